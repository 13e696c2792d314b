"""A worker serving many queues skips the dry ones: claims go where the jobs are, and a
dry queue is looked at again on its NOTIFY (tests/test_wakeups.py) or after a poll
interval."""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from sqla_jobs import Jobs, Worker, current_job

from .helpers import count, running, wait_for

SERVED = 200


def test_claims_go_to_the_queues_with_jobs(
    db: sa.Engine, jobs: Jobs, Session: Any, make_worker: Any
) -> None:
    @jobs.task(queue="busy")
    def step(i: int) -> None:
        pass

    with Session.begin() as session:
        session.enqueue_many(step, [{"i": i} for i in range(300)])
    queues = ["busy"] + [f"idle-{k}" for k in range(SERVED - 1)]
    # Ten jobs per claim: thirty rounds of claims. A poll interval longer than the test
    # keeps the dry queues dry; before they were skipped, every round sent SERVED claims.
    worker = make_worker(jobs, db, queues=queues, claim_limit=10, concurrency=10, poll_interval=60)
    engine = worker.engine
    engine = getattr(engine, "sync_engine", engine)
    claims = 0
    lock = threading.Lock()

    def counted(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        nonlocal claims
        if "SKIP LOCKED" in statement:
            with lock:
                claims += 1

    sa.event.listen(engine, "before_cursor_execute", counted)
    try:
        assert worker.run_until_empty() == 300
    finally:
        sa.event.remove(engine, "before_cursor_execute", counted)
    assert count(db) == 0
    # A first round over every queue, ~30 claims of the busy one, and the final look at
    # every queue before calling it empty: ~430. Every queue every round would be 6,000.
    assert SERVED + 30 <= claims <= 3 * SERVED, claims


def test_a_dry_queue_is_looked_at_again_after_a_poll_interval(
    db: sa.Engine, jobs: Jobs, Session: Any
) -> None:
    ran: list[str] = []

    @jobs.task(queue="a")
    def in_a() -> None:
        ran.append("a")

    @jobs.task(queue="b")
    def in_b() -> None:
        ran.append("b")

    # No LISTEN: nothing but the poll interval can tell the worker that "b" has a job.
    worker = Worker(jobs, db, queues=["a", "b"], listen=False, poll_interval=0.2)
    with running(worker):
        with Session.begin() as session:
            session.enqueue(in_a)
        wait_for(lambda: ran == ["a"])  # both queues were claimed from, "b" came back dry
        with Session.begin() as session:
            session.enqueue(in_b)
        wait_for(lambda: ran == ["a", "b"], timeout=5)


def test_without_listen_every_queue_picks_up_a_new_job_within_the_poll_interval(
    db: sa.Engine, jobs: Jobs, Session: Any, make_worker: Any
) -> None:
    """However many queues (a limited one among them), a job enqueued right after its
    queue's claim came back empty starts within the poll interval. The dry mark used to
    outlast the next wake-up by the few milliseconds of the claims before it, so every
    queue but the first of a round was claimed only every other interval."""
    jobs.queue("lim", concurrency=2)
    started: dict[int, float] = {}
    queues = ["a", "b", "lim", "c"]
    for queue in queues:

        @jobs.task(queue=queue, name=f"mark-{queue}")
        def mark() -> None:
            started[current_job().id] = time.monotonic()

    poll = 0.5
    worker = make_worker(jobs, db, queues=queues, listen=False, poll_interval=poll)
    engine = worker.engine
    engine = getattr(engine, "sync_engine", engine)
    claimed: dict[str, float] = {}
    lock = threading.Lock()

    def seen(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        if isinstance(params, dict) and "queue_name" in params and "UPDATE" in statement:
            with lock:
                claimed[params["queue_name"]] = time.monotonic()

    sa.event.listen(engine, "before_cursor_execute", seen)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        for _ in range(3):
            # Every queue has just been claimed from, empty: then one job for each.
            since = time.monotonic()
            wait_for(lambda: all(claimed.get(q, 0.0) > since for q in queues))  # noqa: B023
            with Session.begin() as session:
                enqueued = [session.enqueue(f"mark-{q}") for q in queues]
                session.flush()
                ids = [job.id for job in enqueued]
            committed = time.monotonic()
            wait_for(lambda: all(i in started for i in ids), timeout=10)  # noqa: B023
            waits = {i: started[i] - committed for i in ids}
            # The poll interval, plus a round of claims and some slack for a loaded
            # machine; every other interval would be up to twice the poll interval.
            assert max(waits.values()) < poll * 1.6, waits
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
        worker.stop()
        thread.join(15)
    assert not thread.is_alive()

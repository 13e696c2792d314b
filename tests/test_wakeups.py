"""Prompt workers: NOTIFY wake-ups, the next due time, and batched completion."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, Worker, current_job
from sqla_jobs._queries import interval

from .helpers import count, rows, running, wait_for


@pytest.fixture
def started(jobs: Jobs) -> dict[int, float]:
    """Handler start times by job id, for a task on queue "mine"."""
    times: dict[int, float] = {}

    @jobs.task(queue="mine", name="mark")
    def mark() -> None:
        times[current_job().id] = time.monotonic()

    return times


@pytest.fixture
def idle_worker(db: sa.Engine, jobs: Jobs) -> Iterator[Worker]:
    # A poll interval far longer than any test: only a NOTIFY or a known due time can
    # wake this worker in time.
    worker = Worker(jobs, db, queues=["mine"], poll_interval=60)
    with running(worker):
        yield worker


def test_notify_wakes_an_idle_worker_long_before_the_poll_interval(
    Session: Any, idle_worker: Worker, started: dict[int, float]
) -> None:
    assert idle_worker.listening.wait(10)
    time.sleep(0.1)  # let it settle into its idle wait
    for _ in range(3):
        with Session.begin() as session:
            job = session.enqueue("mark")
            session.flush()
            job_id = job.id
        committed = time.monotonic()
        wait_for(lambda: job_id in started, timeout=5)  # noqa: B023
        assert started[job_id] - committed < 1.0


def test_a_child_ready_at_once_wakes_an_idle_worker(
    Session: Any, db: sa.Engine, jobs: Jobs, idle_worker: Worker, started: dict[int, float]
) -> None:
    """``after=`` a job that has succeeded already: the child is ready at once, and wakes
    the idle worker as any ready job does (the INSERT trigger saw it held, and the link
    that made it ready said nothing: it waited for the poll interval, a minute here)."""
    from . import app

    with db.begin() as conn:
        parent = conn.execute(
            sa.insert(app.Job)
            .values(
                task="mark",
                queue="other",
                status="done",
                attempts=1,
                finished_at=sa.func.now(),
                locked_until=sa.func.now() + interval(3600),  # its result kept an hour
            )
            .returning(app.Job.id)
        ).scalar_one()
    assert idle_worker.listening.wait(10)
    for via in ("session", "connection"):
        started.clear()
        if via == "session":
            with Session.begin() as session:
                session.enqueue(jobs.tasks["mark"].with_options(after=[parent]))
        else:
            with db.begin() as conn:
                jobs.enqueue(conn, jobs.tasks["mark"].with_options(after=[parent]))
        committed = time.monotonic()
        wait_for(lambda: started, timeout=10)
        assert min(started.values()) - committed < 1.0, via


def test_a_notification_for_another_queue_does_not_wake_the_worker_into_a_claim(
    Session: Any, db: sa.Engine, jobs: Jobs, started: dict[int, float]
) -> None:
    @jobs.task(queue="theirs")
    def theirs() -> None:
        pass

    claims: list[float] = []
    listened: list[float] = []

    def spy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().startswith("WITH next_jobs"):
            claims.append(time.monotonic())
            if idle_worker.listening.is_set():
                listened.append(claims[-1])

    # The spy is in place before the worker starts, so its catch-up claim is seen.
    idle_worker = Worker(jobs, db, queues=["mine"], poll_interval=60)
    sa.event.listen(db, "before_cursor_execute", spy)
    try:
        with running(idle_worker):
            assert idle_worker.listening.wait(10)
            # Once listening, the worker claims to catch up on what it may have missed; on a
            # loaded machine that claim can come late. Wait until it has been made and the
            # worker has been quiet for a while, then count only what the two commits cause.
            wait_for(lambda: listened and time.monotonic() - claims[-1] > 0.5, timeout=15)
            claims.clear()
            with Session.begin() as session:
                session.enqueue(theirs)
            with Session.begin() as session:
                mine = session.enqueue("mark")
                session.flush()
                mine_id = mine.id
            # Notifications arrive in commit order: by the time "mine" has run, the one for
            # "theirs" was seen and ignored. One claim, for the job of "mine".
            wait_for(lambda: mine_id in started, timeout=5)
    finally:
        sa.event.remove(db, "before_cursor_execute", spy)
    assert len(claims) == 1
    assert count(db, queue="theirs", status="ready") == 1


def test_worker_wakes_for_its_next_due_job(
    Session: Any, db: sa.Engine, jobs: Jobs, started: dict[int, float]
) -> None:
    worker = Worker(jobs, db, queues=["mine"], poll_interval=1.0, listen=False)
    with running(worker):
        with Session.begin() as session:
            job = session.enqueue("mark", delay=1.5)
            session.flush()
            job_id = job.id
        (row,) = rows(db)
        wait_for(lambda: job_id in started, timeout=10)
        ran_at = time.time() - (time.monotonic() - started[job_id])
        late = ran_at - row.run_at.timestamp()
        # Due at run_at; picked up at that time, not a poll interval later.
        assert -0.05 < late < 0.5, late
    assert datetime.now(timezone.utc) > row.run_at


def test_batch_completion_leaves_a_stale_row_alone_and_completes_the_others(
    Session: Any, db: sa.Engine, jobs: Jobs, started: dict[int, float]
) -> None:
    with Session.begin() as session:
        session.enqueue_many("mark", [{} for _ in range(3)])
    with db.begin() as conn:
        claimed = conn.execute(
            jobs.queries.claim,
            {"queue_name": "mine", "limit": 3, "lease": interval(30), "worker": "w"},
        ).all()
        stale = claimed[0]
        # Another worker has since taken the stale one (its attempt number moved on).
        conn.execute(sa.update(jobs.table).where(jobs.table.c.id == stale.id).values(attempts=2))
    with db.begin() as conn:
        done = (
            conn.execute(
                jobs.queries.complete,
                {"ids": [r.id for r in claimed], "attempt_list": [r.attempts for r in claimed]},
            )
            .scalars()
            .all()
        )
    assert sorted(done) == sorted(r.id for r in claimed[1:])
    (left,) = rows(db)
    assert (left.id, left.status, left.attempts) == (stale.id, "running", 2)


def test_paused_queue_is_not_claimed_until_resumed(
    Session: Any, db: sa.Engine, jobs: Jobs, started: dict[int, float]
) -> None:
    queues = jobs.queries.queues_table
    with db.begin() as conn:
        conn.execute(sa.insert(queues).values(name="mine", paused=True))
    with Session.begin() as session:
        session.enqueue("mark")
    worker = Worker(jobs, db, queues=["mine"], listen=False)
    assert worker.run_until_empty(timeout=10) == 0
    assert count(db, status="ready") == 1
    with db.begin() as conn:
        conn.execute(sa.update(queues).values(paused=False))
    assert worker.run_until_empty(timeout=10) == 1


def test_resuming_a_queue_wakes_the_idle_workers_into_a_claim(
    Session: Any, db: sa.Engine, jobs: Jobs, started: dict[int, float]
) -> None:
    """``resume_queue`` wakes the idle workers with a NOTIFY, and they read the pause state
    again at once: they woke, found the queue still paused as of their last pass, and
    slept to the next poll interval (a minute here)."""
    from sqla_jobs import admin

    with db.begin() as conn:
        admin.pause_queue(conn, jobs, "mine")
    with Session.begin() as session:
        session.enqueue("mark")
    worker = Worker(jobs, db, queues=["mine"], poll_interval=60)
    with running(worker):
        assert worker.listening.wait(10)
        wait_for(lambda: "mine" in worker.core.maintenance.paused, timeout=10)
        with db.begin() as conn:
            admin.resume_queue(conn, jobs, "mine")
        resumed = time.monotonic()
        wait_for(lambda: started, timeout=10)
    assert min(started.values()) - resumed < 1.0


def test_asyncio_worker_is_woken_by_notify(
    Session: Any, jobs: Jobs, database_url: str, started: dict[int, float]
) -> None:
    import asyncio

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncWorker

    async def main() -> float:
        engine = create_async_engine(database_url)
        worker = AsyncWorker(jobs, engine, queues=["mine"], poll_interval=60)
        runner = asyncio.create_task(worker.run(install_signal_handlers=False))
        try:
            while not getattr(worker, "listening", None) or not worker.listening.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)

            def enqueue() -> tuple[int, float]:
                with Session.begin() as session:
                    job = session.enqueue("mark")
                    session.flush()
                    job_id = job.id
                return job_id, time.monotonic()

            job_id, committed = await asyncio.to_thread(enqueue)
            for _ in range(500):
                if job_id in started:
                    break
                await asyncio.sleep(0.01)
            return started[job_id] - committed
        finally:
            worker.stop()
            await runner
            await engine.dispose()

    assert asyncio.run(main()) < 1.0


def test_a_transaction_notifies_once_per_queue(
    Session: Any, jobs: Jobs, database_url: str, started: dict[int, float]
) -> None:
    import psycopg

    @jobs.task(queue="other")
    def other() -> None:
        pass

    libpq = database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(libpq, autocommit=True) as listener:
        listener.execute(f'LISTEN "{jobs.queries.channel}"')
        with Session.begin() as session:
            for _ in range(3):
                session.enqueue("mark")
                session.flush()  # three INSERT statements...
            session.enqueue_many("mark", [{} for _ in range(100)])  # ...and a bulk one
            session.enqueue(other)
            session.enqueue("mark", delay=60)  # scheduled: nobody to wake for it
        with Session.begin() as session:
            session.enqueue("mark")
        payloads = [n.payload for n in listener.notifies(timeout=0.5)]
    # One per queue for the first transaction, folded by PostgreSQL; one for the second.
    assert sorted(payloads) == ["mine", "mine", "other"]


def test_a_debounce_that_makes_its_job_ready_wakes_an_idle_worker(
    Session: Any, db: sa.Engine, jobs: Jobs, started: dict[int, float]
) -> None:
    """``unique_on_conflict="replace"`` turns a waiting job into a ready one with an
    UPDATE, which the INSERT trigger does not see: the statement notifies by itself, so
    the worker (polling once a minute, its next due time an hour away) starts the job at
    once."""
    debounce = jobs.get("mark").with_options(unique_key="mark:1", unique_on_conflict="replace")
    with Session.begin() as session:
        job = session.enqueue(debounce.with_options(delay=3600))
        session.flush()
        job_id = job.id
    worker = Worker(jobs, db, queues=["mine"], poll_interval=60)
    claims: list[bool] = []  # per claim: whether the LISTEN was held as it began

    def spy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().startswith("WITH next_jobs"):
            claims.append(worker.listening.is_set())

    # Watched from before the worker starts: the claim that follows the LISTEN may come
    # before this thread gets to look (the test failed under load when it looked for a
    # claim later than its own reading of the clock).
    sa.event.listen(db, "before_cursor_execute", spy)
    try:
        with running(worker):
            # Once listening, the worker claims once (for what came before) and then
            # sleeps: after that claim only a wake-up makes it claim again.
            wait_for(lambda: any(claims), timeout=10)
            with Session.begin() as session:
                assert session.enqueue(debounce).id == job_id  # replaced, now ready
            committed = time.monotonic()
            wait_for(lambda: job_id in started, timeout=5)
            assert started[job_id] - committed < 1.0
            wait_for(lambda: count(db) == 0, timeout=5)  # its completion: after its start
    finally:
        sa.event.remove(db, "before_cursor_execute", spy)

"""The worker and the claim/complete/fail paths, on a real PostgreSQL.

The table of tests a Postgres queue must pass (each job exactly once under 8 workers, a
retry after its backoff, the dead state, the attempts guard, the claim index), and the
behaviours around them: leases, unknown tasks, handler signals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    Backoff,
    Jobs,
    PermanentError,
    Snooze,
    Worker,
    WorkerSettings,
    create_engine,
    current_job,
)
from sqla_jobs._queries import interval
from sqla_jobs.worker.job import ClaimedJob, decode_rows

from . import app
from .helpers import count, rows, running, wait_for


def claim(
    engine: sa.Engine,
    jobs: Jobs,
    queue: str,
    *,
    limit: int = 1,
    lease: float = 30,
    worker: str = "test",
) -> list[ClaimedJob]:
    """Claim with the worker's own statement; the claims as the worker reads them."""
    with engine.begin() as conn:
        found = conn.execute(
            jobs.queries.claim,
            {"queue_name": queue, "limit": limit, "lease": interval(lease), "worker": worker},
        ).all()
    claims, unreadable = decode_rows(found, worker)
    assert not unreadable
    return claims


def test_2000_jobs_8_workers_each_job_runs_exactly_once(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, make_worker: Any
) -> None:
    ran: Counter[int] = Counter()
    by_worker: Counter[str] = Counter()
    lock = threading.Lock()

    @jobs.task(queue="q")
    def work(n: int) -> None:
        job = current_job()
        with lock:
            ran[job.id] += 1
            by_worker[job.worker] += 1
        # Long enough that no single worker can take everything, and that the drain (about
        # a second) outlasts the skew of 8 workers starting on a loaded machine: with 1 ms,
        # the drain took a few tenths of a second and a worker that started late got 50.
        time.sleep(0.01)

    with Session.begin() as session:
        session.enqueue_many(work, [{"n": i} for i in range(2000)])

    # Eight workers, each with its own engine (its own connections).
    engines = [create_engine(database_url, pool_size=4) for _ in range(8)]
    workers = [
        make_worker(
            jobs, e, queues=["q"], concurrency=4, claim_limit=10, listen=False, name=f"w{i}"
        )
        for i, e in enumerate(engines)
    ]
    # Each worker's engine connects before the start line, and all cross it together: on a
    # loaded machine, a worker still connecting while the others drain would get a share
    # far below the rest, whatever SKIP LOCKED does.
    for e in engines:
        e.connect().close()
    start_line = threading.Barrier(len(workers))

    def run(worker: Any) -> None:
        start_line.wait(30)
        worker.run_until_empty()

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for e in engines:
        e.dispose()

    assert len(ran) == 2000
    assert set(ran.values()) == {1}, "a job ran more than once"
    assert set(by_worker) == {f"w{i}" for i in range(8)}, "every worker takes a share"
    assert min(by_worker.values()) > 2000 / 8 / 4, by_worker
    assert count(db) == 0  # finished jobs are deleted


def test_every_job_fails_once_then_succeeds_after_backoff(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    attempts: dict[int, list[float]] = {}

    @jobs.task(queue="q", retry=Backoff(base=0.3, jitter=0))
    def flaky() -> None:
        job = current_job()
        attempts.setdefault(job.id, []).append(time.monotonic())
        if job.attempts == 1:
            raise RuntimeError("first try fails")

    with Session.begin() as session:
        session.enqueue_many(flaky, [{} for _ in range(50)])
    worker = make_worker(jobs, db, queues=["q"], concurrency=8, listen=False)
    assert worker.run_until_empty(wait_scheduled=5, timeout=30) == 100
    assert count(db) == 0
    assert len(attempts) == 50
    for first, second in attempts.values():
        assert second - first >= 0.29  # not before the backoff


def test_always_failing_job_is_dead_after_max_attempts_with_its_error(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", max_attempts=2)
    def broken() -> None:
        raise ValueError("the partner API said no")

    with Session.begin() as session:
        session.enqueue(broken)
    worker = make_worker(jobs, db, queues=["q"], listen=False)
    assert worker.run_until_empty(wait_scheduled=5, timeout=30) == 2
    (job,) = rows(db)
    assert job.status == "dead"
    assert job.attempts == 2
    assert job.finished_at is not None
    assert job.locked_until is None
    assert "ValueError: the partner API said no" in job.last_error
    assert "Traceback (most recent call last)" in job.last_error
    assert "in broken" in job.last_error


def test_a_dead_workers_job_is_retaken_after_its_lease_and_its_late_complete_is_ignored(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def task() -> None:
        pass

    with Session.begin() as session:
        session.enqueue(task)
    # Worker A claims the job with a short lease, then "dies" (never completes).
    (a,) = claim(db, jobs, "q", lease=1.0, worker="A")
    assert a.attempts == 1
    # While A's lease is live, nobody else can take it, even after a rescue pass.
    with db.begin() as conn:
        conn.execute(jobs.queries.rescue, {"limit": 100}).all()
    assert claim(db, jobs, "q", worker="B") == []

    # After the lease, the rescuer hands it back and worker B takes it as attempt 2.
    def rescued_and_claimed() -> list[Any]:
        with db.begin() as conn:
            conn.execute(jobs.queries.rescue, {"limit": 100}).all()
        return claim(db, jobs, "q", worker="B")

    (b,) = wait_for(rescued_and_claimed, timeout=5)
    assert (b.id, b.attempts) == (a.id, 2)

    # A comes back late: its complete and its fail change nothing.
    with db.begin() as conn:
        done = conn.execute(jobs.queries.complete, {"ids": [a.id], "attempt_list": [1]}).all()
        failed = conn.execute(
            jobs.queries.fail,
            {
                "job_id": a.id,
                "attempt": 1,
                "error": "late",
                "delay": interval(0),
                "permanent": True,
            },
        ).all()
    assert done == [] and failed == []
    (job,) = rows(db)
    assert (job.status, job.attempts, job.locked_by) == ("running", 2, "B")
    # B's own complete does.
    with db.begin() as conn:
        conn.execute(jobs.queries.complete, {"ids": [b.id], "attempt_list": [2]})
    assert count(db) == 0


def test_rescue_kills_a_job_whose_expired_attempt_was_its_last(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def task() -> None:
        pass

    with Session.begin() as session:
        session.enqueue(task)
    claim(db, jobs, "q", lease=0.05)

    def rescued() -> bool:
        with db.begin() as conn:
            conn.execute(jobs.queries.rescue, {"limit": 100}).all()
        return count(db, status="dead") == 1

    wait_for(rescued, timeout=5)
    (job,) = rows(db)
    assert "lease expired" in job.last_error


def test_claim_uses_the_partial_index_with_50000_waiting_jobs(db: sa.Engine, jobs: Jobs) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {app.SCHEMA}.jobs (task, queue, status, run_at) "
                "SELECT 't', 'q' || (i % 4), CASE WHEN i % 10 = 0 THEN 'dead' ELSE 'ready' END,"
                " now() - interval '1 hour' + i * interval '1 ms' "
                "FROM generate_series(1, 55000) AS i"
            )
        )
        conn.execute(sa.text(f"ANALYZE {app.SCHEMA}.jobs"))
    params = {"queue_name": "q1", "limit": 10, "lease": interval(30), "worker": "w"}
    compiled = jobs.queries.claim.compile(dialect=db.dialect)
    with db.connect() as conn:
        plan = "\n".join(
            r[0]
            for r in conn.exec_driver_sql(f"EXPLAIN {compiled}", compiled.construct_params(params))
        )
    assert "jobs_claim" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert len(claim(db, jobs, "q1", limit=10)) == 10


def test_priority_then_run_at_then_id_order(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q")
    def task(n: int) -> None:
        pass

    with Session.begin() as session:
        for n, prio in enumerate([0, 5, 0, 9, 5]):
            session.enqueue(task, n, priority=prio)
    got = [r.args["n"] for r in claim(db, jobs, "q", limit=5)]
    # RETURNING order is not the claim order; the set and the first pick are what matter.
    assert sorted(got) == [0, 1, 2, 3, 4]
    with db.begin() as conn:
        conn.execute(sa.update(app.Job).values(status="ready", locked_until=None))
    assert [r.args["n"] for r in claim(db, jobs, "q", limit=1)] == [3]
    assert [r.args["n"] for r in claim(db, jobs, "q", limit=1)] == [1]
    assert [r.args["n"] for r in claim(db, jobs, "q", limit=1)] == [4]
    assert [r.args["n"] for r in claim(db, jobs, "q", limit=1)] == [0]


def test_a_task_the_worker_does_not_know_is_left_for_one_that_does(
    db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """Newer code enqueued a task this (older) worker does not know: snoozed, its attempt
    not counted and the reason kept, so that a worker that knows it runs it (counted as a
    failure, older workers spent its attempts: one of max_attempts=1 died unrun). A day
    after its enqueue it fails by the retry policy, to end dead where an operator sees it."""
    # Not the fixture's 50 ms: on a loaded machine the run outlasted it, and took both
    # jobs again (4 runs, not 2). The second run below moves them to now itself.
    jobs.retry = Backoff(base=60, cap=60, jitter=0)
    with db.begin() as conn:
        new, old = conn.execute(
            sa.insert(app.Job).returning(app.Job.id),
            [
                {"task": "new.task", "queue": "q", "max_attempts": 1},
                {"task": "gone.task", "queue": "q", "max_attempts": 2},
            ],
        ).scalars()
        conn.execute(
            sa.update(app.Job)
            .where(app.Job.id == old)
            .values(created_at=sa.func.now() - timedelta(days=1, minutes=1))
        )

    worker = make_worker(jobs, db, queues=["q"], listen=False)
    assert worker.run_until_empty(timeout=30) == 2
    state = {r.id: r for r in rows(db)}
    assert (state[new].status, state[new].attempts, state[new].max_attempts) == ("scheduled", 1, 2)
    assert "unknown task 'new.task'" in state[new].last_error
    assert (state[old].status, state[old].attempts) == ("scheduled", 1)  # retried, counted
    assert state[old].max_attempts == 2

    ran: list[int] = []

    @jobs.task(name="new.task", queue="q")
    def new_task() -> None:
        ran.append(1)

    with db.begin() as conn:
        conn.execute(sa.update(app.Job).values(run_at=sa.func.now()))
    assert make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=30) == 2
    state = {r.id: r for r in rows(db)}
    assert ran == [1] and new not in state  # done (and not kept)
    assert state[old].status == "dead" and state[old].attempts == 2
    assert "unknown task 'gone.task'" in state[old].last_error


def test_handler_exceptions_never_kill_the_worker(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def explode(kind: str) -> None:
        if kind == "system-exit":
            raise SystemExit(3)
        if kind == "keyboard":
            raise KeyboardInterrupt
        raise RuntimeError(kind)

    @jobs.task(queue="q")
    def fine() -> None:
        pass

    with Session.begin() as session:
        for kind in ("system-exit", "keyboard", "runtime"):
            session.enqueue(explode, kind)
        session.enqueue_many(fine, [{} for _ in range(5)])
    worker = make_worker(jobs, db, queues=["q"], concurrency=2, listen=False)
    assert worker.run_until_empty(timeout=30) == 8
    assert count(db, status="dead") == 3
    assert count(db) == 3


def test_snooze_runs_again_later_without_using_an_attempt(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen: list[int] = []

    @jobs.task(queue="q", max_attempts=1)
    def not_yet() -> None:
        seen.append(current_job().attempts)
        if len(seen) < 3:
            raise Snooze(0.05)

    with Session.begin() as session:
        session.enqueue(not_yet)
    worker = make_worker(jobs, db, queues=["q"], listen=False)
    assert worker.run_until_empty(wait_scheduled=5, timeout=30) == 3
    assert seen == [1, 2, 3]  # max_attempts=1, yet it ran three times
    assert count(db) == 0


def test_permanent_error_fails_at_once(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", max_attempts=10)
    def bad_input() -> None:
        raise PermanentError("the address does not exist")

    with Session.begin() as session:
        session.enqueue(bad_input)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(wait_scheduled=5, timeout=30)
    (job,) = rows(db)
    assert (job.status, job.attempts) == ("dead", 1)
    assert "the address does not exist" in job.last_error


def test_delayed_job_is_not_claimed_before_its_time(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    ran: list[float] = []

    @jobs.task(queue="q")
    def later() -> None:
        ran.append(time.monotonic())

    start = time.monotonic()
    with Session.begin() as session:
        session.enqueue(later, delay=0.5)
    worker = make_worker(jobs, db, queues=["q"], listen=False)
    assert worker.run_until_empty(wait_scheduled=5, timeout=30) == 1
    assert ran[0] - start >= 0.45


def test_heartbeat_keeps_a_long_job_from_being_claimed_twice(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    runs: list[int] = []
    release = threading.Event()

    @jobs.task(queue="q")
    def long() -> None:
        runs.append(current_job().attempts)
        release.wait(10)

    with Session.begin() as session:
        session.enqueue(long)
    # A beat every 0.4 s: a loaded two-core CI machine once held one back past a 0.6 s
    # lease (the heartbeat then renews too late, and the rescue takes the job back).
    worker = make_worker(jobs, db, queues=["q"], lease=1.2, listen=False)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        wait_for(lambda: runs, timeout=10)
        # Two lease lengths later, another worker still finds nothing to take.
        deadline = time.monotonic() + 2.4
        while time.monotonic() < deadline:
            with db.begin() as conn:
                conn.execute(jobs.queries.rescue, {"limit": 100}).all()
            assert claim(db, jobs, "q", worker="other") == []
            time.sleep(0.1)
    finally:
        release.set()
        worker.stop()
        thread.join(10)
    assert runs == [1]
    assert count(db) == 0


def test_a_row_another_transaction_holds_does_not_stall_the_heartbeat(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """Another transaction holds one running job's row locked for several leases (a
    worker paused in its rescue pass, an operator's open transaction): the heartbeat
    renews the worker's other leases meanwhile, and keeps the held job as its own. (It
    waited for the row, so every other lease lapsed, and a rescue ran those jobs again
    beside themselves.)"""
    runs: list[tuple[int, int]] = []
    release = threading.Event()

    @jobs.task(queue="q")
    def long(i: int) -> None:
        runs.append((i, current_job().attempts))
        release.wait(20)

    with Session.begin() as session:
        held, other = (session.enqueue(long, i) for i in range(2))
        session.flush()
        held_id, other_id = held.id, other.id
    # (A beat every third of a 1 s lease: a loaded CI machine holds one back for longer
    # than a shorter lease's slack, and the rescue then rightly takes the job back.)
    worker = make_worker(jobs, db, queues=["q"], lease=1.0, listen=False, concurrency=2)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    t = app.Job.__table__
    lease_of = sa.select(t.c.locked_until > sa.func.clock_timestamp()).where(t.c.id == other_id)
    try:
        wait_for(lambda: len(runs) == 2, timeout=10)
        with db.connect() as holder:
            holder.execute(sa.select(t.c.id).where(t.c.id == held_id).with_for_update())
            deadline = time.monotonic() + 3.2  # over three leases
            while time.monotonic() < deadline:
                with db.connect() as conn:
                    assert conn.execute(lease_of).scalar() is True
                time.sleep(0.05)
            holder.rollback()
    finally:
        release.set()
        worker.stop()
        thread.join(10)
    # The other job ran once. (The held row's own lease could not be renewed while it was
    # held past its lease: the rescue may take that one, as it should.)
    assert [attempt for i, attempt in runs if i == 1] == [1]


def test_outcomes_held_up_by_a_locked_row_keep_their_leases(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """Two jobs end in one batch while another transaction holds one's row locked for
    several leases: the completer waits for it, and the other job's lease is renewed
    meanwhile, so it does not run again. (A finished run's lease was not renewed: the
    other job was rescued and run again, five times in three seconds, while its outcome
    waited; and the batch then holding the same job twice failed the completer.)"""
    runs: list[tuple[int, int]] = []
    go = threading.Event()

    @jobs.task(queue="q")
    def work(i: int) -> None:
        runs.append((i, current_job().attempts))
        go.wait(10)

    with Session.begin() as session:
        locked = session.enqueue(work, 0)
        session.enqueue(work, 1)
        session.flush()
        locked_id = locked.id
    worker = make_worker(
        jobs, db, queues=["q"], lease=1.0, listen=False, concurrency=2, poll_interval=0.1
    )
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    t = app.Job.__table__
    try:
        wait_for(lambda: len(runs) == 2, timeout=10)
        with db.connect() as holder:
            holder.execute(sa.select(t.c.id).where(t.c.id == locked_id).with_for_update())
            go.set()
            deadline = time.monotonic() + 3.2  # over three leases
            while time.monotonic() < deadline:
                assert len(runs) == 2, runs
                time.sleep(0.05)
            holder.rollback()
        wait_for(lambda: count(db) == 0, timeout=10)
    finally:
        go.set()
        worker.stop()
        thread.join(10)
    # The other job ran once. (The locked row's own lease could not be renewed while it
    # was held past its lease: once let go, the rescue may take that one first.)
    assert [attempt for i, attempt in runs if i == 1] == [1]


@pytest.mark.parametrize("driver", ["threads", "asyncio"])
def test_stop_hands_back_claimed_jobs_that_never_started(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, driver: str
) -> None:
    @jobs.task(queue="q", max_attempts=3)
    def task() -> None:
        pass

    with Session.begin() as session:
        session.enqueue_many(task, [{} for _ in range(4)])
    notified = listen_for(db, jobs)
    settings = WorkerSettings(queues=("q",), concurrency=2, listen=False, grace_period=0)
    # The core's own claim and shutdown, driven with no handler running: the claimed jobs
    # wait to start, as they would if the stop came between their claim and their start.
    if driver == "threads":
        worker = Worker(jobs, db, settings)
        assert worker._drive(worker.core.fetcher.claim()) == 2
        assert count(db, status="running") == 2
        worker._drive(worker.core.shutdown())
        worker._claim_conn.close()
    else:
        from sqla_jobs import create_async_engine
        from sqla_jobs.aio import AsyncWorker

        async def main() -> None:
            engine = create_async_engine(database_url)
            worker = AsyncWorker(jobs, engine, settings)
            assert await worker._drive(worker.core.fetcher.claim()) == 2
            assert count(db, status="running") == 2
            await worker._drive(worker.core.shutdown())
            await worker._claim_conn.close()
            await engine.dispose()

        asyncio.run(main())
    assert count(db, status="running") == 0
    handed_back = [r for r in rows(db) if r.attempts == 1]
    assert len(handed_back) == 2
    # Ready at once, not after the lease, the claim did not use up an attempt, and idle
    # workers of the queue were woken.
    assert {(r.status, r.max_attempts, r.locked_by) for r in handed_back} == {("ready", 4, None)}
    assert "q" in notified()
    assert len(claim(db, jobs, "q", limit=10)) == 4


def listen_for(engine: sa.Engine, jobs: Jobs) -> Any:
    """Start listening on the jobs channel; return a function that collects payloads."""
    conn = engine.raw_connection()
    # Out of the pool for good: its autocommit and its LISTEN must not reach the next
    # test that checks a connection out (a transaction there committed each statement).
    raw: Any = conn.driver_connection
    conn.detach()
    raw.autocommit = True
    raw.execute(f'LISTEN "{jobs.queries.channel}"')

    def collect() -> set[str]:
        try:
            return {n.payload for n in raw.notifies(timeout=1.0, stop_after=1)}
        finally:
            conn.close()

    return collect


def test_stop_lets_running_jobs_finish(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    # The handlers count their own starts: a row the database shows as running
    # may be claimed ahead and not started yet, and such a claim is handed back
    # at stop, so the row count alone cannot say three jobs are in their handler.
    lock = threading.Lock()
    started: list[int] = []
    release = threading.Event()

    @jobs.task(queue="q")
    def blocker() -> None:
        with lock:
            started.append(1)
        release.wait(10)

    with Session.begin() as session:
        session.enqueue(blocker)
        session.enqueue_many(blocker, [{} for _ in range(5)])
    worker = make_worker(jobs, db, queues=["q"], concurrency=3, listen=False, grace_period=5)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    wait_for(lambda: len(started) == 3)
    wait_for(lambda: count(db, status="running") == 3)
    worker.stop()
    time.sleep(0.05)
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    # The three that started finished; nothing is left running or waiting for a lease.
    assert len(started) == 3
    assert count(db, status="running") == 0
    assert count(db, status="ready") == 3


def test_the_last_outcome_is_written_without_waiting_for_others(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """With nothing else running no other outcome can join the batch: the completer
    writes it at once instead of waiting ``completion_interval`` (a minute here) for more.
    Before, a lone job's row stayed 'running' for the whole wait."""
    ran: list[int] = []

    @jobs.task(queue="q")
    def one(n: int) -> None:
        ran.append(n)

    worker = make_worker(
        jobs, db, queues=["q"], completion_interval=60.0, listen=False, poll_interval=0.05
    )
    with running(worker):
        for n in (1, 2):
            with Session.begin() as session:
                session.enqueue(one, n)
            wait_for(lambda: count(db) == 0, timeout=15)
    assert ran == [1, 2]


def test_worker_survives_losing_its_database_connections(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, make_worker: Any
) -> None:
    @jobs.task(queue="q")
    def task(n: int) -> None:
        pass

    # The application name rides the URL, so that the asyncio worker's engine has it too.
    url = sa.make_url(database_url).update_query_dict({"application_name": "victim"})
    engine = create_engine(url)
    worker = make_worker(jobs, engine, queues=["q"], poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        with Session.begin() as session:
            session.enqueue(task, 1)
        wait_for(lambda: count(db) == 0)
        with db.begin() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'victim' AND datname = current_database()"
                )
            ).scalar()
        assert killed and killed >= 1
        with Session.begin() as session:
            session.enqueue_many(task, [{"n": i} for i in range(10)])
        wait_for(lambda: count(db) == 0, timeout=20)
    finally:
        worker.stop()
        thread.join(10)
        engine.dispose()


def test_worker_rejects_bad_settings(jobs: Jobs, db: sa.Engine) -> None:
    with pytest.raises(ValueError, match="concurrency must be an integer >= 1"):
        Worker(jobs, db, concurrency=0)
    with pytest.raises(TypeError, match="unknown worker setting"):
        Worker(jobs, db, concurrence=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="queue names"):
        Worker(jobs, db, queues=[""])

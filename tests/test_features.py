"""Scheduling features: unique jobs, periodic jobs, cancellation, timeouts, transactional
handlers, retention and events. Time is moved by the tests (rows' timestamps set into the
past), never waited for."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    EnqueueError,
    Jobs,
    JobSession,
    PermanentError,
    Worker,
    create_engine,
    current_job,
)
from sqla_jobs.events import JobEvent
from sqla_jobs.periodic import add_schedule, enqueue_due, remove_schedule, sync_declared
from sqla_jobs.queries import interval
from sqla_jobs.worker import CANCEL_PAYLOAD
from sqla_jobs.worker.db import prune

from . import app
from .helpers import count, rows, running, wait_for

# -- unique jobs ------------------------------------------------------------------------


def test_unique_enqueue_hands_back_the_live_job(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session.begin() as session:
        first = session.enqueue(refresh, 1, unique=True)
        again = session.enqueue(refresh, user_id=1, unique=True)  # same task and args
        other = session.enqueue(refresh, 2, unique=True)
        keyed = session.enqueue(refresh, 3, unique_key="refresh-1")
        keyed_again = session.enqueue(refresh, 4, unique_key="refresh-1")
        assert first is again and first.id is not None
        assert other.id != first.id
        assert keyed is keyed_again and keyed.args == {"user_id": 3}
        assert not session.new  # nothing else was flushed on our behalf
    assert count(db) == 3
    # Once the job is finished, the key is free again.
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=10)
    with Session.begin() as session:
        session.enqueue(refresh, 1, unique=True)
    assert count(db) == 1


def test_unique_enqueue_rolls_back_with_the_transaction(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session() as session:
        session.enqueue(refresh, 1, unique=True)
        session.rollback()
    assert count(db) == 0


def test_eight_connections_enqueueing_one_key_at_once_make_one_job(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    engine = create_engine(database_url, pool_size=8)
    barrier = threading.Barrier(8)
    ids: list[int] = []
    errors: list[BaseException] = []

    def enqueue() -> None:
        try:
            with JobSession(engine, jobs=jobs) as session:
                barrier.wait()
                # The first INSERT wins; the others' ON CONFLICT waits for it to commit.
                job = session.enqueue(refresh, 7, unique=True)
                ids.append(job.id)
                session.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=enqueue) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    engine.dispose()
    assert not errors
    assert count(db) == 1
    assert len(ids) == 8 and len(set(ids)) == 1


def test_enqueue_many_unique_skips_live_duplicates(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session.begin() as session:
        session.enqueue(refresh, 1, unique=True)
    with Session.begin() as session:
        session.enqueue_many(refresh, [{"user_id": i} for i in (1, 2, 2, 3)], unique=True)
    assert sorted(r.args["user_id"] for r in rows(db)) == [1, 2, 3]


def test_async_session_enqueue_unique(database_url: str, db: sa.Engine, jobs: Jobs) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    async def main() -> tuple[int, int]:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            with pytest.raises(EnqueueError, match="enqueue_unique"):
                session.enqueue(refresh, 1, unique=True)
            a = await session.enqueue_unique(refresh, 1)
            b = await session.enqueue_unique(refresh, user_id=1)
            result = (a.id, b.id)
            await session.commit()
        await engine.dispose()
        return result

    a, b = asyncio.run(main())
    assert a == b
    assert count(db) == 1


# -- periodic jobs ----------------------------------------------------------------------


def make_due(db: sa.Engine, jobs: Jobs, name: str, ago: timedelta) -> None:
    """Move a schedule's next tick into the past: the test's clock, not a wait."""
    table = jobs.queries.schedules_table
    with db.begin() as conn:
        conn.execute(
            sa.update(table)
            .where(table.c.name == name)
            .values(next_run_at=sa.func.date_trunc("minute", sa.func.now()) - ago)
        )


def test_periodic_task_is_declared_checked_and_enqueued_once_per_tick(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    with pytest.raises(ValueError, match="invalid cron expression"):
        jobs.periodic("61 * * * *")
    with pytest.raises(ValueError, match="invalid cron expression"):
        jobs.periodic("every minute")

    @jobs.periodic("* * * * *", args={"kind": "minutely"})
    @jobs.task(queue="q")
    def tick(kind: str) -> None:
        pass

    with pytest.raises(EnqueueError, match="missing a required argument"):

        @jobs.periodic("* * * * *", name="bad-args")
        @jobs.task(queue="q", name="needs_args")
        def needs_args(x: int) -> None:
            pass

    with db.begin() as conn:
        sync_declared(conn, jobs)
    (schedule,) = rows(db, jobs.queries.schedules_table)
    assert schedule.next_run_at > datetime.now(timezone.utc)
    make_due(db, jobs, tick.name, timedelta(0))

    # Eight workers' maintenance passes race for the same due tick.
    engines = [create_engine(database_url) for _ in range(8)]
    barrier = threading.Barrier(8)
    made: list[int] = []

    def race(engine: sa.Engine) -> None:
        with engine.begin() as conn:
            barrier.wait()
            made.append(enqueue_due(conn, jobs))

    threads = [threading.Thread(target=race, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for e in engines:
        e.dispose()
    assert sorted(made) == [0] * 7 + [1]
    (job,) = rows(db)
    assert (job.task, job.args, job.queue) == (tick.name, {"kind": "minutely"}, "q")
    assert job.unique_key.startswith(f"periodic:{tick.name}:")


def test_missed_ticks_fire_once_for_the_latest(db: sa.Engine, jobs: Jobs) -> None:
    @jobs.periodic("* * * * *")
    @jobs.task(queue="q")
    def tick() -> None:
        pass

    with db.begin() as conn:
        sync_declared(conn, jobs)
    make_due(db, jobs, tick.name, timedelta(minutes=30))  # no worker for half an hour
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
        assert enqueue_due(conn, jobs) == 0
    (job,) = rows(db)
    (schedule,) = rows(db, jobs.queries.schedules_table)
    now = datetime.now(timezone.utc)
    assert now - timedelta(minutes=1) <= schedule.last_run_at <= now
    assert job.unique_key == f"periodic:{tick.name}:{schedule.last_run_at.isoformat()}"
    assert schedule.next_run_at > now


def test_changing_a_declared_schedule_in_code_is_picked_up(db: sa.Engine) -> None:
    first = Jobs(app.Job)
    second = Jobs(app.Job)
    for registry, cron in ((first, "0 * * * *"), (second, "30 * * * *")):

        @registry.periodic(cron, name="hourly")
        @registry.task(queue="q", name="hourly_task")
        def hourly() -> None:
            pass

    with db.begin() as conn:
        sync_declared(conn, first)
        sync_declared(conn, second)
    (row,) = rows(db, first.queries.schedules_table)
    assert (row.cron, row.next_run_at.minute, row.origin) == ("30 * * * *", 30, "code")
    with db.begin() as conn:
        sync_declared(conn, Jobs(app.Job))  # the code no longer declares it
    assert rows(db, first.queries.schedules_table) == []


def test_runtime_schedules_are_checked_and_picked_up_without_restart(
    db: sa.Engine, jobs: Jobs
) -> None:
    ran: list[int] = []

    @jobs.task(queue="q")
    def report(user_id: int) -> None:
        ran.append(user_id)

    with db.begin() as conn:
        with pytest.raises(ValueError, match="invalid cron"):
            add_schedule(conn, jobs, "r1", report, "0 25 * * *", args={"user_id": 1})
        with pytest.raises(EnqueueError, match="unknown task"):
            add_schedule(conn, jobs, "r1", "no_such_task", "0 8 * * *")
        with pytest.raises(EnqueueError, match="missing a required argument"):
            add_schedule(conn, jobs, "r1", report, "0 8 * * *")
    assert rows(db, jobs.queries.schedules_table) == []

    worker = Worker(jobs, db, queues=["q"], poll_interval=0.05, listen=False)
    with running(worker):
        with db.begin() as conn:
            add_schedule(conn, jobs, "report:42", report, "0 8 * * mon", args={"user_id": 42})
        make_due(db, jobs, "report:42", timedelta(0))
        wait_for(lambda: ran == [42])
        # Changed at run time: a new expression and arguments.
        with db.begin() as conn:
            add_schedule(conn, jobs, "report:42", report, "*/5 * * * *", args={"user_id": 43})
        make_due(db, jobs, "report:42", timedelta(0))
        wait_for(lambda: ran == [42, 43])
        with db.begin() as conn:
            assert remove_schedule(conn, jobs, "report:42")
            assert not remove_schedule(conn, jobs, "report:42")
    assert ran == [42, 43]
    assert rows(db, jobs.queries.schedules_table) == []


# -- cancellation and timeouts ----------------------------------------------------------


def test_a_running_handler_sees_that_it_was_cancelled(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen = threading.Event()
    started = threading.Event()
    events: list[JobEvent] = []
    jobs.events.connect("cancelled", events.append)

    @jobs.task(queue="q")
    def long() -> None:
        started.set()
        job = current_job()
        if job.cancelled.wait(10):
            seen.set()

    with Session.begin() as session:
        session.enqueue(long)
    worker = make_worker(jobs, db, queues=["q"], lease=30)
    with running(worker):
        assert worker.listening.wait(10)
        assert started.wait(10)
        with db.begin() as conn:
            conn.execute(
                sa.update(app.Job).values(
                    status="cancelled", locked_until=None, finished_at=sa.func.now()
                )
            )
            conn.execute(sa.select(sa.func.pg_notify(jobs.queries.channel, CANCEL_PAYLOAD)))
        # Told at once by the NOTIFY, not at the next heartbeat ten seconds away.
        assert seen.wait(3)
    (job,) = rows(db)
    assert job.status == "cancelled"  # its late completion changed nothing
    assert [e.name for e in events] == ["cancelled"]


def test_sync_handler_timeout_fails_the_job_and_tells_the_handler(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    stopped = threading.Event()

    @jobs.task(queue="q", timeout=0.3, max_attempts=1)
    def slow() -> None:
        if current_job().cancelled.wait(10):
            stopped.set()
        time.sleep(0.2)  # ...and it takes a moment to wind down

    with Session.begin() as session:
        session.enqueue(slow)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert stopped.is_set()
    (job,) = rows(db)
    assert job.status == "dead"
    assert "ran longer than its timeout of 0.3s" in job.last_error


def test_async_handler_timeout_cancels_it(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    cancelled = threading.Event()

    @jobs.task(queue="q", timeout=0.2, max_attempts=1)
    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with Session.begin() as session:
        session.enqueue(slow)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert cancelled.is_set()
    (job,) = rows(db)
    assert job.status == "dead"
    assert "TimeoutError" in job.last_error


# -- transactional handlers -------------------------------------------------------------


def test_transactional_handler_commits_with_its_completion(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", transactional=True, max_attempts=2)
    def create_link(code: str, session: Any) -> None:
        session.add(app.Link(code=code, url="u"))
        if code == "boom":
            raise RuntimeError("after the write")

    with pytest.raises(TypeError, match="must take a 'session'"):
        jobs.task(transactional=True, name="x")(lambda code: None)
    with Session.begin() as session:
        session.enqueue(create_link, "ok")
        session.enqueue(create_link, "boom")
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(wait_scheduled=5, timeout=20)
    assert [r.code for r in rows(db, app.Link)] == ["ok"]  # the failing run's write rolled back
    (dead,) = rows(db)
    assert dead.status == "dead" and dead.args == {"code": "boom"}


def test_transactional_handler_whose_lease_was_lost_rolls_back_and_the_second_run_commits(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    first_started = threading.Event()
    release_first = threading.Event()

    @jobs.task(queue="q", transactional=True)
    def create_link(session: Any) -> None:
        attempt = current_job().attempts
        session.add(app.Link(code=f"run-{attempt}", url="u"))
        session.flush()
        if attempt == 1:
            first_started.set()
            release_first.wait(10)

    with Session.begin() as session:
        session.enqueue(create_link)
    a = Worker(jobs, db, queues=["q"], lease=30, listen=False, name="A")
    with running(a):
        assert first_started.wait(10)
        # A stalls past its lease (the test moves the lease into the past); the rescuer
        # hands the job back and worker B runs it as attempt 2, to the end.
        with db.begin() as conn:
            conn.execute(
                sa.update(app.Job).values(locked_until=sa.func.now() - timedelta(seconds=1))
            )
            conn.execute(jobs.queries.rescue, {"limit": 10}).all()
        b_engine = create_engine(database_url)
        b = Worker(jobs, b_engine, queues=["q"], listen=False, name="B")
        assert b.run_until_empty(timeout=20) == 1
        b_engine.dispose()
        release_first.set()  # A wakes up and tries to commit its run
        wait_for(lambda: a.processed == 1)
    assert [r.code for r in rows(db, app.Link)] == ["run-2"]
    assert count(db) == 0


# -- retention --------------------------------------------------------------------------


def test_retention_keeps_then_prunes_in_one_elected_worker(db: sa.Engine) -> None:
    jobs = Jobs(app.Job, keep_done=timedelta(hours=1), keep_dead=timedelta(days=7))

    @jobs.task(queue="q", max_attempts=1)
    def task(fail: bool) -> None:
        if fail:
            raise PermanentError("no")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue_many(task, [{"fail": i % 2 == 0} for i in range(6)])
        session.commit()
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert count(db, status="done") == 3 and count(db, status="dead") == 3
    assert all(r.finished_at is not None for r in rows(db))

    assert prune(db, jobs) == 0  # nothing old enough yet
    t = app.Job.__table__
    with db.begin() as conn:
        old_done = (
            conn.execute(sa.select(t.c.id).where(t.c.status == "done").limit(2)).scalars().all()
        )
        old_dead = (
            conn.execute(sa.select(t.c.id).where(t.c.status == "dead").limit(1)).scalars().all()
        )
        conn.execute(
            sa.update(t)
            .where(t.c.id.in_(old_done))
            .values(finished_at=sa.func.now() - timedelta(hours=2))
        )
        conn.execute(
            sa.update(t)
            .where(t.c.id.in_(old_dead))
            .values(finished_at=sa.func.now() - timedelta(days=8))
        )

    # While another worker holds the pruner lock, this one does nothing.
    with db.connect() as other:
        other.execute(jobs.queries.try_lock)
        assert prune(db, jobs) == 0
        other.rollback()
    assert prune(db, jobs) == 3
    assert count(db, status="done") == 1 and count(db, status="dead") == 2


def test_claim_stays_on_the_index_with_100k_scheduled_and_1k_dead(
    db: sa.Engine, jobs: Jobs
) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {app.SCHEMA}.jobs (task, queue, status, run_at, finished_at) "
                "SELECT 't', 'q', CASE WHEN i <= 1000 THEN 'dead' WHEN i <= 2000 THEN 'ready' "
                "ELSE 'scheduled' END, now() + i * interval '1 s', now() "
                "FROM generate_series(1, 102000) AS i"
            )
        )
        conn.execute(
            sa.text(
                f"UPDATE {app.SCHEMA}.jobs SET run_at = now() - interval '1 s' "
                "WHERE status = 'ready'"
            )
        )
        conn.execute(sa.text(f"ANALYZE {app.SCHEMA}.jobs"))
    compiled = jobs.queries.claim.compile(dialect=db.dialect)
    params = compiled.construct_params(
        {"queue_name": "q", "limit": 10, "lease": interval(30), "worker": "w"}
    )
    with db.connect() as conn:
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {compiled}", params))
    assert "jobs_claim" in plan and "Seq Scan" not in plan, plan


# -- events -----------------------------------------------------------------------------


def test_events_fire_through_a_jobs_life(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen: list[tuple[str, Any]] = []
    for name in ("enqueued", "started", "succeeded", "failed", "retried", "dead"):
        jobs.events.connect(name, lambda e: seen.append((e.name, e.duration)))

    @jobs.events.on("failed")
    def broken_listener(event: JobEvent) -> None:
        raise RuntimeError("a listener bug must not hurt the worker")

    with pytest.raises(ValueError, match="unknown event"):
        jobs.events.connect("finished", print)

    @jobs.task(queue="q", max_attempts=2)
    def flaky(fail: bool) -> None:
        if fail:
            raise RuntimeError("no")

    with Session() as session:
        session.enqueue(flaky, False)
        session.rollback()  # never enqueued: no event
    with Session.begin() as session:
        session.enqueue(flaky, False)
        session.enqueue(flaky, True)
    assert [n for n, _ in seen] == ["enqueued", "enqueued"]
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(wait_scheduled=5, timeout=20)
    names = [n for n, _ in seen]
    assert names.count("started") == 3
    assert names.count("succeeded") == 1
    assert names.count("failed") == 2
    assert names.count("retried") == 1 and names.count("dead") == 1
    assert all(d is not None and d >= 0 for n, d in seen if n in ("succeeded", "failed"))


def test_job_logs_carry_the_job_context(
    Session: Any, db: sa.Engine, jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def broken() -> None:
        raise ValueError("nope")

    with Session.begin() as session:
        session.enqueue(broken)
    with caplog.at_level("INFO", logger="sqla_jobs"):
        Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    (record,) = [r for r in caplog.records if "failed" in r.getMessage()]
    (job,) = rows(db)
    assert record.job_id == job.id  # type: ignore[attr-defined]
    assert (record.task, record.queue, record.attempt) == (broken.name, "q", 1)  # type: ignore[attr-defined]
    assert f"job {job.id} ({broken.name}, queue q, attempt 1/1): failed" in record.getMessage()


def test_enqueued_fires_once_for_a_unique_job(Session: Any, jobs: Jobs) -> None:
    seen: list[int] = []
    jobs.events.connect("enqueued", lambda e: seen.append(e.job.id))

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session.begin() as session:
        session.enqueue(refresh, 1, unique=True)
        session.enqueue(refresh, 1, unique=True)  # the same live job, handed back
    assert len(seen) == 1

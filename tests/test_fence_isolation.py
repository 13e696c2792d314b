"""Transactional runs under snapshot isolation: a serialization failure or a deadlock in
the worker's own statements (the fence's lock, the completion and its children's
release, the COMMIT) runs the job again without counting an attempt; a run that held its
row past its lease keeps its claim until its outcome is written; and the worker's own
heartbeat and outcome writes run at READ COMMITTED whatever the database's default.

Run alone: ``python -m pytest -q -p no:cacheprovider -n0 tests/test_fence_isolation.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from sqla_jobs import Jobs, JobSession, PermanentError, Worker, create_engine, current_job

from . import app
from .conftest import AsyncWorkerInThread
from .helpers import count, running, wait_for


@contextlib.contextmanager
def database_default(db: sa.Engine, value: str) -> Iterator[None]:
    """``default_transaction_isolation`` of this database for the block (new connections)."""
    name = db.url.database
    boss = sa.create_engine(db.url, isolation_level="AUTOCOMMIT")
    with boss.connect() as conn:
        conn.exec_driver_sql(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = '{value}'"
        )
    db.dispose()
    try:
        yield
    finally:
        with boss.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" RESET default_transaction_isolation')
        boss.dispose()
        db.dispose()


def _until_a_lock_wait(db: sa.Engine, seconds: float = 10.0) -> None:
    """Until a backend of this database waits for a lock (at most ``seconds``): polled in
    autocommit, each read of ``pg_stat_activity`` a fresh one."""
    deadline = time.monotonic() + seconds
    with db.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        while time.monotonic() < deadline:
            waiting = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).scalar()
            if waiting:
                return
            time.sleep(0.01)


def _rc(url: str) -> sa.Engine:
    return create_engine(url, isolation_level="READ COMMITTED")


def _links(url: str) -> list[str]:
    eng = _rc(url)
    try:
        with eng.connect() as conn:
            return sorted(conn.execute(sa.select(app.Link.code)).scalars())
    finally:
        eng.dispose()


def _left(url: str) -> list[tuple[str, int]]:
    eng = _rc(url)
    try:
        with eng.connect() as conn:
            t = app.Job.__table__
            return [(r.status, r.attempts) for r in conn.execute(sa.select(t).order_by(t.c.id))]
    finally:
        eng.dispose()


def _runs(url: str) -> list[int]:
    eng = _rc(url)
    try:
        with eng.connect() as conn:
            return list(conn.execute(sa.select(app.Run.attempt).order_by(app.Run.id)).scalars())
    finally:
        eng.dispose()


def _record_run(url: str) -> None:
    """A ``runs`` row for this handler call, committed at once, outside the run."""
    eng = _rc(url)
    try:
        with eng.begin() as conn:
            job = current_job()
            conn.execute(
                sa.insert(app.Run).values(
                    job_id=job.id, attempt=job.attempts, worker="w", pid=0, at=time.time()
                )
            )
    finally:
        eng.dispose()


# -- 1. a fan-in's second parent, its completion meeting the first's ----------------------


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
def test_fan_in_parents_under_snapshot_isolation_run_again_uncounted(
    db: sa.Engine, jobs: Jobs, database_url: str, level: str, flavour: str
) -> None:
    """Two transactional parents of one child run at once; ``a`` completes while ``b``
    runs, and ``b``'s release of the child, in ``b``'s snapshot, meets ``a``'s (a
    serialization failure in the worker's statement). ``b`` wrote nothing and runs again,
    its attempt not counted (``max_attempts=1`` and not dead): each parent's writes are
    committed once, and the child runs."""
    ran: list[str] = []
    b_started = threading.Event()
    b_runs: list[int] = []

    def body(code: str) -> None:
        if code == "a":
            assert b_started.wait(10)
        elif not b_runs:
            b_runs.append(current_job().attempts)
            b_started.set()
            wait_for(lambda: count(db, id=a_id) == 0, timeout=10)  # a committed meanwhile
        else:
            b_runs.append(current_job().attempts)

    if flavour == "threads":

        @jobs.task(queue="fan", transactional=True, max_attempts=1)
        def part(session: Any, code: str) -> None:
            session.add(app.Link(code=f"{code}-{current_job().attempts}", url="u"))
            body(code)

    else:

        @jobs.task(queue="fan", transactional=True, max_attempts=1)
        async def part(session: Any, code: str) -> None:  # type: ignore[misc]
            session.add(app.Link(code=f"{code}-{current_job().attempts}", url="u"))
            await asyncio.to_thread(body, code)

    @jobs.task(queue="fan", max_attempts=1)
    def after() -> None:
        ran.append("after")

    with JobSession(db, jobs=jobs) as session:
        a = session.enqueue(part, code="a")
        b = session.enqueue(part, code="b")
        session.enqueue(after.with_options(after=[a, b]))
        session.commit()
        a_id = a.id
    options: dict[str, Any] = {"queues": ["fan"], "listen": False, "lease": 3, "concurrency": 2}
    worker: Any = (
        Worker(jobs, database_url, **options)
        if flavour == "threads"
        else AsyncWorkerInThread(jobs, database_url, **options)
    )
    with database_default(db, level):
        worker.run_until_empty(wait_scheduled=2, timeout=30)
    assert _left(database_url) == []
    assert ran == ["after"]
    # b's second run is its attempt 2 of 2: the first, which met a's, was not counted.
    assert (_links(database_url), b_runs) == (["a-1", "b-2"], [1, 2])


# -- 2. the lock taken again after the handler's own rollback --------------------------------


@pytest.mark.parametrize("how", ["raised", "wrapped", "swallowed"])
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
def test_a_relock_meeting_a_renewal_runs_the_job_again_uncounted(
    db: sa.Engine, jobs: Jobs, database_url: str, level: str, how: str
) -> None:
    """The handler rolls its transaction back; the heartbeat renews the unlocked row; the
    fence's lock of the next transaction, in a new snapshot, meets that renewal. The
    failure is the worker's statement's, raised in the handler's: whether the handler
    lets it out, wraps it, or swallows it, the run wrote nothing and runs again, its
    attempt not counted. (The heartbeat's commit is held until the fence's lock waits for
    it: held a fixed 0.5 s, a run slowed past that on a loaded machine took its snapshot
    after the renewal had committed, met nothing, and the test failed in CI.)"""
    worker = Worker(jobs, database_url, queues=["rl"], listen=False, lease=1.5, concurrency=1)
    want = threading.Event()
    mid = threading.Event()
    seen: list[str] = []

    def hold_the_beat() -> None:
        if want.is_set() and threading.current_thread().name == "sqla-jobs-heartbeat":
            want.clear()
            mid.set()
            _until_a_lock_wait(db)

    # The heartbeat's renewal, held before its COMMIT: sent as a statement on its own
    # connection (under these levels, BEGIN READ COMMITTED ... COMMIT), or through
    # SQLAlchemy's commit.
    @event.listens_for(worker.engine, "before_cursor_execute")
    def slow_beat(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.strip().upper() == "COMMIT":
            hold_the_beat()

    @event.listens_for(worker.engine, "commit")
    def slow_commit(conn: Any) -> None:
        hold_the_beat()

    @jobs.task(queue="rl", transactional=True, max_attempts=1)
    def create(session: Any) -> None:
        session.add(app.Link(code="dropped", url="u"))
        session.flush()
        session.rollback()
        if current_job().attempts == 1:
            want.set()
            assert mid.wait(10)  # a renewal of this job's row is in flight
        try:
            session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()
        except Exception as exc:
            seen.append(type(exc).__name__)
            if how == "wrapped":
                raise ValueError("the handler's own error") from exc
            if how == "raised":
                raise
            return  # swallowed: the run's transaction is aborted, nothing commits
        session.add(app.Link(code=f"kept-{current_job().attempts}", url="u"))

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create)
        session.commit()
    with database_default(db, level):
        worker.run_until_empty(timeout=20)
    assert seen == ["RunConflict"]
    assert (_left(database_url), _links(database_url)) == ([], ["kept-2"])


# -- 3. a failed run whose lease lapsed while it held its row -------------------------------


@pytest.mark.parametrize("level", ["read committed", "repeatable read"])
def test_a_failed_run_past_its_lease_keeps_its_claim_until_its_outcome_is_written(
    db: sa.Engine, jobs: Jobs, database_url: str, level: str
) -> None:
    """Under REPEATABLE READ the heartbeat passes the locked row by, and a handler that
    outlives its lease leaves ``locked_until`` in the past. It fails for good; once its
    transaction rolled back (the row unlocked), its lease is renewed before its outcome
    is recorded: another worker's rescue, run as the completer sends the failure, finds
    nothing, and the job ends dead after its one run."""
    # Its own rescue only after the test: it could come in the one round trip between the
    # rollback and the renewal (a window keep_lease leaves; a loaded CI machine widened
    # it). The rescue tested is the other worker's, as the completer sends the failure.
    worker = Worker(
        jobs,
        database_url,
        queues=["lap"],
        listen=False,
        lease=1.5,
        concurrency=1,
        rescue_interval=60,
    )
    watcher = _rc(database_url)
    rescued: list[Any] = []

    @event.listens_for(worker.engine, "before_cursor_execute")
    def another_workers_rescue(*args: Any) -> None:
        if threading.current_thread().name == "sqla-jobs-completer" and not rescued:
            with watcher.begin() as conn:
                rescued.append(conn.execute(jobs.queries.rescue, {"limit": 100}).all())

    @jobs.task(queue="lap", transactional=True, max_attempts=3)
    def charge(session: Any) -> None:
        _record_run(database_url)
        session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()
        if current_job().attempts == 1:
            time.sleep(2.0)  # past the 1.5 s lease
        raise PermanentError("card declined")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(charge)
        session.commit()
    try:
        with database_default(db, level), running(worker):
            wait_for(lambda: [s for s, _ in _left(database_url)] == ["dead"], timeout=20)
            time.sleep(0.5)  # a rescued job would be claimed and run again by now
    finally:
        watcher.dispose()
    assert rescued and rescued[0] == []
    assert (_runs(database_url), _left(database_url)) == ([1], [("dead", 1)])


# -- 4. SERIALIZABLE: independent runs beside the worker's own statements -----------------


@pytest.mark.parametrize("how", ["database-default", "engine"])
def test_independent_serializable_runs_are_never_failed_by_the_workers_statements(
    db: sa.Engine, jobs: Jobs, database_url: str, how: str
) -> None:
    """Transactional runs that write nothing in common, beside plain jobs, under
    SERIALIZABLE: SSI fails some of them at the completion or the COMMIT ("canceled on
    identification as a pivot"), a failure of the worker's statements. None counts: with
    ``max_attempts=1`` every job ends done, each run's link committed once."""
    n = 40

    @jobs.task(queue="ind", transactional=True, max_attempts=1)
    def book(session: Any, code: str) -> None:
        session.add(app.Link(code=code, url="u"))
        time.sleep(0.02)

    @jobs.task(queue="ind", max_attempts=1)
    def plain(i: int) -> None:
        time.sleep(0.002)

    with JobSession(db, jobs=jobs) as session:
        for i in range(n):
            session.enqueue(book, code=f"b{i:03d}")
            session.enqueue(plain, i=i)
        session.commit()
    engine = create_engine(database_url, isolation_level="SERIALIZABLE", pool_size=10)
    stack = contextlib.ExitStack()
    if how == "database-default":
        stack.enter_context(database_default(db, "serializable"))
    try:
        with stack:
            bind: Any = engine if how == "engine" else database_url
            worker = Worker(jobs, bind, queues=["ind"], listen=False, lease=3, concurrency=6)
            worker.run_until_empty(timeout=60)
    finally:
        engine.dispose()
    assert _left(database_url) == []
    assert _links(database_url) == [f"b{i:03d}" for i in range(n)]


def test_a_handlers_own_serialization_failure_still_counts(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A serialization failure of the handler's own statement is the handler's: a failed
    attempt, as before (a handler may catch it and raise ``Snooze``)."""
    other = create_engine(database_url, isolation_level="READ COMMITTED")

    @jobs.task(queue="own", transactional=True, max_attempts=1)
    def touch(session: Any) -> None:
        session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()  # snapshot
        with other.begin() as conn:  # a row changed since the handler's snapshot
            conn.execute(sa.update(app.Link.__table__).values(url="changed"))
        session.execute(sa.update(app.Link.__table__).values(url="mine"))

    with JobSession(db, jobs=jobs) as session:
        session.add(app.Link(code="x", url="u"))
        session.enqueue(touch)
        session.commit()
    try:
        with database_default(db, "repeatable read"):
            Worker(jobs, database_url, queues=["own"], listen=False).run_until_empty(timeout=20)
    finally:
        other.dispose()
    assert _left(database_url) == [("dead", 1)]


# -- 5. the worker's own heartbeat and outcome writes ---------------------------------------


@pytest.mark.parametrize("how", ["database-default", "engine"])
def test_heartbeat_and_outcome_writes_run_at_read_committed(
    db: sa.Engine, jobs: Jobs, database_url: str, how: str
) -> None:
    """With REPEATABLE READ the database's default (or the engine's level), the worker's
    plain claim, its heartbeat and its outcome writes still run at READ COMMITTED (as its
    limited claims do): the level of the transaction each statement runs in is read on
    its own connection, by the server."""
    seen: dict[str, set[str]] = {"claim": set(), "heartbeat": set(), "completer": set()}
    release = threading.Event()

    @jobs.task(queue="rc", max_attempts=1)
    def wait() -> None:
        assert release.wait(10)

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(wait)
        session.commit()
    engine = create_engine(database_url, isolation_level="REPEATABLE READ")
    bind: Any = engine if how == "engine" else database_url
    worker = Worker(jobs, bind, queues=["rc"], listen=False, lease=0.6, concurrency=1)

    @event.listens_for(worker.engine, "before_cursor_execute")
    def level(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        name = threading.current_thread().name.removeprefix("sqla-jobs-")
        if conn is worker._claim_conn._conn:
            name = "claim"
        if name in seen and statement.lstrip().startswith(("UPDATE", "DELETE", "WITH")):
            raw = conn.connection.driver_connection
            with raw.cursor() as cur:
                cur.execute("SHOW transaction_isolation")
                seen[name].add(cur.fetchone()[0])

    stack = contextlib.ExitStack()
    if how == "database-default":
        stack.enter_context(database_default(db, "repeatable read"))
    try:
        with stack, running(worker):
            wait_for(lambda: seen["heartbeat"], timeout=10)
            release.set()
            wait_for(lambda: count(db) == 0, timeout=10)
    finally:
        release.set()
        engine.dispose()
    assert seen == {key: {"read committed"} for key in ("claim", "heartbeat", "completer")}


def test_an_outcome_write_waiting_on_a_row_lock_does_not_fail_under_repeatable_read(
    db: sa.Engine, jobs: Jobs, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The completion of a job whose row another transaction holds (an operator's update)
    waits for it, then reads the row as committed: under REPEATABLE READ, the database's
    default, it failed with a serialization error and the batch was written again."""
    other = _rc(database_url)
    hold = threading.Event()
    done = threading.Event()

    @jobs.task(queue="lk", max_attempts=1)
    def quick() -> None:
        hold.set()
        assert done.wait(10)

    with JobSession(db, jobs=jobs) as session:
        job = session.enqueue(quick)
        session.commit()
        job_id = job.id
    t = app.Job.__table__
    worker = Worker(jobs, database_url, queues=["lk"], listen=False, lease=5, concurrency=1)
    # A backend of this database waiting for a row lock (the completer's write).
    waiting = (
        sa.select(sa.func.count())
        .select_from(sa.text("pg_stat_activity"))
        .where(sa.text("wait_event_type = 'Lock' AND datname = current_database()"))
    )

    def completer_waits(look: sa.Connection) -> int:
        # A transaction per look: pg_stat_activity is read once per transaction, and a
        # first look before the write began saw no waiter for the rest of the loop.
        try:
            return int(look.execute(waiting).scalar() or 0)
        finally:
            look.rollback()

    try:
        with database_default(db, "repeatable read"), running(worker):
            assert hold.wait(10)
            with other.begin() as conn:
                conn.execute(sa.update(t).where(t.c.id == job_id).values(priority=t.c.priority))
                done.set()
                with other.connect() as look:  # the completer waits for this transaction
                    wait_for(lambda: completer_waits(look), timeout=10)
            wait_for(lambda: count(db) == 0, timeout=10)
    finally:
        done.set()
        other.dispose()
    assert "could not serialize" not in caplog.text


# -- 6. the maintenance pass --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_a_maintenance_pass_meeting_a_row_changed_since_it_began_does_not_fail(
    db: sa.Engine, jobs: Jobs, database_url: str, kind: str
) -> None:
    """REPEATABLE READ the database's default: a pass began (its rescue, its promotion),
    then a due schedule changed (another worker's pass, an operator) before the pass
    locked it. Under the pass's first snapshot that lock failed with "could not serialize
    access", the whole pass rolled back, and the tick waited for a later pass; at READ
    COMMITTED, as the worker's other statements run, the tick is enqueued."""
    from sqla_jobs.periodic import sync_declared

    @jobs.periodic("* * * * *", name="minutely")
    @jobs.task(queue="mt", name="ticked")
    def ticked() -> None:
        pass

    schedules = jobs.queries.schedules_table
    with db.begin() as conn:
        sync_declared(conn, jobs)
        conn.execute(sa.update(schedules).values(next_run_at=sa.text("now() - interval '1 min'")))
    other = _rc(database_url)
    outcome: list[Any] = []

    def one_pass() -> None:
        try:
            if kind == "threads":
                worker = Worker(jobs, database_url)
                try:
                    outcome.append(worker.run_duty_once("maintenance"))
                finally:
                    worker.engine.dispose()
            else:
                from sqla_jobs.aio import AsyncWorker

                async def main() -> Any:
                    worker = AsyncWorker(jobs, database_url)
                    try:
                        return await worker.run_duty_once("maintenance")
                    finally:
                        await worker.engine.dispose()

                outcome.append(asyncio.run(main()))
        except Exception as exc:
            outcome.append(exc)

    try:
        with database_default(db, "repeatable read"), other.connect() as hold:
            with hold.begin():
                # The pass's lock of the schedule's row waits behind this; its snapshot
                # was taken at its first statement, on the jobs table.
                hold.exec_driver_sql(f"LOCK TABLE {_qualified(schedules)} IN EXCLUSIVE MODE")
                thread = threading.Thread(target=one_pass)
                thread.start()
                _until_a_lock_wait(db)
                hold.execute(sa.update(schedules).values(priority=schedules.c.priority))
            thread.join(20)
    finally:
        other.dispose()
    assert not thread.is_alive() and outcome, "the maintenance pass did not end"
    assert not isinstance(outcome[0], Exception), outcome[0]
    with db.connect() as conn:
        t = app.Job.__table__
        assert conn.execute(sa.select(sa.func.count()).where(t.c.task == "ticked")).scalar() == 1


def _qualified(table: sa.Table) -> str:
    return f'"{table.schema}"."{table.name}"' if table.schema else f'"{table.name}"'


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_the_maintenance_pass_is_one_transaction_on_an_autocommit_engine(
    db: sa.Engine, jobs: Jobs, database_url: str, kind: str
) -> None:
    """A worker given an engine in autocommit (``isolation_level="AUTOCOMMIT"``, an
    application's read engine): its pass's savepoints need a transaction, and each pass
    failed ("SAVEPOINT can only be used in transaction blocks"): no retry was promoted,
    no lease rescued."""

    @jobs.task(queue="ac")
    def later() -> None:
        pass

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(later.with_options(delay=3600))
        session.commit()
    t = app.Job.__table__
    with db.begin() as conn:  # due now: the test's clock, not a wait
        conn.execute(sa.update(t).values(run_at=sa.text("now() - interval '1 min'")))
    if kind == "threads":
        engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
        try:
            Worker(jobs, engine, queues=["ac"]).run_duty_once("maintenance")
        finally:
            engine.dispose()
    else:
        from sqlalchemy.ext.asyncio import create_async_engine

        from sqla_jobs.aio import AsyncWorker

        async def main() -> None:
            url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
            engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
            try:
                await AsyncWorker(jobs, engine, queues=["ac"]).run_duty_once("maintenance")
            finally:
                await engine.dispose()

        asyncio.run(main())
    with db.connect() as conn:
        assert conn.execute(sa.select(t.c.status)).scalars().all() == ["ready"]

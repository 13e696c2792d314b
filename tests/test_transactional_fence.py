"""A transactional run's fence: its handler's writes commit with the job's completion, and
with nothing else, whatever the isolation level and whatever the handler does with its
session (its own commit, its own rollback), on a worker as under ``run_queued_jobs``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, Worker, create_engine, current_job

from . import app
from .conftest import AsyncWorkerInThread
from .helpers import count, rows, running, wait_for


def _links(db: sa.Engine) -> list[str]:
    return sorted(r.code for r in rows(db, app.Link))


@contextlib.contextmanager
def database_default(db: sa.Engine, setting: str, value: str) -> Iterator[None]:
    """``ALTER DATABASE <this one> SET setting = value`` for the block (new connections)."""
    name = db.url.database
    admin = sa.create_engine(db.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"ALTER DATABASE \"{name}\" SET {setting} = '{value}'")
    db.dispose()
    try:
        yield
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" RESET {setting}')
        admin.dispose()
        db.dispose()


def _two_beats_after(worker: Any, since: float) -> None:
    """Wait until the worker's heartbeat has beaten (a whole beat, begun and ended) since
    ``since``: the second beat begins once the first has ended."""
    heartbeat = worker.core.heartbeat
    first = wait_for(lambda: heartbeat.last_beat > since and heartbeat.last_beat, timeout=10)
    wait_for(lambda: heartbeat.last_beat > first, timeout=10)


# -- 1. snapshot isolation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavour", "how"),
    [("threads", "database-default"), ("threads", "engine"), ("asyncio", "database-default")],
)
@pytest.mark.parametrize("level", ["read committed", "repeatable read", "serializable"])
def test_transactional_handler_outliving_a_heartbeat_completes_under_snapshot_isolation(
    db: sa.Engine, jobs: Jobs, database_url: str, level: str, flavour: str, how: str
) -> None:
    """Under REPEATABLE READ or SERIALIZABLE the handler's first read fixed its snapshot,
    the heartbeat then renewed the job's row, and the completion in the handler's
    transaction failed ("could not serialize access due to concurrent update"): a
    handler that outlived one beat never succeeded. READ COMMITTED is the control."""
    ran: list[int] = []
    settings: dict[str, Any] = dict(queues=["rr"], listen=False, lease=1.5, concurrency=1)
    engine = create_engine(database_url, isolation_level=level.upper())
    worker: Any
    if flavour == "threads":
        worker = Worker(jobs, engine if how == "engine" else database_url, **settings)

        @jobs.task(queue="rr", transactional=True, max_attempts=2)
        def pay(session: Any, code: str) -> None:
            session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()
            ran.append(current_job().attempts)
            _two_beats_after(worker, time.monotonic())
            session.add(app.Link(code=f"{code}-{current_job().attempts}", url="u"))

    else:
        worker = AsyncWorkerInThread(jobs, database_url, **settings)

        @jobs.task(queue="rr", transactional=True, max_attempts=2)
        async def pay(session: Any, code: str) -> None:  # type: ignore[misc]
            (await session.execute(sa.select(sa.func.count()).select_from(app.Link))).scalar()
            ran.append(current_job().attempts)
            await asyncio.to_thread(_two_beats_after, worker, time.monotonic())
            session.add(app.Link(code=f"{code}-{current_job().attempts}", url="u"))

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(pay, code="x")
        session.commit()
    try:
        if how == "database-default":
            with database_default(db, "default_transaction_isolation", level):
                worker.run_until_empty(wait_scheduled=3, timeout=20)
        else:
            worker.run_until_empty(wait_scheduled=3, timeout=20)
    finally:
        engine.dispose()
    left = [(r.status, r.attempts, (r.last_error or "").splitlines()[-1:]) for r in rows(db)]
    assert (left, _links(db), ran) == ([], ["x-1"], [1])


def _read(watcher: sa.Engine, statement: Any) -> Any:
    with watcher.connect() as conn:
        return conn.execute(statement).scalar()


def _locked_until(watcher: sa.Engine, job_id: int) -> Any:
    with watcher.connect() as conn:
        return conn.execute(
            sa.select(app.Job.__table__.c.locked_until).where(app.Job.__table__.c.id == job_id)
        ).scalar()


def test_a_locked_run_is_not_rescued_past_its_lease_and_the_other_leases_are_renewed(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """While the run holds its job's row, the heartbeat passes that row by (its lease then
    lapses) and renews the worker's other leases; the rescue passes it by too: the lock,
    held by the run's live connection, keeps the job the run's."""
    watcher = sa.create_engine(database_url, isolation_level="READ COMMITTED")
    expired = sa.func.clock_timestamp() > app.Job.__table__.c.locked_until
    renewed = threading.Event()

    @jobs.task(queue="rr", transactional=True, max_attempts=1)
    def long(session: Any) -> None:
        session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()
        lapsed = sa.select(expired).where(app.Job.__table__.c.id == current_job().id)
        wait_for(lambda: _read(watcher, lapsed), timeout=10)
        with watcher.begin() as conn:
            assert conn.execute(jobs.queries.rescue, {"limit": 100}).all() == []
        assert renewed.wait(10)
        session.add(app.Link(code="long", url="u"))

    @jobs.task(queue="rr", max_attempts=1)
    def short() -> None:
        job_id = current_job().id
        first = _locked_until(watcher, job_id)
        wait_for(lambda: _locked_until(watcher, job_id) > first, timeout=10)
        renewed.set()

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(long)
        session.enqueue(short)
        session.commit()
    worker = Worker(jobs, database_url, queues=["rr"], listen=False, lease=1.5, concurrency=2)
    try:
        with database_default(db, "default_transaction_isolation", "repeatable read"):
            assert worker.run_until_empty(timeout=20) == 2
    finally:
        watcher.dispose()
    assert count(db) == 0
    assert _links(db) == ["long"]


def test_a_handler_that_rolls_back_under_repeatable_read_locks_its_next_transaction_too(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """The handler's own rollback ends the transaction that held the job's row: the next
    one it begins is fenced the same way, so a beat after it does not fail the run."""
    worker = Worker(jobs, database_url, queues=["rb"], listen=False, lease=1.5, concurrency=1)

    @jobs.task(queue="rb", transactional=True)
    def create(session: Any) -> None:
        session.add(app.Link(code="dropped", url="u"))
        session.flush()
        session.rollback()
        session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()
        _two_beats_after(worker, time.monotonic())
        session.add(app.Link(code="kept", url="u"))

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create)
        session.commit()
    with database_default(db, "default_transaction_isolation", "repeatable read"):
        assert worker.run_until_empty(timeout=20) == 1
    assert count(db) == 0
    assert _links(db) == ["kept"]


def test_a_stopped_run_holding_its_row_does_not_hold_up_the_workers_outcomes(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """Under REPEATABLE READ the run holds its job's row locked. A thread past its timeout
    runs on (nothing stops it), and the worker's write of its failure waited on that lock,
    and every outcome of the worker behind it, until the handler returned. The stopped
    run's transaction is ended instead: the failure is written while the thread hangs."""
    release = threading.Event()
    tried: list[str] = []
    worker = Worker(jobs, database_url, queues=["stuck"], listen=False, lease=1.5)

    @jobs.task(queue="stuck", transactional=True, timeout=0.5, max_attempts=1)
    def stuck(session: Any) -> None:
        session.execute(sa.select(sa.func.count()).select_from(app.Link)).scalar()
        release.wait(15)  # deaf to current_job().cancelled
        try:
            session.add(app.Link(code="late", url="u"))
            session.flush()
        except sa.exc.DBAPIError as exc:
            tried.append(type(exc).__name__)
            raise

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(stuck)
        session.commit()
    try:
        with (
            database_default(db, "default_transaction_isolation", "repeatable read"),
            running(worker),
        ):
            wait_for(lambda: [r.status for r in rows(db)] == ["dead"], timeout=10)
            [dead] = rows(db)
            assert "TimeoutError" in (dead.last_error or "")
            release.set()
            wait_for(lambda: tried, timeout=10)
    finally:
        release.set()
    assert _links(db) == []


# -- 2. the handler's own commit -------------------------------------------------------------


@pytest.mark.parametrize("own", ["with-session-begin", "session-commit"])
def test_a_transactional_handlers_writes_are_not_committed_outside_the_fence(
    db: sa.Engine, jobs: Jobs, make_worker: Any, own: str
) -> None:
    """A handler that committed on its own (``with session.begin():``, as SQLAlchemy 2.0
    code is written, or ``session.commit()``) wrote outside the guard: a failing run's
    writes stayed, beside the retry's, and a run whose lease was lost wrote twice. Now the
    session refuses, loudly, and nothing is written."""

    @jobs.task(queue="own", transactional=True, max_attempts=1)
    def create(session: Any) -> None:
        if own == "with-session-begin":
            with session.begin():
                session.add(app.Link(code="run", url="u"))
        else:
            session.add(app.Link(code="run", url="u"))
            session.commit()
        raise RuntimeError("after the write")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create)
        session.commit()
    make_worker(jobs, db, queues=["own"], listen=False).run_until_empty(timeout=20)
    [dead] = rows(db)
    expected = "already begun" if own == "with-session-begin" else "must not commit"
    assert dead.status == "dead" and expected in (dead.last_error or "")
    assert _links(db) == []


@pytest.mark.parametrize("own", ["async-with-session-begin", "await-session-commit"])
def test_an_async_transactional_handlers_writes_are_not_committed_outside_the_fence(
    db: sa.Engine, jobs: Jobs, database_url: str, own: str
) -> None:
    """The same with an ``async def`` handler and its ``AsyncSession``."""

    @jobs.task(queue="own", transactional=True, max_attempts=1)
    async def create(session: Any) -> None:
        if own == "async-with-session-begin":
            async with session.begin():
                session.add(app.Link(code="run", url="u"))
        else:
            session.add(app.Link(code="run", url="u"))
            await session.commit()
        raise RuntimeError("after the write")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create)
        session.commit()
    AsyncWorkerInThread(jobs, database_url, queues=["own"], listen=False).run_until_empty(
        timeout=20
    )
    [dead] = rows(db)
    expected = "already begun" if own == "async-with-session-begin" else "must not commit"
    assert dead.status == "dead" and expected in (dead.last_error or "")
    assert _links(db) == []


def test_a_transactional_handlers_savepoints_are_its_own(
    db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A savepoint stays inside the run's transaction: releasing one is no commit."""

    @jobs.task(queue="sp", transactional=True)
    def create(session: Any) -> None:
        with session.begin_nested():
            session.add(app.Link(code="kept", url="u"))
        with contextlib.suppress(RuntimeError), session.begin_nested():
            session.add(app.Link(code="dropped", url="u"))
            session.flush()
            raise RuntimeError("roll back the savepoint")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create)
        session.commit()
    assert make_worker(jobs, db, queues=["sp"], listen=False).run_until_empty(timeout=20) == 1
    assert count(db) == 0
    assert _links(db) == ["kept"]


# -- 3. run_queued_jobs: the same fence inside the test's transaction -------------------------


def _in_a_test_transaction(db: sa.Engine, jobs: Jobs, task: Any) -> tuple[Any, list[str], str]:
    """Enqueue ``task`` beside a row of the test's, run it with ``run_queued_jobs`` in the
    test's transaction, and say how it went: the summary, the links the test then sees,
    the job's status (or "gone")."""
    from sqla_jobs.testing import run_queued_jobs

    with db.connect() as conn:
        trans = conn.begin()
        session = JobSession(bind=conn, join_transaction_mode="create_savepoint", jobs=jobs)
        try:
            session.add(app.Link(code="setup", url="u"))
            session.enqueue(task)
            summary = run_queued_jobs(session, jobs)
            codes = sorted(session.scalars(sa.select(app.Link.code)))
            status = session.scalar(sa.select(app.Job.status)) or "gone"
        finally:
            session.close()
            trans.rollback()
    return summary, codes, status


def test_run_queued_jobs_a_handler_that_rolls_back_itself_keeps_the_tests_rows(
    db: sa.Engine, jobs: Jobs
) -> None:
    """On a worker a handler's own ``session.rollback()`` drops its own writes, and what
    follows commits with the job. Under ``run_queued_jobs`` it got the test's session, and
    rolled back the whole test (its rows, the job being run); the run then failed on a
    closed transaction, and the summary said "retried" of a job that no longer existed."""

    @jobs.task(queue="t", transactional=True)
    def create(session: Any) -> None:
        session.add(app.Link(code="dropped", url="u"))
        session.flush()
        session.rollback()
        session.add(app.Link(code="kept", url="u"))

    summary, codes, status = _in_a_test_transaction(db, jobs, create)
    assert (summary.succeeded, codes, status) == (1, ["kept", "setup"], "gone"), str(summary)
    assert _links(db) == []


def test_run_queued_jobs_refuses_a_handlers_own_commit_as_a_worker_does(
    db: sa.Engine, jobs: Jobs
) -> None:
    """The fence is the worker's: a handler's own commit fails its job there, and here."""

    @jobs.task(queue="t", transactional=True, max_attempts=1)
    def create(session: Any) -> None:
        session.add(app.Link(code="run", url="u"))
        session.commit()

    summary, codes, status = _in_a_test_transaction(db, jobs, create)
    assert (summary.dead, codes, status) == (1, ["setup"], "dead"), str(summary)
    assert "must not commit" in str(summary.runs[0].error)


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_a_transactional_run_is_one_transaction_on_an_autocommit_engine(
    db: sa.Engine, jobs: Jobs, database_url: str, kind: str
) -> None:
    """A worker given an engine in autocommit (``isolation_level="AUTOCOMMIT"``): each of a
    transactional run's statements committed by itself, so a handler that failed after
    its write left the write committed beside its dead job (and the fence's lock ended
    with its statement). The run's session now has a transaction, at the server's
    default level: the failed run wrote nothing, the good one wrote with its completion."""
    from sqla_jobs import PermanentError

    @jobs.task(queue="ac", transactional=True, max_attempts=1)
    def write(session: Any, code: str, fail: bool) -> None:
        session.add(app.Link(code=code, url="u"))
        session.flush()
        if fail:
            raise PermanentError("fails after its write")

    @jobs.task(queue="ac", transactional=True, max_attempts=1, name="write_async")
    async def write_async(session: Any, code: str, fail: bool) -> None:
        session.add(app.Link(code=code, url="u"))
        await session.flush()
        if fail:
            raise PermanentError("fails after its write")

    task = write if kind == "threads" else write_async
    with JobSession(db, jobs=jobs) as session:
        session.enqueue(task, code="bad", fail=True)
        session.enqueue(task, code="good", fail=False)
        session.commit()
    if kind == "threads":
        engine = create_engine(database_url, isolation_level="AUTOCOMMIT")
        try:
            assert (
                Worker(jobs, engine, queues=["ac"], listen=False).run_until_empty(timeout=20) == 2
            )
        finally:
            engine.dispose()
    else:
        from sqlalchemy.ext.asyncio import create_async_engine

        from sqla_jobs.aio import AsyncWorker

        async def main() -> int:
            url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
            engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
            try:
                worker = AsyncWorker(jobs, engine, queues=["ac"], listen=False)
                return await worker.run_until_empty(timeout=20)
            finally:
                await engine.dispose()

        assert asyncio.run(main()) == 2
    assert _links(db) == ["good"]
    assert sorted(r.status for r in rows(db)) == ["dead"]  # the good one is done, deleted


def test_a_transactional_run_on_an_engine_kept_in_autocommit_is_refused_with_why(
    db: sa.Engine, jobs: Jobs
) -> None:
    """``engine.execution_options(isolation_level="AUTOCOMMIT")`` keeps its level over
    any the worker sets on top of it: such a run cannot have its transaction, so it is
    refused with an error that says so, and its handler is not called."""
    called: list[str] = []

    @jobs.task(queue="ac", transactional=True, max_attempts=1)
    def write(session: Any) -> None:
        called.append("called")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(write)
        session.commit()
    engine = db.execution_options(isolation_level="AUTOCOMMIT")
    Worker(jobs, engine, queues=["ac"], listen=False).run_until_empty(timeout=20)
    assert called == []
    (job,) = rows(db)
    assert job.status == "dead"
    assert "the worker's engine is in autocommit" in job.last_error

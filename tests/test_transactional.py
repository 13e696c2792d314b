"""Transactional handlers: their writes commit with the job's completion, exactly once.
Time is moved by the tests (rows' timestamps set into the past), never waited for."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from sqla_jobs import (
    EnqueueMixin,
    Jobs,
    JobSession,
    Worker,
    create_engine,
    current_job,
)
from sqla_jobs.session import AsyncJobSession
from sqla_jobs.worker._driver import pool_options

from . import app
from .conftest import AsyncWorkerInThread
from .helpers import count, rows, running, wait_for


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
    # One slot, held by the stalled run: A cannot claim the job again itself (with free
    # slots, A's next poll raced B's start on a slow machine, and B found nothing).
    a = Worker(jobs, db, queues=["q"], lease=30, listen=False, name="A", concurrency=1)
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


# -- the application's own session (Jobs(session_factory=...)) ------------------------------


def app_session_class() -> type[Session]:
    """The app's session class (a fresh one per test: its listeners stay on it)."""

    class AppSession(EnqueueMixin, Session):
        pass

    return AppSession


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_transactional_handlers_run_in_the_apps_own_session(
    db: sa.Engine, jobs: Jobs, database_url: str, flavour: str
) -> None:
    AppSession = app_session_class()
    flushed: list[Session] = []
    sa.event.listen(AppSession, "before_flush", lambda session, *_: flushed.append(session))
    if flavour == "threads":
        jobs.session_factory = sessionmaker(class_=AppSession, jobs=jobs, info={"app": "shop"})
    else:
        jobs.session_factory = async_sessionmaker(
            class_=AsyncJobSession, sync_session_class=AppSession, jobs=jobs, info={"app": "shop"}
        )
    seen: list[tuple[bool, Any]] = []

    @jobs.task(queue="q")
    def follow_up(code: str) -> None: ...

    @jobs.task(queue="q", transactional=True)
    def create_link(session: Any, code: str) -> None:
        seen.append((isinstance(session, AppSession), session.info.get("app")))
        session.add(app.Link(code=code, url="u"))
        session.enqueue(follow_up.with_options(queue="later"), code=code)  # the app's enqueue

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create_link, code="x7")
        session.commit()
    if flavour == "threads":
        Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    else:
        AsyncWorkerInThread(jobs, database_url, queues=["q"], listen=False).run_until_empty(
            timeout=20
        )
    assert seen == [(True, "shop")]
    assert [s for s in flushed if isinstance(s, AppSession)], "the app's events did not run"
    assert [r.code for r in rows(db, app.Link)] == ["x7"]
    # The follow-up committed with the completion; the job itself is done (deleted).
    [(task, queue, args)] = [(r.task, r.queue, r.args) for r in rows(db)]
    assert (task, queue, args) == (follow_up.name, "later", {"code": "x7"})


def test_the_claim_guard_fences_the_apps_session(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A run whose lease was lost writes nothing through the app's session either: not its
    rows, not the jobs it enqueued there."""
    jobs.session_factory = sessionmaker(class_=app_session_class(), jobs=jobs)
    first_started, release_first = threading.Event(), threading.Event()

    @jobs.task(queue="later")
    def follow_up(attempt: int) -> None: ...

    @jobs.task(queue="q", transactional=True)
    def create_link(session: Any) -> None:
        attempt = current_job().attempts
        session.add(app.Link(code=f"run-{attempt}", url="u"))
        session.enqueue(follow_up, attempt=attempt)
        session.flush()
        if attempt == 1:
            first_started.set()
            release_first.wait(10)

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create_link)
        session.commit()
    # One slot, held by the stalled run, so that B is the one to take the job again.
    a = Worker(jobs, db, queues=["q"], lease=30, listen=False, name="A", concurrency=1)
    with running(a):
        assert first_started.wait(10)
        with db.begin() as conn:  # A stalls past its lease; B takes the job as attempt 2
            conn.execute(
                sa.update(app.Job)
                .where(app.Job.queue == "q")
                .values(locked_until=sa.func.now() - timedelta(seconds=1))
            )
            conn.execute(jobs.queries.rescue, {"limit": 10}).all()
        b_engine = create_engine(database_url)
        try:
            assert (
                Worker(jobs, b_engine, queues=["q"], listen=False, name="B").run_until_empty(
                    timeout=20
                )
                == 1
            )
        finally:
            b_engine.dispose()
        release_first.set()
        wait_for(lambda: a.processed == 1)
    assert [r.code for r in rows(db, app.Link)] == ["run-2"]
    assert [(r.task, r.args) for r in rows(db)] == [(follow_up.name, {"attempt": 2})]


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda jobs: lambda bind: AsyncSession(), "made a AsyncSession, and this worker runs"),
        (lambda jobs: lambda bind: _begun(Session(bind)), "already in a transaction"),
    ],
    ids=["wrong-kind", "in-a-transaction"],
)
def test_a_session_factory_that_misfits_fails_the_run_with_a_clear_error(
    db: sa.Engine, jobs: Jobs, factory: Any, message: str
) -> None:
    jobs.session_factory = factory(jobs)
    ran: list[bool] = []

    @jobs.task(queue="q", transactional=True, max_attempts=1)
    def create_link(session: Any) -> None:
        ran.append(True)

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(create_link)
        session.commit()
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert ran == []
    (job,) = rows(db)
    assert job.status == "dead" and "Jobs(session_factory=...)" in job.last_error
    assert message in job.last_error, job.last_error


def _begun(session: Session) -> Session:
    session.begin()
    return session


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_handlers_that_hold_connections_leave_the_worker_its_own(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, kind: str, caplog: Any
) -> None:
    """Transactional handlers beyond what the engine's pool holds wait for a connection
    instead of taking the ones the worker's heartbeat needs: no lease lapses while they
    run, and the worker says so at start. (Before, six handlers on a pool of five held
    every free connection, the heartbeat waited on the pool, and every lease lapsed:
    another worker's rescue would have run the jobs again.)"""
    release = threading.Event()
    lock = threading.Lock()
    holding: list[int] = []
    most = [0]

    def started(i: int) -> None:
        with lock:
            holding.append(i)
            most[0] = max(most[0], len(holding))

    def ended(i: int) -> None:
        with lock:
            holding.remove(i)

    if kind == "threads":

        @jobs.task(queue="q", transactional=True)
        def hold(i: int, session: Any) -> None:
            session.execute(sa.text("SELECT 1"))
            started(i)
            release.wait(30)
            ended(i)

        # Six connections in all: the worker keeps four, two are the handlers'.
        engine: Any = create_engine(database_url, pool_size=5, max_overflow=1)
        worker: Any = Worker(jobs, engine, queues=["q"], concurrency=6, lease=1.0, listen=False)
    else:
        import asyncio

        from sqlalchemy.ext.asyncio import create_async_engine

        from sqla_jobs.aio import AsyncWorker

        @jobs.task(queue="q", transactional=True)
        async def hold(i: int, session: Any) -> None:
            await session.execute(sa.text("SELECT 1"))
            started(i)
            while not release.is_set():
                await asyncio.sleep(0.01)
            ended(i)

        engine = create_async_engine(database_url, pool_size=5, max_overflow=1)
        worker = AsyncWorker(jobs, engine, queues=["q"], concurrency=6, lease=1.0, listen=False)

    assert worker.handler_connections == 2
    assert "at most 2 transactional or durable handlers run at once" in caplog.text
    with Session.begin() as session:
        for i in range(6):
            session.enqueue(hold, i)

    def run() -> None:
        if kind == "threads":
            worker.run(install_signal_handlers=False)
        else:
            import asyncio

            async def main() -> None:
                try:
                    await worker.run(install_signal_handlers=False)
                finally:
                    await engine.dispose()

            asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(holding) >= 2, timeout=20)
        lapsed = sa.text(
            f'SELECT count(*) FROM "{app.SCHEMA}".jobs '
            "WHERE status = 'running' AND locked_until < clock_timestamp()"
        )
        # Three leases' worth of time: the heartbeat must renew them all the while.
        deadline = threading.Event()
        threading.Timer(3.0, deadline.set).start()
        while not deadline.is_set():
            with db.connect() as conn:
                assert conn.execute(lapsed).scalar() == 0
            deadline.wait(0.1)
        # The four waiting jobs are claimed too, their leases kept.
        assert count(db, status="running") == 6
        release.set()
        wait_for(lambda: count(db) == 0, timeout=30)  # all done (and deleted, as done jobs are)
        assert most[0] == 2
    finally:
        release.set()
        worker.stop()
        thread.join(30)
        if kind == "threads":
            engine.dispose()


def test_a_worker_makes_its_own_pool_large_enough_for_every_handler() -> None:
    from sqla_jobs.worker._driver import MIN_CONNECTIONS, handler_connections

    for concurrency in (1, 10, 40, 64, 500):
        engine = create_engine(
            "postgresql+psycopg://nobody@127.0.0.1:1/none", **pool_options(concurrency)
        )
        assert handler_connections(engine, concurrency) is None
        pool: Any = engine.pool
        assert pool.size() <= 36  # kept open when idle
        assert pool.size() + pool._max_overflow >= concurrency + MIN_CONNECTIONS
        engine.dispose()


def test_an_async_transactional_handler_on_the_threaded_worker_fails_saying_where_it_runs(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """Its session would be a plain ``Session``, which it cannot await: it fails, naming
    the asyncio worker. (Called, it returned a coroutine nobody ran, and the job counted
    as done, its body never run.)"""
    ran: list[int] = []

    @jobs.task(queue="q", transactional=True, max_attempts=1)
    async def write(session: Any) -> None:
        ran.append(1)

    with Session.begin() as session:
        session.enqueue(write)
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    [dead] = rows(db)
    assert dead.status == "dead" and not ran
    assert "runs on the asyncio worker" in (dead.last_error or "")

"""``jobs.result`` where notifications cannot arrive (``listen=False``, or behind a pooler in
transaction mode): it polls the row at a short, growing interval, holds no connection
between looks, and leaves no LISTEN behind. Behind a real PgBouncer:
tests/faults/test_pgbouncer.py."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from sqla_jobs import Jobs, JobSession, Worker, create_async_engine, create_engine, flow

from .helpers import running


@pytest.fixture
def Session(db: sa.Engine, jobs: Jobs) -> Any:
    return sa.orm.sessionmaker(db, class_=JobSession, jobs=jobs, expire_on_commit=False)


#: The listeners :func:`looks` put on engines, removed after each test: left on the
#: session's shared engine, one turned psycopg's pipelining off for every later test of
#: the same xdist worker (a listener before each cursor execute does).
_noted: list[tuple[sa.Engine, Any]] = []


@pytest.fixture(autouse=True)
def _forget_looks() -> Iterator[None]:
    yield
    while _noted:
        engine, note = _noted.pop()
        event.remove(engine, "before_cursor_execute", note)


def looks(engine: sa.Engine, jobs: Jobs) -> list[float]:
    """When each look at a job's row (the ``outcome`` statement) is sent on ``engine``,
    until the test ends."""
    seen: list[float] = []
    outcome = str(jobs.queries.outcome.compile(dialect=engine.dialect))

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement == outcome:
            seen.append(time.monotonic())

    event.listen(engine, "before_cursor_execute", note)
    _noted.append((engine, note))
    return seen


def listening_channels(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.exec_driver_sql("SELECT pg_listening_channels()").scalars())


def test_a_wait_without_notifications_polls_at_a_growing_interval(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def never() -> None: ...

    with Session.begin() as session:
        job = session.enqueue(never)
    seen = looks(db, jobs)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"job {job.id} did not finish within 1s"):
        jobs.result(db, job.id, timeout=1.0, listen=False)
    assert 1.0 <= time.monotonic() - started < 2.0
    # 20 ms, then 1.5 times as long each time: about ten looks in a second, not fifty
    # (a fixed short interval) nor two (a fixed long one); the last one at the deadline.
    assert 6 <= len(seen) <= 12, [round(t - started, 3) for t in seen]
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    assert gaps[0] < 0.1
    assert max(gaps) <= flow._POLL_MAX + 0.25
    assert seen[-1] - started >= 0.95
    assert listening_channels(db) == []


def test_a_polled_result_comes_soon_after_the_job_ends_and_holds_no_connection(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    gate = threading.Event()

    @jobs.task(queue="q", keep_result=timedelta(minutes=5))
    def slow() -> str:
        gate.wait(20)
        return "late"

    with Session.begin() as session:
        job = session.enqueue(slow)
    # The waiter's engine has one connection: were it held through the wait, the
    # checkout below would time out.
    one = create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=2)
    seen = looks(one, jobs)
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(jobs.result(one, job.id, timeout=30, listen=False))
    )
    try:
        with running(Worker(jobs, db, queues=["q"])):
            waiter.start()
            # Waiting until the looks are 0.5 s apart (the longest pause).
            deadline = time.monotonic() + 20
            while not (len(seen) > 2 and seen[-1] - seen[-2] >= flow._POLL_MAX - 0.01):
                assert time.monotonic() < deadline, seen
                time.sleep(0.05)
            with one.connect() as conn:  # the pool's only connection is free
                assert conn.exec_driver_sql("SELECT 1").scalar() == 1
            assert listening_channels(one) == []
            assert not got
            ended = time.monotonic()
            gate.set()
            waiter.join(15)
            assert got == ["late"]
            assert time.monotonic() - ended < 1.5  # the longest pause, and the job's end
    finally:
        gate.set()
        waiter.join(15)
        one.dispose()


def test_the_async_wait_polls_too(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def answer() -> int:
        return 42

    with Session.begin() as session:
        job = session.enqueue(answer)
        never = session.enqueue(answer.with_options(queue="nobody"))
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty()

    async def main() -> tuple[Any, float, list[float]]:
        engine = create_async_engine(database_url)
        seen = looks(engine.sync_engine, jobs)
        try:
            value = await jobs.result_async(engine, job.id, timeout=5, listen=False)
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await jobs.result_async(engine, never.id, timeout=0.5, listen=False)
            return value, time.monotonic() - started, seen
        finally:
            await engine.dispose()

    value, waited, seen = asyncio.run(main())
    assert value == 42
    assert 0.5 <= waited < 1.5
    assert 1 + 4 <= len(seen) <= 1 + 10  # the first wait's look, then the second's


def test_the_async_listening_wait_ends_at_its_timeout(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """``result_async`` listening for a job that does not finish raises ``TimeoutError``
    at its timeout, having looked at the row a few times. It took its own deadline for
    the end of a wait for a notification (on Python 3.11, asyncio's TimeoutError is the
    builtin) and looked again at once, for ever: thousands of queries a second."""

    @jobs.task(queue="nobody", keep_result=True)
    def never() -> int:
        return 0

    with Session.begin() as session:
        job = session.enqueue(never)

    async def main() -> tuple[float, list[float]]:
        engine = create_async_engine(database_url)
        seen = looks(engine.sync_engine, jobs)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(jobs.result_async(engine, job.id, timeout=0.5), 10)
            return time.monotonic() - started, seen
        finally:
            await engine.dispose()

    waited, seen = asyncio.run(main())
    assert 0.5 <= waited < 1.5
    assert len(seen) <= 3


def test_the_wait_listens_on_a_direct_connection_and_says_so_once_per_engine(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def answer() -> int:
        return 42

    with Session.begin() as session:
        job = session.enqueue(answer)
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty()
    engine = create_engine(database_url)
    pids: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "pg_backend_pid" in statement:
            pids.append(statement)

    try:
        assert jobs.result(engine, job.id, timeout=5) == 42
        assert jobs.result(engine, job.id, timeout=5) == 42
        assert flow._DIRECT[engine] is True
        assert len(pids) == 1  # found out once
    finally:
        engine.dispose()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_listening_wait_whose_connection_is_ended_goes_on_on_a_new_one(
    db: sa.Engine, jobs: Jobs, Session: Any, database_url: str, kind: str
) -> None:
    """The waiter's listening connection is ended while the job waits to run (a
    terminated backend, an ``idle_session_timeout``, a failover): the wait listens again
    on a new connection and returns the committed value, within its timeout. (It raised
    psycopg's own ``OperationalError``, while the job went on to succeed.)"""
    from .helpers import terminate_backend, wait_for

    @jobs.task(queue="r", keep_result=True)
    def compute(x: int) -> int:
        return x * 2

    with Session() as session:
        job = session.enqueue(compute, x=21)
        session.commit()
    got: list[Any] = []

    # The waiter's connections go by a name of their own: told apart by their last
    # statement alone, an idle pooled connection of the test's engine that had read a
    # job's last_error was taken for the waiter's and ended instead.
    waiter_url = sa.make_url(database_url).update_query_dict({"application_name": "waiter"})

    def wait() -> None:
        try:
            if kind == "sync":
                engine = create_engine(waiter_url)
                try:
                    got.append(jobs.result(engine, job.id, timeout=20))
                finally:
                    engine.dispose()
                return

            async def main() -> Any:
                engine = create_async_engine(waiter_url)
                try:
                    return await jobs.result_async(engine, job.id, timeout=20)
                finally:
                    await engine.dispose()

            got.append(asyncio.run(main()))
        except BaseException as exc:  # reported by the assertion below
            got.append(exc)

    def listening() -> int | None:
        with db.connect() as conn:
            return conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'waiter' "
                    "AND datname = current_database() AND state = 'idle' "
                    "AND (query LIKE 'LISTEN%' OR query LIKE '%last_error%')"
                )
            ).scalar()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    terminate_backend(db, wait_for(listening, timeout=10))
    Worker(jobs, db, queues=["r"], listen=False).run_until_empty(timeout=20)
    waiter.join(25)
    assert got == [42]

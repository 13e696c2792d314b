"""Jobs enqueued inside a SAVEPOINT (``session.begin_nested()``) share its fate.

Every scenario builds the same shape: the outer transaction enqueues job 0, then savepoint
level n (1 to ``depth``) enqueues job n, optionally flushing. With ``links``, each level
also adds a link ``l<n>`` first, so the session has something of its own to flush when the
next savepoint begins; without, the session holds nothing but jobs (``enqueue_many`` rows
leave it "clean", and SQLAlchemy's flush at ``begin_nested()`` does nothing). One level (or
none) rolls back, the others are released, and the outer transaction commits. What must be
committed is exactly the links and jobs of the levels above the one that rolled back, and
``enqueued`` must fire for those jobs only, once the outer transaction has committed (never
at a savepoint's release).
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs, JobSession
from sqla_jobs.session import insert_pending, pending_jobs

from . import app
from .helpers import count, rows

KINDS = ("enqueue_many", "enqueue", "unique")
# (depth, the level that rolls back, or None: every savepoint is released)
SHAPES = [(d, r) for d in (1, 2, 3) for r in (None, *range(1, d + 1))]


class Rollback(Exception):
    """Raised inside the ``with`` block of the level that must roll back."""


@pytest.fixture
def numbered(jobs: Jobs) -> Any:
    @jobs.task(queue="sp")
    def numbered(n: int) -> None:
        pass

    return numbered


def _shape_id(shape: tuple[int, int | None]) -> str:
    depth, rollback = shape
    return f"depth{depth}-" + ("release" if rollback is None else f"rollback{rollback}")


def _survivors(depth: int, rollback_at: int | None) -> list[int]:
    last = depth if rollback_at is None else rollback_at - 1
    return list(range(last + 1))


def _number(event: Any) -> int:
    job = event.job
    args = job["args"] if isinstance(job, dict) else job.args
    return int(args["n"])


def _enqueue(session: Any, task: Any, kind: str, n: int) -> None:
    if kind == "enqueue_many":
        session.enqueue_many(task, [{"n": n}])
    elif kind == "enqueue":
        session.enqueue(task, n=n)
    else:
        session.enqueue(task, n=n, unique=True)


def _committed(db: sa.Engine) -> tuple[list[int], list[str]]:
    return sorted(r.args["n"] for r in rows(db)), sorted(r.code for r in rows(db, app.Link))


def _expected(survivors: list[int], links: bool) -> tuple[list[int], list[str]]:
    return survivors, [f"l{n}" for n in survivors] if links else []


@pytest.mark.parametrize("links", [True, False], ids=["links", "jobs-only"])
@pytest.mark.parametrize("flush", [False, True], ids=["no-flush", "flush"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_jobs_share_their_savepoints_fate(
    Session: Any,
    db: sa.Engine,
    jobs: Jobs,
    numbered: Any,
    shape: tuple[int, int | None],
    kind: str,
    flush: bool,
    links: bool,
) -> None:
    depth, rollback_at = shape
    fired: list[int] = []
    jobs.events.connect("enqueued", lambda e: fired.append(_number(e)))

    def level(session: Any, n: int) -> None:
        if n > depth:
            return
        try:
            with session.begin_nested():
                if links:
                    session.add(app.Link(code=f"l{n}", url="u"))
                _enqueue(session, numbered, kind, n)
                if flush:
                    session.flush()
                level(session, n + 1)
                if n == rollback_at:
                    raise Rollback
        except Rollback:
            if n != rollback_at:
                raise
        assert fired == [], "enqueued fired before the outer COMMIT"

    with Session.begin() as session:
        if links:
            session.add(app.Link(code="l0", url="u"))
        _enqueue(session, numbered, kind, 0)
        level(session, 1)
        assert fired == []
    survivors = _survivors(depth, rollback_at)
    assert _committed(db) == _expected(survivors, links)
    assert sorted(fired) == survivors


#: On asyncio, enqueue_many is awaited (written at the call); not awaited, as in 0.1, its
#: rows wait for the next flush, savepoint or commit (deprecated, with a warning).
ASYNC_KINDS = ("enqueue_many", "enqueue_many_unawaited", "enqueue", "unique")


@pytest.mark.parametrize("links", [True, False], ids=["links", "jobs-only"])
@pytest.mark.parametrize("flush", [False, True], ids=["no-flush", "flush"])
@pytest.mark.parametrize("kind", ASYNC_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_async_jobs_share_their_savepoints_fate(
    database_url: str,
    db: sa.Engine,
    jobs: Jobs,
    numbered: Any,
    shape: tuple[int, int | None],
    kind: str,
    flush: bool,
    links: bool,
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    depth, rollback_at = shape
    fired: list[int] = []
    jobs.events.connect("enqueued", lambda e: fired.append(_number(e)))

    async def enqueue(session: Any, n: int) -> None:
        if kind == "unique":
            await session.enqueue_unique(numbered, n=n)
        elif kind == "enqueue_many":
            assert await session.enqueue_many(numbered, [{"n": n}]) == 1
        elif kind == "enqueue_many_unawaited":
            assert session.enqueue_many(numbered, [{"n": n}]) == 1
        else:
            _enqueue(session, numbered, kind, n)

    async def level(session: Any, n: int) -> None:
        if n > depth:
            return
        try:
            async with session.begin_nested():
                if links:
                    session.add(app.Link(code=f"l{n}", url="u"))
                await enqueue(session, n)
                if flush:
                    await session.flush()
                await level(session, n + 1)
                if n == rollback_at:
                    raise Rollback
        except Rollback:
            if n != rollback_at:
                raise
        assert fired == [], "enqueued fired before the outer COMMIT"

    async def main() -> None:
        engine = create_async_engine(database_url)
        try:
            make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with make() as session, session.begin():
                if links:
                    session.add(app.Link(code="l0", url="u"))
                await enqueue(session, 0)
                await level(session, 1)
                assert fired == []
        finally:
            await engine.dispose()

    if kind == "enqueue_many_unawaited":
        # Job 0 always survives, and is written at a flush: the warning always comes.
        with pytest.warns(DeprecationWarning, match="awaited from sqla-jobs 0.2"):
            asyncio.run(main())
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            asyncio.run(main())
    survivors = _survivors(depth, rollback_at)
    assert _committed(db) == _expected(survivors, links)
    assert sorted(fired) == survivors


def test_enqueue_many_rows_are_written_into_the_savepoint_innermost_at_the_call(
    Session: Any, db: sa.Engine, numbered: Any
) -> None:
    """Written at the call: the outer transaction's rows before the SAVEPOINT statement,
    the savepoint's after it, so its rollback takes only its own."""
    statements: list[str] = []

    def spy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement.split(None, 1)[0].upper())

    with Session() as session:
        sa.event.listen(db, "before_cursor_execute", spy)
        try:
            session.enqueue_many(numbered, [{"n": 0}, {"n": 1}])
            assert statements == ["INSERT"], "written at the call"
            nested = session.begin_nested()
            session.enqueue_many(numbered, [{"n": 2}])
            assert statements == ["INSERT", "SAVEPOINT", "INSERT"]
            assert pending_jobs(session) == {}
            nested.rollback()
        finally:
            sa.event.remove(db, "before_cursor_execute", spy)
        session.commit()
    assert _committed(db)[0] == [0, 1]


def test_a_savepoint_with_nothing_waiting_costs_no_statement(
    Session: Any, db: sa.Engine, numbered: Any
) -> None:
    statements: list[str] = []

    def spy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    with Session() as session:
        session.enqueue_many(numbered, [{"n": 0}])  # written at the call
        sa.event.listen(db, "before_cursor_execute", spy)
        try:
            with session.begin_nested():
                pass
        finally:
            sa.event.remove(db, "before_cursor_execute", spy)
        session.commit()
    assert statements == [], "nothing waited, and the savepoint never used its connection"
    assert count(db) == 1


def test_rows_enqueued_after_a_rolled_back_savepoint_are_kept(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    fired: list[int] = []
    jobs.events.connect("enqueued", lambda e: fired.append(_number(e)))
    with Session.begin() as session:
        nested = session.begin_nested()
        session.enqueue_many(numbered, [{"n": 1}])
        nested.rollback()
        assert pending_jobs(session) == {}
        session.enqueue_many(numbered, [{"n": 2}])
        with session.begin_nested():
            session.enqueue_many(numbered, [{"n": 3}])
        session.enqueue_many(numbered, [{"n": 4}])
    assert _committed(db)[0] == [2, 3, 4]
    assert sorted(fired) == [2, 3, 4]


def test_enqueue_many_begins_the_transaction_as_add_would(
    db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    with JobSession(db, jobs=jobs) as session:
        assert session.get_transaction() is None
        session.enqueue_many(numbered, [{"n": 1}])
        assert session.get_transaction() is not None
        assert count(db) == 0, "beginning a transaction does no I/O"
        session.commit()
    assert count(db) == 1

    with JobSession(db, jobs=jobs, autobegin=False) as session:
        for call in (
            lambda: session.enqueue_many(numbered, [{"n": 2}]),
            lambda: session.enqueue(numbered, n=2),
            lambda: session.enqueue(numbered, n=2, unique=True),
        ):
            with pytest.raises(EnqueueError, match="autobegin"):
                call()
        assert pending_jobs(session) == {} and not session.new
        with session.begin():
            session.enqueue_many(numbered, [{"n": 3}])
    assert _committed(db)[0] == [1, 3]


def test_a_rolled_back_root_leaves_nothing_for_the_next_transaction(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    fired: list[int] = []
    jobs.events.connect("enqueued", lambda e: fired.append(_number(e)))
    with Session() as session:
        session.enqueue_many(numbered, [{"n": 1}])
        session.enqueue(numbered, n=2)
        with session.begin_nested():
            session.enqueue_many(numbered, [{"n": 3}])
        session.rollback()
        assert pending_jobs(session) == {}
        session.enqueue_many(numbered, [{"n": 4}])
        session.commit()
    assert _committed(db)[0] == [4]
    assert fired == [4]


def test_insert_pending_writes_into_the_current_savepoint(
    database_url: str, jobs: Jobs, numbered: Any, db: sa.Engine
) -> None:
    """The rows of async ``enqueue_many`` calls that were not awaited (0.1's way, kept
    for one release) wait for the flush; ``insert_pending`` writes them into the current
    savepoint, as the flush would."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    async def main() -> None:
        engine = create_async_engine(database_url)
        try:
            make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with make() as session, session.begin():
                session.enqueue_many(numbered, [{"n": 0}])
                nested = await session.begin_nested()
                session.enqueue_many(numbered, [{"n": 1}])
                assert [len(r) for r in pending_jobs(session.sync_session).values()] == [1]
                await session.run_sync(insert_pending)
                assert pending_jobs(session.sync_session) == {}
                await nested.rollback()
        finally:
            await engine.dispose()

    with pytest.warns(DeprecationWarning, match="awaited"):
        asyncio.run(main())
    assert _committed(db)[0] == [0]


def test_an_enqueue_many_awaited_after_its_savepoint_rolled_back_says_none_was_inserted(
    database_url: str, db: sa.Engine, jobs: Jobs
) -> None:
    """An ``AsyncJobSession.enqueue_many`` made in a savepoint and awaited only after the
    savepoint rolled back inserts nothing, and says so (it said every row was)."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    @jobs.task(queue="q")
    def num(n: int) -> None: ...

    said: list[int] = []

    async def main() -> None:
        engine = create_async_engine(database_url)
        try:
            make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with make() as session, session.begin():
                savepoint = await session.begin_nested()
                late = session.enqueue_many(num, [{"n": 5}])
                await savepoint.rollback()
                said.append(await late)
                said.append(await session.enqueue_many(num, [{"n": 6}]))
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert said == [0, 1]
    assert [r.args["n"] for r in rows(db)] == [6]


def test_a_batch_written_by_a_flush_is_not_taken_for_one_rolled_back(
    database_url: str, db: sa.Engine, jobs: Jobs
) -> None:
    """Batches rolled back unawaited are remembered; a later batch that a flush wrote, at
    the same address (CPython reuses a freed tuple's at once), says its row was inserted
    (it said none was)."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    @jobs.task(queue="q")
    def num(n: int) -> None: ...

    async def main() -> list[int]:
        engine = create_async_engine(database_url)
        said: list[int] = []
        try:
            make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with make() as session:
                for _ in range(10):
                    await session.begin()
                    session.enqueue_many(num, [{"n": 1}])  # never awaited
                    await session.rollback()
                for _ in range(10):
                    await session.begin()
                    made = session.enqueue_many(num, [{"n": 2}])
                    await session.flush()  # writes it
                    said.append(await made)
                    await session.commit()
        finally:
            await engine.dispose()
        return said

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        said = asyncio.run(main())
    assert said == [1] * 10
    assert [r.args["n"] for r in rows(db)] == [2] * 10

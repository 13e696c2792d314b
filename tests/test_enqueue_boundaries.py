"""Enqueue at the edges of the caller's transaction: savepoints of a Core connection, the
session events around a flush and a commit, the first enqueue on a new engine, and what
the ``enqueued`` listeners can read of the jobs they are given."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from sqla_jobs import EnqueueError, Jobs, JobSession, create_engine

from . import app
from .helpers import count, rows
from .test_sharding import Sharded, _task, engine_b, shards  # noqa: F401 (fixtures: a second database)


@pytest.fixture
def numbered(jobs: Jobs) -> Any:
    @jobs.task(queue="edges")
    def numbered(n: int) -> None:
        pass

    return numbered


def _args(db: sa.Engine) -> list[int]:
    return sorted(r.args["n"] for r in rows(db))


def _fired(jobs: Jobs) -> list[int]:
    """The ``n`` of every job the ``enqueued`` listeners hear of."""
    fired: list[int] = []

    def listener(e: Any) -> None:
        job = e.job
        fired.append(int((job["args"] if isinstance(job, dict) else job.args)["n"]))

    jobs.events.connect("enqueued", listener)
    return fired


# -- a Core connection's savepoints --------------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_connection_announces_no_job_of_a_savepoint_that_rolled_back(
    db: sa.Engine, database_url: str, jobs: Jobs, numbered: Any, flavour: str
) -> None:
    """On ``jobs.enqueue(conn, ...)`` and ``jobs.enqueue_many(conn, ...)``, ``enqueued``
    fired at the commit for every job written in the transaction, those of savepoints
    that rolled back too: the metrics counted jobs that never existed."""
    fired = _fired(jobs)

    def scenario(conn: sa.Connection) -> None:
        jobs.enqueue(conn, numbered, n=1)
        outer = conn.begin_nested()
        jobs.enqueue(conn, numbered, n=2)
        inner = conn.begin_nested()
        jobs.enqueue_many(conn, numbered, [numbered.args(n=3), numbered.args(n=4)])
        inner.commit()  # released into `outer`...
        outer.rollback()  # ...which takes it
        kept = conn.begin_nested()
        jobs.enqueue(conn, numbered, n=5)
        kept.commit()  # released into the transaction
        dropped = conn.begin_nested()  # begun right after: not the released one's heir
        jobs.enqueue(conn, numbered, n=6)
        deeper = conn.begin_nested()
        jobs.enqueue(conn, numbered, n=7)
        deeper.rollback()
        jobs.enqueue(conn, numbered, n=8)
        dropped.rollback()
        with conn.begin_nested():
            jobs.enqueue_many(conn, numbered, [numbered.args(n=9)])
        jobs.enqueue(conn, numbered, n=10)

    if flavour == "sync":
        with db.begin() as conn:
            scenario(conn)
    else:
        from sqla_jobs import create_async_engine

        async def main() -> None:
            engine = create_async_engine(database_url)
            try:
                async with engine.begin() as conn:
                    await conn.run_sync(scenario)
            finally:
                await engine.dispose()

        asyncio.run(main())
    assert _args(db) == [1, 5, 9, 10]
    assert sorted(fired) == [1, 5, 9, 10]


def test_a_connection_rolled_back_whole_announces_nothing(
    db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    """The transaction's rollback still drops every announcement, released savepoints'
    included, and leaves none for the connection's next transaction."""
    fired = _fired(jobs)
    with db.connect() as conn:
        jobs.enqueue(conn, numbered, n=1)
        with conn.begin_nested():
            jobs.enqueue(conn, numbered, n=2)
        conn.rollback()
        jobs.enqueue(conn, numbered, n=3)
        conn.commit()
    assert _args(db) == [3]
    assert fired == [3]


# -- session events around the transaction's end -------------------------------------------


@pytest.mark.parametrize("hook", ["after_commit", "after_rollback", "after_savepoint_rollback"])
def test_an_enqueue_after_its_transaction_ended_is_refused(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any, hook: str
) -> None:
    """A job enqueued from ``after_commit`` or ``after_rollback`` was accepted, then
    silently dropped: thrown away by SQLAlchemy's rollback, or left in the session when
    it closed. Refused now, saying where to enqueue instead."""
    errors: list[BaseException] = []
    with Session() as session:

        def follow(s: Any, *rest: Any) -> None:
            if errors:
                return
            try:
                s.enqueue(numbered, n=9)
            except EnqueueError as exc:
                errors.append(exc)

        session.enqueue(numbered, n=1)
        if hook == "after_savepoint_rollback":
            session.flush()
            nested = session.begin_nested()
            session.enqueue(numbered, n=2)
            event.listen(session, "after_rollback", follow)
            nested.rollback()
            session.enqueue(numbered, n=3)  # the transaction goes on
            session.commit()
        else:
            event.listen(session, hook, follow)
            session.flush()
            if hook == "after_commit":
                session.commit()
            else:
                session.rollback()
        event.remove(
            session, "after_commit" if hook == "after_commit" else "after_rollback", follow
        )
        session.enqueue(numbered, n=4)  # in a new transaction: fine
        session.commit()
    assert len(errors) == 1, errors
    assert "before_commit" in str(errors[0]) and "new transaction" in str(errors[0])
    expected = {
        "after_commit": [1, 4],
        "after_rollback": [4],
        "after_savepoint_rollback": [1, 3, 4],
    }
    assert _args(db) == expected[hook]


def test_an_enqueue_after_a_failed_flush_is_refused_until_the_rollback(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    """After a flush failed, the transaction is over: a job enqueued then was accepted,
    and discarded by the rollback. Refused with SQLAlchemy's own error for that state,
    which any statement would raise."""
    with Session() as session:
        session.add_all([app.Link(code="same", url="u"), app.Link(code="same", url="u")])
        with pytest.raises(sa.exc.IntegrityError):
            session.flush()
        with pytest.raises(sa.exc.PendingRollbackError, match=r"Session\.rollback"):
            session.enqueue(numbered, n=1)
        session.rollback()
        session.enqueue(numbered, n=2)
        session.commit()
    assert _args(db) == [2]


def test_enqueue_still_begins_a_transaction_and_rides_one_that_is_connecting(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    """What the refusal must not touch: a session with no transaction begins one (as
    ``add`` does), and a job enqueued from ``after_begin`` (the transaction connecting,
    when SQLAlchemy reports it not active) rides it."""
    fired = _fired(jobs)
    with Session() as session:
        assert not session.in_transaction()
        session.enqueue(numbered, n=1)
        assert session.in_transaction()
        once: list[int] = []

        def follow(s: Any, *rest: Any) -> None:
            if not once:
                once.append(1)
                s.enqueue(numbered, n=2)

        event.listen(session, "after_begin", follow)
        session.commit()
    assert _args(db) == [1, 2]
    assert sorted(fired) == [1, 2]


@pytest.mark.parametrize("hook", ["before_flush", "after_flush", "after_flush_postexec"])
def test_enqueue_many_from_a_flush_listener_writes_its_rows(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any, hook: str
) -> None:
    """``enqueue_many`` flushes first "as a query would"; a query in a flush listener
    does not flush again, and ``enqueue_many`` raised "Session is already flushing"."""
    fired = _fired(jobs)
    with Session() as session:
        once: list[int] = []

        def follow(s: Any, *rest: Any) -> None:
            if not once:
                once.append(1)
                assert s.enqueue_many(numbered, [{"n": 2}, {"n": 3}]) == 2

        event.listen(session, hook, follow)
        session.add(app.Link(code="a", url="u"))
        session.enqueue(numbered, n=1)
        session.commit()
    assert _args(db) == [1, 2, 3]
    assert sorted(fired) == [1, 2, 3]


# -- the first non-ASCII enqueue on an engine -----------------------------------------------


def test_a_first_non_ascii_enqueue_leaves_the_isolation_level_to_the_application(
    database_url: str, db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    """The first enqueue with non-ASCII text on an engine learned its encodings from the
    session's connection, which began the session's transaction: the application's
    ``session.connection(execution_options={"isolation_level": ...})`` after it was
    ignored (a SAWarning), and its transaction ran at READ COMMITTED."""

    @jobs.task(queue="edges")
    def greet(name: str) -> None: ...

    engine = create_engine(database_url)  # a new engine: its encodings not learned yet
    try:
        with JobSession(engine, jobs=jobs) as session, warnings.catch_warnings():
            warnings.simplefilter("error", sa.exc.SAWarning)
            session.enqueue(greet, name="Jos\u00e9")
            session.connection(execution_options={"isolation_level": "SERIALIZABLE"})
            level = session.execute(sa.text("SHOW transaction_isolation")).scalar()
            session.commit()
    finally:
        engine.dispose()
    assert level == "serializable"
    assert [r.args["name"] for r in rows(db)] == ["Jos\u00e9"]


@pytest.mark.parametrize("holds", ["session-connected", "session-bound-to-a-connection"])
def test_a_first_non_ascii_enqueue_needs_no_second_connection(
    database_url: str, db: sa.Engine, jobs: Jobs, holds: str
) -> None:
    """Learning the encodings without the session's transaction must not wait for a
    second connection of a pool the session already holds the only one of."""

    @jobs.task(queue="edges")
    def greet(name: str) -> None: ...

    engine = create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=1)
    try:
        if holds == "session-connected":
            with JobSession(engine, jobs=jobs) as session:
                session.execute(sa.text("SELECT 1"))  # the pool's only connection
                session.enqueue(greet, name="Ren\u00e9e")
                session.commit()
        else:
            with engine.connect() as conn:  # the pool's only connection
                with JobSession(bind=conn, jobs=jobs) as session:
                    session.enqueue(greet, name="Ren\u00e9e")
                    session.commit()
                conn.commit()
    finally:
        engine.dispose()
    assert [r.args["name"] for r in rows(db)] == ["Ren\u00e9e"]


# -- what the enqueued listeners read ---------------------------------------------------------


@pytest.mark.parametrize("path", ["direct", "orm-flush-listener", "after", "asyncio"])
def test_enqueued_listeners_read_the_jobs_they_are_given(
    Session: Any, db: sa.Engine, database_url: str, jobs: Jobs, numbered: Any, path: str
) -> None:
    """``enqueued`` fires after the commit, when no SQL can run. A job the ORM wrote (a
    session with a ``before_flush`` listener, a job with ``after=``) had its server
    defaults left unloaded: reading its ``run_at`` or ``created_at`` in a listener raised
    (logged, not raised: a metric silently lost)."""
    seen: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    names = ("id", "status", "run_at", "created_at", "attempts", "max_attempts", "queue")

    def listener(e: Any) -> None:
        job = e.job
        try:
            seen[job.args["n"]] = {name: getattr(job, name) for name in names}
        except Exception as exc:  # what the listener could not read
            errors.append(repr(exc)[:200])

    jobs.events.connect("enqueued", listener)
    if path == "asyncio":
        from sqlalchemy.ext.asyncio import async_sessionmaker

        from sqla_jobs import create_async_engine
        from sqla_jobs.aio import AsyncJobSession

        async def main() -> None:
            engine = create_async_engine(database_url)
            try:
                make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
                async with make() as session:
                    event.listen(session.sync_session, "before_flush", lambda *a: None)
                    session.enqueue(numbered, n=0)
                    await session.commit()
            finally:
                await engine.dispose()

        asyncio.run(main())
    else:
        with Session() as session:
            if path == "orm-flush-listener":
                event.listen(session, "before_flush", lambda *a: None)  # an app's audit hook
            parent = session.enqueue(numbered, n=0)
            if path == "after":
                session.enqueue(numbered.with_options(after=[parent]), n=1)
            session.commit()
    assert errors == []
    stored = {r.args["n"]: r for r in rows(db)}
    assert sorted(seen) == sorted(stored)
    for n, values in seen.items():
        assert values == {name: getattr(stored[n], name) for name in names}, n


def test_enqueued_listeners_of_a_rolled_back_savepoint_cost_no_read(
    Session: Any, db: sa.Engine, jobs: Jobs, numbered: Any
) -> None:
    """Jobs whose savepoint rolled back before their flush are not read back (nor
    announced); the others are."""
    fired = _fired(jobs)
    with Session() as session:
        event.listen(session, "before_flush", lambda *a: None)
        session.enqueue(numbered, n=1)
        nested = session.begin_nested()
        session.enqueue(numbered, n=2)
        nested.rollback()
        session.commit()
    assert _args(db) == [1] and fired == [1]
    assert count(db) == 1


def test_enqueued_listeners_read_the_jobs_a_sharded_session_gives_them(
    Sharded: Any,  # noqa: F811 (the fixture imported above)
    shards: dict[str, sa.Engine],  # noqa: F811
    jobs: Jobs,
) -> None:
    """A sharded session's jobs go the ORM's way, each read back from its own shard."""
    fetch = _task(jobs)
    seen: list[tuple[str, Any, Any, int, str]] = []
    errors: list[str] = []

    def listener(e: Any) -> None:
        job = e.job
        try:
            seen.append((job.args["code"], job.run_at, job.created_at, job.attempts, job.status))
        except Exception as exc:  # what the listener could not read
            errors.append(repr(exc)[:200])

    jobs.events.connect("enqueued", listener)
    for code in ("a1", "b1"):
        with Sharded.begin() as session:
            session.add(app.Link(code=code, url="u"))
            session.enqueue(fetch, code=code)
    assert errors == []
    stored = []
    for name in ("a", "b"):
        with shards[name].connect() as conn:
            stored += [
                (r.args["code"], r.run_at, r.created_at, r.attempts, r.status)
                for r in conn.execute(sa.select(app.Job.__table__))
            ]
    assert seen == stored

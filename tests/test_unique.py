"""Unique jobs: one live job per key, enforced by the database. Time is moved by the tests (rows'
timestamps set into the past), never waited for."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    EnqueueError,
    Jobs,
    JobSession,
    Worker,
    create_engine,
)

from . import app
from .helpers import count, rows


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


def test_unique_value_is_the_flat_options_grouped(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    """``unique=Unique(...)`` means what the flat keywords it groups mean, on every entry
    point; a field given both ways is refused."""
    from datetime import timedelta

    from sqla_jobs import Unique

    @jobs.task(queue="q", unique=Unique(within=timedelta(minutes=5)))
    def scoped(user_id: int) -> None:
        pass

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    assert scoped.unique and scoped.unique_scope is not None
    with Session.begin() as session:
        keyed = session.enqueue(refresh.with_options(unique=Unique(key="k-1")), 1)
        again = session.enqueue(refresh, 2, unique=Unique(key="k-1"))
        assert keyed is again and keyed.args == {"user_id": 1}
        keyed_id = keyed.id
        first = session.enqueue(scoped, 1)
        assert session.enqueue(scoped, user_id=1) is first
        with pytest.raises(EnqueueError, match="not both"):
            session.enqueue(refresh, 3, unique=Unique(key="a"), unique_key="b")
        with pytest.raises(EnqueueError, match="same unique_key"):
            session.enqueue_many(refresh, [{"user_id": 4}], unique=Unique(key="a"))
    with db.begin() as conn:
        assert jobs.enqueue(conn, refresh, 5, unique=Unique(key="k-1")) == keyed_id
        assert jobs.enqueue_many(conn, refresh, [{"user_id": 6}], unique=Unique()) == 1
    assert count(db) == 3
    with pytest.raises(ValueError, match="one unique key"):
        jobs.task(unique=Unique(key="k"))


def test_a_unique_enqueue_whose_holder_ends_meanwhile_returns_the_new_job(
    db: sa.Engine, jobs: Jobs
) -> None:
    """The holder's id is read, then the holder is loaded: a worker that finished (and
    deleted) it in between made ``session.enqueue(unique=True)`` return None, with
    nothing enqueued. The key is free then, so the job is inserted."""
    from sqlalchemy import event

    Session = sa.orm.sessionmaker(db, class_=JobSession, jobs=jobs)

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None: ...

    with Session() as session:
        holder_id = session.enqueue(refresh, 1, unique=True).id
        session.commit()
    done = threading.Event()

    def finish_the_holder(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        # Right after the statement that found the live holder.
        where = statement.split("WHERE", 1)[-1]
        if not done.is_set() and "unique_key" in where and statement.lstrip().startswith("SELECT"):
            done.set()
            Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=10)

    with Session() as session:
        event.listen(session.connection(), "after_cursor_execute", finish_the_holder)
        job = session.enqueue(refresh, 1, unique=True)
        assert done.is_set() and job is not None and job.id != holder_id
        job_id = job.id
        session.commit()
    assert [r.id for r in rows(db)] == [job_id]


def test_the_async_enqueue_unique_keeps_the_unique_it_is_given(
    database_url: str, db: sa.Engine, jobs: Jobs
) -> None:
    """``enqueue_unique`` set ``unique=True`` over a ``Unique(...)`` given to it: two calls
    with one key and other arguments made two jobs, and a scope made none."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import Unique, create_async_engine
    from sqla_jobs.aio import AsyncJobSession
    from sqla_jobs.model import companion_tables

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None: ...

    async def main() -> tuple[Any, Any]:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            a = await session.enqueue_unique(refresh, 1, unique=Unique(key="profile:1"))
            b = await session.enqueue_unique(refresh, 2, unique=Unique(key="profile:1"))
            await session.enqueue_unique(refresh, 3, unique=Unique(within=3600))
            ids = (a.id, b.id)
            await session.commit()
        await engine.dispose()
        return ids

    a, b = asyncio.run(main())
    assert a == b
    with db.connect() as conn:
        keys = sorted(conn.execute(sa.select(app.Job.unique_key)).scalars(), key=str)
        scoped = conn.execute(
            sa.select(sa.func.count()).select_from(companion_tables(app.Job.__table__).unique_keys)
        ).scalar()
    assert len(keys) == 2 and "profile:1" in keys
    assert scoped == 1  # the scope's period is remembered

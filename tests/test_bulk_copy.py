"""Big ``enqueue_many`` calls go through ``COPY`` (sqla_jobs._bulk): the same rows, in the
caller's transaction, with the NOTIFY, and unique rows still skipped.

Which statement wrote the rows is read from the server itself: a statement-level trigger
(added for the test) logs ``current_query()`` of every INSERT or COPY into the table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs
from sqla_jobs._bulk import COPY_MIN_ROWS
from sqla_jobs.model import notify_channel

from . import app
from .helpers import count, rows, wait_for

N = COPY_MIN_ROWS + 50

#: Arguments no text format forgives: the COPY must escape what needs escaping and
#: nothing else.
TRICKY = [
    "quote \" and ' apostrophe",
    "back\\slash \\N \\t \\\\ and a trailing \\",
    "tab\there",
    "new\nline and carriage\rreturn\r\n",
    "unicode: é ß 日本 🎉 \u2028 \u00a0",
    "",
    "\\.",  # COPY's old end-of-data marker, alone on its line in the file
    "{not json}",
]

LOG = f'"{app.SCHEMA}"."_statement_log"'
JOBS = f'"{app.SCHEMA}"."jobs"'


@pytest.fixture
def send(jobs: Jobs) -> Any:
    @jobs.task(queue="mail")
    def send_email(to: str, subject: str = "hi", extra: Any = None) -> None:
        pass

    return send_email


@pytest.fixture
def statements(db: sa.Engine) -> Iterator[Callable[[], list[str]]]:
    """What wrote into the jobs table: one entry per INSERT or COPY statement."""
    with db.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {LOG} (query text)"))
        conn.execute(
            sa.text(
                f'CREATE FUNCTION "{app.SCHEMA}".log_statement() RETURNS trigger '
                f"LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {LOG} VALUES (current_query()); "
                "RETURN NULL; END $$"
            )
        )
        conn.execute(
            sa.text(
                f"CREATE TRIGGER log_statement AFTER INSERT ON {JOBS} "
                f'FOR EACH STATEMENT EXECUTE FUNCTION "{app.SCHEMA}".log_statement()'
            )
        )

    def read() -> list[str]:
        with db.connect() as conn:
            found = conn.execute(sa.text(f"SELECT query FROM {LOG}")).scalars()
            return [q.lstrip().split(None, 1)[0].upper() for q in found]

    try:
        yield read
    finally:
        with db.begin() as conn:
            conn.execute(sa.text(f"DROP TRIGGER log_statement ON {JOBS}"))
            conn.execute(sa.text(f'DROP FUNCTION "{app.SCHEMA}".log_statement()'))
            conn.execute(sa.text(f"DROP TABLE {LOG}"))


def tricky_args(send: Any, n: int = N) -> list[Any]:
    return [
        send.args(
            f"{i}@example.com",
            subject=TRICKY[i % len(TRICKY)],
            extra={"k\t\\": [TRICKY[(i + 1) % len(TRICKY)], i, 1.5, None, True]},
        )
        for i in range(n)
    ]


def assert_stored(db: sa.Engine, sent: list[Any], meta: Any = None) -> None:
    stored = rows(db)
    assert [r.args for r in stored] == [dict(a.kwargs, to=a.args[0]) for a in sent]
    assert {(r.queue, r.status, r.priority, r.max_attempts) for r in stored} == {
        ("mail", "ready", 0, 5)
    }
    assert all(r.meta == meta for r in stored)


def test_a_big_call_on_a_connection_is_one_copy(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    sent = tricky_args(send)
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, sent) == N
    assert statements() == ["COPY"]
    assert_stored(db, sent)
    (task,) = {r.task for r in rows(db)}
    assert task == send.name


def test_a_small_call_stays_one_insert(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    sent = tricky_args(send, COPY_MIN_ROWS - 1)
    with db.begin() as conn:
        jobs.enqueue_many(conn, send, sent)
    assert statements() == ["INSERT"]
    assert_stored(db, sent)


def test_the_copy_rolls_back_with_the_callers_transaction(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    with db.connect() as conn:
        with conn.begin():
            conn.execute(sa.insert(app.Link).values(code="kept", url="u"))
        trans = conn.begin()
        conn.execute(sa.insert(app.Link).values(code="gone", url="u"))
        jobs.enqueue_many(conn, send, tricky_args(send))
        with db.connect() as other:  # not committed: not visible
            assert other.execute(sa.select(sa.func.count()).select_from(app.Job)).scalar() == 0
        trans.rollback()
    assert count(db) == 0
    with db.connect() as conn:
        assert conn.execute(sa.select(app.Link.code)).scalars().all() == ["kept"]


def test_a_copy_on_a_connection_that_commits_as_it_goes_is_committed(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    """``engine.connect()`` without ``begin()``: SQLAlchemy begins the transaction at the
    first statement, and the COPY is sent around it. It used to leave the Connection
    believing nothing was begun: ``commit()`` committed nothing, and the pool rolled the
    rows back, silently."""
    from sqla_jobs import create_async_engine

    sent = tricky_args(send)
    with db.connect() as conn:
        assert jobs.enqueue_many(conn, send, sent) == N
        assert conn.in_transaction()
        conn.commit()
    assert count(db) == N
    with db.connect() as conn:  # and a rollback takes them back
        jobs.enqueue_many(conn, send, sent)
        conn.rollback()
    assert count(db) == N

    async def main() -> None:
        engine = create_async_engine(database_url)
        async with engine.connect() as conn:
            assert await jobs.enqueue_many(conn, send, sent) == N
            await conn.commit()
        await engine.dispose()

    asyncio.run(main())
    assert count(db) == 2 * N
    assert statements() == ["COPY", "COPY"]


def test_meta_run_at_and_options_reach_every_copied_row(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    later = datetime.now(timezone.utc).replace(microsecond=123456) + timedelta(hours=2)
    earlier = later - timedelta(days=1, microseconds=1)
    meta = {"tenant": 'a"b\\c\td\ne', "n": 1}
    sent = tricky_args(send)
    with db.begin() as conn:
        jobs.enqueue_many(
            conn, send.with_options(priority=7, max_attempts=2, run_at=later), sent, meta=meta
        )
        jobs.enqueue_many(conn, send.with_options(run_at=earlier), sent)
    assert statements() == ["COPY", "COPY"]
    stored = rows(db)
    scheduled, ready = stored[:N], stored[N:]
    assert [r.args for r in scheduled] == [r.args for r in ready]
    assert {(r.status, r.priority, r.max_attempts, r.run_at) for r in scheduled} == {
        ("scheduled", 7, 2, later)
    }
    assert all(r.meta == meta for r in scheduled)
    assert {r.status for r in ready} == {"ready"}
    assert all(r.meta is None for r in ready)
    assert {r.run_at for r in ready} == {earlier}


def test_the_session_copies_at_flush_and_follows_savepoints(
    Session: Any, db: sa.Engine, send: Any, statements: Callable[[], list[str]]
) -> None:
    sent = tricky_args(send)
    with Session() as session:
        session.enqueue_many(send, sent)
        nested = session.begin_nested()  # the waiting rows are written before it
        session.enqueue_many(send, tricky_args(send, N + 1))
        nested.rollback()
        session.add(app.Link(code="x", url="u"))
        session.commit()
    assert statements() == ["COPY"]  # the savepoint's rows were never written
    assert_stored(db, sent)


def test_unique_rows_keep_the_insert_that_skips_conflicts(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    first = [send.args(f"{i}@example.com") for i in range(N)]
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, send, first[:10], unique=True) == 10
        assert jobs.enqueue_many(conn, send, first, unique=True) == N - 10
    assert statements() == ["INSERT", "INSERT"]
    assert count(db) == N


def test_rows_with_a_concurrency_key_keep_the_insert_that_stores_it(
    db: sa.Engine, jobs: Jobs, statements: Callable[[], list[str]]
) -> None:
    """COPY writes the shared columns and the arguments: a keyed task's big call stays on
    the INSERT, which stores each row's key (sqla_jobs.throttle)."""

    @jobs.task(queue="sync", concurrency_key=lambda account, **_: account)
    def sync(account: str) -> None:
        pass

    with db.begin() as conn:
        jobs.enqueue_many(conn, sync, [{"account": f"a{i % 7}"} for i in range(N)])
    assert statements() == ["INSERT"]
    assert sorted({r.concurrency_key for r in rows(db)}) == [f"a{i}" for i in range(7)]


def test_a_task_unique_by_default_gets_a_key_per_row(
    db: sa.Engine, jobs: Jobs, statements: Callable[[], list[str]]
) -> None:
    """A task declared unique derives each row's key from that row's arguments, though
    the call gives no unique option (the rows then differ in more than their arguments)."""

    @jobs.task(queue="sync", unique=True)
    def refresh(user: int) -> None:
        pass

    with db.begin() as conn:
        assert jobs.enqueue_many(conn, refresh, [{"user": i % 5} for i in range(N)]) == 5
    assert statements() == ["INSERT"]
    assert sorted(r.args["user"] for r in rows(db)) == [0, 1, 2, 3, 4]


def test_a_copy_wakes_the_workers_once(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    url = db.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(f'LISTEN "{notify_channel(app.Job.__table__)}"')
        with db.begin() as conn:
            jobs.enqueue_many(conn, send, tricky_args(send))
        notes: list[str] = []

        def heard() -> list[str]:
            notes.extend(n.payload for n in listener.notifies(timeout=0.2, stop_after=1))
            return notes

        wait_for(heard, timeout=10)
        assert notes == ["mail"]
        assert list(listener.notifies(timeout=0.3)) == []


def test_a_failed_copy_raises_sqlalchemys_error_and_rolls_back(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(f"ALTER TABLE {JOBS} ADD CONSTRAINT no_boom CHECK (args->>'to' <> 'boom')")
        )
    try:
        sent = [send.args("ok"), *tricky_args(send)[1:], send.args("boom")]
        with pytest.raises(sa.exc.IntegrityError, match="no_boom"), db.begin() as conn:
            jobs.enqueue_many(conn, send, sent)
        assert count(db) == 0
        with db.begin() as conn:  # the pool's connection is usable again
            assert jobs.enqueue_many(conn, send, sent[:-1]) == N
    finally:
        with db.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {JOBS} DROP CONSTRAINT no_boom"))
    assert count(db) == N


def test_a_schema_translate_map_keeps_the_insert(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    with (
        db.connect().execution_options(schema_translate_map={app.SCHEMA: app.SCHEMA}) as conn,
        conn.begin(),
    ):
        jobs.enqueue_many(conn, send, tricky_args(send))
    assert statements() == ["INSERT"]
    assert count(db) == N


@pytest.mark.parametrize("how", ["listener", "echo"])
def test_a_watched_connection_keeps_the_insert(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]], how: str
) -> None:
    """What watches the connection's statements (a ``before_cursor_execute`` listener:
    tracing, a statement counter, a comment added to each statement; ``echo``) saw
    nothing of a big call: the COPY went around SQLAlchemy. As the other paths that go
    to psycopg directly, it now does so only where nothing could tell the difference."""
    seen: list[str] = []
    with db.connect() as conn, conn.begin():
        if how == "listener":
            sa.event.listen(conn, "before_cursor_execute", lambda c, cur, s, *a: seen.append(s))
        else:
            conn.engine.echo = True
        try:
            jobs.enqueue_many(conn, send, tricky_args(send))
        finally:
            conn.engine.echo = False
    assert statements() == ["INSERT"]
    assert count(db) == N
    if how == "listener":
        assert any(s.lstrip().upper().startswith("INSERT") for s in seen), seen


def test_async_session_and_connection_copy(
    db: sa.Engine,
    database_url: str,
    jobs: Jobs,
    send: Any,
    statements: Callable[[], list[str]],
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    sent = tricky_args(send)
    meta = {"via": "async\\\t"}

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            await session.enqueue_many(send, sent, meta=meta)
            await session.commit()
        async with make() as session:  # rolled back: nothing written
            await session.enqueue_many(send, sent)
            await session.flush()
            await session.rollback()
        async with engine.begin() as conn:
            assert await jobs.enqueue_many(conn, send, sent, meta=meta) == N
        await engine.dispose()

    asyncio.run(main())
    assert statements() == ["COPY", "COPY"]  # the rolled-back one took its log row along
    stored = rows(db)
    assert len(stored) == 2 * N
    assert [r.args for r in stored] == [dict(a.kwargs, to=a.args[0]) for a in sent] * 2
    assert all(r.meta == meta for r in stored)


def test_a_nul_in_a_late_row_is_refused_before_the_copy(
    db: sa.Engine, jobs: Jobs, send: Any, statements: Callable[[], list[str]]
) -> None:
    """Rows after the first are checked by the fast path too: a NUL that PostgreSQL would
    refuse mid-COPY is an EnqueueError before anything is sent, and the caller's
    transaction goes on."""
    sent = [send.args(f"{i}@example.com") for i in range(N)]
    sent[-1] = send.args("last@example.com", subject="a\x00b")
    with db.begin() as conn:
        with pytest.raises(EnqueueError, match="NUL"):
            jobs.enqueue_many(conn, send, sent)
        assert jobs.enqueue_many(conn, send, sent[:-1]) == N - 1  # still usable
    assert statements() == ["COPY"]
    assert count(db) == N - 1

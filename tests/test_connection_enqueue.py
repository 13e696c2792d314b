"""jobs.enqueue / jobs.enqueue_many on a Core Connection: the connection's transaction
decides, and in autocommit a job is one statement."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs

from . import app
from .helpers import count, rows, terminate_backend


@pytest.fixture
def send(jobs: Jobs) -> Any:
    @jobs.task(queue="mail", max_attempts=3)
    def send_email(to: str, subject: str = "hi") -> None:
        pass

    return send_email


class Statements:
    """The SQL statements an engine sends while it listens."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.sent: list[str] = []

    def _spy(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.sent.append(statement)

    def __enter__(self) -> list[str]:
        sa.event.listen(self.engine, "before_cursor_execute", self._spy)
        return self.sent

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._spy)


def test_enqueue_commits_with_the_connection(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    with db.begin() as conn:
        conn.execute(sa.insert(app.Link).values(code="a", url="u"))
        job_id = jobs.enqueue(conn, send, "a@example.com", subject="s")
        assert isinstance(job_id, int)
        with db.connect() as other:  # not visible before the commit
            assert other.execute(sa.select(sa.func.count()).select_from(app.Job)).scalar() == 0
    (row,) = rows(db)
    assert (row.id, row.task, row.queue, row.status, row.max_attempts) == (
        job_id,
        send.name,
        "mail",
        "ready",
        3,
    )
    assert row.args == {"to": "a@example.com", "subject": "s"}


def test_enqueue_rolls_back_with_the_connection(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    with pytest.raises(RuntimeError), db.begin() as conn:
        conn.execute(sa.insert(app.Link).values(code="gone", url="u"))
        jobs.enqueue(conn, send, "a@example.com")
        jobs.enqueue_many(conn, send, [{"to": "b@example.com"}, send.args("c@example.com")])
        assert conn.execute(sa.select(sa.func.count()).select_from(app.Job)).scalar() == 3
        raise RuntimeError("the transaction fails after the enqueue")
    assert count(db) == 0
    assert count(db, app.Link) == 0
    with db.connect() as conn:
        jobs.enqueue(conn, send, "never@example.com")
        conn.rollback()
    assert count(db) == 0


def test_enqueue_in_autocommit_is_one_statement(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        jobs.enqueue(conn, send, "warm@example.com")  # the connection's own setup, once
        with Statements(db) as sent:
            jobs.enqueue(conn, send.with_options(priority=3, delay=60), "a@example.com")
        assert len(sent) == 1 and sent[0].lstrip().upper().startswith("INSERT")
        assert count(db) == 2  # committed, seen from another connection
    row = rows(db)[1]
    assert (row.priority, row.status) == (3, "scheduled")


def test_enqueue_takes_options_by_name_and_keyword(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    with db.begin() as conn:
        jobs.enqueue(conn, send.name, to="a@example.com", queue="urgent", max_attempts=9)
        jobs.enqueue(conn, send.with_options(queue="q"), "b@example.com", priority=4)
    r = rows(db)
    assert (r[0].queue, r[0].max_attempts) == ("urgent", 9)
    assert (r[1].queue, r[1].priority) == ("q", 4)


def test_unique_enqueue_returns_the_live_job(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    unique = send.with_options(unique=True)
    with db.begin() as conn:
        first = jobs.enqueue(conn, unique, "a@example.com")
    with db.begin() as conn:
        assert jobs.enqueue(conn, unique, to="a@example.com") == first
        assert jobs.enqueue(conn, unique, to="b@example.com") != first
        n = jobs.enqueue_many(conn, send, [{"to": "a@example.com"}, {"to": "c@"}], unique=True)
        assert n == 1  # the live one is skipped, and not counted
    assert count(db) == 3


def test_bad_input_writes_nothing(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    other = Jobs(app.OtherJob)

    @other.task
    def elsewhere() -> None:
        pass

    with db.begin() as conn:
        with pytest.raises(EnqueueError, match="missing a required argument: 'to'"):
            jobs.enqueue(conn, send, subject="no recipient")
        with pytest.raises(EnqueueError, match="priority must be >= 0"):
            jobs.enqueue(conn, send, "a@example.com", priority=-1)
        with pytest.raises(EnqueueError, match="belongs to the registry of table"):
            jobs.enqueue(conn, elsewhere)
        with pytest.raises(EnqueueError, match="belongs to the registry of table"):
            jobs.enqueue(conn, elsewhere.with_options(queue="q"))
        with pytest.raises(EnqueueError, match="belongs to the registry of table"):
            jobs.enqueue_many(conn, elsewhere, [{}])
        with pytest.raises(EnqueueError, match="NUL"):
            jobs.enqueue_many(conn, send, [{"to": "ok"}, {"to": "\x00"}])
        assert jobs.enqueue_many(conn, send, []) == 0
    assert count(db) == 0
    assert count(db, app.OtherJob) == 0


def test_enqueued_fires_after_the_commit_only(db: sa.Engine, jobs: Jobs, send: Any) -> None:
    seen: list[Any] = []
    jobs.events.connect("enqueued", lambda event: seen.append(event.job["args"]["to"]))
    with db.begin() as conn:
        jobs.enqueue(conn, send, "committed@example.com")
        jobs.enqueue_many(conn, send, [send.args("bulk@example.com")])
        assert seen == []
    assert seen == ["committed@example.com", "bulk@example.com"]
    with db.connect() as conn:
        jobs.enqueue(conn, send, "rolled-back@example.com")
        conn.rollback()
        jobs.enqueue(conn, send, "second@example.com")
        conn.commit()
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        jobs.enqueue(conn, send, "autocommit@example.com")
        assert seen[-1] == "autocommit@example.com"
    assert seen == [
        "committed@example.com",
        "bulk@example.com",
        "second@example.com",
        "autocommit@example.com",
    ]


def test_async_connection(db: sa.Engine, database_url: str, jobs: Jobs, send: Any) -> None:
    from sqla_jobs import create_async_engine

    async def main() -> tuple[int, int]:
        engine = create_async_engine(database_url)
        try:
            async with engine.begin() as conn:
                job_id = await jobs.enqueue(conn, send, "async@example.com")
                n = await jobs.enqueue_many(conn, send, [send.args(to="bulk@example.com")])
            async with engine.connect() as conn:
                await jobs.enqueue(conn, send, "rolled-back@example.com")
                await conn.rollback()
            return job_id, n
        finally:
            await engine.dispose()

    job_id, n = asyncio.run(main())
    assert n == 1
    assert (rows(db)[0].id, rows(db)[0].args["to"]) == (job_id, "async@example.com")
    assert sorted(r.args["to"] for r in rows(db)) == ["async@example.com", "bulk@example.com"]


def test_a_session_or_an_engine_is_refused(
    Session: Any, db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    with Session() as session, pytest.raises(TypeError, match=r"use session\.enqueue"):
        jobs.enqueue(session, send, "a@example.com")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"engine\.begin"):
        jobs.enqueue_many(db, send, [{"to": "a@example.com"}])  # type: ignore[call-overload]
    with Session() as session, pytest.raises(TypeError, match=r"session\.enqueue_many"):
        jobs.enqueue_many(session, send, [{"to": "a@example.com"}])  # type: ignore[call-overload]
    assert count(db) == 0


def test_a_first_enqueue_begins_the_connections_transaction(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """Unwatched, the INSERT goes to psycopg directly (``sqla_jobs._direct``); the
    connection's transaction is begun as SQLAlchemy's own first statement would begin it,
    so that ``commit()`` commits the job and closing without it rolls the job back."""
    begun: list[Any] = []

    def began(conn: Any) -> None:
        begun.append(conn)

    sa.event.listen(db, "begin", began)
    try:
        with db.connect() as conn:
            assert not conn.in_transaction()
            jobs.enqueue(conn, send, "committed@example.com")
            assert conn.in_transaction() and len(begun) == 1
            conn.commit()
        with db.connect() as conn:
            jobs.enqueue(conn, send, "closed@example.com")  # closed without a commit
    finally:
        sa.event.remove(db, "begin", began)
    assert [r.args["to"] for r in rows(db)] == ["committed@example.com"]


def test_a_database_error_is_sqlalchemys_and_the_connection_goes_on(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """A statement that failed earlier in the transaction: the enqueue's error is the one
    SQLAlchemy raises for its own statements, and after the rollback the same connection
    enqueues."""
    with db.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError):
            conn.execute(sa.text("SELECT 1 / 0"))
        with pytest.raises(sa.exc.InternalError, match="current transaction is aborted"):
            jobs.enqueue(conn, send, "lost@example.com")
        conn.rollback()
        jobs.enqueue(conn, send, "after@example.com")
        conn.commit()
    assert [r.args["to"] for r in rows(db)] == ["after@example.com"]


@pytest.mark.parametrize("hook", ["before_execute", "after_execute", "handle_error"])
def test_any_statement_hook_sends_the_insert_through_sqlalchemy(
    database_url: str, hook: str
) -> None:
    """What watches statements (tracing, auditing, error handlers) sees the enqueue's:
    each of these hooks on the engine turns the direct path off."""
    from sqla_jobs import create_engine
    from sqla_jobs._direct import pipeline_allowed

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            assert pipeline_allowed(conn)
        sa.event.listen(engine, hook, lambda *a, **k: None)
        with engine.connect() as conn:
            assert not pipeline_allowed(conn)
    finally:
        engine.dispose()


def test_a_job_enqueued_in_a_rolled_back_savepoint_is_gone(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """Sent straight to psycopg, the INSERT is still inside SQLAlchemy's savepoint: its
    rollback takes the job, and the jobs around it stay."""
    with db.begin() as conn:
        jobs.enqueue(conn, send, "before@example.com")
        savepoint = conn.begin_nested()
        jobs.enqueue(conn, send, "inside@example.com")
        savepoint.rollback()
        jobs.enqueue(conn, send, "after@example.com")
    assert [r.args["to"] for r in rows(db)] == ["before@example.com", "after@example.com"]


def test_an_enqueue_on_a_connection_the_server_ended_invalidates_it(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """A terminated backend (a server restart, an idle-session kill): the error is
    SQLAlchemy's, flagged as a lost connection, the connection is invalidated, nothing was
    written, and after the rollback SQLAlchemy asks for the same connection enqueues on a
    new one."""
    with db.connect() as conn:
        jobs.enqueue(conn, send, "first@example.com")
        conn.commit()
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        conn.commit()
        terminate_backend(db, pid)
        with pytest.raises(sa.exc.DBAPIError) as raised:
            jobs.enqueue(conn, send, "lost@example.com")
        assert raised.value.connection_invalidated and conn.invalidated
        conn.rollback()
        jobs.enqueue(conn, send, "again@example.com")
        conn.commit()
    assert [r.args["to"] for r in rows(db)] == ["first@example.com", "again@example.com"]

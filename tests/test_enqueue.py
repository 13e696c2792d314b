"""session.enqueue: jobs ride the caller's transaction, and bad input never gets in."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs, JobSession, UnknownTaskError

from . import app
from .helpers import count, rows


@pytest.fixture
def send(jobs: Jobs) -> Any:
    @jobs.task(queue="mail", max_attempts=3)
    def send_email(to: str, subject: str = "hi", *, cc: list[str] | None = None) -> None:
        pass

    return send_email


def test_enqueue_adds_to_unit_of_work_without_flushing(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        job = session.enqueue(send, "a@example.com", cc=["b@example.com"])
        assert job in session.new
        assert job.id is None
        assert count(db) == 0  # not even flushed
        session.commit()
        assert job.id is not None
    (row,) = rows(db)
    assert row.task == send.name
    assert row.queue == "mail"
    assert row.args == {"to": "a@example.com", "cc": ["b@example.com"]}
    assert row.status == "ready"
    assert row.max_attempts == 3
    assert row.attempts == 0
    assert row.priority == 0


def test_enqueue_commits_and_rolls_back_with_app_data(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session.begin() as session:
        session.add(app.Link(code="ok", url="https://example.com"))
        session.enqueue(send, "a@example.com")
    with pytest.raises(RuntimeError), Session.begin() as session:
        session.add(app.Link(code="gone", url="https://example.com"))
        session.enqueue(send, "b@example.com")
        session.flush()  # the row is in the database, inside the transaction...
        raise RuntimeError("...which then fails")
    assert [r.args["to"] for r in rows(db)] == ["a@example.com"]
    assert [r.code for r in rows(db, app.Link)] == ["ok"]


def test_uncommitted_enqueue_is_invisible_to_a_concurrent_claim(
    Session: Any, db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    claim = {"queue_name": "mail", "limit": 10, "lease": timedelta(seconds=30), "worker": "w"}
    with Session() as session:
        session.enqueue(send, "a@example.com")
        session.flush()
        with db.begin() as other:
            assert other.execute(jobs.queries.claim, claim).all() == []
        session.commit()
    with db.begin() as other:
        assert len(other.execute(jobs.queries.claim, claim).all()) == 1


def test_enqueue_by_name_and_options(Session: Any, db: sa.Engine, send: Any) -> None:
    at = datetime.now(timezone.utc) + timedelta(hours=1)
    with Session.begin() as session:
        session.enqueue(send.name, to="x@example.com", queue="urgent", priority=7, max_attempts=9)
        session.enqueue(send, "y@example.com", run_at=at)
        session.enqueue(send, "z@example.com", delay=60)
        session.enqueue(send, "p@example.com", run_at=datetime.now(timezone.utc) - timedelta(1))
    r = rows(db)
    assert (r[0].queue, r[0].priority, r[0].max_attempts, r[0].status) == ("urgent", 7, 9, "ready")
    assert (r[1].status, r[1].run_at) == ("scheduled", at)
    assert r[2].status == "scheduled"
    assert timedelta(seconds=50) < r[2].run_at - r[2].created_at < timedelta(seconds=70)
    assert r[3].status == "ready"  # a run_at in the past is simply due


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s, t: s.enqueue(t), "missing a required argument: 'to'"),
        (lambda s, t: s.enqueue(t, "a", nope=1), "unexpected keyword argument 'nope'"),
        (lambda s, t: s.enqueue(t, "a", "b", "c"), "too many positional arguments"),
        (lambda s, t: s.enqueue(t, "a", cc=[object()]), "argument 'cc' is not JSON"),
        (lambda s, t: s.enqueue(t, "a", cc=[float("nan")]), "argument 'cc' is not JSON"),
        (lambda s, t: s.enqueue("no.such.task", to="a"), "unknown task 'no.such.task'"),
        (lambda s, t: s.enqueue(t, "a", priority=-1), "priority must be >= 0"),
        (lambda s, t: s.enqueue(t, "a", priority="high"), "priority must be an integer"),
        (lambda s, t: s.enqueue(t, "a", max_attempts=0), "max_attempts must be an integer >= 1"),
        (lambda s, t: s.enqueue(t, "a", queue=""), "queue must be a non-empty string"),
        (lambda s, t: s.enqueue(t, "a", delay=-5), "delay must be a number of seconds >= 0"),
        (lambda s, t: s.enqueue(t, "a", run_at=datetime(2030, 1, 1)), "timezone-aware"),
        (
            lambda s, t: s.enqueue(t, "a", delay=1, run_at=datetime.now(timezone.utc)),
            "run_at or delay, not both",
        ),
    ],
)
def test_bad_input_raises_a_clear_error_and_adds_nothing(
    Session: Any, db: sa.Engine, send: Any, call: Any, message: str
) -> None:
    with Session() as session:
        with pytest.raises(EnqueueError, match=message):
            call(session, send)
        assert not session.new
        session.commit()
    assert count(db) == 0


def test_unknown_task_name_is_a_lookup_error(Session: Any) -> None:
    with Session() as session, pytest.raises(UnknownTaskError):
        session.enqueue("missing")


def test_a_session_without_registry_needs_a_task_object(db: sa.Engine, send: Any) -> None:
    with sa.orm.Session(db) as plain, JobSession(db) as session:
        assert not hasattr(plain, "enqueue")
        with pytest.raises(EnqueueError, match="has no Jobs registry"):
            session.enqueue("send_email", to="a")
        session.enqueue(send, "a@example.com")  # a task object knows its registry
        session.commit()
    assert count(db) == 1


def test_enqueue_many_inserts_in_one_statement_at_the_call(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    statements: list[str] = []

    def spy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    # Below COPY_MIN_ROWS (tests/test_bulk_copy.py has the COPY of bigger calls).
    with Session() as session:
        sa.event.listen(db, "before_cursor_execute", spy)
        try:
            n = session.enqueue_many(send, [{"to": f"{i}@example.com"} for i in range(150)])
        finally:
            sa.event.remove(db, "before_cursor_execute", spy)
        assert n == 150
        inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
        assert len(inserts) == 1
        # Written into the session's transaction: there, not yet for anyone else.
        with session.no_autoflush:
            seen = session.connection().execute(sa.select(sa.func.count()).select_from(app.Job))
            assert seen.scalar() == 150
        assert count(db) == 0
        session.commit()
    assert count(db, status="ready") == 150
    assert sorted(r.args["to"] for r in rows(db))[:2] == ["0@example.com", "100@example.com"]


def test_enqueue_many_flushes_first_like_a_query_and_not_without_autoflush(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    """The rule for when a row is written, per call: ``enqueue_many`` writes at the call,
    after the session's own objects when autoflush is on (as a query would flush them);
    with autoflush off, it leaves them unflushed."""
    with Session() as session:
        session.add(app.Link(code="a", url="u"))
        session.enqueue_many(send, [{"to": "x"}])
        assert not session.new  # the Link was flushed first
        session.rollback()
    with Session(autoflush=False) as session:
        link = app.Link(code="b", url="u")
        session.add(link)
        session.enqueue_many(send, [{"to": "y"}])
        assert link in session.new
        jobs_now = session.connection().execute(sa.select(sa.func.count()).select_from(app.Job))
        assert jobs_now.scalar() == 1
        session.commit()
    assert count(db) == 1


def test_enqueue_many_rides_the_flush_and_the_rollback(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        session.add(app.Link(code="a", url="u"))
        session.enqueue_many(send, [{"to": "x"}, {"to": "y"}], delay=30)
        session.flush()  # inserted after the session's own rows
        assert session.execute(sa.select(sa.func.count()).select_from(app.Job)).scalar() == 2
        session.rollback()
        session.commit()  # the rolled-back rows must not come back
    assert count(db) == 0
    with Session() as session:
        with pytest.raises(EnqueueError, match="missing a required argument"):
            session.enqueue_many(send, [{"to": "x"}, {"subject": "no to"}])
        session.commit()
    assert count(db) == 0


def test_database_checks_the_status_and_priority(db: sa.Engine) -> None:
    t = app.Job.__table__
    for bad in ({"status": "finished"}, {"priority": -1}, {"max_attempts": 0}):
        with pytest.raises(sa.exc.IntegrityError), db.begin() as conn:
            conn.execute(sa.insert(t).values(task="t", **bad))


def test_two_job_tables_are_independent(db: sa.Engine, send: Any) -> None:
    other = Jobs(app.OtherJob)

    @other.task(queue="mail")
    def send_email(to: str) -> None:
        pass

    with JobSession(db) as session:
        session.enqueue(send, "a@example.com")
        session.enqueue(send_email, "b@example.com")
        with pytest.raises(EnqueueError, match="belongs to the registry of table"):
            other.get(send)
        session.commit()
    assert [r.args["to"] for r in rows(db, app.Job)] == ["a@example.com"]
    assert [r.args["to"] for r in rows(db, app.OtherJob)] == ["b@example.com"]
    assert other.queries.channel != send.registry.queries.channel


def test_async_session_enqueue(db: sa.Engine, database_url: str, jobs: Jobs, send: Any) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            session.enqueue(send, "async@example.com")
            assert await session.enqueue_many(send.name, [{"to": "bulk@example.com"}]) == 1
            await session.commit()
        async with make() as session:
            session.enqueue(send, "rolled-back@example.com")
            await session.flush()
            await session.rollback()
        await engine.dispose()

    asyncio.run(main())
    assert sorted(r.args["to"] for r in rows(db)) == ["async@example.com", "bulk@example.com"]

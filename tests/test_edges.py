"""Edge cases found in review: a flush with only ``enqueue_many`` rows, the ``enqueued``
event for jobs that never reached the table."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs

from . import app
from .helpers import count


@pytest.fixture
def send(jobs: Jobs) -> Any:
    @jobs.task(queue="mail")
    def send_email(to: str) -> None:
        pass

    return send_email


def _inserts(db: sa.Engine) -> tuple[list[str], Any]:
    statements: list[str] = []

    def spy(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT"):
            statements.append(statement)

    return statements, spy


JOBS_SEEN = sa.select(sa.func.count()).select_from(app.Job)


@pytest.mark.parametrize("autoflush", [True, False], ids=["autoflush", "no-autoflush"])
def test_enqueue_many_rows_are_written_at_the_call_each_call_once(
    Session: Any, db: sa.Engine, send: Any, autoflush: bool
) -> None:
    """Written at the call, whatever the session's autoflush, one INSERT per call; the
    flush and the commit write nothing more."""
    statements, spy = _inserts(db)
    sa.event.listen(db, "before_cursor_execute", spy)
    try:
        with Session(autoflush=autoflush) as session:
            session.enqueue_many(send, [{"to": "x"}, {"to": "y"}])
            assert len(statements) == 1
            session.enqueue_many(send, [{"to": "z"}])
            assert len(statements) == 2
            with session.no_autoflush:
                assert session.scalar(JOBS_SEEN) == 3
            assert count(db) == 0  # written, not committed
            session.flush()
            session.commit()
    finally:
        sa.event.remove(db, "before_cursor_execute", spy)
    assert len(statements) == 2
    assert count(db) == 3


def test_a_flush_inside_a_savepoint_writes_into_it(Session: Any, db: sa.Engine, send: Any) -> None:
    with Session() as session:
        session.enqueue_many(send, [{"to": "outer"}])
        savepoint = session.begin_nested()
        session.enqueue_many(send, [{"to": "inner"}])
        session.flush()
        assert session.scalar(JOBS_SEEN) == 2
        savepoint.rollback()
        assert session.scalar(JOBS_SEEN) == 1
        session.commit()
    assert count(db) == 1


def test_async_flush_with_only_enqueue_many_rows_writes_them(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    """The rows of ``enqueue_many`` calls that were not awaited (0.1's way, deprecated)
    are written by the next flush, an autoflush included, with a warning."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    seen: list[int] = []

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            session.enqueue_many(send, [{"to": "x"}, {"to": "y"}])
            await session.flush()
            seen.append(await (await session.connection()).scalar(JOBS_SEEN))
            session.enqueue_many(send, [{"to": "z"}])
            seen.append(await session.scalar(JOBS_SEEN))  # an autoflush
            await session.rollback()
        await engine.dispose()

    with pytest.warns(DeprecationWarning, match="awaited"):
        asyncio.run(main())
    assert seen == [2, 3]
    assert count(db) == 0


@pytest.mark.parametrize("drop", ["expunge", "expunge_all", "delete_after_flush"])
def test_enqueued_fires_only_for_jobs_that_were_committed(
    Session: Any, db: sa.Engine, jobs: Jobs, send: Any, drop: str
) -> None:
    seen: list[str] = []

    def enqueued(event: Any) -> None:  # an enqueue_many row is a dict
        args = event.job["args"] if isinstance(event.job, dict) else event.job.args
        seen.append(args["to"])

    jobs.events.connect("enqueued", enqueued)
    with Session() as session:
        dropped = session.enqueue(send, "dropped")
        if drop == "expunge":
            session.expunge(dropped)
        elif drop == "expunge_all":
            session.expunge_all()
        else:
            session.flush()
            session.delete(dropped)
        kept = session.enqueue(send, "kept")
        flushed = session.enqueue(send, "flushed then expunged")
        session.flush()
        session.expunge(flushed)  # inserted: its row commits
        session.enqueue_many(send, [{"to": "bulk"}])
        session.commit()
        assert kept.id is not None
    assert sorted(seen) == ["bulk", "flushed then expunged", "kept"]
    assert count(db) == 3


PARTIAL = {"jobs_claim", "jobs_scheduled", "jobs_running", "jobs_dead", "jobs_finished"}


def _plans(db: sa.Engine, call: Any) -> str:
    """EXPLAIN of every SELECT that ``call(conn)`` runs, with sequential scans priced out.

    The test table is small, and on a small table a sequential scan is the right plan;
    with ``enable_seqscan`` off the planner still falls back to one (or to a full scan of
    the primary key) for a statement that no partial index can serve, which is what the
    tests look for."""
    captured: list[tuple[str, Any]] = []

    def spy(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            captured.append((statement, parameters))

    with db.connect() as conn:
        sa.event.listen(conn, "before_cursor_execute", spy)
        call(conn)
        sa.event.remove(conn, "before_cursor_execute", spy)
        conn.exec_driver_sql("SET enable_seqscan = off")
        lines = [
            line
            for statement, parameters in captured
            for (line,) in conn.exec_driver_sql("EXPLAIN " + statement, parameters)
        ]
        conn.rollback()
    return "\n".join(lines)


def _fill(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {app.SCHEMA}.jobs (queue, task, status, finished_at, "
                "locked_until, locked_by) "
                "SELECT 'q' || (i % 3), 't', s, CASE WHEN s IN ('done', 'dead', 'cancelled') "
                "THEN now() END, CASE WHEN s = 'running' THEN now() END, "
                "CASE WHEN s = 'running' THEN 'w' END "
                "FROM generate_series(1, 60) AS i, (VALUES ('done'), ('dead'), ('ready'), "
                "('scheduled'), ('running'), ('cancelled')) AS v(s)"
            )
        )
        conn.execute(sa.text(f"ANALYZE {app.SCHEMA}.jobs"))


def _used(plan: str) -> set[str]:
    import re

    used = set(re.findall(r"Scan (?:Backward )?using (\w+)", plan))
    used |= set(re.findall(r"Bitmap Index Scan on (\w+)", plan))
    return {name for name in used if not name.startswith("jobs_queues")}


def test_list_queues_reads_through_the_partial_indexes(db: sa.Engine, jobs: Jobs) -> None:
    from sqla_jobs import admin

    _fill(db)
    plan = _plans(db, lambda conn: admin.list_queues(conn, jobs))
    assert "Seq Scan on jobs " not in plan and "Seq Scan on jobs\n" not in plan, plan
    assert _used(plan) == {"jobs_claim", "jobs_dead", "jobs_scheduled", "jobs_running"}, plan
    with db.connect() as conn:
        assert [q.name for q in admin.list_queues(conn, app.Job)] == ["q0", "q1", "q2"]


def test_stats_reads_through_the_partial_indexes(db: sa.Engine, jobs: Jobs) -> None:
    from sqla_jobs import admin

    _fill(db)
    plan = _plans(db, lambda conn: admin.queue_states(conn, jobs))
    assert "Seq Scan on jobs " not in plan and "Seq Scan on jobs\n" not in plan, plan
    assert _used(plan) == PARTIAL, plan
    with db.connect() as conn:
        q0 = admin.queue_states(conn, app.Job)[0]
    assert all(type(v) is int for v in (q0.ready, q0.done, q0.lease_expired))  # not Decimal
    assert (q0.queue, q0.ready, q0.done, q0.dead, q0.cancelled, q0.running) == (
        "q0",
        20,
        20,
        20,
        20,
        20,
    )

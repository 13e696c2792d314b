"""``sqla_jobs.testing``: assertions and the in-process runner, inside uncommitted
transactions, and the opt-in pytest plugin run as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, PermanentError, Snooze, admin, current_job
from sqla_jobs.testing import (
    assert_enqueued,
    assert_not_enqueued,
    enqueued_jobs,
    run_queued_jobs,
)

from . import app
from .helpers import count

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def previews(jobs: Jobs) -> dict[str, Any]:
    """A small app: a transactional task that updates a link, and a plain one."""
    seen: list[tuple[int, str]] = []

    @jobs.task(queue="previews", transactional=True, name="fetch_preview")
    def fetch_preview(code: str, session: Any) -> None:
        link = session.get(app.Link, code)
        link.url = link.url + "#previewed"
        session.enqueue(notify_owner, code=code, tags=["a", "b"])

    @jobs.task(queue="mail", name="notify_owner")
    def notify_owner(code: str, tags: list[str] | None = None) -> None:
        seen.append((current_job().id, code))

    return {"fetch_preview": fetch_preview, "notify_owner": notify_owner, "seen": seen}


def create_link(session: Any, code: str, url: str, fetch_preview: Any) -> None:
    """The "view" under test: adds a row and enqueues a job, and does not commit."""
    session.add(app.Link(code=code, url=url))
    session.enqueue(fetch_preview, code=code)


def test_a_view_enqueues_inside_an_uncommitted_transaction_then_its_jobs_run(
    Session: Any, db: sa.Engine, previews: dict[str, Any], jobs: Jobs
) -> None:
    fetch_preview, notify_owner = previews["fetch_preview"], previews["notify_owner"]
    events: list[tuple[str, str]] = []
    for name in ("started", "succeeded"):
        jobs.events.connect(name, lambda event: events.append((event.name, event.job.task)))
    with Session() as session:
        create_link(session, "x7Kp", "https://example.com", fetch_preview)

        found = assert_enqueued(session, fetch_preview, code="x7Kp")
        assert len(found) == 1 and found[0].id is not None  # the query autoflushed
        assert_enqueued(session, "fetch_preview", queue="previews")
        assert_not_enqueued(session, fetch_preview, code="other")
        assert_not_enqueued(session, notify_owner)
        assert count(db) == 0, "nothing is committed"

        summary = run_queued_jobs(session, jobs)

        # The transactional handler ran in this transaction, enqueued a follow-up, and
        # the follow-up ran in the same call.
        assert (summary.ran, summary.succeeded, summary.failed) == (2, 2, 0), summary
        with pytest.warns(DeprecationWarning, match="RunSummary.succeeded"):
            assert summary.done == 2
        assert [r.task for r in summary.runs] == [fetch_preview.name, notify_owner.name]
        assert session.get(app.Link, "x7Kp").url == "https://example.com#previewed"
        assert previews["seen"] == [(summary.runs[1].id, "x7Kp")]
        assert events == [
            ("started", "fetch_preview"),
            ("succeeded", "fetch_preview"),
            ("started", "notify_owner"),
            ("succeeded", "notify_owner"),
        ], "handlers run as a worker runs them"
        assert enqueued_jobs(session, jobs) == []
        assert_not_enqueued(session, fetch_preview)
        session.rollback()
    assert count(db) == 0 and count(db, app.Link) == 0


def test_failure_messages_list_what_was_enqueued(
    Session: Any, previews: dict[str, Any], jobs: Jobs
) -> None:
    notify_owner = previews["notify_owner"]
    with Session() as session:
        with pytest.raises(AssertionError, match="Nothing is enqueued"):
            assert_enqueued(session, notify_owner, code="a")
        # An enqueue_many row is written at the call; a job that enqueue added is listed
        # before any flush writes it (the helper's query autoflushes: so, without).
        session.enqueue_many(notify_owner, [{"code": "b"}], delay=60)
        with session.no_autoflush:
            [written] = assert_enqueued(session, notify_owner, code="b")
            assert written.id is not None and written.status == "scheduled"
            session.enqueue(notify_owner, code="a", tags=["x"])
            [pending] = assert_enqueued(session, notify_owner, code="a")
            assert pending.id is None and pending.status == "ready"
            with pytest.raises(AssertionError, match=r"code='a'.*ready, not flushed yet"):
                assert_enqueued(session, notify_owner, code="c")

        # An expected tuple is compared as the JSON list it would be.
        assert_enqueued(session, notify_owner, code="a", tags=["x"])
        assert_enqueued(session, notify_owner, code="a", tags=("x",))
        with pytest.raises(AssertionError) as failure:
            assert_enqueued(session, notify_owner, code="c")
        message = str(failure.value)
        assert "no job notify_owner(code='c') was enqueued" in message
        assert "Enqueued (2):" in message
        assert "notify_owner(code='a', tags=['x']) [queue 'mail', ready, id 2]" in message
        assert "notify_owner(code='b') [queue 'mail', scheduled, id 1]" in message

        with pytest.raises(AssertionError, match=r"on queue 'other'"):
            assert_enqueued(session, notify_owner, code="a", queue="other")
        with pytest.raises(AssertionError, match=r"expected no job .* found 1:\n  - "):
            assert_not_enqueued(session, notify_owner, code="a")
        session.rollback()


def test_objects_are_seen_without_autoflush(db: sa.Engine, previews: dict[str, Any]) -> None:
    notify_owner = previews["notify_owner"]
    with JobSession(db, autoflush=False) as session:
        session.enqueue(notify_owner, code="a")
        [job] = assert_enqueued(session, notify_owner, code="a")
        assert job.id is None
        assert session.new, "nothing was flushed behind the test's back"


def test_bad_expectations_are_errors_not_silent_mismatches(
    db: sa.Engine, Session: Any, previews: dict[str, Any]
) -> None:
    notify_owner = previews["notify_owner"]
    with Session() as session:
        with pytest.raises(TypeError, match=r"takes no parameter.*cdoe; its parameters are code"):
            assert_enqueued(session, notify_owner, cdoe="a")
        with pytest.raises(LookupError, match="unknown task 'nope'"):
            assert_enqueued(session, "nope")
    with JobSession(db) as bare, pytest.raises(TypeError, match="pass the task itself"):
        assert_enqueued(bare, "notify_owner")


def test_failures_retries_and_dead_jobs(Session: Any, jobs: Jobs) -> None:
    calls: list[int] = []

    @jobs.task(queue="q", max_attempts=3)
    def flaky() -> None:
        calls.append(current_job().attempts)
        raise ValueError("partner API down")

    @jobs.task(queue="q")
    def refuse() -> None:
        raise PermanentError("bad input")

    @jobs.task(queue="q")
    def later() -> None:
        raise Snooze(30)

    with Session() as session:
        session.enqueue(flaky)
        session.enqueue(refuse)
        session.enqueue(later)
        first = run_queued_jobs(session, jobs)
        # Time stands still in a transaction: the retry and the snooze wait.
        assert (first.ran, first.retried, first.dead, first.snoozed) == (3, 1, 1, 1), first
        assert "ValueError: partner API down" in first.errors[0]
        with pytest.raises(AssertionError, match="attempt 1 failed \\(retried\\)"):
            first.raise_errors()

        # The snoozed job (which would snooze forever) is cancelled, the retry made due.
        admin.cancel_jobs(session, jobs, task=later.name)
        rest = run_queued_jobs(session, jobs, include_scheduled=True)
        assert [r.outcome for r in rest.runs] == ["retried", "dead"]
        assert calls == [1, 2, 3]
        [dead] = admin.list_jobs(session, jobs, task=flaky.name)
        assert (dead.status, dead.attempts) == ("dead", 3)
        assert "partner API down" in (dead.last_error or "")
        session.rollback()


def test_snoozing_forever_is_stopped_by_max_runs(Session: Any, jobs: Jobs) -> None:
    @jobs.task
    def again() -> None:
        raise Snooze(1)

    with Session() as session:
        session.enqueue(again)
        with pytest.raises(RuntimeError, match="after 5 attempts"):
            run_queued_jobs(session, jobs, include_scheduled=True, max_runs=5)
        session.rollback()


def test_queues_filter_paused_queues_and_stale_objects(Session: Any, jobs: Jobs) -> None:
    ran: list[str] = []

    @jobs.task(queue="a")
    def on_a() -> None:
        ran.append("a")

    @jobs.task(queue="b")
    def on_b() -> None:
        ran.append("b")

    with Session() as session:
        job_a = session.enqueue(on_a)
        session.enqueue(on_b)
        admin.pause_queue(session, jobs, "b")
        assert run_queued_jobs(session, jobs).ran == 1
        assert ran == ["a"]
        with pytest.raises(sa.orm.exc.ObjectDeletedError):
            job_a.status  # noqa: B018 - the row of a finished job is gone
        admin.resume_queue(session, jobs, "b")
        assert run_queued_jobs(session, jobs, queues=["a"]).ran == 0
        assert run_queued_jobs(session, jobs, queues=["b"]).ran == 1
        assert ran == ["a", "b"]
        session.rollback()


# -- the plugin, as a user's test suite uses it -------------------------------------------

USER_APP = """
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqla_jobs import JobMixin, Jobs

class Base(DeclarativeBase):
    metadata = sa.MetaData(schema={schema!r})

class Job(JobMixin, Base):
    __tablename__ = "jobs"

class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    paid: Mapped[bool] = mapped_column(default=False)

jobs = Jobs(Job)

@jobs.task(transactional=True)
def mark_paid(order_id: int, session) -> None:
    session.get(Order, order_id).paid = True

def checkout(session, order_id):
    session.add(Order(id=order_id))
    session.enqueue("user_app.mark_paid", order_id=order_id)
    session.commit()
"""

USER_TESTS = """
import sqlalchemy as sa
from sqla_jobs.testing import assert_enqueued, run_queued_jobs
from user_app import Order, checkout, jobs, mark_paid

def test_checkout(sqla_jobs_session):
    checkout(sqla_jobs_session, 7)
    assert_enqueued(sqla_jobs_session, mark_paid, order_id=7)
    assert run_queued_jobs(sqla_jobs_session, jobs).succeeded == 1
    assert sqla_jobs_session.get(Order, 7).paid

def test_the_previous_test_left_nothing(sqla_jobs_connection):
    assert sqla_jobs_connection.execute(sa.select(sa.func.count()).select_from(Order)).scalar() == 0
    assert sqla_jobs_connection.execute(
        sa.select(sa.func.count()).select_from(jobs.table)
    ).scalar() == 0
"""


def run_user_suite(path: Path, ini: str) -> subprocess.CompletedProcess[str]:
    (path / "pytest.ini").write_text(f"[pytest]\n{ini}")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def schema_exists(engine: sa.Engine, schema: str) -> bool:
    with engine.connect() as conn:
        return schema in sa.inspect(conn).get_schema_names()


def test_pytest_plugin_creates_the_tables_it_is_pointed_at_and_rolls_back(
    tmp_path: Path, db: sa.Engine
) -> None:
    schema = f"sqla_jobs_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / "user_app.py").write_text(USER_APP.format(schema=schema))
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["sqla_jobs.pytest_plugin"]\n')
    try:
        # Not pointed at any metadata: the plugin creates nothing.
        result = run_user_suite(tmp_path, "")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "does not exist" in result.stdout
        assert not schema_exists(db, schema)

        result = run_user_suite(
            tmp_path,
            "sqla_jobs_metadata = user_app:Base\nsqla_jobs_registry = user_app:jobs\n",
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "2 passed" in result.stdout

        # The plugin's former name still works, with a warning that says where it went.
        (tmp_path / "conftest.py").write_text('pytest_plugins = ["sqla_jobs.testing"]\n')
        result = run_user_suite(
            tmp_path,
            "sqla_jobs_metadata = user_app:Base\nsqla_jobs_registry = user_app:jobs\n",
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "2 passed" in result.stdout
        assert "sqla_jobs.pytest_plugin" in result.stdout, result.stdout
    finally:
        with db.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_an_async_session_uses_the_helpers_through_run_sync(
    database_url: str, db: sa.Engine, previews: dict[str, Any], jobs: Jobs
) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    async def main() -> Any:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        try:
            async with make() as session:
                await session.enqueue_many("notify_owner", [{"code": "a"}])
                await session.run_sync(lambda s: assert_enqueued(s, "notify_owner", code="a"))
                summary = await session.run_sync(lambda s: run_queued_jobs(s, jobs))
                await session.rollback()
                return summary
        finally:
            await engine.dispose()

    summary = asyncio.run(main())
    assert summary.succeeded == 1 and summary.runs[0].task == previews["notify_owner"].name
    assert count(db) == 0

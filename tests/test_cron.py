"""Cron expressions that never fire or do not parse: refused where they enter, and never
fatal to a worker when a row holds one anyway."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs.cron import Schedule, check_cron
from sqla_jobs.periodic import add_schedule, enqueue_due, sync_declared

from .helpers import count, rows

#: (expression, what the ValueError must say)
BAD = [
    ("0 0 31 2 *", "never fires"),  # the 31st of February
    ("0 0 30 2 *", "never fires"),
    ("0 0 31 4,6,9,11 *", "never fires"),  # months with 30 days
    ("61 * * * *", "out of range"),
    ("* 24 * * *", "out of range"),
    ("* * * 13 *", "out of range"),
    ("* * * * * *", "expected five fields"),
    ("every minute", "expected five fields"),
]


@pytest.fixture
def tick(jobs: Jobs) -> Any:
    @jobs.task(queue="q", name="tick")
    def tick(n: int = 0) -> None:
        pass

    return tick


@pytest.mark.parametrize(("cron", "reason"), BAD)
def test_check_cron_says_why(cron: str, reason: str) -> None:
    with pytest.raises(
        ValueError, match=f"invalid cron expression {re.escape(repr(cron))}: .*{reason}"
    ):
        check_cron(cron)


def test_leap_day_fires() -> None:
    """A rare expression that does fire is accepted: never-firing means never."""
    assert check_cron("0 0 29 2 *") == "0 0 29 2 *"


@pytest.mark.parametrize(("cron", "reason"), BAD)
def test_periodic_refuses_with_the_reason(jobs: Jobs, tick: Any, cron: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        jobs.periodic(cron)(tick)
    assert not jobs.schedules


@pytest.mark.parametrize(("cron", "reason"), BAD)
def test_add_schedule_refuses_with_the_reason(
    db: sa.Engine, jobs: Jobs, tick: Any, cron: str, reason: str
) -> None:
    with db.begin() as conn, pytest.raises(ValueError, match=reason):
        add_schedule(conn, jobs, "r", tick, cron)
    assert rows(db, jobs.queries.schedules_table) == []


def write_around_the_api(db: sa.Engine, jobs: Jobs, **crons: str) -> None:
    """Schedule rows as an older version, a migration or a hand-written INSERT left them,
    all due a minute ago."""
    table = jobs.queries.schedules_table
    due = datetime.now(timezone.utc) - timedelta(minutes=1)
    with db.begin() as conn:
        conn.execute(
            sa.insert(table),
            [
                {"name": name, "task": "tick", "args": {}, "cron": cron, "next_run_at": due}
                for name, cron in crons.items()
            ],
        )


def test_enqueue_due_logs_and_skips_a_bad_row(
    db: sa.Engine, jobs: Jobs, tick: Any, caplog: pytest.LogCaptureFixture
) -> None:
    write_around_the_api(db, jobs, never="0 0 31 2 *", invalid="61 * * * *", good="* * * * *")
    with caplog.at_level("ERROR", logger="sqla_jobs.periodic"), db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
    assert [r.unique_key.split(":")[1] for r in rows(db)] == ["good"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("'never'" in m and "never fires" in m for m in messages), messages
    assert any("'invalid'" in m and "out of range" in m for m in messages), messages
    by_name = {r.name: r for r in rows(db, jobs.queries.schedules_table)}
    for name, reason in (("never", "never fires"), ("invalid", "out of range")):
        assert reason in by_name[name].last_error
        # No next tick can be computed: the row waits for someone to fix or remove it,
        # instead of failing at every pass.
        assert by_name[name].next_run_at is None
    assert by_name["good"].last_error is None
    assert by_name["good"].next_run_at > datetime.now(timezone.utc)

    caplog.clear()
    with caplog.at_level("ERROR", logger="sqla_jobs.periodic"), db.begin() as conn:
        assert enqueue_due(conn, jobs) == 0
    assert caplog.records == []


def test_sync_declared_logs_and_skips_a_bad_declaration(
    db: sa.Engine, jobs: Jobs, tick: Any, caplog: pytest.LogCaptureFixture
) -> None:
    jobs.periodic("*/5 * * * *", name="good")(tick)
    # Put in the registry around @jobs.periodic, which would have refused them.
    jobs.schedules["never"] = Schedule("never", tick.name, "0 0 31 2 *")
    jobs.schedules["invalid"] = Schedule("invalid", tick.name, "61 * * * *")
    write_around_the_api(db, jobs, stored="0 0 31 2 *")  # a run-time row: not sync's business
    with caplog.at_level("ERROR", logger="sqla_jobs.periodic"), db.begin() as conn:
        sync_declared(conn, jobs)
    messages = [r.getMessage() for r in caplog.records]
    assert any("'never'" in m and "never fires" in m for m in messages), messages
    assert any("'invalid'" in m and "out of range" in m for m in messages), messages
    names = sorted(r.name for r in rows(db, jobs.queries.schedules_table))
    assert names == ["good", "stored"]


def test_a_worker_survives_bad_schedules_and_runs_the_rest(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[int] = []

    @jobs.task(queue="q", name="work")
    def work(n: int) -> None:
        ran.append(n)

    # Good but not due while the test runs (every minute fired when the test crossed a
    # minute's turn, and the worker ran two jobs where it counted one).
    jobs.periodic("0 0 1 1 *", name="declared-good", args={"n": 2})(work)
    jobs.schedules["declared-never"] = Schedule("declared-never", work.name, "0 0 31 2 *")
    write_around_the_api(db, jobs, never="0 0 31 2 *", invalid="61 * * * *")
    with Session.begin() as session:
        session.enqueue(work, 1)
    with caplog.at_level("ERROR", logger="sqla_jobs"):
        worker = make_worker(jobs, db, queues=["q"], listen=False, poll_interval=0.05)
        assert worker.run_until_empty(timeout=30) == 1
    assert ran == [1]
    assert count(db) == 0
    messages = [r.getMessage() for r in caplog.records]
    for name in ("declared-never", "never", "invalid"):
        assert any(f"'{name}'" in m for m in messages), (name, messages)
    # A second run still works, and the declared good schedule was kept.
    with Session.begin() as session:
        session.enqueue(work, 3)
    assert make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=30) == 1
    assert ran == [1, 3]
    names = {r.name for r in rows(db, jobs.queries.schedules_table)}
    assert names == {"declared-good", "never", "invalid"}

"""An application host whose clock runs ahead of the database's: a job enqueued to run
now (no delay, or ``delay=0``) is claimable at once, on every enqueue path. Real
PostgreSQL; the host's clock moved by replacing the one reading the enqueue takes."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs._queries import interval


@pytest.mark.parametrize("path", ["session", "connection", "many", "copy"])
def test_delay_zero_from_a_host_ahead_is_claimable_at_once(
    Session: Any, db: sa.Engine, jobs: Jobs, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """``delay=0`` was counted from the host's clock: ten minutes ahead, the job was
    stored ``ready`` with a ``run_at`` the database had not reached, which no claim took
    (and no wake-up was planned for) until the database's clock got there."""

    @jobs.task(queue="q")
    def work(n: int) -> None: ...

    def ahead() -> datetime:
        return datetime.now(timezone.utc) + timedelta(minutes=10)

    for module in ("_tasks", "tasks", "_enqueue"):  # each reads the clock it imported
        monkeypatch.setattr(f"sqla_jobs.{module}._utcnow", ahead)
    now = work.with_options(delay=0)
    if path == "session":
        with Session.begin() as session:
            session.enqueue(now, n=1)
    elif path == "connection":
        with db.begin() as conn:
            jobs.enqueue(conn, now, n=1)
    else:
        rows = [{"n": i} for i in range(1 if path == "many" else 250)]
        with Session.begin() as session:
            session.enqueue_many(now, rows)
    with db.begin() as conn:  # the worker's own claim
        claimed = conn.execute(
            jobs.queries.claim,
            {"queue_name": "q", "limit": 300, "lease": interval(30), "worker": "w"},
        ).all()
    assert len(claimed) == (250 if path == "copy" else 1)

"""The dashboard judges times by the database's clock, not its own host's: a host whose
clock runs ahead must not call a live lease expired, nor write ages off by the skew.
Real PostgreSQL; the host's clock moved with a stand-in ``datetime``."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs.model import job_table

from . import app

pytest.importorskip("starlette")

TABLE = job_table(app.Job)


class _Ahead(datetime):
    """``datetime`` on a host whose clock runs two minutes ahead."""

    @classmethod
    def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + timedelta(minutes=2)


def _insert(db: sa.Engine, **values: Any) -> int:
    with db.begin() as conn:
        return int(
            conn.execute(
                sa.insert(TABLE)
                .values(task="t.work", queue="a", args={}, **values)
                .returning(TABLE.c.id)
            ).scalar_one()
        )


def test_a_dashboard_on_a_host_ahead_judges_times_by_the_database(
    db: sa.Engine, jobs: Jobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its host's clock two minutes ahead: a running job whose lease (by the database,
    which decides rescues) has 30 s to go was described as "its lease expired ...: the
    worker died or hangs", and a job ready for 10 s as ready for 2 minutes."""
    from starlette.testclient import TestClient

    from sqla_jobs.web import create_app

    @jobs.task(queue="a", name="t.work")
    def work() -> None: ...

    running = _insert(
        db,
        status="running",
        attempts=1,
        locked_by="w1",
        locked_until=sa.func.now() + sa.text("interval '30 seconds'"),
    )
    ready = _insert(db, status="ready", run_at=sa.func.now() - sa.text("interval '10 seconds'"))
    monkeypatch.setattr("sqla_jobs.web.app.datetime", _Ahead)
    monkeypatch.setattr("sqla_jobs._present.datetime", _Ahead)
    client = TestClient(create_app(jobs, db), base_url="http://localhost")
    page = client.get(f"/jobs/{running}").text
    assert "Running on w1" in page
    assert "worker died or hangs" not in page, "a live lease shown as expired"
    page = client.get(f"/jobs/{ready}").text
    assert "Ready since 1" in page and "Ready since 2m" not in page, "an age off by the skew"
    listing = client.get("/jobs").text
    assert "due 1" in listing and "due 2m" not in listing

"""Transactional handlers: their writes commit with the job's completion, exactly once.
Time is moved by the tests (rows' timestamps set into the past), never waited for."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    Jobs,
    Worker,
    create_engine,
    current_job,
)

from . import app
from .helpers import count, rows, running, wait_for


def test_transactional_handler_commits_with_its_completion(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", transactional=True, max_attempts=2)
    def create_link(code: str, session: Any) -> None:
        session.add(app.Link(code=code, url="u"))
        if code == "boom":
            raise RuntimeError("after the write")

    with pytest.raises(TypeError, match="must take a 'session'"):
        jobs.task(transactional=True, name="x")(lambda code: None)
    with Session.begin() as session:
        session.enqueue(create_link, "ok")
        session.enqueue(create_link, "boom")
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(wait_scheduled=5, timeout=20)
    assert [r.code for r in rows(db, app.Link)] == ["ok"]  # the failing run's write rolled back
    (dead,) = rows(db)
    assert dead.status == "dead" and dead.args == {"code": "boom"}


def test_transactional_handler_whose_lease_was_lost_rolls_back_and_the_second_run_commits(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    first_started = threading.Event()
    release_first = threading.Event()

    @jobs.task(queue="q", transactional=True)
    def create_link(session: Any) -> None:
        attempt = current_job().attempts
        session.add(app.Link(code=f"run-{attempt}", url="u"))
        session.flush()
        if attempt == 1:
            first_started.set()
            release_first.wait(10)

    with Session.begin() as session:
        session.enqueue(create_link)
    a = Worker(jobs, db, queues=["q"], lease=30, listen=False, name="A")
    with running(a):
        assert first_started.wait(10)
        # A stalls past its lease (the test moves the lease into the past); the rescuer
        # hands the job back and worker B runs it as attempt 2, to the end.
        with db.begin() as conn:
            conn.execute(
                sa.update(app.Job).values(locked_until=sa.func.now() - timedelta(seconds=1))
            )
            conn.execute(jobs.queries.rescue, {"limit": 10}).all()
        b_engine = create_engine(database_url)
        b = Worker(jobs, b_engine, queues=["q"], listen=False, name="B")
        assert b.run_until_empty(timeout=20) == 1
        b_engine.dispose()
        release_first.set()  # A wakes up and tries to commit its run
        wait_for(lambda: a.processed == 1)
    assert [r.code for r in rows(db, app.Link)] == ["run-2"]
    assert count(db) == 0

"""Cancelling a running job, and task timeouts. Time is moved by the tests (rows'
timestamps set into the past), never waited for."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import sqlalchemy as sa

from sqla_jobs import (
    Jobs,
    current_job,
)
from sqla_jobs.events import JobEvent
from sqla_jobs.worker import CANCEL_PAYLOAD

from . import app
from .helpers import rows, running


def test_a_running_handler_sees_that_it_was_cancelled(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen = threading.Event()
    started = threading.Event()
    events: list[JobEvent] = []
    jobs.events.connect("cancelled", events.append)

    @jobs.task(queue="q")
    def long() -> None:
        started.set()
        job = current_job()
        if job.cancelled.wait(10):
            seen.set()

    with Session.begin() as session:
        session.enqueue(long)
    worker = make_worker(jobs, db, queues=["q"], lease=30)
    with running(worker):
        assert worker.listening.wait(10)
        assert started.wait(10)
        with db.begin() as conn:
            conn.execute(
                sa.update(app.Job).values(
                    status="cancelled", locked_until=None, finished_at=sa.func.now()
                )
            )
            conn.execute(sa.select(sa.func.pg_notify(jobs.queries.channel, CANCEL_PAYLOAD)))
        # Told at once by the NOTIFY, not at the next heartbeat ten seconds away.
        assert seen.wait(3)
    (job,) = rows(db)
    assert job.status == "cancelled"  # its late completion changed nothing
    assert [e.name for e in events] == ["cancelled"]


def test_sync_handler_timeout_fails_the_job_and_tells_the_handler(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    stopped = threading.Event()

    @jobs.task(queue="q", timeout=0.3, max_attempts=1)
    def slow() -> None:
        if current_job().cancelled.wait(10):
            stopped.set()
        time.sleep(0.2)  # ...and it takes a moment to wind down

    with Session.begin() as session:
        session.enqueue(slow)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert stopped.is_set()
    (job,) = rows(db)
    assert job.status == "dead"
    assert "ran longer than its timeout of 0.3s" in job.last_error


def test_async_handler_timeout_cancels_it(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    cancelled = threading.Event()

    @jobs.task(queue="q", timeout=0.2, max_attempts=1)
    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with Session.begin() as session:
        session.enqueue(slow)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert cancelled.is_set()
    (job,) = rows(db)
    assert job.status == "dead"
    assert "TimeoutError" in job.last_error

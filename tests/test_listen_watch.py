"""A worker whose LISTEN hears nothing notices it, says so once, and polls; one that hears
says nothing. Both drivers, a real PostgreSQL.

Notifications are kept from the worker the way a producer can keep them from anyone: its
transaction runs with ``session_replication_role = replica``, under which the table's
NOTIFY trigger does not fire. To the worker that is what a pooler in transaction mode
does (jobs appear, no notification comes); behind a real PgBouncer:
tests/faults/test_pgbouncer.py.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession
from sqla_jobs.worker import _hearing as hearing

from .helpers import running, wait_for


def enqueue(engine: sa.Engine, task: Any, *, silent: bool) -> int:
    with JobSession(engine) as session:
        if silent:
            session.execute(sa.text("SET LOCAL session_replication_role = replica"))
        job = session.enqueue(task)
        session.flush()
        job_id = int(job.id)
        session.commit()
    return job_id


def deaf_lines(caplog: Any) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "its LISTEN hears nothing" in r.getMessage()]


@pytest.mark.parametrize("silent", [True, False], ids=["no-notifications", "notifications"])
def test_a_worker_tells_whether_its_listen_hears(
    db: sa.Engine, jobs: Jobs, make_worker: Any, caplog: Any, silent: bool
) -> None:
    ran: dict[int, float] = {}

    @jobs.task(queue="q")
    def work() -> None:
        from sqla_jobs import current_job

        ran[current_job().id] = time.monotonic()

    # Heard, a job must start well before the poll would have found it: a long poll keeps
    # that margin wide on a loaded machine (parallel test workers); deaf, the poll is what
    # finds the jobs, so it is short.
    poll = 0.4 if silent else 2.0
    worker = make_worker(jobs, db, queues=["q"], poll_interval=poll)
    waits: list[float] = []
    with caplog.at_level(logging.WARNING, "sqla_jobs.worker"), running(worker):
        assert worker.listening.wait(10)
        for _ in range(hearing.MISSES + 1):
            enqueued = time.monotonic()
            job_id = enqueue(db, work, silent=silent)
            wait_for(lambda: job_id in ran, timeout=10)  # noqa: B023
            waits.append(ran[job_id] - enqueued)
        if silent:
            wait_for(lambda: deaf_lines(caplog), timeout=hearing.GRACE + 5)
            wait_for(lambda: not worker.listening.is_set(), timeout=5)
            # Still found, by polling, within the poll interval.
            enqueued = time.monotonic()
            job_id = enqueue(db, work, silent=True)
            wait_for(lambda: job_id in ran, timeout=10)
            waits.append(ran[job_id] - enqueued)
        else:
            wait_for(lambda: worker.core.listen_watch.verdict is not None, timeout=5)
    lines = deaf_lines(caplog)
    if silent:
        assert len(lines) == 1
        text = lines[0].getMessage()
        assert "jobs came into q 3 times" in text
        assert "--no-listen" in text and "docs' PgBouncer section" in text
        assert worker.core.listen_watch.verdict is False
        # Found by the poll: typically within an interval (the median), and none waited
        # for a fallback slower than a few rounds (one sample stalled 1.6 s once, with the
        # whole suite beside it on 2 cores; a worker that stopped polling waits 10 s).
        assert statistics.median(waits) < poll + 0.5, waits
        assert max(waits) < 4 * poll + 0.5, waits
    else:
        assert lines == []
        assert worker.core.listen_watch.verdict is True
        assert max(waits) < poll / 2, waits  # woken by the notification, not the poll

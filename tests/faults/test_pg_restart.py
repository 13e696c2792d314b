"""PostgreSQL stopped with ``-m immediate`` mid-drain, and started again: twice, after
about 1 s and about 5 s down, with three workers and a steady supply of jobs.

Recovery, per worker and outage, is the time from the moment the server accepted
connections again (``CrashablePostgres.ready_at``) to that worker's first recorded run of a
job enqueued after that moment (``runs.enq >= ready_at``): a run that started before the
crash and recorded itself late, or a job claimed before the crash, proves nothing about
the worker having reconnected and claimed again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import figures, live_jobs, poll_until, runs, status_counts, wait_until
from .pg import CrashablePostgres
from .supply import SteadyProducer
from .workers import WorkerGroup

pytestmark = pytest.mark.faults

WORKERS = 3
#: The target: every worker runs a new job within this many seconds of the restart.
RECOVERY_TARGET = 2.0
OUTAGES = (1.0, 5.0)
#: How long to wait for a worker to come back before calling it lost.
GIVE_UP_AFTER = 40.0


def first_run_after(engine: sa.Engine, moment: float) -> dict[int, float]:
    """Per worker pid, the earliest run start of a job enqueued at or after ``moment``."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(app.Run.pid, sa.func.min(app.Run.mono))
            .where(app.Run.enq >= moment)
            .group_by(app.Run.pid)
        ).all()
    return {int(pid): float(mono) for pid, mono in rows}


def test_workers_resume_promptly_after_postgres_restarts(
    pg: CrashablePostgres, faults_db: sa.Engine, workers: Callable[..., WorkerGroup]
) -> None:
    group = workers(queues=["work"], concurrency=4, lease=5.0, poll_interval=1.0)
    pids = [p.pid for p in group.start(WORKERS)]
    group.wait_started()
    recovery: list[dict[int, float | None]] = []
    downtime: list[float] = []
    supply_delay: list[float | None] = []
    started = time.monotonic()
    # 6 jobs of 20 ms every 50 ms: about a tenth of what three workers of 4 slots can do,
    # so no backlog builds up and every worker gets some of every batch.
    with SteadyProducer(
        pg.url_for("faults-producer"), batch=6, interval=0.05, sleep=0.02
    ) as producer:
        wait_until(
            lambda: set(pids) <= set(first_run_after(faults_db, started)),
            timeout=30,
            what="every worker ran a job before the first outage",
        )
        for down in OUTAGES:
            stopped, ready = pg.restart_after(down)
            downtime.append(ready - stopped)
            poll_until(
                lambda ready=ready: set(pids) <= set(first_run_after(faults_db, ready)),
                timeout=GIVE_UP_AFTER,
            )
            firsts = first_run_after(faults_db, ready)
            recovery.append({pid: firsts[pid] - ready if pid in firsts else None for pid in pids})
            commit = producer.first_commit_after(ready)
            supply_delay.append(None if commit is None else commit - ready)
        produced_until = time.monotonic()
    wait_until(
        lambda: live_jobs(faults_db) == 0, timeout=60, what="the queue drains after the outages"
    )
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()

    ran = {r.job_id for r in runs(faults_db)}
    lost = sorted(set(producer.committed) - ran)
    left = status_counts(faults_db)
    worst = [max((s if s is not None else float("inf")) for s in per.values()) for per in recovery]
    fields: dict[str, object] = {
        "workers": WORKERS,
        "jobs_committed": len(producer.committed),
        "producer_failures": producer.failures,
        "supply_s": produced_until - started,
    }
    for down, took, per, delay in zip(OUTAGES, downtime, recovery, supply_delay, strict=True):
        key = f"down{down:g}s"
        fields[f"{key}_actual_s"] = took
        fields[f"{key}_recovery_s"] = [per[pid] for pid in pids]
        fields[f"{key}_first_enqueue_s"] = delay
    fields.update(lost=len(lost), rows_left=sum(left.values()), exited=len(exited))
    figures("pg_restart", **fields)

    assert not exited, f"worker processes exited: {exited}"
    assert not lost, f"{len(lost)} committed jobs never ran, e.g. {lost[:10]}"
    assert not left, f"job rows left after the drain: {left}"
    for down, per in zip(OUTAGES, recovery, strict=True):
        assert all(s is not None for s in per.values()), (
            f"after {down:g}s down, workers never ran a new job within {GIVE_UP_AFTER}s: "
            f"{per} (seconds after the server accepted connections, per pid)"
        )
    # The worker retries a failed statement on a fresh connection at once, and backs off
    # at most half a second while the server cannot be reached (core.retry_pause).
    assert max(worst) <= RECOVERY_TARGET, (
        f"every worker must run a new job within {RECOVERY_TARGET}s of PostgreSQL "
        f"accepting connections again; "
        f"measured (seconds, per worker pid): "
        + "; ".join(
            f"after {down:g}s down: {per}" for down, per in zip(OUTAGES, recovery, strict=True)
        )
    )

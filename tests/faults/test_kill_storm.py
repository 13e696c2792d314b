"""Kill storm: worker processes SIGKILLed over and over while they drain 10,000 jobs."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import analyse_runs, figures, live_jobs, runs, scalar, status_counts, wait_until
from .workers import KillStorm, WorkerGroup

pytestmark = pytest.mark.faults

JOBS = 10_000
#: Every fourth job is transactional (a ledger row that must exist exactly once).
BOOK_EVERY = 4
WORKERS = 4
LEASE = 2.0


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_kill_storm_loses_nothing_and_repeats_only_killed_work(
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
    isolation: str,
) -> None:
    """Under READ COMMITTED, and with REPEATABLE READ as the worker processes' default
    (``PGOPTIONS``): there a transactional run holds its job's row locked (the worker's
    fence), its lease not renewed while it does, and a process killed inside one leaves
    the job to the rescue once its lease has passed."""
    booked = [i for i in range(JOBS) if i % BOOK_EVERY == 0]
    with FaultsSession.begin() as session:
        # Mixed: blocks of 100 items, a quarter of each transactional, in claim (id) order.
        for start in range(0, JOBS, 100):
            block = range(start, start + 100)
            session.enqueue_many(app.work, [{"i": i} for i in block if i % BOOK_EVERY])
            session.enqueue_many(app.book, [{"i": i} for i in block if i % BOOK_EVERY == 0])

    group = workers(queues=["work"], concurrency=8, lease=LEASE, poll_interval=0.2)
    if isolation != "read committed":
        level = isolation.replace(" ", "\\ ")
        group.env = {**group.env, "PGOPTIONS": f"-c default_transaction_isolation={level}"}
    started = time.monotonic()
    group.start(WORKERS)
    with KillStorm(group, every=(0.5, 1.0)) as storm:
        wait_until(
            lambda: live_jobs(faults_db) == 0,
            timeout=120,
            interval=0.1,
            what="the queue drains through the kill storm",
        )
    drain = time.monotonic() - started
    exited = [(p.pid, p.returncode) for p in group.exited()]
    group.stop()

    all_runs = runs(faults_db)
    analysis = analyse_runs(all_runs, group.killed)
    ran = {r.item for r in all_runs}
    missing = sorted(set(range(JOBS)) - ran)
    with faults_db.connect() as conn:
        ledger = Counter(conn.execute(sa.select(app.Ledger.item)).scalars())
    no_ledger = [i for i in booked if ledger[i] == 0]
    twice = {i: n for i, n in ledger.items() if n > 1}
    left = status_counts(faults_db)
    figures(
        "kill_storm" if isolation == "read committed" else "kill_storm_repeatable_read",
        jobs=JOBS,
        transactional=len(booked),
        workers=WORKERS,
        lease_s=LEASE,
        kills=len(storm.kills),
        processes_started=len(group.all),
        runs=len(all_runs),
        jobs_run_more_than_once=analysis.repeated_jobs,
        duplicate_runs=analysis.extra_runs,
        explained_by_kill=analysis.explained,
        unexplained=len(analysis.unexplained),
        max_runs_per_job=analysis.max_runs,
        max_attempt=analysis.max_attempt,
        missing=len(missing),
        rows_left=sum(left.values()),
        ledger_missing=len(no_ledger),
        ledger_twice=len(twice),
        drain_s=drain,
        jobs_per_s=JOBS / drain,
    )

    assert not missing, f"{len(missing)} jobs never ran, e.g. items {missing[:10]}"
    assert not left, f"job rows left after the drain: {left}"
    assert not analysis.same_attempt_twice, (
        f"one claim ran twice: {analysis.same_attempt_twice[:10]}"
    )
    assert not analysis.unexplained, (
        f"{len(analysis.unexplained)} jobs ran again although no process that ran them was "
        f"killed, e.g. (job, [(attempt, pid)]) {analysis.unexplained[:5]}; killed pids: "
        f"{sorted(group.killed)}"
    )
    assert not no_ledger, f"transactional jobs without their ledger row: {no_ledger[:10]}"
    assert not twice, f"ledger rows written more than once: {dict(list(twice.items())[:10])}"
    assert scalar(faults_db, "SELECT count(*) FROM faults.ledger") == len(booked), (
        "one ledger row per transactional job"
    )
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 5, "the storm must have hit the drain"

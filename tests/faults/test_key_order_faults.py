"""Strict order per key (``key_order="fifo"``) through faults: worker processes SIGKILLed
over and over, and PostgreSQL stopped with ``-m immediate`` and restarted, while they drain
1,000 jobs over 50 keys."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import analyse_runs, figures, live_jobs, runs, status_counts, wait_until
from .pg import CrashablePostgres
from .workers import KillStorm, WorkerGroup

pytestmark = pytest.mark.faults

KEYS = 50
PER_KEY = 20
WORKERS = 4
LEASE = 2.0


def enqueue(FaultsSession: Any) -> None:
    """Interleaved, as the jobs of many accounts arrive; 50 ms each."""
    with FaultsSession.begin() as session:
        for seq in range(PER_KEY):
            session.enqueue_many(
                app.in_order,
                [{"key": f"k{k:02}", "seq": seq, "sleep": 0.05} for k in range(KEYS)],
            )


@dataclass
class Order:
    """What the runs say about each key's order."""

    done: list[Any]
    starts: list[Any]
    #: (key, seqs) whose completed runs are out of order.
    broken: list[Any]
    #: (key, seq, seq) of two completed runs of one key that overlapped.
    overlaps: list[Any]
    #: (key, items) whose runs (killed ones too) started an earlier job after a later one.
    went_back: list[Any]
    #: (key, seq) never completed.
    missing: list[Any]


def read_order(engine: sa.Engine) -> Order:
    with engine.connect() as conn:
        done = list(conn.execute(sa.select(app.KeyRun).order_by(app.KeyRun.started)))
    starts = [r for r in runs(engine) if r.task == "faults.in_order"]
    by_key: dict[str, list[Any]] = {}
    for r in done:
        by_key.setdefault(r.key, []).append(r)
    broken, overlaps = [], []
    for key, mine in by_key.items():
        seqs = [r.seq for r in mine]
        if seqs != sorted(seqs):
            broken.append((key, seqs))
        for before, after in itertools.pairwise(mine):
            if after.started < before.ended:
                overlaps.append((key, before.seq, after.seq))
    job_key = {r.job_id: r.key for r in done}
    went_back = []
    for key in by_key:
        mine = sorted((r for r in starts if job_key.get(r.job_id) == key), key=lambda r: r.at)
        items = [r.item for r in mine]
        if items != sorted(items):
            went_back.append((key, items))
    completed = {(r.key, r.seq) for r in done}
    every = [(f"k{k:02}", s) for k in range(KEYS) for s in range(PER_KEY)]
    missing = [m for m in every if m not in completed]
    return Order(done, starts, broken, overlaps, went_back, missing)


def assert_in_order(order: Order, left: dict[str, int]) -> None:
    assert not order.missing, f"jobs that never completed a run: {order.missing[:10]}"
    assert not left, f"job rows left after the drain: {left}"
    assert not order.broken, f"a key's jobs completed out of order: {order.broken[:3]}"
    assert not order.overlaps, f"two jobs of one key ran at once: {order.overlaps[:5]}"
    assert not order.went_back, f"a key started an earlier job again: {order.went_back[:3]}"


def test_kill_storm_never_breaks_the_order_of_a_key(
    faults_db: sa.Engine, FaultsSession: Any, workers: Callable[..., WorkerGroup]
) -> None:
    """Every job runs; per key, the runs start in the order of the key's jobs and never
    overlap (a killed head is rescued by its lease, runs again, and only then does its key
    go on); a job runs again only when a process that ran it was killed."""
    enqueue(FaultsSession)
    group = workers(queues=["ordered"], concurrency=8, lease=LEASE, poll_interval=0.2)
    started = time.monotonic()
    group.start(WORKERS)
    with KillStorm(group, every=(0.5, 1.0)) as storm:
        wait_until(
            lambda: live_jobs(faults_db) == 0,
            timeout=180,
            interval=0.1,
            what="the ordered queue drains through the kill storm",
        )
    drain = time.monotonic() - started
    group.stop()

    order = read_order(faults_db)
    # A claim lost with its process before the handler recorded anything leaves no run.
    analysis = analyse_runs(order.starts, group.killed)
    left = status_counts(faults_db)
    figures(
        "key_order_kill_storm",
        jobs=KEYS * PER_KEY,
        keys=KEYS,
        workers=WORKERS,
        kills=len(storm.kills),
        runs_started=len(order.starts),
        runs_completed=len(order.done),
        jobs_run_again=analysis.repeated_jobs,
        explained_by_kill=analysis.explained,
        drain_s=drain,
        jobs_per_s=KEYS * PER_KEY / drain,
    )
    assert_in_order(order, left)
    assert not analysis.unexplained, (
        f"jobs ran again with no kill to explain it: {analysis.unexplained[:5]}"
    )
    assert not analysis.same_attempt_twice, f"one claim ran twice: {analysis.same_attempt_twice}"
    assert len(storm.kills) >= 3, "the storm must have hit the drain"
    assert analysis.explained > 0, "no kill landed inside a run"


def test_postgres_restarts_never_break_the_order_of_a_key(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """PostgreSQL stopped at once (``-m immediate``: every backend killed, crash recovery at
    the next start) twice during the drain: no key runs two jobs at once or goes back, and
    every job completes. A run cut by the outage runs again (its attempt is spent), and
    its key waits for it."""
    enqueue(FaultsSession)
    group = workers(queues=["ordered"], concurrency=8, lease=LEASE, poll_interval=0.2)
    group.start(WORKERS)
    group.wait_started()

    def completed() -> int:
        return len(read_order(faults_db).done)

    for _ in range(2):
        target = completed() + 100
        wait_until(
            lambda: completed() >= target,  # noqa: B023 (read at once, in this iteration)
            timeout=60,
            what="a hundred more jobs completed before the outage",
        )
        pg.restart_after(1.0)
    wait_until(
        lambda: live_jobs(faults_db) == 0,
        timeout=180,
        interval=0.1,
        what="the ordered queue drains after the outages",
    )
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()
    order = read_order(faults_db)
    left = status_counts(faults_db)
    figures(
        "key_order_pg_restart",
        jobs=KEYS * PER_KEY,
        keys=KEYS,
        outages=2,
        runs_started=len(order.starts),
        runs_completed=len(order.done),
    )
    assert not exited, f"worker processes exited: {exited}"
    assert_in_order(order, left)

"""Every worker connection cut with ``pg_terminate_backend``, every half second for several
seconds, while three workers drain a queue that keeps being fed."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import analyse_runs, figures, live_jobs, runs, status_counts, wait_until
from .pg import CrashablePostgres
from .supply import SteadyProducer
from .workers import WorkerGroup

pytestmark = pytest.mark.faults

WORKERS = 3
INITIAL = 2000
#: pg_terminate_backend of every worker connection this often, for this long.
EVERY = 0.5
FOR = 6.0


def test_terminated_backends_lose_nothing_and_kill_no_worker(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    booked = list(range(0, INITIAL, 4))
    with FaultsSession.begin() as session:
        session.enqueue_many(app.work, [{"i": i, "sleep": 0.002} for i in range(1, INITIAL, 4)])
        session.enqueue_many(app.work, [{"i": i, "sleep": 0.002} for i in range(2, INITIAL, 4)])
        session.enqueue_many(app.work, [{"i": i, "sleep": 0.002} for i in range(3, INITIAL, 4)])
        session.enqueue_many(app.book, [{"i": i} for i in booked])

    group = workers(queues=["work"], concurrency=8, lease=2.0, poll_interval=0.5)
    procs = group.start(WORKERS)
    group.wait_started()
    terminated: list[int] = []
    rounds = 0
    # The supply keeps the drain going through the whole window: 150 jobs every 0.25 s.
    with SteadyProducer(
        pg.url_for("faults-producer"), batch=150, interval=0.25, sleep=0.002, first_item=INITIAL
    ) as producer:
        pause = threading.Event()
        window_end = time.monotonic() + FOR
        while time.monotonic() < window_end:
            began = time.monotonic()
            terminated.append(pg.terminate_backends("faults-worker-%"))
            rounds += 1
            pause.wait(max(0.0, EVERY - (time.monotonic() - began)))
        last_cut = time.monotonic()
    wait_until(
        lambda: live_jobs(faults_db) == 0,
        timeout=60,
        interval=0.1,
        what="the queue drains after the connections were cut",
    )
    drained_after = time.monotonic() - last_cut
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in procs if not p.alive]
    group.stop()

    all_runs = runs(faults_db)
    analysis = analyse_runs(all_runs, dead_pids=set())
    ran = {r.item for r in all_runs}
    with faults_db.connect() as conn:
        ledger = Counter(conn.execute(sa.select(app.Ledger.item)).scalars())
    lost_initial = sorted(set(range(INITIAL)) - ran)
    lost_supplied = sorted(set(producer.committed) - {r.job_id for r in all_runs})
    left = status_counts(faults_db)
    twice = {i: n for i, n in ledger.items() if n > 1}
    no_ledger = [i for i in booked if ledger[i] == 0]
    figures(
        "terminate_backends",
        workers=WORKERS,
        jobs=INITIAL + len(producer.committed),
        rounds=rounds,
        backends_terminated=sum(terminated),
        per_round=f"{min(terminated)}-{max(terminated)}",
        runs=len(all_runs),
        retried_runs=sum(1 for r in all_runs if r.attempt > 1),
        duplicate_runs=analysis.extra_runs,
        max_attempt=analysis.max_attempt,
        lost=len(lost_initial) + len(lost_supplied),
        rows_left=sum(left.values()),
        ledger_twice=len(twice),
        exited=len(exited),
        drain_after_last_cut_s=drained_after,
    )

    assert not exited, f"worker processes exited: {exited}"
    assert not lost_initial, f"jobs never ran: items {lost_initial[:10]}"
    assert not lost_supplied, f"committed jobs never ran: ids {lost_supplied[:10]}"
    assert not left, f"job rows left after the drain: {left}"
    assert not no_ledger, f"transactional jobs without their ledger row: {no_ledger[:10]}"
    assert not twice, f"ledger rows written more than once: {dict(list(twice.items())[:10])}"
    assert sum(terminated) >= rounds, "every round should have found worker connections"

"""Paused workers: processes frozen (SIGSTOP) for longer than their lease while they drain
a steady supply, then resumed (SIGCONT), as a VM freeze, a long GC pause or a laptop lid
does to them.

While a worker is frozen its leases pass, the other workers rescue its jobs and run them.
Resumed, it must not start a job it had claimed before the pause (claimed ahead, or
dispatched a moment before): by its own clock it renewed nothing for longer than the
lease, so it asks the heartbeat first, and runs only what is still its own. A handler
that was running during the pause is another matter (at least once: it runs again
elsewhere); it is told to stop at the next beat.

Every run records, in the handler, whether its claim still held (its row ``running``, at
its attempt, locked by its worker). A run that started after its claim was lost is a
stale start, unless a pause of its process fell between its start and that check.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from sqla_jobs import JobSession, create_engine

from . import faults_app as app
from .checks import figures, live_jobs, runs, status_counts, wait_until
from .workers import PauseStorm, WorkerGroup

pytestmark = pytest.mark.faults

WORKERS = 3
LEASE = 1.5
#: Longer than a lease and a rescue pass: the frozen worker's jobs go elsewhere.
PAUSE = 2.5 * LEASE
PAUSES = 16
#: Every fourth job is transactional (a ledger row that must exist exactly once).
BOOK_EVERY = 4


def story(job_runs: list[Any], storm: PauseStorm, group: WorkerGroup) -> str:
    """What is known of a job that ran more than once: its runs (monotonic times), the
    pauses of their processes near them, and the worker log lines that name it."""
    first = min(r.started for r in job_runs)
    lines = [f"job {job_runs[0].job_id}:"]
    for r in job_runs:
        lines.append(
            f"  run attempt={r.attempt} pid={r.pid} started={r.started - first:+.3f}"
            f" checked={r.checked - first:+.3f} held={r.held}"
        )
    pids = {r.pid for r in job_runs}
    for pid, stopped, continued in storm.pauses:
        if pid in pids and first - 10 <= stopped <= first + 10:
            lines.append(f"  pause pid={pid} {stopped - first:+.3f} .. {continued - first:+.3f}")
    needle = f"job {job_runs[0].job_id} ("
    for proc in group.all:
        for line in proc.log().splitlines():
            if needle in line:
                lines.append(f"  [{proc.pid}] {line}")
    return "\n".join(lines)


class Supply:
    """``batch`` jobs of queue ``pause`` every ``interval`` seconds, one transaction each,
    until stopped; ``items`` holds the item of every job whose COMMIT succeeded."""

    def __init__(self, url: str, batch: int = 20, interval: float = 0.04) -> None:
        self.engine = create_engine(url, poolclass=NullPool)
        self.batch, self.interval = batch, interval
        self.items: set[int] = set()
        self._next = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pause-supply", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            items = [next(self._next) for _ in range(self.batch)]
            with JobSession(self.engine) as session:
                session.enqueue_many(app.pause_work, [{"i": i} for i in items if i % BOOK_EVERY])
                session.enqueue_many(
                    app.pause_book, [{"i": i} for i in items if i % BOOK_EVERY == 0]
                )
                session.commit()
            self.items.update(items)

    def __enter__(self) -> Supply:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.engine.dispose()


def test_a_worker_resumed_after_a_pause_past_its_lease_starts_nothing_it_lost(
    faults_db: sa.Engine, pg: Any, workers: Callable[..., WorkerGroup]
) -> None:
    group = workers(queues=["pause"], concurrency=4, lease=LEASE, poll_interval=0.2)
    group.start(WORKERS)
    group.wait_started()
    storm = PauseStorm(group, pause=PAUSE, count=PAUSES, at_once=WORKERS - 1)
    with Supply(pg.url_for("faults-pause-supply")) as supply, storm:
        assert storm.done.wait(PAUSES * PAUSE + 60), "the pauses did not end"
    exited = [(p.pid, p.returncode) for p in group.exited()]
    wait_until(
        lambda: live_jobs(faults_db) == 0,
        timeout=60,
        interval=0.1,
        what="the queue drains after the pauses",
    )
    group.stop()
    held_back = sum(p.log().count("starts once a heartbeat says") for p in group.all)

    all_runs = [r for r in runs(faults_db) if r.task in ("faults.pause_work", "faults.pause_book")]
    stale = [
        r for r in all_runs if r.held is False and not storm.explains(r.pid, r.started, r.checked)
    ]
    by_job: dict[int, list[Any]] = defaultdict(list)
    for r in all_runs:
        by_job[r.job_id].append(r)
    twice_one_claim, unexplained, explained = [], [], 0
    for job_id, job_runs in by_job.items():
        job_runs.sort(key=lambda r: (r.attempt, r.started))
        counts = Counter(r.attempt for r in job_runs)
        twice_one_claim += [(job_id, a) for a, n in counts.items() if n > 1]
        # Every run but the last was running when its process was paused.
        for earlier, later in itertools.pairwise(job_runs):
            if storm.explains(earlier.pid, earlier.started, later.started):
                explained += 1
            else:
                unexplained.append((job_id, [(r.attempt, r.pid) for r in job_runs]))
    ran = {r.item for r in all_runs}
    missing = sorted(supply.items - ran)
    booked = {i for i in supply.items if i % BOOK_EVERY == 0}
    with faults_db.connect() as conn:
        ledger = Counter(conn.execute(sa.select(app.Ledger.item)).scalars())
    no_ledger = sorted(booked - set(ledger))
    ledger_twice = {i: n for i, n in ledger.items() if n > 1}
    left = status_counts(faults_db)
    figures(
        "sigstop",
        workers=WORKERS,
        lease_s=LEASE,
        pauses=len(storm.pauses),
        pause_s=PAUSE,
        jobs=len(supply.items),
        transactional=len(booked),
        runs=len(all_runs),
        stale_starts=len(stale),
        starts_held_for_a_beat=held_back,
        duplicate_runs=explained + len(unexplained),
        explained_by_pause=explained,
        unexplained=len(unexplained),
        missing=len(missing),
        rows_left=sum(left.values()),
        ledger_missing=len(no_ledger),
        ledger_twice=len(ledger_twice),
    )

    assert len(storm.pauses) == PAUSES
    assert not stale, (
        f"{len(stale)} runs started after their claim was lost, e.g. "
        f"{[(r.job_id, r.attempt, r.pid, round(r.checked - r.started, 3)) for r in stale[:5]]}"
    )
    assert not missing, f"{len(missing)} jobs never ran, e.g. items {missing[:10]}"
    assert not left, f"job rows left after the drain: {left}"
    assert not twice_one_claim, f"one claim ran twice: {twice_one_claim[:10]}"
    assert not unexplained, "runs repeated with no pause to explain them:\n" + "\n".join(
        story(by_job[job_id], storm, group) for job_id, _ in unexplained[:3]
    )
    assert not no_ledger, f"transactional jobs without their ledger row: {no_ledger[:10]}"
    assert not ledger_twice, f"ledger rows written twice: {dict(list(ledger_twice.items())[:10])}"
    assert not exited, f"worker processes exited: {exited}"

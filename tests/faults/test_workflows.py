"""Workflows under a kill storm: groups whose members finish at once on different workers,
and children enqueued while their parent runs."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError

from . import faults_app as app
from .checks import figures, live_jobs, poll_until, runs, status_counts, wait_until
from .workers import KillStorm, WorkerGroup

pytestmark = pytest.mark.faults

WORKERS = 4
LEASE = 2.0


def test_every_group_callback_gets_every_result_through_a_kill_storm(
    faults_db: sa.Engine, FaultsSession: Any, workers: Callable[..., WorkerGroup]
) -> None:
    """Groups of three members drained by four workers of which one is SIGKILLed every
    0.5-1 s. Members finish on the same ticks of the wall clock, so that the members of a
    group that run on different workers complete at the same moment. Every run of every
    callback must have been given all three results, in order."""
    groups, members = 150, 3
    with FaultsSession.begin() as session:
        for g in range(groups):
            app.jobs.group(
                session,
                [(app.member, app.member.args(g, k, align=0.05)) for k in range(members)],
                then=(app.collect, app.collect.args(g)),
            )

    group = workers(queues=["flow"], concurrency=8, lease=LEASE, poll_interval=0.2)
    started = time.monotonic()
    group.start(WORKERS)
    with KillStorm(group, every=(0.5, 1.0)) as storm:
        wait_until(
            lambda: live_jobs(faults_db) == 0,
            timeout=120,
            interval=0.1,
            what="every group and its callback drain through the kill storm",
        )
    drain = time.monotonic() - started
    exited = [(p.pid, p.returncode) for p in group.exited()]
    group.stop()

    with faults_db.connect() as conn:
        got = list(conn.execute(sa.select(app.GroupRun.group_no, app.GroupRun.results)))
    by_group: dict[int, list[Any]] = defaultdict(list)
    for g, results in got:
        by_group[g].append(results)
    wrong = {
        g: r for g, rs in by_group.items() for r in rs if r != [[g, k] for k in range(members)]
    }
    nulls = sum(1 for rs in by_group.values() for r in rs for v in r if v is None)
    never = sorted(set(range(groups)) - set(by_group))
    left = status_counts(faults_db)
    figures(
        "group_kill_storm",
        groups=groups,
        members=members,
        workers=WORKERS,
        lease_s=LEASE,
        kills=len(storm.kills),
        callback_runs=len(got),
        callbacks_run_twice=sum(1 for rs in by_group.values() if len(rs) > 1),
        wrong_results=len(wrong),
        null_results=nulls,
        never_ran=len(never),
        left={k: v for k, v in left.items() if k != "done"},
        drain_s=drain,
    )

    assert not never, f"callbacks that never ran: groups {never[:10]}"
    assert not wrong, f"callbacks given wrong results: {dict(list(wrong.items())[:5])}"
    assert set(left) <= {"done"}, f"jobs left unfinished: {left}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 3, "the storm must have hit the drain"


class TickKills:
    """SIGKILL a random worker of a group a few milliseconds after every ``period``-th
    second of the wall clock (``jitter``, a uniform range), and start a replacement, until
    :meth:`stop`: the jobs of the test finish on those ticks, so the kills land while
    their outcomes are being written."""

    def __init__(
        self, group: WorkerGroup, period: float, jitter: tuple[float, float] = (0.004, 0.02)
    ) -> None:
        self.group, self.period, self.jitter = group, period, jitter
        self.kills: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._rng = random.Random(20250119)
        self._thread = threading.Thread(target=self._run, name="tick-kills", daemon=True)

    def _run(self) -> None:
        while True:
            now = time.time()
            wait = self.period - now % self.period + self._rng.uniform(*self.jitter)
            if self._stop.wait(wait):
                return
            slot = self._rng.randrange(len(self.group.slots))
            old, new = self.group.kill_and_replace(slot)
            self.kills.append((time.monotonic(), old, new))

    def __enter__(self) -> TickKills:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_a_child_enqueued_while_its_parent_runs_never_waits_forever(
    faults_db: sa.Engine, workers: Callable[..., WorkerGroup]
) -> None:
    """Parents that end on the quarter-second ticks of the wall clock; as soon as a
    parent's run shows, the test enqueues a child after it (so the parent was claimed
    without children: its worker learns of the child only as it completes it). A worker
    is SIGKILLed a few milliseconds after every other tick, while those completions are
    being written. Every child linked to a live parent must run."""
    parents, tick = 200, 0.25
    with faults_db.begin() as conn:
        ids = [app.jobs.enqueue(conn, app.parent, i, align=tick) for i in range(parents)]
    group = workers(queues=["flow"], concurrency=16, lease=LEASE, poll_interval=0.2)
    started = time.monotonic()
    group.start(WORKERS)
    kids: dict[int, int] = {}
    late: list[int] = []
    with TickKills(group, period=3 * tick) as storm:
        deadline = time.monotonic() + 120
        while len(kids) + len(late) < parents:
            assert time.monotonic() < deadline, "parents did not all start"
            with faults_db.connect() as conn:
                seen = set(
                    conn.execute(
                        sa.select(app.Run.job_id).where(app.Run.task == "faults.parent")
                    ).scalars()
                )
            new = [
                (i, p) for i, p in enumerate(ids) if p in seen and p not in kids and i not in late
            ]
            # One transaction for the children of the parents that just started, a
            # savepoint each: a parent that finished (deleted) first refuses its child.
            with faults_db.begin() as conn:
                for i, parent_id in new:
                    try:
                        with conn.begin_nested():
                            kids[parent_id] = app.jobs.enqueue(
                                conn, app.kid.with_options(after=[parent_id]), i
                            )
                    except EnqueueError:
                        late.append(i)
            time.sleep(0.01)
        # No job may be left waiting: every parent ends, and releases its child.
        drained = poll_until(lambda: live_jobs(faults_db) == 0, timeout=30, interval=0.1)
    drain = time.monotonic() - started
    exited = [(p.pid, p.returncode) for p in group.exited()]
    group.stop()

    ran = {r.job_id for r in runs(faults_db) if r.task == "faults.kid"}
    never = sorted(k for k in kids.values() if k not in ran)
    with faults_db.connect() as conn:
        # A child never run, with its parent's state (the parent row may be gone).
        stuck = conn.execute(
            sa.text(
                "SELECT k.id, k.status, k.waiting, p.id AS parent, p.status AS parent_status "
                "FROM faults.jobs k LEFT JOIN faults.jobs p ON p.id = k.parents[1] "
                "WHERE k.id = ANY(:ids) ORDER BY k.id"
            ),
            {"ids": never},
        ).all()
    left = status_counts(faults_db)
    figures(
        "child_while_parent_runs",
        parents=parents,
        workers=WORKERS,
        lease_s=LEASE,
        kills=len(storm.kills),
        children=len(kids),
        parent_done_first=len(late),
        children_never_ran=len(never),
        drain_s=drain,
    )

    assert len(kids) >= parents // 2, "most children must have been enqueued while running"
    assert not never, f"children that never ran (id, status, waiting, parent): {stuck[:10]}"
    assert drained and set(left) <= {"done"}, f"jobs left unfinished: {left}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 3, "the kills must have hit the run"

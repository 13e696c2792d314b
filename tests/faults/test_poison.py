"""Poison jobs next to ordinary ones: each ends as README.md says, and the queue drains.

Two sets of workers run side by side:

* queue ``poison``: ``--processes 2`` under the supervisor, which restarts a child that
  dies. It gets the job that calls ``os._exit(1)`` (its worker process dies with it), the
  one with 5 MB of arguments, and 300 ordinary jobs;
* queue ``steady``: one plain worker process, which no poison kills. It gets the job that
  raises, the one that calls ``sys.exit(3)`` (a failure; the worker must survive it), the
  one that runs past its timeout, the one that runs past its lease while heartbeating
  (three and a half leases long), and 100 ordinary jobs. Kept apart so that a process
  killed by ``os._exit`` cannot blur what those must show (every attempt a failure of its
  own, a single run): the claims a dying process holds are lost with it, and come back
  after their lease with an attempt spent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import analyse_runs, figures, job_rows, live_jobs, runs, wait_until
from .workers import WorkerGroup

pytestmark = pytest.mark.faults

LEASE = 1.0
#: The huge job's argument: 50,000 strings of 100 characters, a little over 5 MB of JSON.
HUGE_ITEMS = 50_000


def test_poison_jobs_end_as_documented_and_the_queue_drains(
    faults_db: sa.Engine, FaultsSession: Any, workers: Callable[..., WorkerGroup]
) -> None:
    blob = ["x" * 100] * HUGE_ITEMS
    huge_bytes = len(json.dumps({"i": 3, "blob": blob, "size": HUGE_ITEMS}))
    assert huge_bytes >= 5_000_000
    with FaultsSession.begin() as session:
        raise_id = session.enqueue(app.poison_raise, i=1)
        os_exit_id = session.enqueue(app.poison_os_exit, i=2)
        huge_id = session.enqueue(app.huge, i=3, blob=blob, size=HUGE_ITEMS)
        sys_exit_id = session.enqueue(app.poison_sys_exit, i=4)
        timeout_id = session.enqueue(app.poison_timeout, i=5, seconds=3.0)
        long_id = session.enqueue(app.long_job, i=6, seconds=3.5 * LEASE)
        session.enqueue_many(app.work, [{"i": 1000 + k} for k in range(300)], queue="poison")
        session.enqueue_many(app.work, [{"i": 2000 + k} for k in range(100)], queue="steady")
        session.flush()
        ids = {
            "raise": raise_id.id,
            "os_exit": os_exit_id.id,
            "huge": huge_id.id,
            "sys_exit": sys_exit_id.id,
            "timeout": timeout_id.id,
            "long": long_id.id,
        }
    ordinary = set(range(1000, 1300)) | set(range(2000, 2100))

    poison = workers(
        queues=["poison"],
        concurrency=4,
        lease=LEASE,
        poll_interval=0.2,
        extra=["--processes", "2", "--grace-period", "5"],
        app="faults-poison",
    )
    steady = workers(
        queues=["steady"], concurrency=6, lease=LEASE, poll_interval=0.2, app="faults-steady"
    )
    started = time.monotonic()
    (supervisor,) = poison.start(1)
    (steady_worker,) = steady.start(1)
    wait_until(
        lambda: live_jobs(faults_db) == 0,
        timeout=90,
        interval=0.1,
        what="every job ends (done, or dead)",
    )
    drain = time.monotonic() - started
    children = {c.pid for c in psutil.Process(supervisor.pid).children()}
    supervisor_alive, steady_alive = supervisor.alive, steady_worker.alive
    restarts = supervisor.log().count("exited with 1; restarting")
    poison.stop()
    steady.stop()

    rows = {r.id: r for r in job_rows(faults_db)}
    all_runs = runs(faults_db)
    runs_of: dict[int, list[Any]] = {}
    for r in all_runs:
        runs_of.setdefault(r.job_id, []).append(r)
    for job_runs in runs_of.values():
        job_runs.sort(key=lambda r: r.attempt)

    def outcome(name: str) -> str:
        row = rows.get(ids[name])
        status = row.status if row is not None else "done"
        attempts = row.attempts if row is not None else "-"
        return f"{status}/{attempts}att/{len(runs_of.get(ids[name], []))}runs"

    exit_pids = {r.pid for r in runs_of.get(ids["os_exit"], [])}
    ordinary_runs = [r for r in all_runs if r.item in ordinary]
    analysis = analyse_runs(
        [r for r in all_runs if r.item in ordinary or r.job_id == ids["huge"]], exit_pids
    )
    missing = sorted(ordinary - {r.item for r in ordinary_runs})
    huge_runs = runs_of.get(ids["huge"], [])
    figures(
        "poison",
        raises=outcome("raise"),
        sys_exit=outcome("sys_exit"),
        os_exit=outcome("os_exit"),
        timeout=outcome("timeout"),
        past_lease=outcome("long"),
        huge_args=outcome("huge"),
        huge_mb=huge_bytes / 1e6,
        worker_restarts=restarts,
        ordinary=len(ordinary),
        ordinary_missing=len(missing),
        duplicate_runs=analysis.extra_runs,
        unexplained=len(analysis.unexplained),
        drain_s=drain,
    )

    def last_error(name: str) -> str:
        row = rows.get(ids[name])
        return (row.last_error or "") if row is not None else ""

    # The handler that raises: retried, then dead with the traceback.
    row = rows.get(ids["raise"])
    assert row is not None and row.status == "dead", outcome("raise")
    assert row.attempts == 3 and len(runs_of[ids["raise"]]) == 3, outcome("raise")
    assert "Traceback (most recent call last)" in last_error("raise"), last_error("raise")
    assert "ValueError: poison #1 raised on purpose" in last_error("raise"), last_error("raise")

    # sys.exit(3): a failure like any other, and the worker survives it.
    row = rows.get(ids["sys_exit"])
    assert row is not None and row.status == "dead", outcome("sys_exit")
    assert row.attempts == 2 and len(runs_of[ids["sys_exit"]]) == 2, outcome("sys_exit")
    assert "SystemExit: 3" in last_error("sys_exit"), last_error("sys_exit")
    assert steady_alive, f"the worker died of sys.exit:\n{steady_worker.log_tail()}"
    assert {r.pid for r in runs_of[ids["sys_exit"]]} == {steady_worker.pid}

    # os._exit(1): the process dies, the supervisor starts another, the job is retaken
    # after its lease and, out of attempts, ends dead with "lease expired".
    row = rows.get(ids["os_exit"])
    assert row is not None and row.status == "dead", outcome("os_exit")
    assert row.attempts == 2 and len(runs_of[ids["os_exit"]]) == 2, outcome("os_exit")
    assert "lease expired" in last_error("os_exit"), last_error("os_exit")
    assert len(exit_pids) == 2 and not exit_pids & children, (exit_pids, children)
    assert supervisor_alive and len(children) == 2, (supervisor_alive, children)
    assert restarts >= 2, supervisor.log_tail()

    # Past its timeout: each attempt fails (none completes), then dead with a TimeoutError.
    row = rows.get(ids["timeout"])
    assert row is not None and row.status == "dead", outcome("timeout")
    assert row.attempts == 2 and len(runs_of[ids["timeout"]]) == 2, outcome("timeout")
    assert "TimeoutError" in last_error("timeout"), last_error("timeout")

    # Three and a half leases long, heartbeating: done, once.
    assert ids["long"] not in rows, outcome("long")
    assert len(runs_of.get(ids["long"], [])) == 1, outcome("long")

    # 5 MB of arguments: done, and they arrived whole (the handler checks their length).
    assert ids["huge"] not in rows, f"{outcome('huge')}: {last_error('huge')[-500:]}"
    assert huge_runs and all(r.slot == HUGE_ITEMS for r in huge_runs), outcome("huge")

    # The ordinary jobs drained; any repeat comes from a process that os._exit killed.
    assert not missing, f"ordinary jobs never ran: {missing[:10]}"
    assert not analysis.unexplained, analysis.unexplained[:5]
    assert set(rows) == {ids["raise"], ids["sys_exit"], ids["os_exit"], ids["timeout"]}, {
        r.id: (r.task, r.status) for r in rows.values()
    }

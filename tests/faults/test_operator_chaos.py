"""An operator at work during a kill storm: cancels, retries, purges and pauses racing the
workers' claims and completions, while producers commit and roll back.

Every other fault test leaves the job rows to the workers. Here a thread in the test acts
on them the way the dashboard and ``sqla-jobs jobs`` do (:mod:`sqla_jobs.admin`, each
action its own transaction), at random, against running jobs most of all: a cancel that
lands while the job's transactional run is under way, a retry of a job whose cancelled run
may still be going, a purge of it, the queue paused and resumed between claims. The
transactional task's ledger row is the proof: it commits with the job's completion, so it
must exist exactly once for every job that ended done, and never for one that ended
cancelled, dead or purged, or whose enqueue rolled back.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import admin

from . import faults_app as app
from .checks import analyse_runs, figures, live_jobs, runs, wait_until
from .workers import KillStorm, PauseStorm, WorkerGroup

pytestmark = pytest.mark.faults

JOBS = 3_000
WORKERS = 3
LEASE = 2.0
#: Items of the jobs the operator's producer enqueues (committed or rolled back).
PRODUCED_FROM = 1_000_000


class RolledBack(Exception):
    """The producer's way to roll a transaction back."""


class Operator:
    """Acts on the job rows at random until :meth:`stop`, and remembers what it did."""

    def __init__(self, engine: sa.Engine, Session: Any, seed: int) -> None:
        self.engine = engine
        self.Session = Session
        self.rng = random.Random(seed)
        self.actions: Counter[str] = Counter()
        self.cancelled = 0
        self.retried = 0
        #: Items whose job rows the operator purged (their run, if any, must not commit).
        self.purged: set[int] = set()
        #: Items enqueued in transactions that committed, or rolled back.
        self.committed: set[int] = set()
        self.rolled_back: set[int] = set()
        self.errors: list[BaseException] = []
        self._next_item = PRODUCED_FROM
        self._resume_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def __enter__(self) -> Operator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        with self.engine.begin() as conn:
            admin.resume_queue(conn, app.jobs, "work")

    def _ids(self, conn: sa.Connection, status: str, most: int) -> list[int]:
        return list(
            conn.execute(
                sa.text("SELECT id FROM faults.jobs WHERE status = :s ORDER BY random() LIMIT :n"),
                {"s": status, "n": most},
            ).scalars()
        )

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.rng.uniform(0.01, 0.05)):
                self._act()
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)

    def _act(self) -> None:
        now = time.monotonic()
        if self._resume_at is not None and now >= self._resume_at:
            with self.engine.begin() as conn:
                admin.resume_queue(conn, app.jobs, "work")
            self._resume_at = None
            self.actions["resume"] += 1
            return
        roll = self.rng.random()
        k = self.rng.randint(1, 5)
        if roll < 0.35:
            # Mostly running jobs: a cancel in the middle of a run, or of its completion.
            with self.engine.begin() as conn:
                if ids := self._ids(conn, "running", k):
                    self.cancelled += admin.cancel_jobs(conn, app.jobs, ids)
            self.actions["cancel running"] += 1
        elif roll < 0.45:
            with self.engine.begin() as conn:
                if ids := self._ids(conn, "ready", k):
                    self.cancelled += admin.cancel_jobs(conn, app.jobs, ids)
            self.actions["cancel ready"] += 1
        elif roll < 0.70:
            # Cancelled jobs whose run may still be going are left alone by the retry.
            with self.engine.begin() as conn:
                if ids := self._ids(conn, "cancelled", k) + self._ids(conn, "dead", k):
                    self.retried += admin.retry_jobs(conn, app.jobs, ids)
            self.actions["retry"] += 1
        elif roll < 0.76:
            with self.engine.begin() as conn:
                rows = conn.execute(
                    sa.text(
                        "SELECT id, (args->>'i')::bigint AS i FROM faults.jobs"
                        " WHERE status = 'cancelled' ORDER BY random() LIMIT :n"
                    ),
                    {"n": k},
                ).all()
                # Only this thread changes a cancelled row, so what it read is what goes.
                if rows:
                    gone = admin.purge_jobs(
                        conn, app.jobs, [r.id for r in rows], status=["cancelled"]
                    )
                    assert gone == len(rows), (gone, rows)
            self.purged.update(r.i for r in rows)
            self.actions["purge"] += 1
        elif roll < 0.82:
            if self._resume_at is None:
                with self.engine.begin() as conn:
                    admin.pause_queue(conn, app.jobs, "work")
                self._resume_at = now + self.rng.uniform(0.1, 0.5)
                self.actions["pause"] += 1
        else:
            items = list(range(self._next_item, self._next_item + k))
            self._next_item += k
            commit = self.rng.random() < 0.5
            try:
                with self.Session.begin() as session:
                    for i in items:
                        session.enqueue(app.book, i=i, sleep=self.rng.uniform(0.0, 0.05))
                    session.flush()  # written, then rolled back with the rest
                    if not commit:
                        raise RolledBack
            except RolledBack:
                self.rolled_back.update(items)
            else:
                self.committed.update(items)
            self.actions["enqueue" if commit else "enqueue, rolled back"] += 1


@pytest.mark.parametrize(
    ("storm_kind", "isolation"),
    [("kills", "read committed"), ("pauses", "read committed"), ("kills", "repeatable read")],
)
def test_an_operator_racing_the_workers_through_a_storm_breaks_nothing(
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
    storm_kind: str,
    isolation: str,
) -> None:
    """Cancels (mostly of running jobs), retries, purges, pauses and producers, at random
    every 10-50 ms, over three workers SIGKILLed (``kills``) or frozen past their lease
    (``pauses``, SIGSTOP: their claims are rescued, and retried after a cancel, while
    their runs go on): a transactional job's ledger row exists once if its job ended done
    and never otherwise; no claim runs twice; what a rolled-back enqueue wrote never runs;
    nothing is left running or waiting. With REPEATABLE READ as the workers' default, a
    transactional run holds its job's row (the fence), and a cancel waits for the run."""
    rng = random.Random(20261207)
    with FaultsSession.begin() as session:
        for start in range(0, JOBS, 100):
            block = range(start, start + 100)
            # Half transactional; runs of 10-80 ms, long enough for cancels to land in.
            session.enqueue_many(
                app.work, [{"i": i, "sleep": rng.uniform(0.01, 0.08)} for i in block if i % 2]
            )
            session.enqueue_many(
                app.book,
                [{"i": i, "sleep": rng.uniform(0.01, 0.08)} for i in block if i % 2 == 0],
            )
    booked = {i for i in range(JOBS) if i % 2 == 0}

    group = workers(queues=["work"], concurrency=8, lease=LEASE, poll_interval=0.2)
    if isolation != "read committed":
        level = isolation.replace(" ", "\\ ")
        group.env = {**group.env, "PGOPTIONS": f"-c default_transaction_isolation={level}"}
    group.start(WORKERS)
    group.wait_started()
    started = time.monotonic()
    storm: KillStorm | PauseStorm
    if storm_kind == "kills":
        storm = KillStorm(group, every=(1.0, 2.0))
    else:
        # Past the lease by half: the claims a frozen worker holds are rescued meanwhile.
        storm = PauseStorm(group, pause=LEASE * 1.5, count=1_000, every=(0.5, 1.5))
    with storm, Operator(faults_db, FaultsSession, seed=7) as operator:
        wait_until(
            lambda: live_jobs(faults_db) == 0 or operator.errors,
            timeout=180,
            interval=0.2,
            what="the queue drains through the kill storm and the operator",
        )
    assert not operator.errors, f"the operator's action failed: {operator.errors[0]!r}"
    # What was produced after the operator's last look drains too, with no one acting.
    wait_until(lambda: live_jobs(faults_db) == 0, timeout=120, interval=0.1, what="the rest")
    drain = time.monotonic() - started
    exited = [(p.pid, p.returncode) for p in group.exited()]
    # A graceful stop waits for every handler, a cancelled one's run included: its
    # transaction has ended (rolled back, if the ledger is right) when the checks read.
    group.stop()

    all_runs = runs(faults_db)
    analysis = analyse_runs(all_runs, group.killed)
    with faults_db.connect() as conn:
        ledger = Counter(conn.execute(sa.select(app.Ledger.item)).scalars())
        left = {
            int(r.i): r.status
            for r in conn.execute(
                sa.text("SELECT (args->>'i')::bigint AS i, status FROM faults.jobs")
            )
        }
    transactional = booked | operator.committed | operator.rolled_back
    # Transactional jobs that ran and ended cancelled: runs an operator's cancel cut off,
    # whose ledger row must not be there.
    cut = {r.item for r in all_runs} & {i for i, s in left.items() if s == "cancelled"}
    cut &= transactional
    ended_done = {i for i in transactional if i not in left} - operator.purged
    ended_done -= operator.rolled_back
    missing = sorted(i for i in ended_done if ledger[i] == 0)
    twice = {i: n for i, n in ledger.items() if n > 1}
    not_done = {i: left.get(i, "purged") for i in ledger if i not in ended_done}
    ran_rolled_back = sorted({r.item for r in all_runs} & operator.rolled_back)
    still_live = {i: s for i, s in left.items() if s in ("scheduled", "ready", "running")}
    figures(
        f"operator_chaos_{storm_kind}" + ("" if isolation == "read committed" else "_rr"),
        jobs=JOBS,
        workers=WORKERS,
        lease_s=LEASE,
        storm=storm_kind,
        kills=len(storm.kills) if isinstance(storm, KillStorm) else 0,
        pauses=len(storm.pauses) if isinstance(storm, PauseStorm) else 0,
        actions=dict(operator.actions),
        cancelled=operator.cancelled,
        retried=operator.retried,
        purged=len(operator.purged),
        produced=len(operator.committed),
        rolled_back=len(operator.rolled_back),
        left=dict(Counter(left.values())),
        runs=len(all_runs),
        ledger_rows=sum(ledger.values()),
        transactional_runs_cut_by_cancel=len(cut),
        ended_done=len(ended_done),
        drain_s=drain,
    )

    assert not analysis.same_attempt_twice, (
        f"one claim ran twice: {analysis.same_attempt_twice[:10]}"
    )
    assert not twice, f"ledger rows written more than once: {dict(list(twice.items())[:10])}"
    assert not missing, f"jobs that ended done without their ledger row: {missing[:10]}"
    assert not not_done, (
        f"ledger rows of jobs that did not end done (item: status): "
        f"{dict(list(not_done.items())[:10])}"
    )
    assert not ran_rolled_back, f"jobs of rolled-back enqueues ran: {ran_rolled_back[:10]}"
    assert not still_live, f"jobs left unfinished: {dict(list(still_live.items())[:10])}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    # The scenario happened: the storm hit, and the operator's cancels met running jobs.
    assert len(storm.kills if isinstance(storm, KillStorm) else storm.pauses) >= 3
    assert operator.actions["cancel running"] >= 20 and operator.cancelled >= 20
    if isolation == "read committed":
        # Under REPEATABLE READ a cancel waits for the run that holds the row, and mostly
        # finds it done; under READ COMMITTED it cuts runs off.
        assert len(cut) >= 10
    assert operator.retried >= 5 and operator.purged and operator.rolled_back

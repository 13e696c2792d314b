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

The same operator then meets what else rides on the job rows: a queue in key order (no
two jobs of a key at once), workflows (no child before its parents' success), result
waits (each hears its own job's end), and durable steps (each checkpointed once).
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import JobFailedError, admin

from . import faults_app as app
from . import test_steps_faults as steps_faults
from .checks import (
    analyse_runs,
    figures,
    live_jobs,
    poll_until,
    runs,
    status_counts,
    wait_until,
)
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

    def __init__(
        self,
        engine: sa.Engine,
        Session: Any,
        seed: int,
        queue: str = "work",
        produce: bool = True,
        purges: bool = True,
        purge_latest: bool = False,
    ) -> None:
        self.engine = engine
        self.Session = Session
        self.queue = queue
        self.produce = produce
        self.purges = purges
        self.purge_latest = purge_latest
        self.rng = random.Random(seed)
        self.actions: Counter[str] = Counter()
        self.cancelled = 0
        self.retried = 0
        #: The job rows the operator purged, by id: their arguments (a run of one, if any,
        #: must not commit). A purge leaves a job cancelled while it ran until its lease
        #: has passed (``skipped`` counts those).
        self.purged: dict[int, dict[str, Any]] = {}
        self.purge_skipped = 0
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
            admin.resume_queue(conn, app.jobs, self.queue)

    def retry_rest(self, conn: sa.Connection) -> None:
        """Retry every cancelled or dead job of the queue (a job cancelled while it ran
        waits for its lease)."""
        self.retried += admin.retry_jobs(conn, app.jobs, queue=self.queue)

    def purge(self, conn: sa.Connection, status: str, most: int | None) -> None:
        """Purge (as the dashboard does: :func:`admin.act`) up to ``most`` jobs of the
        queue in ``status``, chosen at random or (``purge_latest``) the last to end first
        (what the operator just cancelled, whose handler may run on), and remember what
        went."""
        order = "finished_at DESC" if self.purge_latest else "random()"
        rows = conn.execute(
            sa.text(
                "SELECT id, args FROM faults.jobs WHERE queue = :q AND status = :s"
                f" ORDER BY {order} LIMIT :n"
            ),
            {"q": self.queue, "s": status, "n": most},
        ).all()
        if rows:
            report = admin.act(conn, app.jobs, "purge", admin.Selection([r.id for r in rows]))
            gone = set(report.acted)
            self.purged.update((r.id, r.args) for r in rows if r.id in gone)
            self.purge_skipped += len(report.skipped)

    def _ids(self, conn: sa.Connection, status: str, most: int) -> list[int]:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id FROM faults.jobs WHERE queue = :q AND status = :s"
                    " ORDER BY random() LIMIT :n"
                ),
                {"q": self.queue, "s": status, "n": most},
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
                admin.resume_queue(conn, app.jobs, self.queue)
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
            # Ready, or scheduled: retrying, or a child held for its parents (after=).
            status = self.rng.choice(["ready", "scheduled"])
            with self.engine.begin() as conn:
                if ids := self._ids(conn, status, k):
                    self.cancelled += admin.cancel_jobs(conn, app.jobs, ids)
            self.actions["cancel ready"] += 1
        elif roll < 0.70:
            # Cancelled jobs whose run may still be going are left alone by the retry.
            with self.engine.begin() as conn:
                if ids := self._ids(conn, "cancelled", k) + self._ids(conn, "dead", k):
                    self.retried += admin.retry_jobs(conn, app.jobs, ids)
            self.actions["retry"] += 1
        elif roll < 0.76 and self.purges:
            with self.engine.begin() as conn:
                self.purge(conn, "cancelled", k)
            self.actions["purge"] += 1
        elif roll < 0.82:
            if self._resume_at is None:
                with self.engine.begin() as conn:
                    admin.pause_queue(conn, app.jobs, self.queue)
                self._resume_at = now + self.rng.uniform(0.1, 0.5)
                self.actions["pause"] += 1
        elif self.produce:
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


@dataclass
class Operated:
    """What :func:`operate` leaves: the storm and the operator (what they did), the
    workers (stopped), how long it all took, and the processes that exited unkilled."""

    storm: KillStorm
    operator: Operator
    group: WorkerGroup
    drain: float
    exited: list[tuple[int, int | None]]


def operate(
    faults_db: sa.Engine,
    workers: Callable[..., WorkerGroup],
    operator: Operator,
    *,
    concurrency: int,
    settle: Callable[[sa.Connection], None],
) -> Operated:
    """Three workers of ``concurrency`` slots on the operator's queue, SIGKILLed every
    1-2 s while the operator acts, until the queue drains or 12 s pass; then ``settle``
    (in a transaction of its own, every 0.2 s: retry or purge what the operator left
    cancelled or dead) until no job row is left, and the workers stopped gracefully."""
    group = workers(
        queues=[operator.queue], concurrency=concurrency, lease=LEASE, poll_interval=0.2
    )
    group.start(WORKERS)
    group.wait_started()
    started = time.monotonic()
    with KillStorm(group, every=(1.0, 2.0)) as storm, operator:
        poll_until(lambda: live_jobs(faults_db) == 0 or bool(operator.errors), timeout=12)
    assert not operator.errors, f"the operator's action failed: {operator.errors[0]!r}"

    def settled() -> bool:
        with faults_db.begin() as conn:
            settle(conn)
        return not status_counts(faults_db)

    wait_until(settled, timeout=120, interval=0.2, what="the queue empties once settled")
    drain = time.monotonic() - started
    exited = [(p.pid, p.returncode) for p in group.exited()]
    group.stop()
    return Operated(storm, operator, group, drain, exited)


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
    purged = {int(args["i"]) for args in operator.purged.values()}
    ended_done = {i for i in transactional if i not in left} - purged
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
        purges_left_for_their_lease=operator.purge_skipped,
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


KEYS = 30
#: 0.2 s each: a head cancelled while it runs runs on long after the cancel.
PER_KEY = 10


@pytest.mark.parametrize("queue", ["ordered", "ordered_on"], ids=["hold", "continue"])
def test_an_operator_racing_a_queue_in_key_order_never_runs_two_of_a_key_at_once(
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
    queue: str,
) -> None:
    """``key_order="fifo"`` (a dead or cancelled head holds its key) with the operator at
    work through a kill storm: heads cancelled while they run (their handlers run on),
    retried and purged, the queue paused. Then every cancelled or dead job is purged
    until the queue is empty. Per key, runs never overlap (a cancelled head's handler
    included) and, where a failed head holds its key (``hold``), never start an earlier
    job after a later one (with ``continue`` a retried head runs after the jobs that went
    on past it); every job not purged ran to its end. Before a purge (``hold``) and a
    claim (``continue``) waited for the lease of a head cancelled while it ran, the key's
    next job started beside that head's handler."""
    with FaultsSession.begin() as session:
        for seq in range(PER_KEY):
            session.enqueue_many(
                app.in_order.with_options(queue=queue),
                [{"key": f"k{k:02}", "seq": seq, "sleep": 0.2} for k in range(KEYS)],
            )
    operator = Operator(
        faults_db, FaultsSession, seed=11, queue=queue, produce=False, purge_latest=True
    )

    def purge_the_rest(conn: sa.Connection) -> None:
        # The cancelled heads and what they held: purged as their leases pass.
        operator.purge(conn, "cancelled", None)
        operator.purge(conn, "dead", None)

    run = operate(faults_db, workers, operator, concurrency=8, settle=purge_the_rest)
    storm, group, drain, exited = run.storm, run.group, run.drain, run.exited

    with faults_db.connect() as conn:
        done = list(conn.execute(sa.select(app.KeyRun).order_by(app.KeyRun.started)))
    starts = [r for r in runs(faults_db) if r.task == "faults.in_order"]
    analysis = analyse_runs(starts, group.killed)
    by_key: dict[str, list[Any]] = {}
    for r in done:
        by_key.setdefault(r.key, []).append(r)
    overlaps = [
        (key, before.seq, after.seq)
        for key, mine in by_key.items()
        for before, after in itertools.pairwise(mine)
        if after.started < before.ended
    ]
    if queue == "ordered_on":
        # Going on past failed heads, a job of the key that the operator retried comes
        # before a later one cancelled while it ran, and may start beside that one's
        # handler (documented); a later job never starts beside an earlier one's.
        overlaps = [(key, first, then) for key, first, then in overlaps if then > first]
    job_key = {r.job_id: r.key for r in done}
    job_key.update((job_id, args["key"]) for job_id, args in operator.purged.items())
    went_back = []
    for key in by_key:
        items = [r.item for r in sorted(starts, key=lambda r: r.at) if job_key.get(r.job_id) == key]
        if items != sorted(items):
            went_back.append((key, items))
    purged = {(args["key"], args["seq"]) for args in operator.purged.values()}
    completed = {(r.key, r.seq) for r in done}
    every = {(f"k{k:02}", s) for k in range(KEYS) for s in range(PER_KEY)}
    missing = sorted(every - completed - purged)
    figures(
        f"operator_key_order_{'hold' if queue == 'ordered' else 'continue'}",
        jobs=KEYS * PER_KEY,
        keys=KEYS,
        workers=WORKERS,
        kills=len(storm.kills),
        actions=dict(operator.actions),
        cancelled=operator.cancelled,
        retried=operator.retried,
        purged=len(operator.purged),
        purges_left_for_their_lease=operator.purge_skipped,
        runs_started=len(starts),
        runs_completed=len(done),
        drain_s=drain,
    )
    assert not overlaps, f"two jobs of one key ran at once (key, seq, seq): {overlaps[:5]}"
    if queue == "ordered":
        assert not went_back, f"a key started an earlier job after a later one: {went_back[:3]}"
    assert not missing, f"jobs neither purged nor run to their end: {missing[:10]}"
    assert not analysis.same_attempt_twice, f"one claim ran twice: {analysis.same_attempt_twice}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 3
    assert operator.actions["cancel running"] >= 20 and operator.cancelled >= 20
    # Heads cancelled while they ran were purged, once their leases had passed.
    assert operator.purge_skipped >= 1 and operator.retried >= 1


CHAINS = 250


def test_an_operator_racing_workflows_never_runs_a_child_before_its_parents_succeed(
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """Chains of three transactional steps (``after=``) and, every fifth chain, a fourth
    step after the first steps of two chains, through a kill storm, with the operator
    cancelling running, ready and held jobs (a cancelled parent cancels what waits on it)
    and retrying cancelled and dead ones (a retried parent brings its children back,
    waiting for it again); then everything cancelled or dead is retried until the queue
    is empty. Every run of a child starts after each of its parents' successful ends (the
    parent's ``FlowDone`` row, committed with its completion), and every job succeeds
    exactly once."""
    rng = random.Random(5)
    parents: dict[int, list[int]] = {}
    with FaultsSession.begin() as session:
        firsts = []
        for chain in range(CHAINS):
            step = app.flow_step
            a = session.enqueue(step, chain=chain, level=0, sleep=rng.uniform(0.03, 0.12))
            b = session.enqueue(
                step.with_options(after=[a]), chain=chain, level=1, sleep=rng.uniform(0.03, 0.12)
            )
            c = session.enqueue(
                step.with_options(after=[b]), chain=chain, level=2, sleep=rng.uniform(0.03, 0.12)
            )
            firsts.append(a)
            links = [(b, [a]), (c, [b])]
            if chain % 5 == 4:
                both = [firsts[chain - 1], a]
                d = session.enqueue(step.with_options(after=both), chain=chain, level=3, sleep=0.02)
                links.append((d, both))
            session.flush()
            parents.update((child.id, [p.id for p in ps]) for child, ps in links)
        all_ids = set(parents) | {a.id for a in firsts}  # the children, and the first steps
    jobs_count = len(all_ids)

    # 12 slots for about 80 s of work: the drain lasts long enough for the storm.
    operator = Operator(
        faults_db, FaultsSession, seed=13, queue="flowchaos", produce=False, purges=False
    )
    # A parent's retry brings back what it cancelled; a cancelled run's retry waits for
    # its lease.
    run = operate(faults_db, workers, operator, concurrency=4, settle=operator.retry_rest)
    storm, group, drain, exited = run.storm, run.group, run.drain, run.exited

    with faults_db.connect() as conn:
        done_rows = list(conn.execute(sa.select(app.FlowDone)))
    done: dict[int, list[float]] = {}
    for r in done_rows:
        done.setdefault(r.job_id, []).append(r.ended)
    starts = [r for r in runs(faults_db) if r.task == "faults.flow_step"]
    analysis = analyse_runs(starts, group.killed)
    twice = {j: len(e) for j, e in done.items() if len(e) > 1}
    never = sorted(all_ids - set(done))
    early = [
        (r.job_id, p)
        for r in starts
        for p in parents.get(r.job_id, ())
        if not any(ended < r.at for ended in done.get(p, ()))
    ]
    figures(
        "operator_workflows",
        jobs=jobs_count,
        workers=WORKERS,
        kills=len(storm.kills),
        actions=dict(operator.actions),
        cancelled=operator.cancelled,
        retried=operator.retried,
        runs_started=len(starts),
        succeeded=len(done),
        drain_s=drain,
    )
    assert not early, f"child runs started before a parent succeeded (child, parent): {early[:5]}"
    assert not twice, f"jobs that succeeded more than once: {dict(list(twice.items())[:10])}"
    assert not never, f"jobs that never succeeded: {never[:10]}"
    assert not analysis.same_attempt_twice, f"one claim ran twice: {analysis.same_attempt_twice}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 3
    assert operator.actions["cancel running"] >= 20 and operator.cancelled >= 20


ANSWERS = 600


def test_result_waiters_hear_every_end_an_operator_and_a_kill_storm_cause(
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """600 jobs that keep their results, each waited for by ``jobs.result`` (half of the
    waiters LISTEN, half poll) while the operator cancels, retries and purges and the
    workers are SIGKILLed. No wait runs into its timeout: each returns its own job's
    value, or raises ``JobFailedError`` for a job that was cancelled or dead when it
    looked, or ``LookupError`` for one the operator purged."""
    rng = random.Random(17)
    with faults_db.begin() as conn:
        ids = {
            app.jobs.enqueue(conn, app.answer, i, sleep=rng.uniform(0.05, 0.15)): i
            for i in range(ANSWERS)
        }
    group = workers(queues=["answers"], concurrency=4, lease=LEASE, poll_interval=0.2)
    group.start(WORKERS)
    group.wait_started()
    outcomes: dict[int, tuple[str, Any]] = {}
    todo = list(ids)
    lock = threading.Lock()

    def wait_for_results(listen: bool) -> None:
        while True:
            with lock:
                if not todo:
                    return
                job_id = todo.pop()
            try:
                value = app.jobs.result(faults_db, job_id, timeout=60, listen=listen)
            except JobFailedError as exc:
                outcomes[job_id] = ("failed", exc.status)
            except LookupError as exc:
                outcomes[job_id] = ("gone", str(exc))
            except BaseException as exc:
                outcomes[job_id] = ("error", repr(exc))
            else:
                outcomes[job_id] = ("value", value)

    waiters = [
        threading.Thread(target=wait_for_results, args=(n % 2 == 0,), daemon=True) for n in range(8)
    ]
    started = time.monotonic()
    operator = Operator(faults_db, FaultsSession, seed=19, queue="answers", produce=False)
    with KillStorm(group, every=(1.0, 2.0)) as storm, operator:
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(timeout=180)
    assert not operator.errors, f"the operator's action failed: {operator.errors[0]!r}"
    waited = time.monotonic() - started
    group.stop()

    purged = set(operator.purged)
    kinds = Counter(kind for kind, _ in outcomes.values())
    errors = {j: o for j, o in outcomes.items() if o[0] == "error"}
    wrong = {
        j: o[1]
        for j, o in outcomes.items()
        if o[0] == "value" and o[1] != {"i": ids[j], "twice": 2 * ids[j]}
    }
    failed_as = Counter(o[1] for o in outcomes.values() if o[0] == "failed")
    gone_unpurged = sorted(j for j, o in outcomes.items() if o[0] == "gone" and j not in purged)
    figures(
        "operator_result_waits",
        jobs=ANSWERS,
        workers=WORKERS,
        kills=len(storm.kills),
        actions=dict(operator.actions),
        outcomes=dict(kinds),
        failed_as=dict(failed_as),
        purged=len(purged),
        waited_s=waited,
    )
    assert len(outcomes) == ANSWERS, f"waits that never returned: {ANSWERS - len(outcomes)}"
    assert not errors, f"waits that raised something else: {dict(list(errors.items())[:5])}"
    assert not wrong, f"waits that got another job's value: {dict(list(wrong.items())[:5])}"
    assert set(failed_as) <= {"cancelled", "dead"}, failed_as
    assert not gone_unpurged, f"waits told a job that was not purged is gone: {gone_unpurged}"
    assert len(storm.kills) >= 3
    assert kinds["value"] >= ANSWERS // 2 and kinds["failed"] >= 10


DURABLE = 400


def test_an_operator_racing_durable_steps_leaves_every_step_done_once(
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """Durable jobs of three steps of 30 ms (ordinary, transactional, ordinary) through a
    kill storm, with the operator cancelling running, ready and scheduled jobs and
    retrying cancelled and dead ones (no purges); then everything cancelled or dead is
    retried until the queue is empty. A retried job goes on from its checkpoints: every
    step is checkpointed done exactly once, by an execution that returned, nothing runs
    a step again after its checkpoint, and the transactional step's write exists once,
    the one its checkpoint names."""
    with FaultsSession.begin() as session:
        session.enqueue_many(app.steps_three, [{"i": i, "seconds": 0.03} for i in range(DURABLE)])
    ids = steps_faults.job_ids(faults_db, app.steps_three)
    operator = Operator(
        faults_db, FaultsSession, seed=23, queue="steps", produce=False, purges=False
    )
    run = operate(faults_db, workers, operator, concurrency=4, settle=operator.retry_rest)
    storm, drain, exited = run.storm, run.drain, run.exited

    execs = steps_faults.execs_by_step(faults_db)
    done = {
        key: [r for r in rows if r.kind == "run" and r.state == "done"]
        for key, rows in steps_faults.histories(faults_db).items()
    }
    effects: dict[int, list[Any]] = {}
    for e in steps_faults.table(faults_db, app.StepEffect):
        effects.setdefault(e.job_id, []).append(e)
    # Repeats are not checked against kills here (a cancel cuts runs too): only what a
    # repeat must never do.
    a = steps_faults.analyse_steps(ids, execs, done, effects, {})
    figures(
        "operator_durable_steps",
        jobs=DURABLE,
        workers=WORKERS,
        kills=len(storm.kills),
        actions=dict(operator.actions),
        cancelled=operator.cancelled,
        retried=operator.retried,
        executions=a.executions,
        max_attempt=a.max_attempt,
        drain_s=drain,
    )
    assert not a.not_checkpointed_once, (
        f"steps not checkpointed done exactly once: {a.not_checkpointed_once[:5]}"
    )
    assert not a.bad_checkpoint, f"checkpoints of no finished execution: {a.bad_checkpoint[:5]}"
    assert not a.ran_after_checkpoint, (
        f"steps executed again after their checkpoint: {a.ran_after_checkpoint[:5]}"
    )
    assert not a.same_attempt_twice, f"one claim ran a step twice: {a.same_attempt_twice[:5]}"
    assert not a.effects_not_once, f"writes not there exactly once: {a.effects_not_once[:5]}"
    assert not a.bad_effect, f"writes that are not the checkpointed step's: {a.bad_effect[:3]}"
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert len(storm.kills) >= 3
    assert operator.actions["cancel running"] >= 20 and operator.cancelled >= 20

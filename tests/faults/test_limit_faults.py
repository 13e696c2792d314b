"""Queue limits through faults: ``sqla-jobs worker`` processes SIGKILLed over and over (and
PostgreSQL stopped with ``-m immediate`` and restarted) while they drain limited queues.

* ``concurrency=4``, and ``key_concurrency=1`` over 20 keys: at no moment more than 4 runs
  of the capped queue, or more than one of a key, in progress;
* ``fair=True``: a burst of one tenant, enqueued first, does not keep 20 small tenants
  waiting behind it (how many of the burst's jobs are claimed before the small tenants'
  last one, as ``benchmarks/limits.py`` measures it);
* ``rate="50/1s"``: in no window of one second more than 50 starts;

and, in each, no job lost. Read from three places, none of them the library's own records:

* ``limit_runs``: every run of a handler, its start committed before the work begins and
  its end stamped when the work is done (so a run in progress is known from its start to
  its end, or, when its process was SIGKILLed, to the moment of the kill, when it stopped
  at the latest; the job's row counted as running until its lease was rescued, later);
* ``job_events``: every change of status of the queues' jobs, by a trigger, with
  ``clock_timestamp()`` in the statement that made it (a claim, a rescue, a retry, a
  completion), only what committed;
* ``rate_stamps``: every start the rate-limited claims appended to the queue's rate log,
  by a trigger (the log itself is trimmed to its window).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from . import faults_app as app
from .checks import figures, live_jobs, status_counts, wait_until
from .pg import CrashablePostgres
from .workers import KillStorm, WorkerGroup

pytestmark = pytest.mark.faults

LEASE = 2.0
#: The concurrency scenario: jobs of the capped queue, and of 20 keys; seconds each.
CAPPED_JOBS = 300
KEYS = 20
PER_KEY = 15
SLEEP = 0.05
#: The fair-share scenario: one tenant's burst, then small tenants.
BURST = 3_000
SMALL_TENANTS = 20
SMALL_EACH = 20
#: The bound the fair share must keep, through kills: every small tenant's jobs have all
#: been claimed before this many of the burst's have (without fairness: all 3,000). The
#: claims share their jobs between the 21 tenants in turn, so while the small tenants have
#: jobs the burst gets about one in 21: about 20 (one per job of a small tenant) before
#: the last small job, four times that with the margin.
FAIR_BOUND = 4 * SMALL_EACH
RATED_JOBS = 300


# -- reading what happened -----------------------------------------------------------------


def limit_runs(engine: sa.Engine, queue: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(app.LimitRun.__table__)
                .where(app.LimitRun.queue == queue)
                .order_by(app.LimitRun.started)
            )
        )


def job_events(engine: sa.Engine, queue: str) -> list[Any]:
    """The queue's events in the order they happened (their statement's clock)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(app.JobEvent.__table__)
                .where(app.JobEvent.queue == queue)
                .order_by(app.JobEvent.at, app.JobEvent.id)
            )
        )


def completed_runs(engine: sa.Engine, queue: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(app.LimitRun)
                .where(app.LimitRun.queue == queue, app.LimitRun.ended.is_not(None))
            ).scalar_one()
        )


@dataclass
class Overlap:
    """The most runs in progress at once, when, and which."""

    most: int
    at: float | None
    runs: list[tuple[int, int, int]]


def most_at_once(intervals: Iterable[tuple[float, float, Any]]) -> Overlap:
    """Sweep ``(start, end, what)`` intervals: the most in progress at one moment (a run
    that ends when another starts is not counted with it)."""
    points = []
    for start, end, what in intervals:
        points.append((start, 1, what))
        points.append((end, 0, what))
    # At one moment, ends before starts.
    points.sort(key=lambda p: (p[0], p[1]))
    current: dict[int, Any] = {}
    best = Overlap(0, None, [])
    for moment, is_start, what in points:
        if is_start:
            current[id(what)] = what
            if len(current) > best.most:
                best = Overlap(
                    len(current), moment, [(w.job_id, w.attempt, w.pid) for w in current.values()]
                )
        else:
            current.pop(id(what), None)
    return best


@dataclass
class Runs:
    """A queue's handler runs, each with the moment it stopped at the latest."""

    all: list[Any]
    #: (start, end, run): the end recorded, or, for a run cut by a kill, the kill.
    intervals: list[tuple[float, float, Any]]
    #: Runs with no end whose process was never killed (the recording has a hole).
    unended: list[Any]
    #: Runs cut by a kill.
    cut: int


def read_runs(engine: sa.Engine, queue: str, killed_at: dict[int, float]) -> Runs:
    rows = limit_runs(engine, queue)
    intervals, unended, cut = [], [], 0
    for r in rows:
        if r.ended is not None:
            intervals.append((r.started, r.ended, r))
        elif r.pid in killed_at:
            cut += 1
            intervals.append((r.started, max(r.started, killed_at[r.pid]), r))
        else:
            unended.append(r)
    return Runs(rows, intervals, unended, cut)


def kill_moments(storm: KillStorm) -> dict[int, float]:
    """Per killed pid, a moment (``time.monotonic()``) by which it was dead: read after the
    kill was reaped (and its replacement started)."""
    return {old: at for at, old, _ in storm.kills}


def db_running_at_once(events: list[Any], by_key: bool = False) -> dict[str | None, int]:
    """From the events: the most rows of the queue (or of each key) in ``running`` at once,
    a row running from the claim that made it so until the statement that moved it on
    (completion, rescue, retry). A claim that counted the rows running saw every change
    committed before it, and those changes' statements ran before it: so at the moment of a
    claim, the rows running by these events are at most what it counted."""
    running: dict[str | None, set[int]] = defaultdict(set)
    most: dict[str | None, int] = defaultdict(int)
    for e in events:
        key = e.key if by_key else None
        if e.old == "running":
            running[key].discard(e.job_id)
        if e.new == "running":
            running[key].add(e.job_id)
            most[key] = max(most[key], len(running[key]))
    return dict(most)


@dataclass
class Outcome:
    """Whether every job of a queue ran to its end, once."""

    #: Items whose job never got to a completed run, or was never deleted (completed).
    missing: list[int]
    not_deleted: list[int]
    #: Jobs run more than once, and those of them that no fault explains.
    repeated: int
    unexplained: list[tuple[int, list[tuple[int, int, float, float | None]]]]
    #: (job id, attempt) recorded twice: one claim ran twice.
    same_attempt_twice: list[tuple[int, int]]


def outcome(
    runs: Runs,
    events: list[Any],
    items: set[int],
    killed: set[int],
    outages: list[tuple[float, float]],
) -> Outcome:
    """A job may run again only after an earlier run of it was cut: its process was
    killed, or the server was down while it ran or while its completion was to be written
    (between the run's start and the lease after the server was back)."""
    by_job: dict[int, list[Any]] = defaultdict(list)
    for r in runs.all:
        by_job[r.job_id].append(r)
    done_items = {r.item for r in runs.all if r.ended is not None}
    deleted = {e.job_id for e in events if e.new == "deleted"}
    job_item = {r.job_id: r.item for r in runs.all}

    def explained(r: Any) -> bool:
        if r.pid in killed:
            return True
        return any(
            stopped - LEASE <= (r.ended or r.started) and r.started <= ready + LEASE
            for stopped, ready in outages
        )

    repeated, unexplained, twice = 0, [], []
    for job_id, mine in by_job.items():
        mine.sort(key=lambda r: (r.attempt, r.started))
        attempts = Counter(r.attempt for r in mine)
        twice += [(job_id, a) for a, n in attempts.items() if n > 1]
        if len(mine) > 1:
            repeated += 1
            if not all(explained(r) for r in mine[:-1]):
                unexplained.append((job_id, [(r.attempt, r.pid, r.started, r.ended) for r in mine]))
    return Outcome(
        missing=sorted(items - done_items),
        not_deleted=sorted(job_item[j] for j in set(by_job) - deleted),
        repeated=repeated,
        unexplained=unexplained,
        same_attempt_twice=twice,
    )


def assert_nothing_lost(name: str, result: Outcome, left: dict[str, int]) -> None:
    assert not result.missing, f"{name}: items that never completed a run: {result.missing[:10]}"
    assert not result.not_deleted, (
        f"{name}: jobs ran but never completed: {result.not_deleted[:10]}"
    )
    assert not left, f"job rows left after the drain: {left}"
    assert not result.same_attempt_twice, (
        f"{name}: one claim ran twice: {result.same_attempt_twice[:10]}"
    )
    assert not result.unexplained, (
        f"{name}: jobs ran again with no kill or outage to explain it: {result.unexplained[:5]}"
    )


class RestartWhen(threading.Thread):
    """Restart PostgreSQL (``-m immediate``, ``down`` seconds) once ``ready()`` says so,
    from a thread, while the kill storm goes on.

    No worker is started while the server is down (a ``sqla-jobs worker`` that cannot
    connect at its start exits, as it should: that is not what these tests are about):
    the restart holds the group's lock (``WorkerGroup._lock``), which the storm's
    kill-and-replace takes, and waits first for every live worker to have started."""

    def __init__(
        self,
        pg: CrashablePostgres,
        group: WorkerGroup,
        ready: Callable[[], bool],
        down: float = 1.0,
    ) -> None:
        super().__init__(name="restart-when", daemon=True)
        self.pg, self.group, self.ready, self.down = pg, group, ready, down
        self.outage: tuple[float, float] | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        try:
            while not self._done.wait(0.05):
                if self.ready():
                    with self.group._lock:
                        deadline = time.monotonic() + 30
                        while not all(p.starts() >= 1 for p in self.group.slots):
                            if time.monotonic() > deadline:
                                raise AssertionError("workers not started before the restart")
                            time.sleep(0.02)
                        self.outage = self.pg.restart_after(self.down)
                    return
        except BaseException as exc:  # reported by the test
            self.error = exc

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=120)


def drained(engine: sa.Engine) -> bool:
    """No job left (False while the server is down)."""
    try:
        return live_jobs(engine) == 0
    except sa.exc.DBAPIError:
        return False


def drain(
    faults_db: sa.Engine,
    group: WorkerGroup,
    *,
    timeout: float,
    restart: RestartWhen | None = None,
    what: str,
) -> tuple[KillStorm, float]:
    """Start the workers, kill one every 0.5-1 s (and restart the server once, with
    ``restart``) until no job is left; return the storm and the drain's seconds."""
    started = time.monotonic()
    with KillStorm(group, every=(0.5, 1.0)) as storm:
        if restart is not None:
            restart.start()
        try:
            wait_until(lambda: drained(faults_db), timeout=timeout, interval=0.1, what=what)
        finally:
            if restart is not None:
                restart.stop()
    took = time.monotonic() - started
    return storm, took


# -- the tests -----------------------------------------------------------------------------


def test_concurrency_limits_hold_through_kills_and_a_restart(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """``concurrency=4`` and ``key_concurrency=1``, drained together by 4 workers of 4
    slots each (16 slots: both limits bind all along), one worker SIGKILLed every 0.5-1 s,
    and PostgreSQL stopped at once and restarted in the middle: at no moment more than 4
    runs of the capped queue in progress, nor 2 of one key; every job completed."""
    limit = app.CAPPED_CONCURRENCY
    with FaultsSession.begin() as session:
        session.enqueue_many(app.capped, [{"i": i, "sleep": SLEEP} for i in range(CAPPED_JOBS)])
        # In runs of 5 jobs of one key, so that the oldest ready jobs share keys.
        keyed = []
        for block in range(PER_KEY // 5):
            for k in range(KEYS):
                keyed += [
                    {"i": k * PER_KEY + block * 5 + j, "key": f"k{k:02}", "sleep": SLEEP}
                    for j in range(5)
                ]
        session.enqueue_many(app.per_key, keyed)

    group = workers(queues=["capped", "per_key"], concurrency=4, lease=LEASE, poll_interval=0.2)
    group.start(4)
    restart = RestartWhen(
        pg, group, lambda: completed_runs(faults_db, "capped") >= CAPPED_JOBS // 3
    )
    storm, took = drain(
        faults_db,
        group,
        timeout=120,
        restart=restart,
        what="the limited queues drain through kills and a restart",
    )
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()
    assert restart.error is None, f"the restart failed: {restart.error!r}"
    assert restart.outage is not None, "the server was never restarted during the drain"

    killed_at = kill_moments(storm)
    capped = read_runs(faults_db, "capped", killed_at)
    keyed_runs = read_runs(faults_db, "per_key", killed_at)
    capped_events = job_events(faults_db, "capped")
    keyed_events = job_events(faults_db, "per_key")
    at_once = most_at_once(capped.intervals)
    per_key: dict[str, list[tuple[float, float, Any]]] = defaultdict(list)
    for interval in keyed_runs.intervals:
        per_key[interval[2].key].append(interval)
    key_at_once = {key: most_at_once(iv) for key, iv in per_key.items()}
    worst_key = max(key_at_once, key=lambda k: key_at_once[k].most)
    db_capped = db_running_at_once(capped_events).get(None, 0)
    db_keyed = db_running_at_once(keyed_events, by_key=True)
    outages = [restart.outage]
    capped_outcome = outcome(capped, capped_events, set(range(CAPPED_JOBS)), group.killed, outages)
    keyed_outcome = outcome(
        keyed_runs, keyed_events, set(range(KEYS * PER_KEY)), group.killed, outages
    )
    left = status_counts(faults_db)
    figures(
        "limits_concurrency",
        capped_jobs=CAPPED_JOBS,
        keyed_jobs=KEYS * PER_KEY,
        workers=4,
        slots=16,
        kills=len(storm.kills),
        outage_s=restart.outage[1] - restart.outage[0],
        capped_runs=len(capped.all),
        capped_cut_by_kill=capped.cut,
        capped_most_at_once=at_once.most,
        capped_mean_at_once=sum(e - b for b, e, _ in capped.intervals) / took,
        capped_db_running_most=db_capped,
        keyed_runs=len(keyed_runs.all),
        keyed_cut_by_kill=keyed_runs.cut,
        keyed_mean_at_once=sum(e - b for b, e, _ in keyed_runs.intervals) / took,
        keyed_most_at_once_per_key=key_at_once[worst_key].most,
        keyed_db_running_most_per_key=max(db_keyed.values()),
        keys_running_at_once=most_at_once(keyed_runs.intervals).most,
        jobs_run_again=capped_outcome.repeated + keyed_outcome.repeated,
        drain_s=took,
    )
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert not capped.unended and not keyed_runs.unended, (
        "runs without an end in processes never killed: "
        f"{(capped.unended + keyed_runs.unended)[:5]}"
    )
    assert_nothing_lost("capped", capped_outcome, left)
    assert_nothing_lost("per_key", keyed_outcome, left)
    assert at_once.most <= limit, (
        f"concurrency={limit}, yet {at_once.most} runs of the queue were in progress at "
        f"{at_once.at:.3f} (monotonic): (job, attempt, pid) {at_once.runs}; kills: {storm.kills}"
    )
    assert db_capped <= limit, (
        f"concurrency={limit}, yet {db_capped} rows of the queue were running at once"
    )
    assert key_at_once[worst_key].most <= 1, (
        f"key_concurrency=1, yet {key_at_once[worst_key].most} runs of key {worst_key!r} were in "
        f"progress at {key_at_once[worst_key].at:.3f}: {key_at_once[worst_key].runs}"
    )
    assert max(db_keyed.values()) <= 1, (
        f"key_concurrency=1, yet rows of one key ran at once: {db_keyed}"
    )
    # The limits bound: the queue ran at its limit, and the keys side by side.
    assert db_capped == limit, f"the capped queue never ran {limit} at once ({db_capped}): no test"
    assert most_at_once(keyed_runs.intervals).most > 1, "the keys never ran side by side"
    assert len(storm.kills) >= 3, "the storm must have hit the drain"
    assert capped.cut + keyed_runs.cut > 0, "no kill landed inside a run"


def test_fair_share_bound_holds_through_kills(
    faults_db: sa.Engine, FaultsSession: Any, workers: Callable[..., WorkerGroup]
) -> None:
    """``fair=True``: one tenant's 3,000 jobs enqueued first, then 20 tenants of 20; 3
    workers, one SIGKILLed every 0.5-1 s. Every small tenant's jobs are all claimed before
    :data:`FAIR_BOUND` of the burst's are (without fairness: after all 3,000), and a small
    tenant's job rescued from a killed worker is claimed again before that many more of the
    burst's; nothing is lost."""
    small = [
        (f"t{t:02}", t * SMALL_EACH + j) for t in range(SMALL_TENANTS) for j in range(SMALL_EACH)
    ]
    with FaultsSession.begin() as session:
        session.enqueue_many(
            app.fair_share,
            [{"i": BURST * 10 + i, "tenant": "burst", "sleep": 0.005} for i in range(BURST)],
        )
        # The small tenants' jobs, interleaved as they arrive, after the whole burst.
        session.enqueue_many(
            app.fair_share,
            [
                {"i": i, "tenant": tenant, "sleep": 0.005}
                for tenant, i in sorted(small, key=lambda s: s[1] % SMALL_EACH)
            ],
        )
    group = workers(queues=["fair_share"], concurrency=8, lease=LEASE, poll_interval=0.2)
    group.start(3)
    storm, took = drain(faults_db, group, timeout=120, what="the fair queue drains through kills")
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()

    events = job_events(faults_db, "fair_share")
    claims = [e for e in events if e.new == "running"]
    # The order of first claims: how many of the burst's jobs had been claimed when the
    # last small tenant's job was claimed for the first time.
    first_claim: dict[int, int] = {}
    for n, e in enumerate(claims):
        first_claim.setdefault(e.job_id, n)
    small_jobs = {e.job_id for e in claims if e.key != "burst"}
    last_small = max(first_claim[j] for j in small_jobs)
    burst_before = len({e.job_id for e in claims[:last_small] if e.key == "burst"})
    # The claims (one transaction each) until then: how many took a burst job.
    statements: dict[int, list[str]] = defaultdict(list)
    for e in claims[: last_small + 1]:
        statements[e.txid].append(e.key)
    with_burst = sum(1 for keys in statements.values() if "burst" in keys)
    sizes = sorted(len(keys) for keys in statements.values())
    # A small job back in ready (rescued after its worker was killed, or retried): burst
    # jobs claimed before it was claimed again.
    after_rescue: list[int] = []
    back: dict[int, int] = {}
    burst_claims_so_far = 0
    for e in events:
        if e.new == "running":
            if e.key == "burst":
                burst_claims_so_far += 1
            elif e.job_id in back:
                after_rescue.append(burst_claims_so_far - back.pop(e.job_id))
        elif e.old == "running" and e.new in ("ready", "scheduled") and e.key != "burst":
            back[e.job_id] = burst_claims_so_far
    killed_at = kill_moments(storm)
    fair_runs = read_runs(faults_db, "fair_share", killed_at)
    items = {BURST * 10 + i for i in range(BURST)} | {i for _, i in small}
    result = outcome(fair_runs, events, items, group.killed, [])
    # The same order by the handlers' own starts (the first run of each job).
    first_run: dict[int, Any] = {}
    for r in fair_runs.all:
        first_run.setdefault(r.job_id, r)
    small_done = max(r.started for r in first_run.values() if r.key != "burst")
    burst_before_by_runs = sum(
        1 for r in first_run.values() if r.key == "burst" and r.started < small_done
    )
    left = status_counts(faults_db)
    figures(
        "limits_fair_share",
        burst=BURST,
        small=f"{SMALL_TENANTS}x{SMALL_EACH}",
        workers=3,
        kills=len(storm.kills),
        claims=len(claims),
        burst_claimed_before_last_small=burst_before,
        claims_until_then=len(statements),
        of_which_took_a_burst_job=with_burst,
        median_claim_size=sizes[len(sizes) // 2],
        burst_started_before_last_small_run=burst_before_by_runs,
        small_rescued=len(after_rescue),
        burst_claimed_before_rescued_small_max=max(after_rescue, default=None),
        bound=FAIR_BOUND,
        jobs_run_again=result.repeated,
        drain_s=took,
    )
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert not fair_runs.unended, (
        f"runs without an end in processes never killed: {fair_runs.unended[:5]}"
    )
    assert_nothing_lost("fair_share", result, left)
    assert burst_before <= FAIR_BOUND, (
        f"fair=True: {burst_before} of the burst's {BURST} jobs were claimed before the last "
        f"job of the {SMALL_TENANTS} small tenants (bound {FAIR_BOUND}, about {SMALL_EACH} "
        f"when the claims share in turn): {with_burst} of the {len(statements)} claims until "
        f"then took a burst job (median claim: {sizes[len(sizes) // 2]} jobs)"
    )
    assert max(after_rescue, default=0) <= FAIR_BOUND, (
        f"fair=True: a rescued small tenant's job waited for {max(after_rescue)} burst claims "
        f"(bound {FAIR_BOUND}): {sorted(after_rescue)[-10:]}"
    )
    assert len(storm.kills) >= 3, "the storm must have hit the drain"


def test_rate_limit_holds_through_kills_and_a_restart(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    FaultsSession: Any,
    workers: Callable[..., WorkerGroup],
) -> None:
    """``rate="50/1s"``: 300 jobs of 5 ms, 3 workers of 4 slots (far more than 50 a second
    could run), one SIGKILLed every 0.5-1 s, PostgreSQL restarted once: in no window of one
    second more than 50 starts, counting every claim (the ones whose process was killed
    too, and the claims again after a rescue); every job completed."""
    count, period = app.RATE_COUNT, app.RATE_PERIOD
    with FaultsSession.begin() as session:
        session.enqueue_many(app.rated, [{"i": i, "sleep": 0.005} for i in range(RATED_JOBS)])
    group = workers(queues=["rated"], concurrency=4, lease=LEASE, poll_interval=0.2)
    group.start(3)
    restart = RestartWhen(pg, group, lambda: completed_runs(faults_db, "rated") >= RATED_JOBS // 2)
    storm, took = drain(
        faults_db, group, timeout=90, restart=restart, what="the rated queue drains through kills"
    )
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in group.exited()]
    group.stop()
    assert restart.error is None, f"the restart failed: {restart.error!r}"
    assert restart.outage is not None, "the server was never restarted during the drain"

    with faults_db.connect() as conn:
        stamps = list(
            conn.execute(
                sa.select(
                    sa.extract("epoch", app.RateStamp.at).label("at"), app.RateStamp.n
                ).order_by(app.RateStamp.at)
            )
        )
    starts = sorted(float(s.at) for s in stamps for _ in range(s.n))
    events = job_events(faults_db, "rated")
    claims = [e for e in events if e.new == "running"]
    # The most starts in a window of the period ending at a start: (t - period, t], as the
    # claim counts them.
    most, worst_at = 0, None
    for n, t in enumerate(starts):
        inside = n + 1 - bisect.bisect_right(starts, t - period)
        if inside > most:
            most, worst_at = inside, t
    # The handlers' own starts (after the claims, by however long each took to begin).
    runs = read_runs(faults_db, "rated", kill_moments(storm))
    handler = sorted(r.started for r in runs.all)
    handler_most = max(
        (n + 1 - bisect.bisect_right(handler, t - period) for n, t in enumerate(handler)), default=0
    )
    # How long after its claim each run began (PostgreSQL's clock and the handler's are
    # this machine's): the rate holds for the claims; a handler begins a moment later, by
    # up to the slowest of these.
    claimed_at = {(e.job_id, e.attempt): e.at.timestamp() for e in claims}
    unclaimed = [r for r in runs.all if (r.job_id, r.attempt) not in claimed_at]
    delays = sorted(
        r.at - claimed_at[(r.job_id, r.attempt)]
        for r in runs.all
        if (r.job_id, r.attempt) in claimed_at
    )
    # So the handlers' starts keep the rate over windows shorter by the slowest delay.
    slowest = (delays[-1] - min(0.0, delays[0])) if delays else 0.0
    handler_short_most = max(
        (
            n + 1 - bisect.bisect_right(handler, t - (period - slowest))
            for n, t in enumerate(handler)
        ),
        default=0,
    )
    result = outcome(runs, events, set(range(RATED_JOBS)), group.killed, [restart.outage])
    left = status_counts(faults_db)
    span = starts[-1] - starts[0] if starts else 0.0
    figures(
        "limits_rate",
        jobs=RATED_JOBS,
        rate=f"{count}/{period:g}s",
        workers=3,
        kills=len(storm.kills),
        outage_s=restart.outage[1] - restart.outage[0],
        claims=len(claims),
        logged_starts=len(starts),
        most_starts_in_a_window=most,
        most_handler_starts_in_a_window=handler_most,
        claim_to_run_median_s=delays[len(delays) // 2] if delays else None,
        claim_to_run_max_s=delays[-1] if delays else None,
        starts_span_s=span,
        runs_cut_by_kill=runs.cut,
        jobs_run_again=result.repeated,
        drain_s=took,
    )
    assert not exited, f"worker processes exited without being killed: {exited}"
    assert not runs.unended, f"runs without an end in processes never killed: {runs.unended[:5]}"
    assert_nothing_lost("rated", result, left)
    assert not unclaimed, f"runs with no claim of theirs recorded: {unclaimed[:5]}"
    assert handler_short_most <= count, (
        f"{handler_short_most} handlers began within {period - slowest:.3f}s, although each "
        f"began at most {slowest:.3f}s after its claim"
    )
    assert len(starts) == len(claims), (
        f"the rate log recorded {len(starts)} starts, but the queue's jobs were claimed "
        f"{len(claims)} times: claims went unlogged"
    )
    assert most <= count, (
        f"rate {count}/{period:g}s, yet {most} jobs started in the window ending at epoch "
        f"{worst_at:.6f}"
    )
    # The rate bound: some window was full.
    assert most == count, (
        f"the rate never bound (most {most} in a window, {len(starts)} starts over {span:.2f}s)"
    )
    assert len(storm.kills) >= 3, "the storm must have hit the drain"

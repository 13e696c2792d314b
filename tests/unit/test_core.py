"""The worker core's decisions, without a database or a thread: a fake driver records
what the core asks of it, and the tests send the core's steps the answers."""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timezone
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs import Backoff, Jobs, PermanentError, Snooze, WorkerError, WorkerSettings
from sqla_jobs.worker import core as core_mod
from sqla_jobs.worker import steps as s
from sqla_jobs.worker.core import WorkerCore, describe, retry_pause
from sqla_jobs.worker.job import ClaimedJob, Outcome, OutcomeKind, outcome_of

from .. import app


class FakeDriver:
    def __init__(self) -> None:
        self.dispatched: list[ClaimedJob] = []
        self.recorded: list[Outcome] = []
        self.interrupted: list[ClaimedJob] = []
        self.wakes = self.pokes = self.stops = 0

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        self.dispatched += claimed

    def record(self, outcome: Outcome) -> None:
        self.recorded.append(outcome)

    def interrupt(self, job: ClaimedJob) -> None:
        self.interrupted.append(job)

    def wake(self) -> None:
        self.wakes += 1

    def poke(self) -> None:
        self.pokes += 1

    def written(self) -> None:
        pass

    def stop(self) -> None:
        self.stops += 1


def make(**settings: Any) -> tuple[WorkerCore, FakeDriver, Jobs]:
    jobs = Jobs(app.Job, retry=Backoff(base=1, jitter=0))

    @jobs.task(queue="a", name="work")
    def work(n: int = 0) -> None: ...

    @jobs.task(queue="a", name="slow", timeout=0.5)
    def slow() -> None: ...

    driver = FakeDriver()
    core = WorkerCore(jobs, WorkerSettings(**settings), driver)
    return core, driver, jobs


def row(
    job_id: int,
    task: str = "work",
    attempts: int = 1,
    queue: str = "a",
    args: str = "{}",
    meta: str | None = None,
) -> tuple[Any, ...]:
    """A claimed row as the claim returns it (JSON as text)."""
    now = datetime.now(timezone.utc)
    return (job_id, queue, task, args, attempts, 3, 0, now, now, meta)


def run_steps(steps: s.Steps, answer: Any) -> tuple[list[s.Step], Any]:
    """Drive a generator, answering each step with ``answer(step)``; the steps and the
    return value."""
    seen: list[s.Step] = []
    stepper = s.Stepper(steps)
    while (step := stepper.next()) is not None:
        seen.append(step)
        try:
            stepper.result = answer(step)
        except BaseException as exc:
            stepper.error = exc
    return seen, stepper.value


# -- claiming -----------------------------------------------------------------------------


def test_claims_rotate_over_unpaused_queues_and_never_exceed_free_slots() -> None:
    core, driver, _ = make(queues=("a", "b", "c"), concurrency=5, claim_limit=3)
    core._paused = frozenset({"b"})
    asked: list[tuple[str, int]] = []
    ids = iter(range(1, 100))

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io) and step.on is s.Conn.CLAIM
        params = step.args[1]
        asked.append((params["queue_name"], params["limit"]))
        return [row(next(ids)) for _ in range(params["limit"])]

    _, total = run_steps(core._claim(), answer)
    assert asked == [("a", 3), ("c", 2)]  # b is paused; 5 slots in all
    assert total == 5 and core.free == 0 and core.more
    assert len(driver.dispatched) == 5
    # No free slot: no statement at all, and the worker notes it is saturated.
    seen, total = run_steps(core._claim(), answer)
    assert seen == [] and total == 0
    # The next round starts from the next queue.
    core.finished(driver.dispatched[0], Outcome(OutcomeKind.SUCCEEDED, driver.dispatched[0]))
    assert driver.wakes == 1  # a finishing job wakes a saturated fetch loop
    asked.clear()
    run_steps(core._claim(), answer)
    assert asked == [("c", 1)]


def test_a_queue_that_gives_less_than_asked_means_no_more_for_now() -> None:
    core, _, _ = make(queues=("a",), concurrency=10)
    run_steps(core._claim(), lambda step: [row(1)])
    assert not core.more


# -- the running set, keyed by claim --------------------------------------------------------


def test_a_late_first_attempt_does_not_touch_the_retrys_claim() -> None:
    core, driver, _ = make(concurrency=2)
    (first,) = core.claimed([row(7, "slow", attempts=1)])
    first.started = time.monotonic() - 1  # past its 0.5 s timeout
    core.enforce_timeouts()
    assert [o.kind for o in driver.recorded] == [OutcomeKind.FAILED]
    assert driver.interrupted == [first]
    (retry,) = core.claimed([row(7, "slow", attempts=2)])
    # The first attempt's thread returns late: the retry's claim stays running, heartbeated.
    core.finished(first, Outcome(OutcomeKind.SUCCEEDED, first))
    assert core.running == 1
    assert len(driver.recorded) == 1  # nothing more recorded for the first attempt
    seen, _ = run_steps(core.beat(), lambda step: {(7, 2)})
    assert seen[0].args[1] == [retry]


def test_timeouts_fire_failed_then_dead_not_cancelled() -> None:
    core, _, jobs = make()
    events: list[str] = []
    for name in ("failed", "dead", "retried", "cancelled"):
        jobs.events.connect(name, lambda e: events.append(e.name))
    (job,) = core.claimed([row(1, "slow", attempts=3)])
    job.started = time.monotonic() - 1
    core.enforce_timeouts()
    assert events == ["failed", "dead"]
    assert job.is_cancelled and job.settled


def test_heartbeat_stops_lost_claims_but_not_settling_ones() -> None:
    core, driver, _ = make()
    lost, committing, kept = core.claimed([row(1), row(2), row(3)])
    assert core.settle(committing)  # a transactional run is committing its completion
    _, _ = run_steps(core.beat(), lambda step: {(3, 1)})
    assert driver.interrupted == [lost]
    assert lost.is_cancelled and not committing.is_cancelled and not kept.is_cancelled


def test_a_failed_beat_is_logged_and_retried_at_the_next_tick(caplog: Any) -> None:
    core, _, _ = make()
    core.claimed([row(1)])

    def fail(step: s.Step) -> Any:
        raise sa.exc.OperationalError("UPDATE jobs SET ...", {}, psycopg.OperationalError("gone"))

    run_steps(core.beat(), fail)
    assert core._last_beat == 0.0
    assert "heartbeat failed: OperationalError: gone" in caplog.text
    assert "UPDATE" not in caplog.text


# -- outcomes and the completer --------------------------------------------------------------


def test_outcome_of_maps_how_a_handler_ended() -> None:
    core, _, jobs = make()
    (job,) = core.claimed([row(1)])
    task = jobs.tasks["work"]
    assert outcome_of(task, job, None).kind is OutcomeKind.SUCCEEDED
    snoozed = outcome_of(task, job, Snooze(5))
    assert (snoozed.kind, snoozed.delay) == (OutcomeKind.SNOOZED, 5.0)
    permanent = outcome_of(task, job, PermanentError("no"))
    assert permanent.kind is OutcomeKind.FAILED and permanent.permanent and permanent.dead
    failed = outcome_of(task, job, ValueError("x"))
    assert failed.delay == 1.0 and not failed.dead and "ValueError: x" in (failed.error or "")


def test_the_completer_batches_within_its_interval_and_ends_after_the_last() -> None:
    core, driver, _ = make(completion_batch=3, completion_interval=0.01)
    jobs_ = core.claimed([row(i) for i in range(1, 6)])
    for j in jobs_:
        core.finished(j, Outcome(OutcomeKind.SUCCEEDED, j))
    waiting = [*driver.recorded, s.END]
    writes: list[int] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.TakeOutcomes):
            taken, waiting[:] = waiting[: step.limit], waiting[step.limit :]
            return taken
        assert isinstance(step, s.Io) and step.on is s.Conn.WRITE
        writes.append(len(step.args[1]))
        return None

    assert run_steps(core.complete_once(), answer)[1] is True
    assert run_steps(core.complete_once(), answer)[1] is True
    assert run_steps(core.complete_once(), answer)[1] is False
    assert writes == [3, 2] and core.unwritten == 0


# -- errors and supervision ------------------------------------------------------------------


def test_retry_pause_is_at_once_for_a_dropped_held_connection_and_short_for_an_outage() -> None:
    dropped = sa.exc.OperationalError("SELECT 1", {}, Exception("x"), connection_invalidated=True)
    assert retry_pause(1, dropped) == 0.0
    down = sa.exc.OperationalError("SELECT 1", {}, Exception("refused"))
    assert [retry_pause(n, down) for n in (1, 2, 3, 8, 50)] == [0.05, 0.1, 0.2, 0.5, 0.5]
    missing = sa.exc.ProgrammingError("SELECT 1", {}, Exception("no table"))
    assert retry_pause(20, missing) == 30.0


def test_describe_never_prints_the_statement() -> None:
    exc = sa.exc.OperationalError(
        "WITH next_jobs AS (SELECT ...) UPDATE jobs ...",
        {"limit": 1},
        psycopg.OperationalError("server closed\nmore"),
    )
    assert describe(exc) == "OperationalError: server closed"


def test_database_errors_are_waited_out_and_bugs_stop_the_worker_after_five() -> None:
    core, _, _ = make()
    db_error = psycopg.OperationalError("consuming input failed")
    assert core.supervise("listener", 100, db_error) <= 1.0
    for n in range(1, core_mod.MAX_DUTY_FAILURES):
        assert core.supervise("heartbeat", n, RuntimeError("bug")) > 0
    with pytest.raises(WorkerError, match="heartbeat kept failing: RuntimeError: bug"):
        core.supervise("heartbeat", core_mod.MAX_DUTY_FAILURES, RuntimeError("bug"))


def test_a_duty_that_keeps_raising_stops_the_worker_and_one_that_recovers_runs_on() -> None:
    core, driver, _ = make()
    calls = 0

    def flaky() -> s.Steps:
        nonlocal calls
        calls += 1
        yield s.Tick(0)
        if calls < 3:
            raise RuntimeError("transient bug")
        return calls < 4  # done after the fourth round

    steps, _ = run_steps(core.supervised("heartbeat", flaky), lambda step: None)
    assert calls == 4 and core.fatal is None
    assert sum(isinstance(st, s.Pause) for st in steps) == 2

    def broken() -> s.Steps:
        yield s.Tick(0)
        raise RuntimeError("always")

    run_steps(core.supervised("completer", broken), lambda step: None)
    assert isinstance(core.fatal, WorkerError) and driver.stops == 1


# -- shutdown ----------------------------------------------------------------------------------


def test_shutdown_hands_back_unstarted_claims_then_late_ones() -> None:
    core, driver, jobs = make(concurrency=4, grace_period=5)
    cancelled: list[int] = []
    jobs.events.connect("cancelled", lambda e: cancelled.append(e.job.id))
    unstarted, running = core.claimed([row(1), row(2)])
    running.started = time.monotonic()
    handed: list[list[int]] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Io):
            handed.append([j.id for j in step.args[1]])
            return len(step.args[1])
        if isinstance(step, s.WaitIdle):
            return False  # the running handler did not finish within the grace period
        return None

    steps, _ = run_steps(core.shutdown(), answer)
    assert handed == [[1], [2]]
    assert [type(st) for st in steps] == [s.Io, s.WaitIdle, s.Io, s.WaitIdle]
    assert core.start(unstarted) is None  # it will never start here
    assert running.is_cancelled and driver.interrupted == [running] and cancelled == [2]


def test_until_empty_writes_outcomes_and_looks_again_before_stopping() -> None:
    core, _, _ = make(queues=("a",))
    core.until_empty = True
    seen, _ = run_steps(
        core.fetch(),
        lambda step: [] if isinstance(step, s.Io) and step.on is s.Conn.CLAIM else _refresh(step),
    )
    kinds = [type(st).__name__ for st in seen]
    assert "WaitWritten" in kinds and kinds[-1] == "Io"  # refresh and claim once more, then end


def _refresh(step: s.Step) -> Any:
    from sqla_jobs.worker.db import Refresh

    if isinstance(step, s.Io) and step.fn.__name__ == "refresh":
        return Refresh(None, frozenset())
    if isinstance(step, s.Io):
        return 0  # prune: nothing to delete
    return None


def test_notifications_wake_for_own_queues_and_poke_for_cancellations() -> None:
    core, driver, _ = make(queues=("a",))
    payloads = iter([["b"], ["a"], ["!cancel"]])

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Notifications):
            try:
                return next(payloads)
            except StopIteration:
                core.stopping = True
                return []
        return None

    steps, more = run_steps(core.listen_once(), answer)
    assert isinstance(steps[0], s.Listen) and more is False
    assert driver.wakes == 2  # once on LISTEN, once for queue a; none for b
    assert driver.pokes == 1 and not core.listening.is_set()


def test_presence_reports_then_waits_and_keeps_its_counts_through_a_database_error() -> None:
    from sqla_jobs.worker import db

    core, _, _ = make(presence_interval=2.0)
    core.count({"a": [3, 1, 0]})
    steps = core.presence_once()
    step = next(steps)
    assert isinstance(step, s.Io) and step.fn is db.worker_seen and step.on is s.Conn.TX
    _, seen, tally, tidy = step.args
    assert (seen["name"], seen["queues"], seen["running"]) == (core.name, ["a"], 0)
    assert tally == {"a": [3, 1, 0]} and tidy
    down = sa.exc.OperationalError("SELECT 1", {}, psycopg.OperationalError("server down"))
    step = steps.throw(down)
    assert step == s.Pause(2.0)
    with pytest.raises(StopIteration) as ended:
        steps.send(None)
    assert ended.value.value is True
    # The counts that could not be written go with the next report, added to new ones.
    core.count({"a": [1, 0, 0], "b": [0, 2, 1]})
    step = next(core.presence_once())
    assert step.args[2] == {"a": [4, 1, 0], "b": [0, 2, 1]} and not step.args[3]


def test_presence_ends_when_the_worker_stops_and_the_run_leaves_after_the_duties() -> None:
    from sqla_jobs.worker import db

    core, _, _ = make()
    core.stopping = True
    with pytest.raises(StopIteration) as ended:
        next(core.presence_once())
    assert ended.value.value is False
    core.count({"a": [2, 0, 0]})
    step = next(core.leave())
    assert step.fn is db.worker_gone and step.args[1:] == (core.name, {"a": [2, 0, 0]})


def test_a_dry_queue_is_claimed_again_once_a_refresh_promotes_jobs_into_it() -> None:
    """A queue whose claim came back short is skipped until a NOTIFY names it or a poll
    interval passes; a refresh that promoted jobs into it ends that wait at once (a worker
    that does not LISTEN hears of them only there)."""
    from sqla_jobs.worker.db import Refresh

    core, _, _ = make(queues=("a", "b"))
    run_steps(core._claim(), lambda step: [])  # both come back empty: both dry
    assert core._claim_order() == []
    woken = Refresh(None, frozenset(), frozenset({"a"}))
    run_steps(core._maintain(), lambda step: woken if step.fn.__name__ == "refresh" else 0)
    assert core._claim_order() == ["a"]


def test_a_notify_during_a_short_claim_keeps_the_queue_out_of_the_dry_set() -> None:
    """A claim's snapshot may predate the jobs a NOTIFY announces while it is on its way:
    the queue must not go dry then, or those jobs would wait for the poll interval."""
    core, _, _ = make(queues=("a", "b"))

    def claim(step: s.Step) -> Any:
        queue = step.args[1]["queue_name"]
        if queue == "a":  # the listener hears of "a" while its claim is out
            core._notified["a"] = time.monotonic()
        return []

    run_steps(core._claim(), claim)
    assert core._claim_order() == ["a"]  # "b" is dry, "a" is not


# -- claiming ahead (settings.prefetch) ---------------------------------------------------


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The core's clock, stopped: the rate that ``_finishing`` sets is the one the claims
    see. On the real clock, a pause of the test's process of 10 ms or more between two
    claims (a loaded machine) measured a new rate of zero jobs a second and halved it."""
    clock = FakeClock()
    monkeypatch.setattr(core_mod, "time", clock)
    return clock


def _finishing(core: WorkerCore, per_second: float, rtt: float) -> None:
    """As if handlers had finished at ``per_second`` for the last second, and claims took
    ``rtt`` seconds."""
    core._rtt = rtt
    core._rate_mark = (core_mod.time.monotonic() - 1.0, core.processed - round(per_second))


_ids = itertools.count(1)


def _claims(core: WorkerCore) -> list[int]:
    """Run one claim round, every queue giving all it is asked: the limits asked."""
    asked: list[int] = []

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io) and step.on is s.Conn.CLAIM
        asked.append(step.args[1]["limit"])
        return [row(next(_ids)) for _ in range(step.args[1]["limit"])]

    claimed_before = core.running
    run_steps(core._claim(), answer)
    assert core.running - claimed_before == sum(asked)
    return asked


def test_fast_handlers_are_claimed_ahead_of_the_free_slots(frozen: FakeClock) -> None:
    core, driver, _ = make(queues=("a",), concurrency=10, claim_limit=10)
    # 1,000 jobs/s and 10 ms a claim: 10 jobs end during one claim, 20 with the margin,
    # at most one claim's worth (10) ahead.
    _finishing(core, 1000, 0.01)
    asked = _claims(core)
    assert asked == [10]
    assert core.more
    asked = _claims(core)
    assert asked == [10]  # ten more than the slots, waiting for them
    assert core.running == 20 and core.busy == 10 and core.free == -10
    # No room for half a claim: no statement, and the loop waits to be woken.
    assert _claims(core) == []
    for job in driver.dispatched[:4]:
        core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    assert driver.wakes == 0  # room for 4: not yet worth a claim
    job = driver.dispatched[4]
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    assert driver.wakes == 1  # room for 5, half a claim: wake the loop


def test_slow_handlers_and_prefetch_off_claim_only_into_free_slots(frozen: FakeClock) -> None:
    # 5 jobs/s and 10 ms a claim: 0.05 jobs end during a claim, so none is claimed ahead.
    core, driver, _ = make(queues=("a",), concurrency=10, claim_limit=10)
    _finishing(core, 5, 0.01)
    assert _claims(core) == [10]
    assert _claims(core) == []
    job = driver.dispatched[0]
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    assert driver.wakes == 1  # the first free slot wakes the loop, as without claim-ahead

    core, _, _ = make(queues=("a",), concurrency=10, claim_limit=10, prefetch=False)
    _finishing(core, 1000, 0.01)
    assert _claims(core) == [10]
    assert _claims(core) == []


def test_a_claim_told_to_stop_before_it_started_is_not_run_and_frees_its_slot() -> None:
    core, driver, jobs = make(concurrency=2)
    cancelled: list[int] = []
    jobs.events.connect("cancelled", lambda e: cancelled.append(e.job.id))
    (job,) = core.claimed([row(1)])
    job.cancel("cancelled, or lease lost")  # what the heartbeat does to a lost claim
    outcome = core.start(job)
    assert isinstance(outcome, Outcome) and outcome.kind is OutcomeKind.SETTLED
    core.finished(job, outcome)
    assert core.free == 2 and core.running == 0
    assert driver.recorded == [] and cancelled == [1]


def test_a_limited_queue_shares_the_claim_ahead_room(frozen: FakeClock) -> None:
    """A busy queue claimed ahead keeps the free slots below zero; a limited queue must
    still be claimed from the room (kept to the free slots, it starved until the busy
    queue ran dry)."""
    from sqla_jobs.worker.db import LimitedClaim

    jobs = Jobs(app.Job)
    jobs.queue("lim", concurrency=5)

    @jobs.task(queue="busy", name="quick")
    def quick() -> None: ...

    @jobs.task(queue="lim", name="limited")
    def limited() -> None: ...

    driver = FakeDriver()
    settings = WorkerSettings(queues=("busy", "lim"), concurrency=10, claim_limit=10)
    core = WorkerCore(jobs, settings, driver)
    asked: list[tuple[str, int]] = []

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io)
        params = step.args[1]
        queue, limit = params["queue_name"], params["limit"]
        asked.append((queue, limit))
        rows = [row(next(_ids), queue=queue) for _ in range(limit)]
        return LimitedClaim(rows, False, None) if queue == "lim" else rows

    _finishing(core, 1000, 0.01)  # ten may be claimed ahead
    core.claimed([row(next(_ids), queue="busy") for _ in range(14)])
    assert core.free == -4  # no slot free, room for 6 with the claim-ahead: worth a claim
    core._turn = 1  # the limited queue's turn to go first
    run_steps(core._claim(), answer)
    assert asked and asked[0] == ("lim", 6)


# -- polling without LISTEN ----------------------------------------------------------------


class FakeClock:
    """``time`` for the core, on a clock the test moves: statements take the time the
    test says, and a sleep passes at once."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _poll_idle(
    monkeypatch: pytest.MonkeyPatch, queues: tuple[str, ...], limited: tuple[str, ...] = ()
) -> tuple[dict[str, list[float]], float]:
    """Run an idle worker's fetch loop for 20 simulated seconds, every queue empty, each
    statement taking a few milliseconds: when each queue's claims were sent."""
    from sqla_jobs.worker.db import LimitedClaim, Refresh

    clock = FakeClock()
    monkeypatch.setattr(core_mod, "time", clock)
    jobs = Jobs(app.Job)
    for queue in limited:
        jobs.queue(queue, concurrency=2)
    poll = 1.0
    core = WorkerCore(
        jobs, WorkerSettings(queues=queues, poll_interval=poll, listen=False), FakeDriver()
    )
    claims: dict[str, list[float]] = {q: [] for q in queues}
    end = clock.now + 20.0

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Sleep):
            clock.advance(step.seconds)
            if clock.now >= end:
                core.stopping = True
            return None
        assert isinstance(step, s.Io)
        name = step.fn.__name__
        if name == "refresh":
            clock.advance(0.004)
            return Refresh(None, frozenset())
        if name == "prune_batch":
            return None  # another worker prunes
        claims[step.args[1]["queue_name"]].append(clock.now)
        clock.advance(0.003 if name == "claim" else 0.006)
        return LimitedClaim([], False, None) if name == "claim_limited" else []

    run_steps(core.fetch(), answer)
    return claims, poll


@pytest.mark.parametrize(
    ("queues", "limited"),
    [(("a",), ()), (("a", "b", "c", "d"), ()), (("a", "b", "lim", "c"), ("lim",))],
    ids=["one queue", "four queues", "with a limited queue"],
)
def test_an_idle_worker_without_listen_claims_every_queue_every_poll_interval(
    monkeypatch: pytest.MonkeyPatch, queues: tuple[str, ...], limited: tuple[str, ...]
) -> None:
    """A job enqueued into any queue is picked up within the poll interval (plus the
    round's few statements). The dry mark used to be timed from after each claim while
    the loop's wake-up was timed from before them: every queue but the first of a round
    was still "dry" when the loop woke, and was claimed only every other interval."""
    claims, poll = _poll_idle(monkeypatch, queues, limited)
    for queue, times in claims.items():
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert len(times) >= 19, (queue, times)
        assert max(gaps) <= poll + 0.03, (queue, gaps)


# -- rows the worker cannot run ---------------------------------------------------------------


def _timeless(job_id: int, column: int) -> tuple[Any, ...]:
    """A row whose run_at (7) or created_at (8) the claim returned as NULL: infinite, BC,
    or past the year 9999."""
    values = list(row(job_id))
    values[column] = None
    return tuple(values)


@pytest.mark.parametrize(
    ("poison", "why"),
    [
        (row(2, args='{"n": ' + "9" * 5000 + "}"), "args cannot be decoded by Python (ValueError"),
        (row(2, args="[" * 1200 + "]" * 1200), "args is nested too deeply for Python to decode"),
        (row(2, args="[1]"), "args is a JSON array, not a JSON object"),
        (row(2, meta="[1]"), "meta is a JSON array, not a JSON object"),
        (row(2, meta='"x"'), "meta is a JSON string, not a JSON object"),
        (row(2, meta='{"t": ' + "[" * 1200 + "]" * 1200 + "}"), "meta is nested too deeply"),
        (row(2, meta='{"sqla_jobs.keep": "abc"}'), "meta['sqla_jobs.keep'] is \"abc\""),
        (row(2, meta='{"sqla_jobs.keep": 1e300}'), "not a number of seconds from 0 to"),
        (_timeless(2, 7), "run_at is infinite, before the year 1 or after the year 9999"),
        (_timeless(2, 8), "created_at is infinite, before the year 1"),
    ],
    ids=[
        "huge int",
        "deep args",
        "args array",
        "meta array",
        "meta string",
        "deep meta",
        "keep not a number",
        "keep too long",
        "run_at",
        "created_at",
    ],
)
def test_a_row_the_worker_cannot_run_is_failed_dead_and_the_rest_of_its_batch_runs(
    poison: tuple[Any, ...], why: str
) -> None:
    core, driver, jobs = make(concurrency=5)
    events: list[str] = []
    for name in ("failed", "dead"):
        jobs.events.connect(name, lambda e: events.append(e.name))
    claimed = core.claimed([row(1), poison, row(3, meta='{"tag": 1}')])
    assert [j.id for j in claimed] == [1, 3] and claimed[1].meta == {"tag": 1}
    # The poison row holds no slot, and its failure is recorded at once: dead, naming
    # its column and why.
    assert core.free == 3 and core.running == 2 and core.unwritten == 1
    (failure,) = driver.recorded
    assert failure.kind is OutcomeKind.FAILED and failure.permanent and failure.dead
    assert failure.job.id == 2 and failure.job.attempts == 1
    assert failure.error is not None and failure.error.startswith("unreadable job row: ")
    assert why in failure.error, failure.error
    assert events == ["failed", "dead"]


def test_a_meta_that_names_children_still_settles_them_when_another_column_is_unreadable() -> None:
    from sqla_jobs.tasks import CHILDREN_KEY
    from sqla_jobs.worker.job import is_flow

    core, driver, _ = make()
    values = list(row(1, args="[1]", meta=f'{{"{CHILDREN_KEY}": true}}'))
    core.claimed([tuple(values)])
    (failure,) = driver.recorded
    # Written by the flow statement: its children are cancelled, its waiters told.
    assert is_flow(failure.job) and "args is a JSON array" in (failure.error or "")


# -- the worker's own failures around a run ----------------------------------------------------


def test_a_failure_around_a_run_fails_that_run_and_five_in_a_row_stop_the_worker() -> None:
    core, driver, _ = make(concurrency=10)
    claims = core.claimed([row(i) for i in range(1, 9)])
    for job in claims[:4]:
        assert isinstance(core.start(job), core_mod.Run)
        outcome = core.crashed(job, AttributeError("'list' object has no attribute 'get'"))
        assert outcome is not None and outcome.kind is OutcomeKind.FAILED
        assert "AttributeError: 'list' object has no attribute 'get'" in (outcome.error or "")
        assert not outcome.dead and outcome.delay == 1.0  # the task's retry policy
        core.finished(job, outcome)
    assert core.fatal is None and core.free == 6 and core.running == 4
    # A run that ends as runs should ends the streak.
    run = core.start(claims[4])
    assert isinstance(run, core_mod.Run)
    with run:
        pass
    for job in claims[5:8]:
        core.start(job)
        core.finished(job, core.crashed(job, RuntimeError("bug")))
    assert core.fatal is None and driver.stops == 0
    (job,) = core.claimed([row(20)])
    running = core.start(job)  # still running while the next two fail around theirs
    assert isinstance(running, core_mod.Run)
    for _ in range(2):
        (job,) = core.claimed([row(next(_ids) + 100)])
        core.start(job)
        core.crashed(job, RuntimeError("bug"))
    assert isinstance(core.fatal, WorkerError) and driver.stops == 1
    assert "5 runs in a row failed in the worker itself: RuntimeError: bug" in str(core.fatal)
    running.end(None)


def test_a_failure_around_a_claim_already_decided_records_nothing_more() -> None:
    core, _, _ = make()
    (job,) = core.claimed([row(1, "slow")])
    core.start(job)
    job.started -= 1  # past its 0.5 s timeout: failed and settled by the heartbeat
    core.enforce_timeouts()
    outcome = core.crashed(job, RuntimeError("late"))
    assert outcome is not None and outcome.kind is OutcomeKind.SETTLED


# -- stored arguments the handler no longer takes ------------------------------------------------


def test_a_stored_argument_the_handler_does_not_take_fails_the_run_naming_it() -> None:
    core, _, _ = make()
    (job,) = core.claimed([row(1, args='{"user_id": 7}')])
    outcome = core.start(job)
    assert isinstance(outcome, Outcome) and outcome.kind is OutcomeKind.FAILED
    assert "stored argument(s) 'user_id' are not parameters of its handler" in (outcome.error or "")
    assert "which takes (n)" in (outcome.error or "")
    assert not outcome.dead  # the retry policy: a newer worker may take it


def test_a_handler_that_takes_kwargs_gets_stored_arguments_it_does_not_name() -> None:
    jobs = Jobs(app.Job)

    @jobs.task(name="open")
    def open_ended(n: int, **extra: Any) -> None: ...

    task = jobs.tasks["open"]
    # As the library stores it (extras under the parameter's name), and as SQL wrote it.
    assert task.call_args({"n": 1, "extra": {"a": 2}}) == ((1,), {"a": 2})
    assert task.call_args({"n": 1, "user_id": 7}) == ((1,), {"user_id": 7})


def test_a_delay_the_completer_could_not_write_is_capped() -> None:
    """``Snooze(1e300)`` or a retry policy returning ``inf`` made the outcome's statement
    fail (an interval past what a timedelta holds), and with it every outcome of its
    batch, until the completer gave up and stopped the worker."""
    from sqla_jobs.limits import DURATION_MAX_SECONDS
    from sqla_jobs.worker.job import outcome_statements

    core, _, jobs = make()
    (job,) = core.claimed([row(1)])
    task = jobs.tasks["work"]
    snoozed = outcome_of(task, job, Snooze(1e300))
    assert snoozed.delay == DURATION_MAX_SECONDS
    task.retry = lambda attempt: float("inf")
    failed = outcome_of(task, job, ValueError("x"))
    assert failed.delay == DURATION_MAX_SECONDS
    task.retry = lambda attempt: float("nan")
    assert outcome_of(task, job, ValueError("x")).delay == 60.0
    assert len(outcome_statements(jobs.queries, [snoozed, failed])) == 2


# -- no start after a lost lease ---------------------------------------------------------------


def test_a_claim_not_renewed_for_half_a_lease_starts_only_after_a_heartbeat_kept_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker resumed after a pause past its lease (SIGSTOP, a frozen VM) must not start
    what it claimed before: its own clock says the lease may have passed. It beats first;
    what the beat kept starts, what it lost ends unstarted."""
    clock = FakeClock()
    monkeypatch.setattr(core_mod, "time", clock)
    core, driver, jobs = make(concurrency=4, lease=10.0)
    cancelled: list[int] = []
    jobs.events.connect("cancelled", lambda e: cancelled.append(e.job.id))
    kept, lost, fresh = core.claimed([row(1), row(2), row(3)])
    first = core.start(fresh)
    assert isinstance(first, core_mod.Run)  # just claimed: starts
    clock.advance(5.1)  # half the lease and then some, with nothing renewed: paused
    assert core.start(kept) is None and core.start(lost) is None
    assert kept.confirming and not kept.started and driver.pokes == 2 and core._poked
    assert core.free == 1 and driver.dispatched == []  # they keep their slots meanwhile
    # The heartbeat beats (the pause is over): job 1 is still this worker's, job 2 is not.
    seen, _ = run_steps(core.beat(), lambda step: {(1, 1), (3, 1)})
    assert {j.id for j in seen[0].args[1]} == {1, 2, 3}
    assert driver.dispatched == [kept, lost] and not kept.confirming
    run = core.start(kept)
    assert isinstance(run, core_mod.Run) and kept.started
    ended = core.start(lost)
    assert isinstance(ended, Outcome) and ended.kind is OutcomeKind.SETTLED
    core.finished(lost, ended)
    assert cancelled == [2] and driver.recorded == [] and core.free == 2
    # A claimed-ahead job waiting for a slot stays startable while the heartbeat renews it.
    (ahead,) = core.claimed([row(4)])
    for _ in range(4):
        clock.advance(3.4)  # the heartbeat's every third of a lease
        run_steps(core.beat(), lambda step: {(1, 1), (3, 1), (4, 1)})
    last = core.start(ahead)
    assert isinstance(last, core_mod.Run)
    for started in (last, run, first):  # as the drivers do: current_job is reset
        started.end(None)


def test_a_claim_held_for_a_heartbeat_is_handed_back_unstarted_at_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(core_mod, "time", clock)
    core, driver, _ = make(concurrency=2, lease=10.0, grace_period=0)
    (job,) = core.claimed([row(1)])
    clock.advance(6)
    assert core.start(job) is None
    handed: list[int] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Io):
            handed.extend(j.id for j in step.args[1])
            return 1
        return True  # idle

    run_steps(core.shutdown(), answer)
    assert handed == [1] and core.free == 2
    run_steps(core.beat(), lambda step: {(1, 1)})  # a late beat changes nothing
    assert driver.dispatched == [] and core.start(job) is None

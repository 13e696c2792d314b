"""The worker core's decisions, without a database or a thread: a fake driver records
what the core asks of it, and the tests send the core's steps the answers."""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timezone
from typing import Any

import pytest

from sqla_jobs import Backoff, Jobs, PermanentError, Snooze, WorkerError, WorkerSettings
from sqla_jobs.worker import _core as core_mod
from sqla_jobs.worker import _fetch as fetch_mod
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._core import WorkerCore
from sqla_jobs.worker._duties import heartbeat as heartbeat_mod
from sqla_jobs.worker._duties import maintenance as maintenance_mod
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


#: Job ids for rows the tests make up, unique across the module.
_ids = itertools.count(1)


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


def test_a_claim_that_has_not_started_when_stop_is_asked_never_starts() -> None:
    """stop() between a handler's end and the shutdown's hand-back: the executor that is
    free again takes the next claim from its inbox, and must not start it (it started, and
    ran, in a parallel test run); the shutdown hands it back with the other unstarted ones."""
    core, driver, _ = make(concurrency=1, grace_period=5)
    (waiting,) = core.claimed([row(1)])
    core.stopping = True  # what Worker.stop() and AsyncWorker.stop() set, from any thread
    assert core.start(waiting) is None
    assert not waiting.started and driver.recorded == []
    handed: list[list[int]] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Io):
            handed.append([j.id for j in step.args[1]])
            return len(step.args[1])
        return isinstance(step, s.WaitIdle) or None  # nothing runs: idle at once

    run_steps(core.shutdown(), answer)
    assert handed == [[1]] and core.running == 0 and core.free == 1


def _refresh(step: s.Step) -> Any:
    from sqla_jobs.worker._statements import Refresh

    if isinstance(step, s.Io) and step.fn.__name__ == "refresh":
        return Refresh(None, frozenset())
    if isinstance(step, s.Io):
        return 0  # prune: nothing to delete
    return None


# -- claiming ahead (settings.prefetch) ---------------------------------------------------


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


def _use_clock(monkeypatch: pytest.MonkeyPatch, clock: Any) -> None:
    """The core and its duties read ``time.monotonic`` from their own modules."""
    for module in (core_mod, fetch_mod, heartbeat_mod, maintenance_mod):
        monkeypatch.setattr(module, "time", clock)


# -- rows the worker cannot run ---------------------------------------------------------------


def _timeless(job_id: int, column: int) -> tuple[Any, ...]:
    """A row whose run_at (7) or created_at (8) the claim returned as NULL: infinite, BC,
    or past the year 9999."""
    values = list(row(job_id))
    values[column] = None
    return tuple(values)


#: JSON nested this deep fails to decode on Python 3.10 to 3.13 (RecursionError).
DEEP = 10_000


@pytest.mark.parametrize(
    ("poison", "why"),
    [
        (row(2, args='{"n": ' + "9" * 5000 + "}"), "args cannot be decoded by Python (ValueError"),
        # Deeper than any supported Python decodes (3.12 reads 1,200 levels, 3.13 5,000),
        # and within what PostgreSQL's jsonb stores.
        (row(2, args="[" * DEEP + "]" * DEEP), "args is nested too deeply for Python to decode"),
        (row(2, args="[1]"), "args is a JSON array, not a JSON object"),
        (row(2, meta="[1]"), "meta is a JSON array, not a JSON object"),
        (row(2, meta='"x"'), "meta is a JSON string, not a JSON object"),
        (row(2, meta='{"t": ' + "[" * DEEP + "]" * DEEP + "}"), "meta is nested too deeply"),
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
    from sqla_jobs.model import CHILDREN_KEY
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
    core.heartbeat.enforce_timeouts()
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
    from sqla_jobs._storable import DURATION_MAX_SECONDS
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


def test_came_round_over_the_keys() -> None:
    """The walk of key-ordered and fair claims over the keys, in order and wrapping round
    after the last one: each claim walks from where the last one stopped."""
    from sqla_jobs.worker._fetch import KeyWalk

    def walked(start: str | None, *stops: str) -> list[bool]:
        walk = KeyWalk(start)
        return [walk.came_round(last) for last in stops]

    assert walked("c", "c") == [True]  # all the way round in one claim
    assert walked("c", "f", "a", "b", "c") == [False, False, False, True]  # wrapped, back
    assert walked("c", "f", "d") == [False, True]  # wrapped past where it began
    assert walked("c", "f", "f") == [False, True]  # a claim that did not move is round
    assert walked(None, "f", "b") == [False, True]  # from the start: wrapped is round
    assert walked(None, "a", "f") == [False, False]

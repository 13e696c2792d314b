"""The heartbeat duty (worker/_duties/heartbeat.py), without a database: timeouts, leases
kept or lost, failed beats, and claims held back from starting until a beat."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs.worker import _core as core_mod
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker.job import Outcome, OutcomeKind

from .test_core import FakeClock, _use_clock, make, row, run_steps


def test_a_late_first_attempt_does_not_touch_the_retrys_claim() -> None:
    core, driver, _ = make(concurrency=2)
    (first,) = core.claimed([row(7, "slow", attempts=1)])
    first.started = time.monotonic() - 1  # past its 0.5 s timeout
    core.heartbeat.enforce_timeouts()
    assert [o.kind for o in driver.recorded] == [OutcomeKind.FAILED]
    assert driver.interrupted == [first]
    (retry,) = core.claimed([row(7, "slow", attempts=2)])
    # The first attempt's thread returns late: the retry's claim stays running, heartbeated.
    core.finished(first, Outcome(OutcomeKind.SUCCEEDED, first))
    assert core.running == 1
    assert len(driver.recorded) == 1  # nothing more recorded for the first attempt
    seen, _ = run_steps(core.heartbeat.beat(), lambda step: {(7, 2)})
    # The first attempt's outcome (its timeout) waits for the completer: its lease is
    # renewed too, guarded by its own attempt, which the retry's claim does not match.
    assert seen[0].args[1] == [retry, first]
    assert [(c.id, c.attempts) for c in seen[0].args[1]] == [(7, 2), (7, 1)]


def test_timeouts_fire_failed_then_dead_not_cancelled() -> None:
    core, _, jobs = make()
    events: list[str] = []
    for name in ("failed", "dead", "retried", "cancelled"):
        jobs.events.connect(name, lambda e: events.append(e.name))
    (job,) = core.claimed([row(1, "slow", attempts=3)])
    job.started = time.monotonic() - 1
    core.heartbeat.enforce_timeouts()
    assert events == []  # not on the heartbeat: a slow listener held up every lease
    core.tell()  # the completer fires them
    assert events == ["failed", "dead"]
    assert job.is_cancelled and job.settled


def test_heartbeat_stops_lost_claims_but_not_settling_ones() -> None:
    core, driver, _ = make()
    lost, committing, kept = core.claimed([row(1), row(2), row(3)])
    assert core.settle(committing)  # a transactional run is committing its completion
    _, _ = run_steps(core.heartbeat.beat(), lambda step: {(3, 1)})
    assert driver.interrupted == [lost]
    assert lost.is_cancelled and not committing.is_cancelled and not kept.is_cancelled


def test_a_failed_beat_is_logged_and_retried_at_the_next_tick(caplog: Any) -> None:
    core, _, _ = make()
    core.claimed([row(1)])

    def fail(step: s.Step) -> Any:
        raise sa.exc.OperationalError("UPDATE jobs SET ...", {}, psycopg.OperationalError("gone"))

    run_steps(core.heartbeat.beat(), fail)
    assert core.heartbeat.last_beat == 0.0
    assert "heartbeat failed: OperationalError: gone" in caplog.text
    assert "UPDATE" not in caplog.text


def test_a_claim_not_renewed_for_half_a_lease_starts_only_after_a_heartbeat_kept_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker resumed after a pause past its lease (SIGSTOP, a frozen VM) must not start
    what it claimed before: its own clock says the lease may have passed. It beats first;
    what the beat kept starts, what it lost ends unstarted."""
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
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
    seen, _ = run_steps(core.heartbeat.beat(), lambda step: {(1, 1), (3, 1)})
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
        run_steps(core.heartbeat.beat(), lambda step: {(1, 1), (3, 1), (4, 1)})
    last = core.start(ahead)
    assert isinstance(last, core_mod.Run)
    for started in (last, run, first):  # as the drivers do: current_job is reset
        started.end(None)


def test_a_run_past_its_timeout_in_its_started_listeners_times_out_uncalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A started listener held the run past its task's timeout before the heartbeat could
    say so (an asyncio worker's heartbeat waits for the loop the listener blocked): the
    handler was called, and the timeout came after it had done the job's work."""
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
    core, driver, jobs = make(concurrency=2, lease=30.0)
    heard: list[str] = []
    jobs.events.connect("started", lambda e: clock.advance(0.6))  # "slow" times out at 0.5
    for name in ("failed", "retried", "cancelled"):
        jobs.events.connect(name, lambda e: heard.append(e.name))
    (job,) = core.claimed([row(1, "slow")])
    ended = core.start(job)
    assert isinstance(ended, Outcome) and ended.kind is OutcomeKind.SETTLED
    assert [(o.kind, o.error) for o in driver.recorded] == [
        (OutcomeKind.FAILED, "TimeoutError: task 'slow' ran longer than its timeout of 0.5s")
    ]
    assert job.settled and job.is_cancelled and driver.interrupted == []
    core.finished(job, ended)
    core.tell()  # the completer fires the timeout's events
    assert heard == ["failed", "retried"] and core.free == 2 and core.processed == 0
    # A late beat changes nothing: the timeout was recorded once.
    clock.advance(1)
    core.heartbeat.enforce_timeouts()
    assert len(driver.recorded) == 1
    # Cancelled while its listeners ran, past its timeout too: the cancel stands, and no
    # timeout is recorded for a claim that is no longer this worker's to fail.
    (other,) = core.claimed([row(2, "slow")])
    jobs.events.connect("started", lambda e: e.job.cancel("cancelled, or lease lost"))
    ended = core.start(other)
    assert isinstance(ended, Outcome) and ended.kind is OutcomeKind.SETTLED
    assert len(driver.recorded) == 1 and not other.settled
    core.finished(other, ended)
    assert heard == ["failed", "retried", "cancelled"] and core.free == 2


def test_a_claim_stalled_past_half_a_lease_in_its_hooks_goes_back_uncalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The started listeners or run hooks held the worker past half a lease since the
    claim was renewed (an asyncio worker's loop blocked): its lease may have lapsed and the
    job run elsewhere. It is snoozed for no time, the attempt not counted, and the hooks
    are told so; the handler is not called."""
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
    core, driver, jobs = make(concurrency=2, lease=10.0)
    heard: list[str] = []
    exits: list[str] = []

    class Hook:
        def enter(self, job: Any) -> None:
            clock.advance(5.1)

        def exit(self, job: Any, state: object, outcome: str, error: Any) -> None:
            exits.append(outcome)

    jobs.events.add_run_hook(Hook())
    for name in ("snoozed", "cancelled", "failed"):
        jobs.events.connect(name, lambda e: heard.append(e.name))
    (job,) = core.claimed([row(1)])
    ended = core.start(job)
    assert isinstance(ended, Outcome) and ended.kind is OutcomeKind.SNOOZED
    assert ended.delay == 0.0 and "stalled 5.1s" in (ended.error or "")
    assert heard == ["snoozed"] and exits == ["snoozed"] and job.run is None
    core.finished(job, ended)
    assert driver.recorded == [ended] and core.free == 2 and core.processed == 0
    # Held less than half a lease, the same hook lets the handler run.
    clock.advance(0)
    (fresh,) = core.claimed([row(2)])
    monkeypatch.setattr(Hook, "enter", lambda self, job: clock.advance(4.9))
    run = core.start(fresh)
    assert isinstance(run, core_mod.Run)
    run.end(None)


def test_a_job_sent_back_again_and_again_backs_off_its_attempts_still_uncounted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stall (or a conflict) that comes back every time made the job spin: claimed,
    sent back due at once, claimed again. The first few go back at once; from then on
    the delay doubles, up to a cap, and no attempt is counted. Another job is not held
    back by it."""
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
    core, _driver, jobs = make(concurrency=1, lease=10.0)

    class Hook:
        def enter(self, job: Any) -> None:
            clock.advance(5.1)

        def exit(self, job: Any, state: object, outcome: str, error: Any) -> None:
            pass

    jobs.events.add_run_hook(Hook())

    def sent_back(job_id: int) -> Outcome:
        (job,) = core.claimed([row(job_id)])
        ended = core.start(job)
        assert isinstance(ended, Outcome) and ended.kind is OutcomeKind.SNOOZED
        core.finished(job, ended)
        return ended

    first, cap = core_mod.AGAIN_BACKOFF
    delays = [sent_back(7_001).delay for _ in range(core_mod.AGAIN_AT_ONCE + 12)]
    at_once = [0.0] * core_mod.AGAIN_AT_ONCE
    assert delays[: core_mod.AGAIN_AT_ONCE + 3] == [*at_once, first, first * 2, first * 4]
    assert delays[-1] == cap and max(delays) == cap
    assert sent_back(7_002).delay == 0.0
    assert core.processed == 0  # none of them was a run


def test_a_claim_held_for_a_heartbeat_is_handed_back_unstarted_at_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
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
    run_steps(core.heartbeat.beat(), lambda step: {(1, 1)})  # a late beat changes nothing
    assert driver.dispatched == [] and core.start(job) is None

"""The fetcher (worker/_fetch.py), without a database: the claim order over the queues,
dry queues, the claim-ahead and the limited claim, and the idle fetch loop's polling."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from sqla_jobs import Jobs, WorkerSettings
from sqla_jobs.worker import _fetch as fetch_mod
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._core import WorkerCore
from sqla_jobs.worker._statements import LimitedClaim, Refresh
from sqla_jobs.worker.job import Outcome, OutcomeKind

from .. import app
from .test_core import FakeClock, FakeDriver, _ids, _refresh, _use_clock, make, row, run_steps


def test_claims_rotate_over_unpaused_queues_and_never_exceed_free_slots() -> None:
    core, driver, _ = make(queues=("a", "b", "c"), concurrency=5, claim_limit=3)
    core.maintenance.paused = frozenset({"b"})
    asked: list[tuple[str, int]] = []
    ids = iter(range(1, 100))

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io) and step.on is s.Conn.CLAIM
        params = step.args[1]
        asked.append((params["queue_name"], params["limit"]))
        return [row(next(ids)) for _ in range(params["limit"])]

    _, total = run_steps(core.fetcher.claim(), answer)
    assert asked == [("a", 3), ("c", 2)]  # b is paused; 5 slots in all
    assert total == 5 and core.free == 0 and core.fetcher.more
    assert len(driver.dispatched) == 5
    # No free slot: no statement at all, and the worker notes it is saturated.
    seen, total = run_steps(core.fetcher.claim(), answer)
    assert seen == [] and total == 0
    # The next round starts from the next queue.
    core.finished(driver.dispatched[0], Outcome(OutcomeKind.SUCCEEDED, driver.dispatched[0]))
    assert driver.wakes == 1  # a finishing job wakes a saturated fetch loop
    asked.clear()
    run_steps(core.fetcher.claim(), answer)
    assert asked == [("c", 1)]


def test_a_queue_that_gives_less_than_asked_means_no_more_for_now() -> None:
    core, _, _ = make(queues=("a",), concurrency=10)
    run_steps(core.fetcher.claim(), lambda step: [row(1)])
    assert not core.fetcher.more


def test_until_empty_writes_outcomes_and_looks_again_before_stopping() -> None:
    core, _, _ = make(queues=("a",))
    core.until_empty = True
    seen, _ = run_steps(
        core.fetcher.fetch(),
        lambda step: [] if isinstance(step, s.Io) and step.on is s.Conn.CLAIM else _refresh(step),
    )
    kinds = [type(st).__name__ for st in seen]
    assert "WaitWritten" in kinds and kinds[-1] == "Io"  # refresh and claim once more, then end


def test_a_dry_queue_is_claimed_again_once_a_refresh_promotes_jobs_into_it() -> None:
    """A queue whose claim came back short is skipped until a NOTIFY names it or a poll
    interval passes; a refresh that promoted jobs into it ends that wait at once (a worker
    that does not LISTEN hears of them only there)."""

    core, _, _ = make(queues=("a", "b"))
    run_steps(core.fetcher.claim(), lambda step: [])  # both come back empty: both dry
    assert core.fetcher.claim_order() == []
    woken = Refresh(None, frozenset(), frozenset({"a"}))
    run_steps(
        core.maintenance.run_once(), lambda step: woken if step.fn.__name__ == "refresh" else 0
    )
    assert core.fetcher.claim_order() == ["a"]


def test_a_notify_during_a_short_claim_keeps_the_queue_out_of_the_dry_set() -> None:
    """A claim's snapshot may predate the jobs a NOTIFY announces while it is on its way:
    the queue must not go dry then, or those jobs would wait for the poll interval."""
    core, _, _ = make(queues=("a", "b"))

    def claim(step: s.Step) -> Any:
        queue = step.args[1]["queue_name"]
        if queue == "a":  # the listener hears of "a" while its claim is out
            core.fetcher.notified["a"] = time.monotonic()
        return []

    run_steps(core.fetcher.claim(), claim)
    assert core.fetcher.claim_order() == ["a"]  # "b" is dry, "a" is not


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The worker's clock, stopped: the rate that ``_finishing`` sets is the one the claims
    see. On the real clock, a pause of the test's process of 10 ms or more between two
    claims (a loaded machine, the suite's own parallel workers) measured a new rate of zero
    jobs a second and halved the estimate."""
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
    return clock


def _finishing(core: WorkerCore, per_second: float, rtt: float) -> None:
    """As if handlers had finished at ``per_second`` for the last second, and claims took
    ``rtt`` seconds."""
    core.fetcher.rtt = rtt
    now = fetch_mod.time.monotonic()
    core.fetcher.rate_mark = (now - 1.0, core.processed - round(per_second))


def _claims(core: WorkerCore) -> list[int]:
    """Run one claim round, every queue giving all it is asked: the limits asked."""
    asked: list[int] = []

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io) and step.on is s.Conn.CLAIM
        asked.append(step.args[1]["limit"])
        return [row(next(_ids)) for _ in range(step.args[1]["limit"])]

    claimed_before = core.running
    run_steps(core.fetcher.claim(), answer)
    assert core.running - claimed_before == sum(asked)
    return asked


def test_fast_handlers_are_claimed_ahead_of_the_free_slots(frozen: FakeClock) -> None:
    core, driver, _ = make(queues=("a",), concurrency=10, claim_limit=10)
    # 1,000 jobs/s and 10 ms a claim: 10 jobs end during one claim, 20 with the margin,
    # at most one claim's worth (10) ahead.
    _finishing(core, 1000, 0.01)
    asked = _claims(core)
    assert asked == [10]
    assert core.fetcher.more
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


def test_a_worker_of_limited_queues_only_claims_ahead_too(frozen: FakeClock) -> None:
    """The claim-ahead is estimated from the claims' round trips: a limited claim's counts
    like any (it did not, and a worker serving only limited queues never claimed past its
    free slots: a never-binding limit drained at two thirds of the unlimited rate)."""
    jobs = Jobs(app.Job)
    jobs.queue("lim", concurrency=1_000_000)

    @jobs.task(queue="lim", name="limited")
    def limited() -> None: ...

    driver = FakeDriver()
    settings = WorkerSettings(queues=("lim",), concurrency=10, claim_limit=10)
    core = WorkerCore(jobs, settings, driver)
    asked: list[int] = []

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io)
        frozen.advance(0.01)  # each claim takes 10 ms
        limit = step.args[1]["limit"]
        asked.append(limit)
        return LimitedClaim([row(next(_ids), queue="lim") for _ in range(limit)], False, None)

    run_steps(core.fetcher.claim(), answer)
    assert core.fetcher.rtt == pytest.approx(0.01)
    _finishing(core, 1000, core.fetcher.rtt)  # 1,000 jobs/s: twenty end in two claims
    asked.clear()
    run_steps(core.fetcher.claim(), answer)
    assert asked == [10]  # ahead of the ten slots, all busy
    assert core.running == 20 and core.free == -10


def test_a_limited_queue_shares_the_claim_ahead_room(frozen: FakeClock) -> None:
    """A busy queue claimed ahead keeps the free slots below zero; a limited queue must
    still be claimed from the room (kept to the free slots, it starved until the busy
    queue ran dry)."""

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
    core.fetcher.turn = 1  # the limited queue's turn to go first
    run_steps(core.fetcher.claim(), answer)
    assert asked and asked[0] == ("lim", 6)


def _poll_idle(
    monkeypatch: pytest.MonkeyPatch, queues: tuple[str, ...], limited: tuple[str, ...] = ()
) -> tuple[dict[str, list[float]], float]:
    """Run an idle worker's fetch loop for 20 simulated seconds, every queue empty, each
    statement taking a few milliseconds: when each queue's claims were sent."""

    clock = FakeClock()
    _use_clock(monkeypatch, clock)
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
        if name == "sync_schedules":
            return True
        claims[step.args[1]["queue_name"]].append(clock.now)
        clock.advance(0.003 if name == "claim" else 0.006)
        return LimitedClaim([], False, None) if name == "claim_limited" else []

    run_steps(core.fetcher.fetch(), answer)
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


def test_a_worker_drops_the_floor_every_so_often() -> None:
    """Within FAIR_FLOOR_FOR seconds of the last claim without a floor, the last claim's
    floor is used; then one claim goes without, and a new period begins."""
    FAIR_FLOOR_FOR = fetch_mod.FAIR_FLOOR_FOR
    core, _, _ = make(queues=("shared",))
    fetcher = core.fetcher
    assert fetcher.fair_floor("shared", 100.0) is None  # nothing claimed yet
    fetcher.floors["shared"] = (("burst", 42), 100.0)
    assert fetcher.fair_floor("shared", 100.0 + FAIR_FLOOR_FOR / 2) == ("burst", 42)
    assert fetcher.fair_floor("shared", 100.0 + FAIR_FLOOR_FOR) is None
    assert fetcher.floors["shared"] == (None, 100.0 + FAIR_FLOOR_FOR)


def test_a_busy_limited_queue_is_held_by_time_not_for_good() -> None:
    """A limited claim that found its queue's lock taken past its lock timeout (another
    transaction's, or this worker's own completer's on a loaded machine) holds the queue
    for a while, by time: ``run_until_empty`` must wait for it, not call it empty (it
    ended with a job of a fifo queue left, in a loaded CI run)."""
    jobs = Jobs(app.Job)
    jobs.queue("lim", concurrency=5)

    @jobs.task(queue="lim", name="limited")
    def limited() -> None: ...

    core = WorkerCore(jobs, WorkerSettings(queues=("lim",)), FakeDriver())
    fetcher = core.fetcher
    params = fetcher.limited_params("lim", {"queue_name": "lim", "limit": 10})  # type: ignore[typeddict-item]
    fetcher.limited_claimed("lim", params, LimitedClaim([], True, None, busy=True))
    assert "lim" in fetcher.held and "lim" in fetcher.time_held
    steps, held_for_good = run_steps(fetcher.held_for_good(), lambda step: False)
    assert held_for_good is False and steps == []  # not asked whether anything runs


def test_a_busy_limited_queue_is_held_a_little_longer_each_time_up_to_a_poll_interval() -> None:
    """The hold of a busy queue starts at LIMIT_RECHECK and doubles while its claims stay
    busy, up to the poll interval; a claim that is not busy starts it over. A whole poll
    interval for every busy claim (the worker's own completer holding the lock a moment
    on a loaded machine) left a drain of a key-walking queue idle for 10 s of 11."""
    jobs = Jobs(app.Job)
    jobs.queue("lim", concurrency=5)

    @jobs.task(queue="lim", name="limited")
    def limited() -> None: ...

    core = WorkerCore(jobs, WorkerSettings(queues=("lim",), poll_interval=1.0), FakeDriver())
    fetcher = core.fetcher
    params = fetcher.limited_params("lim", {"queue_name": "lim", "limit": 10})  # type: ignore[typeddict-item]

    def hold(found: LimitedClaim) -> float:
        began = time.monotonic()
        fetcher.limited_claimed("lim", params, found)
        return fetcher.held.get("lim", began) - began

    busy = LimitedClaim([], True, None, busy=True)
    holds = [hold(busy) for _ in range(5)]
    first = fetch_mod.LIMIT_RECHECK
    expected = [first, 2 * first, 4 * first, 1.0, 1.0]
    assert holds == pytest.approx(expected, abs=0.05)
    assert hold(LimitedClaim([row(1, queue="lim")], False, None)) == pytest.approx(0, abs=0.05)
    assert hold(busy) == pytest.approx(first, abs=0.05)  # started over

"""The maintenance duty (worker/_duties/maintenance.py), without a database: when the
upkeep is due, what a refresh changes, retention in batches, and the due times that
wake the fetch loop."""

from __future__ import annotations

import time
from typing import Any

import pytest

from sqla_jobs.worker import _statements as statements
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._statements import Refresh
from sqla_jobs.worker.job import Outcome, OutcomeKind

from .test_core import FakeClock, _use_clock, make, row, run_steps


def _answer(refresh: Refresh, deleted: list[int | None] | None = None) -> Any:
    """Answer a refresh with ``refresh`` and each prune batch with the next of ``deleted``
    (None: another worker holds the pruner lock)."""
    batches = iter(deleted if deleted is not None else [None])

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io) and step.on is s.Conn.TX
        if step.fn is statements.refresh:
            return refresh
        if step.fn is statements.sync_schedules:
            return True
        assert step.fn is statements.prune_batch
        return next(batches)

    return answer


def test_the_refresh_runs_once_per_poll_interval_and_rescues_only_when_its_time_comes() -> None:
    core, _, _ = make(queues=("a", "b"), poll_interval=60)
    maintenance = core.maintenance
    core.fetcher.dry["b"] = time.monotonic() + 60
    steps, _ = run_steps(
        maintenance.run_once(), _answer(Refresh(None, frozenset({"a"}), frozenset({"b"})))
    )
    (sync, refresh, *prunes) = steps
    # The first pass makes the code-declared schedules' rows match the code, once.
    assert isinstance(sync, s.Io) and sync.fn is statements.sync_schedules
    # Rescue at once; the next due time of its own queues only.
    assert isinstance(refresh, s.Io) and refresh.args == (core.jobs, True, core.queues)
    assert [p.fn for p in prunes if isinstance(p, s.Io)] == [statements.prune_batch]  # lock held
    assert maintenance.paused == {"a"} and "b" not in core.fetcher.dry  # woken: not dry
    assert run_steps(maintenance.run_once(), _answer(Refresh(None, frozenset())))[0] == []
    # Forced (Worker.maintain()): a refresh, without a rescue (not due) or retention.
    steps, _ = run_steps(maintenance.now(), _answer(Refresh(None, frozenset())))
    assert [st.args for st in steps if isinstance(st, s.Io)] == [(core.jobs, False, core.queues)]


def test_a_known_due_time_makes_the_refresh_due_and_bounds_the_idle_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a clock the test moves: read from the real one, a loaded CI machine stalled the
    # test 0.46 s, then 1.46 s, between two of these lines, past any margin.
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
    core, driver, _ = make(queues=("a",), poll_interval=60)
    maintenance = core.maintenance
    run_steps(maintenance.run_once(), _answer(Refresh(30.0, frozenset())))
    # To the due time, and a millisecond (woken before it, the claim would find nothing).
    assert maintenance.sleep_for() == pytest.approx(30.001)
    assert maintenance.due_soon(31.0) and not maintenance.due_soon(20.0)
    clock.advance(10)
    assert maintenance.sleep_for() == pytest.approx(20.001)
    # A retry written for sooner than that wakes the fetch loop; a later one does not.
    (job,) = core.claimed([row(1)])
    maintenance.note_due([Outcome(OutcomeKind.FAILED, job, delay=1.0)])
    maintenance.note_due([Outcome(OutcomeKind.FAILED, job, delay=45.0)])
    maintenance.note_due([Outcome(OutcomeKind.SUCCEEDED, job)])
    assert driver.wakes == 1 and maintenance.sleep_for() == pytest.approx(1.001)
    clock.advance(2)  # passed: due now, poll interval or not
    assert [
        type(st) for st in run_steps(maintenance.run_once(), _answer(Refresh(None, frozenset())))[0]
    ] == [s.Io]
    assert maintenance.next_due is None


def test_retention_deletes_in_batches_until_one_is_short_and_stops_when_another_worker_prunes() -> (
    None
):
    core, _, _ = make()
    full = statements.PRUNE_BATCH
    # Dead ones: two full batches and a short one; then done ones: another worker prunes.
    steps, total = run_steps(
        core.maintenance.prune(), _answer(Refresh(None, frozenset()), [full, full, 3, None])
    )
    assert total == 2 * full + 3 and len(steps) == 4
    deleting = [st.args[1] for st in steps if isinstance(st, s.Io)]
    assert deleting[:3] == [core.jobs.queries.prune_dead] * 3
    _, total = run_steps(
        core.maintenance.prune(max_batches=2), _answer(Refresh(None, frozenset()), [full] * 10)
    )
    assert total == 2 * full * len(statements.prune_work(core.jobs))


def test_a_retention_pass_that_stops_at_its_cap_goes_on_at_the_next_poll_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass deletes at most 20 full batches of a kind: with rows left, the next pass is
    a poll interval away, not a prune interval (which capped retention at 333 rows a
    second, less than one worker finishes: a backlog of kept rows only grew)."""
    clock = FakeClock()  # a stall of the test's process cannot move the bounds below
    _use_clock(monkeypatch, clock)
    core, _, _ = make(queues=("a",), poll_interval=1, prune_interval=60)
    maintenance = core.maintenance
    full = statements.PRUNE_BATCH
    run_steps(maintenance.run_once(), _answer(Refresh(None, frozenset()), [full] * 200))
    assert maintenance.behind
    assert maintenance.next_prune - clock.now == 1.0
    # Caught up (every kind short of a full batch): back to the prune interval.
    maintenance.next_refresh = maintenance.next_prune = 0.0
    run_steps(maintenance.run_once(), _answer(Refresh(None, frozenset()), [3] * 10))
    assert not maintenance.behind
    assert maintenance.next_prune - clock.now == 60.0


def test_the_schedules_are_synced_until_a_pass_can_lock_their_rows() -> None:
    """The first pass syncs the code-declared schedules before its refresh; a sync that
    met a locked row (False) is tried again at the next pass, and the refresh runs
    either way (a paused worker's lock must hold back neither)."""
    core, _, _ = make(queues=("a",), poll_interval=60)
    maintenance = core.maintenance
    answers = iter([False, True])

    def answer(step: s.Step) -> Any:
        assert isinstance(step, s.Io)
        if step.fn is statements.sync_schedules:
            return next(answers)
        return _answer(Refresh(None, frozenset()))(step)

    for expected in (False, True):
        steps, _ = run_steps(maintenance.now(), answer)
        fns = [st.fn for st in steps if isinstance(st, s.Io)]
        assert fns[:2] == [statements.sync_schedules, statements.refresh]
        assert maintenance.synced is expected
    steps, _ = run_steps(maintenance.now(), answer)
    assert statements.sync_schedules not in [st.fn for st in steps if isinstance(st, s.Io)]

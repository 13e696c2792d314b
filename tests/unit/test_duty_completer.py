"""The completer duty (worker/_duties/completer.py), without a database: batches of
outcomes, what a write frees and schedules, and its retries."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._statements import LimitedClaim, Written
from sqla_jobs.worker.job import Outcome, OutcomeKind

from .test_core import make, row, run_steps


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
        return Written({})

    assert run_steps(core.completer.run_once(), answer)[1] is True
    assert run_steps(core.completer.run_once(), answer)[1] is True
    assert run_steps(core.completer.run_once(), answer)[1] is False
    assert writes == [3, 2] and core.unwritten == 0


def _held(**settings: Any) -> tuple[Any, Any, Any]:
    """A core serving "a" and "lim" (concurrency=1), whose "lim" is held: its limit was
    full at the last claim."""
    core, driver, jobs = make(queues=("a", "lim"), completion_interval=0.0, **settings)
    jobs.queue("lim", concurrency=1)
    core.limits = {"lim": jobs.limits("lim")}
    core.fetcher.held["lim"] = time.monotonic() + 60
    return core, driver, jobs


def _answering(waiting: list[Any], write: Any) -> Any:
    def answer(step: s.Step) -> Any:
        if isinstance(step, s.TakeOutcomes):
            taken, waiting[:] = waiting[: step.limit], waiting[step.limit :]
            return taken
        if isinstance(step, s.Pause):
            return None
        assert isinstance(step, s.Io)
        return write(step)

    return answer


def test_a_batch_that_frees_a_held_queue_claims_from_it_in_the_same_write() -> None:
    """The write carries the held queue's limited claim (for the worker's free slots); the
    jobs it claims are dispatched, the queue stays held as the claim says, and the fetch
    loop is not woken to claim from it again. A retried write carries a claim again; the
    retry it schedules still wakes the loop when due."""
    core, driver, _ = _held(claim_limit=7)
    done, failed = core.claimed([row(1, queue="lim"), row(2)])
    core.finished(done, Outcome(OutcomeKind.SUCCEEDED, done))
    core.finished(failed, Outcome(OutcomeKind.FAILED, failed, delay=0.5))
    outage = sa.exc.OperationalError("UPDATE", {}, psycopg.OperationalError("gone"))
    asked: list[Any] = []

    def write(step: s.Io) -> Any:
        assert step.on is s.Conn.WRITE and step.fn.__name__ == "write_and_claim"
        asked.append(step.args[2])
        if len(asked) == 1:
            raise outage  # waited out, the same batch written again, with a claim again
        claim = LimitedClaim([row(3, queue="lim")], held=True, rate_free_in=None)
        return Written({"lim": [1, 0, 0], "a": [0, 1, 0]}, claim)

    wakes = driver.wakes
    steps, more = run_steps(core.completer.run_once(), _answering([*driver.recorded], write))
    assert more is True and len(asked) == 2 and core.unwritten == 0
    assert all(p["queue_name"] == "lim" and p["concurrency"] == 1 for p in asked)
    assert [p["limit"] for p in asked] == [7, 7]  # claim_limit: the slots are plenty
    assert sum(isinstance(st, s.Pause) and not st.stoppable for st in steps) == 1
    assert [j.id for j in driver.dispatched] == [3] and core.running == 1
    assert "lim" in core.fetcher.held  # 1 of 7 asked, and the limit held the rest back
    assert driver.wakes == wakes + 1  # the retry's due time, not the ridden queue
    assert core.maintenance.next_due is not None
    assert core.presence.take_tally() == {"lim": [1, 0, 0], "a": [0, 1, 0]}


def test_a_batch_of_no_held_queue_is_written_alone_and_frees_the_queues_it_names() -> None:
    core, driver, jobs = make(queues=("a", "lim"), completion_interval=0.0)
    jobs.queue("lim", concurrency=1)
    core.limits = {"lim": jobs.limits("lim")}
    (job,) = core.claimed([row(1, queue="lim")])
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    asked: list[Any] = []

    def write(step: s.Io) -> Any:
        asked.append(step.args[2])
        return Written({"lim": [1, 0, 0]})

    run_steps(core.completer.run_once(), _answering([*driver.recorded], write))
    assert asked == [None] and driver.dispatched == []


def test_a_claim_that_failed_with_the_batch_leaves_the_queue_to_the_fetch_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The outcomes were written all the same: counted, and the held queue is freed for the
    fetch loop's own claim, with one warning that names the failure."""
    core, driver, _ = _held()
    (job,) = core.claimed([row(1, queue="lim")])
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    timeout = sa.exc.OperationalError("SELECT", {}, psycopg.OperationalError("lock timeout"))
    wakes = driver.wakes
    run_steps(
        core.completer.run_once(),
        _answering([*driver.recorded], lambda step: Written({"lim": [1, 0, 0]}, None, timeout)),
    )
    assert core.unwritten == 0 and driver.dispatched == []
    assert "lim" not in core.fetcher.held and driver.wakes == wakes + 1
    assert core.presence.take_tally() == {"lim": [1, 0, 0]}
    assert "a claim with 1 outcomes failed" in caplog.text and "lock timeout" in caplog.text


def test_a_claim_that_came_back_after_the_stop_began_is_handed_back() -> None:
    """The shutdown hands back the unstarted claims it finds; a claim that rode with a
    write and returned after that is handed back by the completer, its slots freed: none
    of its jobs starts or stays claimed until its lease passes."""
    core, driver, _ = _held()
    (job,) = core.claimed([row(1, queue="lim")])
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    handed: list[int] = []

    def write(step: s.Io) -> Any:
        if step.fn.__name__ == "hand_back":
            handed.extend(j.id for j in step.args[1])
            return len(step.args[1])
        core.stopping = True  # the stop began while the write travelled
        return Written({"lim": [1, 0, 0]}, LimitedClaim([row(5, queue="lim")], True, None))

    free = core.free
    run_steps(core.completer.run_once(), _answering([*driver.recorded], write))
    assert handed == [5] and driver.dispatched == []
    assert core.running == 0 and core.free == free


def test_a_stopping_worker_claims_nothing_with_its_writes() -> None:
    core, driver, _ = _held()
    (job,) = core.claimed([row(1, queue="lim")])
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    core.stopping = True
    asked: list[Any] = []

    def write(step: s.Io) -> Any:
        asked.append(step.args[2])
        return Written({"lim": [1, 0, 0]})

    run_steps(core.completer.run_once(), _answering([*driver.recorded], write))
    assert asked == [None]


def test_a_batch_whose_write_hit_a_bug_is_kept_for_the_next_round() -> None:
    core, driver, _ = make()
    (job,) = core.claimed([row(1)])
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    waiting = [*driver.recorded, s.END]

    def broken(step: s.Step) -> Any:
        if isinstance(step, s.TakeOutcomes):
            taken, waiting[:] = waiting[: step.limit], waiting[step.limit :]
            return taken
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        run_steps(core.completer.run_once(), broken)
    assert [o.job for o in core.completer.batch] == [job] and core.unwritten == 1
    seen, more = run_steps(core.completer.run_once(), lambda step: Written({}))
    assert more is True and [type(st) for st in seen] == [s.Io] and core.unwritten == 0


def test_a_wait_cut_short_with_nothing_taken_does_not_end_the_completer() -> None:
    """``asyncio.run``'s teardown cancels every task at once. The asyncio driver ends the
    completer's wait for outcomes that such a cancel lands in with what is there: nothing
    yet, when the handlers it also cancelled have not handed their jobs back. That empty
    batch ended the completer, and the handed-back outcomes that came a moment later were
    never written: the jobs stayed ``running`` until their leases passed. Only the run's
    end (END) ends it."""
    core, driver, _ = make(completion_interval=0.01)
    [job] = core.claimed([row(1)])
    waiting: list[Any] = []
    writes: list[int] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.TakeOutcomes):
            taken, waiting[:] = waiting[: step.limit], waiting[step.limit :]
            return taken  # nothing yet: the wait cut short
        assert isinstance(step, s.Io) and step.on is s.Conn.WRITE
        writes.append(len(step.args[1]))
        return Written({})

    assert run_steps(core.completer.run_once(), answer)[1] is True  # not done
    core.finished(job, Outcome(OutcomeKind.SNOOZED, job, delay=0.0))
    waiting[:] = [*driver.recorded, s.END]
    assert run_steps(core.completer.run_once(), answer)[1] is True
    assert run_steps(core.completer.run_once(), answer)[1] is False
    assert writes == [1] and core.unwritten == 0

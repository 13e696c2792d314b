"""The completer duty (worker/_duties/completer.py), without a database: batches of
outcomes, what a write frees and schedules, and its retries."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs.worker import _steps as s
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
        return None

    assert run_steps(core.completer.run_once(), answer)[1] is True
    assert run_steps(core.completer.run_once(), answer)[1] is True
    assert run_steps(core.completer.run_once(), answer)[1] is False
    assert writes == [3, 2] and core.unwritten == 0


def test_a_written_batch_counts_frees_held_limited_queues_and_schedules_its_retries() -> None:
    core, driver, jobs = make(queues=("a", "lim"), completion_interval=0.0)
    jobs.queue("lim", concurrency=1)
    core.limits = {"lim": jobs.limits("lim")}
    core.fetcher.held["lim"] = time.monotonic() + 60  # its concurrency limit was full
    done, failed = core.claimed([row(1, queue="lim"), row(2)])
    core.finished(done, Outcome(OutcomeKind.SUCCEEDED, done))
    core.finished(failed, Outcome(OutcomeKind.FAILED, failed, delay=0.5))
    waiting = [*driver.recorded]
    outage = sa.exc.OperationalError("UPDATE", {}, psycopg.OperationalError("gone"))
    tries = 0

    def answer(step: s.Step) -> Any:
        nonlocal tries
        if isinstance(step, s.TakeOutcomes):
            taken, waiting[:] = waiting[: step.limit], waiting[step.limit :]
            return taken
        if isinstance(step, s.Pause):
            return None
        assert isinstance(step, s.Io) and step.on is s.Conn.WRITE
        tries += 1
        if tries == 1:
            raise outage  # waited out, the same batch written again
        return {"lim": [1, 0, 0], "a": [0, 1, 0]}

    wakes = driver.wakes
    steps, more = run_steps(core.completer.run_once(), answer)
    assert more is True and tries == 2 and core.unwritten == 0
    assert sum(isinstance(st, s.Pause) and not st.stoppable for st in steps) == 1
    assert "lim" not in core.fetcher.held and driver.wakes == wakes + 2  # freed, then due
    assert core.maintenance.next_due is not None
    assert core.presence.take_tally() == {"lim": [1, 0, 0], "a": [0, 1, 0]}


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
    seen, more = run_steps(core.completer.run_once(), lambda step: None)
    assert more is True and [type(st) for st in seen] == [s.Io] and core.unwritten == 0

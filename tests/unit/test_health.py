"""The worker core's health decisions, its per-run log line and its progress notes, without
a database: the steps are answered by hand, and time is passed to ``health(now=...)``
instead of waited for."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._core import Run
from sqla_jobs.worker._statements import Refresh, Written
from sqla_jobs.worker.job import Outcome, OutcomeKind

from .test_core import FakeClock, _use_clock, make, row, run_steps


def waiting_on(*steps: s.Step) -> s.Steps:
    yield from steps
    return None


def since(core: Any, loop: str) -> float:
    return float(core._waiting[loop][0])


# -- loops ------------------------------------------------------------------------------------


def test_a_loop_is_stuck_only_past_what_its_step_waits_for_plus_stuck_after() -> None:
    core, _, _ = make(stuck_after=5)
    loop = core.watched("fetch loop", waiting_on(s.Sleep(1.0), s.Io(print, (), s.Conn.CLAIM)))
    assert isinstance(next(loop), s.Sleep)
    t = since(core, "fetch loop")
    assert core.health(now=t + 5.9).healthy  # a 1 s sleep may take 1 s + 5 s
    late = core.health(now=t + 6.1)
    assert not late.healthy
    assert late.problems == ("fetch loop stuck: waiting on Sleep for 6.1s",)
    assert late.loops["fetch loop"] == {"waiting_on": "Sleep", "seconds": 6.1}
    # The loop came back and now waits on a statement, which gets stuck_after alone.
    assert isinstance(loop.send(None), s.Io)
    t = since(core, "fetch loop")
    assert core.health(now=t + 4.9).healthy
    assert core.health(now=t + 5.1).problems == ("fetch loop stuck: waiting on Io print for 5.1s",)
    with pytest.raises(StopIteration):
        loop.send(None)
    ended = core.health(now=t + 100)
    assert ended.healthy and ended.loops["fetch loop"]["waiting_on"] is None


def test_an_idle_completer_is_never_stuck_and_errors_pass_through_the_watch() -> None:
    core, _, _ = make(stuck_after=1)
    completer = core.watched("completer", waiting_on(s.TakeOutcomes(10, None)))
    next(completer)
    assert core.health(now=since(core, "completer") + 3600).healthy
    with pytest.raises(RuntimeError, match="thrown in"):
        completer.throw(RuntimeError("thrown in"))


def test_outcomes_that_wait_for_a_write_make_the_worker_unhealthy_unless_the_database_is_down() -> (
    None
):
    core, driver, _ = make(stuck_after=2)
    (job,) = core.claimed([row(1)])
    core.finished(job, Outcome(OutcomeKind.SUCCEEDED, job))
    t = core._outcomes_since
    assert t is not None and core.health(now=t + 1).healthy
    stuck = core.health(now=t + 3)
    assert stuck.problems == ("1 outcomes waiting 3.0s for a write",)
    assert stuck.unwritten == 1

    # The completer tries to write and cannot reach the server: a database outage, which
    # restarting the worker would not cure, is reported but not unhealthy.
    def unreachable(step: s.Step) -> Any:
        if isinstance(step, s.TakeOutcomes):
            return [driver.recorded[0]] if step.timeout is None else []
        if isinstance(step, s.Io):
            raise sa.exc.OperationalError("DELETE ...", {}, psycopg.OperationalError("refused"))
        raise KeyboardInterrupt  # stop at the pause before the next try

    with pytest.raises(KeyboardInterrupt):
        run_steps(core.completer.run_once(), unreachable)
    outage = core.health(now=t + 3)
    assert outage.healthy and outage.database.startswith("unreachable for ")

    # Written at last: nothing waits any more.
    core.completer.batch = []

    def written(step: s.Step) -> Any:
        if isinstance(step, s.TakeOutcomes):
            return [driver.recorded[0]] if step.timeout is None else []
        return Written({})

    _, more = run_steps(core.completer.run_once(), written)
    assert more is True and core.unwritten == 0
    back = core.health(now=t + 100)
    assert back.healthy and back.database == "ok"


def test_a_worker_whose_run_ended_or_whose_duty_kept_failing_is_unhealthy() -> None:
    core, _, _ = make(queues=("a",))
    assert core.health().healthy and core.health().state == "starting"

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Io):
            name = step.fn.__name__
            return {"refresh": Refresh(None, frozenset()), "claim": [], "prune_batch": 0}.get(name)
        if isinstance(step, s.WaitIdle):
            return True
        return None

    run_steps(core.run(listen=False, until_empty=True), answer)
    report = core.health()
    assert not report.healthy and report.state == "stopped"
    assert report.problems == ("the worker is not running",)

    def broken() -> s.Steps:
        yield s.Tick(0)
        raise RuntimeError("always")

    run_steps(core.supervised("heartbeat", broken), lambda step: None)
    assert "heartbeat kept failing: RuntimeError: always" in core.health().problems[0]
    assert core.health().to_dict()["healthy"] is False


# -- the line per finished run ----------------------------------------------------------------


def test_one_line_per_finished_run_and_log_jobs_off_keeps_the_failures(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stopped clock: the line says exactly the 0.25 s the run took, however long the test
    # process itself is paused between the start and the end (a busy machine: 0.253 s once).
    clock = FakeClock()
    _use_clock(monkeypatch, clock)
    for log_jobs in (True, False):
        core, _, jobs = make(log_jobs=log_jobs)
        ok, bad = core.claimed([row(1), row(2)])
        task = jobs.tasks["work"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sqla_jobs"):
            for job, error in ((ok, None), (bad, ValueError("no"))):
                job.started = clock.monotonic() - 0.25
                core.end(task, job, error)
        lines = [(r.levelname, r.getMessage(), r.__dict__.get("outcome")) for r in caplog.records]
        failed = ("INFO", "job 2 (work, queue a, attempt 1/3): failed in 0.250s, retry in 1s: "
                  "ValueError: no", "retried")  # fmt: skip
        if log_jobs:
            assert lines == [
                ("INFO", "job 1 (work, queue a, attempt 1/3): succeeded in 0.250s", "succeeded"),
                failed,
            ]
            (first, _) = caplog.records
            assert first.duration == pytest.approx(0.25, abs=0.01)  # type: ignore[attr-defined]
        else:
            assert lines == [failed]


# -- progress notes ---------------------------------------------------------------------------


def test_a_progress_note_makes_the_heartbeat_beat_within_a_second_and_no_sooner() -> None:
    core, _, _ = make(lease=30)  # beats every 10 s otherwise
    first, second = core.claimed([row(1), row(2)])
    written: list[list[str | None]] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Tick):
            return False
        assert isinstance(step, s.Io) and step.fn.__name__ == "beat"
        written.append(step.args[3])
        return {(1, 1), (2, 1)}

    core.heartbeat.last_beat = time.monotonic()
    run_steps(core.heartbeat.run_once(), answer)
    assert written == []  # nothing waits

    first.set_progress(0.5, note="half way")
    run_steps(core.heartbeat.run_once(), answer)
    assert written == []  # a beat went out less than a second ago

    core.heartbeat.last_beat = time.monotonic() - 1.01
    run_steps(core.heartbeat.run_once(), answer)
    (notes,) = written
    assert notes[1] is None and notes[0] is not None
    assert first.progress is not None and first.progress["note"] == "half way"
    assert first.unwritten_progress() is None  # written: not sent again

    core.heartbeat.last_beat = time.monotonic() - 1.01
    run_steps(core.heartbeat.run_once(), answer)
    assert len(written) == 1
    assert second.progress is None


def test_set_progress_refuses_what_would_not_fit() -> None:
    core, _, _ = make()
    (job,) = core.claimed([row(1)])
    with pytest.raises(ValueError, match="progress is not JSON-serialisable"):
        job.set_progress(object())
    with pytest.raises(ValueError, match="NUL"):
        job.set_progress(note="a\x00b")
    with pytest.raises(ValueError, match="at most 4096"):
        job.set_progress("x" * 5000)
    with pytest.raises(ValueError, match="must be a string"):
        job.set_progress(1, note=2)  # type: ignore[arg-type]
    assert job.progress is None


def test_a_refused_heartbeat_drops_its_progress_notes_but_an_outage_keeps_them() -> None:
    core, _, _ = make()
    (job,) = core.claimed([row(1)])
    job.set_progress(1)

    def refuse(error: Exception) -> Any:
        def answer(step: s.Step) -> Any:
            raise error

        return answer

    outage = sa.exc.OperationalError("UPDATE ...", {}, psycopg.OperationalError("gone"))
    run_steps(core.heartbeat.beat(), refuse(outage))
    assert job.unwritten_progress() is not None  # sent again with the next beat
    bad = sa.exc.DataError("UPDATE ...", {}, psycopg.DataError("invalid input syntax"))
    run_steps(core.heartbeat.beat(), refuse(bad))
    assert job.unwritten_progress() is None  # the next beat keeps the leases without it


def test_the_fetch_loop_reports_a_database_it_cannot_reach() -> None:
    core, _, _ = make(queues=("a",))
    calls = 0

    def answer(step: s.Step) -> Any:
        nonlocal calls
        if isinstance(step, s.Io):
            calls += 1
            if calls == 1:
                raise sa.exc.OperationalError("SELECT ...", {}, psycopg.OperationalError("x"))
            core.stopping = True
            return {"refresh": Refresh(None, frozenset()), "prune_batch": 0}.get(
                step.fn.__name__, []
            )
        if isinstance(step, s.Pause):
            assert core.health().database.startswith("unreachable for ")
        return None

    run_steps(core.fetcher.fetch(), answer)
    assert calls >= 2 and core.health().database == "ok"


def test_a_worker_whose_claims_wait_while_its_slots_run_nothing_is_unhealthy() -> None:
    """Executors that are gone (a thread that died, a task never made) leave claims that
    never start, their leases kept by the heartbeat for ever: the worker runs nothing
    and must say so. Claimed-ahead jobs that wait while every slot runs are fine."""
    core, _, _ = make(concurrency=2, stuck_after=5)
    first, second, third = core.claimed([row(1), row(2), row(3)])
    at = first.claimed_at
    assert core.health(now=at + 4).healthy
    stuck = core.health(now=at + 6)
    assert stuck.problems == (
        "3 claimed jobs waiting 6.0s to start while 2 of 2 slots run no handler",
    )
    # Both slots run a handler: the third was claimed ahead, and waits for one of them.
    runs = [core.start(first), core.start(second)]
    assert core.health(now=at + 60).healthy
    core.finished(first, Outcome(OutcomeKind.SUCCEEDED, first))
    core._unwritten = 0  # as if the completer wrote it
    assert core.health(now=at + 60).problems == (
        "1 claimed jobs waiting 60.0s to start while 1 of 2 slots run no handler",
    )
    runs.append(core.start(third))
    assert core.health(now=at + 60).healthy
    for run in reversed(runs):  # current_job is reset, as when a run ends
        assert isinstance(run, Run)
        run._close()

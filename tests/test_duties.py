"""Side duties are supervised: an unexpected error is logged and the duty restarted, and
one that keeps failing stops the worker loudly (``WorkerError``), on both workers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, WorkerError, current_job
from sqla_jobs.worker import _core as core_mod
from sqla_jobs.worker import _statements as worker_db

from .helpers import count, rows, wait_for

#: The statement function each duty calls, to break.
DUTIES = {
    "completer": "write_outcomes",
    "heartbeat": "beat",
    "maintenance": "refresh",
    "listener": "listen_sql",
    "presence": "worker_seen",
}


def breaking(monkeypatch: pytest.MonkeyPatch, function: str, times: int | None) -> list[int]:
    """Make ``worker._statements.<function>`` raise a RuntimeError (not a database error) ``times``
    times (None: always); return the list that counts the calls."""
    original = getattr(worker_db, function)
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if times is None or len(calls) <= times:
            raise RuntimeError(f"injected bug in {function}")
        return original(*args, **kwargs)

    monkeypatch.setattr(worker_db, function, broken)
    return calls


def run_in_thread(worker: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.run(install_signal_handlers=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("duty", list(DUTIES))
def test_a_duty_that_fails_once_is_restarted_and_the_worker_carries_on(
    duty: str,
    Session: Any,
    db: sa.Engine,
    jobs: Jobs,
    make_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @jobs.task(queue="q")
    def task(n: int) -> None:
        if duty == "heartbeat":
            current_job().cancelled.wait(1.0)  # long enough to be heartbeated again

    calls = breaking(monkeypatch, DUTIES[duty], times=1)
    worker = make_worker(jobs, db, queues=["q"], lease=0.3, poll_interval=0.05)
    thread, errors = run_in_thread(worker)
    try:
        with Session.begin() as session:
            session.enqueue_many(task, [{"n": i} for i in range(5)])
        wait_for(lambda: count(db) == 0 and len(calls) >= 2, timeout=20)
    finally:
        worker.stop()
        thread.join(20)
    assert not errors
    assert f"injected bug in {DUTIES[duty]}" in caplog.text
    assert "failed unexpectedly; restarting it" in caplog.text


@pytest.mark.parametrize("duty", list(DUTIES))
def test_a_duty_that_keeps_failing_stops_the_worker_loudly(
    duty: str,
    Session: Any,
    db: sa.Engine,
    jobs: Jobs,
    make_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @jobs.task(queue="q")
    def task() -> None:
        if duty == "heartbeat":
            current_job().cancelled.wait(10)  # runs until the worker gives up on it

    breaking(monkeypatch, DUTIES[duty], times=None)
    with Session.begin() as session:
        session.enqueue_many(task, [{} for _ in range(3)])
    worker = make_worker(jobs, db, queues=["q"], lease=0.3, poll_interval=0.05, grace_period=0.2)
    thread, errors = run_in_thread(worker)
    thread.join(60)
    if thread.is_alive():
        worker.stop()
        thread.join(30)
        pytest.fail("the worker did not stop by itself")
    (error,) = errors
    assert isinstance(error, WorkerError)
    assert f"kept failing: RuntimeError: injected bug in {DUTIES[duty]}" in str(error)
    assert "stopping the worker" in caplog.text


def breaking_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the worker's own code fail after the handler of a job whose meta says
    ``{"boom": true}`` (where a row's ``meta`` that was not an object once killed the
    executor thread), so that the failure escapes the run."""
    original = core_mod.keeps

    def broken(job: Any) -> Any:
        if job.meta and job.meta.get("boom"):
            raise AttributeError("injected bug around the run")
        return original(job)

    monkeypatch.setattr(core_mod, "keeps", broken)


def test_a_failure_around_a_run_fails_that_job_and_its_executor_runs_the_next(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executors (threads, or asyncio tasks) are supervised: what escapes a run fails
    that run (it stayed 'running', heartbeated, for ever, and its thread was gone), and
    the executor goes on with the next job. One slot, so a dead executor runs nothing."""
    ran: list[int] = []

    @jobs.task(queue="q", max_attempts=1)
    def task(n: int) -> None:
        ran.append(n)

    breaking_runs(monkeypatch)
    with Session.begin() as session:
        for n in range(6):
            session.enqueue(task, n, meta={"boom": True} if n in (1, 3) else None)
    worker = make_worker(jobs, db, queues=["q"], concurrency=1, lease=2.0, grace_period=1)
    worker.run_until_empty(timeout=30)
    assert sorted(ran) == list(range(6))
    # The jobs that succeeded are deleted; the two that failed are dead with the error.
    left = {r.args["n"]: r for r in rows(db)}
    assert {n: r.status for n, r in left.items()} == {1: "dead", 3: "dead"}
    assert "AttributeError: injected bug around the run" in left[1].last_error


def test_runs_that_keep_failing_in_the_worker_stop_it_loudly(
    Session: Any,
    db: sa.Engine,
    jobs: Jobs,
    make_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def task(n: int) -> None:
        pass

    breaking_runs(monkeypatch)
    with Session.begin() as session:
        for n in range(8):
            session.enqueue(task, n, meta={"boom": True})
    worker = make_worker(jobs, db, queues=["q"], concurrency=1, poll_interval=0.05)
    thread, errors = run_in_thread(worker)
    thread.join(60)
    if thread.is_alive():
        worker.stop()
        thread.join(30)
        pytest.fail("the worker did not stop by itself")
    (error,) = errors
    assert isinstance(error, WorkerError)
    assert "5 runs in a row failed in the worker itself: AttributeError" in str(error)
    # Each run that failed was recorded (written before the worker stopped: one more may
    # have started meanwhile); the jobs it had not started were handed back.
    assert count(db, status="dead") in (5, 6) and count(db, status="running") == 0
    assert count(db, status="dead") + count(db, status="ready") == 8

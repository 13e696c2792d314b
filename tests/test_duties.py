"""Side duties are supervised: an unexpected error is logged and the duty restarted, and
one that keeps failing stops the worker loudly (``WorkerError``), on both workers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, WorkerError, current_job
from sqla_jobs.worker import db as worker_db

from .helpers import count, wait_for

#: The statement function each duty calls, to break.
DUTIES = {
    "completer": "write_outcomes",
    "heartbeat": "beat",
    "maintenance": "refresh",
    "listener": "listen_sql",
    "presence": "worker_seen",
}


def breaking(monkeypatch: pytest.MonkeyPatch, function: str, times: int | None) -> list[int]:
    """Make ``worker.db.<function>`` raise a RuntimeError (not a database error) ``times``
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

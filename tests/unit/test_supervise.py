"""Supervision (worker/_supervise.py) and the retry policy for database errors
(worker/_outage.py), without a database."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs import WorkerError
from sqla_jobs.errors import describe
from sqla_jobs.worker import _core as core_mod
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._outage import retry_pause

from .test_core import make, run_steps


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


def test_a_listener_that_listened_before_its_connection_dropped_retries_at_once() -> None:
    """Each round of the listener that got as far as its LISTEN counts as a success: the
    pause after the server ends its connection stays the first one, however often. The
    other duties' loops, which run beside it, must not clear that mark (they did: every
    drop counted as one more failure in a row, and the pauses grew to half a second)."""
    core, _, _ = make()
    dropped = psycopg.OperationalError("server closed the connection unexpectedly")
    heartbeat = core.supervised("heartbeat", lambda: _one_tick())
    next(heartbeat)
    rounds = 0

    def listens_then_drops() -> s.Steps:
        nonlocal rounds
        rounds += 1
        yield s.Tick(0)
        core.listener.listened = True  # LISTEN went through
        heartbeat.send(None)  # another duty's round, in its own thread
        if rounds > 4:
            return False
        raise dropped

    steps, _ = run_steps(core.supervised("listener", listens_then_drops), lambda step: None)
    pauses = [st.seconds for st in steps if isinstance(st, s.Pause)]
    assert pauses == [retry_pause(1, dropped)] * 4


def _one_tick() -> s.Steps:
    yield s.Tick(0)
    return True

"""The presence duty (worker/_duties/presence.py), without a database: the worker's row,
its counts, and leaving at the end of a run."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs._queries import interval
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._duties.presence import PRESENCE_MISSES

from .test_core import make, row


def test_presence_reports_then_waits_and_keeps_its_counts_through_a_database_error() -> None:
    from sqla_jobs.worker import _statements as statements

    core, _, _ = make(presence_interval=2.0)
    core.presence.count({"a": [3, 1, 0]})
    steps = core.presence.run_once()
    step = next(steps)
    assert isinstance(step, s.Io) and step.fn is statements.worker_seen and step.on is s.Conn.TX
    _, seen, tally, tidy = step.args
    assert (seen["name"], seen["queues"], seen["running"]) == (core.name, ["a"], 0)
    assert tally == {"a": [3, 1, 0]} and tidy
    down = sa.exc.OperationalError("SELECT 1", {}, psycopg.OperationalError("server down"))
    step = steps.throw(down)
    assert step == s.Pause(2.0)
    with pytest.raises(StopIteration) as ended:
        steps.send(None)
    assert ended.value.value is True
    # The counts that could not be written go with the next report, added to new ones.
    core.presence.count({"a": [1, 0, 0], "b": [0, 2, 1]})
    step = next(core.presence.run_once())
    assert step.args[2] == {"a": [4, 1, 0], "b": [0, 2, 1]} and not step.args[3]


def test_presence_ends_when_the_worker_stops_and_the_run_leaves_after_the_duties() -> None:
    from sqla_jobs.worker import _statements as statements

    core, _, _ = make()
    core.stopping = True
    with pytest.raises(StopIteration) as ended:
        next(core.presence.run_once())
    assert ended.value.value is False
    core.presence.count({"a": [2, 0, 0]})
    step = next(core.presence.leave())
    assert step.fn is statements.worker_gone and step.args[1:] == (core.name, {"a": [2, 0, 0]})


def test_the_presence_row_says_who_runs_what_and_lives_for_three_intervals() -> None:
    core, _, _ = make(queues=("a",), concurrency=4, presence_interval=5)
    core.claimed([row(1)])
    found = core.presence.row()
    assert (found["name"], found["kind"], found["queues"]) == (core.name, "FakeDriver", ["a"])
    assert (found["concurrency"], found["running"], found["processed"]) == (4, 1, 0)
    assert found["ttl"] == interval(5 * PRESENCE_MISSES)

"""The worker core behind a pooler in transaction mode, without a database: a LISTEN that
hears nothing is noticed from the claims and said once (sqla_jobs.worker._hearing), and a
lost prepared statement is one ERROR line naming the fix, retried without backoff.
Behind a real PgBouncer: tests/faults/test_pgbouncer.py."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from sqla_jobs.worker import _hearing as hearing
from sqla_jobs.worker import _statements as db
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._hearing import ListenWatch
from sqla_jobs.worker._outage import lost_prepared_statement, retry_pause

from .test_core import make, row, run_steps

# -- the watch by itself, on given times --------------------------------------------------


def test_three_finds_without_a_notification_make_a_deaf_listen() -> None:
    watch = ListenWatch()
    watch.listening(10.0)
    t = 10.0
    for n in range(hearing.MISSES):
        watch.claimed("a", t + 1, 0, 5, t + 1.01)  # empty
        watch.claimed("a", t + 2, 3, 5, t + 2.01)  # jobs came, and no notification
        assert watch.judge(t + 2.5) is None  # too soon to tell
        t += 2
        assert watch.judge(t + 0.01 + hearing.GRACE) is (False if n == hearing.MISSES - 1 else None)
    assert watch.verdict is False and not watch.active
    assert watch.missed_queues == ["a"] and watch.misses == hearing.MISSES


def test_one_announced_find_means_it_hears() -> None:
    watch = ListenWatch()
    watch.listening(10.0)
    watch.claimed("a", 11.0, 0, 5, 11.01)
    watch.claimed("a", 12.0, 1, 5, 12.01)
    watch.claimed("b", 12.0, 0, 5, 12.01)
    watch.heard("b", 12.5)  # not the queue that was found
    assert watch.judge(14.0) is None and watch.misses == 1
    watch.claimed("a", 14.0, 2, 5, 14.01)
    watch.heard("a", 14.005)  # a notification naming it, after it was found empty
    assert watch.judge(16.0) is True
    assert watch.verdict is True and not watch.active


def test_jobs_that_were_there_before_the_listen_or_in_a_full_claim_are_no_sign() -> None:
    watch = ListenWatch()
    watch.claimed("a", 9.0, 0, 5, 9.01)  # before the LISTEN: not watched
    watch.listening(10.0)
    watch.claimed("a", 11.0, 5, 5, 11.01)  # a full claim: there may be more
    watch.claimed("a", 12.0, 5, 5, 12.01)
    watch.claimed("b", 9.5, 0, 5, 10.5)  # began before the LISTEN
    watch.claimed("b", 11.0, 2, 5, 11.01)
    assert watch.judge(20.0) is None and watch.misses == 0
    # A new LISTEN (the connection failed) starts over; a verdict is kept.
    watch.claimed("a", 13.0, 0, 5, 13.01)
    watch.listening(14.0)
    watch.claimed("a", 15.0, 1, 5, 15.01)
    assert watch.judge(20.0) is None and watch.misses == 0


# -- the core: the listener and the fetch loop feed it -----------------------------------------


def listener(core: Any) -> Any:
    """The listener generator, past its LISTEN, waiting for notifications."""
    steps = core.listener.run_once()
    assert isinstance(next(steps), s.Listen)
    assert isinstance(steps.send(None), s.Notifications)
    return steps


def claim(core: Any, rows: list[Any]) -> None:
    core.fetcher.dry.clear()  # as the poll interval would
    run_steps(core.fetcher.claim(), lambda step: rows)


def test_a_worker_whose_listen_hears_nothing_says_so_once_and_stops_listening(
    caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hearing, "GRACE", 0.0)
    core, _, _ = make(queues=("a",), concurrency=10, poll_interval=0.5)
    steps = listener(core)
    with caplog.at_level(logging.WARNING, "sqla_jobs.worker"):
        for n in range(hearing.MISSES):
            claim(core, [])
            claim(core, [row(n + 1)])
            if n < hearing.MISSES - 1:
                assert isinstance(steps.send([]), s.Notifications)  # a round with nothing
        with pytest.raises(StopIteration) as ended:
            steps.send([])
    assert ended.value.value is False  # the listener duty ends; the worker polls
    assert not core.listening.is_set()
    [record] = [r for r in caplog.records if "LISTEN" in r.getMessage()]
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "jobs came into a 3 times" in text
    assert "--no-listen" in text and "PgBouncer" in text and "polls every 0.5s" in text
    # Once: a new LISTEN round does not watch again.
    steps = listener(core)
    assert not core.listen_watch.active


def test_a_worker_that_hears_its_notifications_says_nothing(
    caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hearing, "GRACE", 0.0)
    core, driver, _ = make(queues=("a",), concurrency=10)
    steps = listener(core)
    with caplog.at_level(logging.WARNING, "sqla_jobs.worker"):
        claim(core, [])
        assert isinstance(steps.send(["a"]), s.Notifications)  # the NOTIFY of a new job
        claim(core, [row(1)])
        assert isinstance(steps.send([]), s.Notifications)
    assert core.listen_watch.verdict is True and not core.listen_watch.active
    assert driver.wakes >= 2
    assert not [r for r in caplog.records if "LISTEN" in r.getMessage()]


# -- lost prepared statements ---------------------------------------------------------------


def lost(message: str, kind: type[psycopg.Error]) -> sa.exc.DBAPIError:
    return sa.exc.ProgrammingError("UPDATE jobs ...", {}, kind(message))


LOST = [
    lost('prepared statement "_pg3_0" does not exist', psycopg.errors.InvalidSqlStatementName),
    lost('prepared statement "_pg3_4" already exists', psycopg.errors.DuplicatePreparedStatement),
    lost(
        'bind message supplies 2 parameters, but prepared statement "_pg3_2" requires 6',
        psycopg.errors.ProtocolViolation,
    ),
]


def test_a_lost_prepared_statement_is_told_apart() -> None:
    assert all(lost_prepared_statement(e) for e in LOST)
    assert lost_prepared_statement(LOST[0].orig)  # type: ignore[arg-type]
    other = lost("invalid frontend message type 0", psycopg.errors.ProtocolViolation)
    assert not lost_prepared_statement(other)
    assert not lost_prepared_statement(sa.exc.OperationalError("x", {}, Exception("down")))
    # Retried at once, then every 50 ms: never the 30 s backoff of other refused statements.
    assert [retry_pause(n, LOST[0]) for n in (1, 2, 3, 10, 50)] == [0.0, 0.05, 0.05, 0.05, 0.05]


def test_lost_prepared_statements_are_one_error_line_naming_the_fix(caplog: Any) -> None:
    core, _, _ = make(queues=("a",), concurrency=10)
    errors = iter(LOST * 3)
    pauses: list[float] = []

    def answer(step: s.Step) -> Any:
        if isinstance(step, s.Pause):
            pauses.append(step.seconds)
            return None
        if isinstance(step, s.Io) and step.on is s.Conn.CLAIM:
            error = next(errors, None)
            if error is None:
                core.stopping = True
                return []
            raise error
        if isinstance(step, s.Io) and step.fn is db.refresh:
            return db.Refresh(None, frozenset())
        return None  # retention: another worker holds the pruner lock

    with caplog.at_level(logging.DEBUG, "sqla_jobs.worker"):
        run_steps(core.fetcher.fetch(), answer)
        # The other duties' database errors too: the completer's, the heartbeat's.
        core.supervise("completer", 1, LOST[1])
        core.claimed([row(1)])
        run_steps(core.heartbeat.beat(), lambda step: (_ for _ in ()).throw(LOST[2]))
    assert pauses == [0.0] + [0.05] * 8
    errors_logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors_logged) == 1, [r.getMessage() for r in errors_logged]
    [line] = errors_logged
    text = line.getMessage()
    assert line.levelno == logging.ERROR
    assert 'InvalidSqlStatementName: prepared statement "_pg3_0" does not exist' in text
    assert "max_prepared_statements" in text and "prepare_threshold" in text
    assert "--engine" in text and "PgBouncer" in text
    assert "\n" not in text
    # The others are still there for whoever looks, at DEBUG.
    assert sum("prepared statement" in r.getMessage() for r in caplog.records) == 11


def test_a_lost_prepared_statement_is_no_statement_s_own_error() -> None:
    """``errors.answered`` (an error about the statement, on a working connection: one
    queue's claim, one schedule's job, one pass) is false for a prepared statement a
    pooler lost: the loop waits it out and says it once. Taken for the statement's, a
    schedule was failed to its next tick and the pass logged a warning every time."""
    from sqla_jobs.errors import answered

    assert not any(answered(e) for e in LOST)
    refused = lost("new row violates check constraint", psycopg.errors.CheckViolation)
    assert answered(refused)

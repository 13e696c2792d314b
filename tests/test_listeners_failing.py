"""Listeners, log lines and spans when the code around a job misbehaves: a listener that
disconnects itself or fails on every job, an ``extra`` field named like a JSON line's own
key, a handler's error that cannot be printed."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs.errors import describe
from sqla_jobs.events import Events, JobEvent
from sqla_jobs.logs import JsonFormatter

from .helpers import rows


class Unprintable:
    """An object whose ``str()`` and ``repr()`` fail: an exception holding it cannot be
    printed either."""

    def __str__(self) -> str:
        raise RuntimeError("cannot print this")

    __repr__ = __str__


class Keep(logging.Handler):
    """Keeps the records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def library_logs(level: int) -> Iterator[Keep]:
    """The records of the library's loggers at ``level`` and above, for the block."""
    keep = Keep()
    logger = logging.getLogger("sqla_jobs")
    before = logger.level
    logger.setLevel(level)
    logger.addHandler(keep)
    try:
        yield keep
    finally:
        logger.removeHandler(keep)
        logger.setLevel(before)


# -- a listener that disconnects itself -------------------------------------------------


def test_a_listener_that_disconnects_itself_does_not_hide_the_event_from_the_next(
    Session: Any, jobs: Jobs
) -> None:
    """``fire`` walked the live list that ``disconnect`` removes from: a one-shot listener
    shifted the list under it, and the listener after it (the metrics' counter, say) never
    heard of that event."""
    counted: list[int] = []

    def once(event: JobEvent) -> None:
        jobs.events.disconnect("enqueued", once)

    jobs.events.connect("enqueued", once)
    jobs.events.connect("enqueued", lambda e: counted.append(e.job.id))

    @jobs.task(queue="q")
    def work() -> None: ...

    with Session.begin() as session:
        session.enqueue(work)
    with Session.begin() as session:
        session.enqueue(work)
    assert len(counted) == 2, "the second listener missed the first enqueue"
    assert once not in jobs.events.listeners("enqueued")


def test_a_worker_s_listeners_all_hear_of_a_run_that_one_of_them_disconnects_in(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """The same in a worker (as ``JobMetrics.close()`` while a worker runs): the listener
    after the one that disconnected missed the run's ``succeeded``."""
    counted: list[int] = []

    def once(event: JobEvent) -> None:
        jobs.events.disconnect("succeeded", once)

    jobs.events.connect("succeeded", once)
    jobs.events.connect("succeeded", lambda e: counted.append(e.job.id))

    @jobs.task(queue="q")
    def work(n: int) -> None: ...

    with Session.begin() as session:
        session.enqueue_many(work, [{"n": i} for i in range(3)])
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    assert rows(db) == []
    assert len(counted) == 3, f"the counter heard of {len(counted)} of 3 runs"


def test_a_listener_disconnected_by_another_during_an_event_still_hears_of_it() -> None:
    """A change to the listeners applies from the next event: the one disconnected by an
    earlier listener was skipped for the event being fired."""
    events = Events()
    heard: list[str] = []

    def later(event: JobEvent) -> None:
        heard.append(event.name)

    def first(event: JobEvent) -> None:
        events.disconnect("started", later)

    events.connect("started", first)
    events.connect("started", later)
    events.fire("started", None)
    events.fire("started", None)
    assert heard == ["started"]
    with pytest.raises(ValueError):
        events.disconnect("started", later)


# -- a listener that fails on every job -------------------------------------------------


def test_a_broken_listener_is_reported_once_not_per_job(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A listener that failed on every event logged an ERROR with a traceback per job:
    twenty jobs, twenty tracebacks. Now one ERROR per listener and event, then a line at
    DEBUG."""

    @jobs.events.on("started")
    @jobs.events.on("succeeded")
    def broken(event: JobEvent) -> None:
        raise RuntimeError("listener bug")

    @jobs.task(queue="q")
    def work(n: int) -> None: ...

    with Session.begin() as session:
        session.enqueue_many(work, [{"n": i} for i in range(20)])
    with library_logs(logging.DEBUG) as logs:
        make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    assert rows(db) == []
    about = [r for r in logs.records if r.name == "sqla_jobs.events"]
    errors = [r for r in about if r.levelno >= logging.WARNING]
    assert sorted(r.args[1] for r in errors) == ["started", "succeeded"]  # type: ignore[index]
    assert all(r.levelno == logging.ERROR and r.exc_info for r in errors)
    later = [r for r in about if r.levelno < logging.WARNING]
    assert len(later) == 2 * 20 - 2
    assert all(not r.exc_info and "RuntimeError: listener bug" in r.getMessage() for r in later)


def test_a_listener_connected_again_is_reported_again() -> None:
    """Once per connection: a listener disconnected, mended and connected again has its
    next failure said at ERROR, not hidden at DEBUG."""
    events = Events()

    def broken(event: JobEvent) -> None:
        raise RuntimeError("listener bug")

    events.connect("dead", broken)
    with library_logs(logging.DEBUG) as logs:
        events.fire("dead", None)
        events.fire("dead", None)
        events.disconnect("dead", broken)
        events.connect("dead", broken)
        events.fire("dead", None)
    assert [r.levelname for r in logs.records] == ["ERROR", "DEBUG", "ERROR"]


# -- JSON lines ---------------------------------------------------------------------------


def test_json_lines_keep_every_extra_field_the_record_carries() -> None:
    """``--log-format json`` promises every ``extra`` field; one named like a line's own
    key (``time``, ``level``, ``logger``) was dropped without a word."""
    record = logging.getLogger("myapp").makeRecord(
        "myapp",
        logging.WARNING,
        __file__,
        1,
        "slow upstream",
        (),
        None,
        extra={"time": 12.5, "level": "gold", "logger": "payments", "user": 7},
    )
    data = json.loads(JsonFormatter().format(record))
    assert data["level"] == "WARNING" and data["logger"] == "myapp"
    assert data["user"] == 7
    assert (data["extra.time"], data["extra.level"], data["extra.logger"]) == (
        12.5,
        "gold",
        "payments",
    )


# -- errors that cannot be printed ------------------------------------------------------


def test_describe_never_raises_on_an_error_that_cannot_be_printed() -> None:
    """``describe`` called ``str(exc)`` bare: an error whose ``str()`` fails made the
    report of the failure (the worker's log line, the run's span) fail in turn."""
    assert describe(ValueError(Unprintable())) == "<unprintable ValueError>"
    assert describe(ValueError("bad\nsecond line")) == "ValueError: bad"


def test_the_run_span_is_ended_when_the_handlers_error_cannot_be_printed(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """The SDK's ``record_exception`` calls ``str()`` on the handler's error: when that
    raised, the run span was never ended, so never exported. It is ended now, with the
    error recorded by type."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from sqla_jobs.tracing import JobTracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = JobTracing(jobs, tracer_provider=provider)

    @jobs.task(queue="q", max_attempts=1, name="broken")
    def broken() -> None:
        raise ValueError(Unprintable())

    with Session.begin() as session:
        session.enqueue(broken)
    # The job lines are off: only the tracing meets the error.
    with library_logs(logging.CRITICAL):
        try:
            make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
        finally:
            tracing.close()
            provider.shutdown()
    assert [r.status for r in rows(db)] == ["dead"]
    runs = [s for s in exporter.get_finished_spans() if s.name == "run broken"]
    assert len(runs) == 1, f"spans exported: {[s.name for s in exporter.get_finished_spans()]}"
    span = runs[0]
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "<unprintable ValueError>"
    (event,) = [e for e in span.events if e.name == "exception"]
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "<unprintable ValueError>"


def test_an_event_whose_failure_cannot_be_logged_raises_nothing_into_its_caller(
    Session: Any, db: sa.Engine, jobs: Jobs, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken listener, and a log handler that raises on the line saying so (a custom
    handler whose endpoint is down): the error came out of ``fire``, into the caller, an
    application's commit among them (committed, yet raising). The listeners after it
    still hear of the event."""
    heard: list[str] = []

    def broken(event: Any) -> None:
        raise RuntimeError("broken listener")

    jobs.events.connect("enqueued", broken)
    jobs.events.connect("enqueued", lambda event: heard.append(event.name))

    class Raising(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise ConnectionError("log endpoint down")

    @jobs.task(queue="q")
    def work() -> None: ...

    logger = logging.getLogger("sqla_jobs.events")
    handler = Raising()
    logger.addHandler(handler)
    try:
        with Session.begin() as session:
            session.enqueue(work)
    finally:
        logger.removeHandler(handler)
    assert heard == ["enqueued"]
    assert len(rows(db)) == 1
    # Printed instead, as logging prints its own handlers' errors.
    err = capsys.readouterr().err
    assert "--- sqla_jobs: the log line about a broken 'enqueued' listener failed" in err
    assert "ConnectionError: log endpoint down" in err

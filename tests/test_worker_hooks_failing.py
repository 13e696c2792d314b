"""What a worker's log lines, events and run hooks do must never change what its runs do:
a log handler that raises, a slow listener or hook, an error that cannot be printed, an
error the size of a payload."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, Worker, current_job
from sqla_jobs.events import JobEvent

from . import app
from .helpers import rows


@contextlib.contextmanager
def logged(handler: logging.Handler, level: int = logging.INFO) -> Iterator[None]:
    """``handler`` on the library's loggers, at ``level``, for the block."""
    logger = logging.getLogger("sqla_jobs")
    before = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


class Failing(logging.Handler):
    """A log shipper whose endpoint is down: raises on the lines about jobs that ``which``
    picks (and counts them)."""

    def __init__(self, which: Any = lambda record: True) -> None:
        super().__init__(logging.DEBUG)
        self.which = which
        self.raised = 0

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "job_id") and self.which(record):
            self.raised += 1
            raise ConnectionError("log shipper unreachable")


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("cannot print this")

    __repr__ = __str__


def test_a_log_handler_failing_on_every_job_line_changes_no_outcome(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A handler that raised on the worker's "succeeded" line failed the finished job
    (the worker took it for its own crash) and ran it again, up to its last attempt."""
    runs: list[tuple[str, int]] = []

    @jobs.task(queue="q", max_attempts=3)
    def pay(n: int) -> None:
        runs.append(("pay", current_job().attempts))

    @jobs.task(queue="q", max_attempts=2)
    def refuse() -> None:
        runs.append(("refuse", current_job().attempts))
        raise ValueError("refused")

    with Session.begin() as session:
        session.enqueue(pay, 1)
        session.enqueue(refuse)
    handler = Failing()
    with logged(handler):
        make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(
            wait_scheduled=3, timeout=15
        )
    assert handler.raised >= 3
    assert sorted(runs) == [("pay", 1), ("refuse", 1), ("refuse", 2)]
    assert [(r.task.rsplit(".", 1)[-1], r.status, r.attempts) for r in rows(db)] == [
        ("refuse", "dead", 2)
    ]


def test_a_log_handler_failing_on_a_timeout_line_does_not_leave_the_job_running(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """The heartbeat logged a timeout before recording it: the handler's error left the
    outcome unwritten and the job ``running``, its lease extended while the worker
    lived."""
    runs: list[int] = []

    @jobs.task(queue="q", max_attempts=2, timeout=0.3)
    def slow() -> None:
        job = current_job()
        runs.append(job.attempts)
        deadline = time.monotonic() + 5
        while job.attempts == 1 and not job.is_cancelled and time.monotonic() < deadline:
            time.sleep(0.02)

    with Session.begin() as session:
        session.enqueue(slow)
    handler = Failing(lambda r: "TimeoutError" in r.getMessage())
    with logged(handler, logging.WARNING):
        make_worker(
            jobs, db, queues=["q"], listen=False, lease=1.5, poll_interval=0.2
        ).run_until_empty(wait_scheduled=3, timeout=10)
    assert handler.raised >= 1
    assert runs == [1, 2]
    assert rows(db) == []


def test_run_hooks_are_exited_when_the_line_about_the_run_cannot_be_logged(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A run's line was logged before its run hooks were exited: a handler error that
    could not be printed, or a log handler that raised, left them entered (a span never
    ended, a trace context never detached)."""
    calls: list[str] = []

    class Hook:
        def enter(self, job: Any) -> object:
            calls.append("enter")
            return None

        def exit(self, job: Any, state: object, outcome: str, error: Any) -> None:
            calls.append(f"exit {outcome}")

    jobs.events.add_run_hook(Hook())

    @jobs.task(queue="q", max_attempts=1)
    def broken(n: int) -> None:
        raise ValueError(Unprintable())

    with Session.begin() as session:
        session.enqueue_many(broken, [{"n": 1}, {"n": 2}])
    with logged(Failing(lambda r: r.job_id == min(j.id for j in rows(db)))):
        make_worker(jobs, db, queues=["q"], listen=False, concurrency=1).run_until_empty(timeout=15)
    assert [r.status for r in rows(db)] == ["dead", "dead"]
    assert calls == ["enter", "exit dead"] * 2


@pytest.mark.parametrize("lease", [None, 30.0], ids=["lease default", "lease 30s"])
@pytest.mark.parametrize("slow", ["started listener", "around_run"])
def test_a_run_timed_out_in_its_started_hooks_does_not_call_its_handler(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, slow: str, lease: float | None
) -> None:
    """The handler was called once the started listeners and run hooks returned, though
    the heartbeat had meanwhile recorded the attempt timed out and its retry ran: the
    job's work done twice. (The asyncio worker's heartbeat waited on the blocked loop,
    then timed out the handler that had just begun.) And where the heartbeat had not
    beaten yet (a 30 s lease beats every 10 s; on a loaded machine the asyncio worker's
    handler thread could start before the heartbeat's turn on the loop), the handler was
    called though past its timeout, and timed out at the next beat: its work done, then
    done again by the retry."""
    runs: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def block_first(job: Any) -> None:
        if job.attempts == 1:
            time.sleep(1.5)

    if slow == "started listener":
        jobs.events.connect("started", lambda e: block_first(e.job))
    else:

        @jobs.around_run
        @contextlib.contextmanager
        def context(job: Any) -> Iterator[None]:
            block_first(job)
            yield

    @jobs.task(queue="q", max_attempts=2, timeout=0.5)
    def work() -> None:
        job = current_job()
        with lock:
            runs.append((job.attempts, job.is_cancelled))

    with Session.begin() as session:
        session.enqueue(work)
    how = {} if lease is None else {"lease": lease}
    worker = make_worker(jobs, db, queues=["q"], listen=False, concurrency=2, **how)
    worker.run_until_empty(wait_scheduled=5, timeout=15)
    assert rows(db) == []
    assert runs == [(2, False)], f"handler runs (attempt, cancelled): {runs}"


def test_a_job_rescued_while_an_asyncio_worker_s_listener_blocked_its_loop_runs_once(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A synchronous ``started`` listener blocked an asyncio worker's loop, and with it the
    heartbeat, past the claim's lease: another worker rescued the job and ran it. When the
    listener returned, the first worker called the handler too: the job's work done
    twice. It now sees that its claim went unrenewed for over half a lease, and hands the
    claim back uncalled (a write guarded by the claim, which changes nothing here)."""
    from .conftest import AsyncWorkerInThread

    runs: list[int] = []
    lock = threading.Lock()
    blocked, ran_elsewhere = threading.Event(), threading.Event()

    @jobs.events.on("started")
    def block_first(event: JobEvent) -> None:
        if event.job.attempts == 1:
            blocked.set()
            ran_elsewhere.wait(15)  # the loop, heartbeat included, is held meanwhile

    @jobs.task(queue="q")
    def work() -> None:
        with lock:
            runs.append(current_job().attempts)
        ran_elsewhere.set()

    with Session.begin() as session:
        session.enqueue(work)
    stalled = AsyncWorkerInThread(jobs, database_url, queues=["q"], listen=False, lease=1.0)
    first = threading.Thread(target=stalled.run_until_empty, kwargs={"timeout": 30})
    first.start()
    rescuer = Worker(
        jobs, db, queues=["q"], listen=False, lease=1.0, rescue_interval=0.1, poll_interval=0.1
    )
    second = threading.Thread(target=rescuer.run, kwargs={"install_signal_handlers": False})
    try:
        assert blocked.wait(15), "the first worker never started the job"
        second.start()  # only now: the first claim is the stalled worker's
        assert ran_elsewhere.wait(15), "the lapsed claim was never rescued"
        first.join(30)
        assert not first.is_alive()
    finally:
        ran_elsewhere.set()
        rescuer.stop()
        if second.is_alive():
            second.join(30)
        first.join(30)
    assert runs == [2], f"handler runs by attempt: {runs}"
    assert rows(db) == []


def test_a_slow_listener_of_a_timed_out_run_does_not_hold_up_the_heartbeat(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """Threaded worker. The events of a timed-out run were fired on the heartbeat's
    thread: a ``dead`` listener that took 3 s let the 1.5 s leases of the other running
    jobs lapse, and the rescue ran them again beside themselves."""
    runs: list[int] = []
    heard: list[str] = []
    lock = threading.Lock()

    @jobs.events.on("dead")
    def report(event: JobEvent) -> None:
        time.sleep(3.0)
        heard.append(event.job.task)

    @jobs.task(queue="q", max_attempts=1, timeout=0.2)
    def stuck() -> None:
        deadline = time.monotonic() + 5
        while not current_job().is_cancelled and time.monotonic() < deadline:
            time.sleep(0.02)

    @jobs.task(queue="q", max_attempts=3)
    def long() -> None:
        with lock:
            runs.append(current_job().attempts)
        time.sleep(3.5)

    with Session.begin() as session:
        session.enqueue(long)
        session.enqueue(stuck)
    worker = Worker(
        jobs, db, queues=["q"], listen=False, concurrency=3, lease=1.5, poll_interval=0.1
    )
    worker.run_until_empty(timeout=15)
    assert runs == [1], f"long ran {len(runs)} times (attempts {runs})"
    assert heard == [stuck.name]  # told, off the heartbeat
    assert [(r.status, r.attempts) for r in rows(db)] == [("dead", 1)]


def test_a_job_of_an_unknown_task_that_ends_dead_fires_failed_and_dead(
    db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A job of a task no worker knows (past the grace for rolling deploys) ended dead
    with no event: listeners paging on ``dead``, and the metrics, never heard of it."""
    heard: list[tuple[str, str]] = []
    for name in ("started", "failed", "dead", "retried", "snoozed"):
        jobs.events.connect(name, lambda e: heard.append((e.name, e.job.task)))

    @jobs.task(queue="q")
    def known() -> None: ...

    with db.begin() as conn:
        conn.execute(
            sa.insert(app.Job.__table__).values(
                task="tasks.removed_long_ago",
                queue="q",
                args={},
                max_attempts=1,
                created_at=datetime.now(timezone.utc) - timedelta(days=3),
            )
        )
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    assert [r.status for r in rows(db)] == ["dead"]
    assert heard == [("failed", "tasks.removed_long_ago"), ("dead", "tasks.removed_long_ago")]


def test_a_log_handler_failing_on_an_unknown_task_s_line_snoozes_it_all_the_same(
    db: sa.Engine, jobs: Jobs, make_worker: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job of a task this worker does not know (a rolling deploy) is snoozed for a
    worker that knows it, its attempt not counted; a log handler that raised on the line
    saying so made the worker take it for its own crash: the attempt was spent (and a job
    of ``max_attempts=1`` died unrun)."""

    @jobs.task(queue="q")
    def known() -> None: ...

    with db.begin() as conn:
        conn.execute(
            sa.insert(app.Job.__table__).values(
                task="tasks.from_the_next_deploy", queue="q", args={}, max_attempts=1
            )
        )
    failing = Failing()
    with logged(failing):
        make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    assert failing.raised >= 1
    (job,) = rows(db)
    assert (job.status, job.max_attempts - job.attempts) == ("scheduled", 1)
    # The handler's error is printed, as logging prints its own handlers' errors.
    err = capsys.readouterr().err
    assert "--- sqla_jobs: the log line about an unknown task failed" in err
    assert "ConnectionError: log shipper unreachable" in err


def test_a_dead_job_is_logged_as_a_warning_when_the_level_is_warning(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """The line about a failed run was written only where INFO was enabled: with the
    library's loggers at WARNING, a dead job's WARNING line was never written."""

    @jobs.task(queue="q", max_attempts=1)
    def doomed() -> None:
        raise ValueError("never")

    with Session.begin() as session:
        session.enqueue(doomed)
    kept = Kept()
    with logged(kept, logging.WARNING):
        make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    assert [r.status for r in rows(db)] == ["dead"]
    dead = [r for r in kept.records if getattr(r, "outcome", None) == "dead"]
    assert [r.levelno for r in dead] == [logging.WARNING]
    assert "ValueError: never" in dead[0].getMessage()


def test_a_huge_error_message_makes_a_bounded_log_line(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """``last_error`` was capped at 64 KiB, the line about the same failure was not: a
    handler that put a 2 MB payload in its error wrote a 2 MB line per attempt."""

    @jobs.task(queue="q", max_attempts=1)
    def upload(size: int) -> None:
        raise ValueError("payload refused: " + "x" * size)

    with Session.begin() as session:
        session.enqueue(upload, 2_000_000)
    kept = Kept()
    with logged(kept):
        make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    (job,) = rows(db)
    assert job.status == "dead"
    (line,) = [r for r in kept.records if getattr(r, "outcome", None) == "dead"]
    assert len(line.getMessage()) <= 16 * 1024
    assert "ValueError: payload refused: xxx" in line.getMessage()
    assert line.getMessage().endswith("[truncated]")
    assert len(line.error) <= 16 * 1024


def test_the_line_about_a_run_whose_error_holds_a_lone_surrogate_is_valid_utf8(
    db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A dead job's WARNING line carried its error's lone surrogate as it was: every
    handler writing UTF-8 (a file, a stream, a log shipper, pytest-xdist's report) failed
    on it. Escaped, as ``last_error`` keeps it."""

    @jobs.task(queue="q", max_attempts=1)
    def bad() -> None:
        raise ValueError("a lone \ud800 surrogate and a \x00")

    with db.begin() as conn:
        jobs.enqueue(conn, bad)
    kept = Kept()
    with logged(kept, logging.WARNING):
        make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=15)
    (line,) = [r.getMessage() for r in kept.records if getattr(r, "outcome", None) == "dead"]
    line.encode("utf-8")
    assert "a lone \\ud800 surrogate and a \\x00" in line

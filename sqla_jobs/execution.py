"""What running one job means, shared by the threaded and the asyncio worker.

A worker claims rows; each becomes a :class:`ClaimedJob`. Running it yields an
:class:`Outcome` (done, failed, snoozed), which the worker's completer turns into
statements with :func:`outcome_statements`. Keeping this here means the two workers
differ only in how they wait, never in what a job's result does to its row.
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import threading
import traceback
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .errors import PermanentError, Snooze
from .queries import Queries, interval

if TYPE_CHECKING:
    from .tasks import Jobs, Task

__all__ = ["ClaimedJob", "Outcome", "current_job"]

log = logging.getLogger("sqla_jobs.worker")

_MAX_ERROR_CHARS = 65536

OK, FAIL, SNOOZE, SETTLED = "ok", "fail", "snooze", "settled"

#: Payload of a NOTIFY that asks workers to heartbeat now: a running job was cancelled.
CANCEL_PAYLOAD = "!cancel"


@dataclass(eq=False)
class ClaimedJob:
    """A job as its worker holds it while it runs; handlers get it from :func:`current_job`."""

    id: int
    queue: str
    task: str
    args: dict[str, Any]
    attempts: int
    max_attempts: int
    priority: int
    run_at: datetime
    created_at: datetime
    worker: str = ""
    #: Why the run was told to stop (see :attr:`cancelled`), or None.
    cancel_reason: str | None = field(default=None, repr=False)
    #: ``time.monotonic()`` when the handler started (0 until then).
    started: float = field(default=0.0, repr=False)
    _event: threading.Event | None = field(default=None, repr=False)

    @property
    def cancelled(self) -> threading.Event:
        """Set when this run should stop: the job was cancelled, its lease was lost to
        another worker, or it ran out of time. A long handler checks it between steps (or
        waits on it) and returns early; whatever it returns afterwards is ignored.

        Made on first use: the fetch loop builds a ClaimedJob per claimed row, and a
        ``threading.Event`` (a Condition and a Lock) per row cost a fifth of the drain's
        throughput, for an event almost never used.
        """
        event = self._event
        if event is None:
            with _EVENT_LOCK:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
        return event

    @property
    def is_cancelled(self) -> bool:
        """``cancelled.is_set()``, without making the event."""
        event = self._event
        return event is not None and event.is_set()

    @property
    def is_last_attempt(self) -> bool:
        """True when a failure now would make the job dead."""
        return self.attempts >= self.max_attempts

    def cancel(self, reason: str) -> None:
        if not self.is_cancelled:
            self.cancel_reason = reason
            self.cancelled.set()


_EVENT_LOCK = threading.Lock()

_current: contextvars.ContextVar[ClaimedJob] = contextvars.ContextVar("sqla_jobs_current_job")


def current_job() -> ClaimedJob:
    """The job the calling handler is running. Raises ``LookupError`` outside a handler."""
    return _current.get()


def set_current(job: ClaimedJob) -> contextvars.Token[ClaimedJob]:
    return _current.set(job)


def reset_current(token: contextvars.Token[ClaimedJob]) -> None:
    _current.reset(token)


@dataclass(slots=True)
class Outcome:
    """The result of one run, as the completer writes it."""

    kind: str
    job: ClaimedJob
    error: str | None = None
    delay: float = 0.0
    permanent: bool = False


def job_log(level: int, job: ClaimedJob, message: str, *args: Any) -> None:
    """Log about one job: the message is prefixed with its id, task, queue and attempt,
    which are also passed as ``extra`` fields (``job_id``, ``task``, ``queue``,
    ``attempt``) for structured log handlers."""
    if not log.isEnabledFor(level):
        return
    log.log(
        level,
        "job %s (%s, queue %s, attempt %s/%s): " + message,
        job.id,
        job.task,
        job.queue,
        job.attempts,
        job.max_attempts,
        *args,
        extra={"job_id": job.id, "task": job.task, "queue": job.queue, "attempt": job.attempts},
    )


def format_error(exc: BaseException) -> str:
    """The exception and its traceback, as kept in ``last_error`` (capped at 64 KiB)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(text) > _MAX_ERROR_CHARS:
        text = text[: _MAX_ERROR_CHARS - 20] + "\n[truncated]"
    return text


def retry_delay(policy: Any, job: ClaimedJob, name: str) -> float:
    """Seconds before the next attempt; a broken retry policy must not lose the job."""
    try:
        return max(0.0, float(policy(job.attempts)))
    except Exception:
        log.exception("task %s: retry policy failed; retrying in 60s", name)
        return 60.0


def unknown_task(jobs: Jobs, job: ClaimedJob, worker: str) -> Outcome:
    """A job whose task this worker does not know: a failure that follows the default
    retry policy, so a deploy that lags behind loses nothing."""
    job_log(logging.ERROR, job, "unknown task, failing it")
    return Outcome(
        FAIL,
        job,
        error=f"unknown task {job.task!r}: no handler of that name is registered in "
        f"worker {worker}",
        delay=retry_delay(jobs.retry, job, job.task),
    )


def outcome_of(task: Task[Any, Any], job: ClaimedJob, exc: BaseException | None) -> Outcome:
    """Map how a handler ended to an outcome."""
    if exc is None:
        return Outcome(OK, job)
    if isinstance(exc, Snooze):
        return Outcome(SNOOZE, job, delay=exc.delay)
    if isinstance(exc, PermanentError):
        return Outcome(FAIL, job, error=format_error(exc), permanent=True)
    job_log(logging.INFO, job, "failed: %r", exc)
    return Outcome(
        FAIL, job, error=format_error(exc), delay=retry_delay(task.retry, job, task.name)
    )


def timed_out(task: Task[Any, Any], job: ClaimedJob) -> Outcome:
    return Outcome(
        FAIL,
        job,
        error=f"TimeoutError: task {task.name!r} ran longer than its timeout of {task.timeout}s",
        delay=retry_delay(task.retry, job, task.name),
    )


def outcome_statements(
    q: Queries, batch: Iterable[Outcome]
) -> list[tuple[sa.Executable, dict[str, Any]]]:
    """The statements that record a batch: one for all completions, one per failure."""
    statements: list[tuple[sa.Executable, dict[str, Any]]] = []
    ok = [o.job for o in batch if o.kind == OK]
    if ok:
        statements.append(
            (q.complete, {"ids": [j.id for j in ok], "attempt_list": [j.attempts for j in ok]})
        )
    for o in batch:
        if o.kind == FAIL:
            statements.append(
                (
                    q.fail,
                    {
                        "job_id": o.job.id,
                        "attempt": o.job.attempts,
                        "error": o.error,
                        "delay": interval(o.delay),
                        "permanent": o.permanent,
                    },
                )
            )
        elif o.kind == SNOOZE:
            statements.append(
                (
                    q.snooze,
                    {"job_id": o.job.id, "attempt": o.job.attempts, "delay": interval(o.delay)},
                )
            )
    return statements


def complete_one_params(job: ClaimedJob) -> dict[str, Any]:
    """Parameters of the batch completion, for a batch of one (transactional tasks)."""
    return {"ids": [job.id], "attempt_list": [job.attempts]}


def worker_name() -> str:
    """Unique per worker: host, pid and a random suffix (several workers per process)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def default_queues(jobs: Jobs, queues: Iterable[str] | None) -> list[str]:
    names = (
        list(queues)
        if queues
        else sorted({t.queue for t in jobs.tasks.values()} or {jobs.default_queue})
    )
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"queue names must be non-empty strings, got {name!r}")
    return names

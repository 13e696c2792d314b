"""sqla-jobs: a transactional job queue in your own PostgreSQL database.

Jobs are rows in a table of the application's own database, declared with
:class:`JobMixin` in its own metadata and created by its own Alembic migrations. A job
enqueued with ``session.enqueue(...)`` commits or rolls back with the rest of the
transaction, so there is no dual write: no job for a row that never existed, no row
whose job was lost. Workers claim jobs with ``FOR NO KEY UPDATE SKIP LOCKED``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .db import create_async_engine, create_engine
from .errors import (
    EnqueueError,
    JobFailedError,
    JobsError,
    PermanentError,
    ResultError,
    SignalError,
    Snooze,
    StepError,
    UnknownTaskError,
    WaitTimedOut,
    WorkerError,
)
from .model import STATUSES, JobMixin, JobStatus
from .session import EnqueueMixin, JobSession
from .steps import AsyncSteps, Batch, Steps
from .tasks import (
    Backoff,
    ConfiguredTask,
    DurableTask,
    EnqueueOptions,
    Jobs,
    Task,
    TaskArgs,
    TransactionalTask,
    Unique,
)
from .worker import ClaimedJob, Worker, WorkerSettings, current_job

__all__ = [
    "STATUSES",
    "AsyncSteps",
    "Backoff",
    "Batch",
    "ClaimedJob",
    "ConfiguredTask",
    "DurableTask",
    "EnqueueError",
    "EnqueueMixin",
    "EnqueueOptions",
    "JobFailedError",
    "JobMixin",
    "JobSession",
    "JobStatus",
    "Jobs",
    "JobsError",
    "PermanentError",
    "ResultError",
    "SignalError",
    "Snooze",
    "StepError",
    "Steps",
    "Task",
    "TaskArgs",
    "TransactionalTask",
    "Unique",
    "UnknownTaskError",
    "WaitTimedOut",
    "Worker",
    "WorkerError",
    "WorkerSettings",
    "create_async_engine",
    "create_engine",
    "current_job",
]

if TYPE_CHECKING:
    #: The installed distribution's version: ``pyproject.toml`` is its one source.
    __version__: str


def __getattr__(name: str) -> Any:
    """``__version__``, read from the installed distribution when first asked for:
    reading it (``importlib.metadata``'s search of ``sys.path`` and its e-mail header
    parser) was a few hundredths of a second of every worker's start, for a string that
    the worker never reads."""
    if name == "__version__":
        from importlib import metadata

        try:
            version = metadata.version("sqla-jobs")
        except metadata.PackageNotFoundError:  # a checkout that was never installed
            version = "0+unknown"
        globals()["__version__"] = version
        return version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Log output for ``sqla-jobs worker``: a level, and text or JSON lines.

.. code-block:: console

    $ sqla-jobs worker myapp.tasks:jobs --log-level INFO --log-format json
    {"time": "2026-11-30T12:00:00.123456+00:00", "level": "INFO", "logger": "sqla_jobs.worker",
     "message": "job 7 (myapp.tasks.send, queue mail, attempt 1/5): succeeded in 0.012s",
     "job_id": 7, "task": "myapp.tasks.send", "queue": "mail", "attempt": 1,
     "worker": "web-1:4242:a1b2c3", "outcome": "succeeded", "duration": 0.012}

JSON is one object per line, for a log shipper to parse: the record's time (UTC), level,
logger and message, every ``extra`` field the record carries (the worker's job lines carry
``job_id``, ``task``, ``queue``, ``attempt``, ``worker`` and, when a run ends, ``outcome``,
``duration`` and ``error``), and a traceback as one string. An ``extra`` field named
like one of the line's own keys (``time``, ``level``, ``logger``) is kept as
``extra.time``, ``extra.level``, ``extra.logger``. No dependency: the standard
library's ``logging`` and ``json``.

Lines that handler code logs carry the job too: :class:`JobContext`, a filter on the
handler, adds the running job's ``job_id``, ``task``, ``queue``, ``attempt`` and ``worker``
to every record logged while a handler runs (from :func:`~sqla_jobs.current_job`, a
context variable, so it follows the run into ``async def`` handlers and
``asyncio.to_thread``), and the text format starts such a line's message with the job, as
the worker's own job lines are written::

    12:00:00,123 WARNING myapp.tasks: job 7 (myapp.tasks.send, queue mail, attempt 1/5): bounced

The level given applies to the library's own loggers (``sqla_jobs.*``); every other
logger keeps its own level (the root's is WARNING), so that an application's imports
(Alembic's plugin set-up, say) do not fill a worker's log with INFO lines. An application
that wants its own INFO lines sets its loggers' level (``logging.getLogger("myapp")
.setLevel("INFO")``). An application that configures logging itself can use
:class:`JsonFormatter`, :data:`TEXT_FORMAT` and :class:`JobContext` on its own handlers.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any

from .worker.job import current_job

__all__ = ["FORMATS", "LEVELS", "TEXT_FORMAT", "JobContext", "JsonFormatter", "configure"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")

#: The text format ``sqla-jobs`` prints; ``%(job_prefix)s`` is empty except on a line that
#: handler code logged (see :class:`JobContext`; give the formatter
#: ``defaults={"job_prefix": ""}``).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(job_prefix)s%(message)s"

#: Attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

#: A JSON line's own keys that an ``extra`` field may be named: it is kept as
#: ``extra.<name>``. (``logging`` refuses the other ones, ``message`` and ``exc_info``, as
#: extras: they are standard attributes.)
_OWN = frozenset({"time", "level", "logger"})

#: Added by JobContext for the text format only: not a field of a JSON line.
_TEXT_ONLY = frozenset({"job_prefix"})

_encode = json.JSONEncoder(ensure_ascii=False, default=str).encode


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in _TEXT_ONLY and not key.startswith("_"):
                # An extra named like one of the line's own keys is kept beside it.
                data[f"extra.{key}" if key in _OWN else key] = value
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack_info"] = self.formatStack(record.stack_info)
        return _encode(data)


class JobContext(logging.Filter):
    """Adds the running job to the records logged while a handler runs.

    A filter of a handler (``handler.addFilter(JobContext())``), not of a logger: a
    logger's filters do not see the records its children pass up. A record that has a
    ``job_id`` already (the worker's own job lines) is left as it is.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        fields = record.__dict__
        if "job_id" in fields:
            return True
        try:
            job = current_job()
        except LookupError:  # not inside a handler
            return True
        # setdefault: a field the line's own ``extra`` gave is kept.
        fields["job_id"] = job.id
        fields.setdefault("task", job.task)
        fields.setdefault("queue", job.queue)
        fields.setdefault("attempt", job.attempts)
        fields.setdefault("worker", job.worker)
        fields.setdefault(
            "job_prefix",
            f"job {job.id} ({job.task}, queue {job.queue}, "
            f"attempt {job.attempts}/{job.max_attempts}): ",
        )
        return True


def configure(level: str | int = "INFO", fmt: str = "text") -> None:
    """Log to stderr, as text lines or JSON objects (replaces the root logger's handlers):
    the library's loggers at ``level``, every other logger at its own (the root at
    WARNING), and lines logged by handlers with their job (:class:`JobContext`)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter(TEXT_FORMAT, defaults={"job_prefix": ""})
    )
    handler.addFilter(JobContext())
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("sqla_jobs").setLevel(level)

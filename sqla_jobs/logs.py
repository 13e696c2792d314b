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
``duration`` and ``error``), and a traceback as one string. No dependency: the standard
library's ``logging`` and ``json``. An application that configures logging itself can use
:class:`JsonFormatter` on its own handlers.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any

__all__ = ["FORMATS", "LEVELS", "JsonFormatter", "configure"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")

#: The text format ``sqla-jobs`` has always printed.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}

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
            if key not in _STANDARD and not key.startswith("_") and key not in data:
                data[key] = value
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            data["stack_info"] = self.formatStack(record.stack_info)
        return _encode(data)


def configure(level: str | int = "INFO", fmt: str = "text") -> None:
    """Log to stderr at ``level``, as text lines or JSON objects (replaces the root
    logger's handlers)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)

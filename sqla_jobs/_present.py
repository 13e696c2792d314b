"""How operators' tools write the queue's values: times, durations, counts, a job's fields.

Internal: the ``sqla-jobs`` command (:mod:`sqla_jobs.cli`) and the dashboard's templates
(:mod:`sqla_jobs.web`) both render :mod:`sqla_jobs.admin`'s read model, and this module
is the one place that turns its values into text, so that a job's fields are listed once
and a duration is cut into units once.

The two keep their own *style* where their readers differ, and each style is a parameter
here rather than a second copy: a terminal column is narrow and read by scripts too
(``1m05s``, ``2026-01-31 12:00:00Z``), a page is read by people (``1m 05s``, ``3.2 s ago``,
``12,345``). Nothing here reads the database or knows about argparse or Starlette.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "JOB_FIELDS",
    "PAGE_JOB_FIELDS",
    "QUEUE_KEYS",
    "ago",
    "clock",
    "compact_json",
    "duration",
    "job_fields",
    "last_line",
    "plural",
    "printable",
    "progress_text",
    "queue_json",
    "stamp",
    "thousands",
]


def stamp(value: datetime | None) -> str:
    """A moment in UTC to the second, as a column shows it: ``2026-01-31 12:00:00Z``."""
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def clock(value: datetime | None, *, seconds: bool = False, date: bool = False) -> str:
    """A moment in UTC as a page shows it: ``12:00``, or with seconds and the date."""
    if value is None:
        return "-"
    fmt = ("%Y-%m-%d " if date else "") + ("%H:%M:%S" if seconds else "%H:%M")
    return value.astimezone(timezone.utc).strftime(fmt)


def duration(value: float | None, *, spaced: bool = False) -> str:
    """Seconds in the two largest units: ``45.0s``, ``1m05s``, ``2h03m``, ``3d04h``.

    ``spaced`` is the page's style: the units set apart (``1m 05s``, ``1.5 s``), below a
    second in milliseconds, and the magnitude only (a page says "ago" or "in" itself).
    """
    if value is None:
        return "-"
    sep = " " if spaced else ""
    if spaced:
        value = abs(float(value))
        if value < 1:
            return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.1f}{sep}s"
    total = int(value)
    if total < 3600:
        return f"{total // 60}m{sep}{total % 60:02d}s"
    if total < 86400:
        return f"{total // 3600}h{sep}{total % 3600 // 60:02d}m"
    return f"{total // 86400}d{sep}{total % 86400 // 3600:02d}h"


def ago(value: datetime | None, now: datetime | None = None) -> str:
    """How far from ``now`` (the database's, where known; else this host's clock), in
    words: ``3.2 s ago``, ``in 5m 00s``, ``just now``."""
    if value is None:
        return "-"
    delta = ((now or datetime.now(timezone.utc)) - value).total_seconds()
    if abs(delta) < 1:
        return "just now"
    return (
        f"{duration(delta, spaced=True)} ago" if delta > 0 else f"in {duration(delta, spaced=True)}"
    )


def thousands(value: Any) -> str:
    """A count with thousands separators (``12,345``), or ``-`` for None."""
    return f"{int(value):,}" if value is not None else "-"


def plural(n: int, word: str = "job", *, grouped: bool = False) -> str:
    """``1 job``, ``3 jobs``; ``grouped`` writes ``12,345 jobs`` (the page's style)."""
    count = f"{n:,}" if grouped else str(n)
    return f"{count} {word}" + ("" if n == 1 else "s")


def last_line(text: str | None) -> str | None:
    """The last non-blank line of a traceback: the exception itself, the part worth a
    column or a list cell. None when there is none."""
    if not text:
        return None
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


#: What a terminal would act on rather than show: C0 and C1 control characters (ESC
#: starts the sequences that clear the screen, move the cursor or write the clipboard),
#: DEL, and the bidirectional overrides that reorder what is shown.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` safe to print to a terminal: what it would act on, escaped (``\x1b``),
    newlines kept with ``lines``. Job data (an error message carries what a user typed)
    went to the operator's terminal as it was: ``sqla-jobs jobs list`` could clear the
    screen or write the clipboard. The dashboard escapes it as HTML."""

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        if lines and char == "\n":
            return char
        code = ord(char)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _UNPRINTABLE.sub(escape, text)


def compact_json(value: Any) -> str:
    """A JSON value on one line, keys sorted; ``-`` for None."""
    return "-" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def progress_text(progress: Any) -> str:
    """A handler's last progress note: ``0.4 "page 2 of 5" (at 2026-...)``, or ``-``; a
    value that is no object (written around the library: nothing checks that column) as
    its JSON."""
    if progress is None or progress == {}:
        return "-"
    if not isinstance(progress, Mapping):
        return json.dumps(progress, sort_keys=True, ensure_ascii=False)
    parts = []
    if progress.get("value") is not None:
        parts.append(json.dumps(progress["value"], sort_keys=True))
    if progress.get("note"):
        parts.append(json.dumps(progress["note"], ensure_ascii=False))
    if progress.get("at"):
        parts.append(f"(at {progress['at']})")
    return " ".join(parts) or json.dumps(progress, sort_keys=True)


#: A job's fields, in the order ``sqla-jobs jobs show`` lists them (its heading line
#: names the id). Each tool writes the values in its own style (:func:`job_fields`).
JOB_FIELDS: tuple[str, ...] = (
    "task",
    "status",
    "queue",
    "priority",
    "attempts",
    "run_at",
    "created_at",
    "finished_at",
    "locked_by",
    "locked_until",
    "unique_key",
    "args",
    "meta",
    "progress",
)
#: The dashboard's job page: the id first and the queue before the task, as its heading
#: reads; the arguments have a panel of their own.
PAGE_JOB_FIELDS: tuple[str, ...] = (
    "id",
    "queue",
    "task",
    "status",
    *(f for f in JOB_FIELDS if f not in ("task", "status", "queue", "args")),
)


def job_fields(
    job: Any,
    *,
    when: Callable[[datetime | None], str],
    value: Callable[[str, Any], str],
    order: tuple[str, ...] = JOB_FIELDS,
) -> list[tuple[str, str]]:
    """``(name, text)`` for each field of a job view (:class:`sqla_jobs.admin.JobView`),
    then its workflow and result fields, only for a job that has them.

    :param when: how a moment is written (:func:`stamp` in a terminal).
    :param value: how the JSON value of a field (``meta``, ``progress``, ``result``) is
        written, given the field's name and the value.
    :param order: the fields, in order (:data:`JOB_FIELDS` or :data:`PAGE_JOB_FIELDS`).
    """
    texts: dict[str, Callable[[], str]] = {
        "id": lambda: str(job.id),
        "task": lambda: job.task,
        "status": lambda: job.status,
        "queue": lambda: job.queue,
        "priority": lambda: str(job.priority),
        "attempts": lambda: f"{job.attempts} of {job.max_attempts}",
        "run_at": lambda: when(job.run_at),
        "created_at": lambda: when(job.created_at),
        "finished_at": lambda: when(job.finished_at),
        "locked_by": lambda: job.locked_by or "-",
        "locked_until": lambda: when(job.locked_until),
        "unique_key": lambda: job.unique_key or "-",
        "args": lambda: json.dumps(job.args, sort_keys=True),
        "meta": lambda: value("meta", job.meta),
        "progress": lambda: value("progress", job.progress),
    }
    fields = [(name, texts[name]()) for name in order]
    if job.parents is not None:
        fields.append(("parents", ", ".join(map(str, job.parents))))
        fields.append(("waiting for", str(job.waiting or 0)))
    if job.children:
        fields.append(("children", ", ".join(map(str, job.children))))
    if job.result is not None:
        fields.append(("result", value("result", job.result)))
    if job.steps:
        fields.append(("steps", f"{job.steps_done} of {len(job.steps)} done"))
        held = job.suspended_in
        if held is not None:
            fields.append(("suspended in", suspension_text(held, when)))
    return fields


def suspension_text(step: Any, when: Callable[[datetime | None], str]) -> str:
    """What a suspended durable job waits for, in words: ``sleep 'cool-off' until ...``,
    ``signal 'shipped' (times out ...)``, ``signal 'shipped' (no timeout)``."""
    if step.kind == "sleep":
        return f"sleep {step.name!r} until {when(step.until)}"
    deadline = "no timeout" if step.until is None else f"times out {when(step.until)}"
    return f"signal {step.name!r} ({deadline})"


#: The columns of a job's steps table (``sqla-jobs jobs show``, the dashboard's job page).
STEP_COLUMNS: tuple[str, ...] = ("step", "kind", "state", "attempt", "when", "size")


def step_cells(step: Any, when: Callable[[datetime | None], str]) -> list[str]:
    """One row of a job's steps table (:data:`STEP_COLUMNS`): a cursor's state names its
    position, a sleep's or a wait's ``when`` its time, the others when they were written."""
    state = step.state
    if step.kind == "cursor" and isinstance(step.position, dict):
        state = (
            f"{state}: {step.position.get('rows', 0):,} rows, after {step.position.get('after')!r}"
        )
    moment = step.until if step.suspends else step.updated_at
    size = "-" if step.size is None else f"{step.size:,} B"
    attempt = "-" if step.attempt is None else str(step.attempt)
    return [step.name, step.kind, state, attempt, when(moment), size]


#: A queue's state as ``sqla-jobs stats --json`` writes it, key by key, in this order
#: (docs/reference/json-output.md documents these keys; the pause time and limits are
#: the dashboard's).
QUEUE_KEYS: tuple[str, ...] = (
    "queue",
    "paused",
    "scheduled",
    "ready",
    "running",
    "lease_expired",
    "done",
    "dead",
    "cancelled",
    "lag_seconds",
    "done_recent",
    "dead_recent",
)


def queue_json(state: Any) -> dict[str, Any]:
    """A :class:`sqla_jobs.admin.QueueState` as ``stats --json`` writes it."""
    return {key: getattr(state, key) for key in QUEUE_KEYS}

"""Cron expressions: checking them, and finding their next tick.

Five-field cron (minute, hour, day of month, month, day of week), parsed by ``croniter``
and evaluated in UTC. An expression is checked where it enters the system (``@jobs.periodic``
at import, ``add_schedule`` when stored), so a schedule that could never work fails there,
with its reason, and never inside a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from croniter import CroniterError, croniter

__all__ = ["Schedule", "check_cron", "next_tick"]


def check_cron(expression: str, *, now: datetime | None = None) -> str:
    """Return the expression if it is valid five-field cron that fires; raise otherwise.

    A syntactically valid expression may still never fire (``0 0 31 2 *``: the 31st of
    February). It is refused here too, because a worker could not compute its next tick.

    :raises ValueError: with the reason, for example ``out of range`` for ``61 * * * *``.
    """
    if not isinstance(expression, str) or "\x00" in expression:
        raise ValueError(f"invalid cron expression {expression!r}: expected a string")
    if len(expression.split()) != 5:
        raise ValueError(
            f"invalid cron expression {expression!r}: expected five fields "
            "(minute hour day-of-month month day-of-week)"
        )
    try:
        next_tick(expression, now or datetime.now(timezone.utc))
    except CroniterError as exc:
        reason = str(exc)
        if "next date" in reason:
            reason = "it never fires (no matching date exists)"
        else:
            # croniter puts the expression in brackets first; keep only the reason.
            reason = reason.rsplit("]", 1)[-1].strip(" ,:") or reason
        raise ValueError(f"invalid cron expression {expression!r}: {reason}") from None
    return expression


def next_tick(expression: str, after: datetime) -> datetime:
    """The first tick strictly after ``after``, in UTC.

    :raises croniter.CroniterError: (a ``ValueError``) for an expression that
        :func:`check_cron` would refuse.
    """
    result = croniter(expression, after.astimezone(timezone.utc)).get_next(datetime)
    assert isinstance(result, datetime)
    return result


@dataclass(frozen=True)
class Schedule:
    """A schedule declared in code with :meth:`Jobs.periodic <sqla_jobs.Jobs.periodic>`."""

    name: str
    task: str
    cron: str
    args: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None

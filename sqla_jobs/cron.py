"""Cron expressions: checking them, and finding their next tick.

Five-field cron (minute, hour, day of month, month, day of week), parsed by ``croniter``
and evaluated in UTC, or in a schedule's own time zone (``tz="Europe/Paris"``: "9 a.m.
there", whatever the offset is that day). An expression is checked where it enters the
system (``@jobs.periodic`` at import, ``add_schedule`` when stored), so a schedule that
could never work fails there, with its reason, and never inside a worker.

Daylight saving time
--------------------
In a time zone with DST, an expression that fires at a fixed hour inside the hour that is
skipped in spring fires once, at the first minute that exists after it (``30 2 * * *`` in
Paris fires at 03:00 on the last Sunday of March); an hourly one has no tick in the
skipped hour (``15 * * * *``: 01:15, then 03:15; croniter's reading). A tick in the hour
that repeats in autumn fires once, the first time (02:30 CEST, not again at 02:30 CET): a
daily job runs once a day, an hourly job once for each wall-clock hour.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

__all__ = ["Schedule", "check_cron", "check_timezone", "next_tick"]


def check_timezone(name: str | None) -> tzinfo:
    """The time zone of that IANA name (``"Europe/Paris"``); UTC for None.

    :raises ValueError: an unknown name.
    """
    if name is None:
        return timezone.utc
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"time zone must be an IANA name such as 'Europe/Paris', got {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {name!r} (an IANA name such as 'Europe/Paris' is expected)"
        ) from None


def check_cron(expression: str, *, now: datetime | None = None, tz: str | None = None) -> str:
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
    for part in expression.split():
        for token in part.split(","):
            if token.upper() == "R" or token.upper().startswith("R("):
                # croniter draws a random value each time it reads the expression, and a
                # worker reads it at every tick: "0 R * * *" fired several times a day.
                raise ValueError(
                    f"invalid cron expression {expression!r}: a random field (R) is drawn "
                    "anew at each tick; pick the value yourself"
                )
    try:
        next_tick(expression, now or datetime.now(timezone.utc), tz)
    except CroniterError as exc:
        reason = str(exc)
        if "next date" in reason:
            reason = "it never fires (no matching date exists)"
        else:
            # croniter puts the expression in brackets first; keep only the reason.
            reason = reason.rsplit("]", 1)[-1].strip(" ,:") or reason
        raise ValueError(f"invalid cron expression {expression!r}: {reason}") from None
    return expression


def next_tick(expression: str, after: datetime, tz: str | None = None) -> datetime:
    """The first tick strictly after ``after``, as an aware datetime in UTC.

    With ``tz``, the expression is read in that time zone's wall-clock time; the second
    occurrence of a wall-clock time that repeats when DST ends is skipped, so that it
    fires once (see the module's docstring).

    :raises croniter.CroniterError: (a ``ValueError``) for an expression that
        :func:`check_cron` would refuse.
    """
    zone = check_timezone(tz)
    start = after.astimezone(zone)
    ticks = croniter(expression, start)
    for _ in range(10_000):
        result = ticks.get_next(datetime)
        assert isinstance(result, datetime)
        if not _repeated(result, zone):
            return result.astimezone(timezone.utc)
    raise CroniterError(f"[{expression}] no tick outside repeated hours")  # pragma: no cover


def latest_tick(expression: str, due: datetime, now: datetime, tz: str | None = None) -> datetime:
    """The latest tick at or before ``now``, counting from ``due`` (a tick already due):
    the one a schedule fires for after missing some, ``due`` itself if no later one has
    come.

    Read back from the tick after ``now`` (one step back), and kept if stepping forward
    from it lands there again, as :func:`next_tick` would have; otherwise (a time zone's
    change of offset that steps back and forth read differently) walked forward from
    ``due``, on one iterator, bounded. Walking forward always cost a step per missed tick:
    a minutely schedule down for a week, 10,000 steps and 1.4 s of CPU, inside the pass
    that also promotes and rescues; and its bound left one down longer firing for a tick
    a day old."""
    ahead = next_tick(expression, now, tz)
    zone = check_timezone(tz)
    back = croniter(expression, ahead.astimezone(zone))
    for _ in range(10_000):
        candidate = back.get_prev(datetime)
        assert isinstance(candidate, datetime)
        if not _repeated(candidate, zone):
            break
    latest = candidate.astimezone(timezone.utc)
    if latest <= now and next_tick(expression, latest, tz) == ahead:
        return max(latest, due)
    latest = due
    ticks = croniter(expression, due.astimezone(zone))
    for _ in range(100_000):
        after = ticks.get_next(datetime)
        assert isinstance(after, datetime)
        if _repeated(after, zone):
            continue
        if after.astimezone(timezone.utc) > now:
            break
        latest = after.astimezone(timezone.utc)
    return latest


def _repeated(moment: datetime, zone: tzinfo) -> bool:
    """Whether ``moment`` is the second occurrence of a wall-clock time that repeats when
    DST ends (02:30 CET after 02:30 CEST, the same night)."""
    if zone is timezone.utc:
        return False
    wall = moment.astimezone(zone).replace(tzinfo=None)
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    if first.utcoffset() == second.utcoffset():
        return False  # not an ambiguous wall-clock time
    return moment.astimezone(timezone.utc) == second.astimezone(timezone.utc) and (
        moment.astimezone(timezone.utc) - first.astimezone(timezone.utc) > timedelta(0)
    )


@dataclass(frozen=True)
class Schedule:
    """A schedule declared in code with :meth:`Jobs.periodic <sqla_jobs.Jobs.periodic>`."""

    name: str
    task: str
    cron: str
    args: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None
    #: The IANA time zone the expression is read in (None: UTC).
    tz: str | None = None

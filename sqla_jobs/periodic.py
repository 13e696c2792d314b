"""Periodic jobs: cron schedules that the workers enqueue themselves.

Declared in code::

    @jobs.periodic("*/5 * * * *")            # every five minutes, UTC
    @jobs.task(queue="reports")
    def refresh_stats() -> None: ...

or added at run time, as rows (a report each user schedules for themselves)::

    add_schedule(session, jobs, "report:42", send_report, "0 8 * * mon", args={"user_id": 42})

Every schedule is a row of ``<table>_schedules``. Its ``next_run_at`` is the next tick.
Workers look for due rows now and then (``FOR UPDATE SKIP LOCKED``); the one that locks a
row enqueues the job and moves ``next_run_at`` on, in one transaction. However many workers
run, each tick is enqueued once, and the database is what decides it. The job also gets the
unique key ``periodic:<name>:<tick>``, so even a replayed tick cannot make a second job
while the first is live.

Missed ticks: if no worker ran for a while, the schedule fires **once** for the latest
missed tick, then continues from the next one in the future (no burst of catch-up jobs).

Expressions are standard five-field cron (croniter's syntax), evaluated in UTC or in the
schedule's time zone (``tz=``; see :mod:`sqla_jobs.cron` for daylight saving time). An invalid
expression, or one that never fires (``0 0 31 2 *``), is an error when it is declared or
stored, never at tick time. A row that holds one anyway (written around the API) is
logged and skipped by :func:`enqueue_due` and :func:`sync_declared`, never raised into the
worker.
"""

from __future__ import annotations

import json
import logging
from collections import namedtuple
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ._enqueue import insert_rows
from ._queries import readable_json
from ._tasks import check_schedule_name
from .connection import _announce
from .cron import Schedule, check_cron, check_timezone, latest_tick, next_tick
from .errors import EnqueueError, answered, describe, passing

if TYPE_CHECKING:
    from ._tasks import Task
    from .tasks import Jobs

__all__ = ["Schedule", "add_schedule", "check_cron", "list_schedules", "remove_schedule"]

log = logging.getLogger("sqla_jobs.periodic")


def _values(
    jobs: Jobs,
    name: str,
    task: Task[Any, Any] | str,
    cron: str,
    args: Mapping[str, Any] | None,
    queue: str | None,
    priority: int | None,
    now: datetime,
    tz: str | None = None,
) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"schedule name must be a non-empty string, got {name!r}")
    check_schedule_name(name)
    check_timezone(tz)
    check_cron(cron, now=now, tz=tz)
    # The same checks as an enqueue: a schedule that could never make a valid job is
    # refused when it is stored. (Nothing is enqueued here: no enqueue hooks.)
    values, _, _ = jobs.bind_row(
        task, (), dict(args or {}), queue=queue, priority=priority, meta_prepared=True
    )
    return {
        "name": name,
        "task": values["task"],
        "args": values["args"],
        "cron": cron,
        "tz": tz,
        "queue": queue,
        "priority": priority,
        "next_run_at": next_tick(cron, now, tz),
    }


def add_schedule(
    session: sa.orm.Session | sa.Connection,
    jobs: Jobs,
    name: str,
    task: Task[Any, Any] | str,
    cron: str,
    *,
    args: Mapping[str, Any] | None = None,
    queue: str | None = None,
    priority: int | None = None,
    enabled: bool = True,
    tz: str | None = None,
) -> None:
    """Add or replace the run-time schedule ``name`` (in the caller's transaction).

    :param tz: the IANA time zone the expression is read in (``"Europe/Paris"``); UTC by
        default. See :mod:`sqla_jobs.cron` for what happens when DST starts and ends.
    :raises ValueError: an invalid cron expression, one that never fires, or an unknown
        time zone.
    :raises EnqueueError: an unknown task or arguments that do not fit it.
    """
    # The database's clock, as the ticks use: an application server's clock two hours
    # behind stored a daily tick already past (fired at once, 22 hours early).
    now = session.execute(jobs.queries.now).scalar_one()
    values = _values(jobs, name, task, cron, args, queue, priority, now, tz)
    values.update(enabled=enabled, origin="runtime")
    if session.execute(jobs.queries.upsert_runtime_schedule, values).first() is None:
        raise ValueError(
            f"schedule {name!r} is declared in code (@jobs.periodic): a run-time schedule "
            "cannot replace it; give the run-time one another name"
        )


def remove_schedule(session: sa.orm.Session | sa.Connection, jobs: Jobs, name: str) -> bool:
    """Delete a schedule; True if there was one. Jobs it already enqueued stay."""
    result = session.execute(jobs.queries.delete_schedule, {"schedule": name})
    return result.first() is not None


def list_schedules(session: sa.orm.Session | sa.Connection, jobs: Jobs) -> list[Any]:
    """Every schedule row (code-declared and run-time), by name, as named tuples of the
    schedule table's columns.

    Rows are not all written through :func:`add_schedule`: arguments Python cannot read
    (JSON nested a thousand deep) come back as ``{"sqla_jobs.unreadable": why}`` and a
    time it cannot hold (``'infinity'``) as None, rather than failing the whole list and
    the dashboard's page with it."""
    result = session.execute(jobs.queries.list_schedules)
    row_type = namedtuple("ScheduleRow", list(result.keys()))  # type: ignore[misc]
    return [row_type(**{**row._asdict(), "args": readable_json(row.args)}) for row in result]


def sync_declared(conn: sa.Connection, jobs: Jobs) -> None:
    """Make the rows of code-declared schedules match the code (run as a worker starts,
    or by a maintenance pass if that could not finish: see
    ``sqla_jobs.worker._statements.sync_schedules``).

    A changed expression restarts from its next tick; an unchanged one keeps its place,
    so restarting workers never skips or repeats a tick. Code schedules that the code no
    longer declares are deleted. A run-time schedule (:func:`add_schedule`) of a declared
    name is left alone, and the clash logged.
    """
    q = jobs.queries
    now = conn.execute(q.now).scalar_one()
    declared = list(jobs.schedules.values())
    for s in declared:
        try:
            values = _values(jobs, s.name, s.task, s.cron, s.args, s.queue, s.priority, now, s.tz)
        except (ValueError, EnqueueError) as exc:
            # Checked at declaration already; a worker must start even if one is broken.
            log.error("schedule %r: %s; skipped", s.name, exc)
            continue
        values["origin"] = "code"
        if conn.execute(q.upsert_code_schedule, values).first() is None:
            log.error(
                "schedule %r is declared in code, and a run-time schedule of that name "
                "exists (add_schedule): the run-time one is kept and the declared one does "
                "not run; rename one of them",
                s.name,
            )
    conn.execute(q.delete_undeclared, {"declared": [s.name for s in declared]})


def enqueue_due(conn: sa.Connection, jobs: Jobs, *, limit: int = 100) -> int:
    """Enqueue one job for each due schedule and move it to its next tick.

    Runs in the caller's transaction; the row locks (SKIP LOCKED) keep two workers from
    handling the same schedule, and the guarded ``next_run_at`` keeps a tick from firing
    twice. A schedule that cannot be enqueued never stops the worker: it is logged, keeps
    its row with the reason in ``last_error``, and

    - waits for its next tick if no worker could ever enqueue it as it is (a row written
      around the API: an invalid expression, arguments that are no JSON object), or if
      the database refuses its job (an application's trigger, a constraint);
    - stays due if this worker cannot make its job but another may: a task this worker
      does not know, or whose signature does not take the stored arguments (in a rolling
      deploy, a worker of the previous code took the tick from the new ones, and it was
      lost), or an error of the moment (a lock not granted within ``lock_timeout`` while
      a migration holds the table, a deadlock: the tick was skipped for good). The
      next pass, of this worker or another, tries again; it is logged once per reason.

    Each tick's job is written in a savepoint of its own, so that one the database
    refuses fails none of the others (and none of the worker's pass: its promotions, its
    rescues, the pause state). Returns how many jobs were enqueued (a tick whose job is
    there already enqueues none).
    """
    q = jobs.queries
    now = conn.execute(q.now).scalar_one()
    enqueued = 0
    # The ``enqueued`` listeners (the metrics' counter) hear of the ticks' jobs at commit,
    # as of any other job; they heard of none.
    announced: list[dict[str, Any]] | None = [] if jobs.events.wants("enqueued") else None
    for row in conn.execute(q.due_schedules, {"now": now, "limit": limit}).all():
        tick: datetime | None = row.next_run_at
        try:
            # A row written around the API may have a name whose job key would not fit,
            # a tick Python cannot hold, or arguments it cannot decode.
            check_schedule_name(row.name)
            if tick is None:
                raise ValueError("its next_run_at is a time Python cannot hold")
            args = _decode_args(row.args)
            check_cron(row.cron, now=now, tz=row.tz)
            following = next_tick(row.cron, now, row.tz)
            latest = latest_tick(row.cron, tick, now, row.tz)
        except (ValueError, RecursionError) as exc:
            _failed(conn, q, row, now, str(exc))
            continue
        try:
            values = tick_values(jobs, row.task, args, row.queue, row.priority)
        except (EnqueueError, TypeError, RecursionError) as exc:
            _held(conn, q, row, f"this worker cannot make its job: {exc}")
            continue
        # A tick is unique by its own key, not by a scope its task may declare.
        values["unique_key"] = periodic_key(row.name, latest)
        written: list[dict[str, Any]] | None = [] if announced is not None else None
        try:
            with conn.begin_nested():
                enqueued += insert_rows(conn, q, [values], written)
                conn.execute(
                    q.advance_schedule,
                    {"schedule": row.name, "tick": tick, "following": following, "latest": latest},
                )
        except sa.exc.DBAPIError as exc:
            if not answered(exc):
                raise
            if passing(exc):
                _held(conn, q, row, f"its job could not be written yet: {describe(exc)}")
            else:
                _failed(conn, q, row, now, f"its job was refused: {describe(exc)}", following)
            continue
        except Exception as exc:
            # Not the database's: the job could not be written at all (meta an enqueue
            # hook added that JSON cannot hold). It failed the whole pass, at every pass,
            # and stopped every worker of the table.
            _failed(conn, q, row, now, f"its job could not be written: {describe(exc)}", following)
            continue
        if announced is not None and written:
            announced.extend(written)
    if announced:
        _announce(conn, jobs, announced)  # as for jobs enqueued on a connection: at commit
    return enqueued


def tick_values(
    jobs: Jobs, task: str, args: Mapping[str, Any], queue: str | None, priority: int | None
) -> dict[str, Any]:
    """The checked column values of a schedule's job, from its stored row: ``args`` as
    the schedule stored them (bound, as a job's are: a handler's ``**kwargs`` under their
    own name), turned back into the call they came from, then bound again as an enqueue
    does. Bound as they were, a ``**extra`` handler's arguments were nested one level
    deeper at every tick (``extra={"extra": {...}}``).

    :raises EnqueueError: a task this registry does not know, or arguments it refuses.
    :raises TypeError: stored arguments its handler does not take.
    """
    found = jobs.get(task)
    call, keywords = found.call_args(args)
    values, _, _ = jobs.bind_row(found, call, keywords, queue=queue, priority=priority)
    return values


def _held(conn: sa.Connection, q: Any, row: Any, error: str) -> None:
    """Schedule ``row``'s tick could not be enqueued by this worker now, and may be by
    another or later: it stays due, with the reason in ``last_error``, logged when the
    reason is new (each pass meets it again)."""
    if conn.execute(q.schedule_held, {"schedule": row.name, "error": error}).first():
        log.warning("schedule %r: %s; left due", row.name, error)


def _failed(
    conn: sa.Connection,
    q: Any,
    row: Any,
    now: datetime,
    error: str,
    following: datetime | None = None,
) -> None:
    """Schedule ``row`` could not be enqueued: say why, in the log and in its row, and
    move it to its next tick (``following``, or what its row allows)."""
    log.error("schedule %r: %s", row.name, error)
    if following is None:
        following = _safe_next(row.cron, now, row.tz)
    conn.execute(q.schedule_failed, {"schedule": row.name, "error": error, "following": following})


def _decode_args(text: str) -> dict[str, Any]:
    """A schedule's arguments, from the JSON text the row holds: an object."""
    try:
        args = json.loads(text)
    except RecursionError:
        raise ValueError("its args are nested deeper than Python can decode") from None
    if not isinstance(args, dict):
        raise ValueError(f"its args are not a JSON object: {text[:80]}")
    return args


def periodic_key(name: str, tick: datetime) -> str:
    """The unique key of the job of one tick: a replayed tick cannot make a second job.

    Schedule names are at most 200 bytes of UTF-8 (checked when declared or stored, and
    again before a row is enqueued), so the key stays well inside the unique index.
    """
    return f"periodic:{name}:{tick.isoformat()}"


def _safe_next(cron: str, now: datetime, tz: str | None) -> datetime | None:
    try:
        return next_tick(check_cron(cron, now=now, tz=tz), now, tz)
    except ValueError:
        return None

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

Expressions are standard five-field cron (croniter's syntax), evaluated in UTC. An invalid
expression is an error when it is declared or stored, never at tick time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from croniter import croniter
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .errors import EnqueueError

if TYPE_CHECKING:
    from .tasks import Jobs, Task

__all__ = ["Schedule", "add_schedule", "check_cron", "list_schedules", "remove_schedule"]

log = logging.getLogger("sqla_jobs.periodic")


def check_cron(expression: str) -> str:
    """Return the expression if croniter accepts it as five-field cron; raise otherwise."""
    if not isinstance(expression, str) or len(expression.split()) != 5:
        raise ValueError(f"invalid cron expression {expression!r}: expected five fields")
    if not croniter.is_valid(expression):
        raise ValueError(f"invalid cron expression {expression!r}")
    return expression


def next_tick(expression: str, after: datetime) -> datetime:
    """The first tick strictly after ``after`` (UTC)."""
    result = croniter(expression, after.astimezone(timezone.utc)).get_next(datetime)
    assert isinstance(result, datetime)
    return result


@dataclass(frozen=True)
class Schedule:
    """A schedule declared in code with :meth:`Jobs.periodic`."""

    name: str
    task: str
    cron: str
    args: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None


def _values(
    jobs: Jobs,
    name: str,
    task: Task[Any, Any] | str,
    cron: str,
    args: Mapping[str, Any] | None,
    queue: str | None,
    priority: int | None,
    now: datetime,
) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"schedule name must be a non-empty string, got {name!r}")
    check_cron(cron)
    # The same checks as an enqueue: a schedule that could never make a valid job is
    # refused when it is stored.
    values = jobs.job_values(task, (), dict(args or {}), queue=queue, priority=priority)
    return {
        "name": name,
        "task": values["task"],
        "args": values["args"],
        "cron": cron,
        "queue": queue,
        "priority": priority,
        "next_run_at": next_tick(cron, now),
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
) -> None:
    """Add or replace the run-time schedule ``name`` (in the caller's transaction).

    :raises ValueError: an invalid cron expression.
    :raises EnqueueError: an unknown task or arguments that do not fit it.
    """
    values = _values(jobs, name, task, cron, args, queue, priority, datetime.now(timezone.utc))
    values["enabled"] = enabled
    _upsert(session, jobs, values, origin="runtime")


def remove_schedule(session: sa.orm.Session | sa.Connection, jobs: Jobs, name: str) -> bool:
    """Delete a schedule; True if there was one. Jobs it already enqueued stay."""
    table = jobs.queries.schedules_table
    result = session.execute(sa.delete(table).where(table.c.name == name).returning(table.c.name))
    return result.first() is not None


def list_schedules(session: sa.orm.Session | sa.Connection, jobs: Jobs) -> list[Any]:
    table = jobs.queries.schedules_table
    return list(session.execute(sa.select(table).order_by(table.c.name)))


def _upsert(
    session: sa.orm.Session | sa.Connection, jobs: Jobs, values: dict[str, Any], *, origin: str
) -> None:
    """Insert or update one schedule row.

    A run-time schedule is replaced whole (its operator just said what it should be). A
    code-declared one keeps its place in time unless its expression changed, so that
    restarting workers never skips or repeats a tick, and keeps ``enabled`` as an operator
    may have set it.
    """
    table = jobs.queries.schedules_table
    stmt = pg_insert(table).values(**values, origin=origin)
    new = stmt.excluded
    changes: dict[str, Any] = {
        name: new[name] for name in ("task", "args", "cron", "queue", "priority")
    }
    changes["origin"] = origin
    if origin == "code":
        changes["next_run_at"] = sa.case(
            (table.c.cron.is_distinct_from(new.cron), new.next_run_at),
            else_=sa.func.coalesce(table.c.next_run_at, new.next_run_at),
        )
    else:
        changes.update(enabled=new.enabled, next_run_at=new.next_run_at, last_error=None)
    session.execute(stmt.on_conflict_do_update(index_elements=[table.c.name], set_=changes))


def sync_declared(conn: sa.Connection, jobs: Jobs) -> None:
    """Make the rows of code-declared schedules match the code (run at worker start).

    A changed expression restarts from its next tick; an unchanged one keeps its place,
    so restarting workers never skips or repeats a tick. Code schedules that the code no
    longer declares are deleted.
    """
    table = jobs.queries.schedules_table
    now = conn.execute(sa.select(sa.func.now())).scalar_one()
    declared = list(jobs.schedules.values())
    for s in declared:
        values = _values(jobs, s.name, s.task, s.cron, s.args, s.queue, s.priority, now)
        _upsert(conn, jobs, values, origin="code")
    conn.execute(
        sa.delete(table).where(
            table.c.origin == "code", table.c.name.not_in([s.name for s in declared])
        )
    )


def enqueue_due(conn: sa.Connection, jobs: Jobs, *, limit: int = 100) -> int:
    """Enqueue one job for each due schedule and move it to its next tick.

    Runs in the caller's transaction; the row locks (SKIP LOCKED) keep two workers from
    handling the same schedule, and the guarded ``next_run_at`` keeps a tick from firing
    twice. Returns how many jobs were enqueued.
    """
    table = jobs.queries.schedules_table
    now = conn.execute(sa.select(sa.func.now())).scalar_one()
    due = conn.execute(
        sa.select(table)
        .where(table.c.enabled, table.c.next_run_at <= now)
        .order_by(table.c.next_run_at)
        .limit(limit)
        .with_for_update(skip_locked=True, key_share=True)
    ).all()
    rows: list[dict[str, Any]] = []
    for row in due:
        tick: datetime = row.next_run_at
        try:
            check_cron(row.cron)
            following = next_tick(row.cron, now)
            # The latest missed tick: walk forward from the due one (bounded).
            latest = tick
            for _ in range(10000):
                after = next_tick(row.cron, latest)
                if after > now:
                    break
                latest = after
            values = jobs.job_values(
                row.task, (), dict(row.args), queue=row.queue, priority=row.priority
            )
        except (ValueError, EnqueueError) as exc:
            # A row someone wrote around the API, or a task this worker does not know:
            # keep the schedule, say why on it, and try again at the next tick.
            log.error("schedule %r: %s", row.name, exc)
            conn.execute(
                sa.update(table)
                .where(table.c.name == row.name)
                .values(last_error=str(exc), next_run_at=_safe_next(row.cron, now))
            )
            continue
        values["unique_key"] = f"periodic:{row.name}:{latest.isoformat()}"
        rows.append(values)
        conn.execute(
            sa.update(table)
            .where(table.c.name == row.name, table.c.next_run_at == tick)
            .values(next_run_at=following, last_run_at=latest, last_error=None)
        )
    if rows:
        from .session import insert_rows

        insert_rows(conn, jobs, rows)
    return len(rows)


def _safe_next(cron: str, now: datetime) -> datetime | None:
    try:
        return next_tick(check_cron(cron), now)
    except ValueError:
        return None

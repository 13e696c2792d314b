"""Every statement the queue runs, as SQLAlchemy Core, built once per jobs table.

Each statement has a builder of its own below, with a comment above it: what it is for, and
which index it reads through. Statements take their values as bound parameters (never
string formatting), so SQLAlchemy's compiled cache and PostgreSQL's plans are reused run
after run; the parameters of the statements run on every claim and completion are built
by the typed helpers next to them (``claim_params``, ``batch_params``, ...), so a
parameter name is written in one place.

The guard
---------
``attempts`` grows by one at every claim and never goes down, so ``(id, attempts)`` names
exactly one claim of one job. Completing, failing, snoozing, handing back and
heartbeating all match on that pair and on ``status = 'running'`` (:func:`guarded`): a
worker that lost its lease and comes back late finds no row, and changes nothing.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .bulk import copy_allowed, copy_run
from .model import LIVE_STATUSES, UNIQUE_WHERE, JobStatus, companion_tables, notify_channel

if TYPE_CHECKING:
    from sqlalchemy.sql.expression import CTE

__all__ = [
    "Queries",
    "batch_params",
    "claim_params",
    "insert_rows",
    "interval",
    "job_params",
    "status_literal",
]

#: Written into ``last_error`` when a lease passes without a heartbeat.
LEASE_EXPIRED = "lease expired: the worker that ran this attempt stopped heartbeating"


def status_literal(status: JobStatus | str) -> sa.ColumnElement[str]:
    """A status as an SQL literal, not a bound parameter.

    The planner can only match a partial index (``WHERE status = 'ready'``) against a
    constant it can see in a generic plan, and psycopg prepares the statements that run
    often. ``admin`` builds its filters with this too.
    """
    return _LITERALS[JobStatus(status)]


_LITERALS: dict[JobStatus, sa.ColumnElement[str]] = {
    s: sa.literal_column(f"'{s.value}'", sa.Text) for s in JobStatus
}

#: ``(SELECT 'running')``, for the statements that find their rows by id (complete,
#: heartbeat, hand back, fail, snooze). A bare ``'running'`` matches the partial index
#: <table>_running, whose row estimate comes from the last ANALYZE, when few jobs (often
#: none) were running: the planner then walks every running row, and for a batch
#: ``unnest(:ids, :attempt_list)`` re-scans the whole batch for each (nested loop,
#: O(running x batch)); it keeps that generic plan once psycopg has prepared the
#: statement. A completer that falls behind makes every later batch slower, until one
#: takes seconds. Behind an InitPlan the predicate cannot match the partial index, so the
#: rows are found through the primary key: O(batch), whatever the backlog.
_RUNNING_VIA_PK = sa.select(status_literal(JobStatus.RUNNING)).scalar_subquery()


def interval(seconds: float) -> timedelta:
    """Seconds as the timedelta that binds to an ``interval`` parameter."""
    return timedelta(seconds=seconds)


class Claim(Protocol):
    """What names one claim of a job: a ``ClaimedJob``, or any object with these two."""

    @property
    def id(self) -> int: ...

    @property
    def attempts(self) -> int: ...


def _batch() -> Any:
    """``unnest(:ids, :attempt_list) AS batch(id, attempts)``: a whole batch in two parameters."""
    return (
        sa.func.unnest(
            sa.bindparam("ids", type_=ARRAY(sa.BigInteger)),
            sa.bindparam("attempt_list", type_=ARRAY(sa.Integer)),
        )
        .table_valued("id", "attempts")
        .render_derived(name="batch")
    )


def guarded(table: sa.Table, batch: Any) -> sa.ColumnElement[bool]:
    """The guard: this claim of this job (``id`` and ``attempts``), still running."""
    c = table.c
    return sa.and_(c.id == batch.c.id, c.attempts == batch.c.attempts, c.status == _RUNNING_VIA_PK)


def _one_claim(table: sa.Table) -> sa.ColumnElement[bool]:
    """The guard for a single claim given as ``:job_id`` and ``:attempt``."""
    c = table.c
    return sa.and_(
        c.id == sa.bindparam("job_id"),
        c.attempts == sa.bindparam("attempt"),
        c.status == _RUNNING_VIA_PK,
    )


class BatchParams(TypedDict):
    ids: list[int]
    attempt_list: list[int]


def batch_params(claims: Iterable[Claim]) -> BatchParams:
    """Parameters naming a batch of claims, for complete, heartbeat and hand back."""
    ids: list[int] = []
    attempts: list[int] = []
    for claim in claims:
        ids.append(claim.id)
        attempts.append(claim.attempts)
    return {"ids": ids, "attempt_list": attempts}


# -- the claim ----------------------------------------------------------------------------

# Claim: up to :limit ready jobs of one queue, in priority, run_at, id order, through
# <table>_claim. FOR NO KEY UPDATE SKIP LOCKED: concurrent claims skip each other's rows
# instead of queueing behind them, and the weaker NO KEY lock does not block foreign keys
# that point at the job row (FOR UPDATE would). run_at <= now() guards against a 'ready'
# row from a clock ahead of the database; the scheduled status keeps future jobs out of
# this index entirely.
CLAIMED_COLUMNS = (
    "id",
    "queue",
    "task",
    "args",
    "attempts",
    "max_attempts",
    "priority",
    "run_at",
    "created_at",
    "meta",
)


def _claim(t: sa.Table, *, for_session: bool = False) -> sa.Update:
    c = t.c
    where = [
        c.status == status_literal(JobStatus.READY),
        c.queue == sa.bindparam("queue_name"),
        c.run_at <= sa.func.now(),
    ]
    if for_session:
        # session.claim: a caller's own loop honours a paused queue too. The sub-select is
        # uncorrelated, so it runs once per claim (an InitPlan), not once per row.
        queues = companion_tables(t)[0]
        paused = sa.select(queues.c.name).where(
            queues.c.name == sa.bindparam("queue_name"), queues.c.paused
        )
        where.append(~paused.exists())
    nxt = (
        sa.select(c.id)
        .where(*where)
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("next_jobs")
    )
    return (
        sa.update(t)
        .where(c.id == nxt.c.id)
        .values(
            status=JobStatus.RUNNING.value,
            attempts=c.attempts + 1,
            locked_until=sa.func.now() + sa.bindparam("lease", type_=sa.Interval),
            locked_by=sa.bindparam("worker"),
        )
        # The worker reads what it runs a job with; a session gets whole rows, to make
        # ORM objects of them.
        .returning(*(t.c if for_session else (c[name] for name in CLAIMED_COLUMNS)))
    )


class ClaimParams(TypedDict):
    queue_name: str
    limit: int
    lease: timedelta
    worker: str


def claim_params(queue: str, limit: int, lease: timedelta, worker: str) -> ClaimParams:
    return {"queue_name": queue, "limit": limit, "lease": lease, "worker": worker}


# -- outcomes -----------------------------------------------------------------------------


# Complete a batch: one statement for many jobs, each row still guarded by its own
# (id, attempts). Finished jobs are deleted, or kept as 'done' for retention.
def _complete(t: sa.Table, *, keep_done: bool) -> sa.Executable:
    batch = _batch()
    if keep_done:
        return (
            sa.update(t)
            .where(guarded(t, batch))
            .values(status=JobStatus.DONE.value, locked_until=None, finished_at=sa.func.now())
            .returning(t.c.id)
        )
    return sa.delete(t).where(guarded(t, batch)).returning(t.c.id)


# Fail one attempt: retry after :delay (scheduled), or dead once attempts are used up or the
# failure is permanent. The error and its traceback stay in last_error.
def _fail(t: sa.Table) -> sa.Update:
    c = t.c
    dead = sa.or_(sa.bindparam("permanent", type_=sa.Boolean), c.attempts >= c.max_attempts)
    return (
        sa.update(t)
        .where(_one_claim(t))
        .values(
            status=sa.case((dead, JobStatus.DEAD.value), else_=JobStatus.SCHEDULED.value),
            run_at=sa.case(
                (dead, c.run_at), else_=sa.func.now() + sa.bindparam("delay", type_=sa.Interval)
            ),
            finished_at=sa.case((dead, sa.func.now()), else_=None),
            locked_until=None,
            last_error=sa.bindparam("error"),
            progress=_latest_progress(c, sa.bindparam("progress", None, type_=sa.Text)),
        )
        .returning(c.id, c.status)
    )


def _latest_progress(c: Any, note: Any) -> sa.ColumnElement[Any]:
    """The run's latest progress note if it has one not yet written, else the row's. The
    parameter defaults to NULL: callers that know of no progress may leave it out."""
    return sa.func.coalesce(sa.cast(note, JSONB), c.progress)


class FailParams(TypedDict):
    job_id: int
    attempt: int
    error: str | None
    delay: timedelta
    permanent: bool
    progress: str | None


def fail_params(
    claim: Claim, error: str | None, delay: float, *, permanent: bool, progress: str | None = None
) -> FailParams:
    return {
        "job_id": claim.id,
        "attempt": claim.attempts,
        "error": error,
        "delay": interval(delay),
        "permanent": permanent,
        "progress": progress,
    }


# Snooze ("not yet"): back to scheduled without using up an attempt. attempts stays (the
# guard needs it monotonic), so max_attempts grows by one instead.
def _snooze(t: sa.Table) -> sa.Update:
    c = t.c
    return (
        sa.update(t)
        .where(_one_claim(t))
        .values(
            status=JobStatus.SCHEDULED.value,
            run_at=sa.func.now() + sa.bindparam("delay", type_=sa.Interval),
            max_attempts=c.max_attempts + 1,
            locked_until=None,
            progress=_latest_progress(c, sa.bindparam("progress", None, type_=sa.Text)),
        )
        .returning(c.id)
    )


class SnoozeParams(TypedDict):
    job_id: int
    attempt: int
    delay: timedelta
    progress: str | None


def snooze_params(claim: Claim, delay: float, progress: str | None = None) -> SnoozeParams:
    return {
        "job_id": claim.id,
        "attempt": claim.attempts,
        "delay": interval(delay),
        "progress": progress,
    }


# Hand back claims that a stopping worker will not finish: ready again at once, the claim
# not counted (max_attempts + 1, as for snooze), and the workers of their queues woken by
# a NOTIFY (sent at commit). Returns one row per queue with how many went back to it.
def _hand_back(t: sa.Table, channel: str) -> sa.Select[Any]:
    c = t.c
    batch = _batch()
    handed = (
        sa.update(t)
        .where(guarded(t, batch))
        .values(
            status=JobStatus.READY.value,
            max_attempts=c.max_attempts + 1,
            locked_until=None,
            locked_by=None,
        )
        .returning(c.queue)
        .cte("handed_back")
    )
    per_queue = (
        sa.select(handed.c.queue, sa.func.count().label("n"))
        .group_by(handed.c.queue)
        .subquery("per_queue")
    )
    return sa.select(
        per_queue.c.queue, per_queue.c.n, sa.func.pg_notify(sa.literal(channel), per_queue.c.queue)
    )


# Heartbeat: extend the leases of all of a worker's running jobs in one statement, and write
# the progress notes their handlers left since the last beat (a third array, NULL for "no
# news": COALESCE keeps the row's; a missing array is all NULLs, as unnest pads it). Claims
# that do not come back were lost (lease expired and retaken) or cancelled.
def _heartbeat(t: sa.Table) -> sa.Update:
    c = t.c
    batch = (
        sa.func.unnest(
            sa.bindparam("ids", type_=ARRAY(sa.BigInteger)),
            sa.bindparam("attempt_list", type_=ARRAY(sa.Integer)),
            sa.bindparam("progress_list", None, type_=ARRAY(sa.Text)),
        )
        .table_valued("id", "attempts", "progress")
        .render_derived(name="batch")
    )
    return (
        sa.update(t)
        .where(guarded(t, batch))
        .values(
            locked_until=sa.func.now() + sa.bindparam("lease", type_=sa.Interval),
            progress=_latest_progress(c, batch.c.progress),
        )
        .returning(c.id, c.attempts)
    )


class HeartbeatParams(BatchParams):
    lease: timedelta
    progress_list: list[str | None]


def heartbeat_params(
    claims: Iterable[Claim], lease: timedelta, progress: Iterable[str | None] | None = None
) -> HeartbeatParams:
    batch = batch_params(claims)
    notes: list[str | None] = list(progress) if progress is not None else [None] * len(batch["ids"])
    return {
        "ids": batch["ids"],
        "attempt_list": batch["attempt_list"],
        "lease": lease,
        "progress_list": notes,
    }


# -- maintenance --------------------------------------------------------------------------


def _notify_queues(channel: str, changed: CTE) -> sa.Select[Any]:
    """Wrap a data-modifying CTE that returns ``queue`` (and maybe ``status``) in one
    NOTIFY per distinct queue that has ready jobs now."""
    wake = sa.select(changed.c.queue).distinct()
    if "status" in changed.c:
        wake = wake.where(changed.c.status == status_literal(JobStatus.READY))
    sub = wake.subquery("q")
    return sa.select(sa.func.pg_notify(sa.literal(channel), sub.c.queue)).select_from(sub)


# Promote due scheduled jobs to ready, through <table>_scheduled, and wake the workers of
# their queues (NOTIFY is sent at commit).
def _promote(t: sa.Table, channel: str) -> sa.Select[Any]:
    c = t.c
    due = (
        sa.select(c.id)
        .where(c.status == status_literal(JobStatus.SCHEDULED), c.run_at <= sa.func.now())
        .order_by(c.run_at)
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("due_jobs")
    )
    promoted = (
        sa.update(t)
        .where(c.id == due.c.id)
        .values(status=JobStatus.READY.value)
        .returning(c.queue)
        .cte("promoted")
    )
    return _notify_queues(channel, promoted)


# Rescue jobs whose lease has passed, through <table>_running: their worker died or hung.
# Ready again (the next claim counts the attempt), or dead if none are left.
def _rescue(t: sa.Table, channel: str) -> sa.Select[Any]:
    c = t.c
    expired = (
        sa.select(c.id)
        .where(c.status == status_literal(JobStatus.RUNNING), c.locked_until < sa.func.now())
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("expired_jobs")
    )
    out_of_attempts = c.attempts >= c.max_attempts
    rescued = (
        sa.update(t)
        .where(c.id == expired.c.id)
        .values(
            status=sa.case((out_of_attempts, JobStatus.DEAD.value), else_=JobStatus.READY.value),
            finished_at=sa.case((out_of_attempts, sa.func.now()), else_=None),
            locked_until=None,
            last_error=LEASE_EXPIRED,
        )
        .returning(c.queue, c.status)
        .cte("rescued")
    )
    return _notify_queues(channel, rescued)


# Seconds until the earliest scheduled job is due, through <table>_scheduled, so an idle
# worker can sleep exactly until then (NULL when nothing is scheduled).
def _next_due(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return sa.select(sa.func.extract("epoch", sa.func.min(c.run_at) - sa.func.now())).where(
        c.status == status_literal(JobStatus.SCHEDULED)
    )


# Queue depth for metrics: per queue, how many jobs are ready and how long the oldest has
# been due. An index-only scan of <table>_claim (queue and run_at are in it; only ready
# rows are), read when metrics are scraped, never per job.
def _ready_depth(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    age = sa.func.greatest(0.0, sa.extract("epoch", sa.func.now() - sa.func.min(c.run_at)))
    return (
        sa.select(c.queue, sa.func.count().label("ready"), sa.cast(age, sa.Float).label("age"))
        .where(c.status == status_literal(JobStatus.READY))
        .group_by(c.queue)
        .order_by(c.queue)
    )


# Retention: delete a batch of finished rows older than :age, through <table>_finished.
# Small batches keep each transaction (and its locks) short.
def _prune(t: sa.Table, statuses: Sequence[JobStatus]) -> sa.Delete:
    c = t.c
    old = (
        sa.select(c.id)
        .where(
            c.status.in_([status_literal(s) for s in statuses]),
            c.finished_at < sa.func.now() - sa.bindparam("age", type_=sa.Interval),
        )
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return sa.delete(t).where(c.id.in_(old))


# One pruner at a time per table: a transaction-scoped advisory lock elects it.
def _try_lock(t: sa.Table) -> sa.Select[Any]:
    return sa.select(sa.func.pg_try_advisory_xact_lock(sa.func.hashtext(f"sqla_jobs:{t.fullname}")))


# -- enqueue ------------------------------------------------------------------------------

_BULK_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("task", sa.Text),
    ("queue", sa.Text),
    ("args", sa.Text),
    ("priority", sa.SmallInteger),
    ("max_attempts", sa.Integer),
    ("status", sa.Text),
    ("run_at", sa.DateTime(timezone=True)),
    ("unique_key", sa.Text),
    ("meta", sa.Text),
)


# Bulk enqueue of a run of jobs that differ only in their arguments and unique keys (what
# one enqueue_many call adds): INSERT ... SELECT FROM unnest(:args, :unique_key), the shared
# values (meta among them: one enqueue_many call gives all its jobs the same) as scalars.
# The statement is the same whatever the batch size, so it is compiled once, and only two
# arrays are built and sent. ON CONFLICT skips rows whose unique key
# belongs to a live job (<table>_unique).
def _bulk_insert(t: sa.Table) -> sa.Insert:
    each = (
        sa.func.unnest(
            sa.bindparam("args", type_=ARRAY(sa.Text)),
            sa.bindparam("unique_key", type_=ARRAY(sa.Text)),
        )
        .table_valued("args", "unique_key")
        .render_derived(name="rows")
    )
    shared = {name: sa.bindparam(name, type_=type_) for name, type_ in _BULK_COLUMNS}
    return (
        pg_insert(t)
        .from_select(
            [name for name, _ in _BULK_COLUMNS],
            sa.select(
                shared["task"],
                shared["queue"],
                sa.cast(each.c.args, JSONB),
                shared["priority"],
                shared["max_attempts"],
                shared["status"],
                sa.func.coalesce(shared["run_at"], sa.func.now()),
                each.c.unique_key,
                sa.cast(shared["meta"], JSONB),
            ),
        )
        .on_conflict_do_nothing(index_elements=["unique_key"], index_where=UNIQUE_WHERE)
        # The inserted count (unique rows skipped) is what jobs.enqueue_many returns;
        # SQLAlchemy keeps an INSERT's rowcount only when asked.
        .execution_options(preserve_rowcount=True)
    )


# Enqueue one job on a Core connection (``jobs.enqueue``): one statement whatever the
# options, so psycopg prepares it once; the arguments come as JSON text (the encoding
# that checked them) and run_at defaults to now(). The unique variant skips a key held
# by a live job (<table>_unique) and returns no row then.
def _insert_job(t: sa.Table, *, unique: bool) -> sa.Insert:
    p = {name: sa.bindparam(name, type_=type_) for name, type_ in _BULK_COLUMNS}
    stmt = pg_insert(t).values(
        task=p["task"],
        queue=p["queue"],
        args=sa.cast(p["args"], JSONB),
        priority=p["priority"],
        max_attempts=p["max_attempts"],
        status=p["status"],
        run_at=sa.func.coalesce(p["run_at"], sa.func.now()),
        unique_key=p["unique_key"],
        meta=sa.cast(p["meta"], JSONB),
    )
    if unique:
        stmt = stmt.on_conflict_do_nothing(index_elements=["unique_key"], index_where=UNIQUE_WHERE)
    return stmt.returning(t.c.id)


class JobParams(TypedDict):
    task: str
    queue: str
    args: str
    priority: int
    max_attempts: int
    status: str
    run_at: Any
    unique_key: str | None
    meta: str | None


def job_params(values: dict[str, Any]) -> JobParams:
    """Parameters of ``insert_job`` from checked values (:meth:`Jobs.job_values`)."""
    meta = values.get("meta")
    return {
        "task": values["task"],
        "queue": values["queue"],
        "args": args_json(values["args"]),
        "priority": values["priority"],
        "max_attempts": values["max_attempts"],
        "status": values["status"],
        "run_at": values.get("run_at"),
        "unique_key": values.get("unique_key"),
        "meta": None if meta is None else _dumps(meta),
    }


# Unique enqueue: one live job per key, enforced by <table>_unique. DO NOTHING returns no
# row on a conflict; live_by_key then finds the holder.
def _insert_unique(t: sa.Table) -> sa.Insert:
    return (
        pg_insert(t)
        .on_conflict_do_nothing(index_elements=["unique_key"], index_where=UNIQUE_WHERE)
        .returning(t.c.id)
    )


def _live_by_key(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return sa.select(c.id).where(
        c.unique_key == sa.bindparam("key"),
        c.status.in_([status_literal(s) for s in LIVE_STATUSES]),
    )


_SHARED = ("task", "queue", "priority", "max_attempts", "status", "run_at", "meta")

#: One encoder for every row: ``json.dumps(..., separators=...)`` builds one per call.
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def args_json(args: Any) -> str:
    """A job's arguments as JSON text: the text their check wrote, when they carry it
    (:class:`~sqla_jobs.tasks.CheckedArgs`), else encoded here."""
    text = getattr(args, "json", None)
    return text if isinstance(text, str) else _dumps(args)


def _shared_values(row: dict[str, Any]) -> tuple[Any, ...]:
    """What the rows of one enqueue_many call have in common."""
    return (
        row["task"],
        row["queue"],
        row["priority"],
        row["max_attempts"],
        row["status"],
        row.get("run_at"),
        row.get("meta"),
    )


def insert_rows(connection: Any, queries: Queries, rows: list[dict[str, Any]]) -> int:
    """INSERT checked job rows (from :meth:`Jobs.job_values <sqla_jobs.Jobs.job_values>`),
    one statement per run of rows that share task, queue and options: one statement for an
    ``enqueue_many`` call, whatever its size (a ``COPY`` for a big run without unique keys,
    see :mod:`sqla_jobs.bulk`). Returns how many rows were inserted (rows
    whose unique key a live job holds are not)."""
    statement = queries.bulk_insert
    inserted = 0
    for shared, run in itertools.groupby(rows, key=_shared_values):
        same = list(run)
        params = dict(zip(_SHARED, shared, strict=True))
        if params["meta"] is not None:
            params["meta"] = _dumps(params["meta"])
        params["args"] = [args_json(r["args"]) for r in same]
        params["unique_key"] = [r.get("unique_key") for r in same]
        if copy_allowed(connection, len(same), params["unique_key"]):
            inserted += copy_run(connection, queries.table, params, params["args"])
            continue
        inserted += connection.execute(statement, params).rowcount
    return inserted


# -- schedules (<table>_schedules) -------------------------------------------------------


# Due schedules, oldest tick first, through <table>_schedules_due. SKIP LOCKED: each worker
# takes the rows no other worker is handling, so a tick is enqueued by one of them.
def _due_schedules(s: sa.Table) -> sa.Select[Any]:
    return (
        sa.select(s)
        .where(s.c.enabled, s.c.next_run_at <= sa.bindparam("now"))
        .order_by(s.c.next_run_at)
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True, key_share=True)
    )


# Move a schedule past the tick it just enqueued. Guarded by the tick it read, so a replayed
# pass cannot move it twice.
def _advance_schedule(s: sa.Table) -> sa.Update:
    return (
        sa.update(s)
        .where(s.c.name == sa.bindparam("schedule"), s.c.next_run_at == sa.bindparam("tick"))
        .values(
            next_run_at=sa.bindparam("following"),
            last_run_at=sa.bindparam("latest"),
            last_error=None,
        )
    )


# A schedule that could not be enqueued keeps its row, says why, and waits for its next
# tick (NULL: none can be computed; it stays until someone fixes or removes it).
def _schedule_failed(s: sa.Table) -> sa.Update:
    return (
        sa.update(s)
        .where(s.c.name == sa.bindparam("schedule"))
        .values(last_error=sa.bindparam("error"), next_run_at=sa.bindparam("following"))
    )


# Insert or update one schedule row. A run-time schedule is replaced whole (its operator just
# said what it should be). A code-declared one keeps its place in time unless its expression
# or time zone changed, so that restarting workers never skips or repeats a tick, and keeps
# 'enabled' as an operator may have set it.
def _upsert_schedule(s: sa.Table, origin: str) -> sa.Insert:
    stmt = pg_insert(s)
    new = stmt.excluded
    changes: dict[str, Any] = {
        name: new[name] for name in ("task", "args", "cron", "tz", "queue", "priority", "origin")
    }
    if origin == "code":
        moved = sa.or_(s.c.cron.is_distinct_from(new.cron), s.c.tz.is_distinct_from(new.tz))
        changes["next_run_at"] = sa.case(
            (moved, new.next_run_at),
            else_=sa.func.coalesce(s.c.next_run_at, new.next_run_at),
        )
    else:
        changes.update(enabled=new.enabled, next_run_at=new.next_run_at, last_error=None)
    return stmt.on_conflict_do_update(index_elements=[s.c.name], set_=changes)


# Code-declared schedules the code no longer declares.
def _delete_undeclared(s: sa.Table) -> sa.Delete:
    return sa.delete(s).where(
        s.c.origin == "code", s.c.name.not_in(sa.bindparam("declared", expanding=True))
    )


# -- worker presence and throughput (<table>_workers, <table>_throughput) ----------------


# A worker says it is alive: insert or refresh its row (primary key), once every
# presence_interval. started_at stays from the first insert.
def _worker_seen(w: sa.Table) -> sa.Insert:
    stmt = pg_insert(w).values(
        name=sa.bindparam("name"),
        host=sa.bindparam("host"),
        pid=sa.bindparam("pid"),
        kind=sa.bindparam("kind"),
        queues=sa.bindparam("queues", type_=ARRAY(sa.Text)),
        concurrency=sa.bindparam("concurrency"),
        running=sa.bindparam("running"),
        processed=sa.bindparam("processed"),
        last_seen=sa.func.now(),
        expires_at=sa.func.now() + sa.bindparam("ttl", type_=sa.Interval),
    )
    new = stmt.excluded
    return stmt.on_conflict_do_update(
        index_elements=[w.c.name],
        set_={
            name: new[name]
            for name in (
                "host",
                "pid",
                "kind",
                "queues",
                "concurrency",
                "running",
                "processed",
                "last_seen",
                "expires_at",
            )
        },
    )


class WorkerSeenParams(TypedDict):
    name: str
    host: str
    pid: int
    kind: str
    queues: list[str]
    concurrency: int
    running: int
    processed: int
    ttl: timedelta


# Rows of workers that died without deleting theirs, an hour after they expired (the
# Workers page shows them as gone until then). A scan of a table of a few rows.
def _forget_workers(w: sa.Table) -> sa.Delete:
    return sa.delete(w).where(w.c.expires_at < sa.func.now() - sa.text("interval '1 hour'"))


# Add a worker's counts of written outcomes to the current minute of each queue (the
# database's clock, so workers on skewed clocks agree). One row per (minute, queue): a
# handful of workers adding to it every few seconds hold its lock for a moment each.
def _add_throughput(t: sa.Table) -> sa.Insert:
    rows = (
        sa.func.unnest(
            sa.bindparam("queues", type_=ARRAY(sa.Text)),
            sa.bindparam("succeeded", type_=ARRAY(sa.BigInteger)),
            sa.bindparam("failed", type_=ARRAY(sa.BigInteger)),
            sa.bindparam("dead", type_=ARRAY(sa.BigInteger)),
        )
        .table_valued("queue", "succeeded", "failed", "dead")
        .render_derived(name="counts")
    )
    stmt = pg_insert(t).from_select(
        ["minute", "queue", "succeeded", "failed", "dead"],
        sa.select(
            sa.func.date_trunc("minute", sa.func.now()),
            rows.c.queue,
            rows.c.succeeded,
            rows.c.failed,
            rows.c.dead,
        ),
    )
    return stmt.on_conflict_do_update(
        index_elements=[t.c.minute, t.c.queue],
        set_={
            "succeeded": t.c.succeeded + stmt.excluded.succeeded,
            "failed": t.c.failed + stmt.excluded.failed,
            "dead": t.c.dead + stmt.excluded.dead,
        },
    )


class ThroughputParams(TypedDict):
    queues: list[str]
    succeeded: list[int]
    failed: list[int]
    dead: list[int]


def throughput_params(counts: dict[str, list[int]]) -> ThroughputParams:
    """``{queue: [succeeded, failed, dead]}`` as the arrays of :func:`_add_throughput`."""
    queues = sorted(counts)
    return {
        "queues": queues,
        "succeeded": [counts[q][0] for q in queues],
        "failed": [counts[q][1] for q in queues],
        "dead": [counts[q][2] for q in queues],
    }


# Counts older than a day, through the primary key (minute first).
def _forget_throughput(t: sa.Table) -> sa.Delete:
    return sa.delete(t).where(t.c.minute < sa.func.now() - sa.text("interval '1 day'"))


class Queries:
    """The statements of one jobs table (and its companion tables), each built once.

    ``Jobs.queries`` holds the instance for a registry's table; its attributes are Core
    statements to ``execute`` with the parameters the ``*_params`` helpers build.
    """

    def __init__(self, table: sa.Table, *, keep_done: bool = False) -> None:
        self.table = t = table
        self.channel = channel = notify_channel(table)
        companions = companion_tables(t)
        self.queues_table = queues = companions.queues
        self.schedules_table = schedules = companions.schedules
        self.workers_table = workers = companions.workers
        self.throughput_table = throughput = companions.throughput

        self.claim = _claim(t)
        self.session_claim = _claim(t, for_session=True)
        self.complete = _complete(t, keep_done=keep_done)
        self.fail = _fail(t)
        self.snooze = _snooze(t)
        self.hand_back = _hand_back(t, channel)
        self.heartbeat = _heartbeat(t)

        self.promote = _promote(t, channel)
        self.rescue = _rescue(t, channel)
        self.next_due = _next_due(t)
        self.ready_depth = _ready_depth(t)
        self.prune_dead = _prune(t, (JobStatus.DEAD, JobStatus.CANCELLED))
        self.prune_done = _prune(t, (JobStatus.DONE,))
        self.try_lock = _try_lock(t)
        # Paused queues (<table>_queues): read once per poll interval, not per claim.
        self.paused = sa.select(queues.c.name).where(queues.c.paused)

        self.bulk_insert = _bulk_insert(t)
        self.insert_job = _insert_job(t, unique=False)
        self.insert_job_unique = _insert_job(t, unique=True)
        self.insert_unique = _insert_unique(t)
        self.live_by_key = _live_by_key(t)

        self.now = sa.select(sa.func.now())
        self.due_schedules = _due_schedules(schedules)
        self.advance_schedule = _advance_schedule(schedules)
        self.schedule_failed = _schedule_failed(schedules)
        self.upsert_code_schedule = _upsert_schedule(schedules, "code")
        self.upsert_runtime_schedule = _upsert_schedule(schedules, "runtime")
        self.delete_undeclared = _delete_undeclared(schedules)
        self.delete_schedule = (
            sa.delete(schedules)
            .where(schedules.c.name == sa.bindparam("schedule"))
            .returning(schedules.c.name)
        )
        self.list_schedules = sa.select(schedules).order_by(schedules.c.name)

        self.worker_seen = _worker_seen(workers)
        self.worker_gone = sa.delete(workers).where(workers.c.name == sa.bindparam("name"))
        self.forget_workers = _forget_workers(workers)
        self.add_throughput = _add_throughput(throughput)
        self.forget_throughput = _forget_throughput(throughput)

    def __repr__(self) -> str:
        return f"<Queries of {self.table.fullname}>"

"""Every statement the queue runs, as SQLAlchemy Core, built once per jobs table.

Each statement carries a comment: what it is for, and which index it reads through.
Statements take their values as bound parameters (never string formatting), so
SQLAlchemy's compiled cache and PostgreSQL's plans are reused run after run.

The guard
---------
``attempts`` grows by one at every claim and never goes down, so ``(id, attempts)`` names
exactly one claim of one job. Completing, failing, snoozing, handing back and
heartbeating all match on that pair: a worker that lost its lease and comes back late
finds no row, and changes nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .model import STATUSES, UNIQUE_WHERE, companion_tables, notify_channel

__all__ = ["Queries"]

_BULK_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("task", sa.Text),
    ("queue", sa.Text),
    ("args", sa.Text),
    ("priority", sa.SmallInteger),
    ("max_attempts", sa.Integer),
    ("status", sa.Text),
    ("run_at", sa.DateTime(timezone=True)),
    ("unique_key", sa.Text),
)
_LEASE_EXPIRED = "lease expired: the worker that ran this attempt stopped heartbeating"


class Queries:
    """The statements of one jobs table."""

    def __init__(self, table: sa.Table, *, keep_done: bool = False) -> None:
        self.table = t = table
        self.channel = notify_channel(table)
        c = t.c

        # Claim: up to :limit ready jobs of one queue, in priority, run_at, id order,
        # through <table>_claim. FOR NO KEY UPDATE SKIP LOCKED: concurrent claims skip each
        # other's rows instead of queueing behind them, and the weaker NO KEY lock does not
        # block foreign keys that point at the job row (FOR UPDATE would).
        # run_at <= now() is a guard against a 'ready' row from a clock ahead of the
        # database; the scheduled status keeps future jobs out of this index entirely.
        nxt = (
            sa.select(c.id)
            .where(
                c.status == _S["ready"],
                c.queue == sa.bindparam("queue_name"),
                c.run_at <= sa.func.now(),
            )
            .order_by(c.priority.desc(), c.run_at, c.id)
            .limit(sa.bindparam("limit"))
            .with_for_update(skip_locked=True, key_share=True)
            .cte("next_jobs")
        )
        self.claim = (
            sa.update(t)
            .where(c.id == nxt.c.id)
            .values(
                status="running",
                attempts=c.attempts + 1,
                locked_until=sa.func.now() + sa.bindparam("lease", type_=sa.Interval),
                locked_by=sa.bindparam("worker"),
            )
            .returning(
                c.id,
                c.queue,
                c.task,
                c.args,
                c.attempts,
                c.max_attempts,
                c.priority,
                c.run_at,
                c.created_at,
            )
        )

        # Complete a batch: one statement for many jobs, each row still guarded by its own
        # (id, attempts). Finished jobs are deleted, or kept as 'done' for retention.
        batch = _batch()
        guard = sa.and_(c.id == batch.c.id, c.attempts == batch.c.attempts)
        if keep_done:
            self.complete: sa.Executable = (
                sa.update(t)
                .where(guard, c.status == _RUNNING_VIA_PK)
                .values(status="done", locked_until=None, finished_at=sa.func.now())
                .returning(c.id)
            )
        else:
            self.complete = sa.delete(t).where(guard, c.status == _RUNNING_VIA_PK).returning(c.id)

        # Fail one attempt: retry after :delay (scheduled), or dead once attempts are used
        # up or the failure is permanent. The error and its traceback stay in last_error.
        dead = sa.or_(sa.bindparam("permanent", type_=sa.Boolean), c.attempts >= c.max_attempts)
        self.fail = (
            sa.update(t)
            .where(
                c.id == sa.bindparam("job_id"),
                c.attempts == sa.bindparam("attempt"),
                c.status == _RUNNING_VIA_PK,
            )
            .values(
                status=sa.case((dead, "dead"), else_="scheduled"),
                run_at=sa.case(
                    (dead, c.run_at),
                    else_=sa.func.now() + sa.bindparam("delay", type_=sa.Interval),
                ),
                finished_at=sa.case((dead, sa.func.now()), else_=None),
                locked_until=None,
                last_error=sa.bindparam("error"),
            )
            .returning(c.id, c.status)
        )

        # Snooze ("not yet"): back to scheduled without using up an attempt. attempts stays
        # (the guard needs it monotonic), so max_attempts grows by one instead.
        self.snooze = (
            sa.update(t)
            .where(
                c.id == sa.bindparam("job_id"),
                c.attempts == sa.bindparam("attempt"),
                c.status == _RUNNING_VIA_PK,
            )
            .values(
                status="scheduled",
                run_at=sa.func.now() + sa.bindparam("delay", type_=sa.Interval),
                max_attempts=c.max_attempts + 1,
                locked_until=None,
            )
            .returning(c.id)
        )

        # Hand back claimed jobs that never started (a stopping worker): ready again at
        # once, and the claim does not count (max_attempts + 1, as for snooze).
        batch = _batch()
        self.hand_back = (
            sa.update(t)
            .where(
                c.id == batch.c.id,
                c.attempts == batch.c.attempts,
                c.status == _RUNNING_VIA_PK,
            )
            .values(
                status="ready",
                max_attempts=c.max_attempts + 1,
                locked_until=None,
                locked_by=None,
            )
            .returning(c.id, c.queue)
        )

        # Heartbeat: extend the leases of all of a worker's running jobs in one statement.
        # Jobs that do not come back were lost (lease expired and retaken) or cancelled.
        batch = _batch()
        self.heartbeat = (
            sa.update(t)
            .where(c.id == batch.c.id, c.attempts == batch.c.attempts, c.status == _RUNNING_VIA_PK)
            .values(locked_until=sa.func.now() + sa.bindparam("lease", type_=sa.Interval))
            .returning(c.id)
        )

        # Promote due scheduled jobs to ready, through <table>_scheduled, and wake the
        # workers of their queues (NOTIFY is sent at commit).
        due = (
            sa.select(c.id)
            .where(c.status == _S["scheduled"], c.run_at <= sa.func.now())
            .order_by(c.run_at)
            .limit(sa.bindparam("limit"))
            .with_for_update(skip_locked=True, key_share=True)
            .cte("due_jobs")
        )
        promoted = (
            sa.update(t)
            .where(c.id == due.c.id)
            .values(status="ready")
            .returning(c.queue)
            .cte("promoted")
        )
        self.promote = self._notify_queues(promoted)

        # Rescue jobs whose lease has passed, through <table>_running: their worker died or
        # hung. Ready again (the next claim counts the attempt), or dead if none are left.
        expired = (
            sa.select(c.id)
            .where(c.status == _S["running"], c.locked_until < sa.func.now())
            .limit(sa.bindparam("limit"))
            .with_for_update(skip_locked=True, key_share=True)
            .cte("expired_jobs")
        )
        out_of_attempts = c.attempts >= c.max_attempts
        rescued = (
            sa.update(t)
            .where(c.id == expired.c.id)
            .values(
                status=sa.case((out_of_attempts, "dead"), else_="ready"),
                finished_at=sa.case((out_of_attempts, sa.func.now()), else_=None),
                locked_until=None,
                last_error=_LEASE_EXPIRED,
            )
            .returning(c.queue, c.status)
            .cte("rescued")
        )
        self.rescue = self._notify_queues(rescued)

        # Seconds until the earliest scheduled job is due, through <table>_scheduled, so an
        # idle worker can sleep exactly until then (NULL when nothing is scheduled).
        self.next_due = sa.select(
            sa.func.extract("epoch", sa.func.min(c.run_at) - sa.func.now())
        ).where(c.status == _S["scheduled"])

        # Retention: delete a batch of finished rows older than :age, through
        # <table>_finished. Small batches keep each transaction (and its locks) short.
        def prune(statuses: tuple[str, ...]) -> sa.Delete:
            old = (
                sa.select(c.id)
                .where(
                    c.status.in_([_S[st] for st in statuses]),
                    c.finished_at < sa.func.now() - sa.bindparam("age", type_=sa.Interval),
                )
                .limit(sa.bindparam("limit"))
                .with_for_update(skip_locked=True)
                .scalar_subquery()
            )
            return sa.delete(t).where(c.id.in_(old))

        self.prune_dead = prune(("dead", "cancelled"))
        self.prune_done = prune(("done",))
        # One pruner at a time per table: a transaction-scoped advisory lock elects it.
        self.try_lock = sa.select(
            sa.func.pg_try_advisory_xact_lock(sa.func.hashtext(f"sqla_jobs:{t.fullname}"))
        )

        # Paused queues (<table>_queues): read once per poll interval, not per claim.
        queues_table, self.schedules_table = companion_tables(t)
        self.queues_table = queues_table
        self.paused = sa.select(queues_table.c.name).where(queues_table.c.paused)

        # Bulk enqueue of a run of jobs that differ only in their arguments and unique keys
        # (what one enqueue_many call adds): INSERT ... SELECT FROM unnest(:args,
        # :unique_key), the shared values as scalars. The statement is the same whatever
        # the batch size, so it is compiled once, and only two arrays are built and sent.
        # ON CONFLICT skips rows whose unique key belongs to a live job (<table>_unique).
        each = (
            sa.func.unnest(
                sa.bindparam("args", type_=ARRAY(sa.Text)),
                sa.bindparam("unique_key", type_=ARRAY(sa.Text)),
            )
            .table_valued("args", "unique_key")
            .render_derived(name="rows")
        )
        shared = {name: sa.bindparam(name, type_=type_) for name, type_ in _BULK_COLUMNS}
        self.bulk_insert = (
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
                ),
            )
            .on_conflict_do_nothing(index_elements=["unique_key"], index_where=UNIQUE_WHERE)
        )

        # Unique enqueue: one live job per key, enforced by <table>_unique. DO NOTHING
        # returns no row on a conflict; live_by_key then finds the holder.
        self.insert_unique = (
            pg_insert(t)
            .on_conflict_do_nothing(index_elements=["unique_key"], index_where=UNIQUE_WHERE)
            .returning(c.id)
        )
        self.live_by_key = sa.select(c.id).where(
            c.unique_key == sa.bindparam("key"),
            c.status.in_([_S["scheduled"], _S["ready"], _S["running"]]),
        )

    def _notify_queues(self, changed: sa.CTE) -> sa.Select[Any]:
        """Wrap a data-modifying CTE that returns ``queue`` in a NOTIFY per distinct ready queue."""
        wake = sa.select(changed.c.queue).distinct()
        if "status" in changed.c:
            wake = wake.where(changed.c.status == _S["ready"])
        sub = wake.subquery("q")
        return sa.select(sa.func.pg_notify(sa.literal(self.channel), sub.c.queue)).select_from(sub)


#: Status values as SQL literals, not bound parameters: the planner can only match a
#: partial index (``WHERE status = 'ready'``) against a constant it can see in a generic
#: plan, and psycopg prepares statements that run often.
_S: dict[str, sa.ColumnElement[str]] = {
    status: sa.literal_column(f"'{status}'", sa.Text) for status in STATUSES
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
_RUNNING_VIA_PK = sa.select(_S["running"]).scalar_subquery()


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


def interval(seconds: float) -> timedelta:
    """Seconds as the timedelta that binds to an ``interval`` parameter."""
    return timedelta(seconds=seconds)

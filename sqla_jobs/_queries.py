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

import json
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypedDict

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, aggregate_order_by
from sqlalchemy.dialects.postgresql import array as pg_array
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ._storable import JSONB_MAX_BYTES
from .model import (
    CANCELLED_BY_PARENT_KEY,
    CHILDREN_KEY,
    KEEP_KEY,
    KEY_ORDER_STATUSES,
    LIVE_STATUSES,
    RESULTS_KEY,
    RUN_ANYWAY_KEY,
    THROUGHPUT_KINDS,
    UNIQUE_WHERE,
    JobStatus,
    companion_tables,
    notify_channel,
    result_channel,
)

if TYPE_CHECKING:
    from sqlalchemy.sql.expression import CTE

    from .throttle import QueueLimits

__all__ = [
    "Queries",
    "batch_params",
    "claim_params",
    "interval",
    "listen_sql",
    "status_literal",
    "unlisten_sql",
]

#: Written into ``last_error`` when a lease passes without a heartbeat.
LEASE_EXPIRED = "lease expired: the worker that ran this attempt stopped heartbeating"


# LISTEN/UNLISTEN take the channel as an identifier, not a parameter: quoted here, for the
# worker's listener and Jobs.result's wait alike.
def listen_sql(channel: str) -> str:
    """``LISTEN "<channel>"``: a channel is an identifier, not a parameter."""
    return 'LISTEN "{}"'.format(channel.replace('"', '""'))


def unlisten_sql(channel: str) -> str:
    """``UNLISTEN "<channel>"``, for a connection that goes back to the pool."""
    return 'UNLISTEN "{}"'.format(channel.replace('"', '""'))


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


class _IntArrayText(sa.types.TypeDecorator[Sequence[int]]):
    """A list of integers bound as the text of a PostgreSQL array (``'{1,2,3}'``), which
    the statement casts back (:func:`_int_array`).

    psycopg dumps a Python list element by element, in Python: two lists of 200 claims
    took 470 µs, 2.3 µs a job of the completer's time, against 65 µs for their text.
    """

    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: Sequence[int] | None, dialect: Any) -> str | None:
        if value is None:
            return None
        return "{" + ",".join(map(str, value)) + "}"


def _int_array(name: str, element: type[sa.BigInteger] | type[sa.Integer]) -> Any:
    """``CAST(:name AS element[])``, bound through :class:`_IntArrayText`."""
    return sa.cast(sa.bindparam(name, type_=_IntArrayText()), ARRAY(element))


def _batch() -> Any:
    """``unnest(:ids, :attempt_list) AS batch(id, attempts)``: a whole batch in two parameters."""
    return (
        sa.func.unnest(
            _int_array("ids", sa.BigInteger),
            _int_array("attempt_list", sa.Integer),
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
    """Parameters naming a batch of claims, for complete, heartbeat and hand back, in id
    order.

    The statements lock their rows in the batch's order (a nested loop over the unnest,
    one index lookup per element): a worker's heartbeat and its completer lock rows of
    the same running set on two connections, and in two different orders they could
    deadlock (seen once in CI; PostgreSQL then aborts one, and it is retried). In one
    order, one of them waits for the other instead."""
    ids: list[int] = []
    attempts: list[int] = []
    for claim in sorted(claims, key=_claim_id):
        ids.append(claim.id)
        attempts.append(claim.attempts)
    return {"ids": ids, "attempt_list": attempts}


_claim_id = operator.attrgetter("id")


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

# What Python's datetime holds, a day inside each end so that no session TimeZone can push
# a value out of it when psycopg reads it back.
_READABLE_FROM: sa.ColumnElement[Any] = sa.literal_column("TIMESTAMPTZ '0001-01-02 00:00:00+00'")
_READABLE_UNTIL: sa.ColumnElement[Any] = sa.literal_column("TIMESTAMPTZ '9999-12-30 00:00:00+00'")


def readable_time(column: Any) -> sa.ColumnElement[Any]:
    """``column`` (a timestamp) where Python's datetime can hold it, else NULL: rows are
    not all written by this library, and one ``'infinity'`` or BC time failed every read
    that selected it (a claim's batch, a whole job list)."""
    readable = column.between(_READABLE_FROM, _READABLE_UNTIL)
    return sa.case((readable, column), else_=sa.null())


#: What a listing shows for a JSON value Python cannot read: ``{UNREADABLE_KEY: why}``.
UNREADABLE_KEY = "sqla_jobs.unreadable"


def readable_json(text: str | None) -> Any:
    """A JSON column read as text (``CAST(... AS text)``), as Python, or what stands for a
    value Python cannot read (a number of more than 4,300 digits, JSON nested too deep).
    Read by the driver, such a value raised for the whole listing it was in."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        return {UNREADABLE_KEY: f"{type(exc).__name__}: {exc}"}


def claimed_columns(t: sa.Table) -> list[sa.ColumnElement[Any]]:
    """The columns a worker reads from a claimed row (:data:`CLAIMED_COLUMNS`), in a form
    the driver can always read, so that one row cannot break the claim of its batch.

    Rows are not all written by this library (other services, SQL, older versions), and
    the claim commits before psycopg reads its rows: one value it cannot read (a number
    of more than 4,300 digits, JSON nested a thousand deep, a time of ``-infinity`` or
    BC) raised for the whole batch, and every job of it stayed ``running`` on nobody
    until its lease passed. So ``args`` and ``meta`` come back as JSON text, decoded row
    by row by :func:`sqla_jobs.worker.job.decode_rows`, and a time Python cannot hold
    comes back NULL; such a row is failed, naming the column, and the rest run.
    """
    c = t.c
    columns: list[sa.ColumnElement[Any]] = []
    for name in CLAIMED_COLUMNS:
        column = c[name]
        if name in ("args", "meta"):
            columns.append(sa.cast(column, sa.Text).label(name))
        elif name in ("run_at", "created_at"):
            columns.append(readable_time(column).label(name))
        else:
            columns.append(column)
    return columns


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
        # By id = ANY(ARRAY(...)), a probe of the primary key per locked row. As a join
        # (UPDATE ... FROM next_jobs), the planner, costing each probe as a random read,
        # hashed the locked ids and scanned the whole table for them whenever the table
        # was small enough for that to look cheaper: a claim of 200 at 20,000 jobs spent
        # 1.5 ms of its 2.5 there, and took longer the more jobs waited behind it.
        .where(c.id == sa.any_(_ids_of(nxt.c.id)))
        .values(
            status=JobStatus.RUNNING.value,
            attempts=c.attempts + 1,
            locked_until=sa.func.clock_timestamp() + sa.bindparam("lease", type_=sa.Interval),
            locked_by=sa.bindparam("worker"),
        )
        # The worker reads what it runs a job with; a session gets whole rows, to make
        # ORM objects of them.
        .returning(*(t.c if for_session else claimed_columns(t)))
    )


class ClaimParams(TypedDict):
    queue_name: str
    limit: int
    lease: timedelta
    worker: str


def claim_params(queue: str, limit: int, lease: timedelta, worker: str) -> ClaimParams:
    return {"queue_name": queue, "limit": limit, "lease": lease, "worker": worker}


# -- the limited claim (sqla_jobs.throttle) ------------------------------------------------


# Serialise the claims of one limited queue: a transaction-scoped advisory lock, keyed by
# the table (first key) and the queue (second key). The two-key form has a key space of its
# own, apart from the pruner's one-key lock. Run first in the claim's transaction, so that
# the limited claim after it sees every claim committed before the lock was granted.
# ``generic_plan``: the worker's form. The same statement also asks for PostgreSQL's
# generic plan for the rest of the transaction (``set_config(..., true)``, as SET LOCAL),
# one statement for two, and makes sure the transaction is READ COMMITTED
# (``READ_COMMITTED``), which the worker may have only assumed.
#
# The worker's form also bounds its wait for the lock (and for the rows the claim writes
# after it) by CLAIM_LOCK_TIMEOUT: the lock is held for a claim's few milliseconds by other
# workers, but for as long as it likes by an application's ``session.claim`` in an open
# transaction (a paused process, a slow request), and the fetch loop, which claims every
# queue in turn on one connection, stopped claiming any of them while it waited. Past the
# timeout the queue is left for a while, longer each time it stays busy, up to a poll
# interval (``LimitedClaim.busy``, ``Fetcher.limited_claimed``).
def _limit_lock(t: sa.Table, *, generic_plan: bool = False) -> sa.Select[Any]:
    lock = sa.func.pg_advisory_xact_lock(
        sa.func.hashtext(f"sqla_jobs.limits:{t.fullname}"),
        sa.func.hashtext(sa.bindparam("queue_name", type_=sa.Text)),
    )
    if not generic_plan:
        return sa.select(lock)
    # The select list is evaluated in order: the timeout is set before the lock is asked.
    return sa.select(READ_COMMITTED, GENERIC_PLAN, CLAIM_LOCK_WAIT, lock)


#: How long the worker's limited claim waits for its queue's lock (see ``_limit_lock``).
CLAIM_LOCK_TIMEOUT = "100ms"

#: ``SET LOCAL lock_timeout`` as an expression (see ``GENERIC_PLAN``).
CLAIM_LOCK_WAIT = sa.func.set_config(
    sa.literal_column("'lock_timeout'"), sa.literal_column(f"'{CLAIM_LOCK_TIMEOUT}'"), sa.true()
)

#: The SQLSTATE of a lock not granted within ``lock_timeout``.
LOCK_NOT_AVAILABLE = "55P03"


#: ``SET LOCAL plan_cache_mode = force_generic_plan`` as an expression, which a SELECT can
#: carry beside another call (see ``_limit_lock``), and which, unlike SET LOCAL, says nothing
#: when the transaction is the implicit one of a pipeline (SET LOCAL warns that it is not
#: in a transaction block, and applies all the same).
GENERIC_PLAN = sa.func.set_config(
    sa.literal_column("'plan_cache_mode'"), sa.literal_column("'force_generic_plan'"), sa.true()
)

#: The check that a limited claim's transaction is READ COMMITTED, free when it is: setting
#: ``transaction_isolation`` to the level the transaction already has does nothing, and to
#: any other level once the statement has its snapshot fails with SQLSTATE 25001
#: (``SET TRANSACTION ISOLATION LEVEL must be called before any query``), which rolls the
#: claim back before it claims anything. The worker sends its limited claims without BEGIN
#: where the server's ``default_transaction_isolation`` was READ COMMITTED when it asked;
#: a reload of the server's configuration changes that default in live sessions too, and
#: under REPEATABLE READ the claim would not see the claims that committed while it waited
#: for the queue's lock (``sqla_jobs.worker._statements._claim_in_pipeline`` then asks
#: again and sends BEGIN ISOLATION LEVEL READ COMMITTED).
READ_COMMITTED = sa.func.set_config(
    sa.literal_column("'transaction_isolation'"), sa.literal_column("'read committed'"), sa.true()
)

#: The SQLSTATE of :data:`READ_COMMITTED`'s refusal.
NOT_READ_COMMITTED = "25001"


# Limited claim: the plain claim's order and lease, but only as many jobs as the queue's
# limits leave room for (run under _limit_lock, see sqla_jobs.throttle):
#   budget   least(:limit, :concurrency - running, :rate - starts in the window); a NULL
#            limit drops out of least();
#   running  the queue's running rows, through <table>_running (a few hundred at most);
#   per key  running rows per concurrency_key, through <table>_keys; keys at
#            :key_limit are skipped, the others get rows up to their room, by row_number()
#            over the first :scan ready rows (through <table>_claim);
#   rate     <table>_queues.rate_log, trimmed to the window and extended by one
#            clock_timestamp() per job claimed (only when the queue has a rate);
#   key rate <table>_key_starts, one log per (queue, key), only with :key_rate: keys whose
#            log is full (full_until, indexed) are skipped before the scan, like keys at
#            :key_limit; the others get rows up to the room their log leaves, and the
#            logs of the keys claimed are trimmed and extended (an upsert per key).
# Always returns one row at least: the claimed jobs, or one row of NULL job columns, each
# with ``ready_seen`` (ready rows seen, up to :limit + 1: more than were claimed means the
# limits held some back) and ``rate_free_in`` (seconds until the window has room again,
# when the rate is used up); the key-rated variant adds ``key_free_in`` (seconds until the
# first key held by its rate has room again).
LIMITED_COLUMNS = ("ready_seen", "rate_free_in", "key_free_in")


def _limited_claim(
    t: sa.Table,
    *,
    key_rated: bool = False,
    fifo: bool = False,
    rated: bool = True,
    capped: bool = True,
    keyed: bool = True,
) -> sa.Select[Any]:
    """The limited claim; ``key_rated``: the variant for queues with a ``key_rate``, which
    reads and writes <table>_key_starts (a queue without one keeps the statement it had,
    and does not pay for that table's CTEs); ``fifo``: for queues with
    ``key_order="fifo"``, where a keyed job is a candidate only at the head of its key.

    ``rated`` and ``capped``: whether the statement has the queue's rate log and its
    running count. A queue without a rate (or without a concurrency limit) gets a
    statement without them: PostgreSQL plans this statement at every claim (its custom
    plans prune what NULL parameters rule out, so it never settles on a generic one), and
    the planning of CTEs that a NULL parameter makes moot was most of the claim's cost.
    ``keyed`` (always, with ``key_rated`` or ``fifo``): the per-key parts; a queue that no
    keyed task uses holds no keyed job (the enqueue refuses one), so its claim has none."""
    c = t.c
    queues = companion_tables(t).queues
    queue_name = sa.bindparam("queue_name", type_=sa.Text)
    # Cast: a bare NULL parameter next to a timestamp reads as a timestamp, not an interval.
    period = sa.cast(sa.bindparam("period", type_=sa.Interval), sa.Interval)
    rate = sa.bindparam("rate", type_=sa.Integer)
    key_limit = sa.bindparam("key_limit", type_=sa.Integer)
    key_rate = sa.bindparam("key_rate", type_=sa.Integer)
    key_period = sa.cast(sa.bindparam("key_period", type_=sa.Interval), sa.Interval)
    ks = companion_tables(t).key_starts
    stamps = ARRAY(sa.DateTime(timezone=True))
    ready = (c.status == status_literal(JobStatus.READY), c.queue == queue_name)
    running = (c.status == status_literal(JobStatus.RUNNING), c.queue == queue_name)

    clock = sa.select(sa.func.clock_timestamp().label("at")).cte("clock")
    # The log's entries within the window, oldest first: one per claim, its time and how
    # many jobs it started (a NULL count, from a log written one entry per job, is one).
    stamp = (
        sa.func.unnest(queues.c.rate_log, queues.c.rate_counts)
        .table_valued("at", "n")
        .render_derived(name="stamp")
    )
    started = sa.func.coalesce(stamp.c.n, 1)
    recent = (
        sa.select(
            sa.func.coalesce(
                sa.func.array_agg(aggregate_order_by(stamp.c.at, stamp.c.at)),
                sa.cast(sa.literal_column("'{}'"), ARRAY(sa.DateTime(timezone=True))),
            ).label("log"),
            sa.func.coalesce(
                sa.func.array_agg(aggregate_order_by(started, stamp.c.at)),
                sa.cast(sa.literal_column("'{}'"), ARRAY(sa.Integer)),
            ).label("counts"),
            sa.func.coalesce(sa.func.sum(started), 0).label("started"),
        )
        .select_from(queues.join(stamp, sa.true()).join(clock, sa.true()))
        .where(queues.c.name == queue_name, stamp.c.at > clock.c.at - period)
        .cte("recent")
    )
    counted = sa.select(sa.func.count().label("n")).where(*running)
    n_running = counted.cte("n_running")
    terms: list[sa.ColumnElement[Any]] = [sa.bindparam("limit", type_=sa.Integer)]
    budget_n: sa.ColumnElement[Any]
    if rated:
        # The budget joins the log it reads, which the log's rewrite below reads too.
        budget_from: list[sa.FromClause] = []
        if capped:
            terms.append(sa.bindparam("concurrency", type_=sa.Integer) - n_running.c.n)
            budget_from.append(n_running)
        terms.append(rate - recent.c.started)
        budget_from.append(recent)
        joined: sa.FromClause = budget_from[0]
        for other in budget_from[1:]:
            joined = joined.join(other, sa.true())
        budget = (
            sa.select(sa.func.greatest(0, sa.func.least(*terms)).label("n"))
            .select_from(joined)
            .cte("budget")
        )
        budget_n = sa.select(budget.c.n).scalar_subquery()
    else:
        # Without a rate, the budget is an expression in the claim's LIMIT, the running
        # count a scalar subquery in it: two CTEs fewer to plan, at every claim.
        if capped:
            terms.append(sa.bindparam("concurrency", type_=sa.Integer) - counted.scalar_subquery())
        budget_n = sa.func.greatest(0, sa.func.least(*terms))
    busy_keys = (
        sa.select(c.concurrency_key.label("key"), sa.func.count().label("n"))
        .where(*running, c.concurrency_key.is_not(None))
        .group_by(c.concurrency_key)
        .cte("busy_keys")
    )
    full_keys = sa.select(busy_keys.c.key).where(busy_keys.c.n >= key_limit)
    # Keys whose rate log is full, through <table>_key_starts_full.
    key_full = (
        sa.select(ks.c.key, ks.c.full_until)
        .select_from(ks.join(clock, sa.true()))
        .where(ks.c.queue == queue_name, key_rate.is_not(None), ks.c.full_until > clock.c.at)
        .cte("key_full")
    )

    def room_for(key: Any) -> sa.ColumnElement[bool]:
        """The key is below its running limit and, with a key rate, its log has room."""
        room: sa.ColumnElement[bool] = key.not_in(full_keys)
        if key_rated:
            room = sa.and_(room, key.not_in(sa.select(key_full.c.key)))
        return room

    room = room_for(c.concurrency_key)
    scan = sa.bindparam("scan", type_=sa.Integer)
    walk = None
    if fifo:
        head, walk = _fifo_heads(t, queue_name, scan, room_for)
    elif not keyed and not key_rated:
        # A CTE: its rows are also the ready rows seen (see ``seen`` below).
        head = (
            sa.select(c.id, c.priority, c.run_at, c.concurrency_key)
            .where(*ready, c.run_at <= sa.func.now())
            .order_by(c.priority.desc(), c.run_at, c.id)
            .limit(scan)
            .cte("head")
        )
    else:
        head = (
            sa.select(c.id, c.priority, c.run_at, c.concurrency_key)
            .where(*ready, c.run_at <= sa.func.now(), sa.or_(c.concurrency_key.is_(None), room))
            .order_by(c.priority.desc(), c.run_at, c.id)
            .limit(scan)
            .subquery("head")
        )
    candidates = sa.select(
        head,
        sa.func.row_number()
        .over(
            partition_by=head.c.concurrency_key,
            order_by=(head.c.priority.desc(), head.c.run_at, head.c.id),
        )
        .label("nth"),
    ).cte("candidates")
    # With a key rate: a start at or before this no longer counts.
    cutoff = sa.select(clock.c.at - key_period).scalar_subquery()
    chosen_from: sa.Select[Any]
    # What the chosen rows are ordered from: the candidates, or the head when no key.
    ranked: sa.FromClause = candidates
    if not keyed and not key_rated and not fifo:
        # No keys: the head in its order, up to the budget (no window over the keys).
        ranked = head
        chosen_from = sa.select(head.c.id)
    elif key_rated:
        # The candidates in claim order, then each one's key rate checked in that order
        # until the budget is full (the LIMIT stops the scan): a probe of its key's log
        # for each candidate taken, not for every candidate. OFFSET 0 keeps PostgreSQL
        # from flattening the ordered subquery, which would check every row before the
        # sort; its order carries through the filter above it.
        ranked = (
            sa.select(candidates, busy_keys.c.n.label("busy"))
            .select_from(
                candidates.outerjoin(busy_keys, busy_keys.c.key == candidates.c.concurrency_key)
            )
            .order_by(candidates.c.priority.desc(), candidates.c.run_at, candidates.c.id)
            .offset(0)
            .subquery("ranked")
        )
        r = ranked.c
        # Each candidate's key log as last written (NULL: none), one probe of the primary
        # key: trimmed to the window then, so its length is an upper bound of the starts
        # still in it (see _key_room). Read as it is, not unnested, sorted and aggregated
        # per key, only for the candidates the claim gets to, and carried on to the log's
        # rewrite (key_counts): reading every candidate key's log that way at every claim
        # was most of what a key rate cost (a claim of 200 over 1,000 keys spent 9 of its
        # 16 ms sorting 8,800 starts at 10,000 a second). LATERAL, with a LIMIT that keeps
        # PostgreSQL from turning it into a plain join: a nested loop over the ordered
        # candidates, up to the claim's LIMIT (as a join, it hashed the logs of every key
        # of the queue, at every claim).
        key_log = (
            sa.select(ks.c.log)
            .where(ks.c.queue == queue_name, ks.c.key == r.concurrency_key, key_rate.is_not(None))
            .limit(1)
            .lateral("key_log")
        )
        chosen_from = (
            sa.select(r.id, key_log.c.log)
            .select_from(ranked.outerjoin(key_log, sa.true()))
            .where(
                sa.or_(
                    r.concurrency_key.is_(None),
                    sa.and_(
                        sa.or_(
                            key_limit.is_(None), r.nth + sa.func.coalesce(r.busy, 0) <= key_limit
                        ),
                        _key_room(r.nth, key_log.c.log, key_rate, cutoff),
                    ),
                )
            )
        )
    else:
        chosen_from = (
            sa.select(candidates.c.id)
            .select_from(
                candidates.outerjoin(busy_keys, busy_keys.c.key == candidates.c.concurrency_key)
            )
            .where(
                sa.or_(
                    candidates.c.concurrency_key.is_(None),
                    candidates.c.nth + sa.func.coalesce(busy_keys.c.n, 0) <= key_limit,
                )
            )
        )
    if not key_rated:
        chosen_from = chosen_from.order_by(ranked.c.priority.desc(), ranked.c.run_at, ranked.c.id)
    chosen = chosen_from.limit(budget_n).cte("chosen")
    claimed = (
        sa.update(t)
        # By id = ANY(ARRAY(...)), a probe of the primary key per chosen row: as a join,
        # the generic plan of the keyed shapes hashed the chosen ids and scanned the whole
        # table for them (a claim of 200 at 20,000 jobs: 2.7 ms of its 9.7).
        .where(c.id == sa.any_(_ids_of(chosen.c.id)), c.status == status_literal(JobStatus.READY))
        .values(
            status=JobStatus.RUNNING.value,
            attempts=c.attempts + 1,
            locked_until=sa.func.clock_timestamp() + sa.bindparam("lease", type_=sa.Interval),
            locked_by=sa.bindparam("worker"),
        )
        .returning(*claimed_columns(t), *([c.concurrency_key] if key_rated else []))
        .cte("claimed")
    )
    n_claimed = sa.select(sa.func.count()).select_from(claimed).scalar_subquery()
    new_log = sa.func.array_append(recent.c.log, clock.c.at)
    new_counts = sa.func.array_append(recent.c.counts, sa.cast(n_claimed, sa.Integer))
    log_insert = pg_insert(queues).from_select(
        ["name", "rate_log", "rate_counts"],
        sa.select(queue_name, new_log, new_counts)
        .select_from(recent.join(clock, sa.true()))
        .where(rate.is_not(None), n_claimed > 0),
    )
    logged = (
        log_insert.on_conflict_do_update(
            index_elements=[queues.c.name],
            set_={
                "rate_log": log_insert.excluded.rate_log,
                "rate_counts": log_insert.excluded.rate_counts,
            },
        )
        .returning(queues.c.name)
        .cte("logged")
    )
    key_free_in: list[sa.ColumnElement[Any]] = []
    if key_rated:
        # Each claimed key's log: trimmed, plus one start per job claimed; full_until when it
        # holds :key_rate starts (the oldest one that counts, plus the period). The log is
        # the one the choice read (the same on each of the key's rows: min() picks it).
        key_counts = (
            sa.select(
                claimed.c.concurrency_key.label("key"),
                sa.func.count().label("n"),
                sa.func.min(chosen.c.log).label("log"),
            )
            .select_from(claimed.join(chosen, chosen.c.id == claimed.c.id))
            .where(claimed.c.concurrency_key.is_not(None), key_rate.is_not(None))
            .group_by(claimed.c.concurrency_key)
            .subquery("key_counts")
        )
        key_new = (
            sa.select(
                key_counts.c.key,
                sa.type_coerce(
                    sa.func.coalesce(
                        _in_window(key_counts.c.log, cutoff),
                        sa.cast(sa.literal_column("'{}'"), stamps),
                    ).op("||")(
                        sa.func.array_fill(
                            clock.c.at, pg_array([sa.cast(key_counts.c.n, sa.Integer)])
                        )
                    ),
                    stamps,
                ).label("log"),
            )
            .select_from(key_counts.join(clock, sa.true()))
            .cte("key_new")
            # Materialized: the statement reads the new log four times, which PostgreSQL,
            # inlining a CTE read once, would compute four times over.
            .prefix_with("MATERIALIZED")
        )
        size = sa.func.cardinality(key_new.c.log)
        key_insert = pg_insert(ks).from_select(
            ["queue", "key", "log", "full_until", "expires_at"],
            sa.select(
                queue_name,
                key_new.c.key,
                key_new.c.log,
                sa.case((size >= key_rate, key_new.c.log[size - key_rate + 1] + key_period)),
                clock.c.at + key_period,
            ).select_from(key_new.join(clock, sa.true())),
        )
        key_logged = (
            key_insert.on_conflict_do_update(
                index_elements=[ks.c.queue, ks.c.key],
                set_={
                    "log": key_insert.excluded.log,
                    "full_until": key_insert.excluded.full_until,
                    "expires_at": key_insert.excluded.expires_at,
                },
            )
            .returning(ks.c.full_until)
            .cte("key_logged")
        )
        key_free_at = sa.func.least(
            sa.select(sa.func.min(key_full.c.full_until)).scalar_subquery(),
            sa.select(sa.func.min(key_logged.c.full_until)).scalar_subquery(),
        )
        key_free_in.append(
            sa.cast(sa.extract("epoch", key_free_at - clock.c.at), sa.Float).label("key_free_in")
        )
    ready_seen: sa.ColumnElement[Any]
    if not keyed and not key_rated and not fifo:
        # Without keys the head is the first :scan ready rows (:scan is :limit, or one
        # more than the concurrency when that is smaller): more of them than were claimed
        # means the limits held some back, without a scan of the table of its own.
        ready_seen = sa.select(sa.func.count()).select_from(head).scalar_subquery()
    elif not fifo:
        # Keyed: the head is the first :scan ready rows of keys with room, all of them
        # candidates; every other ready row is of a key at its limit (running, or by its
        # rate). So ready rows were held back when more candidates were read than
        # claimed, or else when a key at its limit has a ready row: one probe of the
        # key's rows (<table>_key_order) per such key, up to the first that has one, and
        # only when the candidates do not tell. A scan of the ready rows of its own
        # (below) read, from the front of the claim index, the entries of every job
        # claimed since the last VACUUM: 1.5 ms of a 4.4 ms keyed claim of 200 in a drain
        # of 60,000 jobs, where the head, which reads them too, took 0.6.
        limited_keys = (
            sa.union(full_keys, sa.select(key_full.c.key)) if key_rated else full_keys
        ).subquery("at_limit")
        waiting = (
            sa.select(sa.literal(1))
            .where(*ready, c.concurrency_key == limited_keys.c[0], c.run_at <= sa.func.now())
            .limit(1)
            .lateral("waiting")
        )
        held_back = sa.exists(
            sa.select(sa.literal(1)).select_from(limited_keys.join(waiting, sa.true()))
        )
        n_candidates = sa.select(sa.func.count()).select_from(candidates).scalar_subquery()
        ready_seen = n_candidates + sa.case((n_candidates > n_claimed, 0), (held_back, 1), else_=0)
    else:
        # In key order the candidates are the keys' heads, which do not tell what is ready
        # behind them: the first ready rows are counted.
        seen = (
            sa.select(sa.literal(1))
            .where(*ready, c.run_at <= sa.func.now())
            .limit(sa.bindparam("limit", type_=sa.Integer) + 1)
            .subquery("seen")
        )
        ready_seen = sa.select(sa.func.count()).select_from(seen).scalar_subquery()
    used = recent.c.started + n_claimed
    oldest = sa.func.coalesce(recent.c.log[1], clock.c.at)
    free_in: sa.ColumnElement[Any] = sa.case(
        (used >= rate, sa.extract("epoch", oldest + period - clock.c.at)), else_=None
    )
    logged_count: sa.ColumnElement[Any] = (
        sa.select(sa.func.count()).select_from(logged).scalar_subquery()
    )
    info_from: sa.FromClause | None = recent.join(clock, sa.true())
    if not rated:
        # No FROM: a queue without a rate (nor a key rate) reads no clock at all.
        free_in, logged_count = sa.null(), sa.null()
        info_from = clock if key_rated else None
    last_key: list[sa.ColumnElement[Any]] = []
    if walk is not None:
        # Where the walk over the keys stopped: the next claim starts after it.
        last_key.append(
            sa.select(walk.c.k)
            .order_by(walk.c.n.desc())
            .limit(1)
            .scalar_subquery()
            .label("last_key")
        )
    info = (
        sa.select(
            ready_seen.label("ready_seen"),
            sa.cast(free_in, sa.Float).label("rate_free_in"),
            *key_free_in,
            *last_key,
            logged_count.label("logged"),
        )
        .select_from(*([info_from] if info_from is not None else []))
        .subquery("info")
    )
    return sa.select(
        *(claimed.c[name] for name in CLAIMED_COLUMNS),
        info.c.ready_seen,
        info.c.rate_free_in,
        *([info.c.key_free_in] if key_rated else []),
        *([info.c.last_key] if walk is not None else []),
    ).select_from(info.outerjoin(claimed, sa.true()))


def _in_window(log: Any, cutoff: Any) -> sa.ColumnElement[Any]:
    """A key's log without the starts at or before ``cutoff`` (in its order, oldest first):
    the log itself when its oldest start is after it, else ``ARRAY(SELECT at FROM
    unnest(log) WITH ORDINALITY ... ORDER BY ordinality)``."""
    stamp = sa.func.unnest(log).table_valued("at", with_ordinality="i").render_derived(name="kept")
    kept = sa.select(stamp.c.at).where(stamp.c.at > cutoff).order_by(stamp.c.i)
    trimmed = sa.func.array(kept.scalar_subquery(), type_=ARRAY(sa.DateTime(timezone=True)))
    # Oldest first: when the oldest start is still in the window, so is the whole log.
    return sa.case((log[1] > cutoff, log), else_=trimmed)


def _key_room(nth: Any, log: Any, key_rate: Any, cutoff: Any) -> sa.ColumnElement[bool]:
    """Whether a key's ``nth`` candidate fits its rate: the log's length, an upper bound of
    its starts in the window, says so at once for a key far from its rate; only a key near
    it has its log counted (a CASE, so that PostgreSQL counts only then)."""
    last_written = sa.func.coalesce(sa.func.cardinality(log), 0)
    held = sa.func.unnest(log).table_valued("at").render_derived(name="held")
    counted = sa.select(sa.func.count()).select_from(held).where(held.c.at > cutoff)
    return sa.case(
        (nth + last_written <= key_rate, sa.true()),
        else_=nth + counted.scalar_subquery() <= key_rate,
    )


def _fifo_heads(
    t: sa.Table, queue_name: Any, scan: Any, room_for: Callable[[Any], sa.ColumnElement[bool]]
) -> tuple[Any, Any]:
    """The candidates of a queue with ``key_order="fifo"``: the head of each key (its
    first job, by id, that waits or is ready, or, when failed heads hold, ended dead or
    cancelled), when that head is ready and due and its key has room; and the first ready
    jobs without a key. The walk and its CTE (for where it stopped).

    A running job is not in ``<table>_key_order`` (see ``KEY_ORDER_STATUSES``): its key
    has no room (``room_for``: a queue in key order runs one job per key, counted in
    ``<table>_keys``), so the ready job behind it is no candidate, as when the running job
    was the head the probe found.

    The heads are found by walking the keys (one probe of ``<table>_key_order`` for the
    next key, one for its head), not by reading the ready jobs in claim order: a key whose
    head runs may have thousands of ready jobs behind it, all of which a scan of the ready
    jobs would read before it reached another key's head. At most ``:scan`` keys a claim,
    starting after ``:after_key`` (where the worker's last claim stopped) and wrapping
    around, so that every key is reached in turn whatever the number of keys: a claim
    costs the same with 10 keys or 100,000, and keys take turns."""
    hold = sa.bindparam("hold", type_=sa.Boolean)
    waiting = [status_literal(s) for s in (JobStatus.SCHEDULED, JobStatus.READY)]
    failed = [status_literal(s) for s in (JobStatus.DEAD, JobStatus.CANCELLED)]

    def in_order(e: Any) -> sa.ColumnElement[bool]:
        # A head cancelled while it ran keeps its lease while its handler may run on:
        # it holds its key till then whatever on_head_failure says (with "continue", the
        # key's next job started beside that handler).
        return sa.and_(
            *_key_ordered(e, queue_name),
            sa.or_(
                e.status.in_(waiting),
                sa.and_(hold, e.status.in_(failed)),
                sa.and_(
                    e.status == status_literal(JobStatus.CANCELLED),
                    e.locked_until > sa.func.now(),
                ),
            ),
        )

    walk, visited = _key_walk(t, queue_name, scan)
    h = t.alias("key_head").c
    first_job = (
        sa.select(h.id, h.status, h.priority, h.run_at, h.concurrency_key)
        .where(in_order(h), h.concurrency_key == visited.c.k)
        .order_by(h.id)
        .limit(1)
        .lateral("first_job")
    )
    heads = (
        sa.select(
            first_job.c.id, first_job.c.priority, first_job.c.run_at, first_job.c.concurrency_key
        )
        .select_from(visited.join(first_job, sa.true()))
        .where(
            first_job.c.status == status_literal(JobStatus.READY),
            first_job.c.run_at <= sa.func.now(),
        )
    )
    # Jobs without a key are not ordered: the first ready ones, as the plain claim reads
    # them (a bounded read: the keyed ones among them are dropped).
    front = _front(t, queue_name, scan).subquery("front")
    unkeyed = sa.select(front).where(front.c.concurrency_key.is_(None))
    both = sa.union_all(heads, unkeyed).subquery("both")
    head = (
        sa.select(both)
        .where(sa.or_(both.c.concurrency_key.is_(None), room_for(both.c.concurrency_key)))
        .order_by(both.c.priority.desc(), both.c.run_at, both.c.id)
        .limit(scan)
        .subquery("head")
    )
    return head, walk


def _key_ordered(e: Any, queue_name: Any) -> list[sa.ColumnElement[bool]]:
    """``<table>_key_order``'s own predicate for ``queue_name`` on the columns ``e``, spelled
    as the index spells it (literal statuses), so that the planner uses that index for each
    probe: it does not see it through a condition that ORs statuses with a parameter."""
    return [
        e.queue == queue_name,
        e.concurrency_key.is_not(None),
        e.status.in_([status_literal(s) for s in KEY_ORDER_STATUSES]),
    ]


def _front(t: sa.Table, queue_name: Any, limit: Any) -> sa.Select[Any]:
    """The first ``limit`` ready, due jobs of a queue in claim order, unlocked: where the
    fifo and fair claims find the jobs without a key (a bounded read, whatever the keys)."""
    c = t.c
    return (
        sa.select(c.id, c.priority, c.run_at, c.concurrency_key)
        .where(
            c.status == status_literal(JobStatus.READY),
            c.queue == queue_name,
            c.run_at <= sa.func.now(),
        )
        .order_by(c.priority.desc(), c.run_at, c.id)
        .limit(limit)
    )


def _key_walk(t: sa.Table, queue_name: Any, scan: Any) -> Any:
    """A recursive walk over the keys of a queue's jobs in ``<table>_key_order``: at most
    ``:scan`` keys, from the first one after ``:after_key`` (where the worker's last
    claim stopped; None: from the start), wrapping around once. The walk (its last row:
    where it stopped) and the keys it visited."""

    def indexed(e: Any) -> list[sa.ColumnElement[bool]]:
        return _key_ordered(e, queue_name)

    # The keys are walked over every row of the index (a key whose jobs all ended dead is
    # visited too; its head is then not a candidate), each step one ordered index probe.
    def next_key(after: Any, name: str) -> Any:
        e = t.alias(name).c
        return (
            sa.select(sa.func.min(e.concurrency_key))
            .where(*indexed(e), e.concurrency_key > after)
            .scalar_subquery()
        )

    start = sa.func.coalesce(sa.bindparam("after_key", type_=sa.Text), sa.literal(""))

    # Where the walk wraps to: the queue's smallest key. Probed forwards from the start of
    # the index, that is the one read that meets a drained key's dead entries: a burst of
    # 100,000 jobs drained in id order leaves them at the front of its key until VACUUM,
    # and stepping over them took 0.8 ms of a 6 ms claim once that key was the only one
    # left (every claim wraps then). So first one probe backwards from the walk's start,
    # which meets the live entries of the key before it first: when no key is smaller,
    # the start is the smallest key itself (or the queue has no keys left, and the walk
    # visits one empty key).
    def smallest(name: str) -> Any:
        e = t.alias(f"{name}_below").c
        below = (
            sa.select(sa.func.max(e.concurrency_key))
            .where(*indexed(e), e.concurrency_key < start)
            .scalar_subquery()
        )
        return sa.case(
            (start == sa.literal(""), sa.null()),
            (below.is_(None), start),
            else_=next_key(sa.literal(""), name),
        )

    first = next_key(start, "k_first")
    anchor = sa.select(
        sa.func.coalesce(first, smallest("k_wrap0")).label("k"),
        sa.literal(1).label("n"),
        first.is_(None).label("wrapped"),
    )
    walk = anchor.cte("walk", recursive=True)
    w = walk.alias("w")
    e = t.alias("k_next").c
    following = (
        sa.select(sa.func.min(e.concurrency_key).label("k"))
        .where(*indexed(e), e.concurrency_key > w.c.k)
        .lateral("following")
    )
    step = (
        sa.select(
            sa.case(
                (
                    sa.and_(following.c.k.is_(None), ~w.c.wrapped),
                    smallest("k_wrap"),
                ),
                else_=following.c.k,
            ).label("k"),
            (w.c.n + 1).label("n"),
            sa.or_(w.c.wrapped, following.c.k.is_(None)).label("wrapped"),
        )
        .select_from(w.join(following, sa.true()))
        .where(w.c.k.is_not(None), w.c.n < scan, ~sa.and_(w.c.wrapped, w.c.k > start))
    )
    walk = walk.union_all(step)
    visited = (
        sa.select(walk.c.k, walk.c.n)
        .where(walk.c.k.is_not(None), ~sa.and_(walk.c.wrapped, walk.c.k > start))
        .subquery("visited")
    )
    return walk, visited


def _fair_claim(t: sa.Table, *, for_session: bool = False) -> sa.Select[Any]:
    """The claim of a queue with ``fair=True``: the claim's jobs shared between the keys in
    turn, by weight, instead of the oldest first. No lock (fairness needs none): like the
    plain claim, one statement that skips the rows other claims hold (``SKIP LOCKED``).

    It walks up to ``:scan`` keys from where the worker's last claim stopped
    (:func:`_key_walk`), takes from each the first ``ceil(:limit / keys walked) * weight``
    ready jobs in id order, ranks each key's jobs (1, 2, ...), and claims ``:limit`` of
    them by ``(rank - 1) / weight``, then priority: every key its share, a key of weight 3
    three times that. Jobs without a key come from the first ``:limit`` ready jobs of the
    queue, as the plain claim reads them, as one more key of weight 1. Returns the claimed
    rows (whole rows ``for_session``), each with ``last_key``, or one row of NULL job
    columns when nothing was claimed."""
    c = t.c
    queue_name = sa.bindparam("queue_name", type_=sa.Text)
    limit = sa.bindparam("limit", type_=sa.Integer)
    scan = sa.bindparam("scan", type_=sa.Integer)
    walk, visited = _key_walk(t, queue_name, scan)
    weights = (
        sa.func.unnest(
            sa.bindparam("weight_keys", type_=ARRAY(sa.Text)),
            sa.bindparam("weight_values", type_=ARRAY(sa.Integer)),
        )
        .table_valued("key", "weight")
        .render_derived(name="weights")
    )
    keys = sa.select(
        visited.c.k,
        visited.c.n,
        sa.func.coalesce(
            sa.select(weights.c.weight).where(weights.c.key == visited.c.k).scalar_subquery(),
            1,
        ).label("weight"),
    ).subquery("keys")
    walked = sa.select(sa.func.count()).select_from(visited).scalar_subquery()
    share = sa.cast(
        sa.func.ceil(sa.cast(limit, sa.Float) / sa.func.greatest(walked, 1)), sa.Integer
    )
    r = t.alias("fair_pick").c
    # The floor: the key the worker's last claim took the most jobs from is read from past
    # the last of them (``:floor_key``, ``:floor_id``), not from its first entry in the
    # index. A key drained in id order keeps, ahead of its ready jobs, a dead entry per
    # claimed job (its ready version; two, with its running one, when running jobs were
    # in the index) until VACUUM: stepping over those was the largest part of what a
    # fair claim cost beyond the plain claim in a 100,000-job burst (0.9 of 6 ms). The
    # worker drops the floor every FAIR_FLOOR_FOR seconds, so that an older job of that
    # key ready again behind it (a retry, a handed-back claim) waits for no longer than
    # that.
    floor = sa.case(
        (
            keys.c.k == sa.bindparam("floor_key", type_=sa.Text),
            sa.bindparam("floor_id", type_=sa.BigInteger),
        ),
        else_=sa.literal(0, sa.BigInteger),
    )
    picks = (
        sa.select(r.id, r.priority, r.run_at)
        .where(
            *_key_ordered(r, queue_name),
            r.concurrency_key == keys.c.k,
            r.id > floor,
            r.status == status_literal(JobStatus.READY),
            r.run_at <= sa.func.now(),
        )
        .order_by(r.id)
        .limit(share * keys.c.weight)
        .with_for_update(skip_locked=True, key_share=True)
        .lateral("picks")
    )
    keyed = sa.select(
        picks.c.id,
        picks.c.priority,
        picks.c.run_at,
        keys.c.weight,
        sa.func.row_number().over(partition_by=keys.c.k, order_by=picks.c.id).label("rank"),
        keys.c.k.label("key"),
        keys.c.n.label("pos"),
    ).select_from(keys.join(picks, sa.true()))
    front = _front(t, queue_name, limit).cte("front")
    unkeyed = sa.select(
        front.c.id,
        front.c.priority,
        front.c.run_at,
        sa.literal(1).label("weight"),
        sa.func.row_number()
        .over(order_by=(front.c.priority.desc(), front.c.run_at, front.c.id))
        .label("rank"),
        sa.null().label("key"),
        sa.literal(0).label("pos"),
    ).where(front.c.concurrency_key.is_(None))
    both = sa.union_all(keyed, unkeyed).subquery("both")
    turn = (sa.cast(both.c.rank - 1, sa.Float) / both.c.weight).label("turn")
    # Ties (the keys' jobs of one turn: every pick, when the claim is smaller than the
    # keys walked) go by the walk's order, from after where the last claim stopped, so
    # that small claims take the keys in turn; by age only within one key.
    ranked = (
        sa.select(both.c.id, both.c.key, both.c.pos, turn)
        .order_by(turn, both.c.pos, both.c.priority.desc(), both.c.run_at, both.c.id)
        .limit(limit)
        .cte("ranked")
    )
    # The keyed picks were read locked (SKIP LOCKED: another claim's are passed over); the
    # few jobs without a key were read unlocked (locking the first :limit ready jobs of a
    # queue whose jobs nearly all have keys would lock them for nothing): lock the chosen
    # ones of those. Locking the keyed ones again, which this claim holds already, was a
    # tenth of a fair claim of 200 (a probe of the primary key and a lock check each).
    #
    # Both by ``id = ANY(ARRAY(...))``, probes of the primary key: as joins (``IN`` the
    # ranked ids, ``UPDATE ... FROM chosen``), PostgreSQL costed a claim of 200 as two
    # hash joins over sequential scans of the whole table, so the claim grew with the
    # table (9 ms at 20,000 jobs, most of it the two scans).
    mine = t.alias("mine").c
    unkeyed_ids = sa.select(ranked.c.id).where(ranked.c.key.is_(None)).scalar_subquery()
    unkeyed_locked = (
        sa.select(mine.id)
        .where(mine.id == sa.any_(sa.func.array(unkeyed_ids, type_=ARRAY(sa.BigInteger))))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("unkeyed_locked")
    )
    chosen = sa.union_all(
        sa.select(ranked.c.id).where(ranked.c.key.is_not(None)),
        sa.select(unkeyed_locked.c.id),
    ).cte("chosen")
    claimed = (
        sa.update(t)
        .where(c.id == sa.any_(_ids_of(chosen.c.id)), c.status == status_literal(JobStatus.READY))
        .values(
            status=JobStatus.RUNNING.value,
            attempts=c.attempts + 1,
            locked_until=sa.func.clock_timestamp() + sa.bindparam("lease", type_=sa.Interval),
            locked_by=sa.bindparam("worker"),
        )
        .returning(*(t.c if for_session else claimed_columns(t)))
        .cte("claimed")
    )
    # The next claim walks on from the last key this one took from (in the walk's order,
    # its last turn), or from where the walk stopped when it took from none.
    took = (
        sa.select(ranked.c.key)
        .where(ranked.c.key.is_not(None))
        .order_by(ranked.c.turn.desc(), ranked.c.pos.desc())
        .limit(1)
        .scalar_subquery()
    )
    walked_to = sa.select(walk.c.k).order_by(walk.c.n.desc()).limit(1).scalar_subquery()
    # The next claim's floor: the key this one took the most from, and the last id taken.
    most = (
        sa.select(ranked.c.key.label("key"), sa.func.max(ranked.c.id).label("id"))
        .where(ranked.c.key.is_not(None))
        .group_by(ranked.c.key)
        .order_by(sa.func.count().desc(), ranked.c.key)
        .limit(1)
        .subquery("most")
    )
    info = (
        sa.select(
            sa.func.coalesce(took, walked_to).label("last_key"),
            sa.select(most.c.key).scalar_subquery().label("floor_key"),
            sa.select(most.c.id).scalar_subquery().label("floor_id"),
        )
    ).subquery("info")
    names = [col.name for col in (t.c if for_session else claimed_columns(t))]
    return sa.select(
        *(claimed.c[name] for name in names),
        info.c.last_key,
        info.c.floor_key,
        info.c.floor_id,
    ).select_from(info.outerjoin(claimed, sa.true()))


def _ids_of(column: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``ARRAY(SELECT column ...)``: a CTE's ids as one array, for ``id = ANY(...)``."""
    return sa.func.array(sa.select(column).scalar_subquery(), type_=ARRAY(sa.BigInteger))


class LimitedClaimParams(ClaimParams):
    concurrency: int | None
    rate: int | None
    period: timedelta | None
    key_limit: int | None
    scan: int
    key_rate: int | None
    key_period: timedelta | None
    #: The queue's key_order is "fifo" (the statement is the fifo variant).
    fifo: bool
    #: With fifo: a dead or cancelled head holds its key.
    hold: bool
    #: With fifo: the key where the last claim's walk over the keys stopped (None: start).
    after_key: str | None
    #: Some task of the queue declares a concurrency_key (else its claim has no per-key
    #: parts: keyed jobs are refused there at enqueue).
    keyed: bool


def limited_claim_params(
    params: ClaimParams,
    *,
    concurrency: int | None,
    rate: int | None,
    period: float | None,
    key_limit: int | None,
    keyed: bool = True,
    key_rate: int | None = None,
    key_period: float | None = None,
    fifo: bool = False,
    hold: bool = True,
) -> LimitedClaimParams:
    """The plain claim's parameters and the queue's limits. ``scan``: how many ready rows
    the per-key choice looks at (in key order, how many keys it visits): for a keyed
    queue, twice the claim, so that a few keys holding several rows each at the head do
    not leave it short (the rows of keys already at their limit are skipped before it);
    for a queue without keys, ``limit``, as the plain claim, or one more than the queue's
    ``concurrency`` when that is smaller: the claim takes at most ``concurrency`` rows, and
    the one more tells that the limit held ready jobs back. A binding ``concurrency=64``
    claimed by a worker with room for 200 read and counted 200 rows for the 64 it could
    take (the count alone was a tenth of the claim's time on the server, ``EXPLAIN
    ANALYZE``; a limit of 5 read 200 rows for 5).

    Twice, not four times as before: the scan, its sort by key and its window were most
    of what a keyed claim cost beyond the plain one (a claim of 200 over 1,000 keys,
    alternating: 5.9-6.3 ms at twice against 7.8-9.3 at four times; the keyed drain 0.67
    and 0.81 of the unlimited one, against 0.57 and 0.66). What it gives up: a claim
    whose first rows hold more than two rows per key on average comes back smaller than
    asked, and the worker claims again for the rest."""
    limit = params["limit"]
    if keyed:
        scan = max(limit * 2, 64)
    elif concurrency is None:
        scan = limit
    else:
        scan = min(limit, concurrency + 1)
    return {
        **params,
        "concurrency": concurrency,
        "rate": rate,
        "period": None if period is None else interval(period),
        "key_limit": key_limit,
        "scan": scan,
        "key_rate": key_rate,
        "key_period": None if key_period is None else interval(key_period),
        "fifo": fifo,
        "hold": hold,
        "after_key": None,
        "keyed": keyed,
    }


def limited_statement(queries: Queries, params: LimitedClaimParams) -> Any:
    """The limited claim for these limits, with only the parts they use: the key-rated
    variant only for a queue with a ``key_rate``, the fifo one only for a queue with
    ``key_order="fifo"``, the rate log only with a ``rate``, the running count only with a
    ``concurrency``, the per-key parts only on a keyed queue (see :func:`_limited_claim`
    for why each is left out). Each shape is built once, when first asked for."""
    key_rated = params.get("key_rate") is not None
    rated = params.get("rate") is not None
    capped = params.get("concurrency") is not None
    fifo = bool(params.get("fifo"))
    keyed = params.get("keyed", True) or key_rated or fifo
    if rated and capped and keyed and fifo:
        return queries.fifo_claim(key_rated=key_rated)
    return queries.shaped_claim(
        key_rated=key_rated, fifo=fifo, rated=rated, capped=capped, keyed=keyed
    )


class FairClaimParams(ClaimParams):
    scan: int
    after_key: str | None
    weight_keys: list[str]
    weight_values: list[int]
    #: Where the key the last claim took most from is read from (see ``_fair_claim``).
    floor_key: str | None
    floor_id: int | None


def fair_claim_params(
    params: ClaimParams,
    limits: QueueLimits,
    after_key: str | None,
    *,
    scan: int | None = None,
    floor: tuple[str, int] | None = None,
) -> FairClaimParams:
    """The fair claim's parameters: the plain claim's, how many keys it walks (``scan``:
    four times the claim, at least 64), from where, the queue's weights, and the floor of
    its busiest key (the last claim's, or None: every key read from its start)."""
    return {
        **params,
        "scan": scan if scan is not None else max(params["limit"] * 4, 64),
        "after_key": after_key,
        "weight_keys": [key for key, _ in limits.weights],
        "weight_values": [weight for _, weight in limits.weights],
        "floor_key": floor[0] if floor else None,
        "floor_id": floor[1] if floor else None,
    }


def queue_claim_params(params: ClaimParams, limits: QueueLimits) -> LimitedClaimParams:
    """:func:`limited_claim_params` for a declared queue: its limits, as the worker's
    fetcher and ``session.claim`` both ask them."""
    return limited_claim_params(
        params,
        concurrency=limits.concurrency,
        rate=limits.rate,
        period=limits.rate_period,
        key_limit=limits.key_concurrency,
        keyed=limits.keyed,
        key_rate=limits.key_rate,
        key_period=limits.key_rate_period,
        fifo=limits.key_order == "fifo",
        hold=limits.on_head_failure == "hold",
    )


# -- outcomes -----------------------------------------------------------------------------


# Complete a batch: one statement for many jobs, each row still guarded by its own
# (id, attempts). Finished jobs are deleted, or kept as 'done' for retention.
# ``childless``: the worker's autocommit completion, which leaves a job that has children
# running (a child enqueued while it ran: its claimed meta did not say so, and the
# enqueue, which locks its parents, has committed or is re-checked here after it does);
# the worker completes those with their release, in one transaction (write_outcomes).
def _complete(t: sa.Table, *, keep_done: bool, childless: bool = False) -> sa.Executable:
    batch = _batch()
    where = [guarded(t, batch)]
    if childless:
        where.append(sa.not_(_has_children(t)))
    if keep_done:
        return (
            sa.update(t)
            .where(*where)
            .values(status=JobStatus.DONE.value, locked_until=None, finished_at=sa.func.now())
            .returning(t.c.id, _has_children(t))
        )
    return sa.delete(t).where(*where).returning(t.c.id, _has_children(t))


def _has_children(t: sa.Table) -> sa.ColumnElement[bool]:
    """``meta ? 'sqla_jobs.children'``: jobs were enqueued ``after`` this one. Returned by
    every completion, so that a parent whose child was enqueued while it ran (after its
    claim) still releases it."""
    return sa.func.coalesce(
        t.c.meta.op("?", return_type=sa.Boolean)(sa.literal_column(f"'{CHILDREN_KEY}'")),
        sa.false(),
    ).label("has_children")


# Complete jobs that keep their result or have dependent jobs ("flow" jobs, told apart by
# the worker from the claimed meta): kept as 'done' with their result, locked_until the
# end of its retention (pruning reads it), and their ids announced on the results
# channel (NOTIFY, at commit) for Jobs.result. Jobs that keep nothing never come here.
def _complete_flow(t: sa.Table, results_channel: str) -> sa.Select[Any]:
    batch = (
        sa.func.unnest(
            _int_array("ids", sa.BigInteger),
            _int_array("attempt_list", sa.Integer),
            sa.bindparam("result_list", type_=ARRAY(sa.Text)),
            sa.bindparam("keep_list", type_=ARRAY(sa.Float)),
        )
        .table_valued("id", "attempts", "result", "keep")
        .render_derived(name="batch")
    )
    done = (
        sa.update(t)
        .where(guarded(t, batch))
        .values(
            status=JobStatus.DONE.value,
            result=sa.cast(batch.c.result, JSONB),
            locked_until=sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, batch.c.keep),
            finished_at=sa.func.now(),
        )
        .returning(t.c.id, _has_children(t))
        .cte("done")
    )
    return sa.select(
        done.c.id,
        done.c.has_children,
        sa.func.pg_notify(sa.literal(results_channel), sa.cast(done.c.id, sa.Text)),
    )


class FlowParams(BatchParams):
    result_list: list[str | None]
    keep_list: list[float]


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
        .returning(c.id, c.status, _has_children(t))
    )


# A flow job's failure: the same guarded UPDATE, and a dead one announced on the results
# channel (Jobs.result raises its error).
def _fail_flow(t: sa.Table, results_channel: str) -> sa.Select[Any]:
    failed = _fail(t).cte("failed")
    dead = failed.c.status == status_literal(JobStatus.DEAD)
    note = sa.func.pg_notify(sa.literal(results_channel), sa.cast(failed.c.id, sa.Text))
    return sa.select(
        failed.c.id, failed.c.status, failed.c.has_children, sa.case((dead, note), else_=None)
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
            # Why, where the worker says (a task it does not know); else as it was.
            last_error=sa.func.coalesce(sa.bindparam("error", None, type_=sa.Text), c.last_error),
        )
        .returning(c.id)
    )


class SnoozeParams(TypedDict):
    job_id: int
    attempt: int
    delay: timedelta
    progress: str | None
    error: str | None


def snooze_params(
    claim: Claim, delay: float, progress: str | None = None, error: str | None = None
) -> SnoozeParams:
    return {
        "job_id": claim.id,
        "attempt": claim.attempts,
        "delay": interval(delay),
        "progress": progress,
        "error": error,
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
#
# A row another transaction holds locked is skipped, not waited for, and comes back as
# still held if it was so when the statement began: renewed at a later beat, or found lost
# then. Waiting for it (a maintenance pass of a worker paused in its rescue, an operator's
# open transaction) stalled the whole beat, so every other lease of the worker lapsed
# too, and a job it was running was rescued and run again beside itself. A skipped row's
# progress note waits for the next one.
def _heartbeat(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    batch = (
        sa.func.unnest(
            _int_array("ids", sa.BigInteger),
            _int_array("attempt_list", sa.Integer),
            sa.bindparam("progress_list", None, type_=ARRAY(sa.Text)),
        )
        .table_valued("id", "attempts", "progress")
        .render_derived(name="batch")
    )
    held = sa.select(c.id, c.attempts).where(guarded(t, batch)).cte("held")
    free = (
        sa.select(c.id)
        .where(guarded(t, batch))
        .with_for_update(of=t, skip_locked=True, key_share=True)
        .cte("free")
    )
    renewed = (
        sa.update(t)
        .where(guarded(t, batch), c.id.in_(sa.select(free.c.id)))
        .values(
            locked_until=sa.func.clock_timestamp() + sa.bindparam("lease", type_=sa.Interval),
            progress=_latest_progress(c, batch.c.progress),
        )
        .cte("renewed")
    )
    return sa.select(held.c.id, held.c.attempts).add_cte(renewed)


# A transactional run's fence (worker._driver.Fence), its first statement, before the
# handler: lock this claim's row until the run commits or rolls back, when the run's
# transaction reads from one snapshot (REPEATABLE READ or SERIALIZABLE, by the engine or
# the database's default). Its completion, an UPDATE or DELETE of that row in the
# handler's snapshot, otherwise met the heartbeat's renewal committed since ("could not
# serialize access due to concurrent update") and failed, every attempt of a handler
# that outlived a beat. Locked, the row is skipped by the heartbeat and the rescue
# (SKIP LOCKED): nothing changes it until the run ends. Under READ COMMITTED the
# completion reads the latest row anyway: nothing is locked (a one-time filter), and the
# heartbeat goes on renewing the lease. Returns, if it locked the row, who holds it: the
# backend and its transaction's start (the worker ends that transaction from another
# connection, :data:`_release_run`, when the run is stopped while its handler holds on).
def _lock_run(t: sa.Table) -> sa.Select[Any]:
    snapshot = sa.func.current_setting("transaction_isolation").in_(
        ["repeatable read", "serializable"]
    )
    return (
        sa.select(t.c.id, sa.func.pg_backend_pid().label("pid"), sa.func.now().label("began"))
        .where(_one_claim(t), snapshot)
        .with_for_update(of=t, key_share=True)
    )


# End the transaction of a stopped transactional run that holds its job's row locked (see
# _lock_run) while its handler, a thread nobody can stop, runs on past its timeout or the
# grace period: its writes are to roll back anyway, and the worker's write of the job's
# failure, or its hand back, would wait on the lock, stalling every outcome behind it.
# Only that backend in that same transaction: the connection may be serving another run.
_release_run = (
    sa.select(sa.func.pg_terminate_backend(sa.column("pid")))
    .select_from(sa.table("pg_stat_activity", sa.column("pid"), sa.column("xact_start")))
    .where(
        sa.column("pid") == sa.bindparam("pid", type_=sa.Integer),
        sa.column("xact_start") == sa.bindparam("began", type_=sa.DateTime(timezone=True)),
    )
)


class LockRunParams(TypedDict):
    job_id: int
    attempt: int


def lock_run_params(claim: Claim) -> LockRunParams:
    return {"job_id": claim.id, "attempt": claim.attempts}


class HeartbeatParams(BatchParams):
    lease: timedelta
    progress_list: list[str | None]


def heartbeat_params(
    claims: Iterable[Claim], lease: timedelta, progress: Iterable[str | None] | None = None
) -> HeartbeatParams:
    held = list(claims)
    notes: list[str | None] = list(progress) if progress is not None else [None] * len(held)
    # In id order, as batch_params (see there), each note with its claim.
    pairs = sorted(zip(held, notes, strict=True), key=lambda pair: pair[0].id)
    return {
        "ids": [claim.id for claim, _ in pairs],
        "attempt_list": [claim.attempts for claim, _ in pairs],
        "lease": lease,
        "progress_list": [note for _, note in pairs],
    }


# -- maintenance --------------------------------------------------------------------------


def _notify_queues(channel: str, changed: CTE) -> sa.Select[Any]:
    """Wrap a data-modifying CTE that returns ``queue`` (and maybe ``status``) in one
    NOTIFY per distinct queue that has ready jobs now; each row also names its queue, for
    a worker that does not listen (see ``WorkerCore._maintain``)."""
    wake = sa.select(changed.c.queue).distinct()
    if "status" in changed.c:
        wake = wake.where(changed.c.status == status_literal(JobStatus.READY))
    sub = wake.subquery("q")
    return sa.select(sa.func.pg_notify(sa.literal(channel), sub.c.queue), sub.c.queue)


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
        .where(c.id == sa.any_(_ids_of(due.c.id)))  # a probe per row, as the claim
        .values(status=JobStatus.READY.value)
        .returning(c.queue)
        .cte("promoted")
    )
    return _notify_queues(channel, promoted)


# Rescue jobs whose lease has passed, through <table>_running: their worker died or hung.
# Ready again (the next claim counts the attempt), or dead if none are left (announced
# to the waiters of a kept result).
def _rescue(t: sa.Table, channel: str, results_channel: str) -> sa.Select[Any]:
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
        .where(c.id == sa.any_(_ids_of(expired.c.id)))  # a probe per row, as the claim
        .values(
            status=sa.case((out_of_attempts, JobStatus.DEAD.value), else_=JobStatus.READY.value),
            finished_at=sa.case((out_of_attempts, sa.func.now()), else_=None),
            locked_until=None,
            last_error=LEASE_EXPIRED,
        )
        .returning(c.queue, c.status, announce_end(c, results_channel, out_of_attempts))
        .cte("rescued")
    )
    return _notify_queues(channel, rescued)


# Seconds until the earliest scheduled job is due, through <table>_scheduled, so an idle
# worker can sleep exactly until then (NULL when nothing is scheduled). Only times Python
# holds: a row at 'infinity' (written by SQL) is never due, and one at '-infinity' is
# promoted anyway; before PostgreSQL 17 subtracting them raised, and every maintenance
# pass of every worker failed (no claim followed). Only the queues in :queues (the
# worker's own, unpaused): a run_until_empty(wait_scheduled=...) waited for the scheduled
# jobs of every queue of the table, and an idle worker woke for each of them.
def _next_due(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return sa.select(sa.func.extract("epoch", sa.func.min(c.run_at) - sa.func.now())).where(
        c.status == status_literal(JobStatus.SCHEDULED),
        c.run_at.between(_READABLE_FROM, _READABLE_UNTIL),
        c.queue == sa.any_(sa.bindparam("queues", type_=ARRAY(sa.Text))),
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
# Small batches keep each transaction (and its locks) short. A dead or cancelled parent
# whose children were not settled yet ({"sqla_jobs.children": true}: rescued dead by its
# lease) is left for the pass that settles it (settle_unsettled, a batch at a time): once
# deleted, its children would wait for it for ever. A job cancelled while it ran keeps
# its lease while its handler may run on: left until it passes (keep_dead shorter than a
# lease), as an operator's purge leaves it, so that it holds its key (key_order) till then.
def _prune(t: sa.Table, statuses: Sequence[JobStatus]) -> sa.Delete:
    c = t.c
    old = (
        sa.select(c.id)
        .where(
            c.status.in_([status_literal(s) for s in statuses]),
            c.finished_at < sa.func.now() - sa.bindparam("age", type_=sa.Interval),
            sa.not_(sa.func.coalesce(_unsettled(c), sa.false())),
            sa.or_(c.locked_until.is_(None), c.locked_until <= sa.func.now()),
        )
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)
        .cte("old_jobs")
    )
    return sa.delete(t).where(c.id == sa.any_(_ids_of(old.c.id)))  # a probe per row


# Retention of done jobs: as _prune, except a row whose kept result (locked_until, set by
# _complete_flow) has not yet expired.
def _prune_done(t: sa.Table) -> sa.Delete:
    c = t.c
    old = (
        sa.select(c.id)
        .where(
            c.status == status_literal(JobStatus.DONE),
            c.finished_at < sa.func.now() - sa.bindparam("age", type_=sa.Interval),
            sa.or_(c.locked_until.is_(None), c.locked_until < sa.func.now()),
        )
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)
        .cte("old_jobs")
    )
    return sa.delete(t).where(c.id == sa.any_(_ids_of(old.c.id)))  # a probe per row


# -- workflows ----------------------------------------------------------------------------


def _parent_count(c: Any) -> sa.ColumnElement[int]:
    """How many of the row's parents are among ``:parent_ids`` (a child may have several
    parents in one batch), each counted once: a group's callback lists a member given
    twice (one unique job) twice, for a result per member, and waits for it once."""
    each = sa.func.unnest(c.parents).table_valued("pid").render_derived(name="p")
    return (
        sa.select(sa.func.count(sa.distinct(each.c.pid)))
        .select_from(each)
        .where(each.c.pid == sa.func.any(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))))
        .scalar_subquery()
    )


# Lock the children still waiting on these parents, through <table>_parents (&&), in id
# order (two releases sharing children take them in one order, so neither deadlocks the
# other), with the lock the release's UPDATE takes anyway (FOR NO KEY UPDATE). Run before
# every statement that reads the parents' rows to settle a child (_release reads their
# results): a sibling parent's completion holds the same child's lock until it commits,
# so the statements after this one (READ COMMITTED: each takes its snapshot when it
# starts) see that sibling done, with its result. One statement cannot do both: an UPDATE
# that waits for a child's row lock re-reads only that row, and reads every other row (the
# sibling's result) as its snapshot, taken before the wait, had it.
def _lock_children(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return (
        sa.select(c.id)
        .where(
            c.parents.overlap(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))),
            c.status == _SCHEDULED_VIA_PK,
            c.waiting > 0,
        )
        .order_by(c.id)
        .with_for_update(key_share=True)
    )


# Release children (:child_ids, as _lock_children returned them): these parents
# (:parent_ids) succeeded (or, for children that run anyway, ended). Run as its own
# statement in the completion's transaction, after it and after _lock_children: its
# snapshot is taken once the completion holds the parents' row locks, so it sees every
# child committed before (a child enqueued while its parent ran holds that parent's lock
# until it commits), and once the children are locked, so it sees every sibling parent
# that completed before (see _lock_children). Each child is
# decremented by how many of its parents are in the batch; of two sibling parents
# completing at once, the second takes the child's lock after the first committed and
# sees its decrement, so exactly one of them sees waiting reach 0. A child reaching 0
# becomes ready now (its queue woken at commit); a group callback gets its parents'
# results, in the order of its parents, in the argument named by meta->'sqla_jobs.results'.
# A callback whose results jsonb cannot hold (more than JSONB_MAX_BYTES in one array) is
# dead instead, saying why: the array's build failed the whole completion (SQLSTATE 54000),
# for as long as it was retried. Rows: (NOTIFY, queue, None) per woken queue, then
# (None, None, id) per callback made dead, whose own children the caller settles.
def _release(t: sa.Table, channel: str, results_channel: str) -> sa.Select[Any]:
    c = t.c
    left = c.waiting - _parent_count(c)
    free = left <= 0
    oversized = _oversized(t)
    # Left to right, stopping at the first false: the sizes are read for a group callback
    # that becomes ready now, and for nothing else.
    too_big = sa.and_(free, _has_key(c, RESULTS_KEY), c.id.in_(sa.select(oversized.c.id)))
    size = sa.select(oversized.c.size).where(oversized.c.id == c.id).scalar_subquery()
    reason = sa.func.concat(
        "dead: the results of the jobs of its group (jobs.group) take about ",
        size,
        " bytes as jsonb, more than one jsonb value holds "
        f"({JSONB_MAX_BYTES:,}); a member returns a reference to bulky data (a storage "
        "key, an id), not the data",
    )
    released = (
        sa.update(t)
        .where(
            # The children _lock_children found and locked, by primary key.
            c.id == sa.func.any(sa.bindparam("child_ids", type_=ARRAY(sa.BigInteger))),
            c.status == _SCHEDULED_VIA_PK,
            c.waiting > 0,
        )
        .values(
            waiting=sa.func.greatest(left, 0),
            status=sa.case(
                (too_big, JobStatus.DEAD.value), (free, JobStatus.READY.value), else_=c.status
            ),
            run_at=sa.case((free, sa.func.now()), else_=c.run_at),
            finished_at=sa.case((too_big, sa.func.now()), else_=c.finished_at),
            last_error=sa.case((too_big, reason), else_=c.last_error),
            args=_with_results(t, sa.and_(free, sa.not_(too_big))),
        )
        .returning(
            c.id,
            c.queue,
            c.status,
            announce_end(c, results_channel, c.status == status_literal(JobStatus.DEAD)),
        )
        .cte("released")
    )
    ready = (
        sa.select(released.c.queue)
        .where(released.c.status == status_literal(JobStatus.READY))
        .distinct()
        .subquery("q")
    )
    woken = sa.select(
        sa.func.pg_notify(sa.literal(channel), ready.c.queue), ready.c.queue, sa.null()
    )
    dead = sa.select(sa.null(), sa.null(), released.c.id).where(
        released.c.status == status_literal(JobStatus.DEAD)
    )
    return sa.select(sa.union_all(woken, dead).subquery("released_rows"))


def _oversized(t: sa.Table) -> CTE:
    """The group callbacks among ``:child_ids`` that these parents free, whose results
    would take more than :data:`JSONB_MAX_BYTES` as one jsonb array, and that size. Each
    result is measured as stored, uncompressed: ``(ARRAY[result])[1]`` is the value
    detoasted (``pg_column_size`` of the column itself is its compressed size), one at a
    time; 8 bytes more a member for the array's entry and padding, and the callback's
    own arguments, which the array joins."""
    k = t.alias("child")
    each = sa.func.unnest(k.c.parents).table_valued("pid").render_derived(name="m")
    member = t.alias("member")
    results = (
        sa.select(
            sa.func.coalesce(sa.func.sum(sa.func.pg_column_size(pg_array([member.c.result])[1])), 0)
            + 8 * sa.func.count()
        )
        .select_from(each.outerjoin(member, member.c.id == each.c.pid))
        .scalar_subquery()
    )
    size = (results + sa.func.pg_column_size(pg_array([k.c.args])[1]) + 64).label("size")
    sized = (
        sa.select(k.c.id, size)
        .where(
            k.c.id == sa.func.any(sa.bindparam("child_ids", type_=ARRAY(sa.BigInteger))),
            k.c.status == _SCHEDULED_VIA_PK,
            k.c.waiting > 0,
            _has_key(k.c, RESULTS_KEY),
            k.c.waiting - _parent_count(k.c) <= 0,
        )
        .subquery("sized")
    )
    return (
        sa.select(sized.c.id, sized.c.size).where(sized.c.size > JSONB_MAX_BYTES).cte("oversized")
    )


def _with_results(t: sa.Table, free: sa.ColumnElement[bool]) -> sa.ColumnElement[Any]:
    """The row's ``args``, with (once ``free``, for a group callback) its parents' results,
    in the order of ``parents`` (null for a parent that kept none, or is gone), in the
    argument named by ``meta->'sqla_jobs.results'``."""
    c = t.c
    each = (
        sa.func.unnest(c.parents).table_valued("pid", with_ordinality="n").render_derived(name="u")
    )
    p = t.alias("parent")
    results = (
        sa.select(
            sa.func.coalesce(
                sa.func.jsonb_agg(sa.text("parent.result ORDER BY u.n")), sa.text("'[]'")
            )
        )
        .select_from(each.outerjoin(p, p.c.id == each.c.pid))
        .scalar_subquery()
    )
    wants = c.meta.op("->>", return_type=sa.Text)(sa.literal_column(f"'{RESULTS_KEY}'"))
    return sa.case(
        (
            sa.and_(free, wants.is_not(None)),
            c.args.op("||", return_type=JSONB)(sa.func.jsonb_build_object(wants, results)),
        ),
        else_=c.args,
    )


_SCHEDULED_VIA_PK = sa.select(status_literal(JobStatus.SCHEDULED)).scalar_subquery()


# Cancel what waits on jobs that ended dead or cancelled: their waiting children, and
# theirs, down the chain (a recursive walk through <table>_parents), except children
# enqueued with on_parent_failure="run" (released by _release instead, with what waits on
# them left waiting). Returns the ids cancelled, each announced on the results channel.
def _cancel_children(t: sa.Table, results_channel: str) -> sa.Select[Any]:
    c = t.c
    cancels = sa.and_(
        c.status == _SCHEDULED_VIA_PK,
        c.waiting > 0,
        sa.not_(
            sa.func.coalesce(
                c.meta.op("?", return_type=sa.Boolean)(sa.literal_column(f"'{RUN_ANYWAY_KEY}'")),
                sa.false(),
            )
        ),
    )
    first = sa.select(c.id).where(
        c.parents.overlap(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))), cancels
    )
    doomed = first.cte("doomed", recursive=True)
    child = t.alias("child")
    cc = child.c
    doomed = doomed.union(
        sa.select(cc.id)
        .select_from(child.join(doomed, cc.parents.overlap(pg_array([doomed.c.id]))))
        .where(
            cc.status == _SCHEDULED_VIA_PK,
            cc.waiting > 0,
            sa.not_(
                sa.func.coalesce(
                    cc.meta.op("?", return_type=sa.Boolean)(
                        sa.literal_column(f"'{RUN_ANYWAY_KEY}'")
                    ),
                    sa.false(),
                )
            ),
        )
    )
    cancelled = (
        sa.update(t)
        .where(c.id.in_(sa.select(doomed.c.id)), c.status == _SCHEDULED_VIA_PK)
        .values(
            status=JobStatus.CANCELLED.value,
            finished_at=sa.func.now(),
            last_error=sa.bindparam("reason", type_=sa.Text),
            meta=_marked(
                sa.case((_has_children(t), _settled(c)), else_=c.meta),
                _agg_parents(c, lambda p: sa.or_(_in_ids(p), p.in_(sa.select(doomed.c.id)))),
            ),
        )
        .returning(c.id)
        .cte("cancelled")
    )
    # The ended parents are settled: the retention pass's sweep (_unsettled_parents) must
    # not settle them again (a child that runs anyway would be counted down twice).
    settled = (
        sa.update(t)
        .where(
            c.id == sa.func.any(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))),
            _has_children(t),
        )
        .values(meta=_settled(c))
        .cte("settled")
    )
    return sa.select(
        cancelled.c.id,
        sa.func.pg_notify(sa.literal(results_channel), sa.cast(cancelled.c.id, sa.Text)),
    ).add_cte(settled)


def _settled(c: Any) -> sa.ColumnElement[Any]:
    settled: sa.ColumnElement[Any] = c.meta.op("||", return_type=JSONB)(
        sa.text(f"""'{{"{CHILDREN_KEY}": false}}'::jsonb""")
    )
    return settled


def _marked(meta: Any, parents: sa.ColumnElement[Any]) -> sa.ColumnElement[Any]:
    """``meta`` of a child cancelled because a parent ended: marked so, for the retry of
    that parent to bring it back (see rearm_children), with the ids of the ``parents``
    that ended (a jsonb array).

    The ids, not ``true`` (the mark before): a retry skips the child while one of them is
    dead or cancelled, and it must still once that parent's row is gone (pruned after
    ``keep_dead``, purged by an operator). By the row alone a missing parent cannot be
    told from one that succeeded and was deleted, and the child ran, though the parent it
    waited for never succeeded (see :func:`blocked_by_parent`)."""
    marked: sa.ColumnElement[Any] = sa.func.coalesce(meta, sa.text("'{}'::jsonb")).op(
        "||", return_type=JSONB
    )(sa.func.jsonb_build_object(sa.literal_column(f"'{CANCELLED_BY_PARENT_KEY}'"), parents))
    return marked


def _each_parent(c: Any) -> sa.ColumnElement[Any]:
    """``unnest(parents)``, one id a row (in a subquery correlated to the child)."""
    each: sa.ColumnElement[Any] = sa.func.unnest(c.parents).column_valued("parent_id")
    return each


def _in_ids(value: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    return value == sa.any_(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger)))


def _agg_parents(
    c: Any, which: Callable[[sa.ColumnElement[Any]], sa.ColumnElement[bool]]
) -> sa.ColumnElement[Any]:
    """The row's parents that are ``which(id)``, as a jsonb array of ids (``[]`` for none)."""
    each = _each_parent(c)
    agg: sa.ColumnElement[Any] = (
        sa.select(sa.func.coalesce(sa.func.jsonb_agg(each), sa.text("'[]'::jsonb")))
        .where(which(each))
        .scalar_subquery()
    )
    return agg


def _recorded(c: Any) -> sa.ColumnElement[Any]:
    """The ids of the parents whose end cancelled the row (see :func:`_marked`), as a
    jsonb array; ``[]`` for a row marked ``true`` (before the ids were recorded), read as
    before: held back only by a parent that still exists."""
    mark = c.meta.op("->", return_type=JSONB)(sa.literal_column(f"'{CANCELLED_BY_PARENT_KEY}'"))
    recorded: sa.ColumnElement[Any] = sa.case(
        (sa.func.jsonb_typeof(mark) == "array", mark), else_=sa.text("'[]'::jsonb")
    )
    return recorded


# A child already cancelled because a parent ended (not waiting: _cancel_children leaves
# it) whose other parents end too: their ids join its record, or it came back once those
# were pruned or purged (see _marked). Run after _cancel_children, in a statement of its
# own: one whose snapshot was taken before a concurrent settling cancelled the child
# (waiting for its row lock) skips it there, and sees it cancelled here.
def _record_ended_parents(t: sa.Table) -> sa.Update:
    c = t.c
    new = _agg_parents(
        c,
        lambda p: sa.and_(
            _in_ids(p), ~_recorded(c).op("@>", return_type=sa.Boolean)(sa.func.to_jsonb(p))
        ),
    )
    return (
        sa.update(t)
        .where(_parents_match(t), cancelled_by_parent(t), sa.func.jsonb_array_length(new) > 0)
        .values(
            meta=c.meta.op("||", return_type=JSONB)(
                sa.func.jsonb_build_object(
                    sa.literal_column(f"'{CANCELLED_BY_PARENT_KEY}'"),
                    _recorded(c).op("||", return_type=JSONB)(new),
                )
            )
        )
    )


# Retried parents leave the records of the children they cancelled that stay cancelled
# (another parent is still dead or cancelled): one of them that then succeeds and is
# deleted must not hold the child back for ever as a parent that ended and is gone.
def _forget_parents(t: sa.Table) -> sa.Update:
    c = t.c
    element = sa.func.jsonb_array_elements(_recorded(c)).column_valued("recorded")
    kept = (
        sa.select(sa.func.coalesce(sa.func.jsonb_agg(element), sa.text("'[]'::jsonb")))
        .where(~_in_ids(sa.cast(sa.cast(element, sa.Text), sa.BigInteger)))
        .scalar_subquery()
    )
    return (
        sa.update(t)
        .where(
            _parents_match(t),
            cancelled_by_parent(t),
            sa.func.jsonb_typeof(
                c.meta.op("->", return_type=JSONB)(
                    sa.literal_column(f"'{CANCELLED_BY_PARENT_KEY}'")
                )
            )
            == "array",
        )
        .values(
            meta=c.meta.op("||", return_type=JSONB)(
                sa.func.jsonb_build_object(sa.literal_column(f"'{CANCELLED_BY_PARENT_KEY}'"), kept)
            )
        )
    )


def announce_end(
    c: Any, results_channel: str, ended: sa.ColumnElement[bool] | None = None
) -> sa.ColumnElement[Any]:
    """A RETURNING column that announces, on the results channel, a row that keeps its
    result (its ``meta`` says so) and has ``ended``: NULL for other rows, which nobody
    waits on (:meth:`Jobs.result` refuses them at its first look).

    For the ways a job ends outside the worker's own completion (an operator's cancel,
    a lease that ran out on the last attempt): without it a waiter learned of the end
    only at its next re-check, up to 5 seconds later. NOTIFY is sent at commit."""
    keeps = _has_key(c, KEEP_KEY)
    note = sa.func.pg_notify(sa.literal(results_channel), sa.cast(c.id, sa.Text))
    return sa.case((keeps if ended is None else sa.and_(ended, keeps), note), else_=None)


def _has_key(c: Any, key: str) -> sa.ColumnElement[bool]:
    """``meta ? key``, false for a row without meta."""
    return sa.func.coalesce(
        c.meta.op("?", return_type=sa.Boolean)(sa.literal_column(f"'{key}'")), sa.false()
    )


def _meta_says(c: Any, key: str, value: bool) -> sa.ColumnElement[bool]:
    """``meta @> {key: value}``, through <table>_meta (jsonb_path_ops)."""
    says: sa.ColumnElement[bool] = c.meta.op("@>", return_type=sa.Boolean)(_json({key: value}))
    return says


# Link a new job to its parents (enqueue with after=): mark each parent as having
# children (meta), which also locks it until the enqueue commits, so that a completion
# racing with the enqueue waits for it and then sees the child; returns each parent's
# status to count the ones still to succeed. A parent that already ended dead or
# cancelled is not marked to be settled (link() settles the child itself: a second
# settling by the retention pass would count a child that runs anyway down twice); it
# is marked settled if it had no children, so that retrying it brings this child back.
# ``unsettled``: an ended parent the retention pass has yet to settle (it died by its
# lease), which will count its children that run anyway down then.
def _mark_parents(t: sa.Table) -> sa.Update:
    c = t.c
    meta = sa.func.coalesce(c.meta, sa.text("'{}'::jsonb"))
    ended = _ended(t)
    return (
        sa.update(t)
        .where(c.id == sa.func.any(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))))
        .values(
            meta=sa.case(
                (sa.and_(ended, _has_key(c, CHILDREN_KEY)), c.meta),
                (ended, meta.op("||", return_type=JSONB)(_json({CHILDREN_KEY: False}))),
                else_=meta.op("||", return_type=JSONB)(_json({CHILDREN_KEY: True})),
            )
        )
        .returning(c.id, c.status, _meta_says(c, CHILDREN_KEY, True).label("unsettled"))
    )


def _json(value: dict[str, Any]) -> sa.TextClause:
    """A constant jsonb literal (the library's own keys and values, never user input)."""
    return sa.text("'" + json.dumps(value).replace("'", "''") + "'::jsonb")


def _ended_of_ids(t: sa.Table) -> sa.ScalarSelect[Any]:
    """The ids among ``:parent_ids`` of the jobs dead or cancelled, as a jsonb array: what
    cancels a child linked to them (recorded by :func:`_marked`)."""
    up = t.alias("ended_parent")
    return (
        sa.select(sa.func.coalesce(sa.func.jsonb_agg(up.c.id), sa.text("'[]'::jsonb")))
        .where(_in_ids(up.c.id), _ended(up))
        .scalar_subquery()
    )


# Then the child: its parents, how many it waits for, and its status: held (scheduled in
# the year 9999, which the promoter never reaches; not 'infinity', which Python cannot
# read), ready at once, or cancelled.
def _link_child(t: sa.Table, channel: str) -> sa.Update:
    """A child ready at once (its parents have all succeeded) is notified as the INSERT
    trigger would have (it fired while the row was still ``scheduled``): a sleeping worker
    slept on to its next poll interval."""
    c = t.c
    waiting = sa.bindparam("waiting", type_=sa.Integer)
    status = sa.bindparam("child_status", type_=sa.Text)
    return (
        sa.update(t)
        .where(c.id == sa.bindparam("child_id"))
        .values(
            parents=sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger)),
            waiting=waiting,
            status=status,
            run_at=sa.case(
                (waiting > 0, sa.literal_column("'9999-01-01 00:00:00+00'::timestamptz")),
                else_=sa.func.now(),
            ),
            finished_at=sa.case((status == JobStatus.CANCELLED.value, sa.func.now()), else_=None),
            last_error=sa.bindparam("reason", type_=sa.Text),
            meta=sa.case(
                (status == JobStatus.CANCELLED.value, _marked(c.meta, _ended_of_ids(t))),
                else_=c.meta,
            ),
        )
        .returning(
            sa.case(
                (
                    c.status == status_literal(JobStatus.READY),
                    sa.func.pg_notify(sa.literal(channel), c.queue),
                ),
                else_=sa.null(),
            )
        )
    )


# The retention pass's safety net for workflows: dead or cancelled parents whose
# children were never settled (a parent that died by its lease: the rescue marks jobs dead
# in bulk, and does not look for children), through <table>_meta (jsonb_path_ops serves
# @>). Settling marks a parent {"sqla_jobs.children": false} (see _cancel_children).
def _unsettled(c: Any) -> sa.ColumnElement[bool]:
    """A parent whose children are not settled yet (``meta @> {"sqla_jobs.children":
    true}``; NULL where ``meta`` is)."""
    unsettled: sa.ColumnElement[bool] = c.meta.op("@>", return_type=sa.Boolean)(
        sa.text(f"""'{{"{CHILDREN_KEY}": true}}'::jsonb""")
    )
    return unsettled


def _unsettled_parents(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return (
        sa.select(c.id)
        .where(
            _unsettled(c),
            c.status.in_([status_literal(JobStatus.DEAD), status_literal(JobStatus.CANCELLED)]),
        )
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)
    )


# -- retrying a parent: what it cancelled comes back --------------------------------------


def _ended(t: Any) -> sa.ColumnElement[bool]:
    ended: sa.ColumnElement[bool] = t.c.status.in_(
        [status_literal(JobStatus.DEAD), status_literal(JobStatus.CANCELLED)]
    )
    return ended


_LIVE = [status_literal(s) for s in LIVE_STATUSES]


def _parents_match(t: sa.Table) -> sa.ColumnElement[bool]:
    """``parents && :parent_ids``: children of these jobs, through <table>_parents."""
    match: sa.ColumnElement[bool] = t.c.parents.overlap(
        sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))
    )
    return match


def ended_parent(t: sa.Table) -> sa.Exists:
    """Whether one of the row's parents is dead or cancelled (by primary key)."""
    up = t.alias("ended_parent")
    return sa.exists().where(up.c.id == sa.any_(t.c.parents), _ended(up))


def _gone_parent(t: sa.Table) -> sa.ScalarSelect[Any]:
    """The first id (as text) the row's cancel recorded (see :func:`_marked`) whose row is
    gone: a parent that ended dead or cancelled, then was pruned or purged (or NULL)."""
    up = t.alias("gone_parent")
    recorded = sa.func.jsonb_array_elements_text(_recorded(t.c)).column_valued("recorded")
    as_id = sa.cast(recorded, sa.BigInteger)
    return (
        sa.select(recorded)
        .where(~sa.exists().where(up.c.id == as_id))
        .order_by(as_id)
        .limit(1)
        .scalar_subquery()
    )


def first_ended_parent(t: sa.Table) -> sa.ColumnElement[Any]:
    """``'<id> <status>'`` of the row's first parent that is dead or cancelled, else
    ``'<id> deleted'`` of the first whose end cancelled it and whose row is gone (or
    NULL)."""
    up = t.alias("ended_parent")
    ended = (
        sa.select(sa.cast(up.c.id, sa.Text) + " " + up.c.status)
        .where(up.c.id == sa.any_(t.c.parents), _ended(up))
        .order_by(up.c.id)
        .limit(1)
        .scalar_subquery()
    )
    first: sa.ColumnElement[Any] = sa.func.coalesce(ended, _gone_parent(t) + " deleted")
    return first


def cancelled_by_parent(t: sa.Table) -> sa.ColumnElement[bool]:
    """A child cancelled because a parent ended (not by an operator): meta says so."""
    return sa.and_(
        t.c.status == status_literal(JobStatus.CANCELLED), _has_key(t.c, CANCELLED_BY_PARENT_KEY)
    )


def cancelled_while_held(t: sa.Table) -> sa.ColumnElement[bool]:
    """A cancelled job that was held for its parents when it was cancelled: by a parent
    that ended, or by an operator while it still waited (``waiting > 0``). A retry brings
    it back waiting for the parents still to run (see :func:`rearm_children`); made
    ready as a plain job, it ran before its parents, and a group callback without the
    results it is called with."""
    waited = sa.and_(
        t.c.status == status_literal(JobStatus.CANCELLED), sa.func.coalesce(t.c.waiting, 0) > 0
    )
    return sa.or_(cancelled_by_parent(t), waited)


def blocked_by_parent(t: sa.Table) -> sa.ColumnElement[bool]:
    """Whether a parent of the row's ended (dead or cancelled) in a way that keeps it from
    running: not a child that runs anyway (``on_parent_failure="run"``), which only waits
    for the parents still to run.

    A parent whose end the child's cancel recorded and whose row is gone (pruned after
    ``keep_dead``, purged) still ended: it never succeeded, and nothing can retry it now.
    Read as gone-hence-done (only the live parents were counted), the child came back
    ready and ran, a group callback with ``null`` for that member. Retention and purge
    are not held back instead: a purge is an operator's explicit delete, and a cancelled
    child kept for long would keep its dead parent past ``keep_dead``."""
    ended = sa.or_(ended_parent(t), _gone_parent(t).is_not(None))
    return sa.and_(ended, ~_has_key(t.c, RUN_ANYWAY_KEY))


# Retried parents whose children were settled (meta {"sqla_jobs.children": false}):
# marked as having children to settle again, so that their next end settles them (and a
# rescue that marks one dead again leaves it to the retention pass, which looks for
# true). Returns their ids: the parents whose children come back.
def _unsettle(t: sa.Table) -> sa.Update:
    c = t.c
    return (
        sa.update(t)
        .where(
            c.id == sa.func.any(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))),
            _meta_says(c, CHILDREN_KEY, False),
        )
        .values(meta=c.meta.op("||", return_type=JSONB)(_json({CHILDREN_KEY: True})))
        .returning(c.id)
    )


# Children that run anyway and still wait for other parents were counted down when these
# parents were settled: they wait for them again, one count per parent among :parent_ids.
def _rewait_children(t: sa.Table) -> sa.Update:
    c = t.c
    return (
        sa.update(t)
        .where(
            _parents_match(t),
            c.status == _SCHEDULED_VIA_PK,
            c.waiting > 0,
            _has_key(c, RUN_ANYWAY_KEY),
        )
        .values(waiting=c.waiting + _parent_count(c))
        .returning(c.id)
    )


# Before bringing children back: lock their parents FOR SHARE, which the UPDATE of a
# parent's completion or failure waits for, so that the next statement's count of the
# parents still to run cannot miss an outcome: one committed before the lock is seen
# there, one after it finds the child waiting again and settles it.
def lock_rearm_parents(
    t: sa.Table, which: sa.ColumnElement[bool], *, chosen: bool = False
) -> sa.Select[Any]:
    c = t.c
    up = t.alias("parent_of")
    candidates = sa.select(sa.func.unnest(c.parents)).where(_rearmed(t, chosen), which)
    return (
        sa.select(up.c.id)
        .where(up.c.id.in_(candidates))
        .order_by(up.c.id)
        .with_for_update(read=True, of=up)
    )


def _rearmed(t: sa.Table, chosen: bool) -> sa.ColumnElement[bool]:
    """The cancelled jobs :func:`rearm_children` brings back (see there)."""
    return cancelled_while_held(t) if chosen else cancelled_by_parent(t)


# Bring back the children (``which``) cancelled because a parent ended, once none of
# their parents is dead or cancelled: held again, waiting for the parents still to run
# (ready now if none is, a group callback with its results), no longer marked, with the
# cancel's reason cleared (a held child has run no attempt: it had no error before); one
# that has children of its own is marked so again. Returns each one's id, queue and
# status, and whether its own children were settled (the next step of the walk, see
# admin.retry_report). Run after lock_rearm_parents. ``chosen``: ``which`` are jobs an
# operator retries by name, who also brings back what they cancelled while it was held
# (cancelled_while_held); the walk down from retried parents brings back only what
# those parents cancelled.
def rearm_children(
    t: sa.Table, which: sa.ColumnElement[bool], *, chosen: bool = False
) -> sa.Update:
    c = t.c
    target = (
        sa.select(
            c.id, sa.func.coalesce(_meta_says(c, CHILDREN_KEY, False), sa.false()).label("settled")
        )
        .where(_rearmed(t, chosen), which, ~blocked_by_parent(t))
        .with_for_update(key_share=True)
        .cte("target")
    )
    up = t.alias("live_parent")
    live = (
        sa.select(sa.func.count())
        .select_from(up)
        .where(
            up.c.id == sa.any_(c.parents),
            up.c.status.in_(_LIVE),
        )
        .scalar_subquery()
    )
    free = live == 0
    unmarked = sa.func.coalesce(c.meta, sa.text("'{}'::jsonb")).op("-", return_type=JSONB)(
        sa.literal_column(f"'{CANCELLED_BY_PARENT_KEY}'")
    )
    return (
        sa.update(t)
        .where(c.id == target.c.id)
        .values(
            status=sa.case((free, JobStatus.READY.value), else_=JobStatus.SCHEDULED.value),
            run_at=sa.case(
                (free, sa.func.now()),
                else_=sa.literal_column("'9999-01-01 00:00:00+00'::timestamptz"),
            ),
            waiting=live,
            finished_at=None,
            last_error=None,
            meta=unmarked.op("||", return_type=JSONB)(
                sa.case(
                    (_has_key(c, CHILDREN_KEY), _json({CHILDREN_KEY: True})),
                    else_=sa.text("'{}'::jsonb"),
                )
            ),
            args=_with_results(t, free),
        )
        .returning(c.id, c.queue, c.status, target.c.settled)
    )


# A job's outcome as Jobs.result reads it, by primary key. The JSON as text (decoded by
# flow._look), as the claim reads args: psycopg decodes jsonb as UTF-8 whatever the
# connection's encoding, and a result read over a LATIN1 one raised UnicodeDecodeError.
def _outcome(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return sa.select(
        c.status,
        sa.cast(c.result, sa.Text).label("result"),
        c.last_error,
        c.task,
        sa.cast(c.meta, sa.Text).label("meta"),
    ).where(c.id == sa.bindparam("job_id"))


# Retention of <table>_key_starts: a batch of logs whose newest start has left the window
# (expires_at), which tell the claim nothing any more. A claim that writes one of them
# meanwhile moves its expires_at, and the DELETE re-checks the row it waited for.
def _prune_key_starts(ks: sa.Table) -> sa.Delete:
    stale = (
        sa.select(ks.c.queue, ks.c.key)
        .where(ks.c.expires_at < sa.func.now())
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True)
    )
    return sa.delete(ks).where(sa.tuple_(ks.c.queue, ks.c.key).in_(stale))


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
# arrays are built and sent (a third, concurrency_key, is NULLs unless the task declares
# a key). ON CONFLICT skips rows whose unique key
# belongs to a live job (<table>_unique).
_BULK_ARRAYS = ("args", "unique_key", "concurrency_key")


def _unnest(alias: str, arrays: Iterable[tuple[str, str, Any]]) -> Any:
    """Rows made of parallel arrays sent as parameters: ``unnest(:p, :q, ...) AS alias(a,
    b, ...)``, one ``(parameter, column, item type)`` an array. How a batch of any size is
    one statement, compiled once, with a parameter a column rather than a row."""
    arrays = list(arrays)
    each = sa.func.unnest(*(sa.bindparam(param, type_=ARRAY(t)) for param, _, t in arrays))
    return each.table_valued(*(column for _, column, _ in arrays)).render_derived(name=alias)


def _bulk_insert(t: sa.Table) -> sa.Insert:
    each = _unnest("rows", [(name, name, sa.Text) for name in _BULK_ARRAYS])
    shared = {name: sa.bindparam(name, type_=type_) for name, type_ in _BULK_COLUMNS}
    return (
        pg_insert(t)
        .from_select(
            [*(name for name, _ in _BULK_COLUMNS), "concurrency_key"],
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
                each.c.concurrency_key,
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
def _insert_job(t: sa.Table, *, unique: bool, whole_row: bool = False) -> sa.Insert:
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
        concurrency_key=sa.bindparam("concurrency_key", type_=sa.Text),
    )
    if unique:
        stmt = stmt.on_conflict_do_nothing(index_elements=["unique_key"], index_where=UNIQUE_WHERE)
    if whole_row:
        return stmt.returning(*filled_by_server(t))
    return stmt.returning(t.c.id)


#: The columns :func:`_insert_job` gives a value (its parameters; run_at through
#: ``coalesce(:run_at, now())``).
INSERTED_COLUMNS = (*(name for name, _ in _BULK_COLUMNS), "concurrency_key")


def filled_by_server(t: sa.Table) -> list[sa.Column[Any]]:
    """What the session's INSERT of a job (``insert_job_row``) returns: the id, run_at
    (``now()`` when none was given), and each column the INSERT leaves to a server
    default (attempts and created_at, and any an application's model adds), so that the
    job object it wrote holds the values the server gave it without a second read (what
    the ORM's flush would leave to load when read)."""
    return [
        t.c.id,
        t.c.run_at,
        *(
            c
            for c in t.c
            if c.server_default is not None and c.name not in INSERTED_COLUMNS and c.name != "id"
        ),
    ]


# The live job that holds a unique key (<table>_unique): the answer of a unique enqueue
# whose INSERT ... ON CONFLICT DO NOTHING (insert_job_unique) returned no row.
def _live_by_key(t: sa.Table) -> sa.Select[Any]:
    c = t.c
    return sa.select(c.id).where(
        c.unique_key == sa.bindparam("key"),
        c.status.in_([status_literal(s) for s in LIVE_STATUSES]),
    )


#: One encoder for every row: ``json.dumps(..., separators=...)`` builds one per call.
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def args_json(args: Any) -> str:
    """A job's arguments as JSON text: the text their check wrote, when they carry it
    (:class:`~sqla_jobs.tasks.CheckedArgs`), else encoded here."""
    text = getattr(args, "json", None)
    return text if isinstance(text, str) else _dumps(args)


# -- scoped unique keys (<table>_unique_keys) -------------------------------------------


# Take the row of a scoped unique key, creating it if new, through its primary key. The
# upsert locks the row until the enqueuing transaction ends, so two enqueues of one key
# run one after the other, the second seeing what the first committed (an INSERT of a new
# key waits on the other's uncommitted INSERT the same way). Returns the job that took the
# key last and whether the key's period still runs. ON CONFLICT reads the latest version
# of the row, whatever the statement's snapshot. Periods use statement_timestamp(), not
# now(): an enqueue late in a long transaction must not see its start time.
def _take_key(k: sa.Table) -> sa.Insert:
    stmt = pg_insert(k).values(key=sa.bindparam("key", type_=sa.Text))
    return stmt.on_conflict_do_update(
        index_elements=[k.c.key], set_={"key": stmt.excluded.key}
    ).returning(k.c.job_id, sa.func.coalesce(k.c.until > sa.func.statement_timestamp(), sa.false()))


# Place a scoped unique job, the key's row being locked (take_key): in one statement,
#   replaced: with :replace, the holder gets the new arguments and run time if it is
#             still in :states (scheduled or ready). The UPDATE re-reads the row it waits
#             for, so a holder claimed meanwhile is not replaced (and a new job is made);
#   new:      otherwise a new job, unless the holder blocks it (:held, the key's period,
#             or the holder in :states; never in replace mode), and the key then points
#             at it (keys), its period counting from now;
#   kept:     the holder, when it blocks and still exists.
# One row comes back: (id, 'new' | 'replaced' | 'kept'); none if the key is held by its
# period and the job that took it is gone. The holder is found by primary key. A new job
# wakes the workers through the table's INSERT trigger; a replaced one that is ready now
# (a debounce whose wait is over) wakes them here, with the same NOTIFY (sent at commit).
# SQLAlchemy fills no Python-side column default in an INSERT that is a CTE (a column of
# the application's model, a tenant, was NULL): the new row takes them from
# _python_defaults, a callable's value bound as ``d_<column>`` by the caller.
def _place_scoped(t: sa.Table, k: sa.Table, channel: str) -> sa.Select[Any]:
    c = t.c
    # Prefixed: a parameter named like a column would join the UPDATEs' SET lists.
    p = {name: sa.bindparam(f"p_{name}", type_=type_) for name, type_ in _BULK_COLUMNS}
    holder = sa.bindparam("holder", type_=sa.BigInteger)
    states = sa.bindparam("states", type_=ARRAY(sa.Text))
    replace = sa.bindparam("replace", type_=sa.Boolean)
    # The new arguments' concurrency key (sqla_jobs.throttle), NULL when the task has none.
    p_key = sa.bindparam("p_concurrency_key", type_=sa.Text)
    run_at = sa.func.coalesce(p["run_at"], sa.func.now())
    replaced = (
        sa.update(t)
        .where(replace, c.id == holder, c.status == sa.any_(states))
        .values(
            args=sa.cast(p["args"], JSONB),
            run_at=run_at,
            status=p["status"],
            concurrency_key=p_key,
        )
        .returning(c.id, c.queue, c.status)
        .cte("replaced")
    )
    # An UPDATE fires no INSERT trigger: notify as the trigger would. The count makes the
    # 'replaced' row below depend on the NOTIFY, so PostgreSQL runs it (an unreferenced
    # SELECT in WITH is never evaluated).
    woken = sa.select(sa.func.pg_notify(sa.literal(channel), replaced.c.queue)).where(
        replaced.c.status == status_literal(JobStatus.READY)
    )
    n_woken = sa.select(sa.func.count()).select_from(woken.subquery("woken")).scalar_subquery()
    defaults = _python_defaults(t)
    blocks = sa.or_(
        sa.bindparam("held", type_=sa.Boolean),
        sa.exists().where(c.id == holder, c.status == sa.any_(states)),
    )
    new = (
        pg_insert(t)
        .from_select(
            [*(name for name, _ in _BULK_COLUMNS), "concurrency_key", *defaults],
            sa.select(
                p["task"],
                p["queue"],
                sa.cast(p["args"], JSONB),
                p["priority"],
                p["max_attempts"],
                p["status"],
                run_at,
                # The key stays in the row for people (admin, dashboard) but the partial
                # unique index must not see it: that index allows one live job per key,
                # while a scope may allow two (a running one and a waiting one).
                sa.null(),
                sa.cast(p["meta"], JSONB),
                p_key,
                *defaults.values(),
            ).where(
                ~sa.exists(sa.select(replaced.c.id)),
                sa.or_(replace, ~blocks),
            ),
        )
        .returning(c.id)
        .cte("new")
    )
    keys = (
        sa.update(k)
        .where(k.c.key == sa.bindparam("p_unique_key", type_=sa.Text))
        .where(sa.exists(sa.select(new.c.id)))
        .values(
            job_id=sa.select(new.c.id).scalar_subquery(),
            until=sa.func.statement_timestamp() + sa.bindparam("period", type_=sa.Interval),
        )
        .cte("keys")
    )
    kept = sa.select(c.id, sa.literal("kept")).where(
        c.id == holder,
        # Only a holder that blocked the new job: one that did not, while no new job came
        # back (an application's trigger skipped its INSERT), was returned as kept.
        blocks,
        ~sa.exists(sa.select(replaced.c.id)),
        ~sa.exists(sa.select(new.c.id)),
    )
    return (
        sa.select(new.c.id, sa.literal("new"))
        .union_all(sa.select(replaced.c.id, sa.literal("replaced")).where(n_woken >= 0), kept)
        .subquery("placed")
        .select()
        .add_cte(keys)
    )


def defaulted_columns(t: sa.Table) -> list[sa.Column[Any]]:
    """The columns of ``t`` that the job INSERTs leave out and that have a default of
    SQLAlchemy's (``mapped_column(default="acme")``: a column of the application's model),
    which only SQLAlchemy's own execution of an INSERT fills."""
    written = set(INSERTED_COLUMNS)
    return [c for c in t.c if c.name not in written and c.default is not None]


def _python_defaults(t: sa.Table) -> dict[str, Any]:
    """SQL for each of ``t``'s :func:`defaulted_columns`, by column name: a constant, an
    SQL expression, a sequence's next value, or for a Python callable (whose value is new
    at each enqueue) the bind parameter ``d_<column>`` (see :func:`_callable_defaults`)."""
    found: dict[str, Any] = {}
    for column in defaulted_columns(t):
        default: Any = column.default
        if isinstance(default, sa.Sequence):
            found[column.name] = default.next_value()
        elif default.is_clause_element:
            found[column.name] = sa.type_coerce(default.arg, column.type)
        elif default.is_callable:
            found[column.name] = sa.bindparam(f"d_{column.name}", type_=column.type)
        else:
            found[column.name] = sa.literal(default.arg, column.type)
    return found


def _callable_defaults(t: sa.Table) -> tuple[tuple[str, Any], ...]:
    """The ``d_<column>`` parameters of :func:`_place_scoped`, each with the column's
    Python-callable default (SQLAlchemy's, wrapped to take an execution context), which the
    caller calls once per job (``sqla_jobs._enqueue.enqueue_scoped``)."""
    return tuple(
        (f"d_{column.name}", column.default)
        for column in defaulted_columns(t)
        if column.default is not None and column.default.is_callable
    )


# Retention of <table>_unique_keys (see worker._statements.prune_unique_keys), through its primary
# key: first lock a batch of keys whose period has passed, skipping those an enqueue
# holds; then, in a new snapshot, delete those whose job is no longer live.
def _lock_stale_keys(t: sa.Table, k: sa.Table) -> sa.Select[Any]:
    """Keys whose job is live are left out here, not only by the delete: locked, they
    filled the batch (1,000 jobs held by ``unique_states`` alone, ``until`` NULL), the
    delete removed none of them, and the pass, which stops at a short batch, never
    reached the keys it could delete behind them. The delete still re-checks (its
    snapshot sees a job that took a key since this one's)."""
    c = t.c
    live = sa.exists().where(
        c.id == k.c.job_id, c.status.in_([status_literal(s) for s in LIVE_STATUSES])
    )
    return (
        sa.select(k.c.key)
        .where(sa.or_(k.c.until.is_(None), k.c.until < sa.func.now()), ~live)
        .limit(sa.bindparam("limit"))
        .with_for_update(skip_locked=True, of=k)
    )


def _prune_unique_keys(t: sa.Table, k: sa.Table) -> sa.Delete:
    c = t.c
    live = sa.exists().where(
        c.id == k.c.job_id, c.status.in_([status_literal(s) for s in LIVE_STATUSES])
    )
    return (
        sa.delete(k)
        .where(k.c.key == sa.any_(sa.bindparam("keys", type_=ARRAY(sa.Text))), ~live)
        .execution_options(preserve_rowcount=True)
    )


# -- schedules (<table>_schedules) -------------------------------------------------------


# Due schedules, oldest tick first, through <table>_schedules_due. SKIP LOCKED: each worker
# takes the rows no other worker is handling, so a tick is enqueued by one of them.
def _due_schedules(s: sa.Table) -> sa.Select[Any]:
    """The due schedules, each in a form the driver can always read (as the claim reads
    a job's row, see :func:`claimed_columns`): their arguments as JSON text, decoded row
    by row, and a tick Python cannot hold (``-infinity``, BC) as NULL. A schedule row
    written around the API with such a value raised for the whole pass, which also
    promotes retries and rescues leases: every worker of the table stopped claiming."""
    c = s.c
    readable = c.next_run_at.between(_READABLE_FROM, _READABLE_UNTIL)
    return (
        sa.select(
            c.name,
            c.task,
            sa.cast(c.args, sa.Text).label("args"),
            c.cron,
            c.tz,
            c.queue,
            c.priority,
            sa.case((readable, c.next_run_at), else_=sa.null()).label("next_run_at"),
        )
        .where(s.c.enabled, s.c.next_run_at <= sa.bindparam("now"))
        # Those that failed last come after the others: a hundred held (a task only the
        # next deploy's workers know) would otherwise take every pass's whole limit.
        .order_by(s.c.last_error.is_not(None), s.c.next_run_at)
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


# A schedule whose tick this worker cannot enqueue now, and another worker or a later pass
# may: it stays due, and says why. Nothing is written (nor returned, which the log waits
# for) when the reason is the one it gave already: every pass meets it again.
def _schedule_held(s: sa.Table) -> sa.Update:
    return (
        sa.update(s)
        .where(
            s.c.name == sa.bindparam("schedule"),
            s.c.last_error.is_distinct_from(sa.bindparam("error")),
        )
        .values(last_error=sa.bindparam("error"))
        .returning(s.c.name)
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
    # Each kind replaces only its own: a schedule declared in code silently took over a
    # run-time schedule of its name (its task, expression and arguments), and the deploy
    # that dropped the declaration deleted it; a run-time one took over a code one. No
    # row comes back when the name is the other kind's.
    return stmt.on_conflict_do_update(
        index_elements=[s.c.name], set_=changes, where=s.c.origin == origin
    ).returning(s.c.name)


# Code-declared schedules the code no longer declares.
def _delete_undeclared(s: sa.Table) -> sa.Delete:
    return sa.delete(s).where(
        s.c.origin == "code", s.c.name.not_in(sa.bindparam("declared", expanding=True))
    )


# -- worker presence and throughput (<table>_workers, <table>_throughput) ----------------


@dataclass(frozen=True)
class WorkerReport:
    """What a worker says of itself in its row of ``<table>_workers``: declared once, for
    the statement that writes the row (:func:`_worker_seen`, whose columns these are), the
    worker that fills it in, and :class:`sqla_jobs.admin.WorkerInfo`, which reads it back
    with the times the database keeps."""

    name: str
    host: str
    pid: int
    kind: str
    queues: list[str]
    concurrency: int
    running: int
    processed: int

    def params(self, ttl: timedelta) -> WorkerSeenParams:
        """The parameters of ``worker_seen``: this report, and how long the row counts as
        alive without another."""
        return {**asdict(self), "ttl": ttl}


#: The parameters of ``Queries.worker_seen``: a :class:`WorkerReport`'s fields and ``ttl``.
WorkerSeenParams: TypeAlias = dict[str, Any]

_REPORTED = tuple(f.name for f in fields(WorkerReport))


# A worker says it is alive: insert or refresh its row (primary key), once every
# presence_interval. started_at stays from the first insert; the rest is the report's.
def _worker_seen(w: sa.Table) -> sa.Insert:
    types = {"queues": ARRAY(sa.Text)}
    stmt = pg_insert(w).values(
        {
            **{name: sa.bindparam(name, type_=types.get(name)) for name in _REPORTED},
            "last_seen": sa.func.now(),
            "expires_at": sa.func.now() + sa.bindparam("ttl", type_=sa.Interval),
        }
    )
    new = stmt.excluded
    refreshed = [*_REPORTED[1:], "last_seen", "expires_at"]
    return stmt.on_conflict_do_update(
        index_elements=[w.c.name], set_={name: new[name] for name in refreshed}
    )


# Rows of workers that died without deleting theirs, an hour after they expired (the
# Workers page shows them as gone until then). A scan of a table of a few rows.
def _forget_workers(w: sa.Table) -> sa.Delete:
    return sa.delete(w).where(w.c.expires_at < sa.func.now() - sa.text("interval '1 hour'"))


# Add a worker's counts of written outcomes to the current minute of each queue (the
# database's clock, so workers on skewed clocks agree). One row per (minute, queue): a
# handful of workers adding to it every few seconds hold its lock for a moment each.
def _add_throughput(t: sa.Table) -> sa.Insert:
    kinds = THROUGHPUT_KINDS
    arrays = [("queues", "queue", sa.Text), *((kind, kind, sa.BigInteger) for kind in kinds)]
    rows = _unnest("counts", arrays)
    minute = sa.func.date_trunc("minute", sa.func.now())
    stmt = pg_insert(t).from_select(
        ["minute", "queue", *kinds], sa.select(minute, rows.c.queue, *(rows.c[k] for k in kinds))
    )
    return stmt.on_conflict_do_update(
        index_elements=[t.c.minute, t.c.queue],
        set_={kind: t.c[kind] + stmt.excluded[kind] for kind in kinds},
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
        self.limit_lock = _limit_lock(t)
        self.limit_lock_generic = _limit_lock(t, generic_plan=True)
        self.generic_plan = sa.select(GENERIC_PLAN)
        # The claims of limited queues (the shape each queue's limits need), built when
        # first used: a quarter of building every statement, which every worker, web
        # process and CLI command does at start.
        self._built: dict[tuple[Any, ...], sa.Select[Any]] = {}
        #: Statements compiled for sending straight to psycopg (``sqla_jobs._direct``),
        #: by (id, dialect): each is one of the statements held here, so its id is stable.
        self.compiled: dict[tuple[Any, ...], Any] = {}
        self.complete = _complete(t, keep_done=keep_done)
        self.complete_childless = _complete(t, keep_done=keep_done, childless=True)
        self.fail = _fail(t)
        self.snooze = _snooze(t)
        self.hand_back = _hand_back(t, channel)
        self.heartbeat = _heartbeat(t)
        self.lock_run = _lock_run(t)
        self.release_run = _release_run
        # Results and workflows.
        self.results_channel = results = result_channel(t)
        self.complete_flow = _complete_flow(t, results)
        self.fail_flow = _fail_flow(t, results)
        self.lock_children = _lock_children(t)
        self.release = _release(t, channel, results)
        self.cancel_children = _cancel_children(t, results)
        self.record_ended_parents = _record_ended_parents(t)
        self.mark_parents = _mark_parents(t)
        self.link_child = _link_child(t, channel)
        self.outcome = _outcome(t)
        self.unsettled_parents = _unsettled_parents(t)
        # Retrying a parent (admin.retry_report): what it cancelled comes back.
        self.unsettle = _unsettle(t)
        self.rewait_children = _rewait_children(t)
        self.lock_rearm_parents = lock_rearm_parents(t, _parents_match(t))
        self.rearm_children = rearm_children(t, _parents_match(t))
        self.forget_parents = _forget_parents(t)

        self.promote = _promote(t, channel)
        self.rescue = _rescue(t, channel, results)
        self.next_due = _next_due(t)
        self.ready_depth = _ready_depth(t)
        self.prune_dead = _prune(t, (JobStatus.DEAD, JobStatus.CANCELLED))
        self.prune_done = _prune_done(t)
        self.try_lock = _try_lock(t)
        # Paused queues (<table>_queues): read once per poll interval, not per claim.
        self.paused = sa.select(queues.c.name).where(queues.c.paused)

        self.bulk_insert = _bulk_insert(t)
        # The keys it inserted, for rows with unique keys: the ``enqueued`` listeners hear
        # of those only (see insert_rows).
        self.bulk_insert_keys = _bulk_insert(t).returning(t.c.unique_key)
        self.insert_job = _insert_job(t, unique=False)
        self.insert_job_unique = _insert_job(t, unique=True)
        # session.enqueue's job, written at the flush (sqla_jobs._enqueue.write_direct):
        # insert_job, returning what the server filled in.
        self.insert_job_row = _insert_job(t, unique=False, whole_row=True)
        self.live_by_key = _live_by_key(t)
        self.unique_keys_table = unique_keys = companions.unique_keys
        self.take_key = _take_key(unique_keys)
        self.place_scoped = _place_scoped(t, unique_keys, channel)
        self.scoped_callable_defaults = _callable_defaults(t)
        self.lock_stale_keys = _lock_stale_keys(t, unique_keys)
        self.prune_unique_keys = _prune_unique_keys(t, unique_keys)
        self.key_starts_table = key_starts = companions.key_starts
        self.prune_key_starts = _prune_key_starts(key_starts)

        self.now = sa.select(sa.func.now())
        self.due_schedules = _due_schedules(schedules)
        self.advance_schedule = _advance_schedule(schedules)
        self.schedule_failed = _schedule_failed(schedules)
        self.schedule_held = _schedule_held(schedules)
        self.upsert_code_schedule = _upsert_schedule(schedules, "code")
        self.upsert_runtime_schedule = _upsert_schedule(schedules, "runtime")
        self.delete_undeclared = _delete_undeclared(schedules)
        self.delete_schedule = (
            sa.delete(schedules)
            .where(schedules.c.name == sa.bindparam("schedule"))
            .returning(schedules.c.name)
        )
        # Times Python cannot hold (a row at 'infinity', written by hand: never due, so
        # never rewritten) read as NULL, and the arguments as text, decoded row by row
        # (readable_json): one such row failed every listing.
        self.list_schedules = sa.select(
            *(
                readable_time(col).label(col.key)
                if isinstance(col.type, sa.DateTime)
                else sa.cast(col, sa.Text).label(col.key)
                if col.key == "args"
                else col
                for col in schedules.c
            )
        ).order_by(schedules.c.name)

        self.worker_seen = _worker_seen(workers)
        self.worker_gone = sa.delete(workers).where(workers.c.name == sa.bindparam("name"))
        self.forget_workers = _forget_workers(workers)
        self.add_throughput = _add_throughput(throughput)
        self.forget_throughput = _forget_throughput(throughput)

    def __repr__(self) -> str:
        return f"<Queries of {self.table.fullname}>"

    def fair_claim(self, *, for_session: bool = False) -> sa.Select[Any]:
        """The claim of a queue with ``fair=True`` (:func:`_fair_claim`)."""
        return self._once(("fair", for_session), _fair_claim, for_session=for_session)

    def fifo_claim(self, *, key_rated: bool) -> sa.Select[Any]:
        """The limited claim of a queue with ``key_order="fifo"`` (see
        :func:`_limited_claim`)."""
        return self._once(("fifo", key_rated), _limited_claim, key_rated=key_rated, fifo=True)

    def shaped_claim(
        self, *, key_rated: bool, fifo: bool, rated: bool, capped: bool, keyed: bool = True
    ) -> sa.Select[Any]:
        """The limited claim with only the parts the queue's limits use (see
        :func:`_limited_claim`)."""
        return self._once(
            ("limited", key_rated, fifo, rated, capped, keyed),
            _limited_claim,
            key_rated=key_rated,
            fifo=fifo,
            rated=rated,
            capped=capped,
            keyed=keyed,
        )

    @property
    def limited_claim(self) -> sa.Select[Any]:
        """The limited claim with every part but the key rate's."""
        return self.shaped_claim(key_rated=False, fifo=False, rated=True, capped=True)

    @property
    def key_rated_claim(self) -> sa.Select[Any]:
        """The limited claim with every part."""
        return self.shaped_claim(key_rated=True, fifo=False, rated=True, capped=True)

    def _once(self, key: tuple[Any, ...], build: Any, **kw: Any) -> sa.Select[Any]:
        """A statement built the first time a worker or a session asks for it: most
        applications have no such queue, and every statement built in ``__init__`` is
        start-up time."""
        statement = self._built.get(key)
        if statement is None:
            statement = self._built[key] = build(self.table, **kw)
        return statement

"""Operating the queue: look at it, retry, cancel, purge, pause.

Every function here is a plain SQLAlchemy Core statement run on what the caller gives:
a ``Connection`` or a ``Session``. Nothing commits on the caller's behalf, so an
operation can ride a larger transaction (or be rolled back), and the ``NOTIFY`` that
wakes workers after a retry is sent when the caller commits, like every NOTIFY::

    from sqla_jobs import admin

    with engine.begin() as conn:
        for q in admin.queue_states(conn, jobs):
            print(q.queue, q.ready, q.lag_seconds)
        admin.retry_jobs(conn, jobs, queue="webhooks", status="dead")

The ``jobs`` argument is the :class:`~sqla_jobs.Jobs` registry, or just the ``JobMixin``
model (or its ``Table``): operators do not always have the handlers importable.

Selecting jobs
--------------
:func:`retry_jobs`, :func:`cancel_jobs` and :func:`purge_jobs` act on the jobs that match
*all* the given selectors: ``ids``, ``queue``, ``task`` and ``status`` (each one value or
several). With no selector at all they refuse (``ValueError``) unless ``all_jobs=True``:
"every dead job of every queue" should be something one says, not something one gets
by forgetting an argument. Each takes ``dry_run=True`` to count without changing anything.

One read model, one table of actions
------------------------------------
The ``sqla-jobs`` command and the dashboard render what this module reads; neither keeps
a vocabulary of its own:

- a queue is a :class:`QueueState` (:func:`queue_states`), every count under one name;
- a job is a :class:`JobView` (:func:`list_jobs`, :func:`get_job`), and a list of many
  reads its :class:`JobSummary` (:func:`browse_jobs`), through the same filters;
- an action is an :class:`Action` of :data:`ACTIONS`: its statuses, its words, what it
  runs. :func:`preview` counts a :class:`Selection`, and :func:`act` acts on one, or on
  the jobs an operator saw (:class:`SeenJob`), reporting job by job.

Each read takes one connection; over several databases, :mod:`sqla_jobs.sharding` runs
it on each shard (:func:`~sqla_jobs.sharding.across`) and sums the queues
(:func:`~sqla_jobs.sharding.total`), and a single database is the shard of one. A
``ShardedSession`` is refused (``TypeError``): each shard numbers its own jobs, so an id or
a queue names something only within a shard; give the shard's connection. See
``docs/design/operators.md``.

What each action may touch
--------------------------
========== =============================== ==========================================
action     statuses it acts on (default)   may be narrowed to / widened to
========== =============================== ==========================================
retry      dead, cancelled                 either one
cancel     scheduled, ready, running       any of those
purge      done, dead, cancelled           also scheduled or ready, when named;
                                           never running (cancel those first)
========== =============================== ==========================================
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    NamedTuple,
    TypeAlias,
    TypedDict,
    TypeVar,
    cast,
)

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.horizontal_shard import ShardedSession
from sqlalchemy.orm import Session

from . import _present
from . import _queries as _q
from ._queries import UNREADABLE_KEY, Queries, readable_json, readable_time
from ._queries import status_literal as _lit
from ._settle import settle_children
from ._step_queries import StepQueries
from ._storable import (
    BIGINT_MAX,
    DURATION_MAX_SECONDS,
    INT_MAX,
    QUEUE_MAX_BYTES,
    check_name,
    finite_seconds,
    json_text_depth,
    text_problem,
)
from ._tasks import json_problem
from .connection import _announce
from .errors import CONFLICT_STATES, EnqueueError, conflicted, describe
from .model import (
    CHILDREN_KEY,
    KEY_ORDER_STATUSES,
    LIVE_STATUSES,
    STATUSES,
    SUSPENDED_STEP_STATES,
    JobStatus,
    companion_tables,
    derived_name,
    job_table,
    notify_channel,
    result_channel,
)
from .periodic import tick_values
from .tasks import Jobs
from .worker.job import CANCEL_PAYLOAD

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "ACTIONS",
    "ACTION_ISOLATION",
    "ACTION_TRIES",
    "CANCELLABLE",
    "CONFLICT_STATES",
    "FINISHED_STATUSES",
    "PURGEABLE",
    "PURGEABLE_BY_DEFAULT",
    "RETRYABLE",
    "UNREADABLE_KEY",
    "Action",
    "ActionName",
    "ActionReport",
    "BlockedKey",
    "JobFilters",
    "JobInfo",
    "JobPage",
    "JobSummary",
    "JobView",
    "Minute",
    "NoSuchSchedule",
    "QueueInfo",
    "QueueState",
    "SeenJob",
    "Selection",
    "Selectors",
    "Throughput",
    "WorkerInfo",
    "act",
    "blocked_keys",
    "browse_jobs",
    "cancel_jobs",
    "conflicted",
    "get_job",
    "list_jobs",
    "list_queues",
    "list_workers",
    "max_job_id",
    "meta_filter",
    "overview",
    "parse_search",
    "pause_queue",
    "paused_queues",
    "preview",
    "purge_jobs",
    "queue_states",
    "resume_queue",
    "retry_jobs",
    "retry_report",
    "run_schedule",
    "source_table",
    "stats",
    "throughput",
]

log = logging.getLogger("sqla_jobs.admin")

#: A registry, a JobMixin model class, or the jobs Table itself.
JobSource: TypeAlias = "Jobs | type[Any] | sa.Table"
#: Where statements run: the caller's connection or session (and its transaction).
Bind: TypeAlias = "sa.Connection | Session"
#: One value or several, for a filter.
OneOrMany: TypeAlias = "str | Iterable[str] | None"

#: Statuses a job never leaves by itself.
FINISHED_STATUSES: tuple[str, ...] = (JobStatus.DONE, JobStatus.DEAD, JobStatus.CANCELLED)

#: What each action acts on by default, and (PURGEABLE) what purge may be told to delete.
RETRYABLE: tuple[str, ...] = (JobStatus.DEAD, JobStatus.CANCELLED)
CANCELLABLE: tuple[str, ...] = LIVE_STATUSES
PURGEABLE_BY_DEFAULT: tuple[str, ...] = FINISHED_STATUSES
PURGEABLE: tuple[str, ...] = (*FINISHED_STATUSES, JobStatus.SCHEDULED, JobStatus.READY)

#: The names of the actions (see :data:`ACTIONS`).
ActionName: TypeAlias = Literal["retry", "cancel", "purge"]

DEFAULT_WINDOW = 300.0

#: The 0.2 names of :class:`QueueState`, deprecated (see :func:`__getattr__`).
_RENAMED = {"QueueStats": "QueueState", "QueueSummary": "QueueState"}


def __getattr__(name: str) -> Any:
    """``admin.QueueStats`` and ``admin.QueueSummary``: :class:`QueueState`, with a
    DeprecationWarning (the CLI's and the dashboard's two views of a queue are one now)."""
    if name in _RENAMED:
        _deprecated(f"admin.{name}", f"admin.{_RENAMED[name]}")
        return QueueState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueState:
    """What one queue holds right now: the one read model of a queue's counts, for the
    ``sqla-jobs stats`` command, the dashboard, the metrics an application exports, and
    each shard (summed by :func:`sqla_jobs.sharding.total`).

    ``lease_expired`` counts running jobs whose lease has passed: their worker died or
    hangs, and they will be rescued. ``lag_seconds`` is how long the oldest ready job has
    been due (``now() - run_at``): the delay a job enqueued now would see if the queue
    kept its pace; ``None`` when nothing is ready.

    ``done`` and ``cancelled`` (the totals of the kept history) and ``done_recent`` and
    ``dead_recent`` (finished in the last ``window`` seconds) are ``None`` when they were
    not counted (:func:`queue_states` with ``finished=False``, as the dashboard asks: the
    totals are the one part of the read whose cost grows with the kept history).
    ``done_recent`` is also ``None`` when finished jobs are not kept
    (``Jobs(keep_done=...)``): by default they are deleted the moment they complete, so no
    row is left to count, and ``None`` says "unknown" rather than a misleading zero; and
    when only the model was given, since the retention setting lives on the registry.
    Dead jobs are always kept (until pruned), so ``dead_recent`` is known when counted.
    """

    queue: str
    paused: bool
    scheduled: int
    ready: int
    running: int
    lease_expired: int
    done: int | None
    dead: int
    cancelled: int | None
    lag_seconds: float | None
    done_recent: int | None
    dead_recent: int | None
    #: When the pause state last changed (``None``: never paused or resumed).
    paused_since: datetime | None = None
    #: The registry's limits for it (see :class:`QueueInfo`), empty when none.
    limits: str = ""

    @property
    def expired(self) -> int:
        """Deprecated: the 0.2 name of :attr:`lease_expired` on ``QueueSummary``."""
        _deprecated("QueueState.expired", "QueueState.lease_expired")
        return self.lease_expired

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: datetimes become ISO 8601 strings in UTC."""
        return {k: _json_value(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class StepView:
    """One durable step of a job (:mod:`sqla_jobs.steps`), as stored in ``<table>_steps``:
    its ``kind`` (``run``, ``cursor``, ``sleep``, ``wait``), its ``state`` (``done``,
    ``open`` for a cursor between batches, ``sleeping``, ``waiting``, ``signalled``,
    ``timed_out``), the attempt that wrote it (None: a signal sent from outside), a
    sleep's wake-up time or a wait's deadline, and the size of its stored JSON. A
    cursor's ``position`` is ``{"after": <key>, "rows": <rows done>}``."""

    name: str
    kind: str
    state: str
    attempt: int | None
    until: datetime | None
    #: None where the row holds a time Python cannot (``'infinity'``, a BC date).
    created_at: datetime | None
    updated_at: datetime | None
    size: int | None
    position: Any = None

    @property
    def suspends(self) -> bool:
        """The job is suspended in this step (asleep, or waiting for its signal)."""
        return self.state in SUSPENDED_STEP_STATES

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_value(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class JobView:
    """One job row, as operators look at it: every column (:func:`list_jobs`,
    :func:`get_job`). A list that shows many jobs reads their :class:`JobSummary`
    instead (:func:`browse_jobs`): the same job, with its arguments and last error cut
    short in the statement itself, since each may be megabytes.
    """

    id: int
    queue: str
    task: str
    status: str
    args: dict[str, Any]
    priority: int
    attempts: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    finished_at: datetime | None
    locked_until: datetime | None
    locked_by: str | None
    unique_key: str | None
    last_error: str | None
    #: As enqueued (``meta={...}``), or None.
    meta: dict[str, Any] | None = None
    #: The latest progress note of its handler: ``{"value", "note", "at"}``, or None.
    progress: dict[str, Any] | None = None
    #: What its handler returned, for a job that keeps its result (once done).
    result: Any = None
    #: The jobs it waits for (``after=``), and how many of them have not yet succeeded.
    parents: list[int] | None = None
    waiting: int | None = None
    #: The jobs that wait for it (filled by :func:`get_job` only), newest last.
    children: list[int] | None = None
    #: Its durable steps, oldest first (filled by :func:`get_job` only; empty for a job
    #: that has none).
    steps: list[StepView] | None = None

    @property
    def suspended_in(self) -> StepView | None:
        """The sleep or wait the job is suspended in, if any (:func:`get_job` only)."""
        return next((s for s in self.steps or () if s.suspends), None)

    @property
    def steps_done(self) -> int:
        """How many of its steps are done: its progress, for a durable job."""
        return sum(1 for s in self.steps or () if s.state == "done")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JobView:
        return cls(
            **{
                name: readable_json(row[name]) if name in _JSON_FIELDS else row[name]
                for name in _JOB_FIELDS
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: datetimes become ISO 8601 strings in UTC (its steps' too)."""
        found = {k: _json_value(v) for k, v in asdict(self).items() if k != "steps"}
        found["steps"] = None if self.steps is None else [s.to_dict() for s in self.steps]
        return found

    def summary(self) -> JobSummary:
        """This job as a list shows it."""
        return JobSummary.of(asdict(self), json.dumps(self.args), self.last_error)

    @property
    def seen(self) -> SeenJob:
        """The moment of its life it was read at (the guard of an action on it)."""
        return SeenJob(self.id, self.attempts, self.status)


#: The 0.2 name of :class:`JobView`.
JobInfo = JobView


@dataclass(frozen=True)
class QueueInfo:
    """A queue name, and whether it is paused (``updated_at``: when that last changed)."""

    name: str
    paused: bool
    updated_at: datetime | None
    #: The limits the registry declares for it (``concurrency 3, 100/60s, 1 per key``),
    #: empty when none or when only a model or table was given (see sqla_jobs.throttle).
    limits: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_value(v) for k, v in asdict(self).items()}


#: The columns a JobView is read from (``children`` is looked up by get_job).
_JOB_FIELDS: tuple[str, ...] = tuple(
    f for f in JobView.__dataclass_fields__ if f not in ("children", "steps")
)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return _utc(value).isoformat()
    return value


def _utc(value: datetime) -> datetime:
    from datetime import timezone

    return value.astimezone(timezone.utc)


# -- looking ------------------------------------------------------------------------------


def queue_states(
    bind: Bind, jobs: JobSource, *, window: float = DEFAULT_WINDOW, finished: bool = True
) -> list[QueueState]:
    """Per-queue counts, lag, limits and pause state, sorted by queue name.

    One statement of per-status aggregates, each read where its rows are cheapest: ready,
    scheduled, running and dead jobs (and the oldest ready ``run_at``) through the partial
    index of their status (``_claim`` index-only for ready jobs, ``_scheduled``,
    ``_running``, ``_dead`` index-only); ``done_recent`` and ``dead_recent`` through
    ``<table>_finished``, over the last ``window`` seconds only; and the done and
    cancelled totals from the rows of those two statuses, which no index has by queue
    (one on the success path would cost every job, so those two totals are the one part
    that grows with the kept history). The whole is full-joined with ``<table>_queues`` so
    that a paused queue shows up even while empty; queues named by the registry's tasks
    are listed too, so an idle queue reads as zeros rather than being absent.

    :param window: seconds that ``done_recent`` and ``dead_recent`` look back.
    :param finished: count the finished jobs too (``done``, ``cancelled``,
        ``done_recent``, ``dead_recent``); ``False`` leaves them ``None`` and reads no
        finished row at all, so the table's history costs nothing (the dashboard's
        overview, refreshed every few seconds).
    """
    table = _table(jobs)
    queues_table = _queues_table(table)
    c = table.c
    since = sa.func.now() - sa.bindparam("window", type_=sa.Interval)
    none_time = sa.null().cast(sa.DateTime(timezone=True))
    zero = sa.literal(0, sa.BigInteger)

    def branch(
        kind: str, *where: sa.ColumnElement[bool], oldest: Any = none_time, expired: Any = zero
    ) -> sa.Select[Any]:
        return (
            sa.select(
                c.queue,
                sa.literal(kind).label("kind"),
                sa.func.count().label("n"),
                expired.label("expired"),
                oldest.label("oldest"),
            )
            .where(*where)
            .group_by(c.queue)
        )

    def status(s: JobStatus) -> sa.ColumnElement[bool]:
        return c.status == _lit(s)

    branches = [
        branch("ready", status(JobStatus.READY), oldest=sa.func.min(c.run_at)),
        branch("scheduled", status(JobStatus.SCHEDULED)),
        branch(
            "running",
            status(JobStatus.RUNNING),
            expired=sa.func.count().filter(c.locked_until < sa.func.now()),
        ),
        branch("dead", status(JobStatus.DEAD)),
    ]
    kinds: tuple[str, ...] = tuple(s.value for s in _UNFINISHED)
    if finished:
        kinds = (*STATUSES, *_RECENT)
        branches += [
            # The range on finished_at keeps these two on <table>_finished's recent end.
            branch("done_recent", status(JobStatus.DONE), c.finished_at >= since),
            branch("dead_recent", status(JobStatus.DEAD), c.finished_at >= since),
            # One pass over the rows of both statuses, not one each.
            sa.select(
                c.queue,
                sa.cast(c.status, sa.Text).label("kind"),
                sa.func.count(),
                zero,
                none_time,
            )
            .where(c.status.in_([_lit(JobStatus.DONE), _lit(JobStatus.CANCELLED)]))
            .group_by(c.queue, c.status),
        ]
    counts = sa.union_all(*branches).subquery("counts")
    k = counts.c

    def total(value: Any) -> Any:
        # sum(bigint) is numeric, which the driver hands back as a Decimal.
        return sa.func.coalesce(sa.cast(value, sa.BigInteger), 0)

    per_queue = (
        sa.select(
            k.queue,
            *(total(sa.func.sum(k.n).filter(k.kind == kind)).label(kind) for kind in kinds),
            total(sa.func.sum(k.expired)).label("lease_expired"),
            sa.func.min(k.oldest).label("oldest_ready"),
        )
        .group_by(k.queue)
        .subquery("per_queue")
    )
    p, q = per_queue.c, queues_table.c
    # A ready row at '-infinity' (written by hand): before PostgreSQL 17, subtracting it
    # failed the whole statement ("cannot subtract infinite timestamps").
    oldest = sa.case((sa.func.isfinite(p.oldest_ready), p.oldest_ready), else_=sa.null())
    lag = sa.cast(sa.extract("epoch", sa.func.now() - oldest), sa.Float)
    stmt = (
        sa.select(
            sa.func.coalesce(p.queue, q.name).label("queue"),
            sa.func.coalesce(q.paused, sa.false()).label("paused"),
            q.updated_at,
            *(sa.func.coalesce(p[name], 0).label(name) for name in (*kinds, "lease_expired")),
            lag.label("lag_seconds"),
        )
        .select_from(per_queue.join(queues_table, p.queue == q.name, full=True))
        .order_by("queue")
    )
    if finished and not finite_seconds(window, most=DURATION_MAX_SECONDS):
        raise ValueError(
            f"window must be a number of seconds from 0 to {DURATION_MAX_SECONDS:.0f}, "
            f"got {window!r}"
        )
    params = {"window": timedelta(seconds=window)} if finished else {}
    rows = {r.queue: r._mapping for r in _execute(bind, stmt, params)}
    done_known = isinstance(jobs, Jobs) and jobs.keep_done is not None

    def state(name: str, r: Mapping[str, Any]) -> QueueState:
        def n(kind: str) -> int | None:
            return int(r.get(kind) or 0) if kind in kinds else None

        lag_seconds = r.get("lag_seconds")
        return QueueState(
            queue=name,
            paused=bool(r.get("paused")),
            scheduled=int(r.get("scheduled") or 0),
            ready=int(r.get("ready") or 0),
            running=int(r.get("running") or 0),
            lease_expired=int(r.get("lease_expired") or 0),
            done=n("done"),
            dead=int(r.get("dead") or 0),
            cancelled=n("cancelled"),
            # A ready job from a clock ahead of the database would show a negative lag.
            lag_seconds=None if lag_seconds is None else max(0.0, float(lag_seconds)),
            done_recent=n("done_recent") if done_known else None,
            dead_recent=n("dead_recent"),
            paused_since=r.get("updated_at"),
            limits=jobs.limits(name).describe() if isinstance(jobs, Jobs) else "",
        )

    names = rows.keys() | _registry_queues(jobs)
    return [state(name, rows.get(name, {})) for name in sorted(names)]


_RECENT = ("done_recent", "dead_recent")
#: What ``finished=False`` counts: what no history makes more costly to read.
_UNFINISHED = (JobStatus.SCHEDULED, JobStatus.READY, JobStatus.RUNNING, JobStatus.DEAD)


def stats(bind: Bind, jobs: JobSource, *, window: float = DEFAULT_WINDOW) -> list[QueueState]:
    """Deprecated: :func:`queue_states`, which it is."""
    _deprecated("admin.stats", "admin.queue_states")
    return queue_states(bind, jobs, window=window)


def overview(bind: Bind, jobs: JobSource) -> list[QueueState]:
    """Deprecated: :func:`queue_states` with ``finished=False``, which it is."""
    _deprecated("admin.overview", "admin.queue_states(..., finished=False)")
    return queue_states(bind, jobs, finished=False)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated and goes in the next release: use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


class JobFilters(TypedDict, total=False):
    """The filters of :func:`list_jobs` and :func:`browse_jobs`, declared once; a job is
    listed when it matches every one given.

    ``ids``, ``queue``, ``task`` and ``status`` take one value or several. ``meta``: jobs
    whose ``meta`` has each of these keys with this value, or with a list that contains
    it (``meta={"tags": "vip"}`` finds ``{"tags": ["vip", "eu"]}`` too), read through the
    ``<table>_meta`` GIN index. ``worker``: jobs locked by this worker (``locked_by``).
    ``suspended``: ``True``, durable jobs asleep or waiting for a signal in a step (through
    ``<table>_steps_suspended``); ``False``, every other job.
    """

    ids: Iterable[int] | None
    queue: OneOrMany
    task: OneOrMany
    status: OneOrMany
    meta: Mapping[str, Any] | None
    worker: str | None
    suspended: bool | None


def list_jobs(
    bind: Bind, jobs: JobSource, *, limit: int | None = 50, **filters: Unpack[JobFilters]
) -> list[JobView]:
    """Jobs matching every given filter (:class:`JobFilters`), newest (highest id) first,
    at most ``limit``."""
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= BIGINT_MAX
    ):
        raise ValueError(f"limit must be an integer from 1 to {BIGINT_MAX}, got {limit!r}")
    table = _table(jobs)
    where = _job_filters(table, None, **filters)
    columns = [_readable(table.c[name]) for name in _JOB_FIELDS]
    return _read_jobs(bind, table, columns, where, limit, JobView.from_row)


#: The JSON columns of a job, read as text and decoded row by row (see :func:`_readable`).
_JSON_FIELDS = frozenset({"args", "meta", "progress", "result"})


def _readable(column: Any) -> Any:
    """``column`` as a job list reads it: a time Python cannot hold (``'infinity'``, BC)
    as NULL, JSON as text, decoded row by row (``readable_json``). Rows are not all written
    by this library, and one such value failed the whole list, the dashboard's pages with
    it, for as long as the row was kept: the row could not even be opened to purge it."""
    if isinstance(column.type, sa.DateTime):
        return readable_time(column).label(column.key)
    if column.key in _JSON_FIELDS:
        return sa.cast(column, sa.Text).label(column.key)
    return column


def _job_filters(
    table: sa.Table,
    before_id: int | None,
    *,
    ids: Iterable[int] | None = None,
    queue: OneOrMany = None,
    task: OneOrMany = None,
    status: OneOrMany = None,
    meta: Mapping[str, Any] | None = None,
    worker: str | None = None,
    suspended: bool | None = None,
) -> list[sa.ColumnElement[bool]]:
    """The WHERE of a job list: every given filter (``ValueError`` for a bad one)."""
    c = table.c
    statuses = _statuses(status, STATUSES, "list")
    where = _filters(table, ids=_ids(ids), queue=queue, task=task, statuses=statuses)
    if meta is not None:
        where += meta_filter(table, meta)
    if worker is not None:
        where.append(c.locked_by == worker)
    if suspended is not None:
        if not isinstance(suspended, bool):
            raise ValueError(f"suspended filter must be True or False, got {suspended!r}")
        st = companion_tables(table).steps
        # A job is suspended while it is scheduled with a sleep or a wait open: a step's
        # row keeps its state when an operator cancels (or deletes) the job around it, and
        # a cancelled job was listed as "suspended in a step" for as long as it was kept.
        held = sa.and_(
            c.status == _lit("scheduled"),
            sa.exists().where(
                st.c.job_id == c.id,
                st.c.state.in_([sa.literal(s) for s in SUSPENDED_STEP_STATES]),
            ),
        )
        where.append(held if suspended else ~held)
    if before_id is not None:
        _check_id(before_id, "before_id")
        where.append(c.id < before_id)
    return where


_V = TypeVar("_V")


def _read_jobs(
    bind: Bind,
    table: sa.Table,
    columns: list[Any],
    where: list[sa.ColumnElement[bool]],
    limit: int | None,
    make: Callable[[Mapping[str, Any]], _V],
) -> list[_V]:
    """``columns`` of the jobs matching ``where``, newest first, each made into a view."""
    stmt = sa.select(*columns).where(*where).order_by(table.c.id.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    return [make(r._mapping) for r in _execute(bind, stmt)]


def meta_filter(table: sa.Table, meta: Mapping[str, Any]) -> list[sa.ColumnElement[bool]]:
    """``meta @> {key: value}`` (or ``{key: [value]}``) for each pair: containment, the
    operator the ``jsonb_path_ops`` GIN index serves. ``meta IS NOT NULL`` is spelled out
    so that the planner matches the partial index's predicate."""
    if not isinstance(meta, Mapping) or not meta:
        raise ValueError(f"meta filter must be a non-empty dict, got {meta!r}")
    c = table.c
    where: list[sa.ColumnElement[bool]] = [c.meta.is_not(None)]
    for key, value in meta.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"meta filter keys must be non-empty strings, got {key!r}")
        problem = json_problem({key: value}, "meta filter")  # NaN, a NUL: PostgreSQL refused
        if problem is not None:
            raise ValueError(problem)
        one = c.meta.contains({key: value})
        if isinstance(value, (list, dict)):
            where.append(one)
        else:
            where.append(sa.or_(one, c.meta.contains({key: [value]})))
    return where


def get_job(bind: Bind, jobs: JobSource, job_id: int) -> JobView | None:
    """One job by id, or ``None`` if there is no such row (finished jobs may be deleted)."""
    found = list_jobs(bind, jobs, ids=[job_id], limit=1)
    if not found:
        return None
    info = found[0]
    if info.meta and CHILDREN_KEY in info.meta:
        # Its dependent jobs, through <table>_parents (only a parent's page asks).
        c = _table(jobs).c
        ids = _execute(
            bind,
            sa.select(c.id)
            .where(c.parents.overlap(sa.literal([job_id], ARRAY(sa.BigInteger))))
            .order_by(c.id)
            .limit(1000),
        ).scalars()
        info = replace(info, children=list(ids))
    steps = job_steps(bind, jobs, job_id)
    return replace(info, steps=steps) if steps else info


def job_steps(bind: Bind, jobs: JobSource, job_id: int) -> list[StepView]:
    """A job's durable steps, oldest first (none: not a durable job, or not started)."""
    q = jobs.step_queries if isinstance(jobs, Jobs) else _step_queries(_table(jobs))
    # Times Python cannot hold read as missing, as a job's own are (see _readable): one
    # step whose ``until`` was ``'infinity'`` made the job's page, where an operator
    # purges it, a 500.
    records = q.records.with_only_columns(
        *(_readable(column) for column in q.records.selected_columns)
    )
    return [StepView(**r._mapping) for r in _execute(bind, records, {"job_id": job_id})]


@functools.lru_cache(maxsize=16)
def _step_queries(table: sa.Table) -> StepQueries:
    return StepQueries(table)


# -- the dashboard's reads ---------------------------------------------------------------
#
# Each reads through an index whatever the size of the table: the partial indexes of the
# statuses it counts or lists, the primary key for keyset pages (newest first, no OFFSET),
# and the small companion tables.


@dataclass(frozen=True)
class Minute:
    """Outcomes that workers wrote in one minute (``minute`` is its start)."""

    minute: datetime
    succeeded: int
    failed: int
    dead: int


@dataclass(frozen=True)
class Throughput:
    """:func:`throughput`: one :class:`Minute` per minute, oldest first, the current one
    last; for all queues together, and per queue."""

    total: list[Minute]
    queues: dict[str, list[Minute]]


def throughput(bind: Bind, jobs: JobSource, *, minutes: int = 60) -> Throughput:
    """Jobs that succeeded, failed (each failed attempt) and died, per minute, over the
    last ``minutes`` minutes, from ``<table>_throughput``.

    Workers add what their completer wrote every ``presence_interval`` (5 s by default),
    so the current minute fills in as it goes; runs by ``sqla_jobs.testing`` are not
    counted. Read through the table's primary key (minute first).
    """
    most = int(DURATION_MAX_SECONDS // 60)
    if not isinstance(minutes, int) or isinstance(minutes, bool) or not 1 <= minutes <= most:
        raise ValueError(f"minutes must be an integer from 1 to {most}, got {minutes!r}")
    t = companion_tables(_table(jobs)).throughput
    current = sa.func.date_trunc("minute", sa.func.now())
    since = current - sa.literal(timedelta(minutes=minutes - 1), sa.Interval)
    now_row = _execute(bind, sa.select(current)).scalar_one()
    rows = _execute(
        bind,
        sa.select(t.c.minute, t.c.queue, t.c.succeeded, t.c.failed, t.c.dead).where(
            t.c.minute >= since
        ),
    ).all()
    slots = [now_row - timedelta(minutes=i) for i in range(minutes - 1, -1, -1)]
    index = {m: i for i, m in enumerate(slots)}
    total = [[0, 0, 0] for _ in slots]
    per_queue: dict[str, list[list[int]]] = {}
    for r in rows:
        i = index.get(r.minute)
        if i is None:
            continue
        series = per_queue.setdefault(r.queue, [[0, 0, 0] for _ in slots])
        for j, value in enumerate((r.succeeded, r.failed, r.dead)):
            series[i][j] += int(value)
            total[i][j] += int(value)

    def minutes_of(series: list[list[int]]) -> list[Minute]:
        return [Minute(m, *counts) for m, counts in zip(slots, series, strict=True)]

    return Throughput(minutes_of(total), {q: minutes_of(v) for q, v in sorted(per_queue.items())})


@dataclass(frozen=True)
class WorkerInfo(_q.WorkerReport):
    """A worker's row of ``<table>_workers``: what it reported (the fields of
    :class:`~sqla_jobs._queries.WorkerReport`, first) and the times the database keeps.
    ``alive``: it reported within three of its presence intervals; a worker that stopped
    cleanly deleted its row, so a row that is not alive is a worker that died (or cannot
    reach the database)."""

    #: None where the row holds a time Python cannot (``'infinity'``, a BC date).
    started_at: datetime | None
    last_seen: datetime | None
    expires_at: datetime | None
    alive: bool


def list_workers(bind: Bind, jobs: JobSource) -> list[WorkerInfo]:
    """Every worker with a row: alive ones first, then by name.

    Its times are read as the job lists read theirs (see :func:`_readable`): a row whose
    ``expires_at`` was ``'infinity'`` made the overview and the workers page a 500 for
    as long as it was kept."""
    w = companion_tables(_table(jobs)).workers
    alive = (w.c.expires_at > sa.func.now()).label("alive")
    stmt = sa.select(*(_readable(column) for column in w.c), alive).order_by(alive.desc(), w.c.name)
    return [
        WorkerInfo(**{f: r._mapping[f] for f in WorkerInfo.__dataclass_fields__})
        for r in _execute(bind, stmt)
    ]


@dataclass(frozen=True)
class JobSummary:
    """One job as a list shows it: a preview of its arguments and the last line of its
    last error rather than all of them (each may be megabytes)."""

    id: int
    queue: str
    task: str
    status: str
    priority: int
    attempts: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    finished_at: datetime | None
    locked_by: str | None
    locked_until: datetime | None
    args_preview: str
    error: str | None

    @property
    def seen(self) -> SeenJob:
        return SeenJob(self.id, self.attempts, self.status)

    @classmethod
    def of(cls, fields: Mapping[str, Any], args_text: str | None, error: str | None) -> JobSummary:
        """A summary from a job's columns, its arguments as JSON text (the first
        characters are enough) and its last error (its end is enough)."""
        preview = args_text or ""
        if len(preview) > _PREVIEW:
            preview = preview[:_PREVIEW] + "…"
        return cls(
            **{name: fields[name] for name in _SUMMARY_FIELDS},
            args_preview=preview,
            error=_present.last_line(error),
        )


#: The columns a JobSummary has as they are.
_SUMMARY_FIELDS: tuple[str, ...] = tuple(
    f for f in JobSummary.__dataclass_fields__ if f not in ("args_preview", "error")
)


@dataclass(frozen=True)
class JobPage:
    """One page of :func:`browse_jobs`.

    ``older`` is the ``before_id`` of the next (older) page, ``None`` at the end.
    ``searched_to`` is set when an argument search stopped at its window: no match was
    found among the jobs newer than it beyond those listed, and ``older`` goes on below.
    """

    jobs: list[JobSummary]
    older: int | None
    searched_to: int | None
    search: str | None


#: Jobs an argument search looks at per page, newest first: a search that matches
#: nothing must not read the whole table. The page then offers to search further back.
SEARCH_WINDOW = 10_000

_PREVIEW = 160


def parse_search(text: str | None) -> tuple[str, Any] | None:
    """What a search box holds: ``("id", 42)`` for ``42`` or ``#42``; ``("contains",
    {...})`` for a JSON object or ``key=value`` pairs separated by spaces (values read as
    JSON when they parse, else as strings), matched as ``args @> ...``; else ``("text",
    ...)``, a case-insensitive substring of the arguments' JSON. ``ValueError`` names a
    problem: a search longer than :data:`SEARCH_MAX_CHARS`, JSON nested deeper than
    :data:`SEARCH_MAX_DEPTH`, or a value PostgreSQL cannot compare (``NaN``, ``Infinity``,
    a number past what a float holds, a NUL, a lone surrogate).

    It reads the text word by word, each character once: its time is linear in the text
    whatever the text holds (the regular expression it replaces backtracked
    exponentially on ``a=a=a=...``, and a dashboard shares the application's process)."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    if len(text) > SEARCH_MAX_CHARS:
        raise ValueError(
            f"search: {len(text):,} characters; a search is at most {SEARCH_MAX_CHARS:,}"
        )
    digits = text[1:] if text.startswith("#") else text
    if digits.isascii() and digits.isdigit():
        value = int(digits)
        if not 1 <= value <= 2**63 - 1:
            raise ValueError(f"not a job id: {text!r}")
        return ("id", value)
    if text.startswith("{"):
        if json_text_depth(text) > SEARCH_MAX_DEPTH:
            raise ValueError(_TOO_DEEP)
        try:
            obj = json.loads(text)
        except RecursionError:
            raise ValueError(_TOO_DEEP) from None
        except ValueError as exc:
            raise ValueError(f"search: not a JSON object: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError('search: a JSON search must be an object, like {"user_id": 42}')
        _check_searchable(obj)
        return ("contains", obj)
    pairs = _search_pairs(text)
    if pairs is not None:
        _check_searchable(pairs)
        return ("contains", pairs)
    problem = text_problem(text)
    if problem is not None:
        raise ValueError(f"search: the text {problem}")
    return ("text", text)


#: The longest search :func:`parse_search` takes, in characters: far more than a person
#: types or a JSON object of a few keys needs, and a bound on what one request costs.
SEARCH_MAX_CHARS = 10_000
#: How deeply a JSON search may nest; the arguments it is compared with may nest deeper.
SEARCH_MAX_DEPTH = 32
_TOO_DEEP = f"search: JSON nested more than {SEARCH_MAX_DEPTH} levels deep"
_SEARCH_KEY = re.compile(r"[A-Za-z_][\w.-]*")


def _search_pairs(text: str) -> dict[str, Any] | None:
    """``key=value`` words (separated by spaces, commas around them ignored) as a dict,
    or None when a word is not one; a value is JSON when it parses, else a string."""
    found: dict[str, Any] = {}
    for word in text.split():
        word = word.strip(",")
        if not word:
            continue
        key, equals, raw = word.partition("=")
        if not equals or not raw or _SEARCH_KEY.fullmatch(key) is None:
            return None
        if json_text_depth(raw) > SEARCH_MAX_DEPTH:
            raise ValueError(_TOO_DEEP)
        try:
            found[key] = json.loads(raw)
        except RecursionError:
            raise ValueError(_TOO_DEEP) from None
        except ValueError:
            found[key] = raw
    return found or None


def _check_searchable(obj: dict[str, Any]) -> None:
    """Refuse, naming it, what PostgreSQL could not take as the ``jsonb`` of ``@>``: a
    value nested too deeply, a number that is not finite (``NaN``, ``Infinity``, or
    ``1e999``, which JSON reads as infinity), a string it cannot store."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > SEARCH_MAX_DEPTH:
                raise ValueError(_TOO_DEEP)
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"search: {value!r} is not a number PostgreSQL's JSON can hold (numbers "
                "must be finite)"
            )
    problem = json_problem(obj, "search")
    if problem is not None:
        raise ValueError(problem)


def browse_jobs(
    bind: Bind,
    jobs: JobSource,
    *,
    search: str | None = None,
    before_id: int | None = None,
    limit: int = 50,
    **filters: Unpack[JobFilters],
) -> JobPage:
    """A page of job summaries, newest first, by keyset: ``before_id`` is the ``older`` of
    the previous page. Filters as :func:`list_jobs` (:class:`JobFilters`), plus a
    ``search`` (see :func:`parse_search`).

    A search on the arguments looks at :data:`SEARCH_WINDOW` jobs (matching the filters)
    per page at most, so a search that matches little never reads the whole table.
    """
    table = _table(jobs)
    c = table.c
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit!r}")
    where = _job_filters(table, before_id, **filters)
    parsed = parse_search(search)
    columns = [
        *(_readable(c[name]) for name in _SUMMARY_FIELDS),
        sa.func.left(sa.cast(c.args, sa.Text), _PREVIEW + 1).label("args_text"),
        sa.func.right(c.last_error, 400).label("error_text"),
    ]

    def summaries(extra: list[sa.ColumnElement[bool]], n: int) -> list[JobSummary]:
        return _read_jobs(bind, table, columns, [*where, *extra], n, _summary)

    if parsed is None or parsed[0] == "id":
        extra = [] if parsed is None else [c.id == parsed[1]]
        found = summaries(extra, limit + 1)
        older: int | None = found[limit - 1].id if len(found) > limit else None
        return JobPage(found[:limit], older, None, search)
    kind, value = parsed
    if kind == "contains":
        hit: sa.ColumnElement[bool] = c.args.contains(value)
    else:
        pattern = "%" + re.sub(r"([\\%_])", r"\\\1", value) + "%"
        hit = sa.cast(c.args, sa.Text).ilike(pattern)
    window = (
        sa.select(c.id, hit.label("hit")).where(*where).order_by(c.id.desc()).limit(SEARCH_WINDOW)
    )
    ids_found: list[int] = []
    scanned = 0
    last: int | None = None
    for row in _execute(bind, window):
        scanned += 1
        last = row.id
        if row.hit:
            ids_found.append(row.id)
            if len(ids_found) > limit:
                break
    searched_to = None
    if len(ids_found) > limit:
        older = ids_found[limit - 1]
        ids_found = ids_found[:limit]
    elif scanned == SEARCH_WINDOW:
        older = searched_to = last
    else:
        older = None
    found = summaries([_id_in(c.id, ids_found)], limit) if ids_found else []
    return JobPage(found, older, searched_to, search)


def _summary(row: Mapping[str, Any]) -> JobSummary:
    return JobSummary.of(row, row["args_text"], row["error_text"])


def max_job_id(bind: Bind, jobs: JobSource) -> int:
    """The highest job id now (0 for an empty table): the ``up_to_id`` of a selection
    counted now, so that jobs enqueued later are left out of the action."""
    c = _table(jobs).c
    return int(_execute(bind, sa.select(sa.func.coalesce(sa.func.max(c.id), 0))).scalar_one())


class NoSuchSchedule(LookupError):
    """:func:`run_schedule`: there is no schedule of that name."""


def run_schedule(bind: Bind, jobs: Jobs, name: str) -> int:
    """Enqueue the job of schedule ``name`` now, as its next tick would; return its id.

    The schedule keeps its place in time: its next tick still comes when due. Needs the
    registry, whose task decides the job's queue and checks its arguments (``TypeError``
    for a bare model); :class:`NoSuchSchedule` (a ``LookupError``) if there is no such
    schedule, and :class:`~sqla_jobs.errors.EnqueueError` if its job cannot be enqueued:
    its task is not in this registry (:class:`~sqla_jobs.errors.UnknownTaskError`, a
    ``LookupError`` too: tell them apart by catching ``EnqueueError`` first), or its
    stored arguments do not fit the task.
    """
    if not isinstance(jobs, Jobs):
        raise TypeError("running a schedule needs the Jobs registry, not only the model")
    s = companion_tables(jobs.table).schedules
    row = _execute(bind, sa.select(s).where(s.c.name == name)).first()
    if row is None:
        raise NoSuchSchedule(f"no schedule named {name!r}")
    try:
        # As a tick makes it (a handler's **kwargs were nested a level deeper here too).
        values = tick_values(jobs, row.task, dict(row.args), row.queue, row.priority)
    except TypeError as exc:  # stored arguments its handler does not take
        raise EnqueueError(str(exc)) from None
    values.pop("unique_key", None)  # a task's own key: a schedule run is not unique
    stmt = pg_insert(jobs.table).values(**values).returning(jobs.table.c.id)
    job_id = int(_execute(bind, stmt).scalar_one())
    if jobs.events.wants("enqueued"):
        # Heard of at commit, as a tick's job is (the metrics' counter counted neither).
        connection = bind if isinstance(bind, sa.Connection) else bind.connection()
        _announce(connection, jobs, [values])
    return job_id


# -- acting -------------------------------------------------------------------------------


class SeenJob(NamedTuple):
    """A job as an operator saw it: its id, and the ``attempts`` and ``status`` it had.

    ``attempts`` grows at every claim and ``status`` changes at every step, so the pair
    names one moment of the job's life. Given as ``seen=``, an action touches a job only if
    it is still at that moment: a job that was retried, claimed or finished since the page
    was drawn is left alone (and :func:`act` says so).
    """

    id: int
    attempts: int
    status: str


@dataclass(frozen=True)
class Selection:
    """The jobs an action is asked to act on, as its caller gave them: those that match
    *all* the given selectors (see the module's "Selecting jobs"). ``seen`` guards the
    selection (see :class:`SeenJob`); ``up_to_id`` leaves out the jobs enqueued after it
    was counted; ``older_than`` (purge only) keeps the jobs younger than that."""

    ids: Iterable[int] | None = None
    queue: OneOrMany = None
    task: OneOrMany = None
    status: OneOrMany = None
    all_jobs: bool = False
    seen: Iterable[SeenJob] | None = None
    up_to_id: int | None = None
    older_than: float | timedelta | None = None

    def where(
        self,
        table: sa.Table,
        allowed: tuple[str, ...],
        default: tuple[str, ...],
        action: str,
        *,
        status_from_seen: bool = False,
    ) -> tuple[list[int] | None, tuple[str, ...], list[sa.ColumnElement[bool]], Any]:
        """The ids, the statuses, the WHERE of the action (``ValueError`` for a selection it
        refuses), and the seen jobs it is guarded by."""
        if self.older_than is not None and action != "purge":
            raise ValueError(f"older_than selects jobs to purge, not to {action}")
        ids, guard = _seen(self.ids, self.seen)
        status = self.status
        if status_from_seen and guard is not None and status is None:
            status = sorted({s.status for s in guard} & set(allowed)) or None
        statuses = _statuses(status, allowed, action) or default
        where = _selection(
            table,
            ids,
            self.queue,
            self.task,
            status,
            statuses,
            self.all_jobs,
            extra=self.older_than is not None,
        )
        where += _guards(table, guard, self.up_to_id)
        return ids, statuses, where, guard


class Selectors(TypedDict, total=False):
    """The keyword selectors of :func:`retry_jobs`, :func:`retry_report`,
    :func:`cancel_jobs` and :func:`purge_jobs`, declared once: ``queue``, ``task`` and
    ``status`` (one value or several), ``all_jobs``, ``seen`` and ``up_to_id``, as in
    :class:`Selection`."""

    queue: OneOrMany
    task: OneOrMany
    status: OneOrMany
    all_jobs: bool
    seen: Iterable[SeenJob] | None
    up_to_id: int | None


class Acting(Selectors, total=False):
    """The keywords of :func:`retry_jobs`, :func:`cancel_jobs` and :func:`purge_jobs`: the
    :class:`Selectors`, and ``dry_run`` (count the jobs that would be acted on, change
    nothing; False by default)."""

    dry_run: bool


def retry_jobs(
    bind: Bind, jobs: JobSource, ids: Iterable[int] | None = None, **options: Unpack[Acting]
) -> int:
    """Put dead or cancelled jobs back to ``ready`` now; return how many.

    ``attempts`` is left as it is: ``(id, attempts)`` names one claim, and the completion
    guard relies on it never going down (a late worker of an old attempt must keep
    matching nothing). So ``max_attempts`` is raised to at least ``attempts + 1``: the job
    gets one more attempt, and its retry policy applies again if that one fails too.
    ``last_error`` is kept until the next attempt overwrites it.

    A job with a ``unique_key`` is skipped while a live job holds the same key (the
    database would refuse two), and of several dead jobs sharing one key only the newest
    comes back.

    Workflows (``after=``, groups): a retried job brings back the jobs it had cancelled by
    ending (its children, and theirs, down the chain), waiting for it again; they are not
    counted here (:func:`retry_report` lists them). A child cancelled that way is itself
    retried only back to waiting, and only once none of the jobs it waits for is dead or
    cancelled: while one is, it is skipped (retry that one instead). One whose ended
    parent was deleted since (pruned, purged) is skipped for good: that parent can never
    succeed, and the child is enqueued anew if it must run.

    The workers of the touched queues are woken with a NOTIFY, sent at commit.

    :param seen: act only on these jobs, and only while each still has the attempts and
        status it was seen with (see :class:`SeenJob`).
    :param up_to_id: leave out jobs with a higher id: those enqueued after the operator
        counted the selection.
    """
    return _run("retry", bind, jobs, ids, options)


def retry_report(
    bind: Bind,
    jobs: JobSource,
    ids: Iterable[int] | None = None,
    **selectors: Unpack[Selectors],
) -> ActionReport:
    """:func:`retry_jobs`, saying what it did: the jobs retried (``acted``), the cancelled
    children it left alone and why (``skipped``: a job they wait for is still dead or
    cancelled), and the jobs that came back waiting because a job they wait for was
    retried (``rearmed``)."""
    return _act_on("retry", bind, jobs, Selection(ids, **selectors))


@dataclass(frozen=True)
class _Retried:
    acted: list[int]
    blocked: list[tuple[int, str]]
    rearmed: list[int]


def _retry_where(
    table: sa.Table, selection: Selection
) -> tuple[list[sa.ColumnElement[bool]], sa.ColumnElement[bool]]:
    """The WHERE of a retry, and what holds a selected job back: a child cancelled because
    a job it waits for ended, which is still dead or cancelled."""
    ids, statuses, where, guard = selection.where(table, RETRYABLE, RETRYABLE, "retry")
    queue, task, up_to_id = selection.queue, selection.task, selection.up_to_id
    c = table.c

    # Unique keys: no live twin, and no newer retry candidate with the same key.
    live = table.alias("live_twin")
    newer = table.alias("newer_twin")
    newer_where = _filters(newer, ids=ids, queue=queue, task=task, statuses=statuses)
    newer_where += _guards(newer, guard, up_to_id)
    where.append(
        sa.or_(
            c.unique_key.is_(None),
            sa.and_(
                ~sa.exists().where(
                    live.c.unique_key == c.unique_key,
                    live.c.status.in_([_lit(s) for s in LIVE_STATUSES]),
                ),
                ~sa.exists().where(
                    newer.c.unique_key == c.unique_key, newer.c.id > c.id, *newer_where
                ),
            ),
        )
    )
    held = sa.and_(_q.cancelled_while_held(table), _q.blocked_by_parent(table))
    return where, sa.or_(held, _still_running(table), _no_attempt_left(table))


def _still_running(table: sa.Table) -> sa.ColumnElement[bool]:
    """A job cancelled while it ran whose lease has not passed: its handler, which a
    cancel does not stop (a thread cannot be), may still be running, and a retry now
    would run the job a second time beside it."""
    c = table.c
    # coalesce: a NULL lease must read false, not NULL, under the NOT of the retry's WHERE
    leased = sa.func.coalesce(c.locked_until > sa.func.now(), sa.false())
    return sa.and_(c.status == _lit("cancelled"), leased)


def _no_attempt_left(table: sa.Table) -> sa.ColumnElement[bool]:
    """A job at the largest ``attempts`` the column holds: a retry gives it one more
    attempt (``max_attempts`` at least ``attempts + 1``), which cannot be written (the
    retry failed whole, "integer out of range")."""
    return table.c.attempts >= INT_MAX


def _retry_count(bind: Bind, jobs: JobSource, selection: Selection) -> int:
    table = _table(jobs)
    where, held = _retry_where(table, selection)
    return _count(bind, table, [*where, ~held])


def _retry(bind: Bind, jobs: JobSource, selection: Selection) -> _Retried:
    table = _table(jobs)
    queries = _queries(jobs)
    where, held = _retry_where(table, selection)
    c = table.c
    # Cancelled children among the selection (by a parent, or by an operator while they
    # waited for their parents): held back while a job they wait for is dead or cancelled
    # (the walk below may bring them back), else back to waiting. Both as the selection
    # was before this retry, as the dry run counts them.
    ended = sa.case((_q.blocked_by_parent(table), _q.first_ended_parent(table)), else_=sa.null())
    marked = _execute(
        bind,
        sa.select(
            c.id, ended.label("ended"), _q.cancelled_by_parent(table).label("by_parent")
        ).where(*where, _q.cancelled_while_held(table)),
    ).all()
    held_back = [r for r in marked if r.ended is not None]
    # The lease as the job lists read it (None: a time Python cannot hold, 'infinity').
    leased = _execute(
        bind,
        sa.select(c.id, readable_time(c.locked_until).label("locked_until")).where(
            *where, _still_running(table)
        ),
    ).all()
    spent = _execute(
        bind, sa.select(c.id).where(*where, _no_attempt_left(table), ~_still_running(table))
    ).scalars()
    spent = list(spent)
    where.append(~held)
    retried = (
        sa.update(table)
        # A child cancelled while held comes back waiting for its parents, not ready.
        .where(*where, ~_q.cancelled_while_held(table))
        .values(
            status=JobStatus.READY,
            run_at=sa.func.now(),
            finished_at=None,
            locked_until=None,
            locked_by=None,
            max_attempts=sa.func.greatest(c.max_attempts, c.attempts + 1),
        )
        .returning(c.id, c.queue)
    )
    rows = _past_uncommitted_twins(bind, table, retried)
    selected: list[Any] = []
    free = [r.id for r in marked if r.ended is None]
    if free:
        chosen = c.id.in_(free)
        _execute(bind, _q.lock_rearm_parents(table, chosen, chosen=True)).all()
        selected = _execute(bind, _q.rearm_children(table, chosen, chosen=True)).all()
    # What the retried jobs had cancelled (or counted down) by ending comes back, down the
    # chain: each step's parents are the last step's jobs whose children were settled.
    frontier: list[int] = [r.id for r in selected if r.settled]
    if rows:
        unsettle = {"parent_ids": [r.id for r in rows]}
        frontier += _execute(bind, queries.unsettle, unsettle).scalars()
    walked: list[Any] = []
    while frontier:
        step = {"parent_ids": frontier}
        # They are no longer ended: the children they cancelled that stay cancelled (another
        # parent is) must not be held back by them once they succeed and are deleted.
        _execute(bind, queries.forget_parents, step)
        _execute(bind, queries.rewait_children, step).all()
        _execute(bind, queries.lock_rearm_parents, step).all()
        came = _execute(bind, queries.rearm_children, step).all()
        walked += came
        frontier = [r.id for r in came if r.settled]
    ready = {r.queue for r in (*selected, *walked) if r.status == JobStatus.READY}
    _notify(bind, table, {r.queue for r in rows} | ready)
    back = {r.id for r in walked}
    blocked = [(r.id, _held_reason(r.ended, r.by_parent)) for r in held_back if r.id not in back]
    blocked += [(r.id, _may_still_run("retry", r.locked_until)) for r in leased]
    blocked += [
        (
            i,
            f"it has used the largest number of attempts a job can have ({INT_MAX:,}): "
            "enqueue it anew instead",
        )
        for i in spent
    ]
    direct = {r.id for r in selected}
    blocked += [(i, "a job it waits for ended meanwhile") for i in free if i not in direct]
    return _Retried([r.id for r in (*rows, *selected)], blocked, [r.id for r in walked])


def _lease_end(value: datetime | None) -> str:
    return "-" if value is None else f"{value:%Y-%m-%d %H:%M:%S %Z}"


def _may_still_run(verb: str, locked_until: datetime | None) -> str:
    """Why a retry or a purge left a job cancelled while it ran (see _still_running)."""
    return (
        f"it was cancelled while it ran, and its handler may still be running: {verb} it "
        f"once its lease has passed ({_lease_end(locked_until)})"
    )


def _past_uncommitted_twins(bind: Bind, table: sa.Table, retried: sa.Update) -> list[Any]:
    """Run the retry's UPDATE. Its "no live twin" test cannot see a twin whose enqueue
    has not committed: the UPDATE then waits on that twin's key in ``<table>_unique`` and
    fails with a unique violation once it commits (it raised ``IntegrityError`` where the
    job should have been skipped). In a savepoint, rolled back on that violation and run
    again: the twin is committed by then, and the job is left alone as any other whose
    key is held."""
    unique_index = _unique_index_name(bind, table, retried)
    for _ in range(3):
        savepoint = bind.begin_nested() if bind.in_transaction() else contextlib.nullcontext()
        try:
            with savepoint:
                return list(_execute(bind, retried).all())
        except sa.exc.IntegrityError as exc:
            diag = getattr(exc.orig, "diag", None)
            if getattr(diag, "constraint_name", None) != unique_index:
                raise
    return list(_execute(bind, retried).all())


def _unique_index_name(bind: Bind, table: sa.Table, stmt: sa.Update) -> str:
    """The name the database knows ``<table>_unique`` by (the unique index over
    ``unique_key``), which a unique violation reports. A naming convention for indexes
    (``"ix": "ix_%(table_name)s_%(constraint_name)s"``) renames it, and SQLAlchemy
    shortens a name that comes out over the dialect's limit: compared with
    ``<table>_unique`` only, the violation of a twin was raised as an ``IntegrityError``."""
    # A Session's dialect is that of the engine it runs ``stmt`` on.
    dialect = bind.get_bind(clause=stmt).dialect if isinstance(bind, Session) else bind.dialect
    for index in table.indexes:
        columns = index.expressions
        if index.unique and len(columns) == 1 and columns[0] is table.c.unique_key:
            rendered = dialect.identifier_preparer.format_index(index)
            if rendered.startswith('"'):
                return rendered[1:-1].replace('""', '"')
            return rendered
    return derived_name(table.name, "unique")


def _held_reason(ended: str | None, by_parent: bool = True) -> str:
    parent, _, status = (ended or "? dead").partition(" ")
    if status == "deleted":  # recorded by the cancel, pruned or purged since
        return (
            f"it was cancelled because job {parent}, which it waited for, ended dead or "
            "cancelled; the job it waited for was deleted since (pruned or purged) and can "
            "never succeed: enqueue this job anew"
        )
    if not by_parent:  # cancelled by an operator while it waited
        return f"job {parent}, which it waits for, is {status}: retry that job first"
    return (
        f"it was cancelled because job {parent}, which it waits for, ended; that job is "
        f"{status}: retry it, and the jobs it cancelled come back with it"
    )


def _queries(jobs: JobSource) -> Queries:
    """The registry's statements, or (given a model or a table) the table's."""
    return jobs.queries if isinstance(jobs, Jobs) else Queries(_table(jobs))


def cancel_jobs(
    bind: Bind, jobs: JobSource, ids: Iterable[int] | None = None, **options: Unpack[Acting]
) -> int:
    """Cancel scheduled, ready and running jobs; return how many.

    A cancelled job keeps its row (``finished_at`` set) until it is purged or pruned.
    A *running* job is cancelled too, and keeps its lease, no longer renewed: the
    handler may run on until it passes, so :func:`retry_jobs` leaves the job alone until
    then (it would run twice at once). The worker running it can no longer change it,
    since completing, failing and heartbeating all require ``status = 'running'``.
    Workers are asked (NOTIFY, at commit) to heartbeat at once; the heartbeat finds the
    job gone and sets :attr:`ClaimedJob.cancelled <sqla_jobs.ClaimedJob.cancelled>`,
    which a long handler checks between steps. The handler itself is not interrupted.

    ``seen`` and ``up_to_id`` narrow the selection as for :func:`retry_jobs`.

    A running transactional job's row is held by its run under ``REPEATABLE READ`` or
    ``SERIALIZABLE``: the cancel waits for the run to end. Under those levels it then
    raises a serialization failure (SQLSTATE ``40001``) if the run committed meanwhile,
    its snapshot being older than the run's commit; at ``READ COMMITTED``
    (:data:`ACTION_ISOLATION`, which the dashboard and ``sqla-jobs`` use for their own
    transactions) it reads the job as the run left it, and does not count it. See
    :func:`act` on running an action again.
    """
    return _run("cancel", bind, jobs, ids, options)


def _cancel(bind: Bind, jobs: JobSource, selection: Selection, dry_run: bool) -> list[int]:
    table = _table(jobs)
    _, _, where, _ = selection.where(table, CANCELLABLE, CANCELLABLE, "cancel")
    if dry_run:
        return [0] * _count(bind, table, where)
    # Lock the targets first, to learn the status each had: RETURNING only sees the new row.
    c = table.c
    target = (
        sa.select(c.id, c.status.label("was"))
        .where(*where)
        .with_for_update(key_share=True)
        .cte("target")
    )
    changed = (
        sa.update(table)
        .where(c.id == target.c.id)
        # A running job keeps its lease, no longer renewed: its handler may still run
        # until it passes, and a retry waits for that (see _still_running).
        .values(
            status=JobStatus.CANCELLED,
            finished_at=sa.func.now(),
            locked_until=sa.case((target.c.was == _lit("running"), c.locked_until), else_=None),
        )
        # A waiter on a kept result hears of the cancel at commit, not at its re-check.
        .returning(c.id, target.c.was, _q.announce_end(c, result_channel(table)))
    )
    rows = _execute(bind, changed).all()
    if rows:
        # Workflows: what waits on a cancelled job is cancelled too (or released, for
        # jobs that run anyway), in this transaction. One index probe when nothing waits.
        settle_children(bind, _queries(jobs), [], [r.id for r in rows])
    if any(r.was == JobStatus.RUNNING for r in rows):
        # Ask workers to heartbeat now rather than at their next beat: the handler of a
        # cancelled running job learns it within moments (sent at commit).
        _execute(bind, sa.select(sa.func.pg_notify(notify_channel(table), CANCEL_PAYLOAD)))
    return [r.id for r in rows]


def purge_jobs(
    bind: Bind,
    jobs: JobSource,
    ids: Iterable[int] | None = None,
    *,
    older_than: float | timedelta | None = None,
    **options: Unpack[Acting],
) -> int:
    """Delete finished jobs (done, dead, cancelled); return how many.

    Jobs that have not run yet (``scheduled``, ``ready``) are deleted only when ``status``
    names them: deleting work nobody looked at should take a deliberate word. Running jobs
    are never deleted (``ValueError``): their worker is still at it; cancel them first. A
    job cancelled while it ran is left alone until its lease has passed, as
    :func:`retry_jobs` leaves it: its handler may still be running, and the job holds its
    key (``key_order``) until then (:func:`act` reports it skipped, saying so).

    :param older_than: only jobs finished (or, for unfinished ones, created) longer ago
        than this many seconds.

    ``seen`` and ``up_to_id`` narrow the selection as for :func:`retry_jobs`.
    """
    return _run("purge", bind, jobs, ids, options, older_than=older_than)


def _purge(
    bind: Bind, jobs: JobSource, selection: Selection, dry_run: bool
) -> tuple[list[int], list[tuple[int, str]]]:
    """The ids deleted (zeros for a dry run: only their count is known), and the jobs left
    alone with why: cancelled while they ran, their lease not passed yet."""
    table = _table(jobs)
    older_than = selection.older_than
    _, statuses, where, _ = selection.where(
        table,
        PURGEABLE,
        PURGEABLE_BY_DEFAULT,
        "purge",
        # A job seen scheduled or ready and deleted by id is a deliberate choice.
        status_from_seen=True,
    )
    if older_than is not None:
        age = older_than if isinstance(older_than, timedelta) else timedelta(seconds=older_than)
        if age < timedelta(0):
            raise ValueError(f"older_than must be >= 0, got {older_than!r}")
        cutoff = sa.func.now() - sa.literal(age, sa.Interval)
        if set(statuses) <= set(FINISHED_STATUSES):
            # Every path to a finished status sets finished_at; this form can read through
            # the partial index on finished jobs.
            where.append(table.c.finished_at < cutoff)
        else:
            where.append(sa.func.coalesce(table.c.finished_at, table.c.created_at) < cutoff)
    # A job cancelled while it ran may still be running until its lease passes (see
    # _still_running): deleted, it no longer held its key (key_order), and the key's next
    # job started beside its handler. Left alone, as a retry leaves it; both statements
    # read the transaction's one now(), so what is skipped is exactly what is reported.
    c = table.c
    leased = _still_running(table)
    if dry_run:
        return [0] * _count(bind, table, [*where, ~leased]), []
    running_on = _execute(
        bind,
        sa.select(c.id, readable_time(c.locked_until).label("locked_until")).where(*where, leased),
    ).all()
    where.append(~leased)
    # A waiter on the kept result of a job deleted before it finished hears of it at
    # commit (its next look raises LookupError), not at its re-check.
    unfinished = c.status.notin_([_lit(s) for s in FINISHED_STATUSES])
    deleted = (
        sa.delete(table)
        .where(*where)
        .returning(
            c.id,
            c.status,
            # Unsettled only: a dead or cancelled parent whose children were settled when
            # it ended has {"sqla_jobs.children": false}, and settling them again counted
            # a child that runs anyway down twice (it ran before its other parents).
            sa.func.coalesce(_q._unsettled(c), sa.false()).label("has_children"),
            _q.announce_end(c, result_channel(table), unfinished),
        )
    )
    rows = _execute(bind, deleted).all()
    # Workflows: a deleted parent that did not succeed will not: what waits on it is
    # cancelled (or released, for jobs that run anyway), in this transaction, as a cancel
    # does. A job that died by its lease left that to retention, and a scheduled or ready
    # one never got to it; without this their children waited forever. Only parents are
    # looked at (a purge of many finished jobs holds few of them).
    ended = [r.id for r in rows if r.status != JobStatus.DONE and r.has_children]
    if ended:
        settle_children(bind, _queries(jobs), [], ended)
    skipped = [(r.id, _may_still_run("delete", r.locked_until)) for r in running_on]
    return [r.id for r in rows], skipped


@dataclass(frozen=True)
class ActionReport:
    """What :func:`act` did (or :func:`preview` would do): the jobs it acted on, and those
    it left alone with why."""

    action: str
    acted: tuple[int, ...]
    #: ``(id, why)`` for each job that was not acted on.
    skipped: tuple[tuple[int, str], ...]
    #: Retry: jobs that came back waiting, not ready, because a job they wait for was
    #: retried (children it had cancelled by ending, and theirs), selected or not.
    rearmed: tuple[int, ...] = ()
    #: :func:`preview`: how many jobs the action would act on (``acted`` is empty).
    counted: int | None = None
    #: :func:`preview`: the selected ids that name no job (nothing is counted then).
    missing: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return len(self.acted) if self.counted is None else self.counted


@dataclass(frozen=True)
class Action:
    """One thing an operator does to jobs, and every word the tools say about it.

    :data:`ACTIONS` is the one table of them: :func:`act` and :func:`preview` take its
    names, and the ``sqla-jobs jobs`` subcommands and the dashboard's buttons, confirm
    pages and notices are drawn from it.
    """

    # What most actions share is a default, so that the table below says only how each
    # one differs: the command is the action's name, the page says what the command
    # says, an action may be told only the statuses it acts on by default, and those are
    # what ``--status`` lists. An empty string or tuple means "the default".
    name: str
    #: The statuses it acts on unless told otherwise, and those it may be told to
    #: (default: the same).
    statuses: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    #: The command's words: ``purge``, ``purged`` (``sqla-jobs jobs purge``, its output).
    verb: str = field(default="", kw_only=True)
    past: str = field(kw_only=True)
    #: The page's words, for people rather than scripts: ``delete``, ``deleted``.
    label: str = field(default="", kw_only=True)
    label_past: str = field(default="", kw_only=True)
    #: The button on one job's page.
    button: str = field(kw_only=True)
    #: Whether it cannot be undone (the rows are deleted): a page asks first.
    destroys: bool = field(default=False, kw_only=True)
    #: One line on what it does (``--help``), the whole of it (the subcommand's
    #: description), what happens to each job (a confirm page), and what ``--status``
    #: may name.
    summary: str = field(kw_only=True)
    description: str = field(kw_only=True)
    explanation: str = field(kw_only=True)
    accepted: str = field(default="", kw_only=True)
    _run: Callable[[Bind, JobSource, Selection], ActionReport] = field(repr=False, kw_only=True)
    _count: Callable[[Bind, JobSource, Selection], int] = field(repr=False, kw_only=True)

    def __post_init__(self) -> None:
        allowed = self.allowed or self.statuses
        verb = self.verb or self.name
        defaults = {
            "allowed": allowed,
            "verb": verb,
            "label": self.label or verb,
            "label_past": self.label_past or self.past,
            "accepted": self.accepted or ", ".join(allowed),
        }
        for name, value in defaults.items():
            object.__setattr__(self, name, value)

    def run(self, bind: Bind, jobs: JobSource, selection: Selection) -> ActionReport:
        """Act on the selection (in the caller's transaction)."""
        return self._run(bind, jobs, selection)

    def count(self, bind: Bind, jobs: JobSource, selection: Selection) -> int:
        """How many jobs :meth:`run` would act on now."""
        return self._count(bind, jobs, selection)


def _run_retry(bind: Bind, jobs: JobSource, selection: Selection) -> ActionReport:
    retried = _retry(bind, jobs, selection)
    return ActionReport(
        "retry", tuple(retried.acted), tuple(retried.blocked), tuple(retried.rearmed)
    )


def _run_cancel(bind: Bind, jobs: JobSource, selection: Selection) -> ActionReport:
    return ActionReport("cancel", tuple(_cancel(bind, jobs, selection, False)), ())


def _run_purge(bind: Bind, jobs: JobSource, selection: Selection) -> ActionReport:
    deleted, skipped = _purge(bind, jobs, selection, False)
    return ActionReport("purge", tuple(deleted), tuple(skipped))


#: The actions, by name.
ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action(
            "retry",
            RETRYABLE,
            past="retried",
            button="Retry now",
            summary="put dead or cancelled jobs back to ready",
            description="Put dead or cancelled jobs back to ready, due now, with one more "
            "attempt (attempts is kept, max_attempts raised to at least attempts + 1; "
            "last_error is kept until the next attempt). Idle workers are woken. Jobs a "
            "retried job had cancelled by ending (after=, groups) come back with it, waiting "
            "for it again; such a job is skipped while a job it waits for is still dead or "
            "cancelled.",
            explanation="Each goes back to ready, due now, with one more attempt; idle "
            "workers are woken.",
            _run=_run_retry,
            _count=lambda bind, jobs, selection: _retry_count(bind, jobs, selection),
        ),
        Action(
            "cancel",
            CANCELLABLE,
            past="cancelled",
            button="Cancel",
            summary="cancel scheduled, ready or running jobs",
            description="Cancel scheduled, ready or running jobs. A running job's worker can "
            "no longer complete or retry it; its heartbeat notices and tells the handler.",
            explanation="Each is cancelled; a running one's worker is told to stop it (a "
            "handler is not interrupted, it checks between steps).",
            _run=_run_cancel,
            _count=lambda bind, jobs, selection: len(_cancel(bind, jobs, selection, True)),
        ),
        Action(
            "purge",
            PURGEABLE_BY_DEFAULT,
            PURGEABLE,
            past="purged",
            label="delete",
            label_past="deleted",
            button="Delete",
            destroys=True,
            summary="delete finished jobs",
            description="Delete done, dead or cancelled jobs. Scheduled or ready jobs are "
            "deleted only when --status names them; running jobs never (cancel them first).",
            explanation="Each is deleted for good.",
            accepted="done, dead, cancelled, or (deleting unrun work) scheduled, ready",
            _run=_run_purge,
            _count=lambda bind, jobs, selection: len(_purge(bind, jobs, selection, True)[0]),
        ),
    )
}


def _action(name: str) -> Action:
    """The action of this name (``ValueError`` for another)."""
    found = ACTIONS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown action {name!r}; actions are {', '.join(ACTIONS)}")
    return found


def _run(
    name: str,
    bind: Bind,
    jobs: JobSource,
    ids: Iterable[int] | None,
    options: Acting,
    **extra: Any,
) -> int:
    """What retry_jobs, cancel_jobs and purge_jobs return: how many (would be) acted on.
    ``extra``: the selectors of one action only (purge's ``older_than``)."""
    spec = ACTIONS[name]
    selectors: dict[str, Any] = {**options, **extra}
    dry_run = bool(selectors.pop("dry_run", False))
    selection = Selection(ids, **cast(Selectors, selectors))
    if dry_run:
        return spec.count(bind, jobs, selection)
    return spec.run(bind, jobs, selection).count


def _act_on(name: str, bind: Bind, jobs: JobSource, selection: Selection) -> ActionReport:
    return ACTIONS[name].run(bind, jobs, selection)


def act(
    bind: Bind, jobs: JobSource, action: str, selection: Selection | Iterable[SeenJob]
) -> ActionReport:
    """Retry, cancel or purge the selected jobs, and report job by job: the one path of
    the dashboard's buttons and of ``sqla-jobs jobs retry|cancel|purge``.

    Given the jobs an operator selected, as they saw them (:class:`SeenJob`), each job is
    acted on only if it still has the attempts and status it was seen with and the
    action applies to that status; the others are skipped with the reason (it no longer
    exists, it moved on, it is not something this action applies to, a live job holds
    its unique key). The rows are locked first, so the report is exact: no job changes
    between the check and the action.

    Given a :class:`Selection`, it acts on every job that matches it, as
    :func:`retry_report`, :func:`cancel_jobs` and :func:`purge_jobs` do (a retry's
    report says which jobs came back, and which it held back and why).

    Runs in the caller's transaction, and so is never run again here: the database may
    undo it to let a worker go on, raising ``OperationalError`` with SQLSTATE ``40P01``
    (a deadlock: a worker's outcome write locks some of the same rows, in another order)
    or ``40001`` (a serialization failure: under ``REPEATABLE READ`` or ``SERIALIZABLE``,
    the engine's ``isolation_level`` or the database's ``default_transaction_isolation``,
    a job that changed after the transaction's snapshot was taken, such as a running
    job whose run committed while the action waited for its row). Nothing of the
    transaction is kept then, and acting on the jobs as they were seen is safe to run
    again in a new one: the dashboard and ``sqla-jobs jobs`` do, a few times, and open
    their transactions at ``READ COMMITTED``, where a job that changed while the action
    waited for it is reported as changed rather than failing the action.
    """
    spec = _action(action)
    if isinstance(selection, Selection):
        return spec.run(bind, jobs, selection)
    table = _table(jobs)
    # Each job once, as first seen: a job listed twice (seen at two moments) was counted
    # twice in the report ("Retried 2 jobs" for one).
    first: dict[int, SeenJob] = {}
    for seen in _check_seen(selection):
        first.setdefault(seen.id, seen)
    wanted = list(first.values())
    if not wanted:
        raise ValueError("select at least one job")
    c = table.c
    # In id order, the order in which a worker's statements lock a batch of jobs: in any
    # other (the plan's), an action and a worker's outcome write each held a row the
    # other wanted, and the database undid one of them (a deadlock). Rare with it, not
    # impossible (a worker's write is several statements): see the docstring.
    lock = sa.select(c.id, c.attempts, c.status).where(_id_in(c.id, first)).order_by(c.id)
    # A row about to be deleted needs the full lock; the others the one the claim respects.
    lock = lock.with_for_update(key_share=not spec.destroys)
    now = {r.id: (r.attempts, r.status) for r in _execute(bind, lock)}
    skipped: dict[int, str] = {}
    eligible: list[SeenJob] = []
    for s in wanted:
        current = now.get(s.id)
        if current is None:
            skipped[s.id] = "it no longer exists"
        elif current != (s.attempts, s.status):
            skipped[s.id] = f"it changed: now {current[1]}, attempt {current[0]}"
        elif s.status not in spec.allowed:
            skipped[s.id] = (
                f"{spec.name} applies to {', '.join(spec.allowed)} jobs, not {s.status} ones"
            )
        else:
            eligible.append(s)
    acted: tuple[int, ...] = ()
    rearmed: tuple[int, ...] = ()
    if eligible:
        done = spec.run(bind, jobs, Selection(seen=eligible))
        acted, rearmed = done.acted, done.rearmed
        skipped.update(done.skipped)
    back = set(rearmed)
    for s in eligible:
        if s.id not in acted and s.id not in skipped and s.id not in back:
            skipped[s.id] = "a live job holds its unique key"
    done_ids = set(acted)
    return ActionReport(
        spec.name,
        tuple(s.id for s in wanted if s.id in done_ids),
        tuple((s.id, skipped[s.id]) for s in wanted if s.id in skipped),
        rearmed,
    )


#: The isolation level of the transactions the dashboard and ``sqla-jobs`` open for an
#: action. Under a snapshot (``REPEATABLE READ``), an action that waited for a job's row
#: (a running transactional job, whose run holds it) failed once the run committed
#: ("could not serialize access"), where at ``READ COMMITTED`` it reads the job as the
#: run left it and reports it as changed.
ACTION_ISOLATION = "READ COMMITTED"
#: How many times the dashboard and ``sqla-jobs`` run an action's transaction when the
#: database undoes it (:data:`CONFLICT_STATES`).
ACTION_TRIES = 4


def _again_on_conflict(transaction: Callable[[], _V]) -> _V:
    """Run ``transaction`` (a whole transaction, begun and ended inside it: one the
    dashboard or ``sqla-jobs`` opened for an action) again, up to :data:`ACTION_TRIES`
    times in all, while the database undoes it for another's sake, after a short pause
    of random length (two operators' actions undone by the same worker would otherwise
    meet again). Safe for an action on jobs as they were seen (:class:`SeenJob`): a job
    that changed meanwhile is left alone, and reported so."""
    for attempt in range(1, ACTION_TRIES):
        try:
            return transaction()
        except sa.exc.DBAPIError as exc:
            if not conflicted(exc):
                raise
            log.info(
                "the database undid an action's transaction (%s): running it again", describe(exc)
            )
        time.sleep(random.uniform(0.01, 0.05) * attempt)
    return transaction()


def preview(bind: Bind, jobs: JobSource, action: str, selection: Selection) -> ActionReport:
    """What :func:`act` would do with this selection, changing nothing: how many jobs
    (``count``), the selected ids that name no job (``missing``; then nothing is
    counted), and the selected ids it would leave alone and why (``skipped``: a status,
    queue or task outside the selection). ``ValueError`` for a selection the action
    refuses."""
    spec = _action(action)
    ids = _ids(selection.ids)
    skipped: list[tuple[int, str]] = []
    if ids is not None:
        found = {j.id: j for j in list_jobs(bind, jobs, ids=ids, limit=None)}
        missing = tuple(i for i in ids if i not in found)
        if missing:
            return ActionReport(spec.name, (), (), counted=0, missing=missing)
        statuses = tuple(_names(selection.status, "status") or spec.statuses)
        queues = _names(selection.queue, "queue")
        tasks = _names(selection.task, "task")
        for i in dict.fromkeys(ids):
            job = found[i]
            why = None
            if job.status not in statuses:
                why = f"it is {job.status}; {spec.name} applies to {' or '.join(statuses)} jobs"
            elif queues and job.queue not in queues:
                why = f"it is in queue {job.queue!r}, not in a selected one"
            elif tasks and job.task not in tasks:
                why = f"its task is {job.task!r}, not a selected one"
            if why is not None:
                skipped.append((i, why))
        selection = replace(selection, ids=ids)
    counted = spec.count(bind, jobs, selection)
    return ActionReport(spec.name, (), tuple(skipped), counted=counted)


def _check_seen(seen: Iterable[SeenJob]) -> list[SeenJob]:
    checked: list[SeenJob] = []
    for s in seen:
        job_id, attempts, status = s
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise ValueError(f"job ids must be integers, got {job_id!r}")
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0:
            raise ValueError(f"attempts must be an integer >= 0, got {attempts!r}")
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}; statuses are {', '.join(STATUSES)}")
        checked.append(SeenJob(job_id, attempts, status))
    return checked


def _seen(
    ids: Iterable[int] | None, seen: Iterable[SeenJob] | None
) -> tuple[list[int] | None, list[SeenJob] | None]:
    """The ids selected, and the seen rows that guard them."""
    if seen is None:
        return _ids(ids), None
    guard = _check_seen(seen)
    if ids is not None:
        raise ValueError("give ids or seen, not both")
    return [s.id for s in guard], guard


def _guards(
    table: Any, seen: list[SeenJob] | None, up_to_id: int | None
) -> list[sa.ColumnElement[bool]]:
    c = table.c
    where: list[sa.ColumnElement[bool]] = []
    if seen is not None:
        # One parameter, whatever the number of jobs seen (see _id_in): a JSON object of
        # each id's "attempts status" as seen, which each row looks itself up in (a
        # binary search of the object's keys). Not a join with the seen rows: its plan
        # followed the table's statistics, and once they said no row was in the status
        # acted on (70,000 jobs cancelled since the last ANALYZE, then purged), every row
        # scanned the whole seen list, and the action ran for minutes.
        states: dict[str, list[str]] = {}
        for s in seen:
            states.setdefault(str(s.id), []).append(f"{s.attempts} {s.status}")
        state = sa.cast(c.attempts, sa.Text).concat(" ").concat(sa.cast(c.status, sa.Text))
        where.append(
            sa.literal(states, JSONB)
            .op("->", return_type=JSONB)(sa.cast(c.id, sa.Text))
            .op("?", return_type=sa.Boolean)(state.self_group())
        )
    if up_to_id is not None:
        if not isinstance(up_to_id, int) or isinstance(up_to_id, bool):
            raise ValueError(f"up_to_id must be an integer, got {up_to_id!r}")
        where.append(c.id <= up_to_id)
    return where


def _notify(bind: Bind, table: sa.Table, queues: set[str]) -> None:
    """Wake the workers of these queues (NOTIFY is sent at commit)."""
    if queues:
        q = sa.func.unnest(sa.literal(sorted(queues), ARRAY(sa.Text))).column_valued("q")
        _execute(bind, sa.select(sa.func.pg_notify(notify_channel(table), q)))


# -- queues -------------------------------------------------------------------------------


def pause_queue(bind: Bind, jobs: JobSource, name: str) -> None:
    """Pause a queue: workers stop claiming from it (jobs can still be enqueued).

    Workers read the pause state once per poll interval, so a pause takes effect within
    that; jobs already running finish normally. Pausing a queue that has no jobs yet is
    allowed: it holds back the first ones too.
    """
    _set_paused(bind, jobs, name, True)


def resume_queue(bind: Bind, jobs: JobSource, name: str) -> None:
    """Resume a paused queue, and wake its idle workers (NOTIFY at commit)."""
    table = _table(jobs)
    _set_paused(bind, jobs, name, False)
    _execute(bind, sa.select(sa.func.pg_notify(notify_channel(table), name)))


def paused_queues(bind: Bind, jobs: JobSource) -> set[str]:
    """Names of the paused queues."""
    q = _queues_table(_table(jobs))
    return set(_execute(bind, sa.select(q.c.name).where(q.c.paused)).scalars())


def list_queues(bind: Bind, jobs: JobSource) -> list[QueueInfo]:
    """Every queue known to ``<table>_queues``, the registry, or a live or dead job, by name.

    Queues come from rows of ``<table>_queues`` (paused or resumed once), the queues the
    registry's tasks name, and the queues of scheduled, ready, running and dead jobs,
    each read through the partial index of its status: the ready and dead ones by a
    skip over the index's leading ``queue`` (one index probe per queue, however many
    jobs), the scheduled and running ones (few) from their rows. A queue whose only jobs
    are done or cancelled is not found that way (no index has their queue, and reading
    every finished row is what this avoids); name it in the registry to keep it listed.
    """
    table = _table(jobs)
    q = _queues_table(table)
    known = {r.name: r for r in _execute(bind, sa.select(q.c.name, q.c.paused, q.c.updated_at))}
    names = set(known) | _registry_queues(jobs)
    names.update(_execute(bind, _job_queues(table)).scalars())
    return [
        QueueInfo(
            n,
            bool(known[n].paused) if n in known else False,
            known[n].updated_at if n in known else None,
            jobs.limits(n).describe() if isinstance(jobs, Jobs) else "",
        )
        for n in sorted(names)
    ]


@dataclass(frozen=True)
class BlockedKey:
    """A key of a queue with ``key_order="fifo"`` whose head ended dead or cancelled: the
    jobs behind it wait (``on_head_failure="hold"``) until an operator retries the head
    (it runs first, then the rest of its key) or deletes it (``purge``; then the key goes
    on with its next job)."""

    queue: str
    key: str
    #: The job that holds the key, and how it ended.
    head_id: int
    head_status: str
    finished_at: datetime | None
    #: Jobs of the key behind it (scheduled or ready).
    waiting: int

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_value(v) for k, v in asdict(self).items()}


def blocked_keys(
    bind: Bind, jobs: Jobs, *, queue: str | None = None, limit: int | None = None
) -> list[BlockedKey]:
    """The keys held by a dead or cancelled head, in the queues that ``jobs`` declares with
    ``key_order="fifo"`` and ``on_head_failure="hold"`` (or in ``queue`` alone), by queue
    and key; the first ``limit`` of them, if given.

    Read through ``<table>_key_order`` in its order, a dead or cancelled row at a time,
    each with one probe for a row of its key before it: with a ``limit`` the read stops
    there. It ranked every keyed row of those queues first: after an outage that left
    20,000 keys held, the dashboard's overview read it all every 5 seconds (a second each,
    and 5 MB of page)."""
    if not isinstance(jobs, Jobs):
        raise TypeError("blocked_keys needs the Jobs registry: key order is declared in code")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"blocked_keys: limit is a count of at least 1, got {limit!r}")
    held = [
        name
        for name, limits in jobs.queue_limits.items()
        if limits.key_order == "fifo" and limits.on_head_failure == "hold"
    ]
    if queue is not None:
        held = [name for name in held if name == queue]
    if not held:
        return []
    t = jobs.table
    c = t.c
    statuses = [_lit(s) for s in KEY_ORDER_STATUSES]  # <table>_key_order's rows
    before = t.alias("before_head").c
    waiting_in = t.alias("behind_head").c
    behind = (
        sa.select(sa.func.count())
        .where(
            waiting_in.queue == c.queue,
            waiting_in.concurrency_key == c.concurrency_key,
            waiting_in.status.in_([_lit(s) for s in LIVE_STATUSES]),
        )
        .scalar_subquery()
    )
    stmt = (
        sa.select(c.queue, c.concurrency_key, c.id, c.status, c.finished_at, behind.label("n"))
        .where(
            c.queue.in_(held),
            c.concurrency_key.is_not(None),
            c.status.in_(statuses),
            c.status.in_([_lit(s) for s in RETRYABLE]),
            ~sa.exists().where(
                before.queue == c.queue,
                before.concurrency_key == c.concurrency_key,
                before.status.in_(statuses),
                before.id < c.id,
            ),
            # An earlier job that runs (an operator's retry) is the head: not in
            # <table>_key_order, found through <table>_keys.
            ~sa.exists().where(
                before.queue == c.queue,
                before.concurrency_key == c.concurrency_key,
                before.status == _lit(JobStatus.RUNNING),
                before.id < c.id,
            ),
        )
        .order_by(c.queue, c.concurrency_key)
    )
    if limit is not None:
        stmt = stmt.limit(limit)
    return [
        BlockedKey(r.queue, r.concurrency_key, r.id, r.status, r.finished_at, int(r.n))
        for r in _execute(bind, stmt)
    ]


def _job_queues(table: sa.Table) -> sa.Select[Any]:
    """The distinct queues of the live and dead jobs, read through the partial indexes."""
    c = table.c

    def skip(status: JobStatus) -> sa.Select[Any]:
        # A recursive walk over an index whose first column is queue: each step asks for
        # the next queue name after the last one, which the index answers in one probe.
        def first_after(*where: sa.ColumnElement[bool]) -> Any:
            return (
                sa.select(sa.func.min(c.queue))
                .where(c.status == _lit(status), *where)
                .scalar_subquery()
            )

        walk = sa.select(first_after().label("queue")).cte(f"queues_{status.value}", recursive=True)
        walk = walk.union_all(
            sa.select(first_after(c.queue > walk.c.queue)).where(walk.c.queue.is_not(None))
        )
        return sa.select(walk.c.queue).where(walk.c.queue.is_not(None))

    def few(status: JobStatus) -> sa.Select[Any]:
        return sa.select(c.queue).where(c.status == _lit(status)).distinct()

    return sa.select(
        sa.union(
            skip(JobStatus.READY),
            skip(JobStatus.DEAD),
            few(JobStatus.SCHEDULED),
            few(JobStatus.RUNNING),
        ).subquery("queues")
    )


def _set_paused(bind: Bind, jobs: JobSource, name: str, paused: bool) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"queue name must be a non-empty string, got {name!r}")
    check_name(name, "queue", QUEUE_MAX_BYTES)
    q = _queues_table(_table(jobs))
    stmt = (
        pg_insert(q)
        .values(name=name, paused=paused)
        .on_conflict_do_update(
            index_elements=[q.c.name], set_={"paused": paused, "updated_at": sa.func.now()}
        )
    )
    _execute(bind, stmt)


# -- helpers ------------------------------------------------------------------------------


def source_table(jobs: JobSource) -> sa.Table:
    """The jobs Table of a registry, a model or a table (``TypeError`` for anything else)."""
    return _table(jobs)


def _table(jobs: JobSource) -> sa.Table:
    return jobs.table if isinstance(jobs, Jobs) else job_table(jobs)


def _queues_table(table: sa.Table) -> sa.Table:
    return companion_tables(table)[0]


def _registry_queues(jobs: JobSource) -> set[str]:
    if not isinstance(jobs, Jobs):
        return set()
    return {t.queue for t in jobs.tasks.values()} | set(jobs.queue_limits)


def _execute(bind: Bind, stmt: sa.Executable, params: Mapping[str, Any] | None = None) -> Any:
    if isinstance(bind, ShardedSession):
        # Every function here speaks of one database: each shard numbers its own jobs and
        # keeps its own queues, and a sharded session would send these statements, which
        # name no mapped object, wherever its choosers send such a statement (one shard,
        # or all of them: cancelling job 1 would then cancel one job on every shard).
        raise TypeError(
            "sqla_jobs.admin: a sharded session cannot tell which shard's jobs are meant "
            "(each shard numbers its own); pass that shard's connection, "
            "session.connection(bind_arguments={'shard_id': ...}), or use "
            "sqla_jobs.sharding for every shard"
        )
    return bind.execute(stmt, dict(params or {}))


def _names(value: OneOrMany, what: str) -> list[str] | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    if not names or not all(isinstance(v, str) and v for v in names):
        raise ValueError(f"{what} filter must be one or more non-empty strings, got {value!r}")
    return names


def _statuses(value: OneOrMany, allowed: tuple[str, ...], action: str) -> tuple[str, ...]:
    names = _names(value, "status")
    if names is None:
        return ()
    for s in names:
        if s not in STATUSES:
            raise ValueError(f"unknown status {s!r}; statuses are {', '.join(STATUSES)}")
        if s not in allowed:
            if action == "purge" and s == JobStatus.RUNNING:
                raise ValueError("refusing to purge running jobs: cancel them first")
            raise ValueError(f"{action} applies to {', '.join(allowed)} jobs, not {s!r} ones")
    return tuple(dict.fromkeys(names))


def _ids(ids: Iterable[int] | None) -> list[int] | None:
    if ids is None:
        return None
    values = list(ids)
    for v in values:
        _check_id(v, "job ids")
    return values


def _check_id(value: object, what: str) -> None:
    """A job id (or a bound on ids) the ``bigint`` column can hold: past it PostgreSQL
    refused the statement, aborting the caller's transaction with it."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= BIGINT_MAX:
        raise ValueError(f"{what}: expected an integer from 1 to {BIGINT_MAX}, got {value!r}")


def _id_in(column: Any, ids: Iterable[int]) -> sa.ColumnElement[bool]:
    """``column = ANY(:ids)``: one array parameter. ``IN`` binds one parameter per id, and
    PostgreSQL takes at most 65,535 in a statement: a retry of 40,000 ids by name failed
    (the CLI said it could not connect)."""
    matched: sa.ColumnElement[bool] = column == sa.any_(sa.literal(list(ids), ARRAY(sa.BigInteger)))
    return matched


def _filters(
    table: Any,
    *,
    ids: Iterable[int] | None,
    queue: OneOrMany,
    task: OneOrMany,
    statuses: tuple[str, ...],
) -> list[sa.ColumnElement[bool]]:
    c = table.c
    where: list[sa.ColumnElement[bool]] = []
    id_list = _ids(ids)
    if id_list is not None:
        where.append(_id_in(c.id, id_list))
    queues = _names(queue, "queue")
    if queues is not None:
        where.append(c.queue.in_(queues))
    tasks = _names(task, "task")
    if tasks is not None:
        where.append(c.task.in_(tasks))
    if statuses:
        where.append(c.status.in_([_lit(s) for s in statuses]))
    return where


def _selection(
    table: sa.Table,
    ids: Iterable[int] | None,
    queue: OneOrMany,
    task: OneOrMany,
    status: OneOrMany,
    statuses: tuple[str, ...],
    all_jobs: bool,
    *,
    extra: bool = False,
) -> list[sa.ColumnElement[bool]]:
    """The WHERE of an action; refuses an empty selection unless ``all_jobs``.

    ``statuses`` is the action's effective status list (its default when ``status`` is
    None); only the selectors the caller *gave* count as a selection.
    """
    named = ids is not None or queue is not None or task is not None or status is not None
    if not (named or extra or all_jobs):
        raise ValueError(
            "select the jobs: give ids, or a queue, task or status filter "
            "(or all_jobs=True to act on every matching job)"
        )
    return _filters(table, ids=ids, queue=queue, task=task, statuses=statuses)


def _count(bind: Bind, table: sa.Table, where: list[sa.ColumnElement[bool]]) -> int:
    stmt = sa.select(sa.func.count()).select_from(table).where(*where)
    return int(_execute(bind, stmt).scalar_one())

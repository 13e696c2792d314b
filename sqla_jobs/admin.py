"""Operating the queue: look at it, retry, cancel, purge, pause.

Every function here is a plain SQLAlchemy Core statement run on what the caller gives:
a ``Connection`` or a ``Session``. Nothing commits on the caller's behalf, so an
operation can ride a larger transaction (or be rolled back), and the ``NOTIFY`` that
wakes workers after a retry is sent when the caller commits, like every NOTIFY::

    from sqla_jobs import admin

    with engine.begin() as conn:
        for q in admin.stats(conn, jobs):
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

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from .limits import QUEUE_MAX_BYTES, check_name
from .model import LIVE_STATUSES, STATUSES, JobStatus, companion_tables, job_table, notify_channel
from .queries import status_literal as _lit
from .tasks import Jobs
from .worker.job import CANCEL_PAYLOAD

__all__ = [
    "CANCELLABLE",
    "FINISHED_STATUSES",
    "PURGEABLE",
    "PURGEABLE_BY_DEFAULT",
    "RETRYABLE",
    "JobInfo",
    "QueueInfo",
    "QueueStats",
    "cancel_jobs",
    "get_job",
    "list_jobs",
    "list_queues",
    "meta_filter",
    "pause_queue",
    "paused_queues",
    "purge_jobs",
    "resume_queue",
    "retry_jobs",
    "source_table",
    "stats",
]

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

DEFAULT_WINDOW = 300.0


# -- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueStats:
    """What one queue holds right now.

    ``lag_seconds`` is how long the oldest ready job has been due (``now() - run_at``):
    the delay a job enqueued now would see if the queue kept its pace. ``None`` when
    nothing is ready.

    ``done_recent`` counts jobs finished in the last ``window`` seconds. It is only known
    when finished jobs are kept (``Jobs(keep_done=...)``): by default they are deleted the
    moment they complete, so no row is left to count, and ``None`` says "unknown" rather
    than a misleading zero. It is also ``None`` when only the model was given, since the
    retention setting lives on the registry. Dead jobs are always kept (until pruned), so
    ``dead_recent`` is always counted.
    """

    queue: str
    paused: bool
    scheduled: int
    ready: int
    running: int
    lease_expired: int
    done: int
    dead: int
    cancelled: int
    lag_seconds: float | None
    done_recent: int | None
    dead_recent: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobInfo:
    """One job row, as operators look at it."""

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

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JobInfo:
        return cls(**{name: row[name] for name in _JOB_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: datetimes become ISO 8601 strings in UTC."""
        return {k: _json_value(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class QueueInfo:
    """A queue name, and whether it is paused (``updated_at``: when that last changed)."""

    name: str
    paused: bool
    updated_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_value(v) for k, v in asdict(self).items()}


_JOB_FIELDS: tuple[str, ...] = tuple(JobInfo.__dataclass_fields__)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return _utc(value).isoformat()
    return value


def _utc(value: datetime) -> datetime:
    from datetime import timezone

    return value.astimezone(timezone.utc)


# -- looking ------------------------------------------------------------------------------


def stats(bind: Bind, jobs: JobSource, *, window: float = DEFAULT_WINDOW) -> list[QueueStats]:
    """Per-queue counts, lag and pause state, sorted by queue name.

    One aggregate over the jobs table (a sequential scan: counting finished jobs cannot
    use the partial indexes), outer-joined with ``<table>_queues`` so that a paused queue
    shows up even while empty. Queues named by the registry's tasks are listed too, so
    an idle queue reads as zeros rather than being absent.

    :param window: seconds that ``done_recent`` and ``dead_recent`` look back.
    """
    table = _table(jobs)
    queues_table = _queues_table(table)
    c = table.c
    since = sa.func.now() - sa.bindparam("window", type_=sa.Interval)

    def n(*conditions: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
        return sa.func.count().filter(sa.and_(*conditions))

    per_queue = (
        sa.select(
            c.queue,
            *(n(c.status == _lit(s)).label(s) for s in STATUSES),
            n(c.status == _lit(JobStatus.RUNNING), c.locked_until < sa.func.now()).label(
                "lease_expired"
            ),
            sa.func.min(c.run_at).filter(c.status == _lit(JobStatus.READY)).label("oldest_ready"),
            n(c.status == _lit(JobStatus.DONE), c.finished_at >= since).label("done_recent"),
            n(c.status == _lit(JobStatus.DEAD), c.finished_at >= since).label("dead_recent"),
        )
        .group_by(c.queue)
        .subquery("per_queue")
    )
    p, q = per_queue.c, queues_table.c
    lag = sa.cast(sa.extract("epoch", sa.func.now() - p.oldest_ready), sa.Float)
    counts = (*STATUSES, "lease_expired", "done_recent", "dead_recent")
    stmt = (
        sa.select(
            sa.func.coalesce(p.queue, q.name).label("queue"),
            sa.func.coalesce(q.paused, sa.false()).label("paused"),
            *(sa.func.coalesce(p[name], 0).label(name) for name in counts),
            lag.label("lag_seconds"),
        )
        .select_from(per_queue.join(queues_table, p.queue == q.name, full=True))
        .order_by("queue")
    )
    rows = {r.queue: r for r in _execute(bind, stmt, {"window": timedelta(seconds=window)})}
    done_known = isinstance(jobs, Jobs) and jobs.keep_done is not None
    result = [
        QueueStats(
            queue=r.queue,
            paused=bool(r.paused),
            scheduled=r.scheduled,
            ready=r.ready,
            running=r.running,
            lease_expired=r.lease_expired,
            done=r.done,
            dead=r.dead,
            cancelled=r.cancelled,
            # A ready job from a clock ahead of the database would show a negative lag.
            lag_seconds=None if r.lag_seconds is None else max(0.0, float(r.lag_seconds)),
            done_recent=r.done_recent if done_known else None,
            dead_recent=r.dead_recent,
        )
        for r in rows.values()
    ]
    for name in _registry_queues(jobs) - rows.keys():
        result.append(
            QueueStats(name, False, 0, 0, 0, 0, 0, 0, 0, None, 0 if done_known else None, 0)
        )
    return sorted(result, key=lambda s: s.queue)


def list_jobs(
    bind: Bind,
    jobs: JobSource,
    *,
    ids: Iterable[int] | None = None,
    queue: OneOrMany = None,
    status: OneOrMany = None,
    task: OneOrMany = None,
    meta: Mapping[str, Any] | None = None,
    limit: int | None = 50,
) -> list[JobInfo]:
    """Jobs matching every given filter, newest (highest id) first, at most ``limit``.

    :param meta: jobs whose ``meta`` has each of these keys with this value, or with a
        list that contains it (``meta={"tags": "vip"}`` finds ``{"tags": ["vip", "eu"]}``
        too). Read through the ``<table>_meta`` GIN index.
    """
    table = _table(jobs)
    ids = _ids(ids)  # once: it may be an iterator
    statuses = _statuses(status, STATUSES, "list")
    where = _filters(table, ids=ids, queue=queue, task=task, statuses=statuses)
    if meta is not None:
        where += meta_filter(table, meta)
    stmt = (
        sa.select(*(table.c[name] for name in _JOB_FIELDS))
        .where(*where)
        .order_by(table.c.id.desc())
    )
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        stmt = stmt.limit(limit)
    return [JobInfo.from_row(r._mapping) for r in _execute(bind, stmt)]


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
        one = c.meta.contains({key: value})
        if isinstance(value, (list, dict)):
            where.append(one)
        else:
            where.append(sa.or_(one, c.meta.contains({key: [value]})))
    return where


def get_job(bind: Bind, jobs: JobSource, job_id: int) -> JobInfo | None:
    """One job by id, or ``None`` if there is no such row (finished jobs may be deleted)."""
    found = list_jobs(bind, jobs, ids=[job_id], limit=1)
    return found[0] if found else None


# -- acting -------------------------------------------------------------------------------


def retry_jobs(
    bind: Bind,
    jobs: JobSource,
    ids: Iterable[int] | None = None,
    *,
    queue: OneOrMany = None,
    task: OneOrMany = None,
    status: OneOrMany = None,
    all_jobs: bool = False,
    dry_run: bool = False,
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

    The workers of the touched queues are woken with a NOTIFY, sent at commit.
    """
    table = _table(jobs)
    ids = _ids(ids)  # once: it may be an iterator
    statuses = _statuses(status, RETRYABLE, "retry") or RETRYABLE
    where = _selection(table, ids, queue, task, status, statuses, all_jobs)
    c = table.c

    # Unique keys: no live twin, and no newer retry candidate with the same key.
    live = table.alias("live_twin")
    newer = table.alias("newer_twin")
    newer_where = _filters(newer, ids=ids, queue=queue, task=task, statuses=statuses)
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
    if dry_run:
        return _count(bind, table, where)
    retried = (
        sa.update(table)
        .where(*where)
        .values(
            status=JobStatus.READY,
            run_at=sa.func.now(),
            finished_at=None,
            locked_until=None,
            locked_by=None,
            max_attempts=sa.func.greatest(c.max_attempts, c.attempts + 1),
        )
        .returning(c.queue)
        .cte("retried")
    )
    per_queue = (
        sa.select(retried.c.queue, sa.func.count().label("n"))
        .group_by(retried.c.queue)
        .subquery("per_queue")
    )
    stmt = sa.select(
        per_queue.c.n,
        sa.func.pg_notify(sa.literal(notify_channel(table)), per_queue.c.queue),
    )
    return sum(int(r.n) for r in _execute(bind, stmt))


def cancel_jobs(
    bind: Bind,
    jobs: JobSource,
    ids: Iterable[int] | None = None,
    *,
    queue: OneOrMany = None,
    task: OneOrMany = None,
    status: OneOrMany = None,
    all_jobs: bool = False,
    dry_run: bool = False,
) -> int:
    """Cancel scheduled, ready and running jobs; return how many.

    A cancelled job keeps its row (``finished_at`` set) until it is purged or pruned.
    A *running* job is cancelled too, and its lease dropped: the worker running it can
    no longer change it, since completing, failing and heartbeating all require
    ``status = 'running'``. Workers are asked (NOTIFY, at commit) to heartbeat at once;
    the heartbeat finds the job gone and sets :attr:`ClaimedJob.cancelled
    <sqla_jobs.ClaimedJob.cancelled>`, which a long handler checks between steps. The
    handler itself is not interrupted.
    """
    table = _table(jobs)
    ids = _ids(ids)  # once: it may be an iterator
    statuses = _statuses(status, CANCELLABLE, "cancel") or CANCELLABLE
    where = _selection(table, ids, queue, task, status, statuses, all_jobs)
    if dry_run:
        return _count(bind, table, where)
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
        .values(status=JobStatus.CANCELLED, finished_at=sa.func.now(), locked_until=None)
        .returning(target.c.was)
        .cte("cancelled")
    )
    counted = sa.select(
        sa.func.count(),
        sa.func.count().filter(changed.c.was == _lit(JobStatus.RUNNING)),
    ).select_from(changed)
    total, running = _execute(bind, counted).one()
    if running:
        # Ask workers to heartbeat now rather than at their next beat: the handler of a
        # cancelled running job learns it within moments (sent at commit).
        _execute(bind, sa.select(sa.func.pg_notify(notify_channel(table), CANCEL_PAYLOAD)))
    return int(total)


def purge_jobs(
    bind: Bind,
    jobs: JobSource,
    ids: Iterable[int] | None = None,
    *,
    queue: OneOrMany = None,
    task: OneOrMany = None,
    status: OneOrMany = None,
    older_than: float | timedelta | None = None,
    all_jobs: bool = False,
    dry_run: bool = False,
) -> int:
    """Delete finished jobs (done, dead, cancelled); return how many.

    Jobs that have not run yet (``scheduled``, ``ready``) are deleted only when ``status``
    names them: deleting work nobody looked at should take a deliberate word. Running jobs
    are never deleted (``ValueError``): their worker is still at it; cancel them first.

    :param older_than: only jobs finished (or, for unfinished ones, created) longer ago
        than this many seconds.
    """
    table = _table(jobs)
    ids = _ids(ids)  # once: it may be an iterator
    statuses = _statuses(status, PURGEABLE, "purge") or PURGEABLE_BY_DEFAULT
    where = _selection(
        table, ids, queue, task, status, statuses, all_jobs, extra=older_than is not None
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
    if dry_run:
        return _count(bind, table, where)
    deleted = sa.delete(table).where(*where).returning(table.c.id).cte("purged")
    return int(_execute(bind, sa.select(sa.func.count()).select_from(deleted)).scalar_one())


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
    """Every queue known to the table, the registry or ``<table>_queues``, by name.

    Queues come from three places: rows of ``<table>_queues`` (paused or resumed once),
    queues of jobs in the table (a scan of its ``queue`` column), and queues the
    registry's tasks name.
    """
    table = _table(jobs)
    q = _queues_table(table)
    known = {r.name: r for r in _execute(bind, sa.select(q.c.name, q.c.paused, q.c.updated_at))}
    names = set(known) | _registry_queues(jobs)
    names.update(_execute(bind, sa.select(table.c.queue).distinct()).scalars())
    return [
        QueueInfo(n, bool(known[n].paused), known[n].updated_at)
        if n in known
        else QueueInfo(n, False, None)
        for n in sorted(names)
    ]


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
    return {t.queue for t in jobs.tasks.values()}


def _execute(bind: Bind, stmt: sa.Executable, params: Mapping[str, Any] | None = None) -> Any:
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
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"job ids must be integers, got {v!r}")
    return values


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
        where.append(c.id.in_(id_list))
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

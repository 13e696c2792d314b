"""The enqueue pipeline: one binder, one writer (internal).

Every public way to enqueue (``session.enqueue``/``enqueue_many`` on each session class,
``jobs.enqueue``/``enqueue_many`` on a Core connection, the sharded sessions, ``jobs.group``
and the schedules) is a thin adapter of this module::

    call (task, args, kwargs, options: EnqueueOptions)
      │  bind / bind_call: options resolved (with_options + keywords), arguments checked
      ▼  against the handler, options checked, meta prepared (Jobs.bind_row)
    PendingJob(row: the columns, how: PLAIN | UNIQUE | SCOPED | AFTER, scope, parents)
      │
      ├─ place_on_session(session, pending)        the unit of work
      │     PLAIN   add a Job object; the flush writes it (write_direct: insert_job_row
      │             straight to psycopg, then the object persistent) or leaves it to the ORM
      │     AFTER   add it held; link it at the flush (defer_link)
      │     UNIQUE  INSERT ... ON CONFLICT DO NOTHING now (the answer is needed now)
      │     SCOPED  take the key's row, place the job (enqueue_scoped) now
      ├─ place_on_connection(connection, pending)  a Core connection, now
      │     PLAIN insert_job · UNIQUE insert_job_unique · SCOPED enqueue_scoped ·
      │     AFTER insert held + link, atomically
      └─ many rows (enqueue_many, schedules): many_values / many_json bind them
            (a UniformRows when they differ only in their arguments), insert_rows /
            insert_json write them: the unnest INSERT, or COPY (sqla_jobs._bulk)

So the choice between INSERT, ON CONFLICT, scoped placement, links and COPY is made here
and nowhere else; a row never carries a key that is not a column (the scope and the
parents travel beside it, in :class:`PendingJob`). When each call's rows are written is
the adapters' business (see :mod:`sqla_jobs.session`).

Internal: the names here may change in any release.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypedDict, cast, overload

import sqlalchemy as sa
from sqlalchemy import event, inspect
from sqlalchemy.orm import InstanceState, Session, make_transient, make_transient_to_detached
from sqlalchemy.orm.attributes import instance_state
from sqlalchemy.orm.exc import FlushError

from ._bulk import CheckedLater, copy_allowed, copy_run, gc_paused, python_defaults
from ._direct import autocommit, compiled, execute, execute_each, pipeline_allowed
from ._queries import INSERTED_COLUMNS, _dumps, args_json, filled_by_server
from ._storable import BIGINT_MAX, Encodings, database_encodings
from ._tasks import (
    OPTION_NAMES,
    ConfiguredTask,
    Registry,
    Task,
    TaskArgs,
    UniqueScope,
    _utcnow,
    ascii_rows,
    check_encoding,
    check_encoding_text,
    check_meta,
    flat_unique,
    merge_options,
)
from .db import require_postgresql
from .errors import EnqueueError
from .model import LIVE_STATUSES, RUN_ANYWAY_KEY, JobStatus

if TYPE_CHECKING:
    from ._queries import Queries
    from .tasks import Jobs

#: The session ``info`` key of the registry a session resolves task names with.
JOBS_KEY = "sqla_jobs.jobs"


# -- binding: a call becomes a pending row ------------------------------------------------


class Placement(enum.Enum):
    """How a pending job is written (see the module's picture). Only compared by identity:
    the members' values mean nothing and are never stored."""

    PLAIN = enum.auto()
    UNIQUE = enum.auto()
    SCOPED = enum.auto()
    AFTER = enum.auto()


@dataclass(slots=True, eq=False)
class PendingJob:
    """One checked job, not yet written: its columns (``row``, what ``registry.model``
    takes), and how it is placed, with what that needs (a scoped key's
    :class:`~sqla_jobs.tasks.UniqueScope`; the parents of a job with ``after=``)."""

    registry: Jobs
    row: dict[str, Any]
    how: Placement
    scope: UniqueScope | None = None
    parents: list[Any] | None = None


def bind(
    registry: Jobs,
    task: Task[Any, Any] | str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    options: Mapping[str, Any],
) -> PendingJob:
    """Check one job (:meth:`Jobs.bind_row`) and say how it is placed."""
    row, scope, parents = registry.bind_row(task, args, kwargs, **options)
    if parents is not None:  # never unique: bind_row refuses the two together
        how = Placement.AFTER
    elif scope is not None:
        how = Placement.SCOPED
    elif "unique_key" in row:
        how = Placement.UNIQUE
    else:
        how = Placement.PLAIN
    return PendingJob(registry, row, how, scope, parents)


def bind_call(
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    resolver: Jobs | Any,
) -> PendingJob:
    """Bind an ``enqueue(task, *args, **kwargs)`` call: the option keywords (the names
    of :class:`~sqla_jobs.tasks.EnqueueOptions`) are taken out of ``kwargs`` (no handler
    may have a parameter of those names), merged with those a
    :class:`~sqla_jobs.ConfiguredTask` carries; the rest are the handler's. ``resolver``
    is the registry (a connection's call), or the session whose ``jobs=`` resolves a task
    name."""
    given = {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}
    plain: Task[Any, Any] | str
    if isinstance(task, ConfiguredTask):
        plain, options = merge_options(task, given)
        registry = cast("Jobs", resolver) if isinstance(resolver, Registry) else plain.registry
    else:
        plain, options = task, {k: v for k, v in given.items() if v is not None}
        registry = (
            cast("Jobs", resolver) if isinstance(resolver, Registry) else _registry(resolver, task)
        )
    return bind(registry, plain, args, kwargs, options)


# -- one job on a session ----------------------------------------------------------------


def place_on_session(
    session: Any, pending: PendingJob, shard: Any = None, *, direct: bool = False
) -> tuple[Any, bool]:
    """Place one job in a session's unit of work (``session``: a sync or an async one);
    return the job (the holder of a unique key, or None for a scoped key whose holder
    is gone) and whether it is new. A sharded session names the job's ``shard``: the
    statements of a unique or scoped job run on it, and the job is read back from it.
    ``direct``: the session's flush calls :func:`write_direct`, which may write a plain
    job itself."""
    how = pending.how
    if how is Placement.PLAIN:
        registry = pending.registry
        job = registry.model(**pending.row)
        session.add(job)
        if direct and direct_shape(registry.model) is not None:
            noted = session.info.get(DIRECT_KEY)
            if noted is None:
                noted = session.info[DIRECT_KEY] = []
            noted.append((registry, job))
        return job, True
    if how is Placement.AFTER:
        return _session_after(session, pending), True
    if how is Placement.SCOPED:
        return _session_scoped(_sync(session), pending, shard)
    return _session_unique(_sync(session), pending, shard)


def _sync(session: Any) -> Session:
    """The plain Session behind a Session or an AsyncSession (which keeps its unit of
    work in one)."""
    sync = getattr(session, "sync_session", session)
    assert isinstance(sync, Session)
    return sync


def _on(session: Session, shard: Any) -> sa.Connection:
    """The session's connection, on ``shard`` when one is named (explicit per call: the
    routing is the call's, not a mode of the session)."""
    if shard is None:
        return session.connection()
    return session.connection(bind_arguments={"shard_id": shard})


def _session_unique(session: Session, pending: PendingJob, shard: Any) -> tuple[Any, bool]:
    """INSERT a unique job now, through the session's connection (as on a connection);
    return it (or the live job holding its key) and whether it is new. The arguments go
    as the JSON text their check wrote (:func:`job_params`): encoded once."""
    connection = _on(session, shard)
    require_postgresql(connection, "a unique job (ON CONFLICT on a partial index)", EnqueueError)
    registry = pending.registry
    params = job_params(pending.row)
    for _ in range(5):
        job_id, inserted = _connection_unique(connection, registry, params)
        with session.no_autoflush:
            job = session.get(registry.model, job_id, identity_token=shard)
        # None: the holder finished (and was deleted) between its id's read and this
        # one; the key is free again, so the job is inserted at the next turn.
        if job is not None:
            return job, inserted
    raise EnqueueError(f"unique key {params['unique_key']!r} keeps changing hands; try again")


def _session_scoped(session: Session, pending: PendingJob, shard: Any) -> tuple[Any, bool]:
    """Enqueue a scoped unique job now (see :func:`enqueue_scoped`);
    return the new job, the holder (replaced or kept), or None when the key's period
    holds it and the job that took it is gone; and whether the job is new."""
    connection = _on(session, shard)
    require_postgresql(connection, "a scoped unique job (unique_for, ...)", EnqueueError)
    registry = pending.registry
    job_id, outcome = enqueue_scoped(
        connection, registry.queries, job_params(pending.row), pending.scope
    )
    if outcome == "gone":
        return None, False
    with session.no_autoflush:
        # A replaced holder this session has loaded must show its new arguments.
        job = session.get(
            registry.model,
            job_id,
            populate_existing=outcome == "replaced",
            identity_token=shard,
        )
    return job, outcome == "new"


def session_registry(session: Session) -> Jobs | None:
    """The registry a session resolves task names with (its ``jobs=``), if any."""
    jobs: Jobs | None = _sync(session).info.get(JOBS_KEY)
    return jobs


def _registry(session: Any, task: Task[Any, Any] | str) -> Jobs:
    """The registry of a task, or the session's (for a name)."""
    if isinstance(task, Task):
        return task.registry
    jobs = session.info.get(JOBS_KEY)
    if jobs is None:
        raise EnqueueError(
            f"cannot resolve task name {task!r}: this session has no Jobs registry "
            "(create it with sessionmaker(..., jobs=jobs)) or pass the task itself"
        )
    return jobs  # type: ignore[no-any-return]


# -- one job on a connection -------------------------------------------------------------


def place_on_connection(connection: sa.Connection, pending: PendingJob) -> tuple[int, bool]:
    """Write one job on a Core connection now, in its transaction; its id (for a unique
    or scoped key, the holder's: replaced, kept, or the finished job whose period still
    holds the key) and whether it is new."""
    if pending.how is Placement.AFTER:
        return _connection_after(connection, pending), True
    q = pending.registry.queries
    params = job_params(pending.row)
    if pending.how is Placement.SCOPED:
        job_id, outcome = enqueue_scoped(connection, q, params, pending.scope)
        return job_id, outcome == "new"
    if pending.how is Placement.UNIQUE:
        return _connection_unique(connection, pending.registry, params)
    # Around SQLAlchemy only when it would add nothing: a column of the model's own with
    # a Python-side default is filled by its execution alone (sent as compiled, it was NULL).
    if pipeline_allowed(connection) and not python_defaults(q.table):
        made = compiled(q.compiled, q.insert_job, connection.dialect)
        found = execute(connection, made, params)  # RETURNING id, no conflict clause
        new_id: Any = found[0][0] if found else None
    else:
        new_id = connection.execute(q.insert_job, params).scalar_one_or_none()
    if new_id is None:
        raise EnqueueError(_not_written(q.table, params["task"]))
    return int(new_id), True


def _not_written(table: sa.Table, task: str) -> str:
    """Why an INSERT of one job returned no row: nothing of ours skips one, so an
    application's ``BEFORE INSERT`` trigger did (it returned NULL). Said so, rather than
    an unpacking error from deep inside the enqueue."""
    return (
        f"the job of task {task!r} was not written: the INSERT into {table.fullname} "
        "returned no row (a BEFORE INSERT trigger on the table skipped it)"
    )


@contextlib.contextmanager
def _atomic(connection: sa.Connection) -> Iterator[None]:
    """Make two statements one: on a connection in autocommit (with no transaction of
    its caller's open), inside a BEGIN/COMMIT of their own; otherwise they are in the
    caller's transaction already. Each statement would otherwise commit alone, and what
    the first one locked (a unique key's row) would be free before the second ran."""
    own = autocommit(connection) and _idle(connection)
    if own:
        connection.exec_driver_sql("BEGIN")
    try:
        yield
    except BaseException:
        if own:
            connection.exec_driver_sql("ROLLBACK")
        raise
    if own:
        connection.exec_driver_sql("COMMIT")


def _idle(connection: sa.Connection) -> bool:
    """No transaction is open on the driver's connection (one the caller began with a
    BEGIN of its own would be committed by ours)."""
    info = getattr(connection.connection.driver_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    return status is None or int(status) == 0  # psycopg's TransactionStatus.IDLE


def _connection_after(connection: sa.Connection, pending: PendingJob) -> int:
    """A job with ``after=``: INSERTed held, then linked to its parents, atomically (in
    autocommit, inside a BEGIN/COMMIT of its own)."""
    registry, values = pending.registry, pending.row
    parents = parent_ids(registry, pending.parents or (), pending_ok=False)
    run_anyway = bool((values.get("meta") or {}).get(RUN_ANYWAY_KEY))
    values["run_at"] = HELD_UNTIL
    q = registry.queries
    with _atomic(connection):
        job_id: int = connection.execute(q.insert_job, job_params(values)).scalar_one()
        link(connection, q, job_id, parents, run_anyway)
    return job_id


def _connection_unique(connection: sa.Connection, registry: Jobs, params: Any) -> tuple[int, bool]:
    """INSERT a unique job; its id (or that of the live job holding the key), and whether
    it is new. The holder may finish between the two statements: then try again."""
    q = registry.queries
    for _ in range(5):
        job_id = connection.execute(q.insert_job_unique, params).scalar()
        if job_id is not None:
            return int(job_id), True
        held = connection.execute(q.live_by_key, {"key": params["unique_key"]}).scalar()
        if held is not None:
            return int(held), False
    raise EnqueueError(
        f"unique key {params['unique_key']!r}: the INSERT returned no row five times and no "
        "live job holds the key: an application's BEFORE INSERT trigger on "
        f"{q.table.fullname} skips the row, or the key keeps changing hands (try again)"
    )


# -- links: jobs that wait for others (after=) ------------------------------------------


#: The placeholder ``run_at`` of a job inserted with ``after=``, also the mark of a held job
#: (``'infinity'`` would be neater, but Python's datetime cannot read it back).
HELD_UNTIL = datetime(9999, 1, 1, tzinfo=timezone.utc)


_LINK_KEY = "sqla_jobs.links"


def parent_ids(registry: Jobs, parents: Iterable[Any], *, pending_ok: bool) -> list[Any]:
    """Check ``after=``: job ids, or job objects of this registry's model (pending ones
    only where their ids will be known before linking: ``pending_ok``)."""
    out: list[Any] = []
    for parent in parents:
        if isinstance(parent, bool) or not isinstance(parent, (int, registry.model)):
            if hasattr(parent, "__table__") and hasattr(parent, "task"):
                raise EnqueueError(
                    f"after=: {parent!r} is a job of another table "
                    f"({parent.__table__.fullname}); a job can only wait for jobs of "
                    f"{registry.table.fullname}"
                )
            raise EnqueueError(f"after= takes jobs or job ids, got {parent!r}")
        if isinstance(parent, int):
            if not 1 <= parent <= BIGINT_MAX:  # PostgreSQL refused it at the flush
                raise EnqueueError(f"after=: job ids are from 1 to {BIGINT_MAX}, got {parent}")
            out.append(parent)
        elif parent.id is not None:
            out.append(parent.id)
        elif pending_ok:
            out.append(parent)
        else:
            raise EnqueueError(f"after=: {parent!r} has no id yet (flush the session first)")
    return out


def link(
    conn: sa.Connection, queries: Queries, child_id: int, parents: Sequence[int], run_anyway: bool
) -> str:
    """Tie a just-inserted job to its parents, in the enqueue's transaction; its status.

    Two statements: mark (and lock) the parents, then set the child's parents, how many
    it waits for, and its status. A parent already ``done`` counts as succeeded; one that
    is dead or cancelled cancels the child at once (or, ``run_anyway``, counts as done).
    A cycle cannot be made: a parent must exist before its child is enqueued.
    """
    ids = sorted(set(parents))
    if child_id in ids:
        raise EnqueueError(f"after=: job {child_id} cannot wait for itself")
    rows = conn.execute(queries.mark_parents, {"parent_ids": ids}).all()
    status_of = {int(r.id): r.status for r in rows}
    missing = [i for i in ids if i not in status_of]
    if missing:
        raise EnqueueError(
            f"after=: no job {', '.join(map(str, missing))} in {queries.table.fullname} "
            "(a job that succeeded without keep_result= is deleted: it cannot be waited for)"
        )
    waiting = sum(1 for s in status_of.values() if s in LIVE_STATUSES)
    ended = sorted(i for i, s in status_of.items() if s in (JobStatus.DEAD, JobStatus.CANCELLED))
    if run_anyway:
        # An ended parent not settled yet (dead by its lease) counts this child down when
        # the retention pass settles it: until then, the child waits for it too.
        waiting += sum(1 for r in rows if r.unsettled and int(r.id) in ended)
    reason = None
    if ended and not run_anyway:
        status, waiting = JobStatus.CANCELLED.value, 0
        reason = (
            f"cancelled: job {ended[0]}, which it waits for (after=), ended {status_of[ended[0]]}"
        )
    elif waiting:
        status = JobStatus.SCHEDULED.value
    else:
        status = JobStatus.READY.value
    conn.execute(
        queries.link_child,
        {
            "child_id": child_id,
            # As given: a group's callback gets its members' results in this order, one per
            # member (sorted and deduplicated, a unique member, written before the others
            # at its enqueue, came first, and one given twice gave one result).
            "parent_ids": list(parents),
            "waiting": waiting,
            "child_status": status,
            "reason": reason,
        },
    )
    return status


def defer_link(
    session: Session, registry: Jobs, child: Any, parents: list[Any], run_anyway: bool
) -> None:
    """Link an ORM job at the session's flush, once it and its parents have ids.

    Parents added to the session before the child are INSERTed by the same flush (the ORM
    inserts the rows of one mapper in the order they were added, and returns their ids),
    so after the flush every id is known, and the link runs in the flush's transaction:
    a rollback (of the transaction or of the savepoint) takes the whole workflow with it.
    """
    links: list[tuple[Jobs, Any, list[Any], bool]] | None = session.info.get(_LINK_KEY)
    if links is None:
        links = session.info[_LINK_KEY] = []
        if not event.contains(session, "after_flush_postexec", _link_flushed):
            event.listen(session, "after_flush_postexec", _link_flushed)
            event.listen(session, "after_transaction_end", _forget_links)
    links.append((registry, child, parents, run_anyway))


def _link_flushed(session: Session, flush_context: Any) -> None:
    links = session.info.get(_LINK_KEY)
    if not links:
        return
    session.info[_LINK_KEY] = []
    for registry, child, parents, run_anyway in links:
        state = inspect(child)
        if not state.persistent:
            continue  # rolled back with its savepoint before it was flushed
        ids = []
        for parent in parents:
            if isinstance(parent, int):
                ids.append(parent)
            elif parent.id is None:
                raise EnqueueError(
                    f"after=: {parent!r} was not flushed with the job that waits for it "
                    "(was it expunged?)"
                )
            else:
                ids.append(parent.id)
        conn = session.connection(bind_arguments=_bind_of(state, parents))
        link(conn, registry.queries, child.id, ids, run_anyway)
        session.expire(
            child, ["status", "run_at", "parents", "waiting", "finished_at", "last_error"]
        )
        for parent in parents:
            if not isinstance(parent, int):
                session.expire(parent, ["meta"])


def _bind_of(state: Any, parents: list[Any]) -> dict[str, Any]:
    """Where a child's link runs: on its own shard when it has one (a sharded session
    keeps it as the row's ``identity_token``; asked for by the mapper, a
    ``ShardedSession`` would ask its chooser with no instance), else where the session
    sends its model. A parent on another shard cannot be linked: its id names another
    shard's row, or none (ids are per database)."""
    shard = state.identity_token
    if shard is None:
        return {"mapper": state.mapper}
    for parent in parents:
        if isinstance(parent, int):
            continue
        theirs = inspect(parent).identity_token
        if theirs != shard:
            raise EnqueueError(
                f"after=: {parent!r} is on shard {theirs!r} and the job that waits for it "
                f"on shard {shard!r}; a job can wait only for jobs of its own shard"
            )
    return {"shard_id": shard}


def _forget_links(session: Session, transaction: Any) -> None:
    if transaction.parent is None:
        session.info.pop(_LINK_KEY, None)


def _session_after(session: Any, pending: PendingJob) -> Any:
    """A job with ``after=`` on a session: added held, linked at the flush that gives it
    and its pending parents their ids (:func:`defer_link`)."""
    registry, values, parents = pending.registry, pending.row, pending.parents or []
    run_anyway = bool((values.get("meta") or {}).get(RUN_ANYWAY_KEY))
    values["run_at"] = HELD_UNTIL
    job = registry.model(**values)
    session.add(job)
    sync = _sync(session)
    ids = parent_ids(registry, parents, pending_ok=True)
    noted = sync.info.get(DIRECT_KEY)
    if noted:
        # Pending parents are written by the ORM, with this job, in the order they were
        # added (see defer_link), and stay in the session for the link to expire.
        waited = {id(p) for p in ids if not isinstance(p, int)}
        sync.info[DIRECT_KEY] = [n for n in noted if id(n[1]) not in waited]
    defer_link(sync, registry, job, ids, run_anyway)
    return job


# -- a session's plain jobs, written around the ORM at the flush -------------------------
#
# ``session.enqueue`` adds a Job object to the session, as ``session.add`` would: it is
# pending (in ``session.new``) until the flush, ``expunge`` or a rolled-back savepoint
# drops it, and the flush writes it. Written by the ORM's unit of work, one job added
# half the client's cost of a small transaction (``benchmarks/marginal.py``: 372 µs on
# top of 706 for one business row): a second mapper to sort, collect, execute and
# postfetch, and SQLAlchemy's execution around one INSERT. So at the flush, before the
# ORM's own work, :func:`write_direct` sends the session's plain jobs itself
# (``insert_job_row``, straight to psycopg on the session's connection, several in one
# pipeline) and puts each object back in the session as persistent, with the values the
# server gave it (id, run_at, created_at: the RETURNING), as the ORM's flush leaves it
# (the session makes it transient again if its transaction rolls back, as the ORM
# does: ``sqla_jobs.session._written_rolled_back``). Whatever could tell the
# difference goes the ORM's way as before: a watched connection (see
# :func:`~sqla_jobs._direct.pipeline_allowed`), a session with flush listeners (they read
# ``session.new``), a model with insert events, an inheritance, a version counter or a
# column of its own with a Python default, a job object the application changed beyond
# what enqueue set, a parent of a job with ``after=`` (linked by the ORM's flush), a
# sharded session.

#: The session ``info`` key of the plain jobs the flush may write itself, each with its
#: registry, in the order they were enqueued.
DIRECT_KEY = "sqla_jobs.direct"


@dataclass(frozen=True, slots=True)
class DirectShape:
    """How a model's jobs are written around the ORM, worked out once per model."""

    #: What a job object may hold for the INSERT to write it whole: the attributes of
    #: its parameters (and SQLAlchemy's own state).
    settable: frozenset[str]
    #: The attributes of ``insert_job_row``'s RETURNING columns, in order.
    returned: tuple[str, ...]
    #: Every other column attribute: what the INSERT sent, or NULL. A written job holds
    #: each (None where the object holds nothing), as the ORM's flush leaves its objects:
    #: one left out would be expired, loaded by a query when read, and unreadable once
    #: the session is closed or from an ``AsyncSession`` (``expire_on_commit=False``).
    rest: tuple[str, ...]
    #: The attributes of the INSERT's columns that may not be NULL: a job holding None
    #: in one (set so by the application after enqueue) goes the ORM's way, which leaves
    #: it out of the INSERT for the column's server default.
    required: tuple[str, ...]
    #: Those of ``rest`` whose type writes None as something other than SQL NULL (JSON's
    #: ``null``): taken out again when a rolled-back job becomes transient.
    json_rest: tuple[str, ...]


_shapes: weakref.WeakKeyDictionary[type, DirectShape | None] = weakref.WeakKeyDictionary()


def direct_shape(model: type) -> DirectShape | None:
    """How ``model``'s plain jobs are written around the ORM, or None if they cannot be
    (the ORM would do something the INSERT does not: an inheritance, a version counter,
    a column of the application's own with a Python-side default, a column mapped
    under several attributes, a foreign key, which the ORM's flush fills from a
    relationship, such as an ``owner.jobs`` collection the job was appended to, without
    the job object showing a change). Insert events are checked at each flush: they may
    be listened for later."""
    try:
        return _shapes[model]
    except KeyError:
        pass
    shape = _shapes[model] = _work_out_shape(model)
    return shape


def _work_out_shape(model: type) -> DirectShape | None:
    mapper: sa.orm.Mapper[Any] = sa.inspect(model)
    table = mapper.local_table
    if (
        mapper.inherits is not None
        or mapper.polymorphic_on is not None
        or mapper.version_id_col is not None
        or not isinstance(table, sa.Table)
        or any(column.foreign_keys for column in table.c)
    ):
        return None
    key_of: dict[str, str] = {}
    for prop in mapper.column_attrs:
        [column] = prop.columns if len(prop.columns) == 1 else [None]
        if not isinstance(column, sa.Column) or column.table is not table:
            return None
        key_of[column.name] = prop.key
    if any(column.name not in key_of for column in table.c) or python_defaults(table):
        return None  # a column no attribute maps on its own; a default the ORM would run
    returned = tuple(key_of[c.name] for c in filled_by_server(table))
    settable = frozenset([*(key_of[name] for name in INSERTED_COLUMNS), "_sa_instance_state"])
    rest = tuple(key for key in key_of.values() if key not in returned)
    json_rest = tuple(
        key_of[c.name] for c in table.c if key_of[c.name] in rest and c.type.should_evaluate_none
    )
    required = tuple(key_of[name] for name in INSERTED_COLUMNS if not table.c[name].nullable)
    return DirectShape(settable, returned, rest, required, json_rest)


def write_direct(session: Session) -> list[Any]:
    """Write the session's plain jobs that are still pending in it, in the session's
    transaction, and take them out of it (see the section's comment); leave the rest
    (expunged, rolled back, or for the ORM) where they are. Called by the session's
    flush before the ORM's: a job's columns can name no application row (a model with a
    foreign key goes the ORM's way), so nothing it writes waits for one.

    The jobs of a model are written in the order they were enqueued, whatever registry
    enqueued them (their ids order the claims of one ``run_at``). All are sent before any
    becomes persistent: a failure leaves every job pending, and the caller fails the
    flush as the ORM's own failure does (the transaction, which PostgreSQL has aborted,
    rolled back; see ``EnqueueMixin.flush``). Returns the jobs it wrote: the session makes
    them transient again if their transaction rolls back, as the ORM does with the
    objects its flush wrote."""
    noted: list[tuple[Jobs, Any]] | None = session.info.get(DIRECT_KEY)
    if not noted:
        return []
    session.info[DIRECT_KEY] = []
    watch = session.dispatch
    if watch.before_flush or watch.after_flush or watch.after_flush_postexec:
        return []  # listeners that read what the flush writes (session.new) see the jobs
    if (
        watch.pending_to_persistent
        or watch.pending_to_transient
        or watch.detached_to_persistent
        or watch.before_attach
        or watch.after_attach
    ):
        return []  # the lifecycle the ORM's flush gives each (and no other)
    groups: dict[type, tuple[Jobs, DirectShape, list[InstanceState[Any]]]] = {}
    key = session.hash_key
    for registry, job in noted:
        state = instance_state(job)
        if state.session_id != key or state.key is not None:
            continue  # expunged, rolled back with its savepoint, or flushed by the ORM
        shape = _shapes[registry.model]
        assert shape is not None  # noted only with a shape
        values = state.dict
        if values.keys() <= shape.settable and all(
            values.get(name, True) is not None for name in shape.required
        ):
            groups.setdefault(registry.model, (registry, shape, []))[2].append(state)
    sent: list[tuple[DirectShape, list[InstanceState[Any]], list[list[tuple[Any, ...]]]]] = []
    for model, (registry, shape, group) in groups.items():
        dispatch = group[0].mapper.dispatch
        if dispatch.before_insert or dispatch.after_insert:
            continue
        connection = session.connection(bind_arguments={"mapper": model})
        if not pipeline_allowed(connection):
            continue
        q = registry.queries
        made = compiled(q.compiled, q.insert_job_row, connection.dialect)
        # The arguments encoded from the object, not the text their check wrote: the
        # application may have changed them in place since, as the ORM would write.
        params = [job_params(state.dict, encode=True) for state in group]
        sent.append((shape, group, execute_each(connection, made, params)))
    for _, group, found in sent:
        for state, rows in zip(group, found, strict=True):
            if len(rows) != 1:
                # Before any job becomes persistent: the flush fails whole, as the ORM's
                # does for a row its INSERT did not return (FlushError, its message
                # naming triggers too).
                raise FlushError(_not_written(state.mapper.local_table, state.dict["task"]))  # type: ignore[arg-type]
    written: list[Any] = []
    for shape, group, found in sent:
        for state, [row] in zip(group, found, strict=True):
            # Pending no more: the row is written. Out, filled with the row's values, and
            # back in as a persistent object, as the ORM's flush would leave it (its
            # identity in the session, expired at commit, refreshed, deleted).
            job = state.obj()
            make_transient(job)
            values = state.dict
            values.update(zip(shape.returned, row, strict=True))
            for name in shape.rest:
                if name not in values:
                    values[name] = None  # sent as NULL (or left NULL)
            make_transient_to_detached(job)
            Session.add(session, job)
            written.append(job)
    return written


# -- many rows: enqueue_many and the schedules -------------------------------------------


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
    concurrency_key: str | None


def job_params(values: dict[str, Any], *, encode: bool = False) -> JobParams:
    """Parameters of ``insert_job`` from checked values (:meth:`Jobs.bind_row`); with
    ``encode``, the arguments encoded anew rather than the text their check wrote."""
    meta = values.get("meta")
    return {
        "task": values["task"],
        "queue": values["queue"],
        "args": _dumps(values["args"]) if encode else args_json(values["args"]),
        "priority": values["priority"],
        "max_attempts": values["max_attempts"],
        "status": values["status"],
        "run_at": values.get("run_at"),
        "unique_key": values.get("unique_key"),
        "meta": None if meta is None else _dumps(meta),
        "concurrency_key": values.get("concurrency_key"),
    }


_SHARED = ("task", "queue", "priority", "max_attempts", "status", "run_at", "meta")


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


class UniformRows(Sequence[dict[str, Any]]):
    """Checked job rows that differ only in their arguments, with neither a unique key nor
    a concurrency key: what one ``enqueue_many`` call of the common kind makes (see
    ``session.many_values``). It holds the first row and every row's arguments; a row is
    made only when asked for (by the ``enqueued`` listeners, or ``pending_jobs``), and
    :func:`insert_rows` writes a run without making any: at 100,000 rows a dict per row
    was a fifth of a session's ``enqueue_many`` and flush."""

    __slots__ = ("args", "first")

    def __init__(self, first: dict[str, Any], args: list[Any]) -> None:
        self.first = first
        self.args = args

    def __len__(self) -> int:
        return len(self.args)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [{**self.first, "args": a} for a in self.args[index]]
        return {**self.first, "args": self.args[index]}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        first = self.first
        for a in self.args:
            yield {**first, "args": a}

    def joined(self, other: UniformRows) -> UniformRows:
        """This run and ``other`` as one (a new run; the two are left as they are)."""
        return UniformRows(self.first, [*self.args, *other.args])


def same_run(run: UniformRows, other: UniformRows) -> bool:
    """Whether two :class:`UniformRows` s may be written as one."""
    return _shared_values(run.first) == _shared_values(other.first)


def many_values(
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    session: Any,
    **given: Any,
) -> tuple[Jobs, Sequence[dict[str, Any]]]:
    """The registry and the checked rows of an ``enqueue_many`` call (all or none): a
    :class:`UniformRows` when they differ only in their arguments.

    ``session`` resolves a task name: a session (its ``jobs=``), or a registry."""
    _check_many(arguments)
    plain, registry, options, meta, now = _many_options(task, session, given)
    bind_row = registry.bind_row
    rows: Sequence[dict[str, Any]] = []
    scoped = False
    with gc_paused(arguments):
        items = iter(arguments)
        keyed: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, TaskArgs):
                args, kwargs = item.args, item.kwargs
            else:
                args, kwargs = (), item
            row, scope, _ = bind_row(plain, args, kwargs, now=now, meta_prepared=True, **options)
            scoped = scope is not None
            # Without unique keys, the rows of one call differ only in their arguments: the
            # first row is checked whole, the others reuse its column values and check only
            # their arguments (the options' checks were a third of a row's cost). Not when
            # a column is derived from each row's arguments: a unique key (asked for here
            # or by the task) or a concurrency key (the task's function).
            t = registry.get(plain)
            if not keyed and _uniform(row, t):
                rows = UniformRows(row, [row["args"], *t.bind_many(items)])
                break
            keyed.append(row)
        else:
            rows = keyed
    if rows:
        _prepare_meta(registry, rows, meta, scoped)
    elif meta is not None:
        check_meta(meta)  # nothing to enqueue, but a bad meta is still an error
    return registry, rows


def many_json(
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    jobs: Jobs | Session,
    **given: Any,
) -> tuple[Jobs, Sequence[dict[str, Any]], CheckedLater | None]:
    """:func:`many_values` for a caller that writes the rows at once (``enqueue_many`` on
    a connection): when the rows differ only in their arguments and nobody listens for
    ``enqueued``, ``(registry, [first row], texts)``: the first row checked whole, the
    arguments of every row as JSON text, without a dict per row, checked alike when they
    are written (:class:`~sqla_jobs._bulk.CheckedLater`); otherwise ``(registry, rows,
    None)``, every row checked."""
    _check_many(arguments)
    plain, registry, options, meta, now = _many_options(task, jobs, given)
    if registry.events.wants("enqueued"):  # the listeners get a dict per job
        return (*many_values(task, arguments, jobs, **given), None)
    items = iter(arguments)
    for item in items:
        if isinstance(item, TaskArgs):
            args, kwargs = item.args, item.kwargs
        else:
            args, kwargs = (), item
        row = registry.bind_row(plain, args, kwargs, now=now, meta_prepared=True, **options)[0]
        t = registry.get(plain)
        if not _uniform(row, t):
            # Keyed rows: each is a row of its own (the first is checked again there).
            rows = many_values(task, itertools.chain([item], items), jobs, **given)[1]
            return registry, rows, None
        _prepare_meta(registry, [row], meta, False)  # uniform: never scoped (it has no key)
        return registry, [row], CheckedLater(row["args"].json, list(items), t.bind_many_json)
    if meta is not None:
        check_meta(meta)
    return registry, [], None


def _check_many(arguments: object) -> None:
    """``enqueue_many`` takes many jobs' arguments: one mapping (its keys would be taken
    for the jobs) or something that is not iterable is an error that says so."""
    if isinstance(arguments, (Mapping, str, bytes)) or not isinstance(arguments, Iterable):
        raise EnqueueError(
            "enqueue_many takes an iterable of jobs' arguments (task.args(...) or mappings), "
            f"not {type(arguments).__name__}: for one job, pass [arguments]"
        )


def _many_options(
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str, session: Any, given: dict[str, Any]
) -> tuple[Task[Any, Any] | str, Jobs, dict[str, Any], Any, datetime | None]:
    """The task, registry and options of an ``enqueue_many`` call, its ``meta`` apart, and
    the one clock reading of a batch with a delay."""
    plain: Task[Any, Any] | str
    registry: Jobs
    if isinstance(task, ConfiguredTask):
        plain, options = merge_options(task, given)
        registry = plain.registry
    else:
        plain, options = task, {k: v for k, v in flat_unique(given).items() if v is not None}
        registry = (
            cast("Jobs", session) if isinstance(session, Registry) else _registry(session, plain)
        )
    if "unique_key" in options:
        raise EnqueueError(
            "enqueue_many cannot give every job the same unique_key: use unique=True"
        )
    if options.get("after") is not None or options.get("on_parent_failure") is not None:
        raise EnqueueError("enqueue_many does not take after=: use enqueue, or jobs.group")
    meta = options.pop("meta", None)
    # One clock reading for the whole batch: with a delay, every row gets the same
    # run_at, so the batch stays one run of the bulk INSERT.
    now = _utcnow() if options.get("delay") is not None else None
    return plain, registry, options, meta, now


def _uniform(row: dict[str, Any], task: Task[Any, Any]) -> bool:
    """Whether the rows after ``row`` (the first of a call) may share its columns: not
    when a column is derived from each row's arguments (a unique key, asked for by the
    call or by the task, or the task's concurrency key)."""
    return "unique_key" not in row and task.concurrency_key is None


def _prepare_meta(registry: Jobs, rows: Sequence[dict[str, Any]], meta: Any, scoped: bool) -> None:
    """Check ``meta`` and hand it to the enqueue hooks, once for the whole call; refuse
    a ``scoped`` unique key (after every row was checked, as before).

    Each row's ``meta`` may already hold the library's keys (the task's ``keep_result``,
    put there by :meth:`Jobs.bind_row <sqla_jobs.Jobs.bind_row>`): they are kept, over the
    caller's, as :meth:`~sqla_jobs.Jobs.bind_row` does for one job. Replacing the dict
    lost them, so a call with ``meta`` (or an enqueue hook, as tracing installs) kept no
    result."""
    first = rows.first if isinstance(rows, UniformRows) else rows[0]
    prepared = registry.job_meta(first["task"], first["queue"], meta)
    if prepared is not None:
        for row in [first] if isinstance(rows, UniformRows) else rows:
            own = row.get("meta")
            row["meta"] = {**prepared, **own} if own else prepared
    if scoped:
        raise EnqueueError(
            "enqueue_many does not take unique_for, unique_states or unique_on_conflict "
            "(each job of such a scope takes its key's lock in turn): enqueue them one by "
            "one with session.enqueue"
        )


def insert_rows(
    connection: Any,
    queries: Queries,
    rows: Sequence[dict[str, Any]],
    written: list[dict[str, Any]] | None = None,
) -> int:
    """INSERT checked job rows (from :meth:`Jobs.bind_row <sqla_jobs.Jobs.bind_row>`),
    one statement per run of rows that share task, queue and options: one statement for an
    ``enqueue_many`` call, whatever its size (a ``COPY`` for a big run without unique keys,
    see :mod:`sqla_jobs._bulk`). Returns how many rows were inserted (rows
    whose unique key a live job holds are not, nor a second row of one key).

    ``written``, if given, gets the rows that were inserted: what the ``enqueued``
    listeners hear of (they heard of skipped rows too, and the metrics counted them)."""
    require_postgresql(connection, "enqueue_many", EnqueueError)
    if isinstance(rows, UniformRows):
        if written is not None:
            written.extend(rows)  # no unique key: every row is inserted
        return _write_run(connection, queries, rows.first, rows.args) if rows else 0
    _check_encoding(connection, rows)
    inserted = 0
    for shared, run in itertools.groupby(rows, key=_shared_values):
        same = list(run)
        params = dict(zip(_SHARED, shared, strict=True))
        if params["meta"] is not None:
            params["meta"] = _dumps(params["meta"])
        params["unique_key"] = [r.get("unique_key") for r in same]
        params["concurrency_key"] = [r.get("concurrency_key") for r in same]
        # COPY writes the shared columns and the arguments only: rows with a concurrency
        # key (sqla_jobs.throttle) stay on the INSERT, as unique rows do. It turns the
        # arguments into text a block at a time, as it sends them (see copy_run).
        keyed = any(key is not None for key in params["concurrency_key"])
        if not keyed and copy_allowed(connection, queries.table, len(same), params["unique_key"]):
            args = [r["args"] for r in same]
            inserted += copy_run(connection, queries.table, params, args, args_json)
            if written is not None:
                written.extend(same)
            continue
        params["args"] = [args_json(r["args"]) for r in same]
        if written is None or all(key is None for key in params["unique_key"]):
            inserted += connection.execute(queries.bulk_insert, params).rowcount
            if written is not None:
                written.extend(same)
            continue
        returned = connection.execute(queries.bulk_insert_keys, params).scalars().all()
        inserted += len(returned)
        keys = {key for key in returned if key is not None}
        for row in same:  # of rows that share a key, the first is the one inserted
            key = row.get("unique_key")
            if key is None or key in keys:
                written.append(row)
                keys.discard(key)
    return inserted


def insert_json(connection: Any, queries: Queries, row: dict[str, Any], texts: CheckedLater) -> int:
    """INSERT (a ``COPY`` from :data:`~sqla_jobs._bulk.COPY_MIN_ROWS` rows on) one run of
    rows that have ``row``'s columns (checked values from :meth:`Jobs.bind_row
    <sqla_jobs.Jobs.bind_row>`, without a unique or concurrency key) and differ only in
    their arguments, given as JSON ``texts`` checked as they are written; returns how many
    were inserted."""
    require_postgresql(connection, "enqueue_many", EnqueueError)
    return _write_run(connection, queries, row, texts)


def _write_run(
    connection: Any, queries: Queries, row: dict[str, Any], args: Sequence[Any] | CheckedLater
) -> int:
    """Write rows that have ``row``'s columns and differ only in their arguments: checked
    arguments (:class:`~sqla_jobs.tasks.CheckedArgs`), or texts checked as they are
    written. ``COPY`` when :func:`~sqla_jobs._bulk.copy_allowed` says so, else the bulk
    INSERT (with every text checked first)."""
    params: dict[str, Any] = {name: row.get(name) for name in _SHARED}
    if params["meta"] is not None:
        params["meta"] = _dumps(params["meta"])
    encodings = database_encodings(connection) if isinstance(connection, sa.Connection) else None
    if encodings is not None:
        # A database (or connection) that does not carry every text (LATIN1 has no "€"):
        # the texts are checked for it too, as they are made (see CheckedLater).
        if isinstance(args, CheckedLater):
            args = CheckedLater(args.first, args.rest, _encoded_for(args.encode, row, encodings))
            check_encoding([{**row, "args": args.first}], encodings)
        else:
            check_encoding(UniformRows(row, list(args)), encodings)
    if isinstance(args, CheckedLater):
        if copy_allowed(connection, queries.table, len(args), ()):
            return copy_run(connection, queries.table, params, args)
        params["args"] = args.all()
    else:
        if copy_allowed(connection, queries.table, len(args), ()):
            return copy_run(connection, queries.table, params, args, args_json)
        params["args"] = list(map(args_json, args))
    params["unique_key"] = params["concurrency_key"] = [None] * len(args)
    return int(connection.execute(queries.bulk_insert, params).rowcount)


def _check_encoding(connection: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Refuse rows with text that the connection's database cannot store (see
    :func:`~sqla_jobs.tasks.check_encoding`); nothing to do for a UTF-8 one."""
    if isinstance(connection, sa.Connection):
        encodings = database_encodings(connection)
        if encodings is not None and not ascii_rows(rows):
            check_encoding(rows, encodings)


def _encoded_for(encode: Any, row: dict[str, Any], encodings: Encodings) -> Any:
    """``encode`` (of a :class:`~sqla_jobs._bulk.CheckedLater`), whose texts are then checked
    for the database's encodings too."""

    def checked(items: list[Any]) -> list[str]:
        texts: list[str] = encode(items)
        if not "".join(texts).isascii():
            for text in texts:
                if not text.isascii():
                    check_encoding_text(row["task"], text, encodings)
        return texts

    return checked


class _DefaultContext:
    """What a context-sensitive default function of the application's model
    (``default=lambda context: ...``) is given where SQLAlchemy's execution cannot give its
    own (a scoped unique job's INSERT is a CTE, whose defaults SQLAlchemy leaves out): the
    job's column values, as ``get_current_parameters()`` gives an INSERT's."""

    def __init__(self, values: Any) -> None:
        self.current_parameters: dict[str, Any] = dict(values)

    def get_current_parameters(self, isolate_multiinsert_groups: bool = True) -> dict[str, Any]:
        return self.current_parameters


def _called_defaults(queries: Queries, params: JobParams) -> dict[str, Any]:
    """The model's Python-callable column defaults for one scoped job (the ``d_<column>``
    parameters of ``place_scoped``), each called once, with one context."""
    if not queries.scoped_callable_defaults:
        return {}
    context = _DefaultContext(params)
    return {name: default.arg(context) for name, default in queries.scoped_callable_defaults}


def enqueue_scoped(
    connection: Any, queries: Queries, params: JobParams, scope: Any
) -> tuple[int, str]:
    """Enqueue a scoped unique job (:class:`sqla_jobs.tasks.UniqueScope`) on ``connection``
    in its transaction; ``(id, outcome)``: ``"new"``, ``"replaced"`` (the waiting holder
    took the arguments), ``"kept"`` (the holder blocks and is returned as it is) or
    ``"gone"`` (the key's period holds it, and the id is of the job that took it, which
    has finished and been deleted). Two statements: take the key's row (which waits for
    a concurrent enqueue of the key to commit or roll back), then place the job."""
    key = params["unique_key"]
    # The key's row stays locked until the job is placed: in autocommit the two
    # statements run in a transaction of their own (two producers both found the key
    # free, and both placed a job).
    with _atomic(connection):
        holder, held = connection.execute(queries.take_key, {"key": key}).one()
        row = connection.execute(
            queries.place_scoped,
            {
                **{f"p_{name}": value for name, value in params.items()},
                **_called_defaults(queries, params),
                "holder": holder,
                "held": held,
                "states": list(scope.states),
                "replace": scope.on_conflict == "replace",
                "period": scope.period,
            },
        ).first()
    if row is None:
        if not held:
            # Nothing blocked a new job (no period holds the key, no holder in the
            # scope's states), yet none came back: an application's trigger skipped it.
            raise EnqueueError(_not_written(queries.table, params["task"]))
        return int(holder), "gone"
    return int(row[0]), str(row[1])

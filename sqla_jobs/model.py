"""The jobs table, as a declarative mixin that lives in the application's own metadata.

.. code-block:: python

    from sqlalchemy.orm import DeclarativeBase
    from sqla_jobs import JobMixin

    class Base(DeclarativeBase): ...

    class Job(JobMixin, Base):
        __tablename__ = "jobs"                 # any name
        __table_args__ = {"schema": "work"}    # optional: a schema (or MetaData(schema=...))

The table, its partial indexes, its CHECK constraints, its storage parameters and its
NOTIFY trigger are created by ``metadata.create_all()`` or, better, by
``op.create_jobs_table()`` in an Alembic migration (see :mod:`alembic_ext`). Any
declarative style works (see :class:`JobMixin`); ``sqla-jobs check`` compares a live
database with all of it.

``metadata.create_all()`` also works on SQLite, for an application whose own tests run
there: the PostgreSQL types have SQLite variants (JSON, INTEGER), and what only PostgreSQL
can run (the trigger, the storage parameters, the partial and GIN indexes, the JSON CHECK
constraints) is left out there. PostgreSQL's DDL is exactly what it is without them.

The CHECK constraints (:data:`CHECKS`) hold what the worker assumes of any row, whoever
wrote it: an object ``args``, an object or NULL ``meta``, an attempt left for a job that
waits to run, and so on.

Why the indexes look the way they do
------------------------------------
Every hot statement reads through a *partial* index whose predicate names exactly one
status. A row leaves the index the moment it leaves that status, so finished, dead and
future jobs never sit in the claim path, however many of them the table holds:

* ``<table>_claim``: ``(queue, priority DESC, run_at, id) WHERE status = 'ready'``:
  the claim walks it in order and stops after ``LIMIT`` rows.
* ``<table>_scheduled``: ``(run_at) WHERE status = 'scheduled'``: promoting due jobs
  and finding the next due time.
* ``<table>_running``: ``(locked_until) WHERE status = 'running'``: finding expired leases.
* ``<table>_finished``: ``(finished_at) WHERE status IN ('done', 'dead', 'cancelled')``:
  retention prunes old rows without scanning live ones.
* ``<table>_unique``: ``UNIQUE (unique_key) WHERE status IN ('scheduled', 'ready',
  'running')``: unique jobs, enforced by the database.
* ``<table>_dead``: ``(queue, task, id) WHERE status = 'dead'``: the dashboard, and
  operators counting or listing dead jobs. Dead jobs pile up (they are kept for
  ``keep_dead``, a week by default), and no other index has their queue or task: without
  it the overview's per-queue counts, a list of a task's dead jobs newest first, and the
  count before a bulk retry would each read every finished row (with 1,000,000 jobs in
  the table: 130-210 ms instead of 10-20). A row enters it only when a job dies, never
  on the claim or on a success, so the hot path does not pay for it.

* ``<table>_keys``: ``(queue, concurrency_key) WHERE status = 'running' AND
  concurrency_key IS NOT NULL``: the limited claim counts the running jobs of each key
  (:mod:`sqla_jobs.throttle`). Only running jobs that have a key are in it, so queues
  without keys pay nothing for it.

One index is not about status: ``<table>_meta``, ``GIN (meta jsonb_path_ops) WHERE meta IS
NOT NULL``, for finding jobs by a tag or a correlation id in any status (``meta @> ...``).
It is partial so that the jobs that carry no ``meta``, most of them in most applications,
add nothing to it and pay nothing for it at insert, claim and completion.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import typing
from datetime import datetime, timedelta
from typing import Any, ClassVar, NamedTuple

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.dialects.postgresql.base import PGDialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    MappedAsDataclass,
    MappedColumn,
    Mapper,
    mapped_column,
)
from sqlalchemy.sql.compiler import SQLCompiler

__all__ = ["STATUSES", "JobMixin", "JobStatus", "notify_channel", "result_channel"]


# -- the storage contract of meta: keys the worker reads from a claimed row -------------

#: ``meta`` keys the library writes for results and workflows (the ``sqla_jobs.`` namespace
#: is the library's). They are the storage contract between the enqueue, the worker (which
#: reads them from the claimed row) and admin, so they live with the model: seconds a
#: result is kept; this job has dependent jobs; run this job even if a parent ends dead or
#: cancelled; the parameter a group's callback receives its parents' results in; this job
#: was cancelled because a parent ended dead or cancelled (retrying that parent brings it
#: back).
KEEP_KEY = "sqla_jobs.keep"
CHILDREN_KEY = "sqla_jobs.children"
RUN_ANYWAY_KEY = "sqla_jobs.run_anyway"
RESULTS_KEY = "sqla_jobs.results"
CANCELLED_BY_PARENT_KEY = "sqla_jobs.cancelled_by_parent"

#: How long ``keep_result=True`` keeps a result when the registry keeps no done jobs.
DEFAULT_RESULT_TTL = timedelta(days=1)


class TextEnum(str, enum.Enum):
    """A ``str`` enum that prints as its value (``str(JobStatus.DEAD)`` is ``dead``), as
    :class:`enum.StrEnum` does from Python 3.11 on: the statuses and outcome kinds are
    words written into rows, logs and messages."""

    def __str__(self) -> str:
        return str(self.value)


class JobStatus(TextEnum):
    """The life of a job. The database checks that ``status`` is one of these.

    ``scheduled``
        Waiting for ``run_at``: enqueued with a delay, or waiting to be retried.
    ``ready``
        Runnable now; the only status the claim looks at.
    ``running``
        Claimed by a worker, which holds a lease until ``locked_until``.
    ``done``
        Finished, kept only when retention keeps finished jobs (by default they are deleted).
    ``dead``
        Failed ``max_attempts`` times, or failed permanently; ``last_error`` says why.
    ``cancelled``
        Cancelled before it ran; kept for the record until pruned.
    """

    SCHEDULED = "scheduled"
    READY = "ready"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"
    CANCELLED = "cancelled"


STATUSES: tuple[str, ...] = tuple(s.value for s in JobStatus)

#: Statuses in which a job is still "live": it will run, or is running.
LIVE_STATUSES: tuple[str, ...] = (JobStatus.SCHEDULED, JobStatus.READY, JobStatus.RUNNING)
#: The rows of ``<table>_key_order``: keyed jobs that wait, or failed (a dead or
#: cancelled head can hold its key in a queue with ``key_order="fifo"``). Not the running
#: ones: a claim changes a job's status, so PostgreSQL writes every index whose predicate
#: the claimed row meets, and this one, whose entries of 1,000 keys lie all over it, was
#: most of what a keyed claim cost beyond the plain one (see ``_fifo_heads`` for how a
#: running head still holds its key).
KEY_ORDER_STATUSES: tuple[str, ...] = (
    JobStatus.SCHEDULED,
    JobStatus.READY,
    JobStatus.DEAD,
    JobStatus.CANCELLED,
)

#: The states of a durable step (``<table>_steps.state``) that keep its job suspended: the
#: rows of ``<table>_steps_suspended`` (see :mod:`sqla_jobs.steps`).
SUSPENDED_STEP_STATES: tuple[str, ...] = ("sleeping", "waiting")

#: Storage parameters for a table that is inserted into, updated and deleted from all day.
#: A low scale factor makes autovacuum visit long before dead tuples pile up (the default,
#: 20% of the table, is far too lazy for a queue), no cost delay lets it finish quickly, and
#: a fillfactor below 100 leaves room on each page for the new row versions that every claim
#: and completion writes.
STORAGE_PARAMETERS: dict[str, str] = {
    "fillfactor": "80",
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_insert_scale_factor": "0.02",
    "autovacuum_analyze_scale_factor": "0.05",
    "autovacuum_vacuum_cost_delay": "0",
}


def notify_channel(table: sa.Table) -> str:
    """The LISTEN/NOTIFY channel of one jobs table.

    Each table has its own channel, so two job models in one database never wake each
    other's workers. PostgreSQL truncates identifiers at 63 bytes, so long names are
    shortened with a hash to stay distinct.
    """
    name = f"sqla_jobs.{table.schema}.{table.name}" if table.schema else f"sqla_jobs.{table.name}"
    if len(name.encode()) > 63:
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        name = f"{name.encode()[:50].decode(errors='ignore')}.{digest}"
    return name


def result_channel(table: sa.Table) -> str:
    """The channel on which a finished result-keeping job's id is announced (NOTIFY,
    sent at commit): :meth:`Jobs.result <sqla_jobs.Jobs.result>` waits on it. Apart from
    the workers' channel, so that results never wake a fetch loop."""
    return notify_channel(sa.Table(f"{table.name}!results", sa.MetaData(), schema=table.schema))


def derived_name(table_name: str, suffix: str) -> str:
    """``<table>_<suffix>``, the name of an index, constraint, trigger or companion table.

    PostgreSQL cuts identifiers at 63 bytes, which would make two long names collide
    (``..._claim`` and ``..._claim2`` cut to the same prefix). A name that would not fit
    keeps a prefix of the table name and a short hash of all of it instead.
    """
    name = f"{table_name}_{suffix}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(table_name.encode()).hexdigest()[:8]
    room = 63 - len(suffix) - len(digest) - 2
    prefix = table_name.encode()[:room].decode(errors="ignore")
    return f"{prefix}_{digest}_{suffix}"


def _status_list(statuses: tuple[str, ...]) -> str:
    return ", ".join(f"'{s}'" for s in statuses)


# --- column types: PostgreSQL's, and what an application's SQLite tests can create --------
#
# The queue runs on PostgreSQL only, but the jobs tables live in the application's own
# metadata, so an application whose tests run ``metadata.create_all()`` on SQLite must be
# able to create them there. Each PostgreSQL-only type carries a SQLite variant. The base
# type stays PostgreSQL's: it decides the Python-side operators (``meta.contains(...)``
# is JSONB's ``@>``, ``parents.overlap(...)`` is ARRAY's ``&&``), and PostgreSQL's DDL is
# exactly what it was without the variants.


def _jsonb() -> sa.types.TypeEngine[Any]:
    return JSONB().with_variant(sa.JSON(), "sqlite")


def _moment() -> sa.DateTime:
    """A point in time: every timestamp column is ``timestamptz``."""
    return sa.DateTime(timezone=True)


def _array(item: sa.types.TypeEngine[Any] | type[sa.types.TypeEngine[Any]]) -> Any:
    return ARRAY(item).with_variant(sa.JSON(), "sqlite")


#: BIGINT on PostgreSQL; on SQLite, INTEGER, which is what makes a primary key take the
#: rowid there (and number itself).
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class EmptyObject(sa.sql.expression.ColumnElement[Any]):
    """The server default of a JSON object column: ``'{}'::jsonb`` on PostgreSQL, as it
    always was, and ``'{}'`` elsewhere (SQLite has no cast syntax)."""

    inherit_cache = True


@compiles(EmptyObject)
def _empty_object(element: EmptyObject, compiler: SQLCompiler, **kw: Any) -> str:
    return "'{}'"


@compiles(EmptyObject, "postgresql")
def _empty_object_pg(element: EmptyObject, compiler: SQLCompiler, **kw: Any) -> str:
    return "'{}'::jsonb"


#: Marks the columns a :class:`JobMixin` declares (``Column.info``), so that a table built
#: from them can be told from a Table an application built itself and mapped.
_MIXIN_COLUMN = "sqla_jobs.column"


def _column(*args: Any, **kw: Any) -> Any:
    """``mapped_column(...)``, marked as the mixin's."""
    return mapped_column(*args, info={_MIXIN_COLUMN: True}, **kw)


class JobMixin:
    """Columns, constraints and indexes of a jobs table.

    Mix it into a declarative class of the application's own ``Base``; the class chooses
    the table name (``__tablename__``) and, through ``__table_args__``, the schema. A model
    may add columns of its own; the queue only reads and writes the ones declared here.

    Any declarative style works: a :class:`~sqlalchemy.orm.DeclarativeBase` (with or without
    :class:`~sqlalchemy.orm.MappedAsDataclass`, or a ``DeclarativeBaseNoMeta``), the legacy
    ``declarative_base()`` and ``registry.generate_base()``, ``@registry.mapped``, and bases
    built on them such as Flask-SQLAlchemy's ``db.Model``; not ``@registry.mapped_as_dataclass``,
    which makes the class a dataclass too late for the mixin to give it its own fields (use a
    ``MappedAsDataclass`` base). The indexes, CHECK constraints,
    notify trigger and companion tables are added when the class is mapped (the
    ``after_mapper_constructed`` event), which is the one moment every style shares: a
    metaclass-based base builds the Table only after ``__init_subclass__`` has run. A Table
    the application builds itself and maps (``__table__ = Table(...)``,
    ``map_imperatively``) is left as it is; :class:`~sqla_jobs.Jobs` then says what it
    lacks.

    On a ``MappedAsDataclass`` base (SQLAlchemy 2.1 or later) the columns are keyword-only
    dataclass fields that default to "not given", so ``Job(task=..., args=...)`` leaves
    every other column to its server default, as on any other base.
    """

    __sqla_jobs__: ClassVar[bool] = True
    #: Where ``session.enqueue``'s job goes the ORM's way (see
    #: :func:`sqla_jobs._enqueue.write_direct`), the ORM INSERTs it, and its default
    #: ("auto") adds every server-default column (run_at, attempts, created_at, ...) to
    #: the RETURNING list and processes it, only for ``Session.begin()`` to expire it all
    #: at COMMIT. With ``False`` the INSERT returns the id alone and the rest loads if and
    #: when it is read. About a tenth of the cost of enqueueing one job per transaction
    #: that way. A model that sets its own ``__mapper_args__`` replaces this.
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": False}

    id: Mapped[int] = _column(_ID, sa.Identity(always=False), primary_key=True)
    queue: Mapped[str] = _column(sa.Text, nullable=False, server_default="default")
    task: Mapped[str] = _column(sa.Text, nullable=False)
    args: Mapped[dict[str, Any]] = _column(_jsonb(), nullable=False, server_default=EmptyObject())
    status: Mapped[str] = _column(sa.Text, nullable=False, server_default="ready")
    priority: Mapped[int] = _column(sa.SmallInteger, nullable=False, server_default="0")
    run_at: Mapped[datetime] = _column(
        sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    )
    attempts: Mapped[int] = _column(sa.Integer, nullable=False, server_default="0")
    max_attempts: Mapped[int] = _column(sa.Integer, nullable=False, server_default="5")
    locked_until: Mapped[datetime | None] = _column(sa.DateTime(timezone=True))
    locked_by: Mapped[str | None] = _column(sa.Text)
    unique_key: Mapped[str | None] = _column(sa.Text)
    last_error: Mapped[str | None] = _column(sa.Text)
    created_at: Mapped[datetime] = _column(
        sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    )
    finished_at: Mapped[datetime | None] = _column(sa.DateTime(timezone=True))
    #: A JSON object given at enqueue (``meta={...}``): tags, correlation ids. Keys
    #: starting with ``sqla_jobs.`` are the library's (the trace context, when tracing).
    meta: Mapped[dict[str, Any] | None] = _column(_jsonb())
    #: What the running handler last said about its progress
    #: (``current_job().set_progress(...)``), written with the heartbeat.
    progress: Mapped[dict[str, Any] | None] = _column(_jsonb())
    #: The key a task's ``concurrency_key`` function computed from the job's arguments at
    #: enqueue: at most ``key_concurrency`` running jobs of a queue share one (see
    #: :mod:`sqla_jobs.throttle`). NULL: no key.
    concurrency_key: Mapped[str | None] = _column(sa.Text)
    #: The handler's return value, for a job enqueued with ``keep_result``: written by the
    #: completion that marks it ``done`` (see :meth:`Jobs.result <sqla_jobs.Jobs.result>`).
    result: Mapped[Any | None] = _column(_jsonb())
    #: The jobs this one waits for (``enqueue(..., after=[...])``), or None. Searched by
    #: ``<table>_parents`` when a parent finishes.
    parents: Mapped[list[int] | None] = _column(_array(sa.BigInteger))
    #: How many of ``parents`` have not yet succeeded. A job with ``waiting > 0`` is held
    #: as ``scheduled`` with ``run_at`` in the year 9999, which the promoter never reaches.
    waiting: Mapped[int | None] = _column(sa.Integer)

    def __init_subclass__(cls, **kw: Any) -> None:
        # A dataclass mapping refuses mapped attributes inherited from a class that is not
        # a dataclass, so such a class gets its own copy of each column, declared before
        # declarative (inside super().__init_subclass__) reads the class.
        if issubclass(cls, MappedAsDataclass):
            _declare_dataclass_columns(cls)
        super().__init_subclass__(**kw)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} id={self.id} task={self.task!r} queue={self.queue!r} "
            f"status={self.status!r} attempts={self.attempts}>"
        )


#: The names of the columns :class:`JobMixin` declares, in order.
COLUMN_NAMES: tuple[str, ...] = tuple(
    name for name, value in vars(JobMixin).items() if isinstance(value, MappedColumn)
)


def _declare_dataclass_columns(cls: type[Any]) -> None:
    """Declare on ``cls`` itself each of the mixin's columns that it would inherit from
    :class:`JobMixin`, as keyword-only dataclass fields with a default of "not given".

    SQLAlchemy 2.1 keeps such a default off the INSERT (the column gets its server
    default); 2.0 sets the attribute to None, which a JSON column writes as JSON ``null``
    (``args`` would not get its ``{}``), so it is refused there with the reason.
    """
    if not hasattr(sa.orm, "unmapped_dataclass"):  # new in SQLAlchemy 2.1
        raise TypeError(
            f"{cls.__name__}: JobMixin on a MappedAsDataclass base needs SQLAlchemy 2.1 or "
            f"later (installed: {sa.__version__}): with 2.0, a dataclass field the caller "
            "leaves out is set to None, which the JSON column args stores as JSON null "
            "instead of taking its server default. Map the jobs model on a base without "
            "MappedAsDataclass, or upgrade SQLAlchemy."
        )
    hints = typing.get_type_hints(JobMixin)
    annotations = dict(inspect.get_annotations(cls))
    for name in COLUMN_NAMES:
        owner = next(klass for klass in cls.__mro__ if name in vars(klass))
        if owner is not JobMixin:
            continue  # the model (or a class between) declares it: theirs
        source: sa.Column[Any] = vars(JobMixin)[name].column
        extra: list[Any] = []
        if source.identity is not None:
            extra.append(sa.Identity(always=source.identity.always))
        fields: dict[str, Any] = (
            {"init": False} if source.primary_key else {"kw_only": True, "default": None}
        )
        server_default = source.server_default
        copy = mapped_column(
            source.type,
            *extra,
            primary_key=source.primary_key,
            nullable=source.nullable,
            server_default=getattr(server_default, "arg", None),
            info=dict(source.info),
            **fields,
        )
        setattr(cls, name, copy)
        annotations[name] = hints[name]
    cls.__annotations__ = annotations


@event.listens_for(JobMixin, "after_mapper_constructed", propagate=True)
def _complete_mapped_table(mapper: Mapper[Any], cls: type[Any]) -> None:
    """Add the indexes, CHECK constraints, DDL and companion tables to a jobs table built
    from the mixin's columns, whichever declarative style mapped it.

    The event fires once per mapped class, as soon as its mapper exists, for every style
    (inside ``__init_subclass__`` for ``DeclarativeBase``, in the metaclass for
    ``declarative_base()``, in the decorator for ``@registry.mapped``). A subclass mapped
    on the same table, or a table that already has them, is skipped, and so is a table
    that was not built from the mixin's own columns (the application's own ``Table``):
    changing a Table its owner built could duplicate what it already declares.
    """
    table = mapper.local_table
    if not isinstance(table, sa.Table) or table.info.get("sqla_jobs"):
        return
    if not any(column.info.get(_MIXIN_COLUMN) for column in table.c):
        return
    if not set(COLUMN_NAMES) <= set(table.c.keys()):
        return  # a table of another kind, in an inheritance hierarchy
    complete_table(table)


def complete_table(table: sa.Table) -> None:
    """Give a table of the mixin's columns its constraints, indexes, DDL and companions."""
    table.info["sqla_jobs"] = True
    add_constraints(table)
    attach_ddl(table)
    companion_tables(table)


def _postgresql_only(item: Any) -> Any:
    """``metadata.create_all()`` creates this on PostgreSQL only: SQL that other databases
    cannot run (``jsonb_typeof``, a GIN index) or would read differently (a partial unique
    index without its predicate)."""
    return item.ddl_if(dialect="postgresql")


#: ``<table>_<suffix>`` CHECK constraints and what they hold. The first four are as old as
#: the table; the others were added in 0.2 (an upgrade adds them: see ``alembic_ext``).
#:
#: Each one holds for every row the library writes (an UPDATE that broke one would fail
#: its whole batch, so each was checked against every statement that writes the column),
#: and says what the worker assumes of a row someone else wrote:
#:
#: * ``args_object``, ``meta_object``: a handler is called with the arguments as keywords,
#:   and ``meta`` is read as a mapping;
#: * ``attempts_left``: a job waiting to run (scheduled or ready) has an attempt left, and a
#:   running one has used at most all of them. Attempts only grow, and the claim adds one,
#:   so this also keeps the claim from overflowing the column. Finished jobs are free
#:   (``retry`` raises ``max_attempts`` past their attempts);
#: * ``waiting``: a job held for its parents waits for a count of them, never fewer than 0.
CHECKS: dict[str, str] = {
    "status": f"status IN ({_status_list(STATUSES)})",
    "priority": "priority >= 0",
    "max_attempts": "max_attempts >= 1",
    "attempts": "attempts >= 0",
    "args_object": "jsonb_typeof(args) = 'object'",
    "meta_object": "meta IS NULL OR jsonb_typeof(meta) = 'object'",
    "attempts_left": (
        "status IN ('done', 'dead', 'cancelled') OR attempts < max_attempts"
        " OR (status = 'running' AND attempts = max_attempts)"
    ),
    "waiting": "waiting IS NULL OR waiting >= 0",
}
#: The CHECK constraints whose SQL is PostgreSQL's alone (SQLite has no ``jsonb_typeof``).
_POSTGRESQL_CHECKS = frozenset({"args_object", "meta_object"})


def add_constraints(table: sa.Table) -> None:
    """CHECK constraints and partial indexes, named after the table so that two job tables
    never collide."""
    name, c = table.name, table.c
    for suffix, sql in CHECKS.items():
        check = sa.CheckConstraint(sql, name=derived_name(name, suffix))
        table.append_constraint(_postgresql_only(check) if suffix in _POSTGRESQL_CHECKS else check)
    before = set(table.indexes)

    def partial(suffix: str, *columns: Any, where: str | sa.TextClause, **kw: Any) -> None:
        # Every index of the jobs table is partial, over the rows of the status it serves,
        # and named after the table; given Column objects, Index() attaches itself to it.
        clause = sa.text(where) if isinstance(where, str) else where
        sa.Index(derived_name(name, suffix), *columns, postgresql_where=clause, **kw)

    partial("claim", c.queue, sa.text("priority DESC"), c.run_at, c.id, where="status = 'ready'")
    partial("scheduled", c.run_at, where="status = 'scheduled'")
    partial("running", c.locked_until, where="status = 'running'")
    partial("finished", c.finished_at, where="status IN ('done', 'dead', 'cancelled')")
    partial("unique", c.unique_key, unique=True, where=UNIQUE_WHERE)
    partial("dead", c.queue, c.task, c.id, where="status = 'dead'")
    # jsonb_path_ops: smaller and faster than the default GIN operator class, and it serves
    # the one operator a tag filter needs (@>, containment).
    paths = {"meta": "jsonb_path_ops"}
    partial("meta", c.meta, postgresql_using="gin", postgresql_ops=paths, where="meta IS NOT NULL")
    # The limited claim counts the running jobs of each key (sqla_jobs.throttle). Only
    # running rows that have a key are in it: nothing for queues without keys, and a
    # handful of rows at any time for those with.
    keyed = "status = 'running' AND concurrency_key IS NOT NULL"
    partial("keys", c.queue, c.concurrency_key, where=keyed)
    # Queues with key_order="fifo": the claim takes a keyed job only when no earlier job
    # of its key waits or (held) failed, one probe of this index per key, and none of its
    # key runs (<table>_keys). Keyed rows only, not the running ones (KEY_ORDER_STATUSES),
    # and not the finished ones (a dead or cancelled one can hold its key). The fair claim
    # walks its keys and reads their ready jobs here too.
    fifo = f"concurrency_key IS NOT NULL AND status IN ({_status_list(KEY_ORDER_STATUSES)})"
    partial("key_order", c.queue, c.concurrency_key, c.id, where=fifo)
    # Workflows: a finishing parent finds its waiting children by ``parents && ARRAY[id]``.
    # Partial: the jobs that wait for nothing (nearly all) add nothing to it.
    partial("parents", c.parents, postgresql_using="gin", where="parents IS NOT NULL")
    # On SQLite the partial indexes would index every row without their predicate (a
    # unique key held by finished jobs too), and the GIN ones cannot be made: all of them
    # are created on PostgreSQL only.
    for index in table.indexes - before:
        _postgresql_only(index)


#: The predicate of ``<table>_unique``; ON CONFLICT must name it to infer that index.
UNIQUE_WHERE = sa.text(f"unique_key IS NOT NULL AND status IN ({_status_list(LIVE_STATUSES)})")


_quote = PGDialect().identifier_preparer.quote  # type: ignore[no-untyped-call]


#: ``schema=`` left out: the table's own (``table.schema``).
_OWN: Any = object()


def _qualified(table: sa.Table, name: str | None = None, schema: str | None = _OWN) -> str:
    quote = _quote
    name = name or table.name
    schema = table.schema if schema is _OWN else schema
    return f"{quote(schema)}.{quote(name)}" if schema else quote(name)


def trigger_function_name(table: sa.Table, schema: str | None = _OWN) -> str:
    """The schema-qualified name of the table's notify trigger function (in ``schema``
    when given: where a connection's ``schema_translate_map`` puts the table)."""
    return _qualified(table, derived_name(table.name, "notify"), schema)


def notify_function_body(table: sa.Table) -> str:
    """The PL/pgSQL body of the table's notify function (what goes between its ``$$``)."""
    channel = notify_channel(table).replace("'", "''")
    return f"""
BEGIN
  PERFORM pg_notify('{channel}', q.queue)
     FROM (SELECT DISTINCT queue FROM new_jobs WHERE status = 'ready') AS q;
  RETURN NULL;
END
"""


def ddl_statements(
    table: sa.Table,
    *,
    function_body: str | None = None,
    storage_parameters: dict[str, str] | None = None,
    schema: str | None = _OWN,
) -> list[str]:
    """Statements that complete a freshly created jobs table.

    Storage parameters, and a statement-level trigger that sends one NOTIFY per distinct
    queue per INSERT statement. NOTIFY is transactional, so workers hear of a job only
    when the enqueueing transaction commits, and PostgreSQL folds identical notifications
    sent within one transaction: a transaction that enqueues a thousand jobs on one queue
    wakes the workers once.

    ``function_body`` and ``storage_parameters`` default to this release's; a migration
    that replaces them (``op.replace_jobs_ddl``) passes those it was written with. The
    statements can run again on a table that has them: the function is replaced and the
    trigger re-created.
    """
    qualified = _qualified(table, schema=schema)
    function = trigger_function_name(table, schema)
    trigger = _quote(derived_name(table.name, "notify"))
    body = notify_function_body(table) if function_body is None else function_body
    storage = STORAGE_PARAMETERS if storage_parameters is None else storage_parameters
    statements = []
    if storage:
        params = ", ".join(f"{k} = {v}" for k, v in storage.items())
        statements.append(f"ALTER TABLE {qualified} SET ({params})")
    return [
        *statements,
        f"""CREATE OR REPLACE FUNCTION {function}() RETURNS trigger
LANGUAGE plpgsql AS $${body}$$""",
        f"DROP TRIGGER IF EXISTS {trigger} ON {qualified}",
        f"""CREATE TRIGGER {trigger} AFTER INSERT ON {qualified}
REFERENCING NEW TABLE AS new_jobs
FOR EACH STATEMENT EXECUTE FUNCTION {function}()""",
    ]


def drop_statements(table: sa.Table, schema: str | None = _OWN) -> list[str]:
    """Statements that remove what :func:`ddl_statements` added (the table drops its trigger)."""
    return [f"DROP FUNCTION IF EXISTS {trigger_function_name(table, schema)}() CASCADE"]


def attach_ddl(table: sa.Table) -> None:
    """Have ``metadata.create_all()``/``drop_all()`` create and drop the trigger too."""
    if table.info.get("sqla_jobs_ddl"):
        return
    table.info["sqla_jobs_ddl"] = True

    # PL/pgSQL and storage parameters: PostgreSQL's alone. Elsewhere (an application's
    # SQLite tests) the table is created without them.
    # The statements are text, which a connection's schema_translate_map does not reach:
    # they name the schema the map gives the table (the CREATE TABLE went there), or they
    # would miss it, or change another schema's table of that name. The notify channel
    # stays the table's own, which the workers compute alike.
    def _after_create(target: sa.Table, connection: sa.Connection, **kw: Any) -> None:
        if connection.dialect.name == "postgresql":
            schema = connection.schema_for_object(target)
            for statement in ddl_statements(target, schema=schema):
                connection.exec_driver_sql(statement)

    def _after_drop(target: sa.Table, connection: sa.Connection, **kw: Any) -> None:
        if connection.dialect.name == "postgresql":
            for statement in drop_statements(target, connection.schema_for_object(target)):
                connection.exec_driver_sql(statement)

    # propagate: a copy made with Table.to_metadata() (a tenant's schema) gets them too;
    # it copies the table's info, flag included, but not its listeners otherwise.
    event.listen(table, "after_create", _after_create, propagate=True)
    event.listen(table, "after_drop", _after_drop, propagate=True)


#: What ``<table>_throughput`` counts per minute and queue: the outcomes written, in this
#: order (its columns, and the arrays a worker adds to them).
THROUGHPUT_KINDS: tuple[str, ...] = ("succeeded", "failed", "dead")


class Companions(NamedTuple):
    """The small tables that live beside a jobs table (see :func:`companion_tables`)."""

    queues: sa.Table
    schedules: sa.Table
    workers: sa.Table
    throughput: sa.Table
    unique_keys: sa.Table
    key_starts: sa.Table
    steps: sa.Table


def companion_tables(table: sa.Table) -> Companions:
    """The small tables that live beside a jobs table, in its metadata and schema.

    ``<table>_queues``
        One row per queue that has been paused (or resumed), or that has a rate limit
        (``rate_log`` and ``rate_counts``: when each claim within the last period started
        its jobs, and how many). Workers read it at every
        poll, so pausing takes effect across all of them without touching the claim.
    ``<table>_schedules``
        Periodic jobs: one row per schedule, declared in code or added at run time.
        ``next_run_at`` is the tick a worker enqueues next; advancing it with a guarded
        UPDATE is what makes each tick happen exactly once, however many workers race.
    ``<table>_workers``
        One row per running worker, upserted by the worker every ``presence_interval``
        and deleted when it stops cleanly: the jobs table cannot tell which workers are
        alive while they are idle. ``expires_at`` is three intervals after ``last_seen``;
        a row past it is a worker that died without a word (kept an hour, for the record).
    ``<table>_throughput``
        Jobs that succeeded, failed and died, per minute and queue. Finished jobs are
        deleted by default, so nothing else could count them; the workers add what their
        completer wrote at each presence beat, so the completion statement itself is
        unchanged and writers never wait on one another's counter rows for long.
    ``<table>_unique_keys``
        One row per key of a *scoped* unique job (``unique_for``, ``unique_states``,
        ``unique_on_conflict``): the job that took the key and until when the key stays
        taken whatever became of that job (finished jobs are deleted, so the jobs table
        cannot remember them). Its primary key is also the lock that serialises two
        enqueues of one key: each upserts the row first and holds it until it commits.
        Plain ``unique=True`` jobs never touch it (``<table>_unique`` serves them).
    ``<table>_key_starts``
        One row per (queue, concurrency key) of a queue with a per-key rate
        (``jobs.queue(..., key_rate="10/minute")``): the key's sliding log of start times,
        written by the limited claim under the queue's lock. ``full_until`` (indexed) is
        when a key whose log is full has room again, so the claim finds the held keys
        without reading the others; ``expires_at`` is when the log says nothing any more,
        after which retention deletes the row.
    ``<table>_steps``
        The checkpoints of durable jobs (:mod:`sqla_jobs.steps`): one row per step a job
        has passed (``kind`` ``run``, ``cursor``, ``sleep`` or ``wait``), keyed by the job
        and the step's name, with its JSON ``result`` (a step's return value, a cursor's
        position, a signal's payload), the ``state`` it is in and the ``attempt`` that
        wrote it. A signal sent before its wait is a ``wait`` row in state ``signalled``.
        No foreign key: a cascade would add a lookup to every job the completer deletes,
        durable or not, so retention deletes the rows of jobs that are gone instead.
        ``<table>_steps_suspended`` lists the sleeping and waiting ones.
    """
    existing = table.info.get("sqla_jobs_companions")
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    metadata, schema, name = table.metadata, table.schema, table.name

    def companion(suffix: str, *items: Any) -> sa.Table:
        # Named after the jobs table, in its schema and on its MetaData.
        return sa.Table(derived_name(name, suffix), metadata, *items, schema=schema)

    def key(column: str, type_: Any = sa.Text) -> sa.Column[Any]:
        return sa.Column(column, type_, primary_key=True)

    def required(column: str, type_: Any, **kw: Any) -> sa.Column[Any]:
        return sa.Column(column, type_, nullable=False, **kw)

    def since(column: str) -> sa.Column[Any]:
        # When the row was written first (or last): the database's clock, not a worker's.
        return required(column, _moment(), server_default=sa.func.now())

    queues = companion(
        "queues",
        key("name"),
        required("paused", sa.Boolean, server_default=sa.false()),
        # A rate-limited queue's sliding log, written by the limited claim: when each
        # claim within the last period started its jobs, and (``rate_counts``, the same
        # length) how many it started. One entry per claim, not per job: the log of a
        # queue at 10,000 a second was 10,000 timestamps, read, sorted and rewritten
        # (TOASTed) at every claim, 16 ms of a claim's 18.
        sa.Column("rate_log", _array(_moment())),
        sa.Column("rate_counts", _array(sa.Integer)),
        since("updated_at"),
    )
    schedules = companion(
        "schedules",
        key("name"),
        required("task", sa.Text),
        required("args", _jsonb(), server_default=EmptyObject()),
        required("cron", sa.Text),
        # The IANA time zone the expression is read in; NULL is UTC.
        sa.Column("tz", sa.Text),
        sa.Column("queue", sa.Text),
        sa.Column("priority", sa.SmallInteger),
        required("enabled", sa.Boolean, server_default=sa.true()),
        sa.Column("next_run_at", _moment()),
        sa.Column("last_run_at", _moment()),
        sa.Column("last_error", sa.Text),
        # 'code' for schedules declared with @jobs.periodic (workers keep them in step with
        # the code), 'runtime' for rows added through sqla_jobs.periodic.add_schedule.
        required("origin", sa.Text, server_default="runtime"),
        since("created_at"),
        sa.Index(
            derived_name(name, "schedules_due"), "next_run_at", postgresql_where=sa.text("enabled")
        ),
        # A due schedule's arguments become a job's: an object, as the jobs table holds.
        _postgresql_only(
            sa.CheckConstraint(
                CHECKS["args_object"], name=derived_name(name, "schedules_args_object")
            )
        ),
    )
    workers = companion(
        "workers",
        key("name"),
        # What the worker reports of itself (sqla_jobs._queries.WorkerReport), then when.
        required("host", sa.Text),
        required("pid", sa.Integer),
        required("kind", sa.Text),
        required("queues", _array(sa.Text)),
        required("concurrency", sa.Integer),
        required("running", sa.Integer),
        required("processed", sa.BigInteger),
        since("started_at"),
        since("last_seen"),
        required("expires_at", _moment()),
    )
    throughput = companion(
        "throughput",
        key("minute", _moment()),
        key("queue"),
        *(required(kind, sa.BigInteger, server_default="0") for kind in THROUGHPUT_KINDS),
    )
    unique_keys = companion(
        "unique_keys",
        key("key"),
        # The job that took the key last; it may since have finished and been deleted.
        sa.Column("job_id", sa.BigInteger),
        # The key stays taken until then (``unique_for``), even once the job is gone.
        sa.Column("until", _moment()),
    )
    key_starts = companion(
        "key_starts",
        key("queue"),
        key("key"),
        # The starts within the key's last period, oldest first (at most the rate's count).
        required("log", _array(_moment())),
        # Set while the log is full: the oldest start plus the period.
        sa.Column("full_until", _moment()),
        # The newest start plus the period: from then on the row only takes room.
        required("expires_at", _moment()),
        sa.Index(
            derived_name(name, "key_starts_full"),
            "queue",
            "full_until",
            postgresql_where=sa.text("full_until IS NOT NULL"),
        ),
    )
    steps = companion(
        "steps",
        key("job_id", sa.BigInteger),
        key("name"),
        # run, cursor, sleep or wait (sqla_jobs.steps.StepKind), and where it stands.
        required("kind", sa.Text),
        required("state", sa.Text),
        sa.Column("result", _jsonb()),
        # The attempt of the job that wrote the row (NULL: a signal, sent from outside).
        sa.Column("attempt", sa.Integer),
        # A sleep's wake-up time, a wait's deadline (NULL: no timeout).
        sa.Column("until", _moment()),
        since("created_at"),
        since("updated_at"),
        sa.Index(
            derived_name(name, "steps_suspended"),
            "job_id",
            postgresql_where=sa.text(f"state IN ({_status_list(SUSPENDED_STEP_STATES)})"),
        ),
    )
    companions = Companions(queues, schedules, workers, throughput, unique_keys, key_starts, steps)
    table.info["sqla_jobs_companions"] = companions
    return companions


def job_table(model: type[Any] | sa.Table) -> sa.Table:
    """The Table of a JobMixin model (or the table itself), checked."""
    table = model if isinstance(model, sa.Table) else getattr(model, "__table__", None)
    if not isinstance(table, sa.Table) or "task" not in table.c or "locked_until" not in table.c:
        raise TypeError(f"{model!r} is not a JobMixin model or jobs table")
    return table


def reference_table(
    table_name: str,
    schema: str | None = None,
    naming_convention: typing.Mapping[str, Any] | None = None,
) -> sa.Table:
    """The jobs table as this version declares it, on a MetaData of its own (with its
    companions): what an application's table is checked against. Read it, never change
    it (it may be shared).

    ``naming_convention``: the application's MetaData's, so that constraint names come out
    as they do there (``ck_%(table_name)s_%(constraint_name)s`` renames the CHECKs)."""
    if naming_convention is None or dict(naming_convention) == _DEFAULT_CONVENTION:
        return _default_reference(table_name, schema)
    return _build_reference(table_name, schema, naming_convention)


_DEFAULT_CONVENTION: dict[str, Any] = dict(sa.MetaData().naming_convention)


@functools.lru_cache(maxsize=64)
def _default_reference(table_name: str, schema: str | None) -> sa.Table:
    return _build_reference(table_name, schema, None)


def _build_reference(
    table_name: str, schema: str | None, naming_convention: typing.Mapping[str, Any] | None
) -> sa.Table:
    convention: dict[str, Any] = dict(naming_convention or _DEFAULT_CONVENTION)
    metadata = sa.MetaData(schema=schema, naming_convention=convention)
    base: Any = type("Base", (DeclarativeBase,), {"metadata": metadata})
    model: Any = type("Job", (JobMixin, base), {"__tablename__": table_name})
    table: sa.Table = model.__table__
    return table


def missing_parts(table: sa.Table) -> list[str]:
    """What ``table`` lacks of a complete jobs table, one phrase per kind ("indexes
    'jobs_claim', 'jobs_dead'"), compared by name with :func:`reference_table`: columns,
    CHECK constraints, indexes, the DDL that creates the notify trigger, and the companion
    tables in its metadata."""
    wanted = reference_table(table.name, table.schema, table.metadata.naming_convention)
    constraints = {constraint.name for constraint in table.constraints}
    indexes = {index.name for index in table.indexes}
    tables = table.metadata.tables
    found = {
        "columns": [column.key for column in wanted.c if column.key not in table.c],
        "CHECK constraints": sorted(
            str(c.name)
            for c in wanted.constraints
            if isinstance(c, sa.CheckConstraint) and c.name not in constraints
        ),
        "indexes": sorted(str(i.name) for i in wanted.indexes if i.name not in indexes),
        "companion tables": [
            companion.name
            for companion in wanted.info["sqla_jobs_companions"]
            if tables.get(_key(table.schema, companion.name)) is None
        ],
    }
    missing = [f"{kind} {', '.join(map(repr, names))}" for kind, names in found.items() if names]
    if not table.info.get("sqla_jobs_ddl"):
        missing.append("the notify trigger (its create_all DDL)")
    return missing


def _key(schema: str | None, name: str) -> str:
    return f"{schema}.{name}" if schema else name


def check_complete(model: type[Any] | sa.Table) -> sa.Table:
    """The model's jobs table, if it is complete; a ``TypeError`` naming what it lacks if
    not (a Table the application built and mapped itself)."""
    table = job_table(model)
    missing = missing_parts(table)
    if missing:
        raise TypeError(
            f"{model!r} maps table {table.fullname!r}, which lacks what a jobs table needs: "
            f"{'; '.join(missing)}. Declare the model as `class Job(JobMixin, Base)` with a "
            "`__tablename__` on a declarative base, which builds the whole table, rather "
            "than mapping a Table of your own."
        )
    return table

"""``session.enqueue(...)``: jobs that ride the caller's unit of work.

.. code-block:: python

    Session = sessionmaker(engine, class_=JobSession, jobs=jobs)

    with Session.begin() as session:
        session.add(Link(code="x7Kp", long_url=url))
        session.enqueue(fetch_preview, code="x7Kp")

``enqueue`` checks the job at once (arguments against the handler's signature, options),
adds a ``Job`` object to the session and returns it. Like any object added to a session,
it is INSERTed at the next flush, is visible to workers only once the caller commits, and
is gone if the transaction rolls back. Nothing here commits on the caller's behalf, or
flushes the session's objects where the caller's own commit would not. The flush writes
the job itself, for less client CPU than the ORM's unit of work, and leaves the object as
the ORM would (persistent, holding what the server gave it), unless something could tell
the difference (see :func:`sqla_jobs._enqueue.write_direct`).

``enqueue_many`` is for bulk, and is a statement, like SQLAlchemy's own bulk INSERT
(``session.execute(insert(Job), rows)``): its rows are written at the call, by one
``INSERT ... SELECT FROM unnest(...)`` (a ``COPY`` for a big call), in the caller's
transaction (the innermost savepoint), after a flush of the session when autoflush is on,
as a query would flush it.

Savepoints: a job shares the fate of the innermost transaction that was open when it was
enqueued. Jobs enqueued inside ``begin_nested()`` are gone if that savepoint rolls back
(at any depth), and jobs enqueued before it are not touched by that rollback. The
``enqueued`` event fires once the outermost transaction has committed, for the jobs it
committed; releasing a savepoint fires nothing.

Like ``session.add``, both begin the session's transaction if none is begun (which does no
I/O); a session made with ``autobegin=False`` refuses to enqueue until ``session.begin()``.
Both refuse a transaction that has ended (from ``after_commit`` or ``after_rollback``),
whose job SQLAlchemy would drop or a later transaction write: ``EnqueueError`` (after a
failed flush, SQLAlchemy's ``PendingRollbackError``).

On asyncio, :class:`AsyncJobSession` is a proxy of its sync session, as SQLAlchemy's
``AsyncSession`` is: ``enqueue`` (no I/O) is a plain method, ``enqueue_many`` and
``enqueue_unique`` (I/O) are awaited.

When a row is written: one rule per call name, on every session class (the same table is
in ``docs/design/pipeline.md``; the writing itself is :mod:`sqla_jobs._enqueue`'s):

=============================  ============================================================
call                           written
=============================  ============================================================
``enqueue`` (plain, after=)    at the flush (awaited on asyncio), like ``session.add``
``enqueue`` (unique, scoped)   at the call (``await enqueue_unique`` on asyncio): the
                               answer (new, or the live holder of the key) is needed now
``enqueue_many``               at the call (awaited on asyncio), like a bulk INSERT
``jobs.group``                 at the flush
=============================  ============================================================
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Generator, Iterable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

import sqlalchemy as sa
from sqlalchemy import event, inspect
from sqlalchemy.orm import Session, SessionTransaction, make_transient
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.session import SessionTransactionState

from ._enqueue import (
    DIRECT_KEY,
    JOBS_KEY,
    UniformRows,
    _sync,
    bind_call,
    direct_shape,
    insert_json,
    insert_rows,
    many_json,
    many_values,
    place_on_session,
    same_run,
    write_direct,
)
from ._storable import database_encodings, known_encodings
from ._tasks import (
    ConfiguredTask,
    ManyOptions,
    Task,
    TaskArgs,
    ascii_row,
    ascii_rows,
    check_encoding,
    many_options,
)
from .claiming import AsyncClaimMixin, ClaimMixin
from .db import require_postgresql
from .errors import EnqueueError
from .model import JobMixin

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .tasks import Jobs

__all__ = ["AsyncJobSession", "EnqueueMixin", "JobSession"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T", bound=Task[Any, Any])

_JOBS_KEY = JOBS_KEY
_PENDING_KEY = "sqla_jobs.pending"
_ANNOUNCE_KEY = "sqla_jobs.announce"
#: The ``enqueue_many`` batches whose transaction rolled back before they were written,
#: by id (see ``_write_batch``).
_DROPPED_KEY = "sqla_jobs.dropped"
#: The ``enqueue_many`` batches a flush wrote, by id, with how many of their rows it
#: inserted (see ``_write_batch``); kept until the session's transaction ends.
_FLUSHED_KEY = "sqla_jobs.flushed"
#: Job objects announced to ``enqueued`` listeners, to read back after their flush what
#: it left unloaded (see _load_announced).
_UNLOADED_KEY = "sqla_jobs.unloaded"
#: (transaction, jobs) per flush: the jobs the flush wrote itself, in the transaction
#: innermost then (see EnqueueMixin.flush); weak references, as the session's identity
#: map holds its objects, so that a long transaction does not keep every job alive.
_WRITTEN_KEY = "sqla_jobs.written"
#: Options that make a job unique, which needs an INSERT now (awaited, on asyncio).
_UNIQUE_OPTIONS = ("unique_key", "unique_for", "unique_states", "unique_on_conflict")


def _fail_as_a_flush(session: Session) -> None:
    """What SQLAlchemy's flush does when its work fails (call it while handling the
    error): roll the transaction back to its boundary (the innermost savepoint, or the
    whole transaction), whose pending objects become transient, and leave the session
    needing ``rollback()``, so that a ``commit()`` raises ``PendingRollbackError`` instead
    of sending a COMMIT that PostgreSQL answers with ROLLBACK and no error, losing what the
    transaction wrote before. The jobs this class writes around the ORM fail outside its
    flush; SQLAlchemy offers this only through the flush's own (private) subtransaction,
    the two calls its ``Session._flush`` makes."""
    transaction = session._autobegin_t()._begin()
    transaction.rollback(_capture_exception=True)


def _insert_pending_as_a_flush(session: Session) -> None:
    """:func:`_insert_pending` at a flush: a failure fails the flush (:func:`_fail_as_a_flush`),
    on this class's session and on a plain one behind an ``AsyncSession`` (the
    application's with this class mixed in, or an ``AsyncJobSession`` given a
    ``sync_session_class`` without it)."""
    try:
        _insert_pending(session)
    except BaseException:
        _fail_as_a_flush(session)
        raise


def _written_committed(session: Session) -> None:
    # As _after_commit does for announcements: a released savepoint hands its jobs to
    # its parent; the outermost commit keeps them for good.
    entries: list[tuple[SessionTransaction, list[Any]]] | None = session.info.get(_WRITTEN_KEY)
    if not entries:
        return
    released = session.get_nested_transaction()
    if released is None:
        session.info[_WRITTEN_KEY] = []
        return
    parent = released.parent
    assert parent is not None
    heir = _boundary_of(parent)
    session.info[_WRITTEN_KEY] = [
        (heir if boundary is released else boundary, jobs) for boundary, jobs in entries
    ]


def _written_rolled_back(session: Session) -> None:
    """A transaction rolled back: the jobs the flush wrote in it (or in a savepoint
    inside it) are transient again, holding what they held, as the ORM leaves the objects
    its flush wrote (``Session.add`` would insert them anew). Fired before the session
    expires what it holds, so they keep their values."""
    entries: list[tuple[SessionTransaction, list[weakref.ref[Any]]]] | None = session.info.get(
        _WRITTEN_KEY
    )
    if not entries:
        return
    rolled = session.get_nested_transaction() or session.get_transaction()
    gone: list[tuple[SessionTransaction, list[weakref.ref[Any]]]] = []
    kept: list[tuple[SessionTransaction, list[weakref.ref[Any]]]] = []
    for boundary, jobs in entries:
        inside: SessionTransaction | None = boundary
        while inside is not None and inside is not rolled:
            inside = inside.parent
        (gone if inside is not None else kept).append((boundary, jobs))
    session.info[_WRITTEN_KEY] = kept
    _make_transient(session, gone)


def _make_transient(
    session: Session, entries: list[tuple[SessionTransaction, list[weakref.ref[Any]]]]
) -> None:
    """The jobs of ``entries`` still in ``session`` made transient, holding what they
    held before their flush: a JSON column it filled with None goes (a job added again
    would write JSON ``null`` for it, not SQL NULL, as the ORM leaves such a column out)."""
    for _, refs in entries:
        for ref in refs:
            job = ref()
            if job is None or inspect(job).session_id != session.hash_key:
                continue
            make_transient(job)
            shape = direct_shape(type(job))
            if shape is not None:
                values = inspect(job).dict
                for name in shape.json_rest:
                    if name in values and values[name] is None:
                        del values[name]


def _forget_written(session: Session, transaction: SessionTransaction) -> None:
    # The outermost transaction ended: what it committed is for good, and what it rolled
    # back was handled; a session closed with it open leaves its objects detached. Jobs
    # still noted for the flush went with the transaction.
    if transaction.parent is None:
        for key in (_WRITTEN_KEY, DIRECT_KEY):
            if session.info.get(key):
                session.info[key] = []


class EnqueueMixin:
    """Adds :meth:`enqueue` and :meth:`enqueue_many` to a ``Session`` or ``AsyncSession``.

    Mix it in front of your own session class, or use :class:`JobSession` /
    :class:`AsyncJobSession`. The ``jobs=`` keyword (which ``sessionmaker`` passes through)
    names the registry used to resolve task *names*; task objects know their own registry.
    """

    info: dict[Any, Any]

    if TYPE_CHECKING:

        def add(self, instance: object, _warn: bool = True) -> None: ...

    def __init__(self, *args: Any, jobs: Jobs | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        if jobs is not None:
            self.info[_JOBS_KEY] = jobs

    def __init_subclass__(cls, **kw: Any) -> None:
        """A ``Session`` class that mixes this in listens for its sessions' commits and
        rollbacks (once per class: subclasses inherit the listeners), for the jobs its
        flush wrote itself (see :func:`_written_rolled_back`), and for the connections
        they begin, whose encodings :func:`_check_encoding` reads. On the class, not on
        each session: listening on an instance costs every new session more than the
        write it serves."""
        super().__init_subclass__(**kw)
        if issubclass(cls, Session) and not getattr(cls, "_sqla_jobs_listening", False):
            setattr(cls, "_sqla_jobs_listening", True)  # noqa: B010 - a mark, not a field
            event.listen(cls, "after_commit", _written_committed)
            event.listen(cls, "after_rollback", _written_rolled_back)
            event.listen(cls, "after_transaction_end", _forget_written)
            # The encodings of every engine a session connects to, for _check_encoding,
            # which then never needs a second connection of an engine the session holds
            # one of (a small pool would make it wait; a StaticPool would share it).
            event.listen(cls, "after_begin", _learn_encoding)

    def flush(self, objects: Any = None) -> Any:
        """Write the jobs ``enqueue`` added, flush the session, then write the waiting
        ``enqueue_many`` rows.

        The plain jobs are written first, by :func:`~sqla_jobs._enqueue.write_direct`
        (one prepared INSERT each, all in one round trip, for less client CPU than the
        ORM's unit of work), and are persistent afterwards as if the ORM had written
        them; what it leaves pending, the ORM writes. A flush of chosen ``objects`` leaves
        them all to the ORM.

        Why not only the ``after_flush`` hook for the rows: SQLAlchemy skips a flush (and
        its hooks) when the session holds no changed object of its own, so a session
        whose only work is ``enqueue_many`` rows would write nothing at ``flush()`` or at
        an autoflush, and a query right after would not see them. The rows go into the
        current transaction (the innermost savepoint), whose fate they already share. On
        an ``AsyncSession`` this returns the awaitable of its ``flush``.
        """
        parent: Any = super()
        if isinstance(self, Session):
            if objects is None:
                try:
                    written = write_direct(self)
                except BaseException:
                    _fail_as_a_flush(self)
                    raise
                if written:
                    boundary = self.get_nested_transaction() or self.get_transaction()
                    entries = self.info.get(_WRITTEN_KEY)
                    if entries is None:
                        entries = self.info[_WRITTEN_KEY] = []
                    entries.append((boundary, [weakref.ref(job) for job in written]))
            parent.flush(objects)
            _insert_pending_as_a_flush(self)
            if self.info.get(_UNLOADED_KEY):
                try:
                    _load_announced(self)
                except BaseException:
                    _fail_as_a_flush(self)
                    raise
            return None

        async def flush_async() -> None:
            await parent.flush(objects)
            # Already written when the sync session is ours; not with a sync_session_class
            # of the caller's that lacks this mixin.
            if self.info.get(_PENDING_KEY):
                await self.run_sync(_insert_pending_as_a_flush)  # type: ignore[attr-defined]

        return flush_async()

    # A type checker holds ``enqueue(task, ...)`` to the handler's signature: everything
    # after the task goes to the handler (P), so options are bound first, with
    # ``task.with_options(...)``. The keyword options of the implementation keep older
    # calls working at run time, unchecked; a task name (a string) is never checked.

    # What it returns is the model's object (a ``JobMixin``), or None: see the docstring.

    @overload
    def enqueue(
        self, task: Task[P, Any], /, *args: P.args, **kwargs: P.kwargs
    ) -> JobMixin | None: ...

    @overload
    def enqueue(
        self, task: ConfiguredTask[P, Any], /, *args: P.args, **kwargs: P.kwargs
    ) -> JobMixin | None: ...

    @overload
    def enqueue(self, task: str, /, *args: Any, **kwargs: Any) -> JobMixin | None: ...

    def enqueue(
        self,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        /,
        *args: Any,
        **kwargs: Any,
    ) -> JobMixin | None:
        """Add one job to the unit of work and return it (a new, pending ``Job`` object).

        The return type is :class:`~sqla_jobs.JobMixin` (the model's columns); a unique job
        returns the live job that holds its key instead, and a scoped one (``unique_for``,
        ...) returns None when the key's period holds it and the job that took it is gone.

        :param task: a task, a task with options (``task.with_options(queue=...)``), or
            the name of a task registered with this session's ``jobs``.
        :param args, kwargs: the handler's arguments; checked now, stored as JSON.

        The options (:class:`~sqla_jobs.EnqueueOptions`), best bound with
        :meth:`Task.with_options` (also accepted here as keywords, which a type checker
        cannot tell from the handler's arguments):

        :param queue: overrides the task's queue.
        :param priority: ``>= 0``; higher is claimed first. Overrides the task's.
        :param run_at: not before this (timezone-aware) time. Or ``delay``: seconds or a
            ``timedelta`` from now.
        :param max_attempts: overrides the task's.
        :param unique: at most one live (scheduled, ready or running) job per key:
            ``True`` derives the key from the task and its arguments, a
            :class:`~sqla_jobs.Unique` names it, or its period, states and conflict rule
            (the flat ``unique_key``, ``unique_for``, ``unique_states`` and
            ``unique_on_conflict`` are its deprecated spellings). A unique job
            is INSERTed at once (``ON CONFLICT DO NOTHING``, in the caller's transaction,
            without flushing anything else), because the answer is needed now: the new
            job, or the live one that already holds the key, is returned.
        :param meta: a JSON object stored with the job (tags, correlation ids), shown by
            ``admin`` and the CLI, and searchable (``jobs list --meta key=value``).
        :param keep_result: keep the handler's return value (``True``, or a retention
            ``timedelta``) for :meth:`Jobs.result`; overrides the task's.
        :param after: jobs (pending or persistent ``Job`` objects of this table) or job
            ids: this job runs once all of them have succeeded. Pending parents get their
            ids at the flush, which links them in the same transaction.
        :param on_parent_failure: ``"cancel"`` (default): a parent that ends dead or
            cancelled cancels this job, and what waits on it; ``"run"``: run it anyway.
        :raises EnqueueError: bad arguments or options; the session is left untouched.
        """
        # Through the class: also called with a plain Session as ``self`` (the one behind an
        # AsyncSession whose sync_session_class lacks this mixin).
        return EnqueueMixin._enqueue_job(self, task, args, kwargs)

    def _enqueue_job(
        self,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        shard: Any = None,
    ) -> JobMixin | None:
        """:meth:`enqueue`, the job routed to ``shard`` when one is given (a sharded
        session's call: its statements name the shard, ``bind_arguments={"shard_id":
        shard}``, and the job it reads back its ``identity_token``)."""
        pending = bind_call(task, args, kwargs, self)
        registry = pending.registry
        session = _sync(self)
        boundary = _boundary(session)
        if not ascii_row(pending.row):
            _check_encoding(session, registry, [pending.row], shard)
        job: JobMixin | None
        # Written by this class's flush (write_direct), unless the session lacks it (the
        # plain one behind an AsyncSession of the application's, whatever mixes this in
        # front of it) or is sharded.
        direct = shard is None and isinstance(session, EnqueueMixin)
        job, inserted = place_on_session(self, pending, shard, direct=direct)
        if inserted and registry.events.wants("enqueued"):
            _announce(session, registry, [job], boundary)
        return job

    # enqueue_many's rows can be type-checked only as ``task.args(...)`` objects, which
    # carry the handler's parameters (P); a mapping of keyword arguments cannot (a
    # TypedDict cannot be built from a ParamSpec), so mappings are checked at run time.

    @overload
    def enqueue_many(
        self,
        task: T,
        arguments: Iterable[TaskArgs[T]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int: ...

    @overload
    def enqueue_many(
        self,
        task: ConfiguredTask[P, R],
        arguments: Iterable[TaskArgs[Task[P, R]]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int: ...

    @overload
    def enqueue_many(
        self,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        arguments: Iterable[Mapping[str, Any]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int: ...

    def enqueue_many(
        self,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int:
        """Write many jobs of one task, one per item of ``arguments``; return how many were
        inserted.

        An item is a mapping of keyword arguments (checked at run time only), or
        ``task.args(...)`` (also checked by a type checker). Every job is checked before
        any is kept: one bad item raises :class:`EnqueueError` and none of the batch is
        written. The rows are written at the call, in one statement (a ``COPY`` for a big
        batch), into the transaction or savepoint innermost now, whose fate they share:
        SQLAlchemy's own bulk INSERT (``session.execute(insert(Job), rows)``) does the
        same. Like a query, the call flushes the session first when autoflush is on, so
        that a job table with a foreign key to an application table finds its rows (and,
        like a query, not from inside a flush: a flush listener may call it).
        With ``unique=True`` each job gets a key derived from its task and arguments, and
        one equal to a live job is silently skipped (and not counted). ``meta`` is given
        to every job of the call.

        On an ``AsyncSession`` the call is awaited: ``await session.enqueue_many(...)``
        (see :class:`Enqueued`).
        """
        given = many_options(options)
        if isinstance(self, Session) and not isinstance(self, _FlushingSession):
            return _write_many(self, task, arguments, given)
        # An AsyncSession of the application's own that mixes this class in, or the
        # session inside an AsyncJobSession called outside its greenlet: no I/O here.
        return _enqueued_later(self, task, arguments, given)


def _write_many(
    session: Session,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    given: dict[str, Any],
) -> int:
    """``enqueue_many`` on a sync session: checked, then written now.

    A list of :data:`CHECK_AS_WRITTEN_MIN_ROWS` rows or more is checked as it is written:
    its first row whole at the call, the others as the ``COPY`` sends them, inside its
    savepoint (see :func:`sqla_jobs._bulk.copy_run`), so the checks overlap the sending
    (checked first, they were a fifth of the call at 100,000 rows). The error still comes
    from this call, with nothing of it kept, though the session was flushed by then.
    Smaller calls, and rows that need more than their JSON (unique or concurrency keys,
    ``enqueued`` listeners), are checked whole before anything is flushed or written."""
    texts = None
    if isinstance(arguments, Sized) and len(arguments) >= CHECK_AS_WRITTEN_MIN_ROWS:
        registry, rows, texts = many_json(task, arguments, session, **given)
    else:
        registry, rows = many_values(task, arguments, session, **given)
    if not rows:
        return 0
    require_postgresql(session.get_bind(registry.model), "enqueue_many", EnqueueError)
    boundary = _boundary(session)  # refuses a session with autobegin=False and no transaction
    if texts is None:
        _check_encoding(session, registry, rows)
    _autoflush(session)
    connection = session.connection(bind_arguments={"mapper": registry.model})
    if texts is not None:
        return insert_json(connection, registry.queries, rows[0], texts)
    written: list[dict[str, Any]] | None = [] if registry.events.wants("enqueued") else None
    inserted = insert_rows(connection, registry.queries, rows, written)
    if written:
        _announce(session, registry, written, boundary)
    return inserted


def _autoflush(session: Session) -> None:
    """Flush as a query would before ``enqueue_many``'s rows are written: when autoflush
    is on, and not from inside a flush (a ``before_flush`` or ``after_flush`` listener),
    which would raise "Session is already flushing" (what ``Session._autoflush`` checks)."""
    if session.autoflush and not session._flushing:
        session.flush()


#: From how many rows (a list) a session's ``enqueue_many`` checks the rows after the
#: first as it writes them, rather than all of them first: see :func:`_write_many`.
CHECK_AS_WRITTEN_MIN_ROWS = 1_000


class Enqueued(int):
    """What ``enqueue_many`` returns on an ``AsyncSession``: how many jobs the call
    enqueued, and an awaitable. ``await session.enqueue_many(...)`` writes them at the
    call, as every session does (and returns how many were inserted).

    In 0.1 the call on an ``AsyncSession`` was a plain method whose rows waited for the
    next flush, and code that does not await it still works in 0.2: the rows are written
    at the next flush (or savepoint, or commit), with a ``DeprecationWarning``. The rows
    are checked at the call either way. Awaited after the savepoint it was made in rolled
    back, it writes nothing (the rows went with it)."""

    _session: Any
    _batch: Any

    def __new__(cls, count: int, session: Any, batch: Any) -> Enqueued:
        made = super().__new__(cls, count)
        made._session, made._batch = session, batch
        return made

    def __await__(self) -> Generator[Any, None, int]:
        return self._write().__await__()

    async def _write(self) -> int:
        if self._batch is None:
            return int(self)
        return int(await self._session.run_sync(_write_batch, self._batch))


def _enqueued_later(
    session: Any,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    given: dict[str, Any],
) -> Enqueued:
    """``enqueue_many`` where no I/O may happen at the call (an ``AsyncSession``, or its
    sync session outside the greenlet): checked now, kept for the flush, and written at
    once if the caller awaits what this returns."""
    registry, rows = many_values(task, arguments, session, **given)
    sync = _sync(session)
    batch = _keep_for_flush(sync, registry, rows)
    owner = session if hasattr(session, "run_sync") else None
    return Enqueued(len(rows), owner, batch if owner is not None else None)


def _write_batch(session: Session, batch: _Batch) -> int:
    """An awaited ``enqueue_many`` on an async session: its batch, written now (through
    the greenlet), unless a flush wrote it first."""
    batches: list[_Batch] = session.info.get(_PENDING_KEY) or []
    if not any(b is batch for b in batches):
        dropped: dict[int, _Batch] = session.info.get(_DROPPED_KEY) or {}
        if dropped.get(id(batch)) is batch:  # its savepoint rolled back: none inserted
            del dropped[id(batch)]
            return 0
        # A flush wrote it: how many it inserted (a unique key held by a live job, or
        # given twice, skips rows), not how many were given.
        flushed: dict[int, tuple[_Batch, int]] = session.info.get(_FLUSHED_KEY) or {}
        entry = flushed.pop(id(batch), None)
        if entry is not None and entry[0] is batch:
            return entry[1]
        return len(batch[2])  # awaited after its transaction ended: what was given
    session.info[_PENDING_KEY] = [b for b in batches if b is not batch]
    boundary, registry, rows = batch
    _autoflush(session)  # earlier batches of calls that were not awaited go first
    connection = session.connection(bind_arguments={"mapper": registry.model})
    written: list[dict[str, Any]] | None = [] if registry.events.wants("enqueued") else None
    inserted = insert_rows(connection, registry.queries, rows, written)
    if written:
        _announce(session, registry, written, boundary)
    return inserted


def _check_encoding(
    session: Session, registry: Jobs, rows: Sequence[dict[str, Any]], shard: Any = None
) -> None:
    """Refuse, at the call, text that the database of the jobs' table cannot store (one
    that is not UTF-8: LATIN1 has no "€"), which it would refuse only at the flush.

    Rows whose text is all ASCII (nearly all) cost a scan and nothing else. The others
    need the database's encoding, learned from a connection once per engine (what the
    server said when it opened). A session of this class learns it whenever its
    transaction connects (:func:`_learn_encoding`), so an engine not learned yet is one
    the session holds no connection of: a sync session borrows one from the engine's pool
    the first time, and gives it back, rather than take its own, which would begin its
    transaction (an enqueue does no I/O of the session's, and the application may still
    choose its isolation level). An ``AsyncSession``, which cannot wait here, checks once
    its engine has connected (its first flush). The writers check again where they hold
    a connection."""
    if ascii_rows(rows):
        return
    try:
        route = {} if shard is None else {"shard_id": shard}
        bind = session.get_bind(mapper=registry.model, **route)
    except sa.exc.SQLAlchemyError:  # no bind for it: the flush will say so
        return
    engine = bind.engine if isinstance(bind, sa.Connection) else bind
    if not isinstance(engine, sa.Engine):
        return
    learned, encodings = known_encodings(engine)
    if not learned:
        if engine.dialect.is_async:
            # Learned when the session's transaction connects (its flush), for the next.
            _listen(session, ("after_begin", _learn_encoding))
            return
        if isinstance(bind, sa.Connection):  # the session's own: begun already, or never
            encodings = database_encodings(bind)
        else:
            with engine.connect() as connection:
                encodings = database_encodings(connection)
    if encodings is not None:
        check_encoding(rows, encodings)


def _learn_encoding(session: Session, transaction: Any, connection: sa.Connection) -> None:
    # A lookup once the engine's are known.
    database_encodings(connection)


def _keep_for_flush(
    session: Session, registry: Jobs, rows: Sequence[dict[str, Any]]
) -> _Batch | None:
    """Checked rows wait for the next flush, tagged with the transaction whose fate they
    share; the ``enqueued`` listeners hear of them when it commits. Their batch."""
    if not rows:
        return None
    # Refused now, not at the flush: the rows are written with PostgreSQL's SQL.
    require_postgresql(session.get_bind(registry.model), "enqueue_many", EnqueueError)
    boundary = _boundary(session)
    _check_encoding(session, registry, rows)
    batch: _Batch = (boundary, registry, rows)
    _pending(session).append(batch)  # announced as written (the rows a unique key skips are not)
    return batch


class JobSession(EnqueueMixin, ClaimMixin, Session):
    """A ``Session`` with ``enqueue`` and the claim helpers (``claim``, ``complete``,
    ``fail``, ``retry``, ``snooze``); ``sessionmaker(engine, class_=JobSession,
    jobs=jobs)``."""


class _FlushingSession(EnqueueMixin, Session):
    """The plain ``Session`` inside an :class:`AsyncJobSession`: its flush (explicit or
    an autoflush) writes the waiting ``enqueue_many`` rows too."""


try:
    from sqlalchemy.ext.asyncio import AsyncSession
except ImportError:  # SQLAlchemy's asyncio needs greenlet: pip install 'sqla-jobs[asyncio]'
    pass
else:

    class AsyncJobSession(AsyncClaimMixin, AsyncSession):
        """An ``AsyncSession`` with ``enqueue`` and the claim helpers, awaited;
        ``async_sessionmaker(..., class_=AsyncJobSession, jobs=jobs)``.

        A proxy of the session behind it (``sync_session``, a :class:`JobSession` kind),
        as SQLAlchemy's ``AsyncSession`` is: what does no I/O is a plain method that calls
        the sync session's (``enqueue``, which only adds to the unit of work, like
        ``add``), and what writes is awaited, through the greenlet (``enqueue_many``,
        ``enqueue_unique``, and ``flush``, ``commit``, which write the jobs ``enqueue``
        added). A unique job must be inserted at once to know whether it is new: use
        :meth:`enqueue_unique` for those. The rules are the sync session's: one code path.
        """

        #: The session behind it: a :class:`JobSession` whose flush also writes the rows
        #: of ``enqueue_many`` calls that were not awaited (deprecated, see
        #: :class:`Enqueued`).
        sync_session_class = _FlushingSession

        def __init__(self, *args: Any, jobs: Jobs | None = None, **kw: Any) -> None:
            # Kept on the session behind (``info`` is its), whatever its class.
            super().__init__(*args, **kw)
            if jobs is not None:
                self.sync_session.info[_JOBS_KEY] = jobs

        # A plain enqueue is never unique here (refused), so it always returns the new job.

        @overload
        def enqueue(self, task: Task[P, Any], /, *args: P.args, **kwargs: P.kwargs) -> JobMixin: ...

        @overload
        def enqueue(
            self, task: ConfiguredTask[P, Any], /, *args: P.args, **kwargs: P.kwargs
        ) -> JobMixin: ...

        @overload
        def enqueue(self, task: str, /, *args: Any, **kwargs: Any) -> JobMixin: ...

        def enqueue(self, task: Any, /, *args: Any, **kwargs: Any) -> JobMixin:
            """:meth:`JobSession.enqueue <EnqueueMixin.enqueue>` on the session behind
            this one (no I/O: the job is written at the next awaited flush or commit).

            :raises EnqueueError: as there, and for a unique job (use
                :meth:`enqueue_unique`)."""
            refuse_unique(task, kwargs)
            # Through the class: the sync session may be of a class of the caller's.
            job = EnqueueMixin._enqueue_job(self.sync_session, task, args, kwargs)  # type: ignore[arg-type]
            assert job is not None  # only a scoped unique job gives None
            return job

        @overload
        def enqueue_many(
            self, task: T, arguments: Iterable[TaskArgs[T]], /, **options: Unpack[ManyOptions]
        ) -> Enqueued: ...

        @overload
        def enqueue_many(
            self,
            task: ConfiguredTask[P, R],
            arguments: Iterable[TaskArgs[Task[P, R]]],
            /,
            **options: Unpack[ManyOptions],
        ) -> Enqueued: ...

        @overload
        def enqueue_many(
            self,
            task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
            arguments: Iterable[Mapping[str, Any]],
            /,
            **options: Unpack[ManyOptions],
        ) -> Enqueued: ...

        def enqueue_many(
            self,
            task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
            arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
            /,
            **options: Unpack[ManyOptions],
        ) -> Enqueued:
            """:meth:`JobSession.enqueue_many <EnqueueMixin.enqueue_many>`, awaited:
            ``await session.enqueue_many(task, rows)`` checks the rows at the call and
            writes them then, in this session's transaction (see :class:`Enqueued`)."""
            return _enqueued_later(self, task, arguments, many_options(options))

        @overload
        async def enqueue_unique(
            self, task: Task[P, Any], /, *args: P.args, **kwargs: P.kwargs
        ) -> JobMixin | None: ...

        @overload
        async def enqueue_unique(
            self, task: ConfiguredTask[P, Any], /, *args: P.args, **kwargs: P.kwargs
        ) -> JobMixin | None: ...

        @overload
        async def enqueue_unique(
            self, task: str, /, *args: Any, **kwargs: Any
        ) -> JobMixin | None: ...

        async def enqueue_unique(self, task: Any, /, *args: Any, **kwargs: Any) -> JobMixin | None:
            """``enqueue(..., unique=True)`` (or with ``unique_key=``, as an option of
            ``task.with_options()``), awaited."""
            task = as_unique(task, kwargs)

            def run(sync_session: Any) -> Any:
                return EnqueueMixin.enqueue(sync_session, task, *args, **kwargs)

            return await self.run_sync(run)

        async def flush(self, objects: Sequence[Any] | None = None) -> None:
            """``AsyncSession.flush``; with a ``sync_session_class`` of the caller's that
            lacks :class:`EnqueueMixin`, the waiting ``enqueue_many`` rows are written
            after it, as :class:`JobSession`'s flush writes them."""
            await super().flush(objects)
            if self.sync_session.info.get(_PENDING_KEY):
                await self.run_sync(_insert_pending_as_a_flush)


def refuse_unique(task: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a unique job in an ``AsyncSession``'s plain ``enqueue``: it must be INSERTed
    at once, which on asyncio means awaiting (``enqueue_unique``)."""
    bound = task.options if isinstance(task, ConfiguredTask) else {}
    plain = task.task if isinstance(task, ConfiguredTask) else task
    if (isinstance(plain, Task) and plain.unique) or any(
        o.get("unique") or any(o.get(n) is not None for n in _UNIQUE_OPTIONS)
        for o in (bound, kwargs)
    ):
        raise EnqueueError(
            "a unique job is inserted at once: use `await session.enqueue_unique(...)` "
            "on an AsyncSession"
        )


def as_unique(task: Any, kwargs: dict[str, Any]) -> Any:
    """``enqueue_unique``'s task, and its keywords (changed in place): ``unique=True``
    unless the task, its options or the call already say how it is unique (a
    ``Unique(...)``, a ``unique_key``, a scope), which ``unique=True`` would replace."""
    bound = task.options if isinstance(task, ConfiguredTask) else {}
    plain = task.task if isinstance(task, ConfiguredTask) else task
    if (isinstance(plain, Task) and plain.unique) or any(
        o.get("unique") or any(o.get(n) is not None for n in _UNIQUE_OPTIONS)
        for o in (bound, kwargs)
    ):
        return task
    if isinstance(task, ConfiguredTask):
        return task.with_options(unique=True)
    kwargs["unique"] = True
    return task


# -- savepoints ---------------------------------------------------------------------------
#
# A job shares the fate of the transaction that was innermost when it was enqueued: the
# current SAVEPOINT (``begin_nested()``), else the outermost transaction. ``enqueue`` adds
# an ORM object, whose fate SQLAlchemy tracks itself; ``enqueue_many`` rows and the
# ``enqueued`` announcements are ours to track, so each batch is tagged with that
# transaction (its "boundary"):
#
# * a savepoint begins: the waiting rows belong to its parent, so they are written now,
#   through the parent's connection, before the SAVEPOINT statement (which SQLAlchemy emits
#   only when the savepoint first uses its connection). Waiting rows therefore always
#   belong to the innermost transaction, and a flush writes them into it;
# * a savepoint is released or the transaction commits: the waiting rows are written
#   (``before_commit``); a released savepoint hands its announcements to its parent, and
#   the outermost commit fires them (``after_commit``);
# * a savepoint or the transaction ends: whatever is still tagged with it did not commit,
#   and is dropped (``after_transaction_end``, which also fires for the flush's internal
#   subtransactions: only boundaries count).

#: (boundary transaction, registry, rows) per ``enqueue_many`` call, waiting to be written.
_Batch = tuple[SessionTransaction, "Jobs", Sequence[dict[str, Any]]]


#: A transaction in these states is over (see :func:`_boundary`).
_ENDED = frozenset(
    {
        SessionTransactionState.COMMITTED,
        SessionTransactionState.DEACTIVE,
        SessionTransactionState.CLOSED,
    }
)


def _boundary(session: Session) -> SessionTransaction:
    """The transaction whose fate a job enqueued now shares; begins one, as ``add`` would."""
    transaction = session.get_nested_transaction() or session.get_transaction()
    if transaction is None:
        if not session.autobegin:
            raise EnqueueError(
                "this session has autobegin=False and no transaction: "
                "call session.begin() before enqueueing"
            )
        # What Session.add does first: begin the session's transaction (no I/O yet).
        transaction = session._autobegin_t()
    elif transaction._state in _ENDED:
        # In after_commit or after_rollback: the job would be accepted, then dropped by
        # SQLAlchemy's rollback or with the session, or written by whatever transaction
        # came next. SQLAlchemy says no more than ``is_active``, which is also False while
        # the transaction connects (``after_begin``), where a job still rides it.
        if transaction._state is SessionTransactionState.DEACTIVE:
            # After a failed flush: SQLAlchemy's PendingRollbackError, naming the error,
            # as any statement would raise (session.connection() raises it and does
            # nothing else). In after_rollback it says "inactive" instead: ours, then.
            try:
                session.connection()
            except sa.exc.PendingRollbackError:
                raise
            except sa.exc.InvalidRequestError:
                pass  # "inactive state": a rollback under way
        raise EnqueueError(
            "the session's transaction has ended (it committed or rolled back): a job "
            "enqueued in it now would be lost. Enqueue in before_commit (or earlier), or "
            "in a new transaction"
        )
    return transaction


def _boundary_of(transaction: SessionTransaction) -> SessionTransaction:
    while not (transaction.nested or transaction.parent is None):
        transaction = transaction.parent
    return transaction


def _listen(session: Session, *hooks: tuple[str, Any]) -> None:
    for name, fn in hooks:
        if not event.contains(session, name, fn):
            event.listen(session, name, fn)


def _pending(session: Session) -> list[_Batch]:
    """The batches waiting for the next flush; hooks the session the first time."""
    batches: list[_Batch] | None = session.info.get(_PENDING_KEY)
    if batches is None:
        batches = session.info[_PENDING_KEY] = []
        _listen(
            session,
            ("after_flush", _after_flush),
            ("before_commit", _before_commit),
            ("after_transaction_create", _after_transaction_create),
            ("after_transaction_end", _after_transaction_end),
        )
    return batches


def pending_jobs(session: Session) -> dict[Jobs, list[dict[str, Any]]]:
    """``enqueue_many`` rows still waiting for the session's next flush, per registry
    (a new dict: changing it changes nothing)."""
    pending: dict[Jobs, list[dict[str, Any]]] = {}
    for _, registry, rows in _sync(session).info.get(_PENDING_KEY) or ():
        pending.setdefault(registry, []).extend(rows)
    return pending


def insert_pending(session: Session) -> None:
    """INSERT the waiting ``enqueue_many`` rows now, as the next flush would (into the
    current savepoint, if one is open)."""
    _insert_pending(_sync(session))


def _announce(
    session: Session, registry: Jobs, jobs: Sequence[Any], boundary: SessionTransaction
) -> None:
    """Fire ``enqueued`` for these jobs once the outermost transaction commits, and never
    if ``boundary`` (their savepoint, or the transaction) rolls back: metrics count jobs
    that exist."""
    announce: list[tuple[SessionTransaction, Jobs, Sequence[Any]]] | None = session.info.get(
        _ANNOUNCE_KEY
    )
    if announce is None:
        announce = session.info[_ANNOUNCE_KEY] = []
        _listen(
            session,
            ("after_commit", _after_commit),
            ("after_transaction_end", _after_transaction_end),
        )
    announce.append((boundary, registry, jobs))
    if jobs and inspect(jobs[0], raiseerr=False) is not None:
        # Job objects (not enqueue_many rows): what the ORM's flush leaves unloaded of
        # them is read back after it (_load_announced).
        pending = [job for job in jobs if inspect(job).key is None]
        if pending:
            session.info.setdefault(_UNLOADED_KEY, []).extend(pending)


def _load_announced(session: Session) -> None:
    """Read back what a flush left unloaded of the jobs announced to the ``enqueued``
    listeners, which fire after the commit, when no SQL can run: the model's server
    defaults (``run_at``, ``created_at``, ``attempts``; ``eager_defaults=False``) of a job
    the ORM wrote, its ``status`` and ``run_at`` a link with ``after=`` expired. A job
    the session's flush wrote itself holds them already and costs nothing; the others, one
    SELECT per model and flush, only while someone listens."""
    announced: list[Any] = session.info.get(_UNLOADED_KEY) or []
    waiting: list[Any] = []
    session.info[_UNLOADED_KEY] = waiting
    groups: dict[Any, tuple[list[str], dict[Any, Any]]] = {}
    sharded: list[tuple[Any, list[str]]] = []
    for job in announced:
        state = inspect(job)
        if state.session_id != session.hash_key:
            continue  # expunged, or gone with its savepoint
        if state.key is None:
            waiting.append(job)  # not flushed yet (a flush of chosen objects)
            continue
        unloaded = state.unloaded
        if not unloaded:
            continue
        mapper = state.mapper
        names = [
            p.key
            for p in mapper.column_attrs
            if p.key in unloaded and not p.deferred and isinstance(p.expression, sa.Column)
        ]
        if not names:
            continue
        if state.identity_token is not None:  # a sharded session's: read from its shard
            sharded.append((job, names))
            continue
        keys, by_id = groups.setdefault(mapper, ([], {}))
        keys.extend(n for n in names if n not in keys)
        by_id[state.identity[0]] = job
    with session.no_autoflush:
        for job, names in sharded:
            session.refresh(job, names)
    for mapper, (keys, by_id) in groups.items():
        columns = [mapper.attrs[key].expression for key in keys]
        primary_key = mapper.primary_key[0]
        connection = session.connection(bind_arguments={"mapper": mapper})
        found = connection.execute(
            sa.select(primary_key, *columns).where(primary_key.in_(list(by_id)))
        )
        for row in found:
            job = by_id[row[0]]
            unloaded = inspect(job).unloaded
            for key, value in zip(keys, row[1:], strict=True):
                if key in unloaded:
                    set_committed_value(job, key, value)


def _after_commit(session: Session) -> None:
    # Also fired when a SAVEPOINT is released; get_nested_transaction() is then that
    # savepoint (the savepoints inside it were committed and closed first).
    announce: list[tuple[SessionTransaction, Jobs, Sequence[Any]]] | None = session.info.get(
        _ANNOUNCE_KEY
    )
    if not announce:
        return
    released = session.get_nested_transaction()
    if released is not None:
        parent = released.parent
        assert parent is not None
        heir = _boundary_of(parent)
        session.info[_ANNOUNCE_KEY] = [
            (heir if boundary is released else boundary, registry, jobs)
            for boundary, registry, jobs in announce
        ]
        return
    root = session.get_transaction()
    session.info[_ANNOUNCE_KEY] = []
    for boundary, registry, jobs in announce:
        if boundary is root:
            for job in jobs:
                if _committed(job):
                    registry.events.fire("enqueued", job)


def _committed(job: Any) -> bool:
    """Whether a job announced by this session reached the table: an ``enqueue_many`` row
    was written (its boundary committed); a ``Job`` object only if it was flushed and not
    deleted. One expunged (``expunge``, ``expunge_all``) before any flush never was, and
    metrics must not count it."""
    state = inspect(job, raiseerr=False)
    if state is None:  # an enqueue_many row (a dict)
        return True
    return state.key is not None and not state.was_deleted


def _insert_pending(session: Session, through: SessionTransaction | None = None) -> None:
    """Write every waiting row: through the session's current transaction, or ``through``
    the given one."""
    batches: list[_Batch] | None = session.info.get(_PENDING_KEY)
    if not batches:
        return
    session.info[_PENDING_KEY] = []
    warnings.warn(
        "enqueue_many on an AsyncSession is awaited from sqla-jobs 0.2: "
        "`await session.enqueue_many(...)` writes the rows at the call, as every session "
        "does; these rows of a call that was not awaited were written at this flush, as "
        "in 0.1",
        DeprecationWarning,
        stacklevel=2,
    )
    # Consecutive calls for one registry share one statement when their options agree:
    # runs (rows that differ only in their arguments) with runs whose first rows agree,
    # other rows with other rows (insert_rows groups those row by row). New lists and
    # runs: the batches' own are the ones handed to the ``enqueued`` listeners.
    by_registry: dict[Jobs, list[Sequence[dict[str, Any]]]] = {}
    for _, registry, rows in batches:
        groups = by_registry.setdefault(registry, [])
        last = groups[-1] if groups else None
        if isinstance(rows, UniformRows):
            if isinstance(last, UniformRows) and same_run(last, rows):
                groups[-1] = last.joined(rows)
            else:
                groups.append(rows)
        elif isinstance(last, list):
            last.extend(rows)
        else:
            groups.append(list(rows))
    written: list[dict[str, Any]] = []
    for registry, groups in by_registry.items():
        if through is None:
            connection = session.connection(bind_arguments={"mapper": registry.model})
        else:
            connection = through.connection(inspect(registry.model))
        for group in groups:
            uniform = isinstance(group, UniformRows)
            # The rows written are collected whether or not anyone listens: each batch's
            # count is read from them (an awaited call returns it).
            insert_rows(connection, registry.queries, group, None if uniform else written)
    # Each batch's rows that were written, in its own transaction's fate (runs hold no
    # unique key: all of theirs were).
    inserted = {id(row) for row in written}
    flushed: dict[int, tuple[_Batch, int]] = session.info.setdefault(_FLUSHED_KEY, {})
    for batch in batches:
        boundary, registry, rows = batch
        kept = rows if isinstance(rows, UniformRows) else [r for r in rows if id(r) in inserted]
        flushed[id(batch)] = (batch, len(kept))
        if kept and registry.events.wants("enqueued"):
            _announce(session, registry, kept, boundary)


def _after_flush(session: Session, flush_context: Any) -> None:
    # After the session's own objects: a job table with a foreign key to an app table
    # finds the referenced rows already there.
    _insert_pending(session)


def _before_commit(session: Session) -> None:
    # The outermost COMMIT or a savepoint's RELEASE. A session holding only enqueue_many
    # rows is "clean" and would skip its flush.
    if session.info.get(_PENDING_KEY):
        session.flush()
        _insert_pending(session)


def _after_transaction_create(session: Session, transaction: SessionTransaction) -> None:
    if transaction.nested and session.info.get(_PENDING_KEY):
        # The rows waiting now belong to the parent: write them through it, before the
        # new savepoint's SAVEPOINT statement, so that its rollback cannot take them.
        parent = transaction.parent
        assert parent is not None
        _insert_pending(session, parent)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        # Committed rows were written already; rolled-back ones must not leak into the
        # session's next transaction.
        _dropped(session, session.info.pop(_PENDING_KEY, None) or ())
        session.info.pop(_ANNOUNCE_KEY, None)
        session.info.pop(_FLUSHED_KEY, None)
        session.info.pop(_UNLOADED_KEY, None)
    elif transaction.nested:
        # A released savepoint handed everything on (before_commit, after_commit): what is
        # still tagged with it was rolled back.
        for key in (_PENDING_KEY, _ANNOUNCE_KEY):
            entries = session.info.get(key)
            if entries:
                session.info[key] = [e for e in entries if e[0] is not transaction]
                if key == _PENDING_KEY:
                    _dropped(session, [e for e in entries if e[0] is transaction])


def _dropped(session: Session, batches: Iterable[_Batch]) -> None:
    """Batches of ``enqueue_many`` rolled back unwritten: awaited later, they say that
    none was inserted (they said all were). Kept by id with the batch itself, so that no
    later batch at the same address (CPython reuses it at once) is taken for one."""
    kept = {id(batch): batch for batch in batches}
    if kept:
        session.info.setdefault(_DROPPED_KEY, {}).update(kept)

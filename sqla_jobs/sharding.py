"""Jobs across several databases, on SQLAlchemy's horizontal sharding.

When one PostgreSQL primary is not enough, an application shards its data with
:mod:`sqlalchemy.ext.horizontal_shard`: a ``ShardedSession`` whose ``shard_chooser``
decides, per object, which engine its row lives in. Its jobs follow its rows. Each shard
gets its own jobs table (the same ``JobMixin`` model, created by the same migration on every
shard), and:

* :class:`ShardedJobSession` is a ``ShardedSession`` with ``enqueue``: a job is written into
  the shard where the same unit of work writes its rows, so it commits (or rolls back)
  with them; :class:`AsyncShardedJobSession` is the same under an ``AsyncSession``;
* :class:`ShardedWorker` serves the jobs tables of several engines, one
  :class:`~sqla_jobs.Worker` per shard, so a shard that is down pauses only its own;
  :class:`AsyncShardedWorker` does the same with one ``AsyncWorker`` per shard on one
  event loop; the ``health()`` of either says which shard is unhealthy or unreachable;
* :func:`stats`, :func:`total` and :func:`list_jobs` look at every shard for the admin
  API, the CLI (``--shard NAME=URL``) and the dashboard (``create_app(jobs, engines=...)``).

.. code-block:: python

    Session = sessionmaker(
        class_=ShardedJobSession,
        shards={"eu": eu_engine, "us": us_engine},
        shard_chooser=lambda mapper, instance, clause=None: instance.region,
        identity_chooser=...,
        execute_chooser=...,
        jobs=jobs,
    )
    with Session.begin() as session:
        session.add(order)                               # goes to order.region
        session.enqueue(send_receipt, order_ref=order.ref) # where order goes

    ShardedWorker(jobs, {"eu": eu_url, "us": us_url}, concurrency=32).run()

.. warning::

   A ``ShardedSession``'s transaction holds one connection per shard it touched, and commits
   them one after another: it is not a two-phase commit. If the second COMMIT fails, the
   first shard's rows (and jobs) are committed and the second's are not. What sqla-jobs
   promises is per shard: a job commits with its own shard's rows, in the same
   transaction, never without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar, overload

import sqlalchemy as sa
from sqlalchemy import event, inspect
from sqlalchemy.ext.horizontal_shard import ShardedSession
from sqlalchemy.orm import Mapper, Session, SessionTransaction

from . import admin
from ._enqueue import insert_rows, many_values
from ._tasks import (
    ConfiguredTask,
    ManyOptions,
    Task,
    TaskArgs,
    many_options,
)
from .errors import EnqueueError, WorkerError, describe, unreachable
from .model import JobMixin
from .session import (
    _JOBS_KEY,
    EnqueueMixin,
    _announce,
    _boundary,
    as_unique,
    refuse_unique,
)
from .tasks import Jobs
from .worker._core import misconfigured
from .worker._driver import DriverBase
from .worker._signals import loop_signals, relay, signalled, stopped_by_signals
from .worker.settings import WorkerSettings, resolve
from .worker.threaded import Worker

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .worker._core import WorkerCore
    from .worker.settings import WorkerOptions

__all__ = [
    "ShardResult",
    "ShardedJobSession",
    "ShardedWorker",
    "across",
    "list_jobs",
    "newest",
    "queue_states",
    "stats",
    "total",
]

T = TypeVar("T")

log = logging.getLogger("sqla_jobs.sharding")

#: Longest pause before starting again the worker of a shard that could not be reached.
_RESTART_CAP = 5.0

#: Where a job's chosen shard is kept: the job's ``InstanceState.info``, until its flush.
_SHARD_KEY = "sqla_jobs.shard"

#: ``enqueue(..., shard=None)`` is told apart from no ``shard=`` at all: for a handler
#: with a ``shard`` parameter, the first is an ambiguous keyword, the second is not.
_UNSET: Any = object()

P = ParamSpec("P")
Ret = TypeVar("Ret", covariant=True)


_AnyTask = Task[Any, Any] | ConfiguredTask[Any, Any] | str
_Rows = Iterable[TaskArgs[Any] | Mapping[str, Any]]


class ShardedManyOptions(ManyOptions, total=False):
    """The keywords of the sharded sessions' ``enqueue_many``: the
    :class:`~sqla_jobs.tasks.ManyOptions`, and where the rows go (``shard=``, or
    ``shard_with=`` an ORM object; see :meth:`ShardedJobSession.shard_of_job`)."""

    shard: Any
    shard_with: Any


class _Enqueue(Protocol[Ret]):
    """The typed face of the sharded sessions' ``enqueue`` (and ``enqueue_unique``): a
    call without ``shard=``/``shard_with=`` is held to the handler's signature, as on
    :class:`~sqla_jobs.JobSession` (options bound with ``task.with_options(...)``, the
    one :class:`~sqla_jobs.tasks.EnqueueOptions` declaration); one that names its shard
    keeps the handler's arguments unchecked, since a ``ParamSpec`` cannot take a keyword
    more."""

    @overload
    def __call__(
        self, task: Task[P, Any] | ConfiguredTask[P, Any], /, *args: P.args, **kwargs: P.kwargs
    ) -> Ret: ...

    @overload
    def __call__(self, task: _AnyTask, /, *args: Any, shard: Any, **kwargs: Any) -> Ret: ...

    @overload
    def __call__(self, task: _AnyTask, /, *args: Any, shard_with: Any, **kwargs: Any) -> Ret: ...

    @overload
    def __call__(self, task: str, /, *args: Any, **kwargs: Any) -> Ret: ...


def _refuse_ambiguous(session: Any, task: Any, **given: Any) -> None:
    """Refuse ``shard=``/``shard_with=`` for a task whose handler takes an argument of that
    name: the keyword could be either, and a job on the wrong shard, or with an argument
    silently dropped, is worse than an error.

    Why not reserve the names for every handler, as the plain options are: these are
    options of the sharded session only, and an application that does not shard (or a
    task enqueued elsewhere, by name or on a plain connection) should keep its ``shard``
    parameters."""
    named = [name for name, value in given.items() if value is not _UNSET]
    if not named:
        return
    plain = task.task if isinstance(task, ConfiguredTask) else task
    if isinstance(plain, str):
        registry = session.info.get(_JOBS_KEY)
        if registry is None or plain not in registry.tasks:
            return  # enqueue says what is wrong with the name
        plain = registry.tasks[plain]
    if not isinstance(plain, Task):
        return
    clash = [name for name in named if name in plain.signature.parameters]
    if clash:
        listed = " and ".join(f"{name}=" for name in clash)
        raise EnqueueError(
            f"task {plain.name!r}: {listed} is both an option of the sharded session's "
            f"enqueue and a parameter of the handler; pass the handler's argument "
            f"positionally, or in a mapping through enqueue_many(task, [{{...}}], shard=...), "
            f"or rename the parameter"
        )


class ShardedJobSession(EnqueueMixin, ShardedSession):
    """A ``ShardedSession`` whose ``enqueue`` writes each job into the shard of its rows.

    Takes what ``ShardedSession`` takes (``shards``, ``shard_chooser``, ...) and ``jobs=``.
    The shard of a job is, in this order:

    1. ``shard="eu"``: that shard, named explicitly;
    2. ``shard_with=order``: the shard of that ORM object (where it was loaded from, or
       where ``shard_chooser`` sends it if it is new);
    3. otherwise the one shard this unit of work writes to: the shards of the objects that
       are new, changed or deleted in the session now, and of those flushed earlier in the
       same transaction. If that is no shard or more than one, ``enqueue`` raises
       :class:`EnqueueError` rather than guess.

    ``shard`` and ``shard_with`` are options of the sharded session's ``enqueue``. For a
    task whose handler has a parameter of one of those names, the keyword would mean two
    things: ``enqueue`` refuses it (:class:`EnqueueError`) rather than pick one. Pass such
    an argument positionally, or through ``enqueue_many`` (whose items are mappings of the
    handler's arguments, apart from its options); or rename the parameter.

    ``enqueue_many`` writes its rows at the call, as on every session (one INSERT on the
    shard's connection, in the caller's transaction).
    A unique job (``unique=True``, ``unique_key=``) is INSERTed at once on its shard, as on
    a plain session; its key is unique per shard (as with ``enqueue_many(...,
    unique=True)``).
    """

    def __init__(
        self,
        shard_chooser: Callable[..., Any],
        identity_chooser: Callable[..., Any] | None = None,
        execute_chooser: Callable[..., Any] | None = None,
        shards: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        self._user_chooser = shard_chooser
        self._shard_names = frozenset(shards or ())
        self._written: set[Any] = set()
        super().__init__(self._choose, identity_chooser, execute_chooser, shards=shards, **kw)
        event.listen(self, "after_flush", _after_flush)
        event.listen(self, "after_transaction_end", _after_transaction_end)

    def connection_callable(
        self,
        mapper: Mapper[Any] | None = None,
        instance: Any = None,
        shard_id: Any = None,
        **kw: Any,
    ) -> sa.Connection:
        """The connection a flush writes an object with: in a savepoint, the savepoint's.

        ``ShardedSession`` flushes through the outermost transaction, whose connection to
        a shard does not begin the savepoint there: that is begun at the first statement
        that asks the session for the shard's connection (an ``enqueue_many``, a unique
        job, a query), and rows flushed before it were not in it. Rolled back, the
        savepoint kept a row and lost its job, or kept a job that waits for its parents
        and lost the statement that links it (held for ever). Every statement of the
        session on a shard now goes through the innermost transaction, so a row and its
        jobs share their fate however they interleave."""
        nested = self.get_nested_transaction()
        if nested is None:
            return super().connection_callable(mapper, instance, shard_id, **kw)
        bind = self.get_bind(mapper, shard_id=shard_id, instance=instance)
        return self.connection(bind_arguments={"bind": bind})

    # The chooser the session runs: a job object goes where ``enqueue`` decided; the rest
    # is the application's choice. A unique job's statements and its read-back name the
    # shard themselves (``bind_arguments={"shard_id": ...}``, ``identity_token``): the
    # routing is explicit per call, never a mode of the session.

    def _choose(self, mapper: Mapper[Any], instance: Any, clause: Any = None, **kw: Any) -> Any:
        if instance is not None:
            shard = inspect(instance).info.get(_SHARD_KEY)
            if shard is not None:
                return shard
        return self._user_chooser(mapper, instance, clause=clause, **kw)

    if TYPE_CHECKING:
        enqueue: _Enqueue[JobMixin | None]
    else:

        def enqueue(self, task, /, *args, shard=_UNSET, shard_with=_UNSET, **kwargs):
            return self._enqueue(task, args, kwargs, shard, shard_with)

    def _enqueue(
        self,
        task: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        shard: Any = _UNSET,
        shard_with: Any = _UNSET,
    ) -> Any:
        """``enqueue``: like :meth:`EnqueueMixin.enqueue`, on the shard chosen as the
        class says.

        :raises EnqueueError: no shard can be determined, or it is not one of ``shards``;
            ``shard=`` or ``shard_with=`` given for a task whose handler has a parameter of
            that name; the session is left untouched.
        """
        _refuse_ambiguous(self, task, shard=shard, shard_with=shard_with)
        target = self.shard_of_job(
            shard=None if shard is _UNSET else shard,
            shard_with=None if shard_with is _UNSET else shard_with,
        )
        # A unique job is INSERTed now, on the shard's connection, and read back from it.
        job = self._enqueue_job(task, args, kwargs, shard=target)
        if job is not None:
            self.place_on_shard(job, target)
        return job

    def enqueue_many(
        self, task: _AnyTask, arguments: _Rows, /, **options: Unpack[ShardedManyOptions]
    ) -> int:
        """Like :meth:`EnqueueMixin.enqueue_many`, but the rows are INSERTed at once, on
        the chosen shard's connection (in the caller's transaction, or savepoint)."""
        target = self.shard_of_job(
            shard=options.pop("shard", None), shard_with=options.pop("shard_with", None)
        )
        registry, rows = many_values(task, arguments, self, **many_options(options))
        if rows:
            boundary = _boundary(self)
            connection = self.connection(bind_arguments={"shard_id": target})
            wants = registry.events.wants("enqueued")
            written: list[dict[str, Any]] | None = [] if wants else None
            # Jobs are not among the shards this unit of work writes to (objects are): the
            # next enqueue without a shard is refused, not sent where these rows went.
            inserted = insert_rows(connection, registry.queries, rows, written)
            if written:
                _announce(self, registry, written, boundary)
            return inserted
        return 0

    def shard_of_job(self, *, shard: Any = None, shard_with: Any = None) -> Any:
        """The shard a job enqueued now with these options would go to.

        :raises EnqueueError: as :meth:`enqueue` does.
        """
        if shard is not None and shard_with is not None:
            raise EnqueueError("give shard= or shard_with=, not both")
        if shard is not None:
            return self._known(shard, "shard=")
        if shard_with is not None:
            try:
                state = inspect(shard_with)
            except sa.exc.NoInspectionAvailable:
                raise EnqueueError(
                    f"shard_with= takes an ORM object, got {type(shard_with).__name__}"
                ) from None
            found = self._shard_of(state)
            if found is None:
                raise EnqueueError(f"the shard of {shard_with!r} cannot be determined")
            return self._known(found, "shard_with=")
        shards = self.unit_of_work_shards()
        if len(shards) == 1:
            return self._known(next(iter(shards)), "this unit of work")
        if not shards:
            raise EnqueueError(
                "cannot tell which shard this job belongs to: this unit of work writes no "
                "rows yet; pass shard= or shard_with="
            )
        raise EnqueueError(
            f"cannot tell which shard this job belongs to: this unit of work writes to "
            f"shards {sorted(map(str, shards))}; pass shard= or shard_with="
        )

    def unit_of_work_shards(self) -> set[Any]:
        """The shards this transaction writes to: those of the new, changed and deleted
        objects of the session (jobs aside), and those flushed to earlier in it."""
        shards = set(self._written)
        for obj in (*self.new, *self.dirty, *self.deleted):
            if isinstance(obj, JobMixin):
                continue
            shard = self._shard_of(inspect(obj))
            if shard is not None:
                shards.add(shard)
        return shards

    def shard_of_jobs(self, jobs: Iterable[Any], source: str) -> Any:
        """The one shard of these jobs (a group's members, which its callback follows).

        :raises EnqueueError: they are on more than one shard."""
        shards = {self._shard_of(inspect(job)) for job in jobs}
        if len(shards) != 1:
            raise EnqueueError(
                f"{source} are on shards {sorted(map(str, shards))}: the jobs that wait "
                "for one another must be on one shard"
            )
        return self._known(next(iter(shards)), source)

    def place_on_shard(self, job: Any, shard: Any) -> None:
        """Send a new job object to ``shard`` at the flush (as ``enqueue`` does)."""
        state = inspect(job)
        if state.key is None:
            state.info[_SHARD_KEY] = shard

    def _shard_of(self, state: Any) -> Any:
        if state.key is not None:
            return state.key[2]
        if state.identity_token is not None:
            return state.identity_token
        # New: where its flush will send it (the chooser is asked again then): the shard
        # enqueue chose for a job, else the application's chooser's.
        chosen = state.info.get(_SHARD_KEY)
        if chosen is not None:
            return chosen
        return self._user_chooser(state.mapper, state.obj(), clause=None)

    def _known(self, shard: Any, source: str) -> Any:
        if self._shard_names and shard not in self._shard_names:
            raise EnqueueError(
                f"{source} names shard {shard!r}, which is not one of this session's "
                f"shards {sorted(map(str, self._shard_names))}"
            )
        return shard


def _after_flush(session: Session, flush_context: Any) -> None:
    # new, dirty and deleted still hold what was just flushed, with their shards assigned.
    assert isinstance(session, ShardedJobSession)
    for obj in (*session.new, *session.dirty, *session.deleted):
        if not isinstance(obj, JobMixin):
            state = inspect(obj)
            shard = state.key[2] if state.key is not None else state.identity_token
            if shard is not None:
                session._written.add(shard)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        assert isinstance(session, ShardedJobSession)
        session._written.clear()


try:
    from sqlalchemy.ext.asyncio import AsyncSession
except ImportError:  # SQLAlchemy's asyncio needs greenlet: pip install 'sqla-jobs[asyncio]'
    pass
else:

    class AsyncShardedJobSession(AsyncSession):
        """The asyncio twin of :class:`ShardedJobSession`: an ``AsyncSession`` whose
        session behind it (``sync_session``) is a :class:`ShardedJobSession`, which decides
        every shard.

        .. code-block:: python

            Session = async_sessionmaker(
                class_=AsyncShardedJobSession,
                shards={"eu": eu_async_engine.sync_engine, "us": us_async_engine.sync_engine},
                shard_chooser=..., identity_chooser=..., execute_chooser=...,
                jobs=jobs,
            )
            async with Session.begin() as session:
                session.add(order)
                session.enqueue(send_receipt, order_ref=order.ref)  # no I/O: no await

        The shards are the ``sync_engine`` of ``AsyncEngine`` objects, as SQLAlchemy's
        ``ShardedSession`` needs under asyncio. Where a job goes, and the errors, are the
        sync session's, since it is the one that decides: ``enqueue`` only adds a ``Job``
        object to the unit of work (written at the awaited flush or commit, on its shard);
        a unique job is INSERTed at once, so it takes ``await session.enqueue_unique(...)``
        as on :class:`~sqla_jobs.aio.AsyncJobSession`; and ``enqueue_many``, which
        INSERTs its rows at once on the shard's connection, is awaited here.
        """

        sync_session_class = ShardedJobSession

        @property
        def sharded(self) -> ShardedJobSession:
            """The :class:`ShardedJobSession` behind this session."""
            sync = self.sync_session
            assert isinstance(sync, ShardedJobSession)
            return sync

        if TYPE_CHECKING:
            enqueue: _Enqueue[JobMixin]
            enqueue_unique: _Enqueue[Coroutine[Any, Any, JobMixin | None]]
        else:

            def enqueue(self, task, /, *args, shard=_UNSET, shard_with=_UNSET, **kwargs):
                """:meth:`ShardedJobSession.enqueue`, which does no I/O for a job that is
                not unique: the job is written at the next (awaited) flush.

                :raises EnqueueError: as :meth:`ShardedJobSession.enqueue`, and for a
                    unique job (use :meth:`enqueue_unique`).
                """
                refuse_unique(task, kwargs)
                return self.sharded._enqueue(task, args, kwargs, shard, shard_with)

            async def enqueue_unique(
                self, task, /, *args, shard=_UNSET, shard_with=_UNSET, **kwargs
            ):
                """``enqueue(..., unique=Unique(...))`` (``unique=True`` unless it names a
                key), awaited: INSERTed at once on the job's shard, whose key it is unique
                within."""
                task = as_unique(task, kwargs)

                def run(sync_session: Any) -> Any:
                    return sync_session._enqueue(task, args, kwargs, shard, shard_with)

                return await self.run_sync(run)

        async def enqueue_many(
            self, task: _AnyTask, arguments: _Rows, /, **options: Unpack[ShardedManyOptions]
        ) -> int:
            """:meth:`ShardedJobSession.enqueue_many`, awaited: its rows are INSERTed at
            once on the shard's connection, in this session's transaction."""

            def run(sync_session: Any) -> int:
                return int(sync_session.enqueue_many(task, arguments, **options))

            return await self.run_sync(run)

        def shard_of_job(self, *, shard: Any = None, shard_with: Any = None) -> Any:
            """See :meth:`ShardedJobSession.shard_of_job` (no I/O)."""
            return self.sharded.shard_of_job(shard=shard, shard_with=shard_with)

        def unit_of_work_shards(self) -> set[Any]:
            """See :meth:`ShardedJobSession.unit_of_work_shards` (no I/O)."""
            return self.sharded.unit_of_work_shards()

    __all__ += ["AsyncShardedJobSession"]


# -- workers ------------------------------------------------------------------------------


W = TypeVar("W", bound=DriverBase[Any])


class _Shards(Generic[W]):
    """What the threaded and the asyncio sharded workers share: one worker per shard, the
    pause before starting again one whose database could not be reached, and the health
    of them all."""

    def __init__(
        self,
        make: Callable[[Any, WorkerSettings], W],
        shards: Mapping[str, Any],
        settings: WorkerSettings | None,
        options: Mapping[str, Any],
    ) -> None:
        if not shards:
            raise ValueError(f"{type(self).__name__} needs at least one shard")
        base = resolve(settings, dict(options))
        self.workers: dict[str, W] = {}
        for name, bind in shards.items():
            own = base
            if base.name is not None:
                own = dataclasses.replace(base, name=f"{base.name}@{name}")
            self.workers[name] = make(bind, own)
        #: Shards whose worker could not start, since when (monotonic) and why.
        #: Shards whose worker could not start, waiting to be started again: since when,
        #: why, and whether their database could not be reached (or was reached and is
        #: not ready: tables not migrated, a grant missing).
        self._down: dict[str, tuple[float, str, bool]] = {}
        self._errors: list[BaseException] = []

    def __repr__(self) -> str:
        return f"<{type(self).__name__} shards={list(self.workers)}>"

    def _cores(self) -> list[WorkerCore]:
        """Every shard's worker core (a stop signal is told to each)."""
        return [w.core for w in self.workers.values()]

    @property
    def processed(self) -> int:
        """Jobs finished by the workers of every shard."""
        return sum(w.processed for w in self.workers.values())

    def _name_of(self, worker: W) -> str:
        return next(name for name, w in self.workers.items() if w is worker)

    def _after_failure(
        self, name: str, exc: Exception, failures: int, deadline: float | None
    ) -> float | None:
        """A shard's worker raised: the pause before starting it again, or None to leave
        it stopped (an error that is not about its database stops every shard).

        A worker fails at its start when its database cannot be reached, or is not ready
        for it (its tables not migrated yet, a grant missing: one shard of many during a
        rolling migration). That must not stop the other shards: it is started again,
        more slowly than a running worker's retries (which must be back within a second of
        a restart), since a shard may be down for long and each try logs."""
        late = deadline is not None and time.monotonic() >= deadline
        if not (unreachable(exc) or misconfigured(exc)):
            self._errors.append(exc)
            self.stop()
            return None
        if self._is_stopping() or late:
            return None
        since = self._down.get(name, (time.monotonic(), "", True))[0]
        cut_off = unreachable(exc)
        self._down[name] = (since, describe(exc), cut_off)
        pause = min(_RESTART_CAP, 0.25 * 2.0 ** min(failures, 5))
        if deadline is not None:
            # No later than the run's timeout: a pause taken whole (up to 30 s) ended
            # ``run_until_empty(timeout=4)`` after 7.5 s. After a pause that reaches the
            # deadline, the worker is not started again (see past).
            pause = max(0.0, min(pause, deadline - time.monotonic()))
        what = "cannot reach the database" if cut_off else "its database is not ready"
        log.warning(
            "shard %s: %s, starting its worker again in %.2fs: %s",
            name,
            what,
            pause,
            describe(exc),
        )
        return pause

    def _ready_again(self) -> None:
        """Every shard's worker has ended: the stop is over, for this run and its shards'
        workers, so that a next run serves every shard. Kept, it restarted no shard that
        failed after it, and a shard stopped while it was waiting to be started again
        ended its next run at once."""
        for worker in self.workers.values():
            worker.core.stopping = False

    def _raise_errors(self) -> None:
        if self._errors:
            first = self._errors[0]
            if isinstance(first, WorkerError):
                raise first
            raise WorkerError(f"a shard's worker failed: {describe(first)}") from first

    def stop(self) -> None:
        raise NotImplementedError

    def _is_stopping(self) -> bool:
        raise NotImplementedError

    def health(self) -> dict[str, Any]:
        """The health of every shard's worker, by shard (what ``--health-port`` serves).

        ``healthy`` is false when any shard's worker is unhealthy (its run ended, a loop is
        stuck: see :meth:`~sqla_jobs.worker._core.WorkerCore.health`), and ``unhealthy``
        names those shards, whose ``problems`` are listed too, each prefixed with its
        shard. A shard whose database cannot be reached is named in ``unreachable``
        (its worker is ``restarting`` while it could not even start) but does not make
        the process unhealthy, as for one worker: restarting the process would not bring
        that database back, and would stop the other shards' work. A shard whose database
        answers but is not ready for the worker (its tables not migrated yet, a grant
        missing) is named in ``not_ready`` instead, for the same reason: what it needs is a
        migration or a grant, which an operator looking under ``unreachable`` would not
        think of."""
        now = time.monotonic()
        shards: dict[str, dict[str, Any]] = {}
        unhealthy: list[str] = []
        down: list[str] = []
        not_ready: list[str] = []
        problems: list[str] = []
        for name, worker in self.workers.items():
            report = worker.core.health(now)
            failed = self._down.get(name)
            started = report.state == "running" and "completer" in report.loops
            if failed is not None and not started:
                since, error, cut_off = failed
                said = "unreachable" if cut_off else "not ready"
                entry: dict[str, Any] = {
                    "healthy": True,
                    "state": "restarting",
                    "worker": worker.name,
                    "problems": [],
                    "database": f"{said} for {now - since:.1f}s: {error}",
                }
                (down if cut_off else not_ready).append(name)
            else:
                entry = report.to_dict()
                if entry["database"] != "ok":
                    down.append(name)
            shards[name] = {"shard": name, **entry}
            if not entry["healthy"]:
                unhealthy.append(name)
                problems += [f"shard {name}: {p}" for p in entry["problems"]]
        return {
            "healthy": not unhealthy,
            "unhealthy": unhealthy,
            "unreachable": down,
            "not_ready": not_ready,
            "problems": problems,
            "shards": shards,
        }


class ShardedWorker(_Shards[Worker]):
    """One :class:`~sqla_jobs.Worker` per shard, in one process, each with its own engine,
    connections, LISTEN and leases.

    ``ShardedWorker(jobs, {"eu": eu_engine_or_url, "us": ...}, settings=None, **options)``:
    every worker gets the same settings (with ``name``, if given, suffixed ``@shard``).
    A shard that is down pauses only its own worker, which retries with a capped pause as
    any worker does after database errors; the others go on. If one worker stops with a
    :class:`~sqla_jobs.errors.WorkerError` (a duty kept failing), all are stopped and
    the error is raised. :meth:`health` reports every shard's worker (``serve_health``
    serves it).

    One process runs handlers on one core (the GIL): to use more cores, run one process
    per shard (``sqla-jobs worker --shard NAME=URL ...`` does). For ``async def``
    handlers, see :class:`AsyncShardedWorker`.
    """

    def __init__(
        self,
        jobs: Jobs,
        shards: Mapping[str, sa.Engine | str],
        settings: WorkerSettings | None = None,
        **options: Unpack[WorkerOptions],
    ) -> None:
        super().__init__(lambda bind, own: Worker(jobs, bind, own), shards, settings, options)
        self._stopping = threading.Event()

    def stop(self, *, now: bool = False) -> None:
        """Ask every shard's worker to stop gracefully (``now``: see ``Worker.stop``). Safe
        from any thread or signal handler (see ``Worker.stop``: from the main thread, the
        event is set by the relay's thread)."""
        if threading.current_thread() is threading.main_thread():
            relay.call(self._stopping.set)
        else:
            self._stopping.set()
        for worker in self.workers.values():
            worker.stop(now=now)

    def _is_stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run every shard's worker until :meth:`stop`, SIGINT or SIGTERM."""
        with self._signals(install_signal_handlers):
            self._all(lambda w: w.run(install_signal_handlers=False), deadline=None)

    def run_until_empty(self, *, timeout: float | None = None, **kw: Any) -> dict[str, int]:
        """Run each shard's worker until its shard has no ready job; return how many ran on
        each. A shard that cannot be reached is retried until ``timeout`` (for ever
        without one), then left out of the result."""
        counts: dict[str, int] = {}
        deadline = None if timeout is None else time.monotonic() + timeout

        def run(worker: Worker) -> None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            counts[self._name_of(worker)] = worker.run_until_empty(timeout=left, **kw)

        self._all(run, deadline=deadline)
        return counts

    def _all(self, target: Callable[[Worker], Any], *, deadline: float | None) -> None:
        self._errors = []

        def body(name: str, worker: Worker) -> None:
            failures = 0
            while True:
                try:
                    target(worker)
                    return
                except Exception as exc:
                    failures += 1
                    pause = self._after_failure(name, exc, failures, deadline)
                    if pause is None or self._stopping.wait(pause) or _past(deadline):
                        return

        threads = [
            threading.Thread(
                target=body, args=(name, w), name=f"sqla-jobs-shard-{name}", daemon=True
            )
            for name, w in self.workers.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            # A timed join, so that the main thread still takes signals.
            while thread.is_alive():
                thread.join(0.2)
        self._down.clear()  # nothing is restarting any more
        self._ready_again()
        self._stopping.clear()
        self._raise_errors()

    def _signals(self, install: bool) -> contextlib.AbstractContextManager[None]:
        return stopped_by_signals(install, self._cores, self.stop)


try:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from .worker.aio import AsyncWorker
except ImportError:  # SQLAlchemy's asyncio needs greenlet: pip install 'sqla-jobs[asyncio]'
    pass
else:

    class AsyncShardedWorker(_Shards[AsyncWorker]):
        """One :class:`~sqla_jobs.aio.AsyncWorker` per shard, on one event loop: the
        asyncio twin of :class:`ShardedWorker`, for ``async def`` handlers.

        ``AsyncShardedWorker(jobs, {"eu": async_engine_or_url, ...}, settings=None,
        **options)``; ``await worker.run()`` or ``await worker.run_until_empty()``. Each
        shard's worker has its own engine (made from a URL on the loop that runs it),
        connections, LISTEN and leases; a shard that is down pauses only its own (it is
        started again after a capped pause while the others go on), and an error that is
        not about reaching a database stops them all and is raised as a
        :class:`~sqla_jobs.errors.WorkerError`, as with :class:`ShardedWorker`.
        """

        def __init__(
            self,
            jobs: Jobs,
            shards: Mapping[str, AsyncEngine | str],
            settings: WorkerSettings | None = None,
            **options: Unpack[WorkerOptions],
        ) -> None:
            super().__init__(
                lambda bind, own: AsyncWorker(jobs, bind, own), shards, settings, options
            )
            self._owned = [name for name, bind in shards.items() if isinstance(bind, str)]
            self._stopping = False
            self._loop: asyncio.AbstractEventLoop | None = None
            self._wakeup: asyncio.Event | None = None

        def stop(self, *, now: bool = False) -> None:
            """Ask every shard's worker to stop gracefully (``now``: see ``Worker.stop``).
            Safe from any thread or signal handler."""
            self._stopping = True
            for worker in self.workers.values():
                worker.stop(now=now)
            loop, wakeup = self._loop, self._wakeup
            if loop is not None and wakeup is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(wakeup.set)

        def _is_stopping(self) -> bool:
            return self._stopping

        async def run(self, *, install_signal_handlers: bool = True) -> None:
            """Run every shard's worker until :meth:`stop`, SIGINT or SIGTERM."""
            with loop_signals(install_signal_handlers, self._on_signal):
                await self._all(lambda w: w.run(install_signal_handlers=False), deadline=None)

        async def run_until_empty(
            self, *, timeout: float | None = None, **kw: Any
        ) -> dict[str, int]:
            """Run each shard's worker until its shard has no ready job; return how many
            ran on each. A shard that cannot be reached is retried until ``timeout`` (for
            ever without one), then left out of the result."""
            counts: dict[str, int] = {}
            deadline = None if timeout is None else time.monotonic() + timeout

            async def run(worker: AsyncWorker) -> None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                counts[self._name_of(worker)] = await worker.run_until_empty(timeout=left, **kw)

            await self._all(run, deadline=deadline)
            return counts

        def _on_signal(self, sig: int) -> None:
            signalled(self._cores(), self.stop, sig)

        async def _all(
            self,
            target: Callable[[AsyncWorker], Awaitable[Any]],
            *,
            deadline: float | None,
        ) -> None:
            self._errors = []
            self._loop = asyncio.get_running_loop()
            self._wakeup = wakeup = asyncio.Event()
            if self._stopping:
                wakeup.set()

            async def body(name: str, worker: AsyncWorker) -> None:
                failures = 0
                while True:
                    try:
                        await target(worker)
                        return
                    except Exception as exc:
                        failures += 1
                        pause = self._after_failure(name, exc, failures, deadline)
                        if pause is None:
                            return
                        # asyncio.TimeoutError: not the builtin before Python 3.11.
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(wakeup.wait(), pause)
                            return  # stopped while waiting
                        if _past(deadline):
                            return

            try:
                await asyncio.gather(*(body(n, w) for n, w in self.workers.items()))
            finally:
                self._loop = self._wakeup = None
                self._down.clear()  # nothing is restarting any more
                self._ready_again()
                self._stopping = False
                # Engines made here from URLs belong to this loop: their connections
                # cannot be used from the next one.
                for name in self._owned:
                    await self.workers[name].engine.dispose()
            self._raise_errors()

    __all__ += ["AsyncShardedWorker"]


# -- looking across shards ----------------------------------------------------------------


@dataclass(frozen=True)
class ShardResult(Generic[T]):
    """What one shard answered: ``value``, or the ``error`` (one line) that kept it from
    answering. A shard that is down is reported, not fatal: the others still answer."""

    shard: str
    value: T | None
    error: str | None = None


def across(
    engines: Mapping[str, sa.Engine], read: Callable[[sa.Connection], T]
) -> list[ShardResult[T]]:
    """``read`` on a connection of each shard, in the order given."""
    results: list[ShardResult[T]] = []
    for name, engine in engines.items():
        try:
            with engine.connect() as conn:
                results.append(ShardResult(name, read(conn)))
        except sa.exc.DBAPIError as exc:
            results.append(ShardResult(name, None, describe(exc)))
    return results


def queue_states(
    engines: Mapping[str, sa.Engine],
    jobs: admin.JobSource,
    *,
    window: float = admin.DEFAULT_WINDOW,
    finished: bool = True,
) -> list[ShardResult[list[admin.QueueState]]]:
    """:func:`sqla_jobs.admin.queue_states` of each shard (see :func:`total` for the sum)."""
    return across(
        engines, lambda conn: admin.queue_states(conn, jobs, window=window, finished=finished)
    )


def stats(
    engines: Mapping[str, sa.Engine], jobs: admin.JobSource, *, window: float = admin.DEFAULT_WINDOW
) -> list[ShardResult[list[admin.QueueState]]]:
    """Deprecated: :func:`queue_states`, by its 0.2 name (as :func:`sqla_jobs.admin.stats`)."""
    warnings.warn(
        "sharding.stats is deprecated and goes in the next release: use sharding.queue_states",
        DeprecationWarning,
        stacklevel=2,
    )
    return queue_states(engines, jobs, window=window)


def total(results: Iterable[ShardResult[list[admin.QueueState]]]) -> list[admin.QueueState]:
    """Per-queue states summed over the shards that answered.

    Counts add up; the lag is the largest (the oldest ready job anywhere); a queue is
    paused if it is paused on any shard (since the latest change); a count unknown (None)
    on any shard is unknown in the sum.
    """
    merged: dict[str, admin.QueueState] = {}
    for result in results:
        for q in result.value or ():
            seen = merged.get(q.queue)
            merged[q.queue] = q if seen is None else _sum(seen, q)
    return [merged[name] for name in sorted(merged)]


def _sum(a: admin.QueueState, b: admin.QueueState) -> admin.QueueState:
    def add(x: int | None, y: int | None) -> int | None:
        return None if x is None or y is None else x + y

    def latest(x: datetime | None, y: datetime | None) -> datetime | None:
        return max((t for t in (x, y) if t is not None), default=None)

    lags = [x for x in (a.lag_seconds, b.lag_seconds) if x is not None]
    return admin.QueueState(
        queue=a.queue,
        paused=a.paused or b.paused,
        scheduled=a.scheduled + b.scheduled,
        ready=a.ready + b.ready,
        running=a.running + b.running,
        lease_expired=a.lease_expired + b.lease_expired,
        done=add(a.done, b.done),
        dead=a.dead + b.dead,
        cancelled=add(a.cancelled, b.cancelled),
        lag_seconds=max(lags) if lags else None,
        done_recent=add(a.done_recent, b.done_recent),
        dead_recent=add(a.dead_recent, b.dead_recent),
        paused_since=latest(a.paused_since, b.paused_since),
        limits=a.limits,
    )


def list_jobs(
    engines: Mapping[str, sa.Engine],
    jobs: admin.JobSource,
    *,
    limit: int = 50,
    **filters: Unpack[admin.JobFilters],
) -> tuple[list[tuple[str, admin.JobView]], list[ShardResult[Any]]]:
    """:func:`sqla_jobs.admin.list_jobs` over every shard: the newest ``limit`` jobs, each
    with its shard's name, and the shards that could not answer. Over two shards or more
    the newest are by ``created_at`` (ids are numbered per shard and do not compare across
    shards); a single shard's are by id, as :func:`~sqla_jobs.admin.list_jobs` lists them."""
    results = across(engines, lambda conn: admin.list_jobs(conn, jobs, limit=limit, **filters))
    return newest(results, limit)


def newest(
    results: Iterable[ShardResult[list[admin.JobView]]], limit: int | None
) -> tuple[list[tuple[str, admin.JobView]], list[ShardResult[Any]]]:
    """The newest ``limit`` of the jobs the shards listed, each with its shard's name (see
    :func:`list_jobs`), and the shards that could not answer."""
    results = list(results)
    found = [(r.shard, job) for r in results for job in r.value or ()]
    if len(results) > 1:
        found.sort(key=lambda pair: (_sort_time(pair[1].created_at), pair[1].id), reverse=True)
    return found[:limit], [r for r in results if r.error is not None]


def _sort_time(value: datetime) -> float:
    return value.timestamp()


def _past(deadline: float | None) -> bool:
    """Whether a run's ``deadline`` (``time.monotonic()``) has passed: a shard's worker is
    not started again then (it would connect, up to its connect timeout, for nothing)."""
    return deadline is not None and time.monotonic() >= deadline

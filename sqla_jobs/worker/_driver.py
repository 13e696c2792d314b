"""What the two drivers share: the face a user sees, and the core's callbacks.

A driver owns a :class:`~._core.WorkerCore` and carries out its steps. This base holds what
does not depend on how the driver waits: the settings and the names a user reads
(``name``, ``queues``, ``processed``, ``listening``), and the callbacks that only set an
event or queue an item (``record``, ``wake``, ``poke``, ``written``). The events are
``threading.Event`` in the threaded worker and ``asyncio.Event`` in the asyncio one; both
have ``set``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy import event

from .._direct import autocommit
from .._queries import lock_run_params
from ..errors import PermanentError, conflicted
from ._core import RunConflict, WorkerCore
from .settings import WorkerSettings as _Settings
from .settings import resolve

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session, SessionTransaction
    from typing_extensions import Unpack

    from .._queries import Queries
    from ..tasks import Jobs
    from .job import ClaimedJob, Outcome
    from .settings import WorkerOptions, WorkerSettings

__all__ = [
    "DriverBase",
    "Fence",
    "Wakeups",
    "autocommit_level",
    "handler_connections",
    "pool_options",
    "run_session",
    "still_autocommit",
]

_log = logging.getLogger("sqla_jobs.worker")

E = TypeVar("E")
S = TypeVar("S", bound="Session | AsyncSession")

_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(_Settings)) - {"name", "queues"}


class _Event(Protocol):
    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...


EventT = TypeVar("EventT", bound=_Event)


class Wakeups(Generic[EventT]):
    """The events the steps wait on: ``threading.Event`` or ``asyncio.Event``. (Not the
    registry's job events, :class:`sqla_jobs.events.Events`: these only wake a loop.)"""

    def __init__(self, make: Callable[[], EventT]) -> None:
        #: The fetch loop's wake-up: a NOTIFY, a freed slot, a stop.
        self.wake = make()
        #: The heartbeat's: a cancellation to look at now.
        self.poke = make()
        self.stopping = make()
        #: A stop that will not wait out the grace period (``stop(now=True)``): ends the
        #: shutdown's :class:`~._steps.WaitIdle`.
        self.hurry = make()
        #: The completer wrote outcomes.
        self.written = make()


class DriverBase(Generic[E]):
    """The base of :class:`~sqla_jobs.Worker` and :class:`~sqla_jobs.worker.AsyncWorker`.

    :param jobs: the registry: handlers and the jobs table.
    :param bind: an engine, or a database URL to make one from.
    :param settings: a :class:`~sqla_jobs.WorkerSettings`; keyword arguments override its
        fields (``Worker(jobs, engine, concurrency=16)``), which are described there.
    """

    _wakeups: Wakeups[Any]
    _outbox: Any
    #: The engine was made here from a URL: disposed of at the end of each run.
    _owns_engine: bool = False
    #: The engine of the runs' own sessions, once asked (see the drivers'
    #: ``_in_transactions``): the worker's, or the worker's out of autocommit.
    _run_engine: Any = None

    def __init__(
        self,
        jobs: Jobs,
        bind: E | str,
        settings: WorkerSettings | None = None,
        **options: Unpack[WorkerOptions],
    ) -> None:
        self.settings = resolve(settings, options)
        self.jobs = jobs
        self.core = WorkerCore(jobs, self.settings, self)
        self.engine: E = self._make_engine(bind)
        check_pool(self.engine)
        #: How many transactional or durable handlers may hold a connection at once, when
        #: the pool cannot give one to each (None: it can).
        self.handler_connections = handler_connections(self.engine, self.settings.concurrency)
        if self.handler_connections is not None:
            # Plain handlers that use this engine (the application's Session on it) hold
            # its connections too, which no semaphore here can bound: said, but only as
            # information where no task is transactional or durable, since plain handlers
            # that never touch the engine are common and need nothing.
            bounded = any(task.transactional or task.durable for task in jobs.tasks.values())
            _log.log(
                logging.WARNING if bounded else logging.INFO,
                "worker %s: the engine's pool holds %d connections, %d of them for the "
                "worker itself: %s; plain handlers that use this engine (the application's "
                "Session) need one each too, and wait for it; give the engine "
                "pool_size + max_overflow >= %d to run them all",
                self.core.name,
                pool_capacity(self.engine),
                MIN_CONNECTIONS,
                f"at most {self.handler_connections} transactional or durable handlers run "
                f"at once, not concurrency={self.settings.concurrency} (the others wait "
                "for a connection)"
                if bounded
                else f"fewer than concurrency={self.settings.concurrency} handlers can hold "
                "one at once",
                self.settings.concurrency + MIN_CONNECTIONS,
            )
        #: Set while the listener holds its LISTEN (a ``threading.Event``, so that any
        #: thread can wait on it: tests, health checks).
        self.listening = self.core.listening
        self._listen_conn: Any = None
        self._prepare()

    def _make_engine(self, bind: E | str) -> E:
        raise NotImplementedError

    def _prepare(self) -> None:
        """The driver's own primitives (made again at the start of each run)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        c = self.core
        kind = type(self).__name__
        return f"<{kind} {c.name} queues={c.queues} concurrency={self.settings.concurrency}>"

    @property
    def name(self) -> str:
        return self.core.name

    if not TYPE_CHECKING:  # a run-time shim only: type checkers should flag the old names

        def __getattr__(self, name: str) -> Any:
            # 0.1 kept each setting as an attribute of the worker (``worker.concurrency``).
            if name in _SETTING_NAMES:
                warnings.warn(
                    f"worker.{name} is now worker.settings.{name}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return getattr(self.settings, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def queues(self) -> list[str]:
        return self.core.queues

    @property
    def processed(self) -> int:
        """Jobs this worker has finished running, whatever their outcome."""
        return self.core.processed

    # -- the core's callbacks (see steps.Driver) ------------------------------------------

    def stop(self) -> None:
        raise NotImplementedError

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        raise NotImplementedError

    def interrupt(self, job: ClaimedJob) -> None:
        raise NotImplementedError

    def record(self, outcome: Outcome) -> None:
        self._outbox.put_nowait(outcome)

    def wake(self) -> None:
        self._wakeups.wake.set()

    def poke(self) -> None:
        self._wakeups.poke.set()

    def written(self) -> None:
        self._wakeups.written.set()


#: Connections a worker cannot run without: the claims', the completer's and the
#: heartbeat's, each held as long as it runs, and one for its upkeep (presence,
#: maintenance, in turn). The heartbeat's is its own so that no handler can keep a lease
#: renewal waiting on the pool: handlers that use the worker's engine (the application's
#: Session) once held every free connection, every lease lapsed, and another worker ran
#: the jobs again.
MIN_CONNECTIONS = 4


def pool_capacity(engine: Any) -> int | None:
    """The most connections ``engine``'s pool gives out at once, or None for no limit (or
    one that cannot be read). Only a ``QueuePool`` (the default, sync or asyncio) has one:
    its ``max_overflow`` is read from the pool, which has no public accessor for it."""
    pool = engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", None)
    if not callable(size) or not isinstance(overflow, int) or overflow < 0:
        return None
    return int(size()) + overflow


def check_pool(engine: Any) -> None:
    """Refuse an engine whose pool cannot give a worker :data:`MIN_CONNECTIONS`.

    With fewer, the upkeep and the completer (or the heartbeat) wait on the pool in turn,
    time out, retry with warnings, and the outcomes of jobs that ran go unwritten, or
    their leases lapse (so those jobs run again); said at once instead."""
    capacity = pool_capacity(engine)
    if capacity is not None and capacity < MIN_CONNECTIONS:
        pool = engine.pool
        raise ValueError(
            f"the engine's pool holds at most {capacity} connection(s) (pool_size="
            f"{pool.size()}, max_overflow={pool._max_overflow}); a worker holds two for as "
            f"long as it runs (claims, completions) and a third for its heartbeat, and needs "
            f"one more for its upkeep: give it at least {MIN_CONNECTIONS}, and one more per "
            f"handler that holds one at once (a transactional or durable task's, or a plain "
            f"handler using this engine; the worker's own engine has room for concurrency + "
            f"{MIN_CONNECTIONS + 1})"
        )


def handler_connections(engine: Any, concurrency: int) -> int | None:
    """How many handlers may hold one of ``engine``'s pooled connections at once (a
    transactional run's session, a durable run's steps), or None when every one of
    ``concurrency`` handlers may.

    Beyond what the pool holds, handlers would take the connections the worker's own
    upkeep needs, and the handlers left waiting would fail on the pool's timeout. So
    :data:`MIN_CONNECTIONS` stay the worker's, and the handlers share the rest: one that
    finds none free waits for one, its lease kept by the heartbeat (on a connection of its
    own). Only transactional and durable runs are bounded so: a plain handler's use of the
    engine is the application's, which the worker cannot see."""
    capacity = pool_capacity(engine)
    if capacity is None or capacity - MIN_CONNECTIONS >= concurrency:
        return None
    return max(1, capacity - MIN_CONNECTIONS)


def pool_options(concurrency: int) -> dict[str, int]:
    """The pool of an engine a worker makes from a URL: room for every handler to hold a
    connection at once (a transactional task holds one while it runs) beside the
    worker's own (claims, completions, heartbeat, and upkeep: presence, maintenance), so
    that none waits (:func:`handler_connections`). At most 36 are kept open when idle;
    the rest are opened when needed and closed when returned."""
    size = min(concurrency, 32) + MIN_CONNECTIONS
    return {"pool_size": size, "max_overflow": max(10, concurrency + MIN_CONNECTIONS + 1 - size)}


def run_session(jobs: Jobs, bind: Any, kind: type[S]) -> S:
    """The session one transactional run writes in: made by the registry's
    ``session_factory`` (the application's own session), or a plain ``kind`` on ``bind``.

    :raises TypeError: the factory made something else than a ``kind``.
    :raises ValueError: it made a session already in a transaction, which the run would
        commit, or roll back, with the job's completion.
    """
    factory = jobs.session_factory
    if factory is None:
        return kind(bind)
    session = factory(bind=bind)
    if not isinstance(session, kind):
        raise TypeError(
            f"Jobs(session_factory=...) made a {type(session).__qualname__}, and this "
            f"worker runs transactional handlers in a {kind.__name__}: a sessionmaker "
            "serves the threaded worker, an async_sessionmaker the asyncio worker"
        )
    if session.in_transaction():
        raise ValueError(
            "Jobs(session_factory=...) made a session that is already in a transaction; "
            "a transactional run needs a new session, which it commits with the job's "
            "completion (a scoped_session shared between runs would do this)"
        )
    return session


def autocommit_level(conn: sa.Connection) -> str | None:
    """Where ``conn`` is in autocommit (an engine made with ``isolation_level="AUTOCOMMIT"``,
    given to the worker), the server's default isolation level, as SQLAlchemy names it;
    otherwise None (nothing asked).

    A transactional run's session and a durable step's session need a transaction of their
    own: on such an engine each of their statements committed by itself, so the fence's
    lock of the job's row ended with its statement, and a handler that failed after
    writing left its writes committed beside a failed (or retried) job. The drivers give
    those sessions the engine with this level instead (``engine.execution_options``)."""
    if not autocommit(conn):
        return None
    level = conn.exec_driver_sql("SHOW default_transaction_isolation").scalar()
    return str(level).upper()


def still_autocommit(conn: sa.Connection) -> None:
    """Raise if ``conn``, a connection of the engine meant for the runs' sessions, is in
    autocommit all the same. An engine made by ``engine.execution_options(
    isolation_level="AUTOCOMMIT")`` keeps its own level over any given on top of it (its
    connect listener runs last), so the worker cannot give such runs a transaction:
    they are refused, each with this error, rather than run without one."""
    if autocommit(conn):
        raise ValueError(
            "the worker's engine is in autocommit (execution_options(isolation_level="
            "'AUTOCOMMIT')), which the worker cannot undo for a transactional run or a "
            "durable step's session, and they need a transaction: give the worker an "
            "engine that is not in autocommit (its own statements set their isolation "
            "themselves), or make it with create_engine(..., isolation_level='AUTOCOMMIT')"
        )


#: How many times a transactional run's first statement is tried again when it meets a
#: serialization failure (a heartbeat renewed the row as the run's snapshot was taken).
FENCE_TRIES = 5


def _conflicted(error: BaseException) -> RunConflict:
    """The :class:`~._core.RunConflict` of a fence's lock that failed with ``error``."""
    return RunConflict(
        "the lock on the job's row that a transactional run holds under a snapshot "
        f"isolation met another transaction ({getattr(error, 'orig', error)}): the run "
        "wrote nothing, and runs again, its attempt not counted",
        error,
    )


class Fence:
    """What keeps a transactional run's writes with its completion, made on the run's
    session before its handler runs (``Fence(session, queries, job)``).

    It begins the run's transaction with the statement that locks the job's row under a
    snapshot isolation (``Queries.lock_run``: there the heartbeat's renewal made the
    completion fail), taking the snapshot with the lock; a serialization failure there
    (a renewal just committed) rolls back what is still empty and tries again. A
    transaction the handler begins after rolling its own back takes the lock again, in a
    new snapshot, once: a serialization failure there is raised in the handler's
    statement as a :class:`~._core.RunConflict`, not a database error the handler might
    take for its own. Either lock that fails is the worker's statement, not the
    handler's: the run ends as a :class:`~._core.RunConflict` whatever the handler raised
    or returned after it (see :meth:`handling`), and the job runs again, the attempt not
    counted.

    While :meth:`handling`, the session refuses to commit: the handler's writes commit
    with the job's completion, guarded by its claim, or not at all. A handler that
    committed on its own (``session.commit()``, ``with session.begin():``) wrote them
    whatever became of the run: a failed attempt's writes stayed beside its retry's, and a
    run whose lease was lost wrote them twice. ``session.begin()`` raises, since the
    transaction is begun; ``commit()`` raises :class:`~sqla_jobs.PermanentError`, which
    fails the job at once. Savepoints (``begin_nested()``) are the handler's to use.
    """

    def __init__(self, session: Session, queries: Queries, job: ClaimedJob) -> None:
        self._task = job.task
        self._lock = queries.lock_run
        self._params = lock_run_params(job)
        self._handling = False
        #: The backend and transaction start of the run's transaction while it holds the
        #: job's row locked (None: it does not), for :meth:`release`.
        self.holder: tuple[int, Any] | None = None
        #: The error of the lock taken again that failed, until one succeeds (see
        #: :meth:`handling`).
        self.conflict: BaseException | None = None
        for tries in range(1, FENCE_TRIES + 1):
            try:
                self._hold(session.execute(self._lock, self._params).first())
                break
            except sa.exc.DBAPIError as exc:
                if not conflicted(exc):
                    raise
                session.rollback()
                if tries == FENCE_TRIES:
                    raise _conflicted(exc) from exc
        self._session = session
        event.listen(session, "after_begin", self._relock)
        event.listen(session, "before_commit", self._refuse)

    def close(self) -> None:
        """The run ended: its session (an application's, maybe kept beyond the run) is
        left as it was."""
        self.holder = None
        for name, fn in (("after_begin", self._relock), ("before_commit", self._refuse)):
            if event.contains(self._session, name, fn):
                event.remove(self._session, name, fn)

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """While the handler runs: its session may not commit. A lock taken again that
        failed (see :meth:`_relock`) ends the run as a :class:`~._core.RunConflict`,
        whatever the handler raised (it may have wrapped the error, or raised another
        from the transaction left aborted), or if it returned (it caught the error)."""
        self._handling = True
        try:
            yield
        except RunConflict:
            raise
        except BaseException as exc:
            failed = self.conflict
            if failed is None:
                raise
            raise _conflicted(failed) from exc
        finally:
            self._handling = False
        failed = self.conflict
        if failed is not None:
            raise _conflicted(failed) from failed

    def _relock(self, session: Session, transaction: SessionTransaction, conn: Any) -> None:
        # The handler rolled its transaction back, and the next statement begins another
        # (a savepoint only marks a point in the same one).
        if transaction.nested:
            return
        try:
            self._hold(conn.execute(self._lock, self._params).first())
        except sa.exc.DBAPIError as exc:
            # In a new snapshot, it met a renewal of the lease committed since: the worker's
            # statement failed, not the handler's (which this is raised in).
            if not conflicted(exc):
                raise
            self.conflict = exc
            raise _conflicted(exc) from exc

    def _hold(self, row: Any) -> None:
        self.holder = None if row is None else (row.pid, row.began)
        self.conflict = None

    def release(self, engine: sa.Engine, queries: Queries) -> None:
        """End the run's transaction from another connection if it still holds the job's
        row: the run was stopped (timed out, cut off by the grace period, lost) and its
        handler, a thread, runs on. Its writes were to roll back; the worker's write of
        the job's outcome would wait on the lock until the handler returned, and every
        outcome of the worker behind it. The handler's next statement fails."""
        holder = self.holder
        if holder is None:
            return
        try:
            with engine.begin() as conn:
                conn.execute(queries.release_run, {"pid": holder[0], "began": holder[1]})
        except Exception as exc:  # the outcome's write waits for the handler instead
            _log.warning("could not end a stopped run's transaction: %s", exc)

    def _refuse(self, session: Session) -> None:
        # Fired for a savepoint's release too, which stays inside the run's transaction.
        if self._handling and not session.in_nested_transaction():
            raise PermanentError(
                f"task {self._task!r} is transactional: its handler must not commit its "
                "session (session.commit(), with session.begin()): its writes commit with "
                "the job's completion, guarded by its claim, or not at all"
            )

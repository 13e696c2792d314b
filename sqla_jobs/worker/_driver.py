"""What the two drivers share: the face a user sees, and the core's callbacks.

A driver owns a :class:`~._core.WorkerCore` and carries out its steps. This base holds what
does not depend on how the driver waits: the settings and the names a user reads
(``name``, ``queues``, ``processed``, ``listening``), and the callbacks that only set an
event or queue an item (``record``, ``wake``, ``poke``, ``written``). The events are
``threading.Event`` in the threaded worker and ``asyncio.Event`` in the asyncio one; both
have ``set``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ._core import WorkerCore
from .settings import WorkerSettings as _Settings
from .settings import resolve

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session
    from typing_extensions import Unpack

    from ..tasks import Jobs
    from .job import ClaimedJob, Outcome
    from .settings import WorkerOptions, WorkerSettings

__all__ = ["DriverBase", "Wakeups", "handler_connections", "pool_options", "run_session"]

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
        if self.handler_connections is not None and any(
            task.transactional or task.durable for task in jobs.tasks.values()
        ):
            _log.warning(
                "worker %s: the engine's pool holds %d connections, %d of them for the "
                "worker itself: at most %d transactional or durable handlers run at once, "
                "not concurrency=%d (the others wait for a connection); give the engine "
                "pool_size + max_overflow >= %d to run them all",
                self.core.name,
                self.handler_connections + MIN_CONNECTIONS,
                MIN_CONNECTIONS,
                self.handler_connections,
                self.settings.concurrency,
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


#: Connections a worker cannot run without: the claims' and the completer's, each held
#: as long as it runs, and one for its upkeep (heartbeat, presence, maintenance, in turn).
MIN_CONNECTIONS = 3


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

    With fewer, the upkeep and the completer wait on the pool in turn, time out, retry
    with warnings, and the outcomes of jobs that ran go unwritten (so those jobs run
    again once their leases pass); said at once instead."""
    capacity = pool_capacity(engine)
    if capacity is not None and capacity < MIN_CONNECTIONS:
        pool = engine.pool
        raise ValueError(
            f"the engine's pool holds at most {capacity} connection(s) (pool_size="
            f"{pool.size()}, max_overflow={pool._max_overflow}); a worker holds two for as "
            f"long as it runs (claims, completions) and needs one more for its upkeep: give "
            f"it at least {MIN_CONNECTIONS}, and one more per transactional task running at "
            f"once (the worker's own engine has room for concurrency + {MIN_CONNECTIONS + 1})"
        )


def handler_connections(engine: Any, concurrency: int) -> int | None:
    """How many handlers may hold one of ``engine``'s pooled connections at once (a
    transactional run's session, a durable run's steps), or None when every one of
    ``concurrency`` handlers may.

    Beyond what the pool holds, handlers would take the connections the worker's own
    upkeep needs: the heartbeat would wait on the pool, every lease would lapse while the
    handlers ran (another worker's rescue would then run them again, and this worker would
    take its own jobs for lost), and the handlers left waiting would fail on the pool's
    timeout. So :data:`MIN_CONNECTIONS` stay the worker's, and the handlers share the
    rest: one that finds none free waits for one, its lease kept by the heartbeat."""
    capacity = pool_capacity(engine)
    if capacity is None or capacity - MIN_CONNECTIONS >= concurrency:
        return None
    return max(1, capacity - MIN_CONNECTIONS)


def pool_options(concurrency: int) -> dict[str, int]:
    """The pool of an engine a worker makes from a URL: room for every handler to hold a
    connection at once (a transactional task holds one while it runs) beside the
    worker's own (claims, completions, and upkeep: heartbeat, presence, maintenance), so
    that none waits (:func:`handler_connections`). At most 36 are kept open when idle;
    the rest are opened when needed and closed when returned."""
    size = min(concurrency, 32) + 4
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

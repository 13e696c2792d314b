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

__all__ = ["DriverBase", "Wakeups", "run_session"]

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


def check_pool(engine: Any) -> None:
    """Refuse an engine whose pool cannot give a worker :data:`MIN_CONNECTIONS`.

    With fewer, the upkeep and the completer wait on the pool in turn, time out, retry
    with warnings, and the outcomes of jobs that ran go unwritten (so those jobs run
    again once their leases pass); said at once instead. Only a ``QueuePool`` (the
    default, sync or asyncio) has a limit to check: its ``max_overflow`` is read from the
    pool, which has no public accessor for it."""
    pool = engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", None)
    if not callable(size) or not isinstance(overflow, int) or overflow < 0:
        return
    capacity = size() + overflow
    if capacity < MIN_CONNECTIONS:
        raise ValueError(
            f"the engine's pool holds at most {capacity} connection(s) (pool_size={size()}, "
            f"max_overflow={overflow}); a worker holds two for as long as it runs (claims, "
            f"completions) and needs one more for its upkeep: give it at least "
            f"{MIN_CONNECTIONS}, and one more per transactional task running at once "
            f"(the worker's own engine pools concurrency + 4)"
        )


def pool_size(concurrency: int) -> int:
    """Connections a worker made from a URL pools: claims, completions, heartbeat and
    maintenance each hold one briefly, and a transactional task holds one while it runs."""
    return min(concurrency, 32) + 4


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

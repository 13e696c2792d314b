"""The steps of the worker core's loops, and what a driver does for the core.

The core (:mod:`._core`) never waits and does no I/O: its loops are generators that yield
these steps, and a driver (:mod:`.threaded`, :mod:`.aio`) carries each one out, sends the
result back in, or throws the error in. The steps are the whole vocabulary the two
drivers must speak, so it is kept small. :class:`Duty` is what each of those loops is to
the core.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._core import WorkerCore
    from .job import ClaimedJob, Outcome


class Conn(enum.Enum):
    """Where a statement function runs."""

    #: The fetch loop's held autocommit connection: one round trip per claim.
    CLAIM = "claim"
    #: The completer's held autocommit connection: one round trip per batch.
    WRITE = "write"
    #: The heartbeat's held autocommit connection: a lease renewal never waits on the pool,
    #: which the application's handlers may have emptied (they may use the worker's engine).
    BEAT = "beat"
    #: A pooled connection in a transaction of its own, at READ COMMITTED whatever the
    #: engine's or the server's default (see ``_statements.in_read_committed``), committed
    #: when the function returns.
    TX = "tx"


@dataclass(frozen=True, slots=True)
class Io:
    """Run ``fn(connection, *args)`` and send back what it returns."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    on: Conn


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait until woken (a NOTIFY, a freed slot, a stop) or ``seconds`` pass."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait ``seconds`` (cut short by a stop when ``stoppable``)."""

    seconds: float
    stoppable: bool = True


@dataclass(frozen=True, slots=True)
class WaitWritten:
    """Wait until every recorded outcome has been written, the worker is stopping (its
    completer stopped it, say), or ``until`` (a ``time.monotonic()``) has passed."""

    until: float | None = None

    def waiting(self, core: WorkerCore) -> float:
        """How long to wait for the next write (0: the wait is over). At most a tenth of a
        second, so that a stop or the deadline ends the wait on time: ``run_until_empty``
        waited past its ``timeout`` for as long as outcomes could not be written, and for
        ever once its completer had given up."""
        if core.unwritten <= 0 or core.stopping:
            return 0.0
        if self.until is None:
            return 0.1
        return max(0.0, min(0.1, self.until - time.monotonic()))


@dataclass(frozen=True, slots=True)
class TakeOutcomes:
    """Send back the outcomes waiting for the completer, at most ``limit``: at least one,
    waiting up to ``timeout`` seconds for it (None: as long as it takes). An empty list
    when the time passed; :data:`END` in the list once the worker has shut down."""

    limit: int
    timeout: float | None


#: What :class:`TakeOutcomes` finds after the last outcome of a run.
END = None


@dataclass(frozen=True, slots=True)
class Tick:
    """Wait ``seconds`` or until poked; send back whether poked, or None to end the duty
    (the worker stops and nothing runs any more)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class WaitIdle:
    """Wait until no handler runs, at most ``seconds``, and (``hurry``) no longer once the
    stop is hurried (``Wakeups.hurry``); send back whether idle."""

    seconds: float
    #: Whether a hurried stop ends the wait: the grace period's, not the short wait for
    #: the handlers it cut off (an ``async def`` one ends as its cancel is delivered).
    hurry: bool = True


@dataclass(frozen=True, slots=True)
class Listen:
    """Open the dedicated connection and LISTEN on ``channel``."""

    channel: str


@dataclass(frozen=True, slots=True)
class Notifications:
    """Send back the payloads that arrive within ``timeout`` (returns at the first)."""

    timeout: float


@dataclass(frozen=True, slots=True)
class StartDuties:
    """Start each named duty beside the fetch loop (a thread, or a task), each carrying out
    ``core.supervised(name)``."""

    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EndDuties:
    """The worker has shut down: end the duties (the completer after writing everything
    left) and wait for them."""


@dataclass(frozen=True, slots=True)
class CallHandler:
    """Call the running job's handler with the transactional session (``session=``)."""


@dataclass(frozen=True, slots=True)
class OnSession:
    """Run ``fn(session, *args)`` on the transactional session."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit the transactional session."""


@dataclass(frozen=True, slots=True)
class Rollback:
    """Roll the transactional session back."""


@dataclass(frozen=True, slots=True)
class Unlisten:
    """Close the dedicated LISTEN connection, in whatever state it is."""


Step = (
    Io
    | Sleep
    | Pause
    | WaitWritten
    | TakeOutcomes
    | Tick
    | WaitIdle
    | Listen
    | Notifications
    | Unlisten
    | StartDuties
    | EndDuties
    | CallHandler
    | OnSession
    | Commit
    | Rollback
)
Steps = Generator[Step, Any, Any]


class Stepper:
    """Feeds one core generator: the bookkeeping of ``send``, ``throw`` and its return,
    so that a driver's loop is only "carry out the step, give back what happened"::

        stepper = Stepper(steps)
        while (step := stepper.next()) is not None:
            try:
                stepper.result = carry_out(step)
            except BaseException as exc:
                stepper.error = exc
        return stepper.value

    Every error of a step, a handler's included, goes back into the generator, which
    decides what it means.
    """

    __slots__ = ("_steps", "error", "result", "value")

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self.result: Any = None
        self.error: BaseException | None = None
        self.value: Any = None

    def next(self) -> Step | None:
        """The next step, or None once the generator returned (its value in ``value``)."""
        error, self.error = self.error, None
        result, self.result = self.result, None
        try:
            return self._steps.throw(error) if error is not None else self._steps.send(result)
        except StopIteration as done:
            self.value = done.value
            return None


class Duty:
    """One of the core's loops that yield these steps (the fetch loop, and each duty of
    :mod:`._duties`): it works on the shared state of its :class:`~._core.WorkerCore` and
    holds only its own. What is fresh for each run of the worker (a worker may be run
    more than once) it sets in :meth:`reset`, which the core calls before every run; what
    outlives a run, in ``__init__``."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.reset()

    def reset(self) -> None:
        """Fresh state for a new run (nothing, unless the duty says otherwise)."""


class Driver(Protocol):
    """What a driver does for the core without waiting (called from any of its threads)."""

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        """Start running these claims (their rows are committed as running)."""

    def record(self, outcome: Outcome) -> None:
        """Hand an outcome to the completer."""

    def interrupt(self, job: ClaimedJob) -> None:
        """Stop this job's handler if the driver can (an asyncio task can be cancelled;
        a thread cannot, and is left to notice ``job.cancelled``)."""

    def wake(self) -> None:
        """Wake the fetch loop from its :class:`Sleep`."""

    def poke(self) -> None:
        """End the heartbeat's :class:`Tick` now."""

    def written(self) -> None:
        """Outcomes were written (ends :class:`WaitWritten` when none is left)."""

    def stop(self) -> None:
        """Stop the worker gracefully (a duty failed for good)."""

"""Events: hooks for metrics, tracing, error reporting and logs.

.. code-block:: python

    @jobs.events.on("succeeded")
    def count(event: JobEvent) -> None:
        JOB_SECONDS.labels(event.job.task).observe(event.duration)

Events, in a job's life:

``enqueued``
    after the enqueueing transaction commits (the outermost one: releasing a savepoint
    fires nothing, and a job whose savepoint rolled back never fires); ``event.job`` is the
    ``Job`` object, or the row's values (a dict) for ``enqueue_many``;
``started``
    a worker is about to call the handler;
``succeeded``
    the handler returned (``event.duration`` in seconds);
``failed``
    the handler raised (``event.error``); then exactly one of
``retried``
    another attempt is scheduled, or
``dead``
    no attempt is left, or the failure was permanent;
``snoozed``
    the handler raised :class:`~sqla_jobs.Snooze` (``event.reason``: seconds until the
    next run, as text), or the worker runs the job again at once, the attempt not
    counted, for a reason that is not the handler's (``event.reason`` says which: a
    transactional run's conflict in the worker's own statements, or ``started``
    listeners or run hooks that stalled the worker past half a lease, its handler not
    called);
``cancelled``
    the run was told to stop: the job was cancelled, its lease was lost, or it timed out
    (``event.reason``).

The outcome events are the run's own account, fired when the handler ends and before
the outcome is written: a job cancelled or rescued while it ran may still fire
``succeeded``, and its guarded write then changes nothing. The table is the record.

Listeners run in the worker's threads (or its event loop, for the asyncio worker), so they
must be quick and thread-safe. An exception in a listener is logged, never raised into
the worker: at ERROR with its traceback the first time a listener fails on an event, at
DEBUG after (one line each), so that a listener broken for every job does not bury the
log. A listener may disconnect itself, or another, while an event is fired: the change
applies from the next event, and the listeners after it still hear of this one. The
registry is per :class:`~sqla_jobs.Jobs`, never global: two job tables have two sets of
listeners.

Two hooks go further than listening, for integrations that must act *inside* an enqueue
or a run (:mod:`sqla_jobs.tracing` is built on them):

* an **enqueue hook** (:meth:`Events.add_enqueue_hook`) is called once per ``enqueue``
  or ``enqueue_many`` call, before the rows are built, with the task name, the queue and
  the job's ``meta`` (a fresh dict): it may add keys under ``sqla_jobs.``, which the rows
  then carry (what ``meta`` cannot hold, a ``datetime`` say, is logged and dropped);
* a **run hook** (:meth:`Events.add_run_hook`) is entered right before a handler runs and
  exited when the run ends, both in the handler's own context (its thread, or its asyncio
  task), so that a context variable it sets is seen by the handler and reset after it,
  even when a timeout was decided elsewhere meanwhile.

The context an application's handlers need (Flask's app context, an error reporter's
scope, a tenant or a locale in a context variable) is given with
:meth:`sqla_jobs.Jobs.around_run`: a function of the job that returns a context manager,
entered and exited as a run hook is. Unlike a hook, it is part of the run: if entering it
raises, the handler is not called and the run fails with that error (retried as any
failure), since a handler must not run outside its context.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import describe, print_unlogged

__all__ = ["EVENTS", "EnqueueHook", "Events", "JobEvent", "RunHook", "RunWrapper"]

log = logging.getLogger("sqla_jobs.events")

EVENTS = (
    "enqueued",
    "started",
    "succeeded",
    "failed",
    "retried",
    "dead",
    "snoozed",
    "cancelled",
)


@dataclass(frozen=True, slots=True)
class JobEvent:
    """What a listener receives."""

    name: str
    #: A :class:`~sqla_jobs.ClaimedJob` in a worker; for ``enqueued``, the ``Job`` object
    #: (``enqueue``) or the row's values as a dict (``enqueue_many``).
    job: Any
    #: Seconds the handler ran (succeeded, failed, retried, dead, cancelled).
    duration: float | None = None
    error: BaseException | None = None
    #: Why a run was cancelled, or seconds until a retry, as text.
    reason: str | None = None


Listener = Callable[[JobEvent], object]

#: ``hook(task_name, queue, meta)``: may add ``sqla_jobs.``-prefixed keys to ``meta``.
EnqueueHook = Callable[[str, str, dict[str, Any]], None]


class RunHook(Protocol):
    """Wraps every run of a handler; see the module's docstring."""

    def enter(self, job: Any) -> object:
        """The handler is about to run; what this returns is given back to :meth:`exit`."""

    def exit(self, job: Any, state: object, outcome: str, error: BaseException | None) -> None:
        """The run ended: ``outcome`` is ``succeeded``, ``retried``, ``dead``, ``snoozed``
        or ``cancelled`` (timed out, lost, cancelled, cut off at shutdown: see
        ``job.cancel_reason``); ``error`` is what the handler raised, if anything."""


#: ``wrapper(job)``: the context manager one run of a handler runs in (see
#: :meth:`sqla_jobs.Jobs.around_run`).
RunWrapper = Callable[[Any], AbstractContextManager[object]]


class Around:
    """A run hook made of a :data:`RunWrapper`: it enters what the wrapper returns before
    the handler runs, and exits it, with the handler's exception if any, when the run
    ends. Its ``__exit__`` cannot change how the run ended."""

    __slots__ = ("wrapper",)

    #: A failure to enter fails the run, where a plain hook's is only logged.
    required = True

    def __init__(self, wrapper: RunWrapper) -> None:
        self.wrapper = wrapper

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Around) and other.wrapper == self.wrapper

    def __hash__(self) -> int:
        return hash(self.wrapper)

    def __repr__(self) -> str:
        return f"<around_run {self.wrapper!r}>"

    def enter(self, job: Any) -> object:
        context = self.wrapper(job)
        context.__enter__()
        return context

    def exit(self, job: Any, state: object, outcome: str, error: BaseException | None) -> None:
        context: AbstractContextManager[object] = state  # type: ignore[assignment]
        if error is None:
            context.__exit__(None, None, None)
        else:
            context.__exit__(type(error), error, error.__traceback__)


class Events:
    """Listeners by event name, and the enqueue and run hooks."""

    def __init__(self) -> None:
        # Tuples, replaced whole on each change (copy on write), as the hooks below are: a
        # listener that disconnects itself, or a JobMetrics closed while a worker runs,
        # must not make :meth:`fire`, walking the same sequence, skip the next listener.
        self._listeners: dict[str, tuple[Listener, ...]] = {name: () for name in EVENTS}
        #: Writers only (connect, disconnect): two threads changing one event's listeners
        #: at once must not lose a change. :meth:`fire` reads without it.
        self._changing = threading.Lock()
        #: ``(event, listener)`` pairs whose failure was logged with its traceback: a
        #: listener that fails on every job says so once, not once per job.
        self._reported: set[tuple[str, object]] = set()
        #: Read on every enqueue and every run: empty unless an integration is installed.
        self.enqueue_hooks: tuple[EnqueueHook, ...] = ()
        self.run_hooks: tuple[RunHook, ...] = ()

    def add_enqueue_hook(self, hook: EnqueueHook) -> None:
        self.enqueue_hooks = (*self.enqueue_hooks, hook)

    def remove_enqueue_hook(self, hook: EnqueueHook) -> None:
        # Equality, not identity: each access to a bound method makes a new object.
        self.enqueue_hooks = tuple(h for h in self.enqueue_hooks if h != hook)

    def add_run_hook(self, hook: RunHook) -> None:
        self.run_hooks = (*self.run_hooks, hook)

    def remove_run_hook(self, hook: RunHook) -> None:
        self.run_hooks = tuple(h for h in self.run_hooks if h != hook)

    def listeners(self, name: str) -> list[Listener]:
        """The listeners of one event (a copy)."""
        return list(self._listeners[name])

    def connect(self, name: str, listener: Listener) -> None:
        """Call ``listener(event)`` whenever ``name`` happens."""
        if name not in self._listeners:
            raise ValueError(f"unknown event {name!r}; events are {', '.join(EVENTS)}")
        with self._changing:
            self._listeners[name] = (*self._listeners[name], listener)

    def disconnect(self, name: str, listener: Listener) -> None:
        """Stop calling ``listener`` (its first connection, as ``list.remove``): from
        inside a listener too, and the others still hear of the event being fired.
        Raises :class:`ValueError` if it is not connected."""
        with self._changing:
            listeners = list(self._listeners[name])
            listeners.remove(listener)
            self._listeners[name] = tuple(listeners)
            if listener not in listeners:
                # Connected again later, a failure of it is news again.
                self._reported.discard(_key(name, listener))

    def on(self, name: str) -> Callable[[Listener], Listener]:
        """Decorator form of :meth:`connect`."""

        def register(listener: Listener) -> Listener:
            self.connect(name, listener)
            return listener

        return register

    def wants(self, name: str) -> bool:
        """Whether anyone listens: lets the hot path skip building events nobody reads."""
        return bool(self._listeners[name])

    def fire(self, name: str, job: Any, **info: Any) -> None:
        # One read of the tuple: what connect and disconnect do meanwhile changes the
        # next event, not this one.
        listeners = self._listeners[name]
        if not listeners:
            return
        event = JobEvent(name, job, **info)
        for listener in listeners:
            try:
                listener(event)
            except Exception as exc:
                try:
                    self._failed(name, listener, exc)
                except Exception:
                    # A log handler that raises on the line (a custom handler whose
                    # endpoint is down): fire never raises into its caller, a commit of
                    # the application's among them. Printed as logging prints its own.
                    print_unlogged(f"the log line about a broken {name!r} listener failed")

    def _failed(self, name: str, listener: Listener, exc: Exception) -> None:
        """A listener raised: an ERROR with the traceback the first time, a line at DEBUG
        after (a broken listener fails on every job: fifty jobs must not make fifty
        tracebacks that bury the rest of the log)."""
        key = _key(name, listener)
        if key in self._reported:
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "listener %r for event %r failed again (reported at ERROR once): %s",
                    listener,
                    name,
                    describe(exc),
                )
            return
        self._reported.add(key)
        log.error(
            "listener %r for event %r failed (said once: its next failures are logged at DEBUG)",
            listener,
            name,
            exc_info=exc,
        )


def _key(name: str, listener: Listener) -> tuple[str, object]:
    """What :attr:`Events._reported` keeps of a listener: itself (a bound method made again
    is equal to the first), or its identity if it cannot be hashed."""
    try:
        hash(listener)
    except TypeError:
        return name, id(listener)
    return name, listener

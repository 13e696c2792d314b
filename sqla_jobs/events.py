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
``cancelled``
    the run was told to stop: the job was cancelled, its lease was lost, or it timed out
    (``event.reason``).

Listeners run in the worker's threads (or its event loop, for the asyncio worker), so they
must be quick and thread-safe. An exception in a listener is logged, never raised into
the worker. The registry is per :class:`~sqla_jobs.Jobs`, never global: two job tables have
two sets of listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["EVENTS", "Events", "JobEvent"]

log = logging.getLogger("sqla_jobs.events")

EVENTS = ("enqueued", "started", "succeeded", "failed", "retried", "dead", "cancelled")


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


class Events:
    """Listeners by event name."""

    def __init__(self) -> None:
        self._listeners: dict[str, list[Listener]] = {name: [] for name in EVENTS}

    def connect(self, name: str, listener: Listener) -> None:
        """Call ``listener(event)`` whenever ``name`` happens."""
        if name not in self._listeners:
            raise ValueError(f"unknown event {name!r}; events are {', '.join(EVENTS)}")
        self._listeners[name].append(listener)

    def disconnect(self, name: str, listener: Listener) -> None:
        self._listeners[name].remove(listener)

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
        listeners = self._listeners[name]
        if not listeners:
            return
        event = JobEvent(name, job, **info)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("listener %r for event %r failed", listener, name)

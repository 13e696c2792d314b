"""SIGINT and SIGTERM stop a worker gracefully: one handler for every kind of worker.

A second stop signal (Ctrl-C again), or SIGQUIT, stops it now: what is left of the grace
period is skipped, running handlers are told to stop and their jobs handed back
(``stop(now=True)``). But one stop often arrives twice: a terminal's Ctrl-C reaches every
process of its group, and a wrapper in that group (a Procfile runner, a supervisor) passes
it on too; systemd's default ``KillMode=control-group`` sends SIGTERM to every process of
the unit. So a repeat within :data:`SAME_STOP_WITHIN` of the first is the same stop, and
in a child of ``sqla-jobs worker --processes``, which gets every stop signal from its
supervisor as well, any repeat is: its supervisor sends SIGQUIT on its own second signal
(see :class:`StopSignals`).

The threaded workers (:class:`~sqla_jobs.Worker`, :class:`~sqla_jobs.sharding.ShardedWorker`)
install it with :func:`stopped_by_signals` while they run in the main thread; the asyncio
ones with :func:`loop_signals`, as the event loop's own signal handler.

A Python signal handler runs in the main thread, between two bytecodes of whatever that
thread was doing: inside ``threading.Event.wait`` perhaps, holding the event's lock, which
is not reentrant. A handler that then set the same event (a worker's stop did) waited for
ever on a lock its own thread held: the process logged "received SIGTERM, stopping" and
never stopped. So a handler here takes no lock and writes no log: it sets plain
attributes, calls a worker's ``stop()`` (safe in a signal handler, see :data:`relay`), and
hands the rest (the log lines) to :data:`relay`'s thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ._core import WorkerCore

__all__ = [
    "EarlyStop",
    "StopSignals",
    "loop_signals",
    "relay",
    "signalled",
    "stop_signals",
    "stopped_by_signals",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: Stop now, without the grace period (POSIX only: Windows has no SIGQUIT).
HURRY_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGQUIT,) if hasattr(signal, "SIGQUIT") else ()
#: Every signal the workers' handlers take.
HANDLED = STOP_SIGNALS + HURRY_SIGNALS

log = logging.getLogger("sqla_jobs.worker")


class _Relay:
    """One daemon thread of the process that calls, in order, what it is handed.

    :meth:`call` only puts on a ``queue.SimpleQueue``, whose ``put`` is reentrant (safe in
    a signal handler, documented so); whatever takes a lock or writes a log runs on the
    thread. :meth:`start` must be called beforehand, outside any signal handler (starting
    a thread takes locks): the signal contexts below and the workers' ``_prepare`` do."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # Also in a child made by os.fork: the thread is not there, and the lock may have
        # been held by a thread that is not there either.
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="sqla-jobs-signals", daemon=True
                )
                self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the relay's thread, soon. Safe in a signal handler."""
        self._calls.put((fn, args))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout``) until what was handed over so far has been called:
        the signals a block received are acted on before it ends, as when the handlers
        did it all themselves. Not from a signal handler."""
        self.start()
        done = threading.Event()
        self.call(done.set)
        done.wait(timeout)

    def _serve(self) -> None:
        while True:
            fn, args = self._calls.get()
            try:
                fn(*args)
            except Exception:
                log.exception("sqla-jobs: acting on a stop signal failed")
            # Not kept while waiting for the next: a worker's bound method kept the worker
            # (and its metrics) alive after the application let it go.
            del fn, args


#: The process's relay: see :class:`_Relay`.
relay = _Relay()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=relay._reset)


#: A repeat this soon after the first stop signal is the same stop delivered twice (see
#: the module's docstring), not someone asking again.
SAME_STOP_WITHIN = 1.0

#: What a stop signal means: the first (stop gracefully), a repeat taken for the same
#: stop, or stop now.
Meaning = Literal["stop", "same", "now"]


class StopSignals:
    """The stop signals this process received, and what each one means (:meth:`take`).

    One per process (:data:`stop_signals`): the launcher's early handlers, a worker's own,
    and a supervisor's all read and write it, so a signal kept before the worker ran counts
    as the first. Its methods are safe in a signal handler: plain attributes and
    ``time.monotonic()``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: When the first stop signal came (on ``clock``), until :meth:`reset`.
        self.first_at: float | None = None
        #: Whether a repeat a while after the first stops now: not in a supervised child,
        #: which gets each signal from its supervisor as well (set by
        #: :func:`~.supervisor.watch_supervisor`).
        self.repeats_hurry = True

    def take(self, signum: int) -> Meaning:
        """Note stop signal ``signum``; what it means: SIGQUIT stops now, a first SIGINT or
        SIGTERM stops, a repeat stops now once :data:`SAME_STOP_WITHIN` has passed (where
        repeats hurry) and is the same stop otherwise."""
        at = self._clock()
        first, self.first_at = self.first_at, self.first_at if self.first_at is not None else at
        if signum in HURRY_SIGNALS:
            return "now"
        if first is None:
            return "stop"
        return "now" if self.repeats_hurry and at - first >= SAME_STOP_WITHIN else "same"

    def reset(self) -> None:
        """Forget the signals so far: a worker's run with its handlers has ended."""
        self.first_at = None


#: This process's stop signals.
stop_signals = StopSignals()


def says(meaning: Meaning) -> str:
    """What a worker's log says of a stop signal that means ``meaning``."""
    if meaning == "stop":
        return "stopping"
    if meaning == "now":
        return "stopping now: running jobs are cut off and handed back"
    if stop_signals.repeats_hurry:
        return "already stopping (the same signal again, or SIGQUIT, stops now)"
    return "already stopping (a second signal to the supervisor, or SIGQUIT, stops now)"


def signalled(cores: Iterable[WorkerCore], stop: Callable[..., None], signum: int) -> None:
    """A stop signal arrived: each worker says so in its log, then the stop begins (now,
    if :meth:`StopSignals.take` says so). Not from a signal handler (the asyncio workers'
    loop calls it): the handlers below stop at once and leave the log lines to the
    :data:`relay`."""
    meaning = stop_signals.take(signum)
    _log(list(cores), signum, meaning)
    stop(now=meaning == "now")


def _log(cores: Iterable[WorkerCore], signum: int, meaning: Meaning) -> None:
    name = signal.Signals(signum).name
    for core in cores:
        core.signalled(name, says(meaning), now=meaning == "now")


def _log_signal(cores: Callable[[], Iterable[WorkerCore]], signum: int, meaning: Meaning) -> None:
    _log(cores(), signum, meaning)


@contextlib.contextmanager
def stopped_by_signals(
    install: bool, cores: Callable[[], Iterable[WorkerCore]], stop: Callable[..., None]
) -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGQUIT call ``stop(now=...)`` (which
    must be safe in a signal handler, as every worker's is; ``now`` as
    :meth:`StopSignals.take` says) and have each worker log the signal, from the
    :data:`relay`'s thread (only in the main thread, where Python delivers signals;
    elsewhere, or without ``install``, nothing is installed). The previous handlers are
    put back after, once the signals received meanwhile have been logged."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        meaning = stop_signals.take(signum)
        stop(now=meaning == "now")
        relay.call(_log_signal, cores, signum, meaning)

    relay.start()
    previous = {sig: signal.signal(sig, handler) for sig in HANDLED}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        relay.flush()
        stop_signals.reset()


@contextlib.contextmanager
def loop_signals(install: bool, callback: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGQUIT call ``callback(signum)`` from
    the running event loop (``loop.add_signal_handler``), in the main thread only: a loop
    in another thread cannot take them (``run()`` raised ``RuntimeError: set_wakeup_fd
    only works in main thread``). The handlers found before are put back after: the
    loop's own removal left the signals at their default action, and the application's
    handler was gone."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    for sig in HANDLED:
        loop.add_signal_handler(sig, callback, sig)
    try:
        yield
    finally:
        for sig, old in previous.items():
            loop.remove_signal_handler(sig)
            if old is not None:
                signal.signal(sig, old)
        stop_signals.reset()


class EarlyStop:
    """Stop signals that arrive before the worker has installed its own handlers.

    ``sqla-jobs worker`` starts its metrics and health endpoints before the worker runs,
    so ``/healthz`` can answer while SIGTERM still has its default action and would kill
    the process (a supervisor or an orchestrator that stops a worker as soon as it is
    healthy saw exit -15, not 0). While :meth:`installed` holds, such a signal is kept
    and stops the worker given to :meth:`attach` gracefully (at once if it is attached
    later); once the worker runs, its own handlers take over, as before (a worker that
    runs until empty installs none: this one stops it).
    """

    def __init__(self) -> None:
        self._worker: Any = None
        self._signum: int | None = None
        self._now = False

    def attach(self, worker: Any) -> None:
        """The worker a kept (or later) signal stops; stopped now if one came already."""
        self._worker = worker
        if self._signum is not None:
            worker.stop(now=self._now)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # A signal handler: no lock, no log here (see the module's docstring). A worker's
        # stop() is safe in one; the log line is the relay's.
        meaning = stop_signals.take(signum)
        self._signum = signum
        self._now = self._now or meaning == "now"
        worker = self._worker
        if worker is not None:
            worker.stop(now=meaning == "now")
        relay.call(self._log, signum, worker is None, meaning)

    @staticmethod
    def _log(signum: int, starting: bool, meaning: Meaning) -> None:
        # Also the handler of a worker that runs until empty, which installs none of its
        # own: "while starting" only before a worker is attached.
        log.log(
            logging.WARNING if meaning == "now" else logging.INFO,
            "received %s%s, %s",
            signal.Signals(signum).name,
            " while starting" if starting else "",
            says(meaning),
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Keep stop signals for :meth:`attach` while the block runs (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        relay.start()
        previous = {sig: signal.signal(sig, self._handler) for sig in HANDLED}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)
            relay.flush()
            stop_signals.reset()

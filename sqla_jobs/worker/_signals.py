"""SIGINT and SIGTERM stop a worker gracefully: one handler for every kind of worker.

The threaded workers (:class:`~sqla_jobs.Worker`, :class:`~sqla_jobs.sharding.ShardedWorker`)
install it with :func:`stopped_by_signals` while they run in the main thread; the asyncio
ones with :func:`loop_signals`, as the event loop's own signal handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._core import WorkerCore

__all__ = ["EarlyStop", "loop_signals", "signalled", "stopped_by_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signalled(cores: Iterable[WorkerCore], stop: Callable[[], None], signum: int) -> None:
    """A stop signal arrived: each worker says so in its log, then the stop begins."""
    name = signal.Signals(signum).name
    for core in cores:
        core.signalled(name)
    stop()


@contextlib.contextmanager
def stopped_by_signals(
    install: bool, cores: Callable[[], Iterable[WorkerCore]], stop: Callable[[], None]
) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM call :func:`signalled` (only in the main
    thread, where Python delivers signals; elsewhere, or without ``install``, nothing is
    installed). The previous handlers are put back after."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        signalled(cores(), stop, signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def loop_signals(install: bool, callback: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM call ``callback(signum)`` from the running
    event loop (``loop.add_signal_handler``), in the main thread only: a loop in another
    thread cannot take them (``run()`` raised ``RuntimeError: set_wakeup_fd only works in
    main thread``). The handlers found before are put back after: the loop's own removal
    left the signals at their default action, and the application's handler was gone."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, callback, sig)
    try:
        yield
    finally:
        for sig, old in previous.items():
            loop.remove_signal_handler(sig)
            if old is not None:
                signal.signal(sig, old)


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

    def attach(self, worker: Any) -> None:
        """The worker a kept (or later) signal stops; stopped now if one came already."""
        self._worker = worker
        if self._signum is not None:
            worker.stop()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # Also the handler of a worker that runs until empty, which installs none of its
        # own: "while starting" only before a worker is attached.
        logging.getLogger("sqla_jobs.worker").info(
            "received %s%s, stopping",
            signal.Signals(signum).name,
            " while starting" if self._worker is None else "",
        )
        self._signum = signum
        if self._worker is not None:
            self._worker.stop()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Keep stop signals for :meth:`attach` while the block runs (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handler) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

"""SIGINT and SIGTERM stop a worker gracefully: one handler for every kind of worker.

The threaded workers (:class:`~sqla_jobs.Worker`, :class:`~sqla_jobs.sharding.ShardedWorker`)
install it with :func:`stopped_by_signals` while they run in the main thread; the asyncio
ones call :func:`signalled` from the event loop's own signal handler.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._core import WorkerCore

__all__ = ["signalled", "stopped_by_signals"]

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

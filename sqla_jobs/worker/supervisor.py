"""Several worker processes under one supervisor: ``sqla-jobs worker ... --processes N``.

One Python process runs handlers on one core at a time (the GIL). To use every core, run
several worker processes: the supervisor starts N children (each a plain ``sqla-jobs
worker`` with the same arguments), restarts one that dies, and on SIGTERM or SIGINT passes
the signal on and waits for all of them to stop gracefully.

Children are fresh interpreters started with ``subprocess``, not forks: a fork would copy
the parent's threads, connection pool and locks in whatever state they were in.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

__all__ = ["supervise"]

log = logging.getLogger("sqla_jobs.supervisor")

#: A child that dies sooner than this after starting counts as crashing: restarts back off.
_HEALTHY_AFTER = 5.0


def supervise(
    child_argv: Sequence[str],
    processes: int,
    *,
    grace_period: float = 30.0,
    child_args: Callable[[int], Sequence[str]] | None = None,
) -> int:
    """Run ``processes`` copies of ``python -m sqla_jobs.cli <child_argv>`` until signalled.

    Returns 0 after a graceful stop. A child that exits while the supervisor is running is
    restarted (with a growing delay if it keeps dying at once, so a broken deploy does not
    spin). Children get ``grace_period`` seconds plus a margin after the stop signal, then
    are killed. ``child_args(i)`` adds arguments of child ``i`` (0 to ``processes - 1``, the
    same for its restarts): its own metrics and health ports.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    command = [sys.executable, "-m", "sqla_jobs.cli", *child_argv]
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info(
            "supervisor: received %s, stopping %d workers", signal.Signals(signum).name, processes
        )
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[subprocess.Popen[bytes] | None] = [None] * processes
    started = [0.0] * processes
    failures = [0] * processes
    restart_at = [0.0] * processes
    try:
        while not stopping.is_set():
            now = time.monotonic()
            for i in range(processes):
                child = children[i]
                if child is not None and child.poll() is not None:
                    quick = now - started[i] < _HEALTHY_AFTER
                    failures[i] = failures[i] + 1 if quick else 0
                    delay = min(30.0, 0.5 * 2 ** (failures[i] - 1)) if failures[i] else 0.0
                    log.warning(
                        "supervisor: worker process %d exited with %s; restarting in %.1fs",
                        child.pid,
                        child.returncode,
                        delay,
                    )
                    children[i] = None
                    restart_at[i] = now + delay
                if children[i] is None and now >= restart_at[i]:
                    own = list(child_args(i)) if child_args is not None else []
                    children[i] = subprocess.Popen([*command, *own])
                    started[i] = now
                    log.info("supervisor: started worker process %d", children[i].pid)  # type: ignore[union-attr]
            stopping.wait(0.1)
    finally:
        live = [c for c in children if c is not None and c.poll() is None]
        for child in live:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_period + 5.0
        for child in live:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("supervisor: worker process %d did not stop; killing it", child.pid)
                child.kill()
                child.wait()
        for sig, old in previous.items():
            signal.signal(sig, old)
    log.info("supervisor: all worker processes stopped")
    return 0

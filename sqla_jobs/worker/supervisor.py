"""Several worker processes under one supervisor: ``sqla-jobs worker ... --processes N``.

One Python process runs handlers on one core at a time (the GIL). To use every core, run
several worker processes: the supervisor starts N children (each a plain ``sqla-jobs
worker`` with the same arguments), restarts one that dies, and on SIGTERM or SIGINT passes
the signal on and waits for all of them to stop gracefully. A second SIGTERM or SIGINT, or
SIGQUIT, has them stop now (SIGQUIT to each: the grace period is skipped, running jobs
handed back). The children take a repeated SIGTERM or SIGINT for the same stop (see
:mod:`._signals`): they may get each signal twice, from the terminal or systemd and from
here.

Children are fresh interpreters started with ``subprocess``, not forks: a fork would copy
the parent's threads, connection pool and locks in whatever state they were in.

A child watches its supervisor (:func:`watch_supervisor`): a supervisor killed without a
chance to pass a signal on (``kill -9``, the OOM killer, a unit stopped with
``KillMode=process``) would otherwise leave its children claiming jobs unsupervised, for
ever, and a restarted supervisor would run beside them (old code beside new after a
deploy). A child whose supervisor is gone stops as if sent SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from ._signals import HURRY_SIGNALS, Meaning, relay, stop_signals

__all__ = ["SUPERVISOR_ENV", "supervise", "watch_supervisor"]

log = logging.getLogger("sqla_jobs.supervisor")

#: A child that dies sooner than this after starting counts as crashing: restarts back off.
_HEALTHY_AFTER = 5.0

#: The environment variable that gives a child its supervisor's process id.
SUPERVISOR_ENV = "SQLA_JOBS_SUPERVISOR_PID"

#: How often a child looks for its supervisor.
_WATCH_EVERY = 0.5


def supervise(
    child_argv: Sequence[str],
    processes: int,
    *,
    grace_period: float = 30.0,
    child_args: Callable[[int], Sequence[str]] | None = None,
) -> int:
    """Run ``processes`` copies of ``python -m sqla_jobs.cli <child_argv>`` until signalled.

    Returns 0 after a graceful stop, 1 if a child had to be killed. A child that exits
    while the supervisor is running is restarted (with a growing delay if it keeps dying
    at once, so a broken deploy does not spin). Children get ``grace_period`` seconds plus
    a margin after the stop signal, then are killed. ``child_args(i)`` adds arguments of
    child ``i`` (0 to ``processes - 1``, the same for its restarts): its own metrics and
    health ports.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    command = [sys.executable, "-m", "sqla_jobs.cli", *child_argv]
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    stopping = threading.Event()
    hurried = threading.Event()
    children: list[subprocess.Popen[bytes] | None] = [None] * processes

    def stop(signum: int, meaning: Meaning) -> None:
        name = signal.Signals(signum).name
        if meaning == "stop":
            log.info("supervisor: received %s, stopping %d workers", name, processes)
        elif meaning == "same":
            log.info("supervisor: received %s, already stopping", name)
        else:
            log.warning("supervisor: received %s, stopping %d workers now", name, processes)
            hurried.set()
            for child in list(children):
                _hurry(child)
        stopping.set()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Runs in this (the main) thread, between two bytecodes of the loop below, maybe
        # inside ``stopping.wait`` holding the event's lock (not reentrant): the event is
        # set, and the log written, by the relay's thread (see ._signals). Set here, the
        # handler waited for ever on a lock its own thread held: the supervisor never
        # passed the signal on, never stopped. What the signal means is decided here,
        # when it came: a repeat within a second is the same stop (see ._signals).
        relay.call(stop, signum, stop_signals.take(signum))

    relay.start()
    previous = {
        s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, *HURRY_SIGNALS)
    }
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
                    children[i] = subprocess.Popen([*command, *own], env=env)
                    started[i] = now
                    log.info("supervisor: started worker process %d", children[i].pid)  # type: ignore[union-attr]
            stopping.wait(0.1)
    finally:
        killed = 0
        live = [c for c in children if c is not None and c.poll() is None]
        for child in live:
            child.send_signal(signal.SIGTERM)
            if hurried.is_set():  # started as the stop came, maybe
                _hurry(child)
        deadline = time.monotonic() + grace_period + 5.0
        for child in live:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("supervisor: worker process %d did not stop; killing it", child.pid)
                child.kill()
                child.wait()
                killed += 1
        for sig, old in previous.items():
            signal.signal(sig, old)
        stop_signals.reset()
    if killed:
        log.error("supervisor: %d worker process(es) had to be killed", killed)
        return 1
    log.info("supervisor: all worker processes stopped")
    return 0


def _hurry(child: subprocess.Popen[bytes] | None) -> None:
    """Tell a live child to stop now (SIGQUIT; where there is none, Windows, nothing)."""
    if child is not None and child.poll() is None:
        for sig in HURRY_SIGNALS:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)


@contextlib.contextmanager
def watch_supervisor() -> Iterator[None]:
    """In a child of :func:`supervise`, while the block runs: stop this process gracefully
    (SIGTERM to itself, which the worker's own handlers take) once its supervisor is
    gone, seen as a parent process id that changed. Outside a supervisor, nothing.

    Polled (every half second) rather than asked of the kernel (Linux's parent-death
    signal follows the thread that started the child, not the process, and exists
    nowhere else). The variable is taken out of the environment, so that a process this
    one starts does not watch a supervisor that is not its parent."""
    given = os.environ.pop(SUPERVISOR_ENV, None)
    if not given:
        yield
        return
    supervisor = int(given)
    # Its stop signals may come twice (see ._signals): a repeat is the same stop; the
    # supervisor says "now" with SIGQUIT.
    stop_signals.repeats_hurry = False
    done = threading.Event()

    def watch() -> None:
        while os.getppid() == supervisor:
            if done.wait(_WATCH_EVERY):
                return
        log.warning(
            "worker process %d: its supervisor (process %d) is gone: stopping",
            os.getpid(),
            supervisor,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="sqla-jobs-supervisor-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        stop_signals.repeats_hurry = True

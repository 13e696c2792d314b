"""A worker's health, as data: whether it is alive and doing its work, and if not, why.

The supervisor (:func:`._supervise.watched`) notes which step each loop waits on and since
when; :func:`diagnose` compares that with what the step should take
(:func:`step_budget`), and adds what the slots and the unwritten outcomes say.
:mod:`sqla_jobs.health` serves the report over HTTP; sharded workers merge theirs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._steps import (
    EndDuties,
    Io,
    Notifications,
    Pause,
    Sleep,
    Step,
    TakeOutcomes,
    Tick,
    WaitIdle,
    WaitWritten,
)

if TYPE_CHECKING:
    from ._core import WorkerCore

__all__ = ["Health", "diagnose", "step_budget", "step_name"]


@dataclass(frozen=True)
class Health:
    """What :meth:`WorkerCore.health` found (``sqla-jobs worker --health-port`` serves it)."""

    healthy: bool
    #: ``starting`` (before its run), ``running``, or ``stopped``.
    state: str
    worker: str
    #: Why it is unhealthy, one sentence each (empty when healthy).
    problems: tuple[str, ...]
    #: Per loop: the step it waits on and for how many seconds (``None``: it ended).
    loops: dict[str, dict[str, Any]] = field(default_factory=dict)
    running: int = 0
    concurrency: int = 0
    #: Outcomes recorded and not yet written.
    unwritten: int = 0
    #: ``ok``, or how long the completer has not reached it.
    database: str = "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "state": self.state,
            "worker": self.worker,
            "problems": list(self.problems),
            "loops": self.loops,
            "running": self.running,
            "concurrency": self.concurrency,
            "unwritten_outcomes": self.unwritten,
            "database": self.database,
        }


def step_name(step: Step | None) -> str | None:
    """A step as health reports name it: ``Sleep``, ``Io claim``, ..."""
    if step is None:
        return None
    if isinstance(step, Io):
        return f"Io {getattr(step.fn, '__name__', step.fn)}"
    return type(step).__name__


def step_budget(step: Step, stuck_after: float) -> float:
    """How long a loop may wait on ``step`` before it counts as stuck: what the step says
    it waits for (a sleep, a poll) plus ``stuck_after``; a statement gets ``stuck_after``;
    waits that are idle by nature (the completer waiting for a first outcome) have no
    limit, since what they wait for is watched on its own."""
    if isinstance(step, (Sleep, Pause, Tick, WaitIdle)):
        return step.seconds + stuck_after
    if isinstance(step, Notifications):
        return step.timeout + stuck_after
    if isinstance(step, TakeOutcomes):
        return math.inf if step.timeout is None else step.timeout + stuck_after
    if isinstance(step, (WaitWritten, EndDuties)):
        return math.inf
    return stuck_after


def diagnose(core: WorkerCore, now: float | None = None) -> Health:
    """Whether this worker is alive and doing its work, and if not, why.

    Unhealthy when its run has ended (or a duty kept failing), when a loop (the fetch
    loop, the completer, the heartbeat, the listener) has waited on one step for longer
    than that step should take plus ``stuck_after`` (a statement that hangs, a thread
    that never comes back), or when outcomes have waited ``stuck_after`` seconds
    without a write while the database answers. A database that cannot be reached is
    reported, but is not the worker's fault: restarting it would not help.
    """
    now = time.monotonic() if now is None else now
    stuck_after = core.settings.stuck_after
    problems: list[str] = []
    loops: dict[str, dict[str, Any]] = {}
    for name, (since, step) in sorted(dict(core._waiting).items()):
        waited = max(0.0, now - since)
        loops[name] = {"waiting_on": step_name(step), "seconds": round(waited, 3)}
        if step is not None and waited > step_budget(step, stuck_after):
            problems.append(f"{name} stuck: waiting on {step_name(step)} for {waited:.1f}s")
    idle = idle_with_work(core, now)
    if idle is not None:
        problems.append(idle)
    if core._state == "stopped":
        problems.insert(0, "the worker is not running")
    if core.fatal is not None:
        problems.insert(0, str(core.fatal))
    database = "ok"
    unreachable_since = core._unreachable_since
    if unreachable_since is not None:
        database = f"unreachable for {now - unreachable_since:.1f}s"
    outcomes_since = core._outcomes_since
    if (
        outcomes_since is not None
        and core._unwritten
        and now - outcomes_since > stuck_after
        and unreachable_since is None
    ):
        problems.append(
            f"{core._unwritten} outcomes waiting {now - outcomes_since:.1f}s for a write"
        )
    return Health(
        healthy=not problems,
        state=core._state,
        worker=core.name,
        problems=tuple(problems),
        loops=loops,
        running=core.running,
        concurrency=core.settings.concurrency,
        unwritten=core._unwritten,
        database=database,
    )


def idle_with_work(core: WorkerCore, now: float) -> str | None:
    """Why the worker runs nothing though it holds claims to run, or None.

    A claim waits to start only while every slot runs a handler (it was claimed
    ahead), or, held by :meth:`~._core.WorkerCore.start`, for the heartbeat. One that has waited
    longer than ``stuck_after`` while a slot runs no handler means the executors
    (threads or tasks) are gone: the heartbeat would keep its lease for ever, and the
    worker would look alive while running nothing."""
    concurrency = core.settings.concurrency
    with core._lock:
        unstarted = [j for j in core._running.values() if not j.started and not j.settled]
        # Slots held by handlers: every claim holds one until its handler ends (a
        # timed-out one too, whose thread cannot be stopped), and unstarted claims
        # hold theirs too.
        handlers = concurrency - core._free - len(unstarted)
    waiting = [j for j in unstarted if not j.confirming and j.claimed_at]
    if not waiting or handlers >= concurrency:
        return None
    oldest = now - min(j.claimed_at for j in waiting)
    if oldest <= core.settings.stuck_after:
        return None
    return (
        f"{len(waiting)} claimed jobs waiting {oldest:.1f}s to start while "
        f"{concurrency - max(handlers, 0)} of {concurrency} slots run no handler"
    )

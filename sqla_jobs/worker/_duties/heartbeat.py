"""The heartbeat: timeouts, leases, and claims that are no longer this worker's.

Every tick it fails the runs past their task's timeout. Every third of the lease (sooner
when poked: a cancellation arrived, or a claim waits for a beat to start; or when a
handler left a progress note) it extends the leases of every running claim in one
statement and writes their progress notes. A claim that does not come back was cancelled
or lost (its lease passed and another worker took it): its handler is told to stop. The
heartbeat outlives the stop: leases are kept while handlers finish their grace period.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ...errors import describe, unreachable
from .. import _statements as statements
from .._outage import is_database_error, lost_prepared_statement
from .._steps import Conn, Duty, Io, Steps, Tick
from ..job import ClaimedJob, job_log

if TYPE_CHECKING:
    from ..._tasks import Task

__all__ = ["PROGRESS_EVERY", "Heartbeat"]

log = logging.getLogger("sqla_jobs.worker")

#: A progress note waits at most about this long for the heartbeat (which then beats
#: early), and the heartbeat never beats early more often than this.
PROGRESS_EVERY = 1.0


class Heartbeat(Duty):
    """Leases kept, timeouts enforced, lost claims stopped."""

    def reset(self) -> None:
        """A new run beats at its first tick."""
        #: When the last beat began (monotonic; 0: beat at the next tick).
        self.last_beat = 0.0
        #: Whether the last tick woke late (see :meth:`woke_late`).
        self.stalled = False

    def run_once(self) -> Steps:
        """Enforce timeouts; every third of the lease (or when poked by a cancellation),
        extend the leases of all running claims in one statement and stop lost ones.
        Returns False once the worker stopped and nothing runs any more."""
        core = self.core
        every = core.settings.lease / 3
        tick = min(every, 0.1)
        asked = time.monotonic()
        poked = yield Tick(tick)
        if poked is None:
            return False
        self.woke_late(time.monotonic() - asked - tick, every)
        self.enforce_timeouts()
        since = time.monotonic() - self.last_beat
        if (
            poked
            or core._poked
            or since >= every
            or (since >= PROGRESS_EVERY and self.progress_waiting())
        ):
            core._poked = False
            yield from self.beat()
        return True

    def woke_late(self, late: float, every: float) -> None:
        """A tick that woke ``late`` seconds after it was due, more than a beat's interval
        late, is said once per stall (a WARNING): nothing renewed the leases meanwhile,
        and those of the running jobs may have lapsed, the jobs taken by another worker
        and run twice. The usual cause is an ``async def`` handler that blocks the event
        loop (``time.sleep``, a blocking client), where the heartbeat runs too; it once
        went unsaid, the job simply ran twice."""
        if late <= every:
            self.stalled = False
            return
        if self.stalled:
            return
        self.stalled = True
        core = self.core
        core.quietly(
            log.warning,
            "worker %s: the event loop was blocked for %.1fs (a blocking call in an async "
            "def handler?), or the process stalled: the heartbeat woke that late; leases "
            "may have lapsed (lease %ss) and their jobs run again elsewhere",
            core.name,
            late,
            core.settings.lease,
        )

    def progress_waiting(self) -> bool:
        """A running handler left a progress note the heartbeat has not written."""
        core = self.core
        with core._lock:
            return any(j.unwritten_progress() is not None for j in core._running.values())

    def beat(self) -> Steps:
        """Extend the leases of every running claim, and write their handlers' latest
        progress notes, in one statement.

        A claim that does not come back is no longer this worker's: the job was
        cancelled, or its lease passed and another worker took it. Its handler is told to
        stop. A database error is logged and the beat tried again at the next tick.
        """
        core = self.core
        self.last_beat = began = time.monotonic()
        with core._lock:
            running = [j for j in core._running.values() if not j.settled]
            # Finished, their outcomes not written yet: kept ours until they are.
            pending = list(core._pending.values())
        if not running and not pending:
            return
        notes = [j.unwritten_progress() for j in running]
        claims = [*running, *pending]
        every = [*notes, *(None for _ in pending)]
        try:
            # On the heartbeat's own held connection: through the pool, a beat waited for a
            # connection while plain handlers using the worker's engine (the application's
            # Session) held every one, and the leases lapsed, the jobs run again elsewhere.
            kept = yield Io(statements.beat, (core.queries, claims, core.lease, every), Conn.BEAT)
        except Exception as exc:
            self.last_beat = 0.0  # whatever failed, try again at the next tick
            noted = any(n is not None for n in notes)
            if not is_database_error(exc):
                if not noted:
                    raise
                # Not the database: binding a note failed (the driver's encoder, a
                # UnicodeError). Raised, it failed every beat until the worker stopped and
                # every running job's lease lapsed; the leases matter more than the notes.
                log.error(
                    "worker %s: heartbeat failed, writing progress notes (%s); "
                    "beating again without them",
                    core.name,
                    describe(exc),
                )
            else:
                core.db_warning(exc, "worker %s: heartbeat failed: %s", core.name, describe(exc))
            if not is_database_error(exc) or (
                not unreachable(exc) and not lost_prepared_statement(exc) and noted
            ):
                # The server refused the statement, and a note may be why: the leases
                # matter more, so the next beat goes without these notes.
                for job, note in zip(running, notes, strict=True):
                    if note is not None:
                        job.progress_written(note)
            return
        with core._lock:
            # A claim settled while the statement ran (its completion may be written
            # already) is not lost: only those still running and open are.
            lost = [
                j
                for j in running
                if j.key not in kept and core._running.get(j.key) is j and not j.settled
            ]
            # Claims held back from starting until a beat (see WorkerCore.start): decided now.
            confirmed = [
                j
                for j in running
                if j.confirming and core._running.get(j.key) is j and not j.settled
            ]
            for job in confirmed:
                job.confirming = False
        for job, note in zip(running, notes, strict=True):
            if job.key in kept:
                job.renewed = began
                if note is not None:
                    job.progress_written(note)
        for job in lost:
            if not job.is_cancelled:
                job.cancel("cancelled, or lease lost")
                core.driver.interrupt(job)
                core.quietly(
                    job_log, logging.WARNING, job, "cancelled or lease lost; asking it to stop"
                )
        if confirmed:
            # Kept ones start now; lost ones, cancelled above, end at once, not run.
            core.driver.dispatch(confirmed)

    def enforce_timeouts(self) -> None:
        """Past its task's timeout, a run has failed: record that now, stop extending its
        lease, and stop the handler (an asyncio task is cancelled; a thread cannot be, and
        is told through ``job.cancelled``). Its slot frees when the handler ends.

        The outcome is recorded before anything is said about it: a log handler that
        failed on the line once left it unwritten and the job ``running``, its lease
        extended for as long as the worker lived. Its events are fired by the completer
        (:meth:`WorkerCore.tell_later`): the listeners are the application's code, and a
        slow one here held up the leases of every other running job."""
        core = self.core
        now = time.monotonic()
        tasks = core.jobs.tasks
        overdue: list[tuple[ClaimedJob, Task[Any, Any]]] = []
        with core._lock:
            for job in core._running.values():
                task = tasks.get(job.task)
                if task is not None and core.overdue(job, task, now):
                    overdue.append((job, task))
            for job, _ in overdue:
                core.settle_timed_out(job, now)
        for job, task in overdue:
            core.tell_timed_out(job, task, now, interrupt=True)

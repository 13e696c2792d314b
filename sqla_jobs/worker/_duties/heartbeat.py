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
from ..job import ClaimedJob, job_log, timed_out

if TYPE_CHECKING:
    from ..._tasks import Task

__all__ = ["PROGRESS_EVERY", "Heartbeat"]

#: A progress note waits at most about this long for the heartbeat (which then beats
#: early), and the heartbeat never beats early more often than this.
PROGRESS_EVERY = 1.0


class Heartbeat(Duty):
    """Leases kept, timeouts enforced, lost claims stopped."""

    def reset(self) -> None:
        """A new run beats at its first tick."""
        #: When the last beat began (monotonic; 0: beat at the next tick).
        self.last_beat = 0.0

    def run_once(self) -> Steps:
        """Enforce timeouts; every third of the lease (or when poked by a cancellation),
        extend the leases of all running claims in one statement and stop lost ones.
        Returns False once the worker stopped and nothing runs any more."""
        core = self.core
        every = core.settings.lease / 3
        poked = yield Tick(min(every, 0.1))
        if poked is None:
            return False
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
            kept = yield Io(statements.beat, (core.queries, claims, core.lease, every), Conn.TX)
        except Exception as exc:
            self.last_beat = 0.0  # whatever failed, try again at the next tick
            if not is_database_error(exc):
                raise
            core.db_warning(exc, "worker %s: heartbeat failed: %s", core.name, describe(exc))
            if (
                not unreachable(exc)
                and not lost_prepared_statement(exc)
                and any(n is not None for n in notes)
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
                job_log(logging.WARNING, job, "cancelled or lease lost; asking it to stop")
                job.cancel("cancelled, or lease lost")
                core.driver.interrupt(job)
        if confirmed:
            # Kept ones start now; lost ones, cancelled above, end at once, not run.
            core.driver.dispatch(confirmed)

    def enforce_timeouts(self) -> None:
        """Past its task's timeout, a run has failed: record that now, stop extending its
        lease, and stop the handler (an asyncio task is cancelled; a thread cannot be, and
        is told through ``job.cancelled``). Its slot frees when the handler ends."""
        core = self.core
        now = time.monotonic()
        tasks = core.jobs.tasks
        overdue: list[tuple[ClaimedJob, Task[Any, Any]]] = []
        with core._lock:
            for job in core._running.values():
                task = tasks.get(job.task)
                if (
                    task is not None
                    and task.timeout is not None
                    and job.started
                    and not job.settled
                    and now - job.started > task.timeout
                ):
                    overdue.append((job, task))
            for job, _ in overdue:
                del core._running[job.key]
                job.settled = True
                if not core._unwritten:
                    core._outcomes_since = now
                core._unwritten += 1
                core._pending[job.key] = job
        for job, task in overdue:
            job.cancel(f"timed out after {task.timeout}s")
            outcome = timed_out(task, job)
            error = TimeoutError((outcome.error or "").removeprefix("TimeoutError: "))
            name = "dead" if outcome.dead else "retried"
            core.log_end(job, name, now - job.started, outcome, error, level=logging.WARNING)
            core.fire_outcome(outcome, now - job.started, error)
            core.driver.record(outcome)
            core.driver.interrupt(job)

"""What the threaded and the asyncio worker share: settings, scheduling of the fetch
loop's duties, and what a finished run means for events.

The two workers differ in how they wait (threads and events, or tasks and the event loop);
everything that decides *what* happens lives here once, so they cannot drift apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from .execution import (
    FAIL,
    OK,
    ClaimedJob,
    Outcome,
    default_queues,
    job_log,
    outcome_of,
    worker_name,
)
from .maintenance import Refresh
from .queries import interval
from .tasks import Jobs, Task

__all__ = ["WorkerBase"]


class WorkerBase:
    """Settings and bookkeeping common to :class:`~sqla_jobs.Worker` and
    :class:`~sqla_jobs.aio.AsyncWorker` (see the former for the parameters)."""

    def __init__(
        self,
        jobs: Jobs,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 10,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        grace_period: float = 30.0,
        claim_limit: int = 100,
        completion_batch: int = 500,
        completion_interval: float = 0.005,
        rescue_interval: float | None = None,
        prune_interval: float = 60.0,
        listen: bool = True,
        name: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if lease <= 0 or poll_interval <= 0 or grace_period < 0 or claim_limit < 1:
            raise ValueError("lease, poll_interval and claim_limit must be > 0, grace_period >= 0")
        self.jobs = jobs
        self.queues = default_queues(jobs, queues)
        self.concurrency = concurrency
        self.lease = lease
        self.poll_interval = poll_interval
        self.grace_period = grace_period
        self.claim_limit = claim_limit
        self.completion_batch = completion_batch
        self.completion_interval = completion_interval
        self.rescue_interval = (
            rescue_interval if rescue_interval is not None else min(5.0, lease / 2)
        )
        self.prune_interval = prune_interval
        self.listen = listen
        self.name = name or worker_name()
        self.q = jobs.queries
        self._lease = interval(lease)
        #: Jobs this worker has finished running, whatever their outcome.
        self.processed = 0
        self._reset_schedule()

    def __repr__(self) -> str:
        kind = type(self).__name__
        return f"<{kind} {self.name} queues={self.queues} concurrency={self.concurrency}>"

    def _reset_schedule(self) -> None:
        self._next_due: float | None = None
        self._next_refresh = 0.0
        self._next_rescue = 0.0
        self._next_prune = 0.0
        self._paused: frozenset[str] = frozenset()
        self._turn = 0
        self._more = False
        self._saturated = False

    # -- the fetch loop's schedule ----------------------------------------------------------

    def _claim_order(self) -> list[str]:
        """The queues to claim from this round: unpaused ones, starting from a rotating one
        so that no queue always goes first."""
        queues = [q for q in self.queues if q not in self._paused]
        if not queues:
            return []
        start = self._turn % len(queues)
        self._turn = start + 1
        return queues[start:] + queues[:start]

    def _claim_params(self, queue: str, want: int) -> dict[str, Any]:
        return {"queue_name": queue, "limit": want, "lease": self._lease, "worker": self.name}

    def _refresh_due(self) -> tuple[bool, bool]:
        """(refresh now?, rescue too?): every poll interval, or once a known due time passed."""
        now = time.monotonic()
        due = self._next_due is not None and now >= self._next_due
        if now < self._next_refresh and not due:
            return False, False
        return True, now >= self._next_rescue

    def _refreshed(self, result: Refresh, rescued: bool) -> bool:
        """Record what a refresh learned; return whether retention is due too."""
        now = time.monotonic()
        if rescued:
            self._next_rescue = now + self.rescue_interval
        self._paused = result.paused
        self._next_refresh = now + self.poll_interval
        self._next_due = None if result.due_in is None else now + max(0.0, result.due_in)
        if now >= self._next_prune:
            self._next_prune = now + self.prune_interval
            return True
        return False

    def _sleep_for(self) -> float:
        """How long the idle fetch loop may sleep: to the next refresh or due time."""
        now = time.monotonic()
        sleep = min(self.poll_interval, max(0.0, self._next_refresh - now))
        if self._next_due is not None:
            sleep = min(sleep, max(0.0, self._next_due - now) + 0.001)
        return sleep

    def _due_soon(self, within: float) -> bool:
        if within <= 0 or self._next_due is None:
            return False
        return self._next_due - time.monotonic() <= within

    def _note_due(self, batch: list[Outcome]) -> None:
        """Retries and snoozes were scheduled: make sure the fetch loop wakes for them."""
        for o in batch:
            if o.kind != OK:
                due = time.monotonic() + o.delay
                if self._next_due is None or due < self._next_due:
                    self._next_due = due

    # -- the end of a run -----------------------------------------------------------------

    def _finished(
        self,
        task: Task[Any, Any],
        job: ClaimedJob,
        error: BaseException | None,
        *,
        cancelled: bool = False,
    ) -> Outcome:
        """The outcome of a run, with its events fired and a debug line logged."""
        outcome = outcome_of(task, job, error)
        duration = time.monotonic() - job.started
        job_log(logging.DEBUG, job, "%s after %.3fs", outcome.kind, duration)
        events = self.jobs.events
        if cancelled or job.is_cancelled:
            events.fire("cancelled", job, duration=duration, reason=job.cancel_reason)
        elif outcome.kind == OK:
            events.fire("succeeded", job, duration=duration)
        elif outcome.kind == FAIL:
            events.fire("failed", job, duration=duration, error=error)
            dead = outcome.permanent or job.attempts >= job.max_attempts
            events.fire("dead" if dead else "retried", job, duration=duration, error=error)
        return outcome

"""The shared upkeep: refresh (paused queues, woken queues, the next due time), the
rescue of expired leases, and retention.

Any worker may run it; the statements make it safe to run from many at once (retention
runs in the one worker that holds the pruner lock). It has no loop of its own: the fetch
loop runs it when due (every poll interval, or once a known due time has passed), and a
driver can force it (``Worker.maintain()``). Its schedule also tells the idle fetch loop
how long it may sleep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

from .. import _statements as statements
from .._steps import Conn, Duty, Io, Step, Steps
from ..job import OutcomeKind

if TYPE_CHECKING:
    from .._statements import Refresh
    from ..job import Outcome

__all__ = ["Maintenance"]

log = logging.getLogger("sqla_jobs.worker")

#: Seconds before the maintenance looks again at a scheduled job that was due but not
#: promoted (another transaction holds its row locked), at most a poll interval.
DUE_RECHECK = 0.5


class Maintenance(Duty):
    """When the upkeep is due, and carrying it out."""

    def reset(self) -> None:
        """Fresh schedule for a new run: everything is due at once."""
        #: The earliest known time a scheduled job (a retry, a snooze) falls due.
        self.next_due: float | None = None
        self.next_refresh = 0.0
        self.next_rescue = 0.0
        self.next_prune = 0.0
        #: The last retention pass stopped at its cap with rows left to delete.
        self.behind = False
        #: Rows the last retention pass deleted, by what they are (as the log names them).
        self.pruned: dict[str, int] = {}
        #: The paused queues, as of the last refresh.
        self.paused: frozenset[str] = frozenset()
        #: The code-declared schedules' rows match the code (see statements.sync_schedules).
        self.synced = False

    def now(self) -> Steps:
        """Run the maintenance now, whatever its schedule says."""
        self.next_refresh = 0.0
        yield from self.run_once()

    def run_once(self) -> Steps:
        """The shared maintenance, when due: every poll interval, or once a known due time
        has passed. Retention runs every ``prune_interval`` in one elected worker."""
        core = self.core
        now = time.monotonic()
        due = self.next_due is not None and now >= self.next_due
        if now < self.next_refresh and not due:
            return
        rescue = now >= self.next_rescue
        if not self.synced:
            self.synced = yield Io(statements.sync_schedules, (core.jobs,), Conn.TX)
        result: Refresh = yield Io(statements.refresh, (core.jobs, rescue, core.queues), Conn.TX)
        now = time.monotonic()
        settings = core.settings
        if rescue:
            self.next_rescue = now + settings.rescue_every
        self.paused = result.paused
        fetcher = core.fetcher
        if result.paused:
            self.forget_paused(result.paused)
        for queue in result.woken:
            fetcher.dry.pop(queue, None)
        self.next_refresh = now + settings.poll_interval
        due_in = result.due_in
        if due_in is not None and due_in <= 0 and not result.woken:
            # Due, and this pass promoted nothing: another transaction holds the row
            # locked (the promotion skips it). Looked at again at once, it made the fetch
            # loop run a refresh transaction every millisecond while the lock lasted.
            due_in = min(settings.poll_interval, DUE_RECHECK)
        self.next_due = None if due_in is None else now + max(0.0, due_in)
        if now >= self.next_prune:
            self.next_prune = now + settings.prune_interval
            self.behind = False
            yield from self.prune()
            if self.behind:
                # Stopped at its cap with work left: on at the next poll interval. A pass
                # every prune_interval deletes at most 20,000 rows of a kind (333 a second
                # by default), less than one worker finishes, and a backlog of kept rows
                # would only grow.
                self.next_prune = time.monotonic() + settings.poll_interval
            said = [f"{n} {kind}" for kind, n in self.pruned.items() if n]
            if said:
                log.info("worker %s: pruned %s", core.name, ", ".join(said))

    def forget_paused(self, paused: frozenset[str]) -> None:
        """What the fetch loop waits for of the queues now paused (a hold of a limit, a
        refused claim's pause): a paused queue is not claimed, and only a claim ended
        those waits. Kept, a paused queue counted as not empty for ever (a
        ``run_until_empty`` went on to its timeout), and an expired hold made the idle
        loop go round every millisecond. Resumed, the queue is claimed afresh."""
        fetcher = self.core.fetcher
        with self.core._lock:
            for queue in paused:
                fetcher.held.pop(queue, None)
                fetcher.rate_held.discard(queue)
                fetcher.time_held.discard(queue)
                fetcher.failing.pop(queue, None)
                fetcher.walks.pop(queue, None)

    def prune(self, *, max_batches: int = 20) -> Generator[Step, Any, int]:
        """Retention, in batches of their own short transactions; stops at once if another
        worker holds the pruner lock. Returns how many rows were deleted, and keeps how
        many of each kind in :attr:`pruned` (the log says which: keys, rate logs and step
        records were all logged as "finished jobs"); sets :attr:`behind` when a kind of
        row stopped at ``max_batches`` full batches."""
        jobs = self.core.jobs
        total = 0
        self.pruned = {}
        for statement, age in statements.prune_work(jobs):
            kind = _kind(jobs, statement)
            for _ in range(max_batches):
                deleted = yield Io(statements.prune_batch, (jobs, statement, age), Conn.TX)
                if deleted is None:
                    return total
                total += deleted
                self.pruned[kind] = self.pruned.get(kind, 0) + deleted
                if deleted < statements.PRUNE_BATCH:
                    break
            else:
                self.behind = True
        return total

    def sleep_for(self) -> float:
        """How long the idle fetch loop may sleep as far as upkeep goes: to the next
        refresh or due time, at most a poll interval."""
        now = time.monotonic()
        sleep = min(self.core.settings.poll_interval, max(0.0, self.next_refresh - now))
        if self.next_due is not None:
            sleep = min(sleep, max(0.0, self.next_due - now) + 0.001)
        return sleep

    def due_soon(self, within: float) -> bool:
        """A scheduled job falls due within ``within`` seconds (``run_until_empty`` waits)."""
        if within <= 0 or self.next_due is None:
            return False
        return self.next_due - time.monotonic() <= within

    def note_due(self, batch: Iterable[Outcome]) -> None:
        """Retries and snoozes were scheduled: make sure the fetch loop wakes for them."""
        sooner = False
        for o in batch:
            if o.kind is not OutcomeKind.SUCCEEDED:
                due = time.monotonic() + o.delay
                if self.next_due is None or due < self.next_due:
                    self.next_due = due
                    sooner = True
        if sooner:
            # Its sleep was timed before this due time was known.
            self.core.driver.wake()


def _kind(jobs: Any, statement: Any) -> str:
    """What a retention statement deletes, as the log names it."""
    queries = jobs.queries
    if statement is queries.prune_dead or statement is queries.prune_done:
        return "finished jobs"
    if statement is queries.prune_unique_keys:
        return "unique keys"
    if statement is queries.prune_key_starts:
        return "key rate logs"
    return "step records"

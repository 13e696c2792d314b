"""The completer: writes the outcomes of finished runs, many per statement.

Outcomes queue up in the driver (``Driver.record``); the completer takes the first one,
waits up to ``completion_interval`` for others (up to ``completion_batch``), and writes
them in one statement guarded by (id, attempts). A batch that frees slots of a limited
queue held by its concurrency limit also claims from that queue, in the same transaction
and round trip (``Fetcher.ride``). Database errors are retried for as long as the worker
runs (a short outage costs latency, not outcomes); once the worker stops, a few more
tries, then the jobs are left to run again when their leases pass. The completer
outlives the stop: it ends once the run has ended and every outcome is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from ...errors import describe
from .. import _statements as statements
from .._outage import is_database_error, refused_row, retry_pause
from .._steps import END, Conn, Duty, Io, Pause, Step, Steps, TakeOutcomes
from ..job import job_log

if TYPE_CHECKING:
    from .._core import WorkerCore
    from ..job import Outcome

__all__ = ["Completer"]

log = logging.getLogger("sqla_jobs.worker")


class Completer(Duty):
    """Batches of outcomes, written."""

    def __init__(self, core: WorkerCore) -> None:
        #: A batch whose write failed with a bug (not the database): written next time.
        self.batch: list[Outcome] = []
        super().__init__(core)

    def reset(self) -> None:
        """A new run: its outcomes have not ended (a batch left by a bug stays)."""
        self.ended = False

    def run_once(self) -> Steps:
        """Write one batch of outcomes, retrying through database errors. Returns False
        once the run has ended and every outcome is written."""
        core = self.core
        batch = self.batch or (yield from self.take_batch())
        self.batch = []
        # The events of the runs the heartbeat timed out (WorkerCore.tell_later), fired
        # here, off the heartbeat: their outcomes just woke the completer.
        core.tell()
        if not batch:
            # Done only once the run has ended (END). A wait that a cancel cut short
            # (``asyncio.run``'s teardown cancels every task at once) gives what is there,
            # maybe nothing yet: the handlers it cancelled hand their jobs back a moment
            # later, and a completer that ended here left those outcomes unwritten.
            return not self.ended
        try:
            yield from self.write(batch)
        except Exception:
            # A bug, not the database: the supervisor logs it and runs this again after a
            # pause, with the same batch, or stops the worker if it keeps failing.
            self.batch = batch
            raise
        with core._lock:
            core._unwritten -= len(batch)
            core._outcomes_since = time.monotonic() if core._unwritten else None
            for outcome in batch:  # written, or left to its lease (write_apart)
                core._pending.pop(outcome.job.key, None)
        core.reached()
        core.driver.written()
        return True

    def take_batch(self) -> Generator[Step, Any, list[Outcome]]:
        """The next batch: wait for a first outcome, then up to ``completion_interval``
        more for others, up to ``completion_batch``. Empty once the run has ended.

        The wait for others ends early when waiting cannot fill the batch or holds up a
        claim (:meth:`no_linger`)."""
        s = self.core.settings
        batch: list[Outcome] = []
        deadline: float | None = None
        if self.ended:
            return batch
        while len(batch) < s.completion_batch:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            taken = yield TakeOutcomes(s.completion_batch - len(batch), timeout)
            if END in taken:
                self.ended = True
                taken = [o for o in taken if o is not END]
            batch.extend(taken)
            if self.ended or (deadline is not None and not taken) or self.no_linger(batch):
                break
            if deadline is None:
                deadline = time.monotonic() + s.completion_interval
        return batch

    def no_linger(self, batch: list[Outcome]) -> bool:
        """Write ``batch`` now rather than wait for more outcomes: no claim of this worker
        is running (every outcome there is to come is in), or the batch frees a slot of
        a limited queue whose claims are held by a concurrency limit (its next claim
        waits for this write).

        The linger exists to write many outcomes in one statement while handlers keep
        finishing. With nothing left running it only delayed the write (and, for a
        one-job burst, the job's end by ``completion_interval``); with a concurrency limit
        that binds, the held queue's next claim waited on it between every two claims
        (``benchmarks/limits.py``: a binding ``concurrency=64`` drained at 0.23 of an
        unlimited queue with it, 0.41 without)."""
        core = self.core
        if not core.running:
            return True
        fetcher = core.fetcher
        if not fetcher.held:
            return False
        with core._lock:
            # A queue held by its rate waits for time, which no completion frees.
            waiting = fetcher.held.keys() - fetcher.rate_held
            return any(o.job.queue in waiting for o in batch)

    def write(self, batch: list[Outcome]) -> Steps:
        """Write ``batch``, retrying through database errors, with the claim that rides
        with it (its jobs dispatched here); then count it for the presence report, free
        the limited queues it frees, and wake the fetch loop for the retries it
        scheduled."""
        core = self.core
        fetcher = core.fetcher
        failures = 0
        while True:
            try:
                # A queue whose concurrency limit holds its claims waits for this write:
                # claim from it in the same round trip (see write_and_claim).
                ride = fetcher.ride(batch)
                began = time.monotonic()
                written = yield Io(
                    statements.write_and_claim,
                    (core.queries, batch, ride and ride[1]),
                    Conn.WRITE,
                )
                if ride is not None and written.claim is not None:
                    yield from fetcher.rode(*ride, written.claim, began)
                # What committed is counted now: written again, it matches nothing.
                core.presence.count(written.tally)
                if written.rest_error is not None:
                    raise written.rest_error
                if written.claim_error is not None:
                    core.db_warning(
                        written.claim_error,
                        "worker %s: a claim with %d outcomes failed (the fetch loop claims "
                        "instead): %s",
                        core.name,
                        len(batch),
                        describe(written.claim_error),
                    )
                fetcher.freed(batch, ride[0] if written.claim is not None and ride else None)
                break
            except Exception as exc:
                if refused_row(exc):
                    yield from self.write_apart(batch, exc)
                    return
                if not is_database_error(exc):
                    raise
                failures += 1
                core.note_unreachable(exc)
                if core.stopping and failures > 5:
                    log.error(
                        "worker %s: could not record %d outcomes (%s); their jobs will run "
                        "again once their leases pass",
                        core.name,
                        len(batch),
                        describe(exc),
                    )
                    return
                pause = retry_pause(failures, exc)
                core.db_warning(
                    exc,
                    "worker %s: writing %d outcomes failed, retrying in %.2fs: %s",
                    core.name,
                    len(batch),
                    pause,
                    describe(exc),
                )
                yield Pause(pause, stoppable=False)
        core.maintenance.note_due(batch)

    def write_apart(self, batch: list[Outcome], exc: Exception) -> Steps:
        """Write a batch the database refused for what a row of it holds (an application's
        trigger raising, a constraint), in halves, until the row is alone: its outcome is
        left unwritten, its job to run again once its lease passes (the heartbeat renews it
        no more), and the rest of the batch is written. Retried whole, the one
        row held up every outcome of the worker for as long as it ran."""
        if len(batch) == 1:
            job_log(
                logging.ERROR,
                batch[0].job,
                "its outcome could not be written (%s); it will run again once its lease passes",
                describe(exc),
            )
            return
        half = len(batch) // 2
        yield from self.write(batch[:half])
        yield from self.write(batch[half:])

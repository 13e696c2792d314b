"""Every decision a worker makes, once, for both the threaded and the asyncio worker.

The core does no I/O and never waits. Its loops (the fetch loop and the side duties) are
generators that *yield steps*: "run this statement function on the claim connection",
"sleep until woken or 0.4 s", "give me the next batch of outcomes". A driver
(:mod:`.threaded` or :mod:`.aio`) carries each step out in its own way (blocking calls in
threads, or awaits on an event loop) and sends the result back in, or throws the error
in. So what to claim, when to sleep, how long to back off, which jobs were lost, what a
timeout means, what to hand back at shutdown: all of it lives here, and the two workers
cannot drift apart. A driver keeps only how it waits, how it runs a handler, and how it
stops.

The statement functions the steps name are in :mod:`.db`; they take a plain
``Connection``, and the asyncio driver runs them through ``AsyncConnection.run_sync``
(SQLAlchemy's own bridge, and the same greenlet switch that ``AsyncConnection.execute``
makes anyway).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import psycopg.errors
import sqlalchemy as sa

from ..errors import ResultError, WorkerError
from ..queries import ClaimParams, WorkerSeenParams, claim_params, interval, limited_claim_params
from . import db
from .hearing import ListenWatch
from .job import (
    CANCEL_PAYLOAD,
    ClaimedJob,
    Outcome,
    OutcomeKind,
    decode_rows,
    format_error,
    job_log,
    keeps,
    outcome_name,
    outcome_of,
    reset_current,
    result_json,
    retry_delay,
    set_current,
    timed_out,
    unknown_task,
    worker_name,
)
from .settings import WorkerSettings, check_queue_name
from .steps import (
    END,
    CallHandler,
    Commit,
    Conn,
    Driver,
    EndDuties,
    Io,
    Listen,
    Notifications,
    OnSession,
    Pause,
    Rollback,
    Sleep,
    StartDuties,
    Step,
    Steps,
    TakeOutcomes,
    Tick,
    Unlisten,
    WaitIdle,
    WaitWritten,
)

if TYPE_CHECKING:
    import contextvars

    from ..events import RunHook
    from ..tasks import Jobs, Task
    from .db import Refresh, Tally

__all__ = ["Driver", "Health", "WorkerCore"]

log = logging.getLogger("sqla_jobs.worker")

#: Consecutive unexpected (non-database) errors after which a duty stops the worker.
MAX_DUTY_FAILURES = 5

#: A worker's row counts as alive for this many presence intervals after its last update.
PRESENCE_MISSES = 3

#: Every this many presence updates (about a minute at the default), one of them also
#: deletes the rows of workers long gone and throughput counts over a day old.
TIDY_EVERY = 12

#: A progress note waits at most about this long for the heartbeat (which then beats
#: early), and the heartbeat never beats early more often than this.
PROGRESS_EVERY = 1.0
#: Seconds a worker waits before it claims again from a queue whose concurrency (or key)
#: limit was full, unless one of its own completions frees a slot first. Other workers'
#: completions are not announced; this bounds how late it notices them, at a cost of a
#: few cheap claims a second per worker.
LIMIT_RECHECK = 0.2


def is_database_error(exc: BaseException) -> bool:
    """Errors the database, the driver or the pool raise, which a worker waits out: never
    fatal. Everything SQLAlchemy raises (a pool ``TimeoutError`` included, though it is no
    ``DBAPIError``), and psycopg's own errors from the LISTEN connection, which is used
    without SQLAlchemy."""
    return isinstance(exc, (sa.exc.SQLAlchemyError, psycopg.Error))


def describe(exc: BaseException) -> str:
    """One line about an error, without the SQL statement SQLAlchemy puts in its message."""
    if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
        exc = exc.orig
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def unreachable(exc: BaseException) -> bool:
    """The server could not be reached (or dropped the connection), as opposed to an error
    it answered with (a missing table, a constraint)."""
    return isinstance(
        exc,
        (
            sa.exc.OperationalError,
            sa.exc.InterfaceError,
            sa.exc.TimeoutError,
            psycopg.OperationalError,
            psycopg.InterfaceError,
        ),
    )


def lost_prepared_statement(exc: BaseException) -> bool:
    """A statement psycopg had prepared was not there on the server connection it went to
    (or another one was, under its name): the worker's connections go through a pooler in
    transaction mode (PgBouncer before 1.21, or without ``max_prepared_statements``), which
    lends each transaction whichever server connection is free. Not the database's fault,
    nor a passing one: a misconfiguration, said once (:data:`POOLING_ADVICE`)."""
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    if isinstance(
        orig, (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)
    ):
        return True
    # "bind message supplies 2 parameters, but prepared statement "_pg3_2" requires 6"
    return isinstance(orig, psycopg.errors.ProtocolViolation) and "prepared statement" in str(orig)


#: The one line a worker logs at its first lost prepared statement.
POOLING_ADVICE = (
    "worker %s: %s: its connections go through a pooler in transaction mode (PgBouncer) "
    "that does not keep psycopg's prepared statements, so statements fail, or run another "
    "statement's plan. Fix it: set max_prepared_statements in pgbouncer.ini (PgBouncer 1.21 "
    "or later), or turn preparing off for the worker's engine, "
    "connect_args={'prepare_threshold': None} (sqla-jobs worker --engine MODULE:ATTR, or "
    "?prepare_threshold=None in the URL); see the README's PgBouncer section. Until then "
    "such failures are retried at once and logged at DEBUG"
)


def retry_pause(failures: int, exc: BaseException) -> float:
    """Seconds to wait after ``failures`` consecutive database errors.

    The first failure of a held connection that the server dropped (a restart, a
    terminated backend) is retried at once on a fresh one. Failures to reach the server
    back off to at most half a second, so a worker is back within about a second of the server
    accepting connections again; other errors (a missing table) back off to 30 s. A
    prepared statement lost by a pooler is retried at once, then every 50 ms: the next
    try usually finds a server connection that works, and backing off only loses time.
    """
    if failures <= 1 and getattr(exc, "connection_invalidated", False):
        return 0.0
    if lost_prepared_statement(exc):
        return 0.0 if failures <= 1 else 0.05
    cap = 0.5 if unreachable(exc) else 30.0
    return min(cap, 0.05 * 2.0 ** max(failures - 1, 0))


def default_queues(jobs: Jobs, queues: Iterable[str] | None) -> list[str]:
    """The queues to serve: those given, or every queue a registered task names."""
    names = (
        list(queues)
        if queues
        else sorted({t.queue for t in jobs.tasks.values()} or {jobs.default_queue})
    )
    for name in names:
        check_queue_name(name)
    return names


# -- the core ---------------------------------------------------------------------------


class WorkerCore:
    """The state of one worker and every decision about it."""

    def __init__(self, jobs: Jobs, settings: WorkerSettings, driver: Driver) -> None:
        self.jobs = jobs
        self.settings = settings
        self.driver = driver
        self.queries = jobs.queries
        self.name = settings.name or worker_name()
        self.queues = default_queues(jobs, settings.queues)
        self.lease = interval(settings.lease)
        #: The limits of this worker's limited queues (sqla_jobs.throttle); the others are
        #: claimed by the plain statement, unchanged.
        self.limits = {q: limits for q in self.queues if (limits := jobs.limits(q)).limited}
        #: Set while the listener holds its LISTEN (tests and health checks wait on it).
        self.listening = threading.Event()
        #: Jobs whose handler has ended, whatever their outcome.
        self.processed = 0
        self.stopping = False
        self.until_empty = False
        self._lock = threading.Lock()
        self._running: dict[tuple[int, int], ClaimedJob] = {}
        self._free = settings.concurrency
        self._unwritten = 0
        self._poked = False
        self._last_beat = 0.0
        self._listened = False
        self._unwritten_batch: list[Outcome] = []
        #: Outcomes written (or committed by transactional runs) and not yet added to
        #: <table>_throughput: {queue: [succeeded, failed, dead]}.
        self._tally: Tally = {}
        self._presence_rounds = 0
        self._presence_failing = False
        #: Whether the worker said that a pooler loses its prepared statements (once).
        self.pooling_said = False
        #: Whether the listener hears what it should (see :mod:`.hearing`); kept across
        #: runs, so that a deaf LISTEN is reported once.
        self.listen_watch = ListenWatch()
        #: Why the worker stopped on its own (a duty kept failing); raised by ``run()``.
        self.fatal: WorkerError | None = None
        #: For health: per loop, since when it waits on which step (None: it ended).
        self._waiting: dict[str, tuple[float, Step | None]] = {}
        #: Since when outcomes wait with none written; since when the completer cannot
        #: reach the database.
        self._outcomes_since: float | None = None
        self._unreachable_since: float | None = None
        self._state = "starting"
        #: Runs in a row that the worker's own code failed around (see :meth:`crashed`).
        self._crashes = 0
        self.reset()

    def reset(self) -> None:
        """Fresh schedule state for a new run (a worker may be run more than once). A stop
        asked for before the run stands: the run then only starts and shuts down."""
        self.fatal = None
        self._ended = False
        self.more = False
        self._saturated = False
        self._next_due: float | None = None
        self._next_refresh = 0.0
        self._next_rescue = 0.0
        self._next_prune = 0.0
        self._paused: frozenset[str] = frozenset()
        #: Limited queues not to claim from until a monotonic time: their limits held
        #: ready jobs back at the last claim.
        self._held: dict[str, float] = {}
        #: Those of them held by their rate (a completion does not end that wait).
        self._rate_held: set[str] = set()
        self._turn = 0
        self._dry: dict[str, float] = {}
        #: When a NOTIFY last named each queue (monotonic): a claim that began before it
        #: may have missed its jobs, so it does not make the queue dry. Written by the
        #: listener, read by the fetch loop, both under ``_lock``.
        self._notified: dict[str, float] = {}
        self._waiting.clear()  # cleared, not replaced: watched() holds this dict
        self._unreachable_since = None
        #: Claim-ahead (``settings.prefetch``): how many jobs past the free slots the next
        #: claim may take, and the room (free slots plus that) at which a finishing job
        #: wakes a fetch loop that had none. Estimated from how fast handlers finish and
        #: how long a claim takes: see _estimate_ahead.
        self._ahead = 0
        self._wake_at = 1
        self._rate = 0.0
        self._rtt = 0.0
        self._rate_mark = (time.monotonic(), self.processed)

    # -- slots and the running set -----------------------------------------------------

    @property
    def free(self) -> int:
        return self._free

    @property
    def idle(self) -> bool:
        """No handler runs (every slot is free)."""
        return self._free == self.settings.concurrency

    @property
    def busy(self) -> int:
        """Slots in use: claims held, at most ``concurrency`` (claimed ahead ones wait)."""
        return min(self.settings.concurrency, self.settings.concurrency - self._free)

    @property
    def unwritten(self) -> int:
        return self._unwritten

    @property
    def running(self) -> int:
        """Claims this worker is running and has not settled."""
        return len(self._running)

    def claimed(self, rows: Iterable[Any], at: float | None = None) -> list[ClaimedJob]:
        """Claimed rows become running jobs, each holding a slot; ``at`` is when the claim
        was sent (its lease counts from no earlier). A row that cannot be run (see
        :func:`~.job.decode_rows`) is failed at once instead, and holds none."""
        if at is None:
            at = time.monotonic()
        claimed, unreadable = decode_rows(rows, self.name)
        with self._lock:
            self._free -= len(claimed)
            self._saturated = self._free + self._ahead < self._wake_at
            for job in claimed:
                job.claimed_at = job.renewed = at
                self._running[job.key] = job
        if unreadable:
            self._fail_unreadable(unreadable)
        return claimed

    def _fail_unreadable(self, failures: list[Outcome]) -> None:
        """Record the failures of claimed rows that cannot be run: logged as errors (the
        row was written by something other than this library, or by a newer or older
        version), with their events, and written like any outcome."""
        with self._lock:
            for outcome in failures:
                outcome.job.settled = True
            if not self._unwritten:
                self._outcomes_since = time.monotonic()
            self._unwritten += len(failures)
        for outcome in failures:
            job_log(logging.ERROR, outcome.job, "%s; it is dead", outcome.error, outcome="dead")
            self._fire_outcome(outcome, 0.0, ValueError(outcome.error))
            self.driver.record(outcome)

    def finished(self, job: ClaimedJob, outcome: Outcome | None) -> None:
        """A handler ended (or its task did). Frees the slot, and records the outcome
        unless the claim was settled meanwhile (timed out, cancelled, handed back, or
        committed by its transactional run)."""
        with self._lock:
            if self._running.get(job.key) is job:
                del self._running[job.key]
            self._free += 1
            self.processed += 1
            # The fetch loop waits for a slot only when it had none left; run_until_empty
            # also waits for the last running job, to look once more and call it empty.
            # Waking it for every other finish cost the drain a tenth of its throughput.
            wake = (self._saturated and self._free + self._ahead >= self._wake_at) or (
                self.until_empty and self._free == self.settings.concurrency
            )
            if wake:
                self._saturated = False
            record = (
                outcome is not None
                and outcome.kind is not OutcomeKind.SETTLED
                and not job.settled
                and not job.is_cancelled
            )
            if record:
                job.settled = True
                if not self._unwritten:
                    self._outcomes_since = time.monotonic()
                self._unwritten += 1
        if record:
            assert outcome is not None
            self.driver.record(outcome)
        if wake:
            self.driver.wake()

    def _take(self, which: Callable[[ClaimedJob], bool]) -> list[ClaimedJob]:
        """Remove matching unsettled claims from the running set, settled."""
        with self._lock:
            taken = [j for j in self._running.values() if not j.settled and which(j)]
            for job in taken:
                del self._running[job.key]
                job.settled = True
        return taken

    # -- running one job ---------------------------------------------------------------

    def start(self, job: ClaimedJob) -> Run | Outcome | None:
        """Called by the driver just before it runs a handler.

        Returns a :class:`Run` to carry out, an outcome to record at once (an unknown
        task), or None when the claim was handed back before it started, or waits for a
        heartbeat (skip it).

        A claim is started only while the worker knows it is still its own: by its own
        clock, its lease was extended (claimed, or kept by a heartbeat) less than half a
        lease ago. The heartbeat does that every third of a lease, so a claim older than
        that means the worker itself was stalled (a paused process: SIGSTOP, a frozen VM,
        a long GC pause), and its lease may have passed and the job be running elsewhere,
        or done. Such a claim is held (``confirming``) and the heartbeat poked; the beat
        dispatches it again, kept (it starts) or lost (it ends at once, not run).
        """
        now = time.monotonic()
        with self._lock:
            if job.settled:
                return None
            confirm = (
                job.renewed != 0.0
                and now - job.renewed > self.settings.lease / 2
                and not job.is_cancelled
            )
            if confirm:
                job.confirming = True
            else:
                job.started = now
        if confirm:
            job_log(
                logging.INFO,
                job,
                "claimed %.1fs ago, its lease last extended %.1fs ago: starts once a "
                "heartbeat says the claim is still this worker's",
                now - job.claimed_at,
                now - job.renewed,
            )
            self._poked = True
            self.driver.poke()
            return None
        if job.is_cancelled:
            # Told to stop before it started (cancelled, or its lease lost while it waited
            # for a slot): it is not run, and its slot frees with this outcome.
            self.log_end(job, "cancelled", 0.0)
            self.jobs.events.fire("cancelled", job, duration=0.0, reason=job.cancel_reason)
            return Outcome(OutcomeKind.SETTLED, job)
        task = self.jobs.tasks.get(job.task)
        if task is None:
            return unknown_task(self.jobs, job, self.name)
        token = set_current(job)
        events = self.jobs.events
        events.fire("started", job)
        run = job.run = Run(self, task, job, token)
        try:
            if events.run_hooks:
                run.enter_hooks(events.run_hooks)  # the app's context (around_run) may raise
            run.args, run.kwargs = task.call_args(job.args)
        except Exception as exc:  # that, or stored arguments that no longer fit the handler
            return run.end(exc)
        return run

    def crashed(self, job: ClaimedJob, exc: BaseException) -> Outcome | None:
        """The worker's own code failed around a run of ``job`` (not the handler: how a
        handler ends is an outcome). The driver catches whatever escapes a run, calls
        this, and goes on with the next job: an executor thread or task outlives anything
        one job does (a thread that died of a row's ``meta`` once left its job
        ``running``, heartbeated, for ever, and with ``concurrency`` such rows the worker
        ran nothing). Returns the outcome for :meth:`finished`: the run failed with the
        traceback, retried by its task's policy.

        Supervised like a side duty: after :data:`MAX_DUTY_FAILURES` such failures in a
        row, with no run ending normally between them, the worker stops loudly
        (:class:`~sqla_jobs.errors.WorkerError`): a worker that fails every run would
        otherwise spend the attempts of every job it claims.
        """
        run = job.run
        if run is not None:
            run.abandon(exc)  # current_job and the run hooks, whatever failed around it
        with self._lock:
            self._crashes += 1
            crashes = self._crashes
            if job.settled or job.is_cancelled:
                # Decided already (timed out, handed back), or no longer this worker's.
                return Outcome(OutcomeKind.SETTLED, job)
        task = self.jobs.tasks.get(job.task)
        outcome = Outcome(
            OutcomeKind.FAILED,
            job,
            error=format_error(exc),
            delay=retry_delay(task.retry if task is not None else self.jobs.retry, job, job.task),
        )
        log.error(
            "worker %s: job %s (%s): the worker failed around its run; the run counts as "
            "failed: %s",
            self.name,
            job.id,
            job.task,
            describe(exc),
            exc_info=exc,
        )
        self._fire_outcome(outcome, 0.0, exc)
        if crashes >= MAX_DUTY_FAILURES and self.fatal is None:
            log.critical(
                "worker %s: %d runs in a row failed in the worker itself; stopping the worker",
                self.name,
                crashes,
            )
            self.fatal = WorkerError(
                f"worker {self.name}: {crashes} runs in a row failed in the worker itself: "
                f"{describe(exc)}"
            )
            self.driver.stop()
        return outcome

    def end(self, task: Task[Any, Any], job: ClaimedJob, error: BaseException | None) -> Outcome:
        """The outcome of a run, with its events fired and a debug line logged."""
        if self._crashes:
            self._crashes = 0  # a run ended as runs should: the crash streak is over
        # A bool read needs no lock: a timeout or a shutdown that settles the claim after
        # this is caught by finished(), which records nothing for a settled claim.
        if job.settled:  # a timeout or a shutdown decided this claim already, events and all
            return Outcome(OutcomeKind.SETTLED, job)
        if error is None and not job.is_cancelled:
            # The common case, without the general mapping below (every job passes here).
            outcome = Outcome(OutcomeKind.SUCCEEDED, job)
            duration = time.monotonic() - job.started
            if log.isEnabledFor(logging.INFO if self.settings.log_jobs else logging.DEBUG):
                self.log_end(job, "succeeded", duration, outcome)
            self.jobs.events.fire("succeeded", job, duration=duration)
            return outcome
        outcome = outcome_of(task, job, error)
        duration = time.monotonic() - job.started
        name = outcome_name(outcome)
        # A cheap test first (where job lines are off, most runs log nothing): a DEBUG
        # line for a quiet success or snooze, else INFO or above.
        quiet = not self.settings.log_jobs and name in ("succeeded", "snoozed")
        if log.isEnabledFor(logging.DEBUG if quiet else logging.INFO):
            self.log_end(job, name, duration, outcome, error)
        if name == "cancelled":
            self.jobs.events.fire("cancelled", job, duration=duration, reason=job.cancel_reason)
        else:
            self._fire_outcome(outcome, duration, error)
        return outcome

    def log_end(
        self,
        job: ClaimedJob,
        name: str,
        duration: float,
        outcome: Outcome | None = None,
        error: BaseException | None = None,
        *,
        level: int | None = None,
    ) -> None:
        """The one line about a finished run: its outcome and duration (and why it failed,
        without any SQL statement). Successes and snoozes are INFO, or DEBUG without
        ``log_jobs``; failures are always logged, a dead job as a WARNING."""
        if level is None:
            if name in ("succeeded", "snoozed"):
                level = logging.INFO if self.settings.log_jobs else logging.DEBUG
            else:
                level = logging.WARNING if name == "dead" else logging.INFO
        if not log.isEnabledFor(level):
            return
        # A snooze is raised, but it is no error.
        why = describe(error) if error is not None and name != "snoozed" else None
        if name == "succeeded":
            text = f"succeeded in {duration:.3f}s"
        elif name == "retried":
            delay = outcome.delay if outcome is not None else 0.0
            text = f"failed in {duration:.3f}s, retry in {delay:.3g}s"
        elif name == "dead":
            text = f"failed in {duration:.3f}s, dead"
        elif name == "snoozed":
            delay = outcome.delay if outcome is not None else 0.0
            text = f"snoozed in {duration:.3f}s, again in {delay:.3g}s"
        else:
            text = f"cancelled after {duration:.3f}s"
            why = why or job.cancel_reason
        if why:
            text += f": {why}"
        fields: dict[str, Any] = {"outcome": name, "duration": round(duration, 6)}
        if why is not None and error is not None:
            fields["error"] = why
        job_log(level, job, "%s", text, **fields)

    def _fire_outcome(self, outcome: Outcome, duration: float, error: BaseException | None) -> None:
        events, job = self.jobs.events, outcome.job
        if outcome.kind is OutcomeKind.SUCCEEDED:
            events.fire("succeeded", job, duration=duration)
        elif outcome.kind is OutcomeKind.FAILED:
            events.fire("failed", job, duration=duration, error=error)
            name = "dead" if outcome.dead else "retried"
            events.fire(name, job, duration=duration, error=error)
        elif outcome.kind is OutcomeKind.SNOOZED:
            events.fire("snoozed", job, duration=duration, reason=f"{outcome.delay:g}")

    def settle(self, job: ClaimedJob) -> bool:
        """A transactional run is about to COMMIT its completion: from now on the
        heartbeat must not take the job's disappearing row for a lost lease. False if the
        claim was settled already (timed out, handed back): then roll back instead."""
        with self._lock:
            if job.settled:
                return False
            job.settled = True
            return True

    def unsettle(self, job: ClaimedJob) -> None:
        """The COMMIT failed: the claim is open again, and its failure must be recorded."""
        with self._lock:
            job.settled = False

    def transactional(self, run: Run) -> Generator[Step, Any, Outcome]:
        """A transactional task: the handler's writes and the job's completion commit in
        one transaction, on a session the driver opens for this run.

        The completion is guarded by (id, attempts) like any other: if this claim was lost
        (the lease passed and another worker took the job, or it was cancelled), it matches
        no row, and the handler's writes roll back with it. Database effects happen
        exactly once.
        """
        job = run.job
        try:
            value = yield CallHandler()
            done = yield OnSession(db.complete_in, (self.queries, job, value))
        except BaseException as exc:  # the handler's own, or a database error
            yield Rollback()
            return run.end(exc)
        if not done:
            yield Rollback()
            return run.lost()
        if not self.settle(job):
            yield Rollback()  # timed out or handed back meanwhile: that decision stands
            return run.end(None)
        try:
            yield Commit()
        except BaseException as exc:
            self.unsettle(job)
            return run.end(exc)
        self.count({job.queue: [1, 0, 0]})
        return run.committed()

    # -- the fetch loop ----------------------------------------------------------------

    def fetch(self, *, wait_scheduled: float = 0.0, deadline: float | None = None) -> Steps:
        """Claim, run maintenance, sleep; until stopped (or, ``until_empty``, until no job is
        ready or running here and none falls due within ``wait_scheduled`` seconds)."""
        failures = 0
        while not self.stopping:
            if deadline is not None and time.monotonic() >= deadline:
                return
            try:
                yield from self._maintain()
                yield from self._claim()
                if self.until_empty and not self.more and self.idle:
                    # Outcomes may still be in flight (a retry not yet scheduled): write
                    # them, refresh, and look once more before calling it empty.
                    yield WaitWritten()
                    self._next_refresh = 0.0
                    self._dry.clear()  # "empty" means every queue looked at now
                    yield from self._maintain()
                    # A limited queue that held ready jobs back is not empty: wait for
                    # its slot or its rate window (the sleep below ends when it is due).
                    claimed = yield from self._claim()
                    if not claimed and not self._held and not self._due_soon(wait_scheduled):
                        return
                if failures:
                    failures = 0
                    self._unreachable_since = None
            except Exception as exc:
                if not is_database_error(exc):
                    raise
                failures += 1
                self._note_unreachable(exc)
                pause = retry_pause(failures, exc)
                self.db_warning(
                    exc,
                    "worker %s: database error, retrying in %.2fs: %s",
                    self.name,
                    pause,
                    describe(exc),
                )
                yield Pause(pause)
                continue
            if not self.more:
                yield Sleep(self._sleep_for())

    def _note_unreachable(self, exc: BaseException) -> None:
        """For health: since when the database cannot be reached (a failure of another kind
        means it answers)."""
        if not unreachable(exc):
            self._unreachable_since = None
        elif self._unreachable_since is None:
            self._unreachable_since = time.monotonic()

    def _claim_order(self) -> list[str]:
        """The queues to claim from this round: unpaused ones, starting from a rotating one
        so that no queue always goes first.

        A queue whose last claim came back short is dry: it is skipped until a NOTIFY names
        it or the next poll round (:meth:`_dry_until`). A worker serving 1,000 queues with
        jobs in three of them would otherwise send a thousand claims per round, nearly all
        empty, while the busy queues wait (``benchmarks/curves.py --rows queues``).
        Limited queues are never dry: their own wait (``_held``, until a slot or the rate
        window frees) decides when they are claimed again."""
        dry, now = self._dry, time.monotonic()
        queues = [q for q in self.queues if q not in self._paused and not dry.get(q, 0.0) > now]
        if self._held:
            with self._lock:
                queues = [q for q in queues if self._held.get(q, 0.0) <= now]
        if not queues:
            return []
        start = self._turn % len(queues)
        self._turn = start + 1
        return queues[start:] + queues[:start]

    def _claim(self) -> Generator[Step, Any, int]:
        """Claim up to the free slots (and the claim-ahead), queue by queue; dispatch each
        claim at once.

        Sets ``more`` when a queue gave as many jobs as asked (there may be more right
        now), and marks the worker saturated when too little room is left for a claim
        worth sending (a finishing job must then wake the loop). Otherwise the queues are
        drained for the moment.
        """
        self.more = False
        self._estimate_ahead()
        with self._lock:
            # Under the lock with the flag: a job finishing in between sees it and wakes us.
            room = self._free + self._ahead
            if room < self._wake_at:
                self._saturated = True
                return 0
        total = 0
        for queue in self._claim_order():
            limited = queue in self.limits
            # Limited queues share the room: their claims, like any, are 'running' rows
            # while they wait, so their limits hold (and kept to the free slots, they
            # would starve beside a busy queue that keeps those below zero).
            want = min(room - total, self.settings.claim_limit)
            if want <= 0:
                break
            # One statement in autocommit: it has committed when it returns. Only now may
            # the jobs start: a completion written before the claim is visible would find
            # the row still 'ready' and match nothing.
            params = claim_params(queue, want, self.lease, self.name)
            began = time.monotonic()
            if limited:
                rows = yield from self._claim_limited(queue, params)
            else:
                rows = yield Io(db.claim, (self.queries, params), Conn.CLAIM)
                took = time.monotonic() - began
                self._rtt = took if not self._rtt else 0.8 * self._rtt + 0.2 * took
                if self.listen_watch.active:
                    self.listen_watch.claimed(queue, began, len(rows), want, began + took)
            if len(rows) == want:
                self.more = True
                self._dry.pop(queue, None)
            elif not limited:
                # Not when a NOTIFY for it arrived while this claim was on its way: the
                # claim's snapshot may predate the jobs it announced.
                with self._lock:
                    if self._notified.get(queue, 0.0) < began:
                        self._dry[queue] = self._dry_until(began)
            if rows:
                claimed = self.claimed(rows, began)
                if claimed:
                    self.driver.dispatch(claimed)
                total += len(rows)
        return total

    def _dry_until(self, began: float) -> float:
        """Until when a queue whose claim (sent at ``began``) came back short is skipped:
        the next poll round, which is due within a poll interval of ``began``.

        Timed from the round, not from the claim: the idle loop wakes for the round at
        ``_next_refresh``, and a mark set a few milliseconds later than that (from the end
        of the claim, or its start) was still "dry" when the loop woke, so each queue but
        the first of a round was claimed only every other poll interval. When the round
        is already overdue (its claims took longer than a poll interval: thousands of
        queues), a poll interval from ``began`` still bounds the wait."""
        round_due = self._next_refresh
        return round_due if round_due > began else began + self.settings.poll_interval

    def _estimate_ahead(self) -> None:
        """How far past the free slots to claim: twice the jobs that finish during one
        claim's round trip (both smoothed), at most a claim's worth.

        A claim claims only what its worker can run, so with handlers faster than a round
        trip the slots run dry while the next claim travels: one worker drained at a
        fraction of what the database allows, and only more processes (more claims in
        flight) made up for it. Claimed ahead, the next claim's jobs arrive as the last
        ones end. Slow handlers finish few jobs per round trip, which makes the claim-ahead
        zero, so slow jobs do not queue here behind each other while another worker is
        idle (only what was claimed ahead when quick jobs turned slow can, once). A
        claimed-ahead job waits in this worker, with its lease renewed, for a round trip
        or two; a stop hands it back at once, unstarted.
        """
        if not self.settings.prefetch:
            return
        now = time.monotonic()
        since, processed = self._rate_mark
        elapsed = now - since
        if elapsed < 0.01:  # too short a time to tell a rate; keep the last estimate
            return
        rate = (self.processed - processed) / elapsed
        self._rate = 0.5 * (self._rate + rate) if self._rate else rate
        self._rate_mark = (now, self.processed)
        s = self.settings
        ahead = min(s.claim_limit, s.concurrency, int(2 * self._rate * self._rtt))
        with self._lock:
            self._ahead = ahead
            # Wait for room for half a claim rather than send a claim per finished job.
            self._wake_at = max(1, ahead // 2)

    def _claim_limited(self, queue: str, params: ClaimParams) -> Generator[Step, Any, list[Any]]:
        """Claim from a limited queue. When its limits held ready jobs back, skip it until
        its rate has room again, or for a moment (``LIMIT_RECHECK``) when a concurrency
        limit is full: a slot frees when any worker's completion is written, which no
        NOTIFY announces (this worker's own completions end the wait at once)."""
        limits = self.limits[queue]
        limited = limited_claim_params(
            params,
            concurrency=limits.concurrency,
            rate=limits.rate,
            period=limits.rate_period,
            key_limit=limits.key_concurrency,
            keyed=limits.keyed,
            key_rate=limits.key_rate,
            key_period=limits.key_rate_period,
        )
        found: db.LimitedClaim = yield Io(db.claim_limited, (self.queries, limited), Conn.CLAIM)
        # Under the lock: the completer (another thread in the threaded worker) ends
        # waits in _freed.
        with self._lock:
            self._rate_held.discard(queue)
            if len(found.rows) < params["limit"] and found.held:
                wait = LIMIT_RECHECK
                if found.rate_free_in is not None:
                    wait = found.rate_free_in
                    self._rate_held.add(queue)
                elif found.key_free_in is not None:
                    # Held by a key's rate: nothing frees it before then. Unless a
                    # concurrency limit may be holding jobs too, whose slot a completion
                    # can free: then look again within LIMIT_RECHECK, as for those.
                    if limits.concurrency is None and limits.key_concurrency is None:
                        wait = found.key_free_in
                        self._rate_held.add(queue)
                    else:
                        wait = min(found.key_free_in, LIMIT_RECHECK)
                wait = max(0.0, min(wait, self.settings.poll_interval))
                self._held[queue] = time.monotonic() + wait
            else:
                self._held.pop(queue, None)
        return found.rows

    def maintain(self) -> Steps:
        """Run the maintenance now, whatever its schedule says."""
        self._next_refresh = 0.0
        yield from self._maintain()

    def _maintain(self) -> Steps:
        """The shared maintenance, when due: every poll interval, or once a known due time
        has passed. Retention runs every ``prune_interval`` in one elected worker."""
        now = time.monotonic()
        due = self._next_due is not None and now >= self._next_due
        if now < self._next_refresh and not due:
            return
        rescue = now >= self._next_rescue
        result: Refresh = yield Io(db.refresh, (self.jobs, rescue), Conn.TX)
        now = time.monotonic()
        if rescue:
            self._next_rescue = now + self.settings.rescue_every
        self._paused = result.paused
        for queue in result.woken:
            self._dry.pop(queue, None)
        self._next_refresh = now + self.settings.poll_interval
        self._next_due = None if result.due_in is None else now + max(0.0, result.due_in)
        if now >= self._next_prune:
            self._next_prune = now + self.settings.prune_interval
            pruned = yield from self.prune()
            if pruned:
                log.info("worker %s: pruned %d finished jobs", self.name, pruned)

    def prune(self, *, max_batches: int = 20) -> Generator[Step, Any, int]:
        """Retention, in batches of their own short transactions; stops at once if another
        worker holds the pruner lock. Returns how many rows were deleted."""
        total = 0
        for statement, age in db.prune_work(self.jobs):
            for _ in range(max_batches):
                deleted = yield Io(db.prune_batch, (self.jobs, statement, age), Conn.TX)
                if deleted is None:
                    return total
                total += deleted
                if deleted < db.PRUNE_BATCH:
                    break
        return total

    def _sleep_for(self) -> float:
        """How long the idle fetch loop may sleep: to the next refresh or due time."""
        now = time.monotonic()
        sleep = min(self.settings.poll_interval, max(0.0, self._next_refresh - now))
        if self._held:
            with self._lock:
                held = min(self._held.values(), default=now)
            sleep = min(sleep, max(0.0, held - now) + 0.001)
        if self._next_due is not None:
            sleep = min(sleep, max(0.0, self._next_due - now) + 0.001)
        return sleep

    def _due_soon(self, within: float) -> bool:
        if within <= 0 or self._next_due is None:
            return False
        return self._next_due - time.monotonic() <= within

    def _note_due(self, batch: Iterable[Outcome]) -> None:
        """Retries and snoozes were scheduled: make sure the fetch loop wakes for them."""
        sooner = False
        for o in batch:
            if o.kind is not OutcomeKind.SUCCEEDED:
                due = time.monotonic() + o.delay
                if self._next_due is None or due < self._next_due:
                    self._next_due = due
                    sooner = True
        if sooner:
            # Its sleep was timed before this due time was known.
            self.driver.wake()

    # -- side duties -------------------------------------------------------------------

    def duties(self, *, listen: bool) -> dict[str, Callable[[], Steps]]:
        """The named side duties a worker runs beside its fetch loop, each a ``run_once``."""
        duties: dict[str, Callable[[], Steps]] = {
            "completer": self.complete_once,
            "heartbeat": self.heartbeat_once,
            "presence": self.presence_once,
        }
        if listen:
            duties["listener"] = self.listen_once
        return duties

    def complete_once(self) -> Steps:
        """Write one batch of outcomes, retrying through database errors. Returns False
        once the worker stopped and every outcome is written."""
        batch = self._unwritten_batch or (yield from self._take_batch())
        self._unwritten_batch = []
        if not batch:
            return False
        try:
            yield from self._write(batch)
        except Exception:
            # A bug, not the database: the supervisor logs it and runs this again after a
            # pause, with the same batch, or stops the worker if it keeps failing.
            self._unwritten_batch = batch
            raise
        with self._lock:
            self._unwritten -= len(batch)
            self._outcomes_since = time.monotonic() if self._unwritten else None
        self._unreachable_since = None
        self.driver.written()
        return True

    def _take_batch(self) -> Generator[Step, Any, list[Outcome]]:
        """The next batch: wait for a first outcome, then up to ``completion_interval``
        more for others, up to ``completion_batch``. Empty once the run has ended."""
        s = self.settings
        batch: list[Outcome] = []
        deadline: float | None = None
        if self._ended:
            return batch
        while len(batch) < s.completion_batch:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            taken = yield TakeOutcomes(s.completion_batch - len(batch), timeout)
            if END in taken:
                self._ended = True
                taken = [o for o in taken if o is not END]
            batch.extend(taken)
            if self._ended or (deadline is not None and not taken):
                break
            if deadline is None:
                deadline = time.monotonic() + s.completion_interval
        return batch

    def _write(self, batch: list[Outcome]) -> Steps:
        failures = 0
        while True:
            try:
                written = yield Io(db.write_outcomes, (self.queries, batch), Conn.WRITE)
                self.count(written)
                self._freed(batch)
                break
            except Exception as exc:
                if not is_database_error(exc):
                    raise
                failures += 1
                self._note_unreachable(exc)
                if self.stopping and failures > 5:
                    log.error(
                        "worker %s: could not record %d outcomes (%s); their jobs will run "
                        "again once their leases pass",
                        self.name,
                        len(batch),
                        describe(exc),
                    )
                    return
                pause = retry_pause(failures, exc)
                self.db_warning(
                    exc,
                    "worker %s: writing %d outcomes failed, retrying in %.2fs: %s",
                    self.name,
                    len(batch),
                    pause,
                    describe(exc),
                )
                yield Pause(pause, stoppable=False)
        self._note_due(batch)

    def _freed(self, batch: list[Outcome]) -> None:
        """Written outcomes freed slots of limited queues: claim from them again now."""
        if not self.limits:
            return
        freed = {o.job.queue for o in batch} & self.limits.keys()
        woken = False
        with self._lock:
            for queue in freed - self._rate_held:
                if self._held.pop(queue, None) is not None:
                    woken = True
        if woken:
            self.driver.wake()

    def heartbeat_once(self) -> Steps:
        """Enforce timeouts; every third of the lease (or when poked by a cancellation),
        extend the leases of all running claims in one statement and stop lost ones.
        Returns False once the worker stopped and nothing runs any more."""
        every = self.settings.lease / 3
        poked = yield Tick(min(every, 0.1))
        if poked is None:
            return False
        self.enforce_timeouts()
        since = time.monotonic() - self._last_beat
        if (
            poked
            or self._poked
            or since >= every
            or (since >= PROGRESS_EVERY and self._progress_waiting())
        ):
            self._poked = False
            yield from self.beat()
        return True

    def _progress_waiting(self) -> bool:
        """A running handler left a progress note the heartbeat has not written."""
        with self._lock:
            return any(j.unwritten_progress() is not None for j in self._running.values())

    def beat(self) -> Steps:
        """Extend the leases of every running claim, and write their handlers' latest
        progress notes, in one statement.

        A claim that does not come back is no longer this worker's: the job was
        cancelled, or its lease passed and another worker took it. Its handler is told to
        stop. A database error is logged and the beat tried again at the next tick.
        """
        self._last_beat = began = time.monotonic()
        with self._lock:
            running = [j for j in self._running.values() if not j.settled]
        if not running:
            return
        notes = [j.unwritten_progress() for j in running]
        try:
            kept = yield Io(db.beat, (self.queries, running, self.lease, notes), Conn.TX)
        except Exception as exc:
            self._last_beat = 0.0  # whatever failed, try again at the next tick
            if not is_database_error(exc):
                raise
            self.db_warning(exc, "worker %s: heartbeat failed: %s", self.name, describe(exc))
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
        with self._lock:
            # A claim settled while the statement ran (its completion may be written
            # already) is not lost: only those still running and open are.
            lost = [
                j
                for j in running
                if j.key not in kept and self._running.get(j.key) is j and not j.settled
            ]
            # Claims held back from starting until a beat (see start): decided now.
            confirmed = [
                j
                for j in running
                if j.confirming and self._running.get(j.key) is j and not j.settled
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
                self.driver.interrupt(job)
        if confirmed:
            # Kept ones start now; lost ones, cancelled above, end at once, not run.
            self.driver.dispatch(confirmed)

    def enforce_timeouts(self) -> None:
        """Past its task's timeout, a run has failed: record that now, stop extending its
        lease, and stop the handler (an asyncio task is cancelled; a thread cannot be, and
        is told through ``job.cancelled``). Its slot frees when the handler ends."""
        now = time.monotonic()
        tasks = self.jobs.tasks
        overdue: list[tuple[ClaimedJob, Task[Any, Any]]] = []
        with self._lock:
            for job in self._running.values():
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
                del self._running[job.key]
                job.settled = True
                if not self._unwritten:
                    self._outcomes_since = now
                self._unwritten += 1
        for job, task in overdue:
            job.cancel(f"timed out after {task.timeout}s")
            outcome = timed_out(task, job)
            error = TimeoutError((outcome.error or "").removeprefix("TimeoutError: "))
            name = "dead" if outcome.dead else "retried"
            self.log_end(job, name, now - job.started, outcome, error, level=logging.WARNING)
            self._fire_outcome(outcome, now - job.started, error)
            self.driver.record(outcome)
            self.driver.interrupt(job)

    def count(self, tally: Tally | None) -> None:
        """Add written outcomes to what the next presence update reports."""
        if not tally:
            return
        with self._lock:
            for queue, (succeeded, failed, dead) in tally.items():
                counts = self._tally.setdefault(queue, [0, 0, 0])
                counts[0] += succeeded
                counts[1] += failed
                counts[2] += dead

    def _take_tally(self) -> Tally:
        with self._lock:
            tally, self._tally = self._tally, {}
        return tally

    def presence(self) -> WorkerSeenParams:
        """This worker's row of ``<table>_workers``, as of now."""
        return {
            "name": self.name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "kind": type(self.driver).__name__,
            "queues": list(self.queues),
            "concurrency": self.settings.concurrency,
            "running": self.running,
            "processed": self.processed,
            "ttl": interval(self.settings.presence_interval * PRESENCE_MISSES),
        }

    def presence_once(self) -> Steps:
        """Say that this worker is alive (its row in ``<table>_workers``) and add the
        outcomes written since the last time to ``<table>_throughput``; then wait
        ``presence_interval``. Returns False once the worker is stopping (its row is
        deleted at the end of the run, see :meth:`run`).

        A database error only delays the report: the counts are kept for the next one,
        and the first failure of a streak is logged (a missing table means migrations
        were not run; jobs still run, the dashboard just cannot see this worker).
        """
        if self.stopping:
            return False
        self._presence_rounds += 1
        tidy = self._presence_rounds % TIDY_EVERY == 1
        tally = self._take_tally()
        try:
            yield Io(db.worker_seen, (self.queries, self.presence(), tally, tidy), Conn.TX)
        except Exception as exc:
            self.count(tally)
            if not is_database_error(exc):
                raise
            if not self._presence_failing:
                self.db_warning(
                    exc,
                    "worker %s: could not record its presence (%s); the dashboard will not "
                    "show it until this works",
                    self.name,
                    describe(exc),
                )
            self._presence_failing = True
        else:
            self._presence_failing = False
        yield Pause(self.settings.presence_interval)
        return not self.stopping

    def leave(self) -> Steps:
        """At the end of a run: add the last counts and delete this worker's row."""
        tally = self._take_tally()
        try:
            yield Io(db.worker_gone, (self.queries, self.name, tally), Conn.TX)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            log.log(
                logging.DEBUG if self._presence_failing else logging.WARNING,
                "worker %s: could not delete its presence row (%s); it expires by itself",
                self.name,
                describe(exc),
            )

    def listen_once(self) -> Steps:
        """Hold a LISTEN connection and pass notifications on, until the worker stops or
        the connection fails (the supervisor then starts this again after a pause).

        A notification names a queue that has new ready jobs (the fetch loop wakes only
        for its own queues), or asks for a heartbeat now because a running job was
        cancelled. A LISTEN that turns out to hear nothing (see :mod:`.hearing`) is said
        once, and let go: the worker then polls, as with ``listen=False``."""
        watch = self.listen_watch
        try:
            yield Listen(self.queries.channel)
            self._listened = True
            self.listening.set()
            watch.listening(time.monotonic())
            self.driver.wake()  # catch anything enqueued while we were not listening
            wanted = set(self.queues)
            while not self.stopping:
                for payload in (yield Notifications(0.5)):
                    if payload in wanted:
                        now = time.monotonic()
                        with self._lock:
                            self._notified[payload] = now
                            self._dry.pop(payload, None)
                        watch.heard(payload, now)
                        self.driver.wake()
                    elif payload == CANCEL_PAYLOAD:
                        self._poked = True
                        self.driver.poke()
                if watch.active and watch.judge(time.monotonic()) is False:
                    self._deaf(watch)
                    return False
            return False
        finally:
            # The supervisor has the driver close the connection (Unlisten) after each run.
            watch.stopped()
            self.listening.clear()

    def _deaf(self, watch: ListenWatch) -> None:
        log.warning(
            "worker %s: its LISTEN hears nothing: jobs came into %s %d times in %.0fs with no "
            "notification; its connection goes through a pooler in transaction mode "
            "(PgBouncer) or a proxy that does not pass notifications. It stops listening and "
            "polls every %gs. Run it with --no-listen (listen=False), or give it a direct "
            "connection (or a PgBouncer pool in session mode) to pick jobs up within "
            "milliseconds; see the README's PgBouncer section",
            self.name,
            ", ".join(watch.missed_queues),
            watch.misses,
            max(0.0, time.monotonic() - watch.first_miss),
            self.settings.poll_interval,
        )

    def run(
        self,
        *,
        listen: bool,
        until_empty: bool,
        wait_scheduled: float = 0.0,
        deadline: float | None = None,
    ) -> Steps:
        """A worker's whole run: start, the fetch loop beside the side duties, then the
        graceful shutdown. Raises :class:`~sqla_jobs.errors.WorkerError` at the end if a
        duty kept failing."""
        return self.watched(
            "fetch loop",
            self._run(
                listen=listen,
                until_empty=until_empty,
                wait_scheduled=wait_scheduled,
                deadline=deadline,
            ),
        )

    def _run(
        self, *, listen: bool, until_empty: bool, wait_scheduled: float, deadline: float | None
    ) -> Steps:
        self.reset()
        self.until_empty = until_empty
        self._state = "running"
        try:
            yield from self.starting()
            yield StartDuties(tuple(self.duties(listen=listen)))
            try:
                yield from self._supervised(
                    "fetch loop",
                    lambda: self.fetch(wait_scheduled=wait_scheduled, deadline=deadline),
                )
            finally:
                self.driver.stop()
                yield from self.shutdown()
                yield EndDuties()
                # After the duties ended: no presence update can follow the row's deletion.
                yield from self.leave()
                self.stopping = False  # ready for another run
                log.info("worker %s stopped", self.name)
        finally:
            self._state = "stopped"
        if self.fatal is not None:
            raise self.fatal

    def supervised(self, name: str, run_once: Callable[[], Steps] | None = None) -> Steps:
        """Run a duty (``run_once`` again and again) until it says it is done; when it raises,
        run it again after the pause :meth:`supervise` decides, or stop the worker.

        The completer and the heartbeat outlive the stop (outcomes must be written, and
        leases kept while handlers finish): they end by themselves, once nothing is left.
        Each step the duty waits on is noted for :meth:`health`.
        """
        return self.watched(name, self._supervised(name, run_once))

    def _supervised(self, name: str, run_once: Callable[[], Steps] | None = None) -> Steps:
        run_once = run_once or self.duties(listen=True)[name]
        outlives_stop = name in ("completer", "heartbeat")
        state = DutyState(self, name)
        while True:
            self._listened = False
            error: Exception | None = None
            try:
                more = yield from run_once()
            except Exception as exc:
                error = exc
            if name == "listener":
                yield Unlisten()
            if error is None:
                if more is not True:
                    return
                state.succeeded()
                continue
            if self._listened:
                state.succeeded()
            try:
                pause = state.failed(error)
            except WorkerError as fatal:
                self.fatal = fatal
                self.driver.stop()
                return
            yield Pause(pause, stoppable=not outlives_stop)
            if self.stopping and not outlives_stop:
                return

    # -- health ------------------------------------------------------------------------

    def watched(self, name: str, steps: Steps) -> Steps:
        """``yield from steps``, noting for :meth:`health` which step the loop ``name``
        waits on, and since when. One clock reading per step."""
        waiting = self._waiting
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                try:
                    step = steps.throw(error) if error is not None else steps.send(value)
                except StopIteration as stop:
                    return stop.value
                waiting[name] = (time.monotonic(), step)
                try:
                    value, error = (yield step), None
                except GeneratorExit:
                    raise
                except BaseException as exc:
                    value, error = None, exc
        finally:
            waiting[name] = (time.monotonic(), None)
            steps.close()

    def health(self, now: float | None = None) -> Health:
        """Whether this worker is alive and doing its work, and if not, why.

        Unhealthy when its run has ended (or a duty kept failing), when a loop (the fetch
        loop, the completer, the heartbeat, the listener) has waited on one step for longer
        than that step should take plus ``stuck_after`` (a statement that hangs, a thread
        that never comes back), or when outcomes have waited ``stuck_after`` seconds
        without a write while the database answers. A database that cannot be reached is
        reported, but is not the worker's fault: restarting it would not help.
        """
        now = time.monotonic() if now is None else now
        stuck_after = self.settings.stuck_after
        problems: list[str] = []
        loops: dict[str, dict[str, Any]] = {}
        for name, (since, step) in sorted(dict(self._waiting).items()):
            waited = max(0.0, now - since)
            loops[name] = {"waiting_on": step_name(step), "seconds": round(waited, 3)}
            if step is not None and waited > step_budget(step, stuck_after):
                problems.append(f"{name} stuck: waiting on {step_name(step)} for {waited:.1f}s")
        idle = self._idle_with_work(now)
        if idle is not None:
            problems.append(idle)
        if self._state == "stopped":
            problems.insert(0, "the worker is not running")
        if self.fatal is not None:
            problems.insert(0, str(self.fatal))
        database = "ok"
        unreachable_since = self._unreachable_since
        if unreachable_since is not None:
            database = f"unreachable for {now - unreachable_since:.1f}s"
        outcomes_since = self._outcomes_since
        if (
            outcomes_since is not None
            and self._unwritten
            and now - outcomes_since > stuck_after
            and unreachable_since is None
        ):
            problems.append(
                f"{self._unwritten} outcomes waiting {now - outcomes_since:.1f}s for a write"
            )
        return Health(
            healthy=not problems,
            state=self._state,
            worker=self.name,
            problems=tuple(problems),
            loops=loops,
            running=self.running,
            concurrency=self.settings.concurrency,
            unwritten=self._unwritten,
            database=database,
        )

    def db_warning(self, exc: BaseException, message: str, *args: Any) -> None:
        """Log a database error as a warning; but a prepared statement lost by a pooler is
        a misconfiguration, not weather: one ERROR line naming the fix
        (:data:`POOLING_ADVICE`), the first time, and DEBUG lines after."""
        if not lost_prepared_statement(exc):
            log.warning(message, *args)
            return
        with self._lock:  # the fetch loop and the duties may be threads
            first, self.pooling_said = not self.pooling_said, True
        if first:
            log.error(POOLING_ADVICE, self.name, describe(exc))
        else:
            log.debug(message, *args)

    def _idle_with_work(self, now: float) -> str | None:
        """Why the worker runs nothing though it holds claims to run, or None.

        A claim waits to start only while every slot runs a handler (it was claimed
        ahead), or, held by :meth:`start`, for the heartbeat. One that has waited
        longer than ``stuck_after`` while a slot runs no handler means the executors
        (threads or tasks) are gone: the heartbeat would keep its lease for ever, and the
        worker would look alive while running nothing."""
        concurrency = self.settings.concurrency
        with self._lock:
            unstarted = [j for j in self._running.values() if not j.started and not j.settled]
            # Slots held by handlers: every claim holds one until its handler ends (a
            # timed-out one too, whose thread cannot be stopped), and unstarted claims
            # hold theirs too.
            handlers = concurrency - self._free - len(unstarted)
        waiting = [j for j in unstarted if not j.confirming and j.claimed_at]
        if not waiting or handlers >= concurrency:
            return None
        oldest = now - min(j.claimed_at for j in waiting)
        if oldest <= self.settings.stuck_after:
            return None
        return (
            f"{len(waiting)} claimed jobs waiting {oldest:.1f}s to start while "
            f"{concurrency - max(handlers, 0)} of {concurrency} slots run no handler"
        )

    def supervise(self, name: str, failures: int, exc: BaseException) -> float:
        """A duty raised: log it, and say how long to wait before running it again.

        Database errors are waited out for ever (with the pause of :func:`retry_pause`);
        anything else (a bug, an exhausted resource) is logged with its traceback and
        retried with backoff, and after :data:`MAX_DUTY_FAILURES` in a row the worker
        stops loudly (:class:`~sqla_jobs.errors.WorkerError`): a side duty that is dead
        for good would let leases lapse and jobs run twice.
        """
        if is_database_error(exc):
            pause = retry_pause(failures, exc)
            self.db_warning(
                exc,
                "worker %s: %s: database error, again in %.2fs: %s",
                self.name,
                name,
                pause,
                describe(exc),
            )
            return pause
        if failures >= MAX_DUTY_FAILURES:
            log.critical(
                "worker %s: %s failed %d times in a row; stopping the worker",
                self.name,
                name,
                failures,
                exc_info=exc,
            )
            raise WorkerError(f"worker {self.name}: {name} kept failing: {describe(exc)}") from exc
        pause = min(5.0, 0.1 * 2.0 ** (failures - 1)) * random.uniform(0.8, 1.2)
        log.error(
            "worker %s: %s failed unexpectedly; restarting it in %.2fs",
            self.name,
            name,
            pause,
            exc_info=exc,
        )
        return pause

    # -- starting and stopping ---------------------------------------------------------

    def starting(self) -> Steps:
        """Before the first claim: make the code-declared schedules' rows match the code."""
        from .. import periodic

        yield Io(periodic.sync_declared, (self.jobs,), Conn.TX)
        log.info(
            "worker %s started: queues %s, concurrency %d",
            self.name,
            self.queues,
            self.settings.concurrency,
        )

    def signalled(self, name: str) -> None:
        log.info("worker %s: received %s, stopping", self.name, name)

    def shutdown(self) -> Steps:
        """The one stop policy: hand back claims that never started (at once), give running
        handlers the grace period, then stop the ones still running and hand them back too.
        A handed-back job is ready again at once (the claim not counted) and its queue's
        workers are woken."""
        self.stopping = True
        self.driver.wake()
        unstarted = self._take(lambda j: not j.started)
        with self._lock:
            self._free += len(unstarted)
        if unstarted:
            yield from self._hand_back(unstarted, "unstarted")
        if (yield WaitIdle(self.settings.grace_period)):
            return
        late = self._take(lambda j: True)
        for job in late:
            job.cancel("worker stopping: grace period over")
            self.log_end(job, "cancelled", time.monotonic() - job.started if job.started else 0.0)
            self.jobs.events.fire("cancelled", job, reason=job.cancel_reason)
            self.driver.interrupt(job)
        if late:
            yield from self._hand_back(late, "cut off by the grace period")
            yield WaitIdle(1.0)  # cancelled tasks end at once; threads cannot be made to

    def _hand_back(self, claims: list[ClaimedJob], what: str) -> Steps:
        try:
            count = yield Io(db.hand_back, (self.queries, claims), Conn.TX)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            log.warning(
                "worker %s: could not hand back %d %s jobs (%s); they will run again once "
                "their leases pass",
                self.name,
                len(claims),
                what,
                describe(exc),
            )
        else:
            log.info("worker %s: handed back %d %s jobs", self.name, count, what)


class Run:
    """One run of a handler, from :meth:`WorkerCore.start` to its outcome.

    A driver calls the handler inside ``with run:``, which ends the run whatever happens
    (the worker itself must never die of a handler, not even of its ``SystemExit``) and
    leaves the outcome in :attr:`outcome`::

        with run:
            run.task.fn(*run.args, **run.kwargs)
        return run.outcome

    Every way a run ends (:meth:`end`, :meth:`committed`, :meth:`lost`) is called in the
    handler's own context, so the run hooks (:mod:`sqla_jobs.events`) are exited there.
    """

    __slots__ = ("_token", "args", "core", "hooks", "job", "kwargs", "outcome", "task", "value")

    def __init__(
        self,
        core: WorkerCore,
        task: Task[Any, Any],
        job: ClaimedJob,
        token: contextvars.Token[ClaimedJob],
    ) -> None:
        self.core, self.task, self.job, self._token = core, task, job, token
        #: The handler's arguments, from the stored JSON.
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.outcome: Outcome | None = None
        #: What the handler returned (the driver sets it): kept for a result-keeping job.
        self.value: Any = None
        #: The run hooks entered, with what each returned (a tuple: none, the usual case,
        #: costs no allocation).
        self.hooks: Sequence[tuple[RunHook, object]] = ()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        result: str | None = None
        if error is None and keeps(self.job) is not None:
            try:
                result = result_json(self.value)
            except ResultError as exc:
                error = exc
        outcome = self.outcome = self.end(error)
        if result is not None and outcome.kind is OutcomeKind.SUCCEEDED:
            outcome.result = result
        return True

    def enter_hooks(self, hooks: Iterable[RunHook]) -> None:
        """Enter the run hooks, in order. A hook that fails to enter is logged and left
        out, except a ``required`` one (the app's context, ``Jobs.around_run``), whose
        error is raised for the run to fail with: the hooks entered before it are exited
        when the run ends."""
        entered: list[tuple[RunHook, object]] = []
        self.hooks = entered
        for hook in hooks:
            try:
                entered.append((hook, hook.enter(self.job)))
            except Exception:
                if getattr(hook, "required", False):
                    raise
                log.exception("run hook %r failed to enter", hook)

    def _exit_hooks(self, outcome: str, error: BaseException | None) -> None:
        hooks, self.hooks = self.hooks, ()
        for hook, state in reversed(hooks):
            try:
                hook.exit(self.job, state, outcome, error)
            except Exception:
                log.exception("run hook %r failed to exit", hook)

    def _close(self) -> None:
        """The run is over: :func:`current_job` is reset (once) and the job lets go of it."""
        if self.job.run is self:
            self.job.run = None
            reset_current(self._token)

    def abandon(self, error: BaseException) -> None:
        """The worker's own code failed around this run (:meth:`WorkerCore.crashed`): close
        it as a failure, so that the executor's next run starts without this one's
        :func:`current_job` or hooks."""
        self._close()
        if self.hooks:
            self._exit_hooks("failed", error)

    def end(self, error: BaseException | None) -> Outcome:
        """The handler is done (``error`` is what it raised, if anything)."""
        self._close()
        outcome = self.core.end(self.task, self.job, error)
        if self.hooks:
            self._exit_hooks(outcome_name(outcome), error)
        return outcome

    def committed(self) -> Outcome:
        """A transactional run committed its writes with its completion: nothing is left
        to record."""
        self._close()
        core = self.core
        if core._crashes:
            core._crashes = 0
        duration = time.monotonic() - self.job.started
        self.core.log_end(self.job, "succeeded", duration)
        self.core.jobs.events.fire("succeeded", self.job, duration=duration)
        if self.hooks:
            self._exit_hooks("succeeded", None)
        return Outcome(OutcomeKind.SETTLED, self.job)

    def lost(self) -> Outcome:
        """A transactional run's guarded completion matched no row: the claim was lost
        (the lease passed, or the job was cancelled), and its writes were rolled back."""
        self._close()
        job = self.job
        duration = time.monotonic() - job.started
        job.cancel("lease lost, or cancelled: this claim is no longer this worker's")
        job_log(
            logging.WARNING,
            job,
            "claim lost; its writes were rolled back",
            outcome="cancelled",
            duration=round(duration, 6),
        )
        self.core.jobs.events.fire("cancelled", job, duration=duration, reason=job.cancel_reason)
        if self.hooks:
            self._exit_hooks("cancelled", None)
        return Outcome(OutcomeKind.SETTLED, job)


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


class DutyState:
    """A supervisor's memory of one duty: how often it failed in a row.

    A round that ends normally resets it. So does a listener round that got as far as its
    LISTEN: that round holds its connection for hours, and one connection dropped a day is
    not "failing repeatedly".
    """

    def __init__(self, core: WorkerCore, name: str) -> None:
        self.core, self.name = core, name
        self.failures = 0

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self, exc: BaseException) -> float:
        """Seconds to wait before the next run; raises WorkerError to stop the worker."""
        self.failures += 1
        return self.core.supervise(self.name, self.failures, exc)

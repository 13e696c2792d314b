"""Every decision a worker makes, once, for both the threaded and the asyncio worker.

:class:`WorkerCore` holds the state the duties share (the running set and its lock, the
slots, the unwritten outcomes, the health marks), the start and the end of each run of a
handler (:class:`Run`), the stop policy, and ``run()``: the whole run, the fetch loop
beside the side duties. The duties themselves are small classes over that state, one per
concern: :class:`~._fetch.Fetcher` (what to claim, and when), and in :mod:`._duties` the
completer, the heartbeat, presence, the listener and the maintenance. Supervision is in
:mod:`._supervise`, health as data in :mod:`._vitals`, the retry policy for database errors
in :mod:`._outage`.

The core does no I/O and never waits. Its loops (the fetch loop and the side duties) are
generators that *yield steps*: "run this statement function on the claim connection",
"sleep until woken or 0.4 s", "give me the next batch of outcomes". A driver
(:mod:`.threaded` or :mod:`.aio`) carries each step out in its own way (blocking calls in
threads, or awaits on an event loop) and sends the result back in, or throws the error
in. So what to claim, when to sleep, how long to back off, which jobs were lost, what a
timeout means, what to hand back at shutdown: all of it lives here, and the two workers
cannot drift apart. A driver keeps only how it waits, how it runs a handler, and how it
stops.

The statement functions the steps name are in :mod:`._statements`; they take a plain
``Connection``, and the asyncio driver runs them through ``AsyncConnection.run_sync``
(SQLAlchemy's own bridge, and the same greenlet switch that ``AsyncConnection.execute``
makes anyway).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._queries import interval
from .._settle import format_error, worker_name
from .._storable import known_encodings
from ..errors import (
    ResultError,
    WorkerError,
    conflicted,
    describe,
    print_unlogged,
    unreachable,
)
from ..steps import Suspended
from . import _statements as statements
from . import _supervise as supervise
from ._duties import Completer, Heartbeat, Listener, Maintenance, Presence
from ._fetch import Fetcher
from ._hearing import ListenWatch
from ._outage import (
    MAX_DUTY_FAILURES,
    POOLING_ADVICE,
    is_database_error,
    lost_prepared_statement,
)
from ._steps import (
    CallHandler,
    Commit,
    Conn,
    Driver,
    Duty,
    EndDuties,
    Io,
    OnSession,
    Rollback,
    StartDuties,
    Step,
    Steps,
    WaitIdle,
)
from ._vitals import Health, diagnose
from .job import (
    ClaimedJob,
    Outcome,
    OutcomeKind,
    decode_rows,
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
)
from .settings import WorkerSettings, check_queue_name

if TYPE_CHECKING:
    import contextvars

    from .._tasks import Task
    from ..events import RunHook
    from ..tasks import Jobs

__all__ = ["Driver", "Health", "WorkerCore"]

log = logging.getLogger("sqla_jobs.worker")


#: The most of an error's text that the line about a run carries. ``last_error`` keeps
#: 64 KiB; a line is cut shorter, under the smallest line that log shippers take whole
#: (16 KiB), as a handler may put a whole payload in its error's message.
LOG_ERROR_CHARS = 8 * 1024


def quietly(call: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """``call(*args, **kwargs)`` (a log line, or an event), letting no error of it out.

    What a run's log lines and events say must never change what the run did: a log
    handler that raised (a log shipper whose endpoint is down) on a success line once
    failed the finished job and ran it again, and on a timeout's line left the job
    ``running``, its outcome never written. The error is printed to stderr as
    :mod:`logging` prints its own handlers' errors (``logging.raiseExceptions``), since
    the logging that would report it is what failed."""
    try:
        call(*args, **kwargs)
    except Exception:
        unlogged()


def unlogged() -> None:
    """Print the error being handled, that of a log line or an event (see :func:`quietly`)."""
    print_unlogged("a log line or an event about a job failed")


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


#: SQLSTATEs of a database the worker cannot work with whatever it waits for: a privilege
#: the role lacks, a table, column or function that is not there.
_MISCONFIGURED = frozenset({"42501", "42P01", "42703", "42883"})


def misconfigured(exc: BaseException) -> bool:
    """A privilege the role lacks, a table, column or function that is not there: no
    waiting mends it, but a migration or a grant does."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) in _MISCONFIGURED


def _unreached(exc: BaseException) -> bool:
    """No server answered: the connection could not be made (no SQLSTATE)."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) is None


#: When a transactional run that met another transaction in the worker's own statements
#: runs again (see :meth:`Run.conflicted`): at once. A serialization failure or a deadlock
#: is raised only once the other transaction has ended (or, in a deadlock, this one was
#: the one given up), so the next run's snapshot reads past it; the claim that takes the
#: job again spaces the runs anyway. A delay would also leave the job ``scheduled`` at
#: the end of a ``run_until_empty`` without ``wait_scheduled``. A claim a stalled worker
#: sends back uncalled (see :meth:`Run.stalled`) is due at once too.
CONFLICT_DELAY = 0.0

#: A job this worker ran again uncounted this many times (conflicts, stalls) is run again
#: after a growing delay from then on (see :meth:`WorkerCore.again_delay`): a conflict or
#: a stall that came back every time made the job spin, claimed, sent back and claimed
#: again at once, a WARNING each time, for as long as it lasted. Its attempts are still
#: not counted: a run that met another transaction did nothing wrong, and under heavy
#: contention (the parents of a big fan-in completing together) it may meet several.
AGAIN_AT_ONCE = 3
#: The delay's first step and its cap, seconds.
AGAIN_BACKOFF: tuple[float, float] = (0.05, 5.0)
#: How many jobs' counts a worker keeps (the oldest are forgotten first).
AGAIN_KEPT = 10_000


class RunConflict(Exception):
    """A transactional run's fence could not lock the job's row (see
    :class:`~._driver.Fence`): a serialization failure or a deadlock in the worker's own
    statement, raised in the handler's stead. The run wrote nothing, and is run again
    without counting an attempt."""

    def __init__(self, message: str, error: BaseException) -> None:
        super().__init__(message)
        #: The database error: the lock's serialization failure or deadlock.
        self.error = error


def _flush(session: Any) -> None:
    """The handler's pending writes, sent as the handler's own statements, before the
    job's completion (see :meth:`WorkerCore.transactional`)."""
    session.flush()


class WorkerCore:
    """The state of one worker and every decision about it."""

    #: For the duties, which cannot import this module (it imports them).
    quietly = staticmethod(quietly)

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
        #: The queues that share their claims between keys (``fair=True``): claimed by the
        #: fair statement, without a lock.
        self.fair = {q: limits for q in self.queues if (limits := jobs.limits(q)).fair}
        #: Set while the listener holds its LISTEN (tests and health checks wait on it).
        self.listening = threading.Event()
        #: Runs whose handler was called and has ended, whatever their outcome (or was
        #: cut off by a stop's grace period: counted then). A claim settled before its
        #: handler was called (cancelled, handed back) is not a run: ``run_until_empty``
        #: said a job ran that never did.
        self.processed = 0
        #: Claims taken from the running set by a stop once its grace period was over
        #: (by ``id``: a handed-back job claimed again has the same key), whose handlers
        #: run on: their slots were given back and their runs counted by the shutdown,
        #: so :meth:`finished` does neither again. It did both when the abandoned thread
        #: returned, in whatever run was on then: that run started a slot short (none at
        #: ``concurrency=1``, and claimed nothing until then) and counted a run of the
        #: run before.
        self._cut_off: set[int] = set()
        #: Claims ended before their handler was called (cancelled before it started,
        #: stopped while its ``started`` listeners ran), by ``id``: not counted as runs.
        self._uncalled: set[int] = set()
        #: How many times each job (by id) was run again uncounted by this worker.
        self._agains: dict[int, int] = {}
        self.stopping = False
        #: A stop that asked for no grace period (``stop(now=True)``, a second stop
        #: signal, SIGQUIT): the shutdown cuts running handlers off at once.
        self.hurried = False
        #: Set once the shutdown began (see :meth:`shutdown`), until the run has ended.
        self.shutting_down = False
        self.until_empty = False
        #: Guards the running set, the slots and the counts: the fetch loop, the duties
        #: and the handlers may be threads.
        self._lock = threading.Lock()
        self._running: dict[tuple[int, int], ClaimedJob] = {}
        self._free = settings.concurrency
        self._unwritten = 0
        #: The claims whose outcome waits for the completer: the heartbeat renews their
        #: leases too, so that a write held up (a row another transaction holds locked, a
        #: database that refuses for a while) does not let them lapse, and the jobs run
        #: again, over and over, while their outcomes wait.
        self._pending: dict[tuple[int, int], ClaimedJob] = {}
        #: Outcomes decided by the heartbeat (timeouts), whose events the completer fires
        #: (:meth:`tell`): a listener is the application's code and may be slow (an error
        #: reporter's HTTP call), and on the heartbeat it held up every lease of the
        #: worker, which lapsed, and their jobs ran twice.
        self._untold: list[tuple[Outcome, float, BaseException | None]] = []
        #: A heartbeat is wanted now (a cancellation was heard, or a claim waits for a
        #: beat to start): set by the listener and :meth:`start`, cleared by the heartbeat.
        self._poked = False
        #: Whether the worker said that a pooler loses its prepared statements (once).
        self.pooling_said = False
        #: Whether the listener hears what it should (see :mod:`._hearing`); kept across
        #: runs, so that a deaf LISTEN is reported once.
        self.listen_watch = ListenWatch()
        #: Why the worker stopped on its own (a duty kept failing); raised by ``run()``.
        self.fatal: WorkerError | None = None
        #: Moves on as each run ends: a duty of a run that is over (one that was still
        #: connecting, or waiting for the pool, when the stop gave up on it) sees it and
        #: ends, rather than go on once ``stopping`` is reset for the next run (a
        #: listener held a LISTEN connection for good, a presence wrote its row again).
        self.generation = 0
        #: For health: per loop, since when it waits on which step (None: it ended).
        self._waiting: dict[str, tuple[float, Step | None]] = {}
        #: Since when outcomes wait with none written; since when the completer cannot
        #: reach the database.
        self._outcomes_since: float | None = None
        self._unreachable_since: float | None = None
        self._state = "starting"
        #: Runs in a row that the worker's own code failed around (see :meth:`crashed`).
        self._crashes = 0
        #: The duties, each over this shared state (see :mod:`._duties`, :mod:`._fetch`),
        #: by name and all together (:meth:`reset` resets every one).
        loops = (
            Maintenance(self),
            Fetcher(self),
            Completer(self),
            Heartbeat(self),
            Presence(self),
            Listener(self),
        )
        (
            self.maintenance,
            self.fetcher,
            self.completer,
            self.heartbeat,
            self.presence,
            self.listener,
        ) = loops
        self._loops: tuple[Duty, ...] = loops
        self.reset()

    def reset(self) -> None:
        """Fresh schedule state for a new run (a worker may be run more than once). A stop
        asked for before the run stands: the run then only starts and shuts down."""
        self.fatal = None
        self._saturated = False
        self._waiting.clear()  # cleared, not replaced: watched() holds this dict
        self._unreachable_since = None
        #: Claim-ahead (``settings.prefetch``): how many jobs past the free slots the next
        #: claim may take, and the room (free slots plus that) at which a finishing job
        #: wakes a fetch loop that had none. Estimated by the fetcher
        #: (:meth:`._fetch.Fetcher.estimate_ahead`).
        self._ahead = 0
        self._wake_at = 1
        for duty in self._loops:
            duty.reset()

    def reached(self) -> None:
        """For health: a statement went through, the database answers."""
        self._unreachable_since = None

    def note_unreachable(self, exc: BaseException) -> None:
        """For health: since when the database cannot be reached (a failure of another kind
        means it answers)."""
        if not unreachable(exc):
            self._unreachable_since = None
        elif self._unreachable_since is None:
            self._unreachable_since = time.monotonic()

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
                self._pending[outcome.job.key] = outcome.job
        for outcome in failures:
            # Recorded first: a log line or a listener that fails must not lose it.
            self.driver.record(outcome)
        for outcome in failures:
            quietly(
                job_log, logging.ERROR, outcome.job, "%s; it is dead", outcome.error, outcome="dead"
            )
            self.fire_outcome(outcome, 0.0, ValueError(outcome.error))

    def finished(self, job: ClaimedJob, outcome: Outcome | None) -> None:
        """A handler ended (or its task did). Frees the slot, and records the outcome
        unless the claim was settled meanwhile (timed out, cancelled, handed back, or
        committed by its transactional run)."""
        with self._lock:
            if self._running.get(job.key) is job:
                del self._running[job.key]
            if self._cut_off and id(job) in self._cut_off:
                self._cut_off.discard(id(job))  # its slot and its count are the shutdown's
                self._uncalled.discard(id(job))
            else:
                self._free += 1
                if self._uncalled and id(job) in self._uncalled:
                    self._uncalled.discard(id(job))
                else:
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
                self._pending[job.key] = job
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
            if self.stopping:
                # Told to stop: a claim that has not started is not started now, whatever
                # slot just freed; the shutdown hands it back with the other unstarted ones
                # (an executor that finished a job between stop() and the shutdown's hand-
                # back started the next one from its inbox).
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
            quietly(
                job_log,
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
            # for a slot): it is not run, and its slot frees with this outcome (not
            # counted as a run: see processed).
            self._uncalled.add(id(job))
            self.log_end(job, "cancelled", 0.0)
            quietly(self.jobs.events.fire, "cancelled", job, duration=0.0, reason=job.cancel_reason)
            return Outcome(OutcomeKind.SETTLED, job)
        task = self.jobs.tasks.get(job.task)
        if task is None:
            outcome = unknown_task(self.jobs, job, self.name)
            # Told as any other outcome: a job of a task no worker knows ends dead, and the
            # listeners (and the metrics) that count dead jobs must hear of it.
            self.fire_outcome(outcome, 0.0, LookupError(outcome.error))
            return outcome
        token = set_current(job)
        events = self.jobs.events
        run = job.run = Run(self, task, job, token)
        try:
            quietly(events.fire, "started", job)
            if events.run_hooks:
                run.enter_hooks(events.run_hooks)  # the app's context (around_run) may raise
            run.args, run.kwargs = task.call_args(job.args)
        except Exception as exc:  # that, or stored arguments that no longer fit the handler
            return run.end(exc)
        now = time.monotonic()
        if not job.is_cancelled and self.overdue(job, task, now):
            # Past its timeout already, in the started listeners or the run hooks, and
            # the heartbeat has not said so yet: an asyncio worker's heartbeat waits for
            # the loop these blocked, and a thread's may beat later. The run times out
            # here, its handler uncalled.
            with self._lock:
                overdue = self._running.get(job.key) is job and self.overdue(job, task, now)
                if overdue:
                    self.settle_timed_out(job, now)
            if overdue:
                self.tell_timed_out(job, task, now, interrupt=False)
        # A bool read needs no lock (as in end()): a timeout that settles the claim after
        # this is one of a running handler, which it is told of.
        if job.settled or job.is_cancelled:
            # Timed out, cancelled, or lost while the started listeners or the run hooks
            # ran (an app context waiting for a pool; the timeout counts them): the handler
            # must not run. Its attempt may be recorded and its retry running elsewhere:
            # called now, it did the job's work twice.
            return run.unstarted()
        if job.renewed != 0.0 and now - job.renewed > self.settings.lease / 2:
            # The rule this method applies before the hooks (see its docstring), once more
            # now that they have run: they held the worker itself past half a lease since
            # its last renewal (an asyncio worker's loop blocked by a synchronous listener
            # or hook, or the process paused in them). The lease may have lapsed and the job
            # run elsewhere already: this claim goes back uncalled, its attempt not counted.
            return run.stalled()
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
        quietly(
            log.error,
            "worker %s: job %s (%s): the worker failed around its run; the run counts as "
            "failed: %s",
            self.name,
            job.id,
            job.task,
            describe(exc),
            exc_info=exc,
        )
        self.fire_outcome(outcome, 0.0, exc)
        if crashes >= MAX_DUTY_FAILURES and self.fatal is None:
            quietly(
                log.critical,
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
        """The outcome of a run, with its events fired and its line logged. The outcome is
        decided first, and neither a log handler nor a listener that fails changes it
        (see :func:`quietly`)."""
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
            try:  # quietly(), inline: every job passes here
                self.jobs.events.fire("succeeded", job, duration=duration)
            except Exception:
                unlogged()
            return outcome
        outcome = outcome_of(task, job, error)
        duration = time.monotonic() - job.started
        name = outcome_name(outcome)
        # A cheap test first (where job lines are off, most runs log nothing), at the
        # line's own level: a dead job's WARNING is written where INFO is not.
        if log.isEnabledFor(self.end_level(name)):
            self.log_end(job, name, duration, outcome, error)
        if name == "cancelled":
            quietly(
                self.jobs.events.fire, "cancelled", job, duration=duration, reason=job.cancel_reason
            )
        else:
            self.fire_outcome(outcome, duration, error)
        return outcome

    def end_level(self, name: str) -> int:
        """The level of the line about a run that ended ``name``: successes and snoozes
        are INFO, or DEBUG without ``log_jobs``; failures are always logged, a dead job as
        a WARNING."""
        if name in ("succeeded", "snoozed"):
            return logging.INFO if self.settings.log_jobs else logging.DEBUG
        return logging.WARNING if name == "dead" else logging.INFO

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
        without any SQL statement, cut at :data:`LOG_ERROR_CHARS`), at
        :meth:`end_level`. Never raises: a log handler that fails changes no outcome."""
        if level is None:
            level = self.end_level(name)
        if log.isEnabledFor(level):
            try:  # quietly(), inline: most jobs pass here
                self._log_end(level, job, name, duration, outcome, error)
            except Exception:
                unlogged()

    def _log_end(
        self,
        level: int,
        job: ClaimedJob,
        name: str,
        duration: float,
        outcome: Outcome | None,
        error: BaseException | None,
    ) -> None:
        # A snooze is raised, but it is no error.
        why = describe(error) if error is not None and name != "snoozed" else None
        if why is not None:
            if len(why) > LOG_ERROR_CHARS:
                why = why[: LOG_ERROR_CHARS - 14] + " [truncated]"
            if "\x00" in why or not why.isascii():
                # Escaped as last_error keeps them: a lone surrogate made every handler
                # that writes UTF-8 (a file, a stream, a shipper) fail on the line.
                why = why.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00")
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

    def fire_outcome(self, outcome: Outcome, duration: float, error: BaseException | None) -> None:
        """Fire the events of ``outcome``; never raises (see :func:`quietly`)."""
        quietly(self._fire_outcome, outcome, duration, error)

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

    @staticmethod
    def overdue(job: ClaimedJob, task: Task[Any, Any], now: float) -> bool:
        """The run of ``job`` has started and is past its task's timeout, and nothing has
        settled its claim yet (the heartbeat's test, and :meth:`start`'s)."""
        return (
            task.timeout is not None
            and job.started != 0.0
            and not job.settled
            and now - job.started > task.timeout
        )

    def settle_timed_out(self, job: ClaimedJob, now: float) -> None:
        """``job`` ran past its task's timeout: its claim is settled (the lease no longer
        extended, its outcome about to be recorded). Called with :attr:`_lock` held, by the
        heartbeat for a running handler and by :meth:`start` for one not yet called."""
        del self._running[job.key]
        job.settled = True
        if not self._unwritten:
            self._outcomes_since = now
        self._unwritten += 1
        self._pending[job.key] = job

    def tell_timed_out(
        self, job: ClaimedJob, task: Task[Any, Any], now: float, *, interrupt: bool
    ) -> None:
        """Record the failure of a claim :meth:`settle_timed_out` settled, and, if its
        handler runs (``interrupt``), stop it. The outcome is recorded before anything is
        said about it: a log handler that failed on the line once left it unwritten and the
        job ``running``, its lease extended for as long as the worker lived. Its events
        are fired by the completer (:meth:`tell_later`)."""
        job.cancel(f"timed out after {task.timeout}s")
        outcome = timed_out(task, job)
        error = TimeoutError((outcome.error or "").removeprefix("TimeoutError: "))
        duration = now - job.started
        self.tell_later(outcome, duration, error)
        self.driver.record(outcome)
        if interrupt:
            self.driver.interrupt(job)
        name = "dead" if outcome.dead else "retried"
        self.log_end(job, name, duration, outcome, error, level=logging.WARNING)

    def tell_later(self, outcome: Outcome, duration: float, error: BaseException | None) -> None:
        """Have the completer fire the events of ``outcome`` (see :attr:`_untold`); called
        before the outcome is recorded, so that its batch finds them."""
        with self._lock:
            self._untold.append((outcome, duration, error))

    def tell(self) -> None:
        """Fire the events that :meth:`tell_later` left (the completer does, off the
        heartbeat)."""
        if not self._untold:
            return
        with self._lock:
            untold, self._untold = self._untold, []
        for outcome, duration, error in untold:
            self.fire_outcome(outcome, duration, error)

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

        A serialization failure or a deadlock in the worker's own statements (the fence's
        lock, the completion and the release of the children, the COMMIT) wrote nothing
        and is not the handler's: the job runs again, the attempt not counted
        (:meth:`Run.conflicted`). The handler's own statements, its pending writes flushed
        before the completion included, fail the run as any error of the handler does.
        A run that ends without committing keeps its lease until its outcome is written
        (:meth:`keep_lease`).
        """
        job = run.job
        try:
            value = yield CallHandler()
            yield OnSession(_flush, ())  # its pending writes: a failure there is its own
        except BaseException as exc:  # the handler's own, or its fence's (RunConflict)
            yield Rollback()
            yield from self.keep_lease(job)
            if isinstance(exc, RunConflict):
                return run.conflicted(exc)
            return run.end(exc)
        try:
            done = yield OnSession(statements.complete_in, (self.queries, job, value))
        except BaseException as exc:
            yield Rollback()
            yield from self.keep_lease(job)
            return run.conflicted(exc) if conflicted(exc) else run.end(exc)
        if not done:
            yield Rollback()
            return run.lost()
        if not self.settle(job):
            yield Rollback()  # timed out or handed back meanwhile: that decision stands
            yield from self.keep_lease(job)
            return run.end(None)
        try:
            yield Commit()
        except BaseException as exc:
            self.unsettle(job)
            yield from self.keep_lease(job)
            return run.conflicted(exc) if conflicted(exc) else run.end(exc)
        self.presence.count({job.queue: [1, 0, 0]})
        return run.committed()

    def keep_lease(self, job: ClaimedJob) -> Steps:
        """Renew the lease of a transactional run that ends without committing, once its
        transaction has rolled back, before its outcome is recorded.

        Under a snapshot isolation the run held its job's row locked (see
        :class:`~._driver.Fence`), and the heartbeat passed the row by: a run longer than
        its lease left ``locked_until`` in the past. The rollback unlocked the row, and
        until the completer wrote the outcome any worker's rescue took the job back to
        ``ready``: the outcome's write then matched nothing, and a job that had failed for
        good, or snoozed, or was to wait for its retry's backoff, ran again at once.
        Renewed here, the claim holds until its outcome is written. A rescue that comes
        between the rollback and this renewal (one round trip) still takes it. Runs
        shorter than a third of a lease skip this: the lease they found has that left."""
        if job.is_cancelled or time.monotonic() - job.started < self.settings.lease / 3:
            return
        sent = time.monotonic()
        try:
            kept = yield Io(statements.beat, (self.queries, [job], self.lease), Conn.TX)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            quietly(
                job_log,
                logging.WARNING,
                job,
                "could not renew its lease before its outcome is written: %s",
                describe(exc),
            )
            return
        if job.key in kept:
            job.renewed = max(job.renewed, sent)

    # -- side duties -------------------------------------------------------------------

    def duties(self, *, listen: bool) -> dict[str, Callable[[], Steps]]:
        """The named side duties a worker runs beside its fetch loop, each a ``run_once``."""
        duties: dict[str, Callable[[], Steps]] = {
            "completer": self.completer.run_once,
            "heartbeat": self.heartbeat.run_once,
            "presence": self.presence.run_once,
        }
        if listen:
            duties["listener"] = self.listener.run_once
        return duties

    def maintain(self) -> Steps:
        """Run the maintenance now, whatever its schedule says."""
        return self.maintenance.now()

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
                    lambda: self.fetcher.fetch(wait_scheduled=wait_scheduled, deadline=deadline),
                )
            finally:
                self.driver.stop()
                yield from self.shutdown()
                yield EndDuties()
                # After the duties ended: no presence update can follow the row's deletion.
                yield from self.presence.leave()
                log.info("worker %s stopped", self.name)
        finally:
            # Ready for another run, a start that failed too (it kept the stop, and the
            # next run of a sharded worker, restarting it, ended at once).
            self.generation += 1
            self.stopping = self.shutting_down = self.hurried = False
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
        return supervise.supervised(self, name, run_once or self.duties(listen=True)[name])

    def supervise(self, name: str, failures: int, exc: BaseException) -> float:
        """A duty raised: how long to wait before running it again (see
        :func:`._supervise.supervise`); raises WorkerError to stop the worker."""
        return supervise.supervise(self, name, failures, exc)

    # -- health ------------------------------------------------------------------------

    def watched(self, name: str, steps: Steps) -> Steps:
        """``yield from steps``, noting for :meth:`health` which step the loop ``name``
        waits on, and since when."""
        return supervise.watched(self._waiting, name, steps)

    def health(self, now: float | None = None) -> Health:
        """Whether this worker is alive and doing its work, and if not, why (see
        :func:`._vitals.diagnose`)."""
        return diagnose(self, now)

    def check_result(self, result: str) -> None:
        """Raise :class:`~sqla_jobs.ResultError` if the worker's connections cannot carry
        the kept result ``result`` (JSON): a LATIN1 database or a WIN1252 client, as
        learnt at the start (``statements.sync_schedules``). Checked as the run ends, the
        run fails with its events saying so; found only when the outcome was written, it
        failed there after its events had said it succeeded."""
        engine = getattr(self.driver, "engine", None)
        engine = getattr(engine, "sync_engine", engine)  # an AsyncEngine's
        encodings = known_encodings(engine)[1] if engine is not None else None
        error = None if encodings is None else encodings.result_error(result)
        if error is not None:
            raise error

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

    # -- starting and stopping ---------------------------------------------------------

    def starting(self) -> Steps:
        """Before the first claim: make the code-declared schedules' rows match the code
        (``statements.sync_schedules``). A database it cannot reach, a role that lacks a
        privilege on the tables, or tables that are not there, stop the start here with
        that error (a sharded worker starts that shard's worker again later, as a
        process supervisor does a process). Any other error of a database it reached (its
        backend terminated mid-sync), or a schedule's row locked past the sync's bound,
        leaves the sync to the maintenance passes, which retry it as they retry
        anything: it once ended ``Worker.run`` with the error, or kept a starting worker
        from claiming while another worker held a row."""
        try:
            synced = yield Io(statements.sync_schedules, (self.jobs,), Conn.TX)
        except Exception as exc:
            if not is_database_error(exc) or misconfigured(exc) or _unreached(exc):
                raise
            log.warning(
                "worker %s: the declared schedules will be synced by the maintenance: %s",
                self.name,
                describe(exc),
            )
            synced = False
        self.maintenance.synced = synced
        log.info(
            "worker %s started: queues %s, concurrency %d",
            self.name,
            self.queues,
            self.settings.concurrency,
        )

    def again_delay(self, job: ClaimedJob) -> float:
        """The delay of a job sent back uncounted now (see :data:`AGAIN_AT_ONCE`): none for
        its first few, then doubling from ``AGAIN_BACKOFF[0]`` up to ``AGAIN_BACKOFF[1]``.
        Counted per worker, for the life of the worker (the oldest counts are forgotten
        past :data:`AGAIN_KEPT` jobs)."""
        with self._lock:
            agains = self._agains
            n = agains.pop(job.id, 0) + 1
            agains[job.id] = n  # the newest last: dicts keep insertion order
            if len(agains) > AGAIN_KEPT:
                del agains[next(iter(agains))]
        if n <= AGAIN_AT_ONCE:
            return CONFLICT_DELAY
        first, cap = AGAIN_BACKOFF
        return min(cap, first * 2.0 ** (n - AGAIN_AT_ONCE - 1))

    def signalled(self, name: str, what: str = "stopping", *, now: bool = False) -> None:
        """Log stop signal ``name`` and ``what`` it does (a WARNING when it stops ``now``)."""
        level = logging.WARNING if now else logging.INFO
        log.log(level, "worker %s: received %s, %s", self.name, name, what)

    def shutdown(self) -> Steps:
        """The one stop policy: hand back claims that never started (at once), give running
        handlers the grace period, then stop the ones still running and hand them back too.
        A handed-back job is ready again at once (the claim not counted) and its queue's
        workers are woken.

        Once it began (:attr:`shutting_down`), the asyncio driver takes a further cancel
        of its task to mean "the grace period is over": the wait it lands in ends, and the
        rest of this, the hand-back and the end of the duties, still happens.

        A hurried stop (:attr:`hurried`, before or during the wait) ends the grace period
        at once: both drivers' :class:`WaitIdle` ends when it is set."""
        self.stopping = self.shutting_down = True
        self.driver.wake()
        unstarted = self._take(lambda j: not j.started)
        with self._lock:
            self._free += len(unstarted)
        if unstarted:
            yield from self._hand_back(unstarted, "unstarted")
        if (yield WaitIdle(0.0 if self.hurried else self.settings.grace_period)):
            return
        late = self._take(lambda j: True)
        with self._lock:
            # Given back now: a thread cannot be stopped, and its run may end in the next
            # run, or never (see _cut_off). One that had started counts as a run (the
            # asyncio worker's cancelled task ends within this run and counted it too).
            self._free += len(late)
            started = [job for job in late if job.started]
            self.processed += len(started)
            self._cut_off.update(id(job) for job in started)
        why = "worker stopping now" if self.hurried else "worker stopping: grace period over"
        for job in late:
            job.cancel(why)
            self.driver.interrupt(job)
            self.log_end(job, "cancelled", time.monotonic() - job.started if job.started else 0.0)
            quietly(self.jobs.events.fire, "cancelled", job, reason=job.cancel_reason)
        if late:
            yield from self._hand_back(
                late, "cut off by a stop now" if self.hurried else "cut off by the grace period"
            )
            # Cancelled tasks end at once (given the loop a moment, hurried or not); threads
            # cannot be made to.
            yield WaitIdle(1.0, hurry=False)

    def _hand_back(self, claims: list[ClaimedJob], what: str) -> Steps:
        try:
            count = yield Io(statements.hand_back, (self.queries, claims), Conn.TX)
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


class StepHost:
    """What a durable run's step runner asks of the worker (:class:`sqla_jobs.steps.Host`)
    for one claim."""

    __slots__ = ("core", "job")

    def __init__(self, core: WorkerCore, job: ClaimedJob) -> None:
        self.core, self.job = core, job

    def settle(self) -> bool:
        return self.core.settle(self.job)

    def unsettle(self) -> None:
        self.core.unsettle(self.job)

    def lost(self, reason: str) -> None:
        self.job.cancel(f"lease lost, or cancelled: {reason}")


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
        if isinstance(error, Suspended):
            self.outcome = self.suspended(error)
            return True
        result: str | None = None
        if error is None and keeps(self.job) is not None:
            try:
                result = result_json(self.value)
                if not result.isascii():
                    self.core.check_result(result)
            except ResultError as exc:
                error, result = exc, None
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
                quietly(log.exception, "run hook %r failed to enter", hook)

    def _exit_hooks(self, outcome: str, error: BaseException | None) -> None:
        hooks, self.hooks = self.hooks, ()
        for hook, state in reversed(hooks):
            try:
                hook.exit(self.job, state, outcome, error)
            except Exception:
                quietly(log.exception, "run hook %r failed to exit", hook)

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
        """The handler is done (``error`` is what it raised, if anything). The run hooks
        are exited whatever happens here (a hook's span ended, its context detached): if
        the worker's own code fails, as a failure."""
        self._close()
        name = "failed"
        try:
            outcome = self.core.end(self.task, self.job, error)
            name = outcome_name(outcome)
        finally:
            if self.hooks:
                self._exit_hooks(name, error)
        return outcome

    def unstarted(self) -> Outcome:
        """Told to stop while its started listeners or run hooks ran, before the handler
        was called (see :meth:`WorkerCore.start`): the handler is not called. A timed-out
        run's outcome is the heartbeat's, told already; any other is told as cancelled,
        as a claim cancelled before it started is."""
        self._close()
        job = self.job
        self.core._uncalled.add(id(job))  # not a run (see WorkerCore.processed)
        duration = time.monotonic() - job.started
        if job.settled:
            return self._cancelled(duration, told=True)
        self.core.log_end(job, "cancelled", duration)
        return self._cancelled(duration)

    def stalled(self) -> Outcome:
        """The started listeners or run hooks held the worker past half a lease since the
        claim was last renewed (see :meth:`WorkerCore.start`): the handler is not called,
        and the job runs again, the attempt not counted (:meth:`_again`). The completer's
        write is guarded by the claim, so where the lease lapsed meanwhile (the job
        rescued, or running in another worker) it changes nothing. The next claim runs
        the listeners and hooks again."""
        self._close()
        job = self.job
        self.core._uncalled.add(id(job))  # not a run (see WorkerCore.processed)
        stalled = time.monotonic() - job.renewed
        return self._again(
            f"the worker stalled {stalled:.1f}s since the claim's lease was last extended, "
            "in the started listeners or run hooks (a blocked event loop?), and did not "
            "call the handler"
        )

    def _again(self, reason: str) -> Outcome:
        """The run ends snoozed (its attempt not counted), for a ``reason`` that is not the
        handler's: due at once, or after a growing delay once this worker sent the job
        back a few times (:meth:`WorkerCore.again_delay`); said at WARNING, told to the
        ``snoozed`` listeners, kept in the job's ``last_error``; the run hooks are exited
        whatever happens."""
        job = self.job
        outcome = Outcome(
            OutcomeKind.SNOOZED,
            job,
            error=f"run again, the attempt not counted: {reason}",
            delay=self.core.again_delay(job),
        )
        try:
            duration = time.monotonic() - job.started
            quietly(
                job_log,
                logging.WARNING,
                job,
                "%s: run again, the attempt not counted",
                reason,
                outcome="snoozed",
                duration=round(duration, 6),
            )
            quietly(self.core.jobs.events.fire, "snoozed", job, duration=duration, reason=reason)
        finally:
            if self.hooks:
                self._exit_hooks("snoozed", None)
        return outcome

    def _cancelled(self, duration: float, *, told: bool = False) -> Outcome:
        """The run ended cancelled, its line logged: the ``cancelled`` listeners hear of
        it (unless ``told`` already), and the run hooks are exited whatever they do."""
        try:
            if not told:
                quietly(
                    self.core.jobs.events.fire,
                    "cancelled",
                    self.job,
                    duration=duration,
                    reason=self.job.cancel_reason,
                )
        finally:
            if self.hooks:
                self._exit_hooks("cancelled", None)
        return Outcome(OutcomeKind.SETTLED, self.job)

    def committed(self) -> Outcome:
        """A transactional run committed its writes with its completion: nothing is left
        to record."""
        self._close()
        core = self.core
        if core._crashes:
            core._crashes = 0
        try:
            duration = time.monotonic() - self.job.started
            core.log_end(self.job, "succeeded", duration)
            quietly(core.jobs.events.fire, "succeeded", self.job, duration=duration)
        finally:
            if self.hooks:
                self._exit_hooks("succeeded", None)
        return Outcome(OutcomeKind.SETTLED, self.job)

    def suspended(self, how: Suspended) -> Outcome:
        """A durable run's sleep or wait committed the job's suspension (back to
        ``scheduled``, the attempt not counted): nothing is left to record. Told as a
        snooze to the events and the run hooks: the job runs again later."""
        self._close()
        core, job = self.core, self.job
        if core._crashes:
            core._crashes = 0
        try:
            duration = time.monotonic() - job.started
            until = "a signal" if how.until is None else how.until.isoformat(timespec="seconds")
            reason = f"{how.kind} {how.name!r} until {until}"
            level = core.end_level("snoozed")
            quietly(job_log, level, job, "suspended: %s", reason, outcome="snoozed")
            quietly(core.jobs.events.fire, "snoozed", job, duration=duration, reason=reason)
        finally:
            if self.hooks:
                self._exit_hooks("snoozed", None)
        return Outcome(OutcomeKind.SETTLED, job)

    def conflicted(self, error: BaseException) -> Outcome:
        """A transactional run's transaction met another's in the worker's own statements
        (its fence's lock, its completion and the release of its children, its COMMIT):
        a serialization failure or a deadlock (see :func:`sqla_jobs.errors.conflicted`).
        It wrote nothing, and it is not the handler's failure: the job runs again, the
        attempt not counted (snoozed, due at once: the transaction it met has ended, and
        the next run's reads past it). Told as a snooze, at WARNING with why."""
        job = self.job
        if job.settled or job.is_cancelled:  # timed out, handed back, lost: that stands
            return self.end(error)
        self._close()
        core = self.core
        if core._crashes:
            core._crashes = 0
        why = describe(error.error if isinstance(error, RunConflict) else error)
        return self._again(f"its transaction met another's in the worker's own statements ({why})")

    def lost(self) -> Outcome:
        """A transactional run's guarded completion matched no row: the claim was lost
        (the lease passed, or the job was cancelled), and its writes were rolled back."""
        self._close()
        job = self.job
        duration = time.monotonic() - job.started
        job.cancel("lease lost, or cancelled: this claim is no longer this worker's")
        quietly(
            job_log,
            logging.WARNING,
            job,
            "claim lost; its writes were rolled back",
            outcome="cancelled",
            duration=round(duration, 6),
        )
        return self._cancelled(duration)

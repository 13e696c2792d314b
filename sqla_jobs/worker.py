"""The threaded worker: claim, run, complete, and stay out of its own way.

.. code-block:: python

    worker = Worker(jobs, engine, queues=["previews", "webhooks"], concurrency=16)
    worker.run()              # until SIGINT/SIGTERM or worker.stop()
    worker.run_until_empty()  # tests and scripts: until no ready job is left

Inside, a handful of threads, each with one duty:

* the **fetch loop** (the thread that calls ``run``) claims as many jobs as there are free
  slots, in one statement per queue, and hands them to the executors. It also promotes
  due scheduled jobs and rescues expired leases now and then. With nothing to do it
  sleeps until a NOTIFY, a freed slot, the next due ``run_at`` or the poll interval;
* ``concurrency`` **executor** threads run handlers, outside any transaction;
* the **completer** writes outcomes in batches: one guarded statement completes many jobs;
* the **heartbeat** extends the leases of all running jobs in one statement, so a slow
  job is never taken by another worker while this one is alive;
* the **listener** holds a dedicated connection that LISTENs for the table's channel.

Delivery is at least once: a worker that dies mid-job (or before its batched completion
reaches the database) loses its lease, and the job runs again. Handlers must be safe to
repeat; transactional tasks get exactly-once database effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import queue as queue_mod
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import FrameType
from typing import Any

import sqlalchemy as sa

from .errors import PermanentError, Snooze
from .queries import interval
from .tasks import Jobs, Task

__all__ = ["ClaimedJob", "Worker", "current_job"]

log = logging.getLogger("sqla_jobs.worker")

_MAX_ERROR_CHARS = 65536


@dataclass(eq=False)
class ClaimedJob:
    """A job as its worker holds it while it runs; see :func:`current_job`."""

    id: int
    queue: str
    task: str
    args: dict[str, Any]
    attempts: int
    max_attempts: int
    priority: int
    run_at: datetime
    created_at: datetime
    worker: str = ""
    #: Set when the worker learns that this claim is no longer its own (the lease was
    #: lost, or the job was cancelled). A long handler may check it and stop early.
    lost: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def is_last_attempt(self) -> bool:
        return self.attempts >= self.max_attempts


_current: contextvars.ContextVar[ClaimedJob] = contextvars.ContextVar("sqla_jobs_current_job")


def current_job() -> ClaimedJob:
    """The job the calling handler is running. Raises ``LookupError`` outside a handler."""
    return _current.get()


# Outcomes, as the executors hand them to the completer.
_OK, _FAIL, _SNOOZE = "ok", "fail", "snooze"


@dataclass(slots=True)
class _Outcome:
    kind: str
    job: ClaimedJob
    error: str | None = None
    delay: float = 0.0
    permanent: bool = False


def _url_engine(bind: sa.Engine | str) -> sa.Engine:
    if isinstance(bind, sa.Engine):
        return bind
    from .db import create_engine

    return create_engine(bind)


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _format_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (
        text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 20] + "\n[truncated]"
    )


class Worker:
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry.

    :param jobs: the registry: handlers and the jobs table.
    :param bind: an ``Engine`` or a database URL. The worker uses a few pooled
        connections (fetch, completer, heartbeat) and one dedicated LISTEN connection.
    :param queues: queues to serve; by default every queue a registered task names.
    :param concurrency: handlers running at once (threads).
    :param lease: seconds a claim is held without a heartbeat. The heartbeat renews it
        every third of that, so it only needs to outlast a stall of the worker itself.
    :param poll_interval: longest sleep between claims when no NOTIFY arrives.
    :param grace_period: on stop, seconds running handlers get to finish.
    :param claim_limit: most jobs one claim statement takes.
    :param listen: LISTEN for new jobs (turn off behind PgBouncer's transaction pooling).
    """

    def __init__(
        self,
        jobs: Jobs,
        bind: sa.Engine | str,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 10,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        grace_period: float = 30.0,
        claim_limit: int = 100,
        completion_batch: int = 200,
        completion_interval: float = 0.005,
        rescue_interval: float | None = None,
        listen: bool = True,
        name: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if lease <= 0 or poll_interval <= 0 or grace_period < 0:
            raise ValueError("lease and poll_interval must be > 0, grace_period >= 0")
        self.jobs = jobs
        self.engine = _url_engine(bind)
        names = (
            list(queues)
            if queues
            else sorted({t.queue for t in jobs.tasks.values()} or {jobs.default_queue})
        )
        for q in names:
            if not isinstance(q, str) or not q:
                raise ValueError(f"queue names must be non-empty strings, got {q!r}")
        self.queues: list[str] = names
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
        self.listen = listen
        self.name = name or _worker_name()
        self.q = jobs.queries

        self._lock = threading.Lock()
        self._free = concurrency
        self._running: dict[int, ClaimedJob] = {}
        self._inbox: queue_mod.SimpleQueue[ClaimedJob | None] = queue_mod.SimpleQueue()
        self._outbox: queue_mod.SimpleQueue[_Outcome | None] = queue_mod.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        #: Set while the listener holds its LISTEN (tests and health checks wait on it).
        self.listening = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unwritten = 0
        self._written = threading.Condition(self._lock)
        self._next_due: float | None = None
        self._next_promote = 0.0
        self._next_rescue = 0.0
        self._turn = 0
        self._paused: frozenset[str] = frozenset()
        self._more = False
        self._saturated = False
        self._until_empty = False
        #: Jobs this worker has finished running, whatever their outcome.
        self.processed = 0

    def __repr__(self) -> str:
        return f"<Worker {self.name} queues={self.queues} concurrency={self.concurrency}>"

    # -- public control -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: no new claims, then a graceful shutdown. Thread-safe."""
        self._stopping.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully."""
        with self._signals(install_signal_handlers), self._threads_running(listen=self.listen):
            self._loop(until_empty=False, wait_scheduled=0.0, deadline=None)

    def run_until_empty(self, *, wait_scheduled: float = 0.0, timeout: float | None = None) -> int:
        """Run until no job of these queues is ready; return how many jobs ran.

        :param wait_scheduled: also wait for scheduled jobs (delays, retries) that fall due
            within this many seconds.
        :param timeout: give up (and shut down gracefully) after this many seconds.
        """
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        self._until_empty = True
        try:
            with self._threads_running(listen=False):
                self._loop(until_empty=True, wait_scheduled=wait_scheduled, deadline=deadline)
        finally:
            self._until_empty = False
        return self.processed - before

    # -- the fetch loop -------------------------------------------------------------------

    def _loop(self, *, until_empty: bool, wait_scheduled: float, deadline: float | None) -> None:
        failures = 0
        while not self._stopping.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._wake.clear()
            try:
                self._maintain()
                self._claim_free_slots()
                failures = 0
            except sa.exc.DBAPIError as exc:
                failures += 1
                pause = min(30.0, 0.1 * 2**failures)
                log.warning(
                    "worker %s: database error, retrying in %.1fs: %s", self.name, pause, exc
                )
                self._stopping.wait(pause)
                continue
            if self._more:
                continue  # a queue gave all we asked for and slots are free: go again
            if until_empty and self._idle():
                # Outcomes may still be in flight (a retry not yet scheduled): write them,
                # promote what is due, and look once more before calling it empty.
                self._wait_written()
                self._next_promote = 0.0
                try:
                    self._maintain()
                    if self._claim_free_slots() or self._more:
                        continue
                except sa.exc.DBAPIError:
                    continue
                if not self._due_soon(wait_scheduled):
                    break
            self._wake.wait(self._sleep_for())

    def _claim_free_slots(self) -> int:
        """Claim up to the free slots, queue by queue (starting from a rotating one).

        Sets ``_more`` when a queue gave as many jobs as asked while slots are still free
        (there may be more right now), and ``_saturated`` when no slot is left (a finishing
        job must then wake the loop). Otherwise the queues are drained for the moment, and
        the loop can sleep until a NOTIFY, a due time or the poll interval.
        """
        self._more = False
        with self._lock:
            free = self._free
        if free <= 0:
            self._saturated = True
            return 0
        claimed: list[ClaimedJob] = []
        queues = [q for q in self.queues if q not in self._paused]
        if not queues:
            return 0
        n = len(queues)
        start = self._turn % n
        self._turn = start + 1
        with self.engine.begin() as conn:
            for i in range(n):
                want = min(free - len(claimed), self.claim_limit)
                if want <= 0:
                    break
                rows = conn.execute(
                    self.q.claim,
                    {
                        "queue_name": queues[(start + i) % n],
                        "limit": want,
                        "lease": interval(self.lease),
                        "worker": self.name,
                    },
                ).all()
                claimed.extend(
                    ClaimedJob(*row, worker=self.name)  # type: ignore[misc]
                    for row in rows
                )
                if len(rows) == want:
                    self._more = True
        # Only now, after COMMIT: a completion written before the claim is visible would
        # find the row still 'ready' and match nothing.
        if claimed:
            with self._lock:
                self._free -= len(claimed)
                self._saturated = self._free <= 0
                for job in claimed:
                    self._running[job.id] = job
            for job in claimed:
                self._inbox.put(job)
        return len(claimed)

    def _maintain(self) -> None:
        """Promote due scheduled jobs, rescue expired leases and read which queues are
        paused, when it is time to (every poll interval, or when a known due time passes)."""
        now = time.monotonic()
        promote = now >= self._next_promote or (
            self._next_due is not None and now >= self._next_due
        )
        rescue = now >= self._next_rescue
        if not (promote or rescue):
            return
        with self.engine.begin() as conn:
            if rescue:
                conn.execute(self.q.rescue, {"limit": 1000}).all()
                self._next_rescue = now + self.rescue_interval
            if promote:
                conn.execute(self.q.promote, {"limit": 1000}).all()
                self._paused = frozenset(conn.execute(self.q.paused).scalars())
                due_in = conn.execute(self.q.next_due).scalar()
                self._next_promote = now + self.poll_interval
                self._next_due = None if due_in is None else now + max(0.0, float(due_in))

    def _sleep_for(self) -> float:
        sleep = self.poll_interval
        if self._next_due is not None:
            sleep = min(sleep, max(0.0, self._next_due - time.monotonic()) + 0.001)
        return sleep

    def _idle(self) -> bool:
        with self._lock:
            return self._free == self.concurrency

    def _due_soon(self, within: float) -> bool:
        if within <= 0 or self._next_due is None:
            return False
        return self._next_due - time.monotonic() <= within

    # -- executors ------------------------------------------------------------------------

    def _executor(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            try:
                outcome = self._execute(job)
            except BaseException as exc:  # the worker itself must never die of a handler
                outcome = _Outcome(_FAIL, job, error=_format_error(exc))
            with self._lock:
                self._unwritten += 1
            self._outbox.put(outcome)
            with self._lock:
                self._free += 1
                self._running.pop(job.id, None)
                self.processed += 1
                wake = self._saturated or self._until_empty
                self._saturated = False
            if wake:
                self._wake.set()

    def _execute(self, job: ClaimedJob) -> _Outcome:
        task = self.jobs.tasks.get(job.task)
        if task is None:
            log.error("job %s: unknown task %r, failing it", job.id, job.task)
            return _Outcome(
                _FAIL,
                job,
                error=f"unknown task {job.task!r}: no handler of that name is registered "
                f"in the worker ({self.name})",
                delay=self.jobs.retry(job.attempts),
            )
        token = _current.set(job)
        started = time.monotonic()
        try:
            args, kwargs = task.call_args(job.args)
            if task.is_async:
                asyncio.run(task.fn(*args, **kwargs))
            else:
                task.fn(*args, **kwargs)
        except Snooze as snooze:
            return _Outcome(_SNOOZE, job, delay=snooze.delay)
        except PermanentError as exc:
            return _Outcome(_FAIL, job, error=_format_error(exc), permanent=True)
        except Exception as exc:
            log.info(
                "job %s (%s, queue %s) attempt %s/%s failed: %r",
                job.id,
                job.task,
                job.queue,
                job.attempts,
                job.max_attempts,
                exc,
            )
            return _Outcome(_FAIL, job, error=_format_error(exc), delay=_retry_delay(task, job))
        finally:
            _current.reset(token)
        log.debug("job %s (%s) done in %.3fs", job.id, job.task, time.monotonic() - started)
        return _Outcome(_OK, job)

    # -- completer ------------------------------------------------------------------------

    def _completer(self) -> None:
        done = False
        while not done:
            item = self._outbox.get()
            if item is None:
                break
            batch = [item]
            deadline = time.monotonic() + self.completion_interval
            while len(batch) < self.completion_batch:
                remaining = deadline - time.monotonic()
                try:
                    nxt = (
                        self._outbox.get(timeout=remaining)
                        if remaining > 0
                        else (self._outbox.get_nowait())
                    )
                except queue_mod.Empty:
                    break
                if nxt is None:
                    done = True
                    break
                batch.append(nxt)
            self._write_outcomes(batch)
            with self._lock:
                self._unwritten -= len(batch)
                self._written.notify_all()

    def _wait_written(self) -> None:
        with self._lock:
            self._written.wait_for(lambda: self._unwritten == 0)

    def _note_due(self, delay: float) -> None:
        """A retry or snooze was scheduled: make sure the fetch loop wakes for it."""
        due = time.monotonic() + delay
        if self._next_due is None or due < self._next_due:
            self._next_due = due

    def _write_outcomes(self, batch: list[_Outcome]) -> None:
        """Write a batch, retrying through database outages; never drops one silently."""
        failures = 0
        while True:
            try:
                with self.engine.begin() as conn:
                    ok = [o.job for o in batch if o.kind == _OK]
                    if ok:
                        conn.execute(
                            self.q.complete,
                            {"ids": [j.id for j in ok], "attempt_list": [j.attempts for j in ok]},
                        )
                    for o in batch:
                        if o.kind == _FAIL:
                            conn.execute(
                                self.q.fail,
                                {
                                    "job_id": o.job.id,
                                    "attempt": o.job.attempts,
                                    "error": o.error,
                                    "delay": interval(o.delay),
                                    "permanent": o.permanent,
                                },
                            )
                            self._note_due(o.delay)
                        elif o.kind == _SNOOZE:
                            conn.execute(
                                self.q.snooze,
                                {
                                    "job_id": o.job.id,
                                    "attempt": o.job.attempts,
                                    "delay": interval(o.delay),
                                },
                            )
                            self._note_due(o.delay)
                return
            except sa.exc.DBAPIError as exc:
                failures += 1
                if self._stopping.is_set() and failures > 5:
                    log.error(
                        "worker %s: could not record %d outcomes (%s); their jobs will run "
                        "again once their leases pass",
                        self.name,
                        len(batch),
                        exc,
                    )
                    return
                pause = min(10.0, 0.1 * 2**failures)
                log.warning(
                    "worker %s: completion failed, retrying in %.1fs: %s", self.name, pause, exc
                )
                time.sleep(pause)

    # -- heartbeat ------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        every = self.lease / 3
        while True:
            stopping = self._stopping.wait(every if not self._stopping.is_set() else 0.5)
            if stopping and not self._has_running():
                return
            self.beat()

    def _has_running(self) -> bool:
        with self._lock:
            return bool(self._running)

    def beat(self) -> None:
        """Extend the leases of every running job of this worker, in one statement."""
        with self._lock:
            running = list(self._running.values())
        if not running:
            return
        try:
            with self.engine.begin() as conn:
                kept = set(
                    conn.execute(
                        self.q.heartbeat,
                        {
                            "ids": [j.id for j in running],
                            "attempt_list": [j.attempts for j in running],
                            "lease": interval(self.lease),
                        },
                    ).scalars()
                )
        except sa.exc.DBAPIError as exc:
            log.warning("worker %s: heartbeat failed: %s", self.name, exc)
            return
        for job in running:
            if job.id not in kept and not job.lost.is_set():
                log.warning("job %s attempt %s: lease lost", job.id, job.attempts)
                job.lost.set()

    # -- listener -------------------------------------------------------------------------

    def _listener(self) -> None:
        failures = 0
        wanted = set(self.queues)
        while not self._stopping.is_set():
            try:
                # A connection of the engine's own (same URL, same connect args), taken
                # out of the pool for good: LISTEN belongs to one session.
                pooled = self.engine.raw_connection()
                conn = pooled.driver_connection
                pooled.detach()
                try:
                    conn.rollback()  # type: ignore[union-attr]
                    conn.autocommit = True  # type: ignore[union-attr]
                    conn.execute(  # type: ignore[union-attr]
                        f'LISTEN "{self.q.channel}"'
                    )
                    failures = 0
                    self.listening.set()
                    self._wake.set()  # catch anything enqueued while we were not listening
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=0.5):  # type: ignore[union-attr]
                            if note.payload in wanted:
                                self._wake.set()
                finally:
                    self.listening.clear()
                    with contextlib.suppress(Exception):
                        pooled.close()
                        conn.close()  # type: ignore[union-attr]
            except Exception as exc:
                failures += 1
                pause = min(30.0, 0.1 * 2**failures)
                log.warning(
                    "worker %s: listener error, reconnecting in %.1fs: %s", self.name, pause, exc
                )
                self._stopping.wait(pause)

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _threads_running(self, *, listen: bool) -> Iterator[None]:
        self._stopping.clear()
        self._threads = [
            self._start(self._executor, f"executor-{i}") for i in range(self.concurrency)
        ]
        completer = self._start(self._completer, "completer")
        heartbeat = self._start(self._heartbeat, "heartbeat")
        listener = self._start(self._listener, "listener") if listen else None
        log.info(
            "worker %s started: queues %s, concurrency %d", self.name, self.queues, self.concurrency
        )
        try:
            yield
        finally:
            self._stopping.set()
            self._shutdown()
            self._outbox.put(None)
            completer.join()
            heartbeat.join(timeout=1.0)
            if listener is not None:
                listener.join(timeout=2.0)
            log.info("worker %s stopped", self.name)

    def _start(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"sqla-jobs-{name}", daemon=True)
        thread.start()
        return thread

    def _shutdown(self) -> None:
        """Hand back jobs that never started, then give running ones the grace period."""
        unstarted: list[ClaimedJob] = []
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue_mod.Empty:
                break
            if job is not None:
                unstarted.append(job)
        if unstarted:
            with self._lock:
                for job in unstarted:
                    self._running.pop(job.id, None)
                    self._free += 1
            self._hand_back(unstarted)
        for _ in self._threads:
            self._inbox.put(None)
        deadline = time.monotonic() + self.grace_period
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        still = [t for t in self._threads if t.is_alive()]
        if still:
            log.warning(
                "worker %s: %d handlers still running after the %.0fs grace period; their "
                "jobs will be retried when their leases pass",
                self.name,
                len(still),
                self.grace_period,
            )

    def _hand_back(self, jobs: list[ClaimedJob]) -> None:
        try:
            with self.engine.begin() as conn:
                rows = conn.execute(
                    self.q.hand_back,
                    {"ids": [j.id for j in jobs], "attempt_list": [j.attempts for j in jobs]},
                ).all()
                for queue_name in {r.queue for r in rows}:
                    conn.execute(sa.select(sa.func.pg_notify(self.q.channel, queue_name)))
            log.info("worker %s: handed back %d unstarted jobs", self.name, len(rows))
        except sa.exc.DBAPIError as exc:
            log.warning(
                "worker %s: could not hand back %d jobs (%s); they will be retried "
                "when their leases pass",
                self.name,
                len(jobs),
                exc,
            )

    @contextlib.contextmanager
    def _signals(self, install: bool) -> Iterator[None]:
        if not install or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("worker %s: received %s, stopping", self.name, signal.Signals(signum).name)
            self.stop()

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _retry_delay(task: Task[Any, Any], job: ClaimedJob) -> float:
    try:
        return max(0.0, float(task.retry(job.attempts)))
    except Exception:
        log.exception("task %s: retry policy failed; retrying in 60s", task.name)
        return 60.0


def seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)

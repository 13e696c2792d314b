"""The threaded worker: claim, run, complete, and stay out of its own way.

.. code-block:: python

    worker = Worker(jobs, engine, queues=["previews", "webhooks"], concurrency=16)
    worker.run()              # until SIGINT/SIGTERM or worker.stop()
    worker.run_until_empty()  # tests and scripts: until no ready job is left

Inside, a handful of threads, each with one duty:

* the **fetch loop** (the thread that calls ``run``) claims as many jobs as there are free
  slots, in one statement per queue, and hands them to the executors. Every poll interval
  it also runs the shared maintenance (promote due jobs, rescue expired leases, cron
  ticks, pause state). With nothing to do it sleeps until a NOTIFY, a freed slot, the next
  due ``run_at`` or the poll interval;
* ``concurrency`` **executor** threads run handlers, outside any transaction;
* the **completer** writes outcomes in batches: one guarded statement completes many jobs;
* the **heartbeat** extends the leases of all running jobs in one statement, notices jobs
  that were cancelled or lost, and enforces task timeouts;
* the **listener** holds a dedicated connection that LISTENs on the table's channel.

Delivery is at least once: a worker that dies mid-job (or before its batched completion
reaches the database) loses its lease, and the job runs again. Handlers must be safe to
repeat. Transactional tasks get exactly-once database effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as queue_mod
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from . import maintenance, periodic
from ._base import WorkerBase
from .execution import (
    CANCEL_PAYLOAD,
    SETTLED,
    ClaimedJob,
    Outcome,
    complete_one_params,
    current_job,
    job_log,
    outcome_of,
    outcome_statements,
    reset_current,
    set_current,
    timed_out,
    unknown_task,
)
from .queries import batch_params
from .session import insert_pending
from .tasks import Jobs, Task

__all__ = ["CANCEL_PAYLOAD", "ClaimedJob", "Worker", "current_job"]

log = logging.getLogger("sqla_jobs.worker")


def _engine(bind: sa.Engine | str, concurrency: int) -> sa.Engine:
    if isinstance(bind, sa.Engine):
        return bind
    from .db import create_engine

    # Fetch, completer, heartbeat and maintenance each hold a connection briefly, and a
    # transactional task holds one while it runs.
    return create_engine(bind, pool_size=min(concurrency, 32) + 4)


class _HeldConnection:
    """A pooled connection that one worker thread keeps between statements, in autocommit.

    The claim and the batch completion are single statements, atomic by themselves.
    Through ``engine.begin()`` each one costs four round trips: the pool's pre-ping
    (``create_engine`` turns ``pool_pre_ping`` on), BEGIN, the statement, COMMIT. The
    fetch loop claims hundreds of times a second, so it keeps one connection in autocommit
    and pays one round trip per claim. After an error the connection is dropped and the
    next use takes a fresh one from the pool.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None

    def execute(self, statement: sa.Executable, params: dict[str, Any]) -> sa.CursorResult[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self._engine.connect().execution_options(
                isolation_level="AUTOCOMMIT"
            )
        try:
            return conn.execute(statement, params)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


class Worker(WorkerBase):
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry.

    :param jobs: the registry: handlers and the jobs table.
    :param bind: an ``Engine`` or a database URL. The worker uses a few pooled
        connections (fetch, completer, heartbeat) and one dedicated LISTEN connection.
    :param queues: queues to serve; by default every queue a registered task names.
    :param concurrency: handlers running at once (threads).
    :param lease: seconds a claim is held without a heartbeat. The heartbeat renews it
        every third of that, so it only has to outlast a stall of the worker itself.
    :param poll_interval: longest sleep between claims when no NOTIFY arrives; also how
        often maintenance runs.
    :param grace_period: on stop, seconds running handlers get to finish.
    :param claim_limit: most jobs one claim statement takes.
    :param completion_batch: most outcomes one completion transaction writes.
    :param completion_interval: seconds the completer waits to fill a batch.
    :param listen: LISTEN for new jobs (turn off behind PgBouncer's transaction pooling).
    :param prune_interval: seconds between retention passes (one elected worker prunes).
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
        completion_batch: int = 500,
        completion_interval: float = 0.005,
        rescue_interval: float | None = None,
        prune_interval: float = 60.0,
        listen: bool = True,
        name: str | None = None,
    ) -> None:
        super().__init__(
            jobs,
            queues=queues,
            concurrency=concurrency,
            lease=lease,
            poll_interval=poll_interval,
            grace_period=grace_period,
            claim_limit=claim_limit,
            completion_batch=completion_batch,
            completion_interval=completion_interval,
            rescue_interval=rescue_interval,
            prune_interval=prune_interval,
            listen=listen,
            name=name,
        )
        self.engine = _engine(bind, concurrency)
        self._claim_conn = _HeldConnection(self.engine)
        self._write_conn = _HeldConnection(self.engine)

        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._free = concurrency
        self._running: dict[int, ClaimedJob] = {}
        self._unwritten = 0
        self._inbox: queue_mod.SimpleQueue[ClaimedJob | None] = queue_mod.SimpleQueue()
        self._outbox: queue_mod.SimpleQueue[Outcome | None] = queue_mod.SimpleQueue()
        self._wake = threading.Event()
        self._beat_now = threading.Event()
        self._stopping = threading.Event()
        #: Set while the listener holds its LISTEN (tests and health checks wait on it).
        self.listening = threading.Event()
        self._executors: list[threading.Thread] = []
        self._until_empty = False
        self._last_beat = 0.0
        self._cancel_requested = False

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
        with self._signals(install_signal_handlers), self._threads(listen=self.listen):
            self._loop(wait_scheduled=0.0, deadline=None)

    def run_until_empty(self, *, wait_scheduled: float = 0.0, timeout: float | None = None) -> int:
        """Run until no job of these queues is ready or running here; return how many ran.

        :param wait_scheduled: also wait for scheduled jobs (delays, retries) that fall due
            within this many seconds.
        :param timeout: give up (and shut down gracefully) after this many seconds.
        """
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        self._until_empty = True
        try:
            with self._threads(listen=False):
                self._loop(wait_scheduled=wait_scheduled, deadline=deadline)
        finally:
            self._until_empty = False
        return self.processed - before

    # -- the fetch loop -------------------------------------------------------------------

    def _loop(self, *, wait_scheduled: float, deadline: float | None) -> None:
        failures = 0
        while not self._stopping.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._wake.clear()
            try:
                self._maintain()
                self._claim_free_slots()
                if not self._more and self._until_empty and self._idle():
                    # Outcomes may still be in flight (a retry not yet scheduled): write
                    # them, refresh, and look once more before calling it empty.
                    self._wait_written()
                    self._next_refresh = 0.0
                    self._maintain()
                    if not self._claim_free_slots() and not self._due_soon(wait_scheduled):
                        break
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
            self._wake.wait(self._sleep_for())

    def _claim_free_slots(self) -> int:
        """Claim up to the free slots, queue by queue (starting from a rotating one).

        Sets ``_more`` when a queue gave as many jobs as asked (there may be more right
        now), and ``_saturated`` when no slot is left (a finishing job must then wake the
        loop). Otherwise the queues are drained for the moment, and the loop can sleep
        until a NOTIFY, a due time or the poll interval.
        """
        self._more = False
        with self._lock:
            free = self._free
        if free <= 0:
            self._saturated = True
            return 0
        total = 0
        for queue in self._claim_order():
            want = min(free - total, self.claim_limit)
            if want <= 0:
                break
            # One statement in autocommit: it has committed when it returns. Only now may
            # the jobs start: a completion written before the claim is visible would find
            # the row still 'ready' and match nothing.
            rows = self._claim_conn.execute(self.q.claim, self._claim_params(queue, want)).all()
            if len(rows) == want:
                self._more = True
            if rows:
                self._dispatch([ClaimedJob(*row, worker=self.name) for row in rows])  # type: ignore[call-arg]
                total += len(rows)
        return total

    def _dispatch(self, claimed: list[ClaimedJob]) -> None:
        with self._lock:
            self._free -= len(claimed)
            self._saturated = self._free <= 0
            for job in claimed:
                self._running[job.id] = job
        for job in claimed:
            self._inbox.put(job)

    def _maintain(self) -> None:
        """Run the shared maintenance when it is due (see :meth:`WorkerBase._refresh_due`)."""
        refresh, rescue = self._refresh_due()
        if not refresh:
            return
        with self.engine.begin() as conn:
            result = maintenance.refresh(conn, self.q, rescue=rescue)
            periodic.enqueue_due(conn, self.jobs)
        if self._refreshed(result, rescue):
            pruned = maintenance.prune(self.engine, self.jobs)
            if pruned:
                log.info("worker %s: pruned %d finished jobs", self.name, pruned)

    def _idle(self) -> bool:
        with self._lock:
            return self._free == self.concurrency

    # -- executors ------------------------------------------------------------------------

    def _executor(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            try:
                outcome = self.execute(job)
            except BaseException as exc:  # the worker itself must never die of a handler
                task = self.jobs.tasks.get(job.task)
                outcome = (
                    outcome_of(task, job, exc) if task else unknown_task(self.jobs, job, self.name)
                )
            with self._lock:
                self._running.pop(job.id, None)
                self._free += 1
                self.processed += 1
                wake = self._saturated or self._until_empty
                self._saturated = False
                # A run that timed out or was cancelled already has its outcome written.
                record = outcome.kind != SETTLED and not job.is_cancelled
                if record:
                    self._unwritten += 1
            if record:
                self._outbox.put(outcome)
            if wake:
                self._wake.set()

    def execute(self, job: ClaimedJob, *, session: Session | None = None) -> Outcome:
        """Run one claimed job as this worker would, and say how it ended.

        Sets :func:`current_job`, fires the events, and maps exceptions to an outcome; the
        caller writes the outcome (the worker hands it to its completer). A transactional
        task runs in a session of the worker's that commits with the job's completion, or,
        given ``session`` (``sqla_jobs.testing`` does this inside a test's transaction), in
        that session behind a savepoint that a failure rolls back.
        """
        task = self.jobs.tasks.get(job.task)
        if task is None:
            return unknown_task(self.jobs, job, self.name)
        events = self.jobs.events
        token = set_current(job)
        job.started = time.monotonic()
        events.fire("started", job)
        error: BaseException | None = None
        try:
            args, kwargs = task.call_args(job.args)
            if task.transactional and session is not None:
                with session.begin_nested():
                    task.fn(*args, session=session, **kwargs)
                    session.flush()
                    insert_pending(session)
            elif task.transactional:
                return self._run_transactional(task, job, args, kwargs)
            elif task.is_async:
                asyncio.run(_with_timeout(task, task.fn(*args, **kwargs)))
            else:
                task.fn(*args, **kwargs)
        except BaseException as exc:
            error = exc
        finally:
            reset_current(token)
        return self._finished(task, job, error)

    def _run_transactional(
        self, task: Task[Any, Any], job: ClaimedJob, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Outcome:
        """The handler's writes and the job's completion, in one transaction.

        The completion is guarded by (id, attempts) like any other: if this claim was lost
        (the lease passed and another worker took the job), it matches no row, and the
        handler's writes roll back with it. Database effects happen exactly once.
        """
        with Session(self.engine) as session:
            try:
                task.fn(*args, session=session, **kwargs)
                done = session.execute(self.q.complete, complete_one_params(job)).first()
            except BaseException as exc:
                session.rollback()
                return self._finished(task, job, exc)
            if done is None:
                session.rollback()
                job_log(logging.WARNING, job, "claim lost; its writes were rolled back")
                job.cancel("lease lost: another worker owns this job")
                self._finished(task, job, None)
                return Outcome(SETTLED, job)
            session.commit()
        self._finished(task, job, None)
        return Outcome(SETTLED, job)

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
                        else self._outbox.get_nowait()
                    )
                except queue_mod.Empty:
                    break
                if nxt is None:
                    done = True
                    break
                batch.append(nxt)
            self._write(batch)
            with self._lock:
                self._unwritten -= len(batch)
                self._written.notify_all()

    def _wait_written(self) -> None:
        with self._lock:
            self._written.wait_for(lambda: self._unwritten == 0)

    def _write(self, batch: list[Outcome]) -> None:
        """Write a batch, retrying through database outages; never drops one silently."""
        statements = outcome_statements(self.q, batch)
        failures = 0
        while True:
            try:
                if len(statements) == 1:
                    # The common case, every job done: one statement, atomic by itself.
                    self._write_conn.execute(*statements[0])
                else:
                    with self.engine.begin() as conn:
                        for statement, params in statements:
                            conn.execute(statement, params)
                break
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
        self._note_due(batch)

    # -- heartbeat ------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        every = self.lease / 3
        while True:
            wait = min(every, 0.25)
            self._beat_now.wait(wait)
            self._beat_now.clear()
            if self._stopping.is_set() and not self._has_running():
                return
            self._enforce_timeouts()
            now = time.monotonic()
            if now - self._last_beat >= every or self._cancel_requested:
                self._cancel_requested = False
                self.beat()

    def _has_running(self) -> bool:
        with self._lock:
            return bool(self._running)

    def beat(self) -> None:
        """Extend the leases of every running job of this worker, in one statement.

        A job that does not come back is no longer this worker's: it was cancelled, or its
        lease passed and another worker took it. Its handler is told to stop.
        """
        self._last_beat = time.monotonic()
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
                            "lease": self._lease,
                        },
                    ).scalars()
                )
        except sa.exc.DBAPIError as exc:
            log.warning("worker %s: heartbeat failed: %s", self.name, exc)
            return
        with self._lock:
            # A job that finished while the statement ran (its completion may be written
            # already) is not lost: only those still running here are.
            lost = [j for j in running if j.id not in kept and self._running.get(j.id) is j]
        for job in lost:
            if not job.is_cancelled:
                job_log(logging.WARNING, job, "cancelled or lease lost; asking it to stop")
                job.cancel("cancelled, or lease lost")

    def _enforce_timeouts(self) -> None:
        """A sync handler cannot be killed: past its timeout, record the failure, stop
        extending its lease, and tell it to stop. Its slot frees when it returns."""
        now = time.monotonic()
        with self._lock:
            overdue = [
                j
                for j in self._running.values()
                if j.started
                and not j.is_cancelled
                and (t := self.jobs.tasks.get(j.task)) is not None
                and t.timeout is not None
                and now - j.started > t.timeout
            ]
            for job in overdue:
                self._running.pop(job.id, None)
                self._unwritten += 1
        for job in overdue:
            task = self.jobs.tasks[job.task]
            job_log(logging.WARNING, job, "timed out after %ss", task.timeout)
            job.cancel(f"timed out after {task.timeout}s")
            self._outbox.put(timed_out(task, job))

    # -- listener -------------------------------------------------------------------------

    def _listener(self) -> None:
        failures = 0
        wanted = set(self.queues)
        while not self._stopping.is_set():
            try:
                # A connection of the engine's own (same URL, same connect args), taken
                # out of the pool for good: LISTEN belongs to one session.
                pooled = self.engine.raw_connection()
                conn: Any = pooled.driver_connection
                pooled.detach()
                try:
                    conn.rollback()
                    conn.autocommit = True
                    conn.execute(f'LISTEN "{self.q.channel}"')
                    failures = 0
                    self.listening.set()
                    self._wake.set()  # catch anything enqueued while we were not listening
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if note.payload in wanted:
                                self._wake.set()
                            elif note.payload == CANCEL_PAYLOAD:
                                self._cancel_requested = True
                                self._beat_now.set()
                finally:
                    self.listening.clear()
                    with contextlib.suppress(Exception):
                        conn.close()
            except Exception as exc:
                failures += 1
                pause = min(30.0, 0.1 * 2**failures)
                log.warning(
                    "worker %s: listener error, reconnecting in %.1fs: %s", self.name, pause, exc
                )
                self._stopping.wait(pause)

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _threads(self, *, listen: bool) -> Iterator[None]:
        self._stopping.clear()
        with self.engine.begin() as conn:
            periodic.sync_declared(conn, self.jobs)
        self._executors = [
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
            self._claim_conn.close()
            self._write_conn.close()
            self._beat_now.set()
            heartbeat.join(timeout=2.0)
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
        for _ in self._executors:
            self._inbox.put(None)
        deadline = time.monotonic() + self.grace_period
        for thread in self._executors:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        still = [t for t in self._executors if t.is_alive()]
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
                rows = conn.execute(self.q.hand_back, batch_params(jobs)).all()
            log.info("worker %s: handed back %d unstarted jobs", self.name, sum(r.n for r in rows))
        except sa.exc.DBAPIError as exc:
            log.warning(
                "worker %s: could not hand back %d jobs (%s); they will be retried when "
                "their leases pass",
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


async def _with_timeout(task: Task[Any, Any], coro: Any) -> Any:
    """Await an async handler run by the threaded worker, cancelled at its timeout."""
    if task.timeout is None:
        return await coro
    return await asyncio.wait_for(coro, task.timeout)

"""asyncio: :class:`AsyncJobSession` and :class:`AsyncWorker`.

Needs SQLAlchemy's asyncio support (``pip install 'sqla-jobs[asyncio]'``, i.e. greenlet)
and runs on psycopg's async connection.

``enqueue`` on an ``AsyncSession`` is a plain method, not a coroutine: it only adds to the
unit of work, and the INSERT happens at the (awaited) flush or commit.

.. code-block:: python

    worker = AsyncWorker(jobs, async_engine, queues=["webhooks"], concurrency=100)
    await worker.run()

The asyncio worker has the threaded worker's semantics (the same statements, the same
attempts guard, batching, heartbeats, LISTEN, leases, graceful stop) with one task per
running job instead of one thread per slot, so ``concurrency`` can be in the hundreds for
I/O-bound handlers. ``async def`` handlers run on the loop; plain functions run in a
thread (``asyncio.to_thread``). A timed-out or cancelled async handler is cancelled
for real (``CancelledError`` inside it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from . import maintenance, periodic
from ._base import WorkerBase
from .execution import (
    CANCEL_PAYLOAD,
    ClaimedJob,
    Outcome,
    complete_one_params,
    job_log,
    outcome_of,
    outcome_statements,
    reset_current,
    set_current,
    timed_out,
    unknown_task,
)
from .session import AsyncJobSession
from .tasks import Jobs, Task

__all__ = ["AsyncJobSession", "AsyncWorker"]

log = logging.getLogger("sqla_jobs.worker")


def _engine(bind: AsyncEngine | str, concurrency: int) -> AsyncEngine:
    if isinstance(bind, AsyncEngine):
        return bind
    from .db import create_async_engine

    return create_async_engine(bind, pool_size=min(concurrency, 32) + 4)


class _HeldConnection:
    """The asyncio twin of the threaded worker's held autocommit connection: one round trip
    per claim or all-done completion batch, instead of four."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None

    async def execute(self, statement: sa.Executable, params: dict[str, Any]) -> Any:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = await self._engine.connect()
            self._conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            conn = self._conn
        try:
            return await conn.execute(statement, params)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


class AsyncWorker(WorkerBase):
    """The asyncio twin of :class:`~sqla_jobs.Worker`; the parameters mean the same."""

    def __init__(
        self,
        jobs: Jobs,
        bind: AsyncEngine | str,
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False

    # -- public control -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop gracefully. Safe from any thread or signal handler."""
        self._stop_requested = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._request_stop)

    def _request_stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully."""
        await self._main(
            until_empty=False, wait_scheduled=0.0, deadline=None, signals=install_signal_handlers
        )

    async def run_until_empty(
        self, *, wait_scheduled: float = 0.0, timeout: float | None = None
    ) -> int:
        """Run until no job of these queues is ready or running here; return how many ran."""
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        await self._main(
            until_empty=True, wait_scheduled=wait_scheduled, deadline=deadline, signals=False
        )
        return self.processed - before

    # -- lifecycle ------------------------------------------------------------------------

    async def _main(
        self, *, until_empty: bool, wait_scheduled: float, deadline: float | None, signals: bool
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._written = asyncio.Event()
        self._outbox: list[Outcome] = []
        self._outbox_ready = asyncio.Event()
        self._running: dict[int, tuple[ClaimedJob, asyncio.Task[None]]] = {}
        self._free = self.concurrency
        self._reset_schedule()
        self._until_empty = until_empty
        self._claim_conn = _HeldConnection(self.engine)
        self._write_conn = _HeldConnection(self.engine)
        self.listening = asyncio.Event()
        self._beat_now = asyncio.Event()
        if self._stop_requested:
            self._stopping.set()
        async with self.engine.begin() as conn:
            await conn.run_sync(periodic.sync_declared, self.jobs)
        if signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        side = [
            asyncio.create_task(self._completer(), name="sqla-jobs-completer"),
            asyncio.create_task(self._heartbeat(), name="sqla-jobs-heartbeat"),
        ]
        if self.listen and not until_empty:
            side.append(asyncio.create_task(self._listener(), name="sqla-jobs-listener"))
        log.info(
            "worker %s started: queues %s, concurrency %d", self.name, self.queues, self.concurrency
        )
        try:
            await self._fetch_loop(wait_scheduled, deadline)
        finally:
            self._stopping.set()
            await self._shutdown()
            self._outbox_ready.set()
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)
            await self._flush()  # whatever the completer had not written yet
            await self._claim_conn.close()
            await self._write_conn.close()
            if signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    self._loop.remove_signal_handler(sig)
            self._stop_requested = False
            log.info("worker %s stopped", self.name)

    def _on_signal(self, sig: int) -> None:
        log.info("worker %s: received %s, stopping", self.name, signal.Signals(sig).name)
        self._request_stop()

    async def _shutdown(self) -> None:
        """Running jobs get the grace period; then they are cancelled and handed back."""
        tasks = [t for _, t in self._running.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.grace_period)
        late = [(job, t) for job, t in self._running.values() if not t.done()]
        for job, t in late:
            job.cancel("worker stopping: grace period over")
            t.cancel()
        if late:
            await asyncio.gather(*(t for _, t in late), return_exceptions=True)
            with contextlib.suppress(sa.exc.DBAPIError):
                async with self.engine.begin() as conn:
                    await conn.execute(
                        self.q.hand_back,
                        {
                            "ids": [j.id for j, _ in late],
                            "attempt_list": [j.attempts for j, _ in late],
                        },
                    )
            log.warning(
                "worker %s: handed back %d jobs cut off by the grace period", self.name, len(late)
            )

    # -- the fetch loop -------------------------------------------------------------------

    async def _fetch_loop(self, wait_scheduled: float, deadline: float | None) -> None:
        failures = 0
        while not self._stopping.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            self._wake.clear()
            try:
                await self._maintain()
                await self._claim()
                if not self._more and self._until_empty and self._free == self.concurrency:
                    await self._wait_written()
                    self._next_refresh = 0.0
                    await self._maintain()
                    if not await self._claim() and not self._due_soon(wait_scheduled):
                        break
                failures = 0
            except sa.exc.DBAPIError as exc:
                failures += 1
                pause = min(30.0, 0.1 * 2**failures)
                log.warning(
                    "worker %s: database error, retrying in %.1fs: %s", self.name, pause, exc
                )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)
                continue
            if self._more:
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._sleep_for())

    async def _claim(self) -> int:
        self._more = False
        free = self._free
        if free <= 0:
            self._saturated = True
            return 0
        total = 0
        for queue in self._claim_order():
            want = min(free - total, self.claim_limit)
            if want <= 0:
                break
            # One statement in autocommit (committed when it returns), as in the threaded
            # worker; only then may its jobs start.
            result = await self._claim_conn.execute(self.q.claim, self._claim_params(queue, want))
            rows = result.all()
            if len(rows) == want:
                self._more = True
            self._free -= len(rows)
            total += len(rows)
            for row in rows:
                job = ClaimedJob(*row, worker=self.name)  # type: ignore[misc]
                self._running[job.id] = (job, asyncio.create_task(self._run(job)))
        self._saturated = self._free <= 0
        return total

    async def _maintain(self) -> None:
        refresh, rescue = self._refresh_due()
        if not refresh:
            return
        async with self.engine.begin() as conn:
            result = await conn.run_sync(partial(maintenance.refresh, q=self.q, rescue=rescue))
            await conn.run_sync(periodic.enqueue_due, self.jobs)
        if self._refreshed(result, rescue):
            await self._prune()

    async def _prune(self) -> None:
        for statement, age in maintenance.prune_work(self.jobs):
            for _ in range(20):
                async with self.engine.begin() as conn:
                    deleted = await conn.run_sync(
                        maintenance.prune_batch, self.jobs, statement, age
                    )
                if deleted is None:
                    return
                if deleted < maintenance.BATCH:
                    break

    # -- running one job ------------------------------------------------------------------

    async def _run(self, job: ClaimedJob) -> None:
        outcome: Outcome | None
        try:
            outcome = await self._execute(job)
        except asyncio.CancelledError:
            outcome = None  # cancelled, lost, or cut off at shutdown: settled elsewhere
        except BaseException as exc:
            task = self.jobs.tasks.get(job.task)
            outcome = (
                outcome_of(task, job, exc) if task else unknown_task(self.jobs, job, self.name)
            )
        self._running.pop(job.id, None)
        self._free += 1
        self.processed += 1
        # None: cancelled, lost, or settled by a transactional run. A timed-out run does
        # return its outcome (the failure to record), though its job is marked cancelled.
        if outcome is not None:
            self._outbox.append(outcome)
            self._outbox_ready.set()
            self._written.clear()
        if self._saturated or self._until_empty:
            self._saturated = False
            self._wake.set()

    async def _execute(self, job: ClaimedJob) -> Outcome | None:
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
            if task.transactional:
                return await self._transactional(task, job, args, kwargs)
            call = self._call(task, args, kwargs)
            if task.timeout is not None:
                try:
                    await asyncio.wait_for(call, task.timeout)
                except asyncio.TimeoutError:
                    job.cancel(f"timed out after {task.timeout}s")
                    self._finished(task, job, None, cancelled=True)
                    return timed_out(task, job)
            else:
                await call
        except asyncio.CancelledError:
            self._finished(task, job, None, cancelled=True)
            raise
        except Exception as exc:
            error = exc
        finally:
            reset_current(token)
        return self._finished(task, job, error)

    def _call(self, task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if task.is_async:
            return task.fn(*args, **kwargs)
        return asyncio.to_thread(task.fn, *args, **kwargs)

    async def _transactional(
        self, task: Task[Any, Any], job: ClaimedJob, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Outcome | None:
        """Handler writes and completion in one transaction (see the threaded worker)."""
        async with AsyncSession(self.engine) as session:
            try:
                if task.is_async:
                    await task.fn(*args, session=session, **kwargs)
                else:
                    await session.run_sync(lambda s: task.fn(*args, session=s, **kwargs))
                done = (await session.execute(self.q.complete, complete_one_params(job))).first()
            except Exception as exc:
                await session.rollback()
                return self._finished(task, job, exc)
            if done is None:
                await session.rollback()
                job.cancel("lease lost: another worker owns this job")
                self._finished(task, job, None)
                return None
            await session.commit()
        self._finished(task, job, None)
        return None

    # -- completer and heartbeat ----------------------------------------------------------

    async def _completer(self) -> None:
        while True:
            await self._outbox_ready.wait()
            await asyncio.sleep(self.completion_interval)
            self._outbox_ready.clear()
            await self._flush()

    async def _flush(self) -> None:
        failures = 0
        while self._outbox:
            batch = self._outbox[: self.completion_batch]
            statements = outcome_statements(self.q, batch)
            try:
                if len(statements) == 1:  # every job done: one statement, atomic by itself
                    await self._write_conn.execute(*statements[0])
                else:
                    async with self.engine.begin() as conn:
                        for statement, params in statements:
                            await conn.execute(statement, params)
            except sa.exc.DBAPIError as exc:
                failures += 1
                if self._stopping.is_set() and failures > 5:
                    log.error(
                        "worker %s: could not record %d outcomes (%s); their jobs will "
                        "run again once their leases pass",
                        self.name,
                        len(batch),
                        exc,
                    )
                    del self._outbox[: len(batch)]
                    continue
                await asyncio.sleep(min(10.0, 0.1 * 2**failures))
                continue
            del self._outbox[: len(batch)]
            self._note_due(batch)
        self._written.set()

    async def _wait_written(self) -> None:
        if self._outbox:
            self._outbox_ready.set()
            await self._written.wait()

    async def _heartbeat(self) -> None:
        every = self.lease / 3
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), every)
            self._beat_now.clear()
            await self.beat()

    async def beat(self) -> None:
        """Extend the leases of every running job in one statement; cancel lost ones."""
        running = list(self._running.values())
        if not running:
            return
        try:
            async with self.engine.begin() as conn:
                result = await conn.execute(
                    self.q.heartbeat,
                    {
                        "ids": [j.id for j, _ in running],
                        "attempt_list": [j.attempts for j, _ in running],
                        "lease": self._lease,
                    },
                )
                kept = set(result.scalars())
        except sa.exc.DBAPIError as exc:
            log.warning("worker %s: heartbeat failed: %s", self.name, exc)
            return
        for job, task in running:
            # A job that finished while the statement ran is not lost.
            still = self._running.get(job.id)
            if (
                job.id not in kept
                and still is not None
                and still[0] is job
                and not job.is_cancelled
            ):
                job_log(logging.WARNING, job, "cancelled or lease lost; cancelling it")
                job.cancel("cancelled, or lease lost")
                task.cancel()

    async def _listener(self) -> None:
        failures = 0
        wanted = set(self.queues)
        while not self._stopping.is_set():
            conn: Any = None
            try:
                pooled = await self.engine.raw_connection()
                conn = pooled.driver_connection
                pooled.detach()
                await conn.rollback()
                await conn.set_autocommit(True)
                await conn.execute(f'LISTEN "{self.q.channel}"')
                failures = 0
                self.listening.set()
                self._wake.set()
                while not self._stopping.is_set():
                    async for note in conn.notifies(timeout=1.0):
                        if note.payload in wanted:
                            self._wake.set()
                        elif note.payload == CANCEL_PAYLOAD:
                            self._beat_now.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                pause = min(30.0, 0.1 * 2**failures)
                log.warning(
                    "worker %s: listener error, reconnecting in %.1fs: %s", self.name, pause, exc
                )
                await asyncio.sleep(pause)
            finally:
                self.listening.clear()
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()

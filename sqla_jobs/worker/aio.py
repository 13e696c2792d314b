"""The asyncio worker: the core's steps carried out with awaits on one event loop.

.. code-block:: python

    worker = AsyncWorker(jobs, async_engine, queues=["webhooks"], concurrency=100)
    await worker.run()

Same settings, same statements, same decisions as the threaded worker (all in
:mod:`._core`), with one task per running job instead of one thread per slot, so
``concurrency`` can be in the hundreds for I/O-bound handlers. ``async def`` handlers run
on the loop; plain functions in a thread of the worker's own pool, one per slot. A timed-out,
cancelled or lost ``async def`` handler is cancelled for real (``CancelledError`` inside
it); a plain function's thread cannot be, and its slot frees when its task is cancelled.
The statement functions are the threaded worker's, run through
``AsyncConnection.run_sync``. Needs SQLAlchemy's asyncio support:
``pip install 'sqla-jobs[asyncio]'``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from .._direct import compiled, pipeline_allowed, raise_as_dbapi_error
from .._queries import ClaimParams, Queries
from ..db import create_async_engine
from ..steps import AsyncSteps
from . import _statements as statements
from . import _steps as s
from ._core import Run, StepHost
from ._driver import DriverBase, Wakeups, pool_options, run_session
from ._signals import loop_signals, signalled
from .job import ClaimedJob, Outcome

__all__ = ["AsyncWorker"]

T = TypeVar("T")


class AsyncWorker(DriverBase[AsyncEngine]):
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry, on asyncio.

    ``AsyncWorker(jobs, bind, settings=None, **options)``: ``bind`` is an ``AsyncEngine``
    or a database URL; ``settings`` a :class:`~sqla_jobs.WorkerSettings`, whose fields
    keyword arguments override.
    """

    _wakeups: Wakeups[asyncio.Event]

    def _make_engine(self, bind: AsyncEngine | str) -> AsyncEngine:
        if isinstance(bind, AsyncEngine):
            return bind
        self._owns_engine = True
        return create_async_engine(bind, **pool_options(self.settings.concurrency))

    def _prepare(self) -> None:
        # asyncio primitives belong to the loop that first waits on them, and each run may
        # be on a loop of its own: they are made again at the start of every run.
        self._claim_conn = _HeldConnection(self.engine)
        self._write_conn = _HeldConnection(self.engine)
        self._wakeups = Wakeups(asyncio.Event)
        #: Outcomes for the completer: a deque, and an event set only while the completer
        #: waits on an empty one (an asyncio.Queue made a future per outcome).
        self._outbox: collections.deque[Outcome | None] = collections.deque()
        self._outcome_waiter: asyncio.Event | None = None
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        #: Claimed ahead of the free slots (``settings.prefetch``): each gets its task when
        #: a running one ends, so that no more than ``concurrency`` handlers run at once.
        self._waiting: collections.deque[ClaimedJob] = collections.deque()
        self._duties: list[asyncio.Task[Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False
        #: Held by a transactional or durable run while the pool cannot give every
        #: handler a connection (see ``handler_connections``).
        n = self.handler_connections
        self._connection_slots = None if n is None else asyncio.Semaphore(n)
        self._threads = self._thread_pool()

    def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads of plain-function handlers: one per slot, the worker's own.

        ``asyncio.to_thread`` ran them in the loop's default executor, of
        ``min(32, cores + 4)`` threads shared with the application: on 2 cores, no more
        than 6 plain handlers ran at once whatever ``concurrency`` said (the other claimed
        jobs waited, their leases renewed), and 6 handlers stuck past their timeout
        stopped every plain handler of every queue for good."""
        return concurrent.futures.ThreadPoolExecutor(
            max_workers=self.settings.concurrency, thread_name_prefix="sqla-jobs-handler"
        )

    async def _in_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` in a thread of the worker's pool, in a copy of this context (where
        :func:`current_job` is set). Cancelled while it runs (a timeout, a cancel, a lost
        lease), the thread cannot be stopped and runs on, out of the slot: the pool is
        replaced by a fresh one, the old one ending as its threads return, so that a
        handler stuck for good never keeps a thread the next handlers need."""
        context = contextvars.copy_context()
        future = self._threads.submit(context.run, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel():  # running: its thread is abandoned to it
                stuck, self._threads = self._threads, self._thread_pool()
                stuck.shutdown(wait=False)
            raise

    def stop(self) -> None:
        """Ask the worker to stop gracefully. Safe from any thread or signal handler."""
        self.core.stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake_stopping)

    def _wake_stopping(self) -> None:
        self._wakeups.stopping.set()
        self._wakeups.wake.set()

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully.

        :raises WorkerError: a duty kept failing (raised after the shutdown).
        """
        with loop_signals(install_signal_handlers, self._on_signal):
            await self._run(listen=self.settings.listen, until_empty=False)

    async def run_until_empty(
        self, *, wait_scheduled: float = 0.0, timeout: float | None = None
    ) -> int:
        """Run until no job of these queues is ready or running here; return how many ran."""
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        await self._run(
            listen=False, until_empty=True, wait_scheduled=wait_scheduled, deadline=deadline
        )
        return self.processed - before

    async def run_duty_once(self, name: str) -> Any:
        """One round of a side duty, or of the ``maintenance``: see ``Worker.run_duty_once``."""
        core = self.core
        steps = core.maintain() if name == "maintenance" else core.duties(listen=True)[name]()
        return await self._drive(steps)

    async def _run(self, **how: Any) -> None:
        self._prepare()
        self._loop = asyncio.get_running_loop()
        try:
            await self._drive(self.core.run(**how))
        finally:
            await self._claim_conn.close()
            await self._write_conn.close()
            self._threads.shutdown(wait=False)  # a stuck handler's thread ends as it returns
            if self._owns_engine:
                # Made from a URL: the pool is the worker's, and its connections belong to
                # this loop (the next run may be on another).
                await self.engine.dispose()

    def _on_signal(self, sig: int) -> None:
        signalled([self.core], self.stop, sig)

    # -- carrying out steps ----------------------------------------------------------------

    async def _drive(
        self, steps: s.Steps, handler: Callable[[], Any] | None = None, session: Any = None
    ) -> Any:
        """Carry out a core generator's steps; return what it returns."""
        stepper = s.Stepper(steps)
        while (step := stepper.next()) is not None:
            try:
                stepper.result = await self._do(step, handler, session)
            except BaseException as exc:
                stepper.error = exc
        return stepper.value

    async def _do(self, step: s.Step, handler: Callable[[], Any] | None, session: Any) -> Any:
        events = self._wakeups
        match step:
            case s.Io(fn, args, s.Conn.CLAIM):
                if fn is statements.claim:
                    return await self._claim_conn.claim(*args)
                return await self._claim_conn.run(fn, *args)
            case s.Io(fn, args, s.Conn.WRITE):
                return await self._write_conn.run(fn, *args)
            case s.Io(fn, args, _):
                async with self.engine.begin() as conn:
                    return await conn.run_sync(fn, *args)
            case s.Sleep(seconds):
                await _wait(events.wake, seconds)
                events.wake.clear()
            case s.Pause(seconds, stoppable):
                await (_wait(events.stopping, seconds) if stoppable else asyncio.sleep(seconds))
            case s.WaitWritten() as wait:
                while (seconds := wait.waiting(self.core)) > 0:
                    events.written.clear()
                    if self.core.unwritten > 0:
                        await _wait(events.written, seconds)
            case s.TakeOutcomes(limit, timeout):
                return await self._take_outcomes(limit, timeout)
            case s.Tick(seconds):
                poked = await _wait(events.poke, seconds)
                events.poke.clear()
                return None if self._done else poked
            case s.WaitIdle(seconds):
                # What still waits was handed back, unstarted: nothing to run.
                self._waiting.clear()
                if self._tasks:
                    await asyncio.wait(list(self._tasks.values()), timeout=seconds)
                return not self._tasks
            case s.Listen(channel):
                pooled = await self.engine.raw_connection()
                self._listen_conn = raw = pooled.driver_connection
                pooled.detach()
                await raw.rollback()  # type: ignore[union-attr]
                await raw.set_autocommit(True)  # type: ignore[union-attr]
                await raw.execute(statements.listen_sql(channel))  # type: ignore[union-attr]
            case s.Notifications(timeout):
                notes = self._listen_conn.notifies(timeout=timeout, stop_after=1)
                return [n.payload async for n in notes]
            case s.Unlisten():
                conn, self._listen_conn = self._listen_conn, None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
            case s.StartDuties(names):
                self._duties = [
                    asyncio.create_task(self._drive(self.core.supervised(name)), name=name)
                    for name in names
                ]
            case s.EndDuties():
                self._done = True
                events.poke.set()
                self.record(None)  # the completer ends once it wrote the rest
                # The completer is waited for as long as it takes (it gives up by itself
                # after a few tries once the worker stops), as the threaded worker does:
                # cut off during a retry's pause, it left its outcomes unwritten, and their
                # jobs ran again. The other duties end within moments.
                writing = [t for t in self._duties if t.get_name().endswith("completer")]
                others = [t for t in self._duties if t not in writing]
                if others:
                    await asyncio.wait(others, timeout=5.0)
                if writing:
                    await asyncio.wait(writing)
            case s.CallHandler():
                return await handler() if handler is not None else None
            case s.OnSession(fn, args):
                return await session.run_sync(fn, *args)
            case s.Commit():
                await session.commit()
            case s.Rollback():
                await session.rollback()
        return None

    async def _take_outcomes(self, limit: int, timeout: float | None) -> list[Outcome | None]:
        outbox = self._outbox
        if not outbox and timeout != 0:
            self._outcome_waiter = waiter = asyncio.Event()
            try:
                await _wait(waiter, timeout) if timeout is not None else await waiter.wait()
            finally:
                self._outcome_waiter = None
        taken: list[Outcome | None] = []
        while outbox and len(taken) < limit:
            taken.append(outbox.popleft())
        return taken

    def record(self, outcome: Outcome | None) -> None:
        self._outbox.append(outcome)
        waiter = self._outcome_waiter
        if waiter is not None:
            waiter.set()

    # -- the core's callbacks --------------------------------------------------------------

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        self._waiting.extend(claimed)
        self._start_waiting()

    def _start_waiting(self) -> None:
        tasks, waiting, limit = self._tasks, self._waiting, self.settings.concurrency
        while waiting and len(tasks) < limit:
            job = waiting.popleft()
            if not job.settled:  # handed back (a stop) while it waited
                tasks[job.key] = asyncio.create_task(self._run_job(job))

    def interrupt(self, job: ClaimedJob) -> None:
        task = self._tasks.get(job.key)
        if task is not None:
            task.cancel()

    # -- running handlers ------------------------------------------------------------------

    async def _run_job(self, job: ClaimedJob) -> None:
        # One coroutine per job, the common case inline: this runs for every job.
        try:
            run = self.core.start(job)
            if not isinstance(run, Run):
                outcome = run  # an unknown task's failure, or None: handed back unstarted
            elif run.task.transactional or run.task.durable:
                outcome = await self._holding_connection(run)
            else:
                task = run.task
                with run:
                    value = await (
                        task.fn(*run.args, **run.kwargs)
                        if task.is_async
                        else self._in_thread(task.fn, *run.args, **run.kwargs)
                    )
                    # A plain function's coroutine (a decorator's wrapper around an async
                    # def): awaited here, as the threaded worker does.
                    run.value = await value if inspect.iscoroutine(value) else value
                outcome = run.outcome
        except BaseException as exc:  # the worker's own failure around a run
            outcome = self.core.crashed(job, exc)
        finally:
            self._tasks.pop(job.key, None)
            if self._waiting:
                self._start_waiting()
        if outcome is not None:
            self.core.finished(job, outcome)

    async def _holding_connection(self, run: Run) -> Outcome:
        """A transactional or durable run, once a connection is free for it (see
        ``handler_connections``); cancelled while it waits (a timeout, a stop), it ends
        as a run cancelled at its start would."""
        slots = self._connection_slots
        run_it = self._transactional if run.task.transactional else self._durable
        if slots is None:
            return await run_it(run)
        try:
            await slots.acquire()
        except BaseException as exc:
            return run.end(exc)
        try:
            return await run_it(run)
        finally:
            slots.release()

    async def _transactional(self, run: Run) -> Outcome:
        fn, args, kwargs = run.task.fn, run.args, run.kwargs
        try:
            made = run_session(self.jobs, self.engine, AsyncSession)
        except Exception as exc:  # the app's session factory failed, or misfits
            return run.end(exc)
        async with made as session:

            async def handler() -> Any:
                if run.task.is_async:
                    return await fn(*args, session=session, **kwargs)
                return await session.run_sync(lambda sync: fn(*args, session=sync, **kwargs))

            outcome: Outcome = await self._drive(self.core.transactional(run), handler, session)
        return outcome

    async def _durable(self, run: Run) -> Outcome:
        """A durable task: its ``async def`` handler gets an awaitable step runner."""
        job, task = run.job, run.task
        steps = AsyncSteps(
            self.engine,
            self.jobs.step_queries,
            job,
            StepHost(self.core, job),
            lambda bind: run_session(self.jobs, bind, AsyncSession),
        )
        try:
            with run:
                if not task.is_async:
                    raise TypeError(
                        f"task {task.name!r} is durable and a plain def, whose steps block: "
                        "it runs on the threaded worker (or make it async def)"
                    )
                run.value = await task.fn(*run.args, steps=steps, **run.kwargs)
        finally:
            await steps.close()
        assert run.outcome is not None
        return run.outcome


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds``; whether it was set.

    The idle fetch loop waits here for a NOTIFY's wake-up, so it is on the idle pickup's
    path. ``asyncio.timeout`` (Python 3.11) waits in this task; ``asyncio.wait_for``
    wrapped the wait in a task of its own, one more turn of the loop before the claim."""
    if not event.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            if _timeout is None:
                await asyncio.wait_for(event.wait(), seconds)
            else:
                async with _timeout(seconds):
                    await event.wait()
    return event.is_set()


_timeout: Any = getattr(asyncio, "timeout", None)  # Python 3.11 and later


class _HeldConnection:
    """The asyncio twin of :class:`._statements.HeldConnection`: one autocommit connection kept
    between statements, running the same statement functions through ``run_sync``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None

    async def _connected(self) -> AsyncConnection:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = await self._engine.connect()
            self._conn = conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        return conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        conn = await self._connected()
        try:
            return await conn.run_sync(fn, *args)
        except BaseException:
            await self.close()
            raise

    async def claim(self, queries: Queries, params: ClaimParams) -> list[Any]:
        """:func:`._statements.claim`, awaited on the psycopg connection itself where the
        statement may go straight to it (:func:`~sqla_jobs._direct.pipeline_allowed`).

        The plain claim is on the idle pickup's path, and ``run_sync`` (a greenlet, then
        the same await) cost it about 0.1 ms of 0.8; its errors are still SQLAlchemy's
        (raised through ``run_sync``, which may invalidate the connection)."""
        conn = await self._connected()
        sync = conn.sync_connection
        if sync is None or not pipeline_allowed(sync):
            return await self.run(statements.claim, queries, params)
        made = compiled(queries.compiled, queries.claim, sync.dialect)
        driver: Any = sync.connection.driver_connection
        try:
            try:
                # Binary rows, as sqla_jobs._direct reads them (and why).
                cursor = await driver.execute(made.sql, made.params(params), binary=True)
                return list(await cursor.fetchall())
            except sync.dialect.loaded_dbapi.Error as exc:
                await conn.run_sync(raise_as_dbapi_error, made.sql, exc)
                raise  # not reached: the line above raised SQLAlchemy's error
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

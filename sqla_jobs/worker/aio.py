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
import contextlib
import contextvars
import functools
import inspect
import logging
import queue
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from .._direct import compiled, pipeline_allowed, raise_as_dbapi_error
from .._queries import ClaimParams, Queries
from ..db import create_async_engine
from ..errors import Snooze
from ..steps import AsyncSteps
from . import _statements as statements
from . import _steps as s
from ._core import Run, StepHost, quietly
from ._driver import (
    DriverBase,
    Fence,
    Wakeups,
    autocommit_level,
    pool_options,
    run_session,
    still_autocommit,
)
from ._signals import loop_signals, signalled
from .job import ClaimedJob, Outcome, job_log

__all__ = ["AsyncWorker"]

T = TypeVar("T")


class AsyncWorker(DriverBase[AsyncEngine]):
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry, on asyncio.

    ``AsyncWorker(jobs, bind, settings=None, **options)``: ``bind`` is an ``AsyncEngine``
    or a database URL; ``settings`` a :class:`~sqla_jobs.WorkerSettings`, whose fields
    keyword arguments override.
    """

    _wakeups: Wakeups[asyncio.Event]
    #: Whether :meth:`run` or :meth:`run_until_empty` runs now (see ``_run``).
    _active = False

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
        #: The heartbeat's own (see Conn.BEAT), taken as the duties start.
        self._beat_conn = _HeldConnection(self.engine)
        self._wakeups = Wakeups(asyncio.Event)
        #: Outcomes for the completer: a deque, and an event set only while the completer
        #: waits on an empty one (an asyncio.Queue made a future per outcome).
        self._outbox: collections.deque[Outcome | None] = collections.deque()
        self._outcome_waiter: asyncio.Event | None = None
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        #: The cancels of handlers' tasks from outside the worker, raised again once
        #: their runs are over (see _cancelled).
        self._outside: dict[tuple[int, int], BaseException] = {}
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

    def _thread_pool(self) -> _HandlerThreads:
        """The threads of plain-function handlers: one per slot, the worker's own.

        ``asyncio.to_thread`` ran them in the loop's default executor, of
        ``min(32, cores + 4)`` threads shared with the application: on 2 cores, no more
        than 6 plain handlers ran at once whatever ``concurrency`` said (the other claimed
        jobs waited, their leases renewed), and 6 handlers stuck past their timeout
        stopped every plain handler of every queue for good."""
        return _HandlerThreads(self.settings.concurrency)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn`` in a thread of the worker's pool, in a copy of this context (where
        :func:`current_job` is set). Cancelled while it runs (a timeout, a cancel, a lost
        lease, a grace period over), the thread cannot be stopped and runs on, out of the
        pool, so that a handler stuck for good never keeps a thread the next handlers
        need; it is a daemon thread, so that the process does not wait for it at exit."""
        context = contextvars.copy_context()
        call = self._threads.submit(
            asyncio.get_running_loop(), functools.partial(context.run, fn, *args, **kwargs)
        )
        try:
            return await call.future
        except asyncio.CancelledError:
            self._threads.abandon(call)
            raise

    def stop(self, *, now: bool = False) -> None:
        """Ask the worker to stop gracefully. Safe from any thread or signal handler.

        ``now=True`` skips what is left of the grace period (see ``Worker.stop``)."""
        self.core.stopping = True
        if now:
            self.core.hurried = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake_stopping)

    def _wake_stopping(self) -> None:
        self._wakeups.stopping.set()
        self._wakeups.wake.set()
        if self.core.hurried:
            self._wakeups.hurry.set()

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully.

        Cancelled (``task.cancel()``, ``asyncio.wait_for``), it shuts down gracefully too,
        then raises ``CancelledError``; a further cancel during the shutdown ends the
        grace period (the handlers still running are cancelled and their jobs handed
        back). One worker runs once at a time: a second ``run()`` raises RuntimeError.

        :raises WorkerError: a duty kept failing (raised after the shutdown).
        """
        with loop_signals(install_signal_handlers, self._on_signal):
            await self._run(listen=self.settings.listen, until_empty=False)

    async def run_until_empty(
        self, *, wait_scheduled: float = 0.0, timeout: float | None = None
    ) -> int:
        """Run until no job of these queues is ready or running here; return how many ran
        (the runs whose handler this call called: see ``Worker.run_until_empty``)."""
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
        with _RUNS:
            if self._active:
                # A second run replaced the first's connections, tasks and events: each
                # waited on the other's, one hung, and jobs were left running.
                raise RuntimeError(
                    "AsyncWorker.run() is already running: one worker runs once at a time "
                    "(make another AsyncWorker to run more)"
                )
            self._active = True
        try:
            await self._run_once(**how)
        finally:
            self._active = False

    async def _run_once(self, **how: Any) -> None:
        self._prepare()
        self._loop = asyncio.get_running_loop()
        core = self.core
        try:
            # Once the shutdown began, a further cancel means "the grace period is
            # over": it cut the shutdown short, and nothing was handed back, the duties
            # left pending, the running jobs left running until their leases.
            await self._drive(core.run(**how), outlast=lambda: core.shutting_down)
        finally:
            await self._claim_conn.close()
            await self._write_conn.close()
            await self._beat_conn.close()
            self._threads.close()  # a stuck handler's thread ends as it returns
            if self._owns_engine:
                # Made from a URL: the pool is the worker's, and its connections belong to
                # this loop (the next run may be on another).
                await self.engine.dispose()

    def _on_signal(self, sig: int) -> None:
        signalled([self.core], self.stop, sig)

    # -- carrying out steps ----------------------------------------------------------------

    async def _drive(
        self,
        steps: s.Steps,
        handler: Callable[[], Any] | None = None,
        session: Any = None,
        *,
        outlast: Callable[[], bool] | None = None,
    ) -> Any:
        """Carry out a core generator's steps; return what it returns.

        A cancel (``task.cancel()``, ``asyncio.wait_for``, ``asyncio.run``'s teardown)
        that lands while a statement is on its way does not drop its result: the
        statement is waited for (see :func:`_landing`), what it returned is sent in, and
        the cancel is thrown in at the next step. A claim in autocommit has committed on
        the server when its rows come back: cut off there, the claimed jobs were left
        ``running``, run by nobody and handed back by no shutdown, until their leases
        passed.

        While ``outlast()`` is true, the generator is not cut short at all: a cancel
        ends the wait it lands in (a grace period over, say) and is raised once the
        generator has returned. The run does so once its shutdown began (see
        :meth:`_run`), the completer always (see ``StartDuties``)."""
        stepper = s.Stepper(steps)
        held: BaseException | None = None  # a cancel raised once the steps are done
        thrown: BaseException | None = None  # a cancel thrown in at the next step
        while (step := stepper.next()) is not None:
            outlasting = outlast is not None and outlast()
            if thrown is not None:
                if not outlasting:
                    stepper.error, thrown = thrown, None
                    continue
                held, thrown = held or thrown, None
            try:
                if outlasting and not isinstance(step, _CUT_SHORT):
                    # Neither a statement (shielded by itself) nor a wait: carried out
                    # whatever is cancelled meanwhile (EndDuties, Unlisten).
                    cancels: list[BaseException] = []
                    try:
                        stepper.result = await _outlive(self._do(step, handler, session), cancels)
                    finally:
                        held = held or (cancels[0] if cancels else None)
                else:
                    stepper.result = await self._do(step, handler, session)
            except _Landed as landed:
                stepper.result, stepper.error, thrown = landed.result, landed.error, landed.cancel
            except asyncio.CancelledError as exc:
                if outlast is not None and outlast():
                    held = held or exc
                    stepper.result = self._cut_short(step)
                else:
                    stepper.error = exc
            except BaseException as exc:
                stepper.error = exc
        if thrown is not None or held is not None:
            raise held or thrown  # type: ignore[misc]
        return stepper.value

    def _cut_short(self, step: s.Step) -> Any:
        """What a wait sends back when a cancel ended it early (see :meth:`_drive`)."""
        match step:
            case s.WaitIdle():
                # The grace period is over: the shutdown stops what still runs and
                # hands it back.
                return not self._tasks
            case s.TakeOutcomes(limit):
                return self._pop_outcomes(limit)
            case s.Tick():
                return None if self._done else False
            case s.Notifications():
                return []
        return None

    async def _do(self, step: s.Step, handler: Callable[[], Any] | None, session: Any) -> Any:
        events = self._wakeups
        match step:
            case s.Io(fn, args, s.Conn.CLAIM):
                if fn is statements.claim:
                    return await self._claim_conn.claim(*args)
                return await self._claim_conn.run(fn, *args)
            case s.Io(fn, args, s.Conn.WRITE):
                return await self._write_conn.run(fn, *args)
            case s.Io(fn, args, s.Conn.BEAT):
                return await self._beat_conn.run(fn, *args)
            case s.Io(fn, args, _):
                conn = await self.engine.connect()
                return await _landing(_in_transaction(conn, fn, args))
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
            case s.WaitIdle(seconds, hurry):
                # What still waits was handed back, unstarted: nothing to run.
                self._waiting.clear()
                tasks = list(self._tasks.values())
                if tasks and not hurry:
                    await asyncio.wait(tasks, timeout=seconds)
                elif tasks and not events.hurry.is_set():
                    await _idle_or_hurried(tasks, events.hurry, seconds)
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
                # The heartbeat's connection, before any handler runs: one that uses the
                # worker's engine would otherwise find it first. Failing, the first beat
                # connects.
                with contextlib.suppress(Exception):
                    await self._beat_conn._connected()
                # The completer outlives a cancel of its task (asyncio.run's teardown
                # cancels every task at once): it ends once it wrote every outcome. Cut
                # off, a finished job's outcome waiting in its batch was never written,
                # and the job stayed running until its lease, then ran again.
                self._duties = [
                    asyncio.create_task(
                        self._drive(
                            self.core.supervised(name),
                            outlast=_always if name == "completer" else None,
                        ),
                        name=name,
                    )
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
        return self._pop_outcomes(limit)

    def _pop_outcomes(self, limit: int) -> list[Outcome | None]:
        outbox = self._outbox
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
                    try:
                        value = await (
                            task.fn(*run.args, **run.kwargs)
                            if task.is_async
                            else self._in_thread(task.fn, *run.args, **run.kwargs)
                        )
                        # A plain function's coroutine (a decorator's wrapper around an
                        # async def): awaited here, as the threaded worker does.
                        run.value = await value if inspect.iscoroutine(value) else value
                    except asyncio.CancelledError as exc:
                        raise self._cancelled(job, exc) from None
                outcome = run.outcome
        except BaseException as exc:  # the worker's own failure around a run
            outcome = self.core.crashed(job, exc)
        finally:
            self._tasks.pop(job.key, None)
            if self._waiting:
                self._start_waiting()
        if outcome is not None:
            self.core.finished(job, outcome)
        cancelled = self._outside.pop(job.key, None)
        if cancelled is not None:
            raise cancelled  # the task's cancel, once its job was handed back

    def _cancelled(self, job: ClaimedJob, cancel: BaseException) -> BaseException:
        """What a handler's ``CancelledError`` ends its run with. Cancelled by
        :meth:`interrupt` (a timeout, a cancellation, a lost lease, a grace period over)
        the job's outcome is decided already; raised by the handler itself (a future it
        awaited was cancelled, its task not), it is the handler's failure. Its task
        cancelled from outside the worker (``asyncio.run``'s teardown cancels every task
        at once), the job is handed back (:func:`_handed_back`), and the task ends
        cancelled once the run is over."""
        if job.settled or job.is_cancelled or not _cancelled_here():
            return cancel
        self._outside[job.key] = cancel
        return _handed_back(job)

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
            made = run_session(self.jobs, await self._in_transactions(), AsyncSession)
        except Exception as exc:  # the app's session factory failed, or misfits
            return run.end(exc)
        fences: list[Fence] = []
        async with made as session:

            async def handler() -> Any:
                # The run's transaction begins here, before the handler (see Fence).
                fence = await session.run_sync(Fence, self.core.queries, run.job)
                fences.append(fence)
                with fence.handling():
                    try:
                        if run.task.is_async:
                            return await fn(*args, session=session, **kwargs)
                        return await session.run_sync(
                            lambda sync: fn(*args, session=sync, **kwargs)
                        )
                    except asyncio.CancelledError as exc:
                        raise self._cancelled(run.job, exc) from None

            try:
                outcome: Outcome = await self._drive(self.core.transactional(run), handler, session)
            finally:
                for fence in fences:
                    fence.close()
        return outcome

    async def _in_transactions(self) -> AsyncEngine:
        """The engine the runs' own sessions are on (see ``Worker._in_transactions``)."""
        engine: AsyncEngine | None = self._run_engine
        if engine is None:
            async with self.engine.connect() as conn:
                level = await conn.run_sync(autocommit_level)
            engine = self.engine
            if level is not None:
                engine = engine.execution_options(isolation_level=level)
                async with engine.connect() as conn:
                    await conn.run_sync(still_autocommit)
            self._run_engine = engine
        return engine

    async def _durable(self, run: Run) -> Outcome:
        """A durable task: its ``async def`` handler gets an awaitable step runner."""
        job, task = run.job, run.task
        try:
            engine = await self._in_transactions()
        except Exception as exc:  # an engine that stays in autocommit
            return run.end(exc)
        steps = AsyncSteps(
            engine,
            self.jobs.step_queries,
            job,
            StepHost(self.core, job),
            lambda bind: run_session(self.jobs, bind, AsyncSession),
            # Its plain steps in the worker's own threads, as plain handlers are.
            self._in_thread,
        )
        try:
            with run:
                if not task.is_async:
                    raise TypeError(
                        f"task {task.name!r} is durable and a plain def, whose steps block: "
                        "it runs on the threaded worker (or make it async def)"
                    )
                try:
                    run.value = await task.fn(*run.args, steps=steps, **run.kwargs)
                except asyncio.CancelledError as exc:
                    raise self._cancelled(job, exc) from None
        finally:
            await steps.close()
        assert run.outcome is not None
        return run.outcome


def _cancelled_here() -> bool:
    """Whether this task was cancelled (Python 3.11; before, assumed so), rather than its
    handler raising a ``CancelledError`` of its own (a future it awaited, cancelled):
    that is the handler's failure, retried by its policy, not handed back again and
    again, its attempts not counted."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


def _handed_back(job: ClaimedJob) -> Snooze:
    """A handler's task cancelled from outside the worker (``asyncio.run``'s teardown
    cancels every task at once), not by :meth:`AsyncWorker.interrupt`: the job is not the
    handler's to fail. It runs again at once, the attempt not counted, as a job the
    shutdown hands back does. Recorded as the handler's failure, it spent an attempt
    (a job of ``max_attempts=1`` died of a redeploy)."""
    quietly(
        job_log,
        logging.WARNING,
        job,
        "its handler's task was cancelled from outside the worker; it runs again",
        outcome="snoozed",
    )
    return Snooze(0.0)


#: Guards the check that a worker is not run twice at once (runs may be on two loops).
_RUNS = threading.Lock()


def _always() -> bool:
    return True


#: The steps that only wait: cut short by a cancel that the drive outlasts (see
#: ``AsyncWorker._cut_short``).
_CUT_SHORT = (
    s.Io,  # shielded by itself (see _landing)
    s.Sleep,
    s.Pause,
    s.WaitWritten,
    s.TakeOutcomes,
    s.Tick,
    s.WaitIdle,
    s.Notifications,
)


class _Landed(asyncio.CancelledError):
    """A cancel that landed while a statement was on its way, the statement waited for:
    ``result`` is what it returned (or ``error`` what it raised), ``cancel`` the cancel
    to throw in after it (see ``AsyncWorker._drive``). A cancel itself, should anything
    else meet it."""

    def __init__(
        self, result: Any, cancel: BaseException, error: BaseException | None = None
    ) -> None:
        super().__init__()
        self.result, self.cancel, self.error = result, cancel, error


async def _landing(statement: Coroutine[Any, Any, T]) -> T:
    """Await ``statement`` in a task of its own that nothing cancels: cancelled
    meanwhile, wait for it, and raise :class:`_Landed` with its result or its error.

    The worker's statements run in autocommit, or commit as they return: once sent, it
    is the server that decides, and a result read and then dropped for a cancel was a
    claim committed that nobody ran, or outcomes written that the completer thought
    unwritten.

    The task is awaited directly, not through :func:`asyncio.shield`: a cancel of this
    task asks the statement's task to cancel, which refuses, so the cancel is only
    raised here once the statement's task is done, its result there to read. A shield
    added a future and a turn of the event loop to every statement, the idle pickup's
    claim among them."""
    task: asyncio.Task[T] = _Statement(statement, loop=asyncio.get_running_loop(), **_EAGER)
    try:
        return await task
    except asyncio.CancelledError as cancel:
        try:
            # Done already (see above); waited for should anything else have ended the
            # await early.
            result = task.result() if task.done() else await _outlive(task)
        except Exception as exc:  # the database's, say: the caller decides, as ever
            raise _Landed(None, cancel, exc) from None
        raise _Landed(result, cancel) from None


#: Python 3.12 and later start a statement's task at once, in the caller's turn of the
#: event loop (``eager_start``): the statement is sent one turn sooner.
_EAGER: dict[str, Any] = {"eager_start": True} if sys.version_info >= (3, 12) else {}


class _Statement(asyncio.Task):  # type: ignore[type-arg]
    """A statement's task (see :func:`_landing`), which nothing cancels: ``asyncio.run``'s
    teardown cancels every task, this one too, and cut off it left the completer's
    outcomes written or not, it could not tell."""

    def cancel(self, msg: Any = None) -> bool:
        return False


async def _outlive(work: Awaitable[T], cancels: list[BaseException] | None = None) -> T:
    """Await ``work`` to its end whatever cancels meanwhile; they are put in ``cancels``,
    for the caller to raise (see ``AsyncWorker._drive``)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError as cancel:
            if cancels is not None:
                cancels.append(cancel)
    return task.result()


async def _in_transaction(conn: AsyncConnection, fn: Callable[..., T], args: Any) -> T:
    """``fn(connection, *args)`` in a transaction of its own at READ COMMITTED, committed
    as it returns (see ``_statements.in_read_committed``)."""
    try:
        async with conn.begin():
            return await conn.run_sync(statements.in_read_committed, fn, args)
    finally:
        await conn.close()


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


async def _idle_or_hurried(
    tasks: list[asyncio.Task[None]], hurry: asyncio.Event, seconds: float
) -> None:
    """Wait until every one of ``tasks`` is done, ``hurry`` is set, or ``seconds`` passed.
    The handlers' tasks are only waited on: what ends the wait cancels none of them."""
    done = asyncio.ensure_future(asyncio.wait(tasks))
    hurried = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait([done, hurried], timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        done.cancel()
        hurried.cancel()


class _Call:
    """One plain handler's call, for :class:`_HandlerThreads`."""

    __slots__ = ("fn", "future", "loop", "state")

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
        self.loop = loop
        self.fn = fn
        self.future: asyncio.Future[Any] = loop.create_future()
        #: "waiting", "running", "abandoned" (its task cancelled while it ran), "done".
        self.state = "waiting"


class _HandlerThreads:
    """At most ``limit`` daemon threads that run plain handlers, made as needed; each
    call's result resolves an asyncio future on its loop.

    Not a ``concurrent.futures.ThreadPoolExecutor``: the interpreter joins every thread of
    one at exit, whatever ``shutdown(wait=False)`` said. A handler stuck past its grace
    period, its job handed back (and maybe running again in another worker), kept the
    stopped worker's process alive until it returned (minutes), and a supervisor killed
    it and exited 1. The threaded worker's handler threads are daemon threads too."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # in the pool: not counting the abandoned ones
        self._idle = 0  # waiting for a call
        self._queued = 0  # calls not yet taken by a thread

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> _Call:
        call = _Call(loop, fn)
        with self._lock:
            self._queued += 1
            more = self._queued > self._idle and self._threads < self._limit
            if more:
                self._threads += 1
        self._calls.put(call)
        if more:
            threading.Thread(target=self._serve, name="sqla-jobs-handler", daemon=True).start()
        return call

    def abandon(self, call: _Call) -> None:
        """Its task was cancelled: not run if it has not started; if it runs, its thread
        leaves the pool (ending when the handler returns) and another may take its place."""
        with self._lock:
            if call.state == "running":
                self._threads -= 1
                call.state = "abandoned"
            elif call.state == "waiting":
                call.state = "done"

    def close(self) -> None:
        """The pool's threads end, the idle ones at once, the busy ones when their handler
        returns (not waited for)."""
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._calls.put(None)

    def _serve(self) -> None:
        calls = self._calls
        while True:
            with self._lock:
                self._idle += 1
            call = calls.get()
            with self._lock:
                self._idle -= 1
                if call is None:
                    self._threads -= 1
                    return
                self._queued -= 1
                if call.state != "waiting":  # abandoned before it started
                    continue
                call.state = "running"
            try:
                outcome: tuple[bool, Any] = (True, call.fn())
            except BaseException as exc:  # handed to the awaiting task, as a future would
                outcome = (False, exc)
            with self._lock:
                abandoned = call.state == "abandoned"
                call.state = "done"
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody awaits it
                call.loop.call_soon_threadsafe(_resolve, call.future, outcome)
            if abandoned:
                return  # out of the pool already


def _resolve(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():  # cancelled
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


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
        """``fn(connection, *args)``, shielded from a cancel once sent (see :func:`_landing`)."""
        conn = await self._connected()
        return await _landing(self._run_on(conn, fn, args))

    async def _run_on(self, conn: AsyncConnection, fn: Callable[..., T], args: Any) -> T:
        try:
            return await conn.run_sync(fn, *args)
        except BaseException:
            await self.close()
            raise

    async def claim(self, queries: Queries, params: ClaimParams) -> list[Any]:
        """:func:`._statements.claim`, awaited on the psycopg connection itself where the
        statement may go straight to it (:func:`~sqla_jobs._direct.pipeline_allowed`);
        shielded from a cancel once sent, as :meth:`run` is.

        The plain claim is on the idle pickup's path, and ``run_sync`` (a greenlet, then
        the same await) cost it about 0.1 ms of 0.8; its errors are still SQLAlchemy's
        (raised through ``run_sync``, which may invalidate the connection)."""
        conn = await self._connected()
        sync = conn.sync_connection
        if sync is None or not pipeline_allowed(sync):
            return await self.run(statements.claim, queries, params)
        # Elsewhere than at READ COMMITTED (asked once per connection), the claim is sent
        # in a transaction of its own (see statements.claim).
        alone = statements.lone_read_committed(sync)
        if alone is None:
            try:
                alone = await conn.run_sync(statements.lone_read_committed, True)
            except BaseException:  # a read only: cut off, the connection is not reused
                await self.close()
                raise
        if not alone:
            return await self.run(statements.claim, queries, params)
        return await _landing(self._claim_on(conn, sync, queries, params))

    async def _claim_on(
        self, conn: AsyncConnection, sync: Any, queries: Queries, params: ClaimParams
    ) -> list[Any]:
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

"""The asyncio worker: the core's steps carried out with awaits on one event loop.

.. code-block:: python

    worker = AsyncWorker(jobs, async_engine, queues=["webhooks"], concurrency=100)
    await worker.run()

Same settings, same statements, same decisions as the threaded worker (all in
:mod:`.core`), with one task per running job instead of one thread per slot, so
``concurrency`` can be in the hundreds for I/O-bound handlers. ``async def`` handlers run
on the loop; plain functions run in a thread (``asyncio.to_thread``). A timed-out,
cancelled or lost ``async def`` handler is cancelled for real (``CancelledError`` inside
it); a plain function's thread cannot be, and frees its slot when its task is cancelled.
Needs SQLAlchemy's asyncio support: ``pip install 'sqla-jobs[asyncio]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from . import db
from .core import (
    CallHandler,
    Commit,
    Conn,
    DutyState,
    Io,
    Listen,
    Notifications,
    OnSession,
    Pause,
    Rollback,
    Run,
    Sleep,
    Step,
    Steps,
    TakeOutcomes,
    Tick,
    WaitIdle,
    WaitWritten,
    WorkerCore,
)
from .job import ClaimedJob, Outcome
from .settings import WorkerSettings, resolve

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..errors import WorkerError
    from ..tasks import Jobs
    from .settings import WorkerOptions

__all__ = ["AsyncWorker"]

T = TypeVar("T")


class AsyncWorker:
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry, on asyncio.

    :param jobs: the registry: handlers and the jobs table.
    :param bind: an ``AsyncEngine`` or a database URL.
    :param settings: a :class:`WorkerSettings`; keyword arguments override its fields.
    """

    def __init__(
        self,
        jobs: Jobs,
        bind: AsyncEngine | str,
        settings: WorkerSettings | None = None,
        **options: Unpack[WorkerOptions],
    ) -> None:
        self.settings = resolve(settings, options)
        self.jobs = jobs
        self.core = WorkerCore(jobs, self.settings, self)
        self.engine = _engine(bind, self.settings.concurrency)
        #: Set while the listener holds its LISTEN (a ``threading.Event``, so that other
        #: threads can wait on it too).
        self.listening = self.core.listening
        self._loop: asyncio.AbstractEventLoop | None = None
        self._claim_conn = _HeldConnection(self.engine)
        self._write_conn = _HeldConnection(self.engine)
        self._listen_conn: Any = None
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._outbox: list[Outcome] = []
        self._done = False
        self._fatal: WorkerError | None = None
        self._events = _Events()

    def __repr__(self) -> str:
        c = self.core
        return f"<AsyncWorker {c.name} queues={c.queues} concurrency={self.settings.concurrency}>"

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def queues(self) -> list[str]:
        return self.core.queues

    @property
    def processed(self) -> int:
        """Jobs this worker has finished running, whatever their outcome."""
        return self.core.processed

    # -- public control -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop gracefully. Safe from any thread or signal handler."""
        self.core.stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._events.stop)

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully.

        :raises WorkerError: a duty kept failing (after the shutdown).
        """
        await self._run(
            listen=self.settings.listen,
            until_empty=False,
            fetch={},
            signals=install_signal_handlers,
        )

    async def run_until_empty(
        self, *, wait_scheduled: float = 0.0, timeout: float | None = None
    ) -> int:
        """Run until no job of these queues is ready or running here; return how many ran."""
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        fetch = {"wait_scheduled": wait_scheduled, "deadline": deadline}
        await self._run(listen=False, until_empty=True, fetch=fetch, signals=False)
        return self.processed - before

    # -- the run --------------------------------------------------------------------------

    async def _run(
        self, *, listen: bool, until_empty: bool, fetch: dict[str, Any], signals: bool
    ) -> None:
        core = self.core
        stop_requested = core.stopping  # stop() before run() still counts
        core.reset()
        core.until_empty = until_empty
        self._loop = loop = asyncio.get_running_loop()
        self._events = events = _Events()
        self._outbox = []
        self._done = False
        self._fatal = None
        if stop_requested:
            self.stop()
        await self._drive(core.starting())
        if signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
        duties = [
            asyncio.create_task(self._supervised(name, run_once), name=f"sqla-jobs-{name}")
            for name, run_once in core.duties(listen=listen).items()
        ]
        try:
            await self._supervised("fetch loop", lambda: core.fetch(**fetch))
        finally:
            self.stop()
            events.stop()
            await self._drive(core.shutdown())
            self._done = True
            events.poke.set()
            events.outbox.set()
            await asyncio.wait(duties, timeout=5.0)
            await self._claim_conn.close()
            await self._write_conn.close()
            if signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            core.stopped()
        if self._fatal is not None:
            raise self._fatal

    def _on_signal(self, sig: int) -> None:
        self.core.signalled(signal.Signals(sig).name)
        self.stop()

    async def _supervised(self, name: str, run_once: Callable[[], Steps]) -> None:
        """Run a duty until it says it is done; restart it when it raises (the core says
        how soon, or that the worker must stop)."""
        state = DutyState(self.core, name)
        while True:
            state.starting()
            try:
                if await self._drive(run_once()) is not True:
                    return
                state.succeeded()
            except Exception as exc:
                try:
                    pause = state.failed(exc)
                except Exception as fatal:
                    self._fatal = fatal  # type: ignore[assignment]
                    self.stop()
                    return
                if name in ("completer", "heartbeat"):
                    await asyncio.sleep(pause)  # they must outlive the stop: outcomes, leases
                elif await _wait(self._events.stopping, pause):
                    return
            finally:
                if name == "listener":
                    await self._close_listener()

    # -- carrying out steps ----------------------------------------------------------------

    async def _drive(
        self,
        steps: Steps,
        handler: Callable[[], Any] | None = None,
        session: AsyncSession | None = None,
    ) -> Any:
        """Carry out a core generator's steps; return what it returns. Every error of a
        step, the handler's included, is thrown back into the generator to decide on."""
        result: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = steps.throw(error) if error is not None else steps.send(result)
            except StopIteration as done:
                return done.value
            result = error = None
            try:
                result = await self._do(step, handler, session)
            except BaseException as exc:
                error = exc

    async def _do(
        self, step: Step, handler: Callable[[], Any] | None, session: AsyncSession | None
    ) -> Any:
        events = self._events
        match step:
            case Io(fn, args, Conn.CLAIM):
                return await self._claim_conn.run(fn, *args)
            case Io(fn, args, Conn.WRITE):
                return await self._write_conn.run(fn, *args)
            case Io(fn, args, _):
                async with self.engine.begin() as conn:
                    return await conn.run_sync(fn, *args)
            case Sleep(seconds):
                await _wait(events.wake, seconds)
                events.wake.clear()
            case Pause(seconds, stoppable):
                if stoppable:
                    await _wait(events.stopping, seconds)
                else:
                    await asyncio.sleep(seconds)
            case WaitWritten():
                while self.core.unwritten > 0:
                    events.written.clear()
                    await events.written.wait()
            case TakeOutcomes(limit, within):
                while not self._outbox:
                    if self._done:
                        return None
                    events.outbox.clear()
                    await events.outbox.wait()
                if within:
                    await asyncio.sleep(within)
                batch = self._outbox[:limit]
                del self._outbox[:limit]
                return batch
            case Tick(seconds):
                poked = await _wait(events.poke, seconds)
                events.poke.clear()
                return None if self._done else poked
            case WaitIdle(seconds):
                tasks = list(self._tasks.values())
                if tasks:
                    await asyncio.wait(tasks, timeout=seconds)
                return not self._tasks
            case Listen(channel):
                await self._listen(channel)
            case Notifications(timeout):
                notes = self._listen_conn.notifies(timeout=timeout, stop_after=1)
                return [n.payload async for n in notes]
            case CallHandler():
                assert handler is not None
                return await handler()
            case OnSession(fn, args):
                assert session is not None
                return await session.run_sync(fn, *args)
            case Commit():
                assert session is not None
                await session.commit()
            case Rollback():
                assert session is not None
                await session.rollback()
        return None

    async def _listen(self, channel: str) -> None:
        pooled = await self.engine.raw_connection()
        raw: Any = pooled.driver_connection
        self._listen_conn = raw
        pooled.detach()
        await raw.rollback()
        await raw.set_autocommit(True)
        await raw.execute(db.listen_sql(channel))

    async def _close_listener(self) -> None:
        conn, self._listen_conn = self._listen_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    # -- the core's driver interface -------------------------------------------------------

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        for job in claimed:
            self._tasks[job.key] = asyncio.create_task(self._run_job(job))

    def record(self, outcome: Outcome) -> None:
        self._outbox.append(outcome)
        self._events.outbox.set()

    def interrupt(self, job: ClaimedJob) -> None:
        task = self._tasks.get(job.key)
        if task is not None:
            task.cancel()

    def wake(self) -> None:
        self._events.wake.set()

    def poke(self) -> None:
        self._events.poke.set()

    def written(self) -> None:
        self._events.written.set()

    # -- running handlers ------------------------------------------------------------------

    async def _run_job(self, job: ClaimedJob) -> None:
        try:
            outcome = await self._execute(job)
        finally:
            self._tasks.pop(job.key, None)
        if outcome is not None:
            self.core.finished(job, outcome)

    async def _execute(self, job: ClaimedJob) -> Outcome | None:
        run = self.core.start(job)
        if not isinstance(run, Run):
            return run  # an unknown task's failure, or None: handed back before it started
        try:
            args, kwargs = run.args()
            fn = run.task.fn
            if run.task.transactional:
                return await self._transactional(run, args, kwargs)
            if run.task.is_async:
                await fn(*args, **kwargs)
            else:
                await asyncio.to_thread(fn, *args, **kwargs)
        except BaseException as exc:  # the worker itself must never die of a handler
            return run.end(exc)
        return run.end(None)

    async def _transactional(
        self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Outcome:
        fn = run.task.fn

        async def handler() -> Any:
            if run.task.is_async:
                return await fn(*args, session=session, **kwargs)
            return await session.run_sync(lambda s: fn(*args, session=s, **kwargs))

        async with AsyncSession(self.engine) as session:
            outcome: Outcome = await self._drive(self.core.transactional(run), handler, session)
        return outcome


class _Events:
    """The asyncio events of one run, made inside it: an ``asyncio.Event`` belongs to the
    loop that first waits on it, and each run may be on a loop of its own."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.poke = asyncio.Event()
        self.stopping = asyncio.Event()
        self.outbox = asyncio.Event()
        self.written = asyncio.Event()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds``; whether it was set."""
    if event.is_set():
        return True
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()


class _HeldConnection:
    """The asyncio twin of :class:`.db.HeldConnection`: one autocommit connection kept
    between statements, running the same statement functions through ``run_sync``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: AsyncConnection | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = await self._engine.connect()
            self._conn = conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            return await conn.run_sync(fn, *args)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


def _engine(bind: AsyncEngine | str, concurrency: int) -> AsyncEngine:
    if isinstance(bind, AsyncEngine):
        return bind
    from ..db import create_async_engine

    return create_async_engine(bind, pool_size=min(concurrency, 32) + 4)

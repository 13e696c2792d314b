"""The threaded worker: the core's steps carried out with threads and blocking calls.

.. code-block:: python

    worker = Worker(jobs, engine, queues=["previews", "webhooks"], concurrency=16)
    worker.run()              # until SIGINT/SIGTERM or worker.stop()
    worker.run_until_empty()  # tests and scripts: until no ready job is left

The thread that calls ``run`` runs the fetch loop; ``concurrency`` executor threads run
handlers, outside any transaction; the completer, the heartbeat and the listener each
have a thread of their own, supervised. What they do is decided in :mod:`.core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue as queue_mod
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from ..session import insert_pending
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
from .job import ClaimedJob, Outcome, OutcomeKind
from .settings import WorkerSettings, resolve

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..errors import WorkerError
    from ..tasks import Jobs
    from .settings import WorkerOptions

__all__ = ["Worker"]


class Worker:
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry, with threads.

    :param jobs: the registry: handlers and the jobs table.
    :param bind: an ``Engine`` or a database URL. The worker uses a few pooled
        connections (claims, completions, heartbeat, maintenance, transactional tasks)
        and one dedicated LISTEN connection.
    :param settings: a :class:`WorkerSettings`; keyword arguments override its fields
        (``Worker(jobs, engine, concurrency=16)``), which are described there.
    """

    def __init__(
        self,
        jobs: Jobs,
        bind: sa.Engine | str,
        settings: WorkerSettings | None = None,
        **options: Unpack[WorkerOptions],
    ) -> None:
        self.settings = resolve(settings, options)
        self.jobs = jobs
        self.core = WorkerCore(jobs, self.settings, self)
        self.engine = _engine(bind, self.settings.concurrency)
        #: Set while the listener holds its LISTEN (tests and health checks wait on it).
        self.listening = self.core.listening
        self._claim_conn = db.HeldConnection(self.engine)
        self._write_conn = db.HeldConnection(self.engine)
        self._listen_conn: Any = None
        self._inbox: queue_mod.SimpleQueue[ClaimedJob | None] = queue_mod.SimpleQueue()
        self._outbox: queue_mod.SimpleQueue[Outcome | None] = queue_mod.SimpleQueue()
        self._written = threading.Condition()
        self._wake = threading.Event()
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._done = False
        self._fatal: WorkerError | None = None
        self._executors: list[threading.Thread] = []
        self._coroutines: dict[tuple[int, int], tuple[asyncio.AbstractEventLoop, Any]] = {}

    def __repr__(self) -> str:
        c = self.core
        return f"<Worker {c.name} queues={c.queues} concurrency={self.settings.concurrency}>"

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

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- public control -------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: no new claims, then a graceful shutdown. Thread-safe."""
        self.core.stopping = True
        self._stop.set()
        self._wake.set()

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully.

        :raises WorkerError: a duty kept failing (after the shutdown).
        """
        with self._signals(install_signal_handlers):
            self._run(listen=self.settings.listen, until_empty=False, fetch={})

    def run_until_empty(self, *, wait_scheduled: float = 0.0, timeout: float | None = None) -> int:
        """Run until no job of these queues is ready or running here; return how many ran.

        :param wait_scheduled: also wait for scheduled jobs (delays, retries) that fall due
            within this many seconds.
        :param timeout: give up (and shut down gracefully) after this many seconds.
        """
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        fetch = {"wait_scheduled": wait_scheduled, "deadline": deadline}
        self._run(listen=False, until_empty=True, fetch=fetch)
        return self.processed - before

    def run_duty_once(self, name: str) -> Any:
        """Run one round of a side duty (``completer``, ``heartbeat``, ``listener``) or of
        ``maintenance`` here and now, and return what it returned: for tests and tools."""
        duties = self.core.duties(listen=True)
        steps = self.core.maintain() if name == "maintenance" else duties[name]()
        return self._drive(steps)

    # -- the run --------------------------------------------------------------------------

    def _run(self, *, listen: bool, until_empty: bool, fetch: dict[str, Any]) -> None:
        core = self.core
        core.reset()
        core.until_empty = until_empty
        self._inbox = queue_mod.SimpleQueue()
        self._outbox = queue_mod.SimpleQueue()
        self._stop.clear()
        self._wake.clear()
        self._done = False
        self._fatal = None
        self._drive(core.starting())
        n = self.settings.concurrency
        self._executors = [self._thread(self._executor, f"executor-{i}") for i in range(n)]
        duties = [
            self._thread(self._supervised, name, name, run_once)
            for name, run_once in core.duties(listen=listen).items()
        ]
        try:
            self._supervised("fetch loop", lambda: core.fetch(**fetch))
        finally:
            self.stop()
            self._drive(core.shutdown())
            self._done = True
            self._poke.set()
            self._outbox.put(None)
            for thread in duties:
                thread.join(timeout=None if thread.name.endswith("completer") else 2.0)
            self._claim_conn.close()
            self._write_conn.close()
            core.stopped()
        if self._fatal is not None:
            raise self._fatal

    def _thread(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=f"sqla-jobs-{name}", daemon=True)
        thread.start()
        return thread

    def _supervised(self, name: str, run_once: Callable[[], Steps]) -> None:
        """Run a duty until it says it is done; restart it when it raises (the core says
        how soon, or that the worker must stop)."""
        state = DutyState(self.core, name)
        while True:
            state.starting()
            try:
                if self._drive(run_once()) is not True:
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
                    time.sleep(pause)  # they must outlive the stop: outcomes, leases
                elif self._stop.wait(pause):
                    return
            finally:
                if name == "listener":
                    self._close_listener()

    # -- carrying out steps ----------------------------------------------------------------

    def _drive(
        self,
        steps: Steps,
        handler: Callable[[], Any] | None = None,
        session: Session | None = None,
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
                result = self._do(step, handler, session)
            except BaseException as exc:
                error = exc

    def _do(self, step: Step, handler: Callable[[], Any] | None, session: Session | None) -> Any:
        match step:
            case CallHandler():
                assert handler is not None
                return handler()
            case OnSession(fn, args):
                return fn(session, *args)
            case Commit():
                assert session is not None
                session.commit()
            case Rollback():
                assert session is not None
                session.rollback()
            case Io(fn, args, Conn.CLAIM):
                return self._claim_conn.run(fn, *args)
            case Io(fn, args, Conn.WRITE):
                return self._write_conn.run(fn, *args)
            case Io(fn, args, _):
                with self.engine.begin() as conn:
                    return fn(conn, *args)
            case Sleep(seconds):
                self._wake.wait(seconds)
                self._wake.clear()
            case Pause(seconds, stoppable):
                if stoppable:
                    self._stop.wait(seconds)
                else:
                    time.sleep(seconds)
            case WaitWritten():
                with self._written:
                    self._written.wait_for(lambda: self.core.unwritten <= 0)
            case TakeOutcomes(limit, within):
                return self._take_outcomes(limit, within)
            case Tick(seconds):
                poked = self._poke.wait(seconds)
                self._poke.clear()
                return None if self._done else poked
            case WaitIdle(seconds):
                deadline = time.monotonic() + seconds
                for _ in self._executors:
                    self._inbox.put(None)
                for thread in self._executors:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
                return not any(t.is_alive() for t in self._executors)
            case Listen(channel):
                self._listen(channel)
            case Notifications(timeout):
                notes = self._listen_conn.notifies(timeout=timeout, stop_after=1)
                return [n.payload for n in notes]
        return None

    def _listen(self, channel: str) -> None:
        # A connection of the engine's own (same URL, same connect args), taken out of the
        # pool for good: LISTEN belongs to one session.
        pooled = self.engine.raw_connection()
        raw: Any = pooled.driver_connection
        self._listen_conn = raw
        pooled.detach()
        raw.rollback()
        raw.autocommit = True
        raw.execute(db.listen_sql(channel))

    def _take_outcomes(self, limit: int, within: float) -> list[Outcome] | None:
        first = self._outbox.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + within
        while len(batch) < limit:
            remaining = deadline - time.monotonic()
            try:
                item = (
                    self._outbox.get(timeout=remaining)
                    if remaining > 0
                    else self._outbox.get_nowait()
                )
            except queue_mod.Empty:
                break
            if item is None:
                self._outbox.put(None)  # end after this batch
                break
            batch.append(item)
        return batch

    def _close_listener(self) -> None:
        conn, self._listen_conn = self._listen_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- the core's driver interface -------------------------------------------------------

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        for job in claimed:
            self._inbox.put(job)

    def record(self, outcome: Outcome) -> None:
        self._outbox.put(outcome)

    def interrupt(self, job: ClaimedJob) -> None:
        # Threads cannot be stopped; a coroutine run by an executor thread can.
        entry = self._coroutines.get(job.key)
        if entry is not None:
            loop, task = entry
            with contextlib.suppress(RuntimeError):  # its loop just closed
                loop.call_soon_threadsafe(task.cancel)

    def wake(self) -> None:
        self._wake.set()

    def poke(self) -> None:
        self._poke.set()

    def written(self) -> None:
        with self._written:
            self._written.notify_all()

    # -- running handlers ------------------------------------------------------------------

    def _executor(self) -> None:
        while (job := self._inbox.get()) is not None:
            outcome = self._execute(job)
            if outcome is not None:
                self.core.finished(job, outcome)

    def execute(self, job: ClaimedJob, *, session: Session | None = None) -> Outcome:
        """Run one claimed job as this worker would, and say how it ended.

        Sets :func:`~sqla_jobs.current_job`, fires the events, and maps exceptions to an
        outcome; the caller writes the outcome (the worker hands it to its completer). A
        transactional task runs in a session of the worker's that commits with the job's
        completion, or, given ``session`` (``sqla_jobs.testing`` does this inside a test's
        transaction), in that session behind a savepoint that a failure rolls back.
        """
        return self._execute(job, session) or Outcome(OutcomeKind.SETTLED, job)

    def _execute(self, job: ClaimedJob, session: Session | None = None) -> Outcome | None:
        run = self.core.start(job)
        if not isinstance(run, Run):
            return run  # an unknown task's failure, or None: handed back before it started
        try:
            args, kwargs = run.args()
            task = run.task
            if task.transactional:
                return self._transactional(run, args, kwargs, session)
            if task.is_async:
                asyncio.run(self._coroutine(job, task.fn(*args, **kwargs)))
            else:
                task.fn(*args, **kwargs)
        except BaseException as exc:  # the worker itself must never die of a handler
            return run.end(exc)
        return run.end(None)

    async def _coroutine(self, job: ClaimedJob, coro: Any) -> Any:
        """Await an ``async def`` handler, cancellable from the heartbeat (a timeout, a
        lost lease) through :meth:`interrupt`."""
        task = asyncio.current_task()
        self._coroutines[job.key] = (asyncio.get_running_loop(), task)
        try:
            if job.is_cancelled:
                coro.close()
                raise asyncio.CancelledError
            return await coro
        finally:
            self._coroutines.pop(job.key, None)

    def _transactional(
        self, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any], session: Session | None
    ) -> Outcome:
        if session is None:
            with Session(self.engine) as own:
                return self._drive(  # type: ignore[no-any-return]
                    self.core.transactional(run),
                    lambda: run.task.fn(*args, session=own, **kwargs),
                    own,
                )
        # The test's session (sqla_jobs.testing), behind a savepoint that a failure rolls
        # back; the test's own run writes the outcome.
        try:
            with session.begin_nested():
                run.task.fn(*args, session=session, **kwargs)
                session.flush()
                insert_pending(session)
        except BaseException as exc:
            return run.end(exc)
        return run.end(None)

    @contextlib.contextmanager
    def _signals(self, install: bool) -> Iterator[None]:
        if not install or threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            self.core.signalled(signal.Signals(signum).name)
            self.stop()

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _engine(bind: sa.Engine | str, concurrency: int) -> sa.Engine:
    if isinstance(bind, sa.Engine):
        return bind
    from ..db import create_engine

    # Claims, completions, heartbeat and maintenance each hold a connection briefly, and a
    # transactional task holds one while it runs.
    return create_engine(bind, pool_size=min(concurrency, 32) + 4)

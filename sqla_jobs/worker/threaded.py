"""The threaded worker: the core's steps carried out with threads and blocking calls.

.. code-block:: python

    worker = Worker(jobs, engine, queues=["previews", "webhooks"], concurrency=16)
    worker.run()              # until SIGINT/SIGTERM or worker.stop()
    worker.run_until_empty()  # tests and scripts: until no ready job is left

The thread that calls ``run`` runs the fetch loop; ``concurrency`` executor threads run
handlers, outside any transaction; the completer, the heartbeat and the listener each have
a thread of their own. What they do is decided in :mod:`._core`; this module only decides
how to wait, how to run a handler, and how to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue as queue_mod
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from ..db import create_engine
from ..session import JobSession, insert_pending
from ..steps import Steps
from . import _statements as statements
from . import _steps as s
from ._core import Run, StepHost
from ._driver import (
    DriverBase,
    Fence,
    Wakeups,
    autocommit_level,
    pool_options,
    run_session,
    still_autocommit,
)
from ._signals import relay, stopped_by_signals
from .job import ClaimedJob, Outcome, OutcomeKind

__all__ = ["Worker"]


#: Guards the check that a worker is not run twice at once.
_RUNS = threading.Lock()


class Worker(DriverBase[sa.Engine]):
    """Runs the jobs of some queues of one :class:`~sqla_jobs.Jobs` registry, with threads.

    ``Worker(jobs, bind, settings=None, **options)``: ``bind`` is an ``Engine`` or a
    database URL; ``settings`` a :class:`~sqla_jobs.WorkerSettings`, whose fields keyword
    arguments override. The worker uses a few pooled connections (claims, completions,
    heartbeat, maintenance, transactional tasks) and one dedicated LISTEN connection.
    """

    _wakeups: Wakeups[threading.Event]
    #: Whether :meth:`run` or :meth:`run_until_empty` runs now (see ``_run``).
    _active = False

    def _make_engine(self, bind: sa.Engine | str) -> sa.Engine:
        if isinstance(bind, sa.Engine):
            return bind
        self._owns_engine = True
        return create_engine(bind, **pool_options(self.settings.concurrency))

    def _prepare(self) -> None:
        self._claim_conn = statements.HeldConnection(self.engine)
        self._write_conn = statements.HeldConnection(self.engine)
        #: The heartbeat's own (see Conn.BEAT), taken as the duties start.
        self._beat_conn = statements.HeldConnection(self.engine)
        self._wakeups = Wakeups(threading.Event)
        self._inbox: queue_mod.SimpleQueue[ClaimedJob | None] = queue_mod.SimpleQueue()
        self._outbox: queue_mod.SimpleQueue[Outcome | None] = queue_mod.SimpleQueue()
        self._executors: list[threading.Thread] = []
        self._duties: list[threading.Thread] = []
        self._coroutines: dict[tuple[int, int], tuple[asyncio.AbstractEventLoop, Any]] = {}
        #: The fences of the transactional runs whose handlers run (see interrupt).
        self._fences: dict[tuple[int, int], Fence] = {}
        self._done = False
        #: Held by a transactional or durable run while the pool cannot give every
        #: handler a connection (see ``handler_connections``).
        n = self.handler_connections
        self._connection_slots = None if n is None else threading.BoundedSemaphore(n)
        relay.start()  # for stop() from the main thread, a signal handler maybe

    @property
    def stopping(self) -> bool:
        return self.core.stopping

    def stop(self, *, now: bool = False) -> None:
        """Ask the worker to stop: no new claims, then a graceful shutdown. Safe from any
        thread or signal handler.

        ``now=True`` (a second stop signal, SIGQUIT) skips what is left of the grace
        period: running handlers are told to stop and their jobs handed back at once, as
        when the grace period is over. It may follow a plain stop already under way.

        In the main thread it may be a signal handler, run between two bytecodes of the
        fetch loop, which waits on these very events there: setting one (which takes the
        event's lock, not reentrant) then waited for ever on a lock the thread itself
        held. From the main thread the events are set by the relay's thread instead (see
        :mod:`._signals`); the flag, which the fetch loop reads after every wait, at once.
        """
        self.core.stopping = True
        if now:
            self.core.hurried = True
        if threading.current_thread() is threading.main_thread():
            relay.call(self._wake_stopping)
        else:
            self._wake_stopping()

    def _wake_stopping(self) -> None:
        self._wakeups.stopping.set()
        self._wakeups.wake.set()
        if self.core.hurried:
            self._wakeups.hurry.set()

    def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until :meth:`stop`, SIGINT or SIGTERM, then shut down gracefully.

        :raises WorkerError: a duty kept failing (raised after the shutdown).
        """
        with self._signals(install_signal_handlers):
            self._run(listen=self.settings.listen, until_empty=False)

    def run_until_empty(self, *, wait_scheduled: float = 0.0, timeout: float | None = None) -> int:
        """Run until no job of these queues is ready or running here; return how many ran.

        Counted: the runs whose handler this call called, however they ended (a run cut
        off by the grace period too). Not counted: a claim settled before its handler was
        called (cancelled before it started, handed back unstarted at a stop).

        :param wait_scheduled: also wait for scheduled jobs (delays, retries) that fall due
            within this many seconds.
        :param timeout: give up (and shut down gracefully) after this many seconds.
        """
        before = self.processed
        deadline = None if timeout is None else time.monotonic() + timeout
        self._run(listen=False, until_empty=True, wait_scheduled=wait_scheduled, deadline=deadline)
        return self.processed - before

    def run_duty_once(self, name: str) -> Any:
        """One round of a side duty (``completer``, ``heartbeat``, ``listener``) or of the
        ``maintenance``, here and now; what it returned. For tests and tools."""
        core = self.core
        return self._drive(
            core.maintain() if name == "maintenance" else core.duties(listen=True)[name]()
        )

    def _run(self, **how: Any) -> None:
        with _RUNS:
            if self._active:
                # A second run (another thread) replaced the first's connections,
                # executors and events, and the two runs' duties wrote over each other.
                raise RuntimeError(
                    "Worker.run() is already running: one worker runs once at a time "
                    "(make another Worker to run more)"
                )
            self._active = True
        try:
            self._run_once(**how)
        finally:
            self._active = False

    def _run_once(self, **how: Any) -> None:
        self._prepare()
        try:
            self._drive(self.core.run(**how))
        finally:
            self._claim_conn.close()
            self._write_conn.close()
            self._beat_conn.close()
            if self._owns_engine:
                # Made from a URL, the pool is the worker's: its connections close with the
                # run (they stayed open until the worker was collected; the next run
                # connects again).
                self.engine.dispose()

    # -- carrying out steps ----------------------------------------------------------------

    def _drive(
        self, steps: s.Steps, handler: Callable[[], Any] | None = None, session: Any = None
    ) -> Any:
        """Carry out a core generator's steps; return what it returns."""
        stepper = s.Stepper(steps)
        while (step := stepper.next()) is not None:
            try:
                stepper.result = self._do(step, handler, session)
            except BaseException as exc:
                stepper.error = exc
        return stepper.value

    def _do(self, step: s.Step, handler: Callable[[], Any] | None, session: Any) -> Any:
        events = self._wakeups
        match step:
            case s.Io(fn, args, s.Conn.CLAIM):
                return self._claim_conn.run(fn, *args)
            case s.Io(fn, args, s.Conn.WRITE):
                return self._write_conn.run(fn, *args)
            case s.Io(fn, args, s.Conn.BEAT):
                return self._beat_conn.run(fn, *args)
            case s.Io(fn, args, _):
                with self.engine.begin() as conn:
                    return statements.in_read_committed(conn, fn, args)
            case s.Sleep(seconds):
                events.wake.wait(seconds)
                events.wake.clear()
            case s.Pause(seconds, stoppable):
                (events.stopping.wait if stoppable else time.sleep)(seconds)
            case s.WaitWritten() as wait:
                while (seconds := wait.waiting(self.core)) > 0:
                    events.written.clear()
                    if self.core.unwritten > 0:
                        events.written.wait(seconds)
            case s.TakeOutcomes(limit, timeout):
                return self._take_outcomes(limit, timeout)
            case s.Tick(seconds):
                poked = events.poke.wait(seconds)
                events.poke.clear()
                return None if self._done else poked
            case s.WaitIdle(seconds, hurry):
                return self._wait_idle(seconds, hurry)
            case s.Listen(channel):
                # A connection of the engine's own (same URL, same connect args), taken out
                # of the pool for good: LISTEN belongs to one session.
                pooled = self.engine.raw_connection()
                self._listen_conn = raw = pooled.driver_connection
                pooled.detach()
                raw.rollback()  # type: ignore[union-attr]
                raw.autocommit = True  # type: ignore[union-attr]
                raw.execute(statements.listen_sql(channel))  # type: ignore[union-attr]
            case s.Notifications(timeout):
                notes = self._listen_conn.notifies(timeout=timeout, stop_after=1)
                return [n.payload for n in notes]
            case s.Unlisten():
                conn, self._listen_conn = self._listen_conn, None
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
            case s.StartDuties(names):
                # Before any handler runs: one that uses the worker's engine would
                # otherwise find it first. Failing, the first beat connects.
                with contextlib.suppress(Exception):
                    self._beat_conn.run(_connected)
                n = self.settings.concurrency
                self._executors = [_thread(f"executor-{i}", self._executor) for i in range(n)]
                self._duties = [
                    _thread(name, self._drive, self.core.supervised(name)) for name in names
                ]
            case s.EndDuties():
                self._done = True
                events.poke.set()
                self._outbox.put(None)  # the completer ends once it has written the rest
                for thread in self._duties:
                    thread.join(timeout=None if thread.name.endswith("completer") else 2.0)
            case s.CallHandler():
                return handler() if handler is not None else None
            case s.OnSession(fn, args):
                return fn(session, *args)
            case s.Commit():
                session.commit()
            case s.Rollback():
                session.rollback()
        return None

    def _take_outcomes(self, limit: int, timeout: float | None) -> list[Outcome | None]:
        outbox = self._outbox
        try:
            taken = [outbox.get(timeout=timeout) if timeout != 0 else outbox.get_nowait()]
        except queue_mod.Empty:
            return []
        with contextlib.suppress(queue_mod.Empty):
            while len(taken) < limit:
                taken.append(outbox.get_nowait())
        return taken

    def _wait_idle(self, seconds: float, hurriable: bool) -> bool:
        """Let the executors finish what they run, at most ``seconds`` and, if
        ``hurriable``, no longer once the stop is hurried: whether they did. Joined in
        short slices, so that a hurry (a second signal, whose handler sets the event from
        the relay's thread) ends the wait within one."""
        deadline = time.monotonic() + seconds
        hurry = self._wakeups.hurry
        for _ in self._executors:
            self._inbox.put(None)
        for thread in self._executors:
            while thread.is_alive() and not (hurriable and hurry.is_set()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                thread.join(timeout=min(left, 0.05))
        return not any(t.is_alive() for t in self._executors)

    # -- the core's callbacks --------------------------------------------------------------

    def dispatch(self, claimed: list[ClaimedJob]) -> None:
        for job in claimed:
            self._inbox.put(job)

    def interrupt(self, job: ClaimedJob) -> None:
        # A thread cannot be stopped (it is told through job.cancelled); a coroutine that an
        # executor thread runs can be cancelled on its loop. A transactional run holding
        # its job's row locked has its transaction ended (see Fence.release), from a
        # thread of its own: this is called from the heartbeat and the fetch loop.
        fence = self._fences.get(job.key)
        if fence is not None and fence.holder is not None:
            _thread("release", fence.release, self.engine, self.core.queries)
        entry = self._coroutines.get(job.key)
        if entry is not None:
            loop, task = entry
            with contextlib.suppress(RuntimeError):  # its loop just closed
                loop.call_soon_threadsafe(task.cancel)

    # -- running handlers ------------------------------------------------------------------

    def _executor(self) -> None:
        core = self.core
        # Its run's inbox, kept: a thread cut off by a stop's grace period runs on, and
        # when its handler returned it took the next run's jobs (from the inbox made for
        # that run) as one of its executors, past that run's concurrency.
        inbox = self._inbox
        while (job := inbox.get()) is not None:
            try:
                outcome = self._execute(job)
            except BaseException as exc:  # the worker's own failure around a run
                outcome = core.crashed(job, exc)
            if outcome is not None:
                core.finished(job, outcome)

    def execute(self, job: ClaimedJob, *, session: Session | None = None) -> Outcome:
        """Run one claimed job as this worker would, and say how it ended.

        Sets :func:`~sqla_jobs.current_job`, fires the events, and maps exceptions to an
        outcome; the caller writes the outcome (the worker hands it to its completer). A
        transactional task runs in a session (the registry's ``session_factory``'s, or a
        plain one on the worker's engine) that commits with the job's completion, or,
        given ``session`` (``sqla_jobs.testing`` does this inside a test's
        transaction), in a session of its own on that session's connection, behind a
        savepoint that a failure rolls back.
        """
        return self._execute(job, session) or Outcome(OutcomeKind.SETTLED, job)

    def _execute(self, job: ClaimedJob, session: Session | None = None) -> Outcome | None:
        run = self.core.start(job)
        if not isinstance(run, Run):
            return run  # an unknown task's failure, or None: handed back before it started
        if run.task.transactional or run.task.durable:
            slots = self._connection_slots if session is None else None
            with slots or contextlib.nullcontext():
                if run.task.transactional:
                    return self._transactional(run, session)
                return self._durable(run, session)
        with run:
            result = run.task.fn(*run.args, **run.kwargs)
            # A plain function may return a coroutine too: a decorator's wrapper around an
            # async def. Left unawaited, its job counted as done and its body never ran.
            if run.task.is_async or inspect.iscoroutine(result):
                result = asyncio.run(self._coroutine(job, result))
            run.value = result
        return run.outcome

    async def _coroutine(self, job: ClaimedJob, coro: Any) -> Any:
        """Await an ``async def`` handler, cancellable by :meth:`interrupt`."""
        self._coroutines[job.key] = (asyncio.get_running_loop(), asyncio.current_task())
        try:
            if job.is_cancelled:
                coro.close()
                raise asyncio.CancelledError
            return await coro
        finally:
            self._coroutines.pop(job.key, None)

    def _transactional(self, run: Run, session: Session | None) -> Outcome:
        fn, args, kwargs = run.task.fn, run.args, run.kwargs
        if run.task.is_async:
            # Its session would be a plain Session, which it cannot await; called, it
            # returned a coroutine that nobody ran, and the job counted as done.
            with run:
                raise TypeError(
                    f"task {run.task.name!r} is a transactional async def handler, which "
                    "awaits its session: it runs on the asyncio worker (sqla-jobs worker "
                    "--asyncio, or AsyncWorker)"
                )
            assert run.outcome is not None
            return run.outcome
        if session is None:
            try:
                made = run_session(self.jobs, self._in_transactions(), Session)
            except Exception as exc:  # the app's session factory failed, or misfits
                return run.end(exc)
            with made as own:

                def handler() -> Any:
                    # The run's transaction begins here, before the handler (see Fence).
                    fence = self._fences[run.job.key] = Fence(own, self.core.queries, run.job)
                    if run.job.is_cancelled:  # stopped meanwhile: interrupt() missed it
                        self.interrupt(run.job)
                    with fence.handling():
                        return fn(*args, session=own, **kwargs)

                try:
                    outcome: Outcome = self._drive(self.core.transactional(run), handler, own)
                finally:
                    if (done := self._fences.pop(run.job.key, None)) is not None:
                        done.close()
                return outcome
        # The test's transaction (sqla_jobs.testing): the test writes the outcome with the
        # real statements.
        try:
            joined = self._joined_session(session)
        except Exception as exc:  # the app's session factory failed, or misfits
            return run.end(exc)
        if joined is session:
            # The factory hands out the test's own session (Flask-SQLAlchemy's scoped
            # db.session): behind a savepoint that a failure rolls back.
            with run, session.begin_nested():
                run.value = fn(*args, session=session, **kwargs)
                session.flush()
                insert_pending(session)
            assert run.outcome is not None
            return run.outcome
        # A session of the run's own on the test's connection, whose transaction is a
        # savepoint: a failure, or the handler's own rollback, rolls back its writes only.
        # Given the test's session itself, the handler's rollback rolled back the whole
        # test (its rows, the job being run), and the run then failed on a closed
        # transaction.
        with joined, run:
            try:
                fence = Fence(joined, self.core.queries, run.job)
                try:
                    with fence.handling():
                        value = fn(*args, session=joined, **kwargs)
                    joined.flush()
                    insert_pending(joined)
                finally:
                    fence.close()
                joined.commit()  # releases its savepoint: the writes join the test's
            except BaseException:
                joined.rollback()
                raise
            run.value = value
        # What the handler wrote, through its own session, is newer than the test's
        # objects: they load again when next read.
        session.expire_all()
        assert run.outcome is not None
        return run.outcome

    def _joined_session(self, session: Session) -> Session:
        """The session a transactional run gets inside a test's transaction, on the test
        session's connection: a ``JobSession``, or what the registry's ``session_factory``
        makes, as the worker would. One of a ``sessionmaker`` gets a savepoint for a
        transaction (``join_transaction_mode="create_savepoint"``); a factory of another
        kind makes its session as it does (Flask-SQLAlchemy's ``db.session`` is the test's
        session itself)."""
        conn = session.connection()
        factory = self.jobs.session_factory
        if factory is None:
            return JobSession(bind=conn, join_transaction_mode="create_savepoint", jobs=self.jobs)
        if isinstance(factory, sessionmaker):
            made = factory(bind=conn, join_transaction_mode="create_savepoint")
        else:
            made = factory(bind=conn)
        if not isinstance(made, Session):
            raise TypeError(
                f"Jobs(session_factory=...) made a {type(made).__qualname__}, and this "
                "worker runs transactional handlers in a Session"
            )
        return made

    def _in_transactions(self) -> sa.Engine:
        """The engine the runs' own sessions are on: the worker's, or, where it is in
        autocommit, the worker's at the server's default level (see
        :func:`~._driver.autocommit_level`). Asked once per worker, at its first such run.

        :raises ValueError: the engine stays in autocommit (see
            :func:`~._driver.still_autocommit`): the run is refused with it."""
        engine: sa.Engine | None = self._run_engine
        if engine is None:
            with self.engine.connect() as conn:
                level = autocommit_level(conn)
            engine = self.engine
            if level is not None:
                engine = engine.execution_options(isolation_level=level)
                with engine.connect() as conn:
                    still_autocommit(conn)
            self._run_engine = engine
        return engine

    def _durable(self, run: Run, session: Session | None) -> Outcome:
        """A durable task: its handler gets a step runner on this worker's engine."""
        job, task = run.job, run.task
        try:
            engine = self._in_transactions()
        except Exception as exc:  # an engine that stays in autocommit
            return run.end(exc)
        steps = Steps(
            engine,
            self.jobs.step_queries,
            job,
            StepHost(self.core, job),
            lambda bind: run_session(self.jobs, bind, Session),
        )
        try:
            with run:
                if session is not None:
                    raise TypeError(
                        f"task {task.name!r} is durable: its steps commit on connections of "
                        "their own, which a test's open transaction would keep waiting; "
                        "run it with Worker(...).run_until_empty() on committed jobs"
                    )
                if task.is_async:
                    raise TypeError(
                        f"task {task.name!r} is a durable async def handler, whose steps are "
                        "awaited: it runs on the asyncio worker (sqla-jobs worker --asyncio, "
                        "or AsyncWorker)"
                    )
                run.value = task.fn(*run.args, steps=steps, **run.kwargs)
        finally:
            steps.close()
        assert run.outcome is not None
        return run.outcome

    def _signals(self, install: bool) -> contextlib.AbstractContextManager[None]:
        return stopped_by_signals(install, lambda: [self.core], self.stop)


def _connected(conn: sa.Connection) -> None:
    """Nothing: a held connection's ``run(_connected)`` only takes its connection."""


def _thread(name: str, target: Callable[..., Any], *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=f"sqla-jobs-{name}", daemon=True)
    thread.start()
    return thread

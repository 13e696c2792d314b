"""Tasks and the registry that binds them to one jobs table.

.. code-block:: python

    jobs = Jobs(Job)

    @jobs.task(queue="previews", max_attempts=5, retry=Backoff(base=2, cap=600))
    def fetch_preview(code: str) -> None: ...

A job stores a task *name* and its arguments as JSON. Arguments are checked against the
handler's signature when the job is enqueued, in the caller's process, so a typo fails
the web request that made it instead of a worker an hour later.

:class:`Jobs` lives above the enqueue paths it calls (enqueue on a Core connection in
:mod:`sqla_jobs.connection`, results and groups in :mod:`sqla_jobs.flow`), so this module
imports them and they do not import it: no import runs in a circle. What they need of a
task lives below them, in ``_tasks`` (tasks, their options, the argument checks), and is
re-exported here; where one of them must tell a registry from a session it tests for
``_tasks.Registry``, an empty base of :class:`Jobs`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Literal, Protocol, overload

import sqlalchemy as sa

from . import connection as core
from . import flow as _flow
from . import steps as _steps
from ._queries import Queries
from ._step_queries import StepQueries
from ._storable import DURATION_MAX_SECONDS, finite_seconds, shorten, text_problem
from ._tasks import (
    _READY,
    _TASK_OPTION_SET,
    Backoff,
    ConfiguredTask,
    DurableTask,
    EnqueueOptions,
    ManyOptions,
    P,
    R,
    Registry,
    RetryPolicy,
    SessionFactory,
    T,
    Task,
    TaskArgs,
    TaskOptions,
    TransactionalTask,
    Unique,
    UniqueScope,
    _check_max_attempts,
    _check_on_parent_failure,
    _check_priority,
    _check_queue,
    _check_unique_key,
    _run_at,
    _TransactionalDecorator,
    _unique_fields,
    _utcnow,
    check_meta,
    check_schedule_name,
    check_unique_scope,
    derive_unique_key,
    flat_unique,
    keep_seconds,
    many_options,
)
from .cron import Schedule, check_cron, check_timezone
from .errors import EnqueueError, UnknownTaskError
from .events import Around, Events, RunWrapper
from .model import KEEP_KEY, RUN_ANYWAY_KEY, JobStatus, check_complete
from .throttle import ConcurrencyKey, QueueLimits, QueueOptions, concurrency_key_of

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session
    from typing_extensions import Unpack

    from .steps import AsyncSteps, Steps

log = logging.getLogger("sqla_jobs.enqueue")

__all__ = [
    "Backoff",
    "ConfiguredTask",
    "DurableTask",
    "EnqueueOptions",
    "Jobs",
    "ManyOptions",
    "RetryPolicy",
    "SessionFactory",
    "Task",
    "TaskArgs",
    "TaskOptions",
    "TransactionalTask",
    "Unique",
]


class _DurableDecorator(Protocol):
    """What ``@jobs.task(durable=True)`` returns, for a type checker."""

    @overload
    def __call__(self, fn: Callable[Concatenate[Steps, P], R], /) -> DurableTask[P, R]: ...

    @overload
    def __call__(self, fn: Callable[Concatenate[AsyncSteps, P], R], /) -> DurableTask[P, R]: ...

    @overload
    def __call__(self, fn: Callable[..., R], /) -> Task[..., R]: ...


class Jobs(Registry):
    """The registry of tasks bound to one jobs table, and the queue's settings.

    One ``Jobs`` per job model. Sessions take it (``sessionmaker(..., jobs=jobs)``) to
    resolve task names, workers take it to find handlers, and its methods act on the queue.

    :param model: a ``JobMixin`` model.
    :param default_queue: queue of tasks that do not name one.
    :param max_attempts: default for tasks that do not set it.
    :param retry: default retry policy (:class:`Backoff` by default).
    :param keep_done: ``None`` deletes finished jobs at once (cheapest); a ``timedelta``
        keeps them as ``done`` for that long before they are pruned.
    :param keep_dead: how long dead and cancelled jobs are kept before they are pruned.
    :param session_factory: makes the session a transactional handler runs in, so that it
        is the application's own (its session class with ``enqueue``, its events, its
        ``info``): called as ``session_factory(bind=engine)`` with the worker's engine, as
        a ``sessionmaker`` is; an ``async_sessionmaker`` for the asyncio worker. It must
        make a new session, not one in a transaction: the worker begins it, commits the
        handler's writes with the job's guarded completion, or rolls them back, and closes
        it. Default: a plain ``Session`` (``AsyncSession``) on the worker's engine. Also
        settable later, as :attr:`session_factory` (``sqla_jobs.flask`` does that).
    """

    def __init__(
        self,
        model: type[Any],
        *,
        default_queue: str = "default",
        max_attempts: int = 5,
        retry: RetryPolicy | None = None,
        keep_done: timedelta | None = None,
        keep_dead: timedelta = timedelta(days=7),
        session_factory: SessionFactory | None = None,
    ) -> None:
        self.model = model
        self.table: sa.Table = check_complete(model)
        # Plain values (an enum member's): every path stores them alike (see _check_queue).
        default_queue = _check_queue(default_queue)
        max_attempts = _check_max_attempts(max_attempts)
        for label, keep in (("keep_done", keep_done), ("keep_dead", keep_dead)):
            if keep is None and label == "keep_done":
                continue
            if not isinstance(keep, timedelta) or not (
                timedelta(0) <= keep <= timedelta(seconds=DURATION_MAX_SECONDS)
            ):
                raise ValueError(f"{label} must be a timedelta from 0 to 100 years, got {keep!r}")
        self.default_queue = default_queue
        self.max_attempts = max_attempts
        self.retry: RetryPolicy = retry or Backoff()
        self.keep_done = keep_done
        self.keep_dead = keep_dead
        self.tasks: dict[str, Task[Any, Any]] = {}
        self.schedules: dict[str, Schedule] = {}
        #: Hooks for metrics and logs; see :mod:`sqla_jobs.events`.
        self.events = Events()
        self._queries: Queries | None = None
        self._step_queries: StepQueries | None = None
        #: Limits declared with :meth:`queue`.
        self.queue_limits: dict[str, QueueLimits] = {}
        #: Queues of tasks that declare a ``concurrency_key``.
        self._keyed_queues: set[str] = set()
        #: Makes the session of a transactional run (see the parameter); None: a plain one.
        self.session_factory = session_factory

    def __repr__(self) -> str:
        return f"<Jobs table={self.table.fullname!r} tasks={sorted(self.tasks)}>"

    @property
    def queries(self) -> Queries:
        """The statements of this table, built once."""
        if self._queries is None:
            self._queries = Queries(self.table, keep_done=self.keep_done is not None)
        return self._queries

    @property
    def step_queries(self) -> StepQueries:
        """The statements of durable steps (``<table>_steps``), built on first use."""
        if self._step_queries is None:
            self._step_queries = StepQueries(self.table)
        return self._step_queries

    # The overloads give a type checker the handler's signature: ``Task[P, R]``. A
    # transactional handler that takes the session first becomes a ``TransactionalTask``
    # over the rest of its parameters (what an enqueue passes); one that takes it anywhere
    # else cannot be expressed with ``ParamSpec`` and becomes a ``Task[..., R]``, checked
    # at run time only.

    @overload
    def task(  # type: ignore[overload-overlap]
        self,
        fn: Callable[P, R],
        /,
        *,
        transactional: Literal[False] = False,
        durable: Literal[False] = False,
        **options: Unpack[TaskOptions],
    ) -> Task[P, R]: ...

    @overload
    def task(
        self,
        fn: Callable[Concatenate[Steps, P], R],
        /,
        *,
        durable: Literal[True],
        **options: Unpack[TaskOptions],
    ) -> DurableTask[P, R]: ...

    @overload
    def task(
        self,
        fn: Callable[Concatenate[AsyncSteps, P], R],
        /,
        *,
        durable: Literal[True],
        **options: Unpack[TaskOptions],
    ) -> DurableTask[P, R]: ...

    @overload
    def task(  # type: ignore[overload-overlap]
        self,
        fn: Callable[Concatenate[Session, P], R],
        /,
        *,
        transactional: Literal[True],
        **options: Unpack[TaskOptions],
    ) -> TransactionalTask[P, R]: ...

    @overload
    def task(  # type: ignore[overload-overlap]
        self,
        fn: Callable[Concatenate[AsyncSession, P], R],
        /,
        *,
        transactional: Literal[True],
        **options: Unpack[TaskOptions],
    ) -> TransactionalTask[P, R]: ...

    @overload
    def task(
        self, fn: Callable[..., R], /, *, transactional: bool, **options: Unpack[TaskOptions]
    ) -> Task[..., R]: ...

    @overload
    def task(
        self,
        fn: None = None,
        /,
        *,
        transactional: Literal[False] = False,
        durable: Literal[False] = False,
        **options: Unpack[TaskOptions],
    ) -> Callable[[Callable[P, R]], Task[P, R]]: ...

    @overload
    def task(
        self, fn: None = None, /, *, durable: Literal[True], **options: Unpack[TaskOptions]
    ) -> _DurableDecorator: ...

    @overload
    def task(
        self, fn: None = None, /, *, transactional: Literal[True], **options: Unpack[TaskOptions]
    ) -> _TransactionalDecorator: ...

    @overload
    def task(
        self, fn: None = None, /, *, transactional: bool, **options: Unpack[TaskOptions]
    ) -> Callable[[Callable[..., R]], Task[..., R]]: ...

    def task(
        self,
        fn: Callable[P, R] | None = None,
        *,
        transactional: bool = False,
        durable: bool = False,
        **options: Unpack[TaskOptions],
    ) -> Any:
        """Register a handler, as ``@jobs.task`` or ``@jobs.task(queue=..., ...)``.

        :param name: the stored name; defaults to ``module.qualname``. Keep it stable: jobs
            already in the table refer to it.
        :param timeout: seconds a run may take before it counts as failed.
        :param keep_result: keep the handler's return value (JSON) on the finished row,
            for :meth:`result` and group callbacks: ``True`` (for ``keep_done``, or a day)
            or a ``timedelta``. A return value that is not JSON fails the job, dead.
        :param transactional: the handler takes a ``session``; its writes commit in the same
            transaction that completes the job, so they happen exactly once.
        :param unique: ``True`` or a :class:`Unique` (without ``key``): the task's jobs
            are unique by default, as with the enqueue option (which, given at an
            enqueue, wins). The flat ``unique_for``, ``unique_states`` and
            ``unique_on_conflict`` are its deprecated spellings; any of them makes the
            jobs unique. The keywords are :class:`TaskOptions`.
        :param concurrency_key: a function of the job's arguments (as keywords) that
            returns its key, or None; at most ``key_concurrency`` jobs of the queue with the
            same key run at once (1 unless :meth:`queue` says otherwise). See
            :mod:`sqla_jobs.throttle`.
        """
        unknown = options.keys() - _TASK_OPTION_SET
        if unknown:
            raise TypeError(f"task() got an unexpected keyword argument {min(unknown)!r}")
        try:
            given = flat_unique(options)
        except EnqueueError as exc:
            raise ValueError(str(exc)) from None
        if given.get("unique_key") is not None:
            raise ValueError(
                "a task's jobs cannot share one unique key: give Unique(key=...) at the "
                "enqueue, or leave the key derived from each job's arguments"
            )
        name: str | None = given.get("name")
        queue: str | None = given.get("queue")
        max_attempts: int | None = given.get("max_attempts")
        retry: RetryPolicy | None = given.get("retry")
        priority: int = given.get("priority", 0)
        timeout: float | None = given.get("timeout")
        concurrency_key: ConcurrencyKey | None = given.get("concurrency_key")
        keep_result: bool | float | timedelta = given.get("keep_result", False)
        unique = given.get("unique", False)
        unique_states = given.get("unique_states")
        unique_on_conflict = given.get("unique_on_conflict")
        scope = check_unique_scope(
            given.get("unique_for"), unique_states, unique_on_conflict, ValueError
        )
        if scope is None and (unique_states is not None or unique_on_conflict is not None):
            unique = True  # the plain rule, asked for explicitly

        def register(f: Callable[P, R]) -> Task[P, R]:
            task_name = name or f"{f.__module__}.{f.__qualname__}"
            if not isinstance(task_name, str):
                raise ValueError(f"a task name must be a string, got {task_name!r}")
            problem = text_problem(task_name)
            if problem is not None:
                raise ValueError(f"task name {shorten(task_name)} {problem}")
            if task_name in self.tasks:
                raise ValueError(f"a task named {task_name!r} is already registered")
            q = _check_queue(queue if queue is not None else self.default_queue)
            attempts = _check_max_attempts(
                max_attempts if max_attempts is not None else self.max_attempts
            )
            prio = _check_priority(priority)
            if timeout is not None and not finite_seconds(timeout):
                # NaN never fired, True was one second, "5" failed on a comparison.
                raise ValueError(
                    f"task {task_name!r}: timeout must be a finite number of seconds > 0, "
                    f"got {timeout!r}"
                )
            if concurrency_key is not None and not callable(concurrency_key):
                raise ValueError(
                    f"task {task_name!r}: concurrency_key must be a function of the task's "
                    f"arguments, got {concurrency_key!r}"
                )
            try:
                keep_seconds(keep_result, None)
            except EnqueueError as exc:
                raise ValueError(f"task {task_name!r}: {exc}") from None
            cls = TransactionalTask if transactional else DurableTask if durable else Task
            t: Task[P, R] = cls(
                fn=f,
                name=task_name,
                registry=self,
                queue=q,
                max_attempts=attempts,
                retry=retry or self.retry,
                priority=prio,
                timeout=timeout,
                transactional=transactional,
                durable=durable,
                is_async=inspect.iscoroutinefunction(f),
                unique=bool(unique) or scope is not None,
                unique_scope=scope,
                concurrency_key=concurrency_key,
                keep_result=keep_result,
            )
            self.tasks[task_name] = t
            if concurrency_key is not None:
                self._keyed_queues.add(q)
            return t

        return register(fn) if fn is not None else register

    def queue(self, name: str, **limits: Unpack[QueueOptions]) -> QueueLimits:
        """Declare a queue's limits, enforced by every worker of this registry.

        :param concurrency: most jobs of the queue running at once, across all workers.
        :param rate: most jobs started per period, in any window of it: ``"100/minute"``,
            ``"20/s"``, ``"5/10s"``, ``"1000/hour"``, ``"10/day"``. A job that cannot start
            yet stays ready, and no attempt is spent.
        :param key_concurrency: most running jobs with the same ``concurrency_key`` (1 when
            not given); giving it makes the queue take keyed jobs of any task.
        :param key_rate: most jobs with the same ``concurrency_key`` started per period, in
            any window of it (``"10/minute"``, as ``rate``); jobs without a key are not
            counted. Given alone, it is the key's only limit (no ``key_concurrency``).
        :param key_order: ``"fifo"``: the jobs of one key start in the order they were
            enqueued (by id), one at a time, across every worker; other keys run in
            parallel. A job waits while an earlier job of its key is scheduled (a delay, or
            a retry: a retrying head holds its key), ready or running. Priority orders the
            heads of different keys, never the jobs of one key.
        :param on_head_failure: with ``key_order``, what a head that ends dead or
            cancelled does to the rest of its key: ``"hold"`` them (the default) until an
            operator retries or deletes it (``admin.blocked_keys`` and ``sqla-jobs queues
            blocked`` list such keys), or ``"continue"`` with the next job of the key.
        :param fair: ``True``: each claim shares its jobs between the keys of the queue
            (the tasks' ``concurrency_key``) in turn, instead of taking the oldest first, so
            that one key's burst of 100,000 jobs does not hold back every other key. Within
            a key, jobs go in id order. Goes alone (no other limit) in this release.
        :param weights: with ``fair``: a mapping of key to weight (1 to 100; 1 when not
            listed): a key's share of each claim is proportional to its weight.

        Raises ``ValueError`` for a bad limit or a queue declared twice. See
        :mod:`sqla_jobs.throttle` for how the limits are enforced, and what they cost.
        """
        try:
            name = _check_queue(name)  # an enum member's value: the name the jobs carry
        except EnqueueError as exc:
            raise ValueError(str(exc)) from None
        if name in self.queue_limits:
            raise ValueError(f"queue {name!r} is already declared")
        declared = QueueLimits.declare(name, **limits)
        self.queue_limits[name] = declared
        return declared

    def around_run(self, wrapper: RunWrapper) -> RunWrapper:
        """Run every handler of this registry inside ``wrapper(job)``, a context manager:
        the application's context (Flask's ``app.app_context()``, an error reporter's
        scope, a tenant or locale in a context variable). Usable as a decorator; returns
        ``wrapper``.

        .. code-block:: python

            jobs.around_run(lambda job: app.app_context())

            @jobs.around_run
            @contextlib.contextmanager
            def tenant(job: ClaimedJob) -> Iterator[None]:
                token = TENANT.set(job.meta["tenant"])
                try:
                    yield
                finally:
                    TENANT.reset(token)

        Entered right before the handler is called and exited when its run ends, both in
        the handler's own context (its executor thread, or its asyncio task), so a
        context variable it sets is seen by ``async def`` handlers, by plain functions the
        asyncio worker runs in threads, and by a transactional handler's session (made
        inside it, so ``Jobs(session_factory=...)`` may use the context), and is reset
        before the next run. Its ``__exit__`` gets the handler's exception, if any, and
        cannot change how the run ended. If entering raises, the handler is not called
        and the run fails with that error (retried like any failure). Wrappers nest in
        the order given, the first outermost. The hook behind it is a run hook (see
        :mod:`sqla_jobs.events`): ``jobs.events.run_hooks`` lists it.
        """
        self.events.add_run_hook(Around(wrapper))
        return wrapper

    def limits(self, queue: str) -> QueueLimits:
        """The limits of a queue, as declared with :meth:`queue` and by keyed tasks."""
        declared = self.queue_limits.get(queue)
        if declared is None:
            declared = QueueLimits(queue)
        # A keyed task makes its queue keyed (one per key), unless the queue shares its
        # claims between the keys (fair): the keys are for the share there.
        if queue in self._keyed_queues and not declared.keyed and not declared.fair:
            declared = dataclasses.replace(declared, keyed=True)
        return declared

    # -- enqueue on a Core connection (see sqla_jobs.connection) --------------------------

    @overload
    def enqueue(
        self,
        connection: sa.Connection,
        task: Task[P, Any] | ConfiguredTask[P, Any],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> int: ...

    @overload
    def enqueue(
        self,
        connection: AsyncConnection,
        task: Task[P, Any] | ConfiguredTask[P, Any],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Coroutine[Any, Any, int]: ...

    @overload
    def enqueue(
        self, connection: sa.Connection, task: str, /, *args: Any, **kwargs: Any
    ) -> int: ...

    @overload
    def enqueue(
        self, connection: AsyncConnection, task: str, /, *args: Any, **kwargs: Any
    ) -> Coroutine[Any, Any, int]: ...

    def enqueue(
        self,
        connection: sa.Connection | AsyncConnection,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        /,
        *args: Any,
        **kwargs: Any,
    ) -> int | Coroutine[Any, Any, int]:
        """INSERT one job now, on a Core ``Connection`` (or, awaited, an
        ``AsyncConnection``), in its transaction; return the job's id.

        For code without an ORM session (scripts, services, pipelines): the job is
        checked as ``session.enqueue`` checks it, and written at once with one prepared
        statement. It commits or rolls back with the connection's transaction; on a
        connection in autocommit it is committed by this one round trip. Nothing is
        committed for you. Options are bound with ``task.with_options(...)`` (or given
        as keywords, unchecked by a type checker, as for ``session.enqueue``). A unique job
        whose key a live job holds is not inserted: that job's id is returned. A scoped
        one (``unique_for``, ...) returns the holder's id too: replaced, kept, or the
        finished job whose period still holds the key (two statements, not one).
        """
        if isinstance(connection, sa.Connection):
            return core.enqueue(connection, self, task, args, kwargs)
        return core.enqueue_async(core.async_connection(connection), self, task, args, kwargs)

    @overload
    def enqueue_many(
        self,
        connection: sa.Connection,
        task: T,
        arguments: Iterable[TaskArgs[T]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int: ...

    @overload
    def enqueue_many(
        self,
        connection: sa.Connection,
        task: ConfiguredTask[P, R],
        arguments: Iterable[TaskArgs[Task[P, R]]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int: ...

    @overload
    def enqueue_many(
        self,
        connection: sa.Connection,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        arguments: Iterable[Mapping[str, Any]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int: ...

    @overload
    def enqueue_many(
        self,
        connection: AsyncConnection,
        task: T,
        arguments: Iterable[TaskArgs[T]],
        /,
        **options: Unpack[ManyOptions],
    ) -> Coroutine[Any, Any, int]: ...

    @overload
    def enqueue_many(
        self,
        connection: AsyncConnection,
        task: ConfiguredTask[P, R],
        arguments: Iterable[TaskArgs[Task[P, R]]],
        /,
        **options: Unpack[ManyOptions],
    ) -> Coroutine[Any, Any, int]: ...

    @overload
    def enqueue_many(
        self,
        connection: AsyncConnection,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        arguments: Iterable[Mapping[str, Any]],
        /,
        **options: Unpack[ManyOptions],
    ) -> Coroutine[Any, Any, int]: ...

    def enqueue_many(
        self,
        connection: sa.Connection | AsyncConnection,
        task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
        arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
        /,
        **options: Unpack[ManyOptions],
    ) -> int | Coroutine[Any, Any, int]:
        """INSERT many jobs of one task now, in one statement, on a Core ``Connection`` (or,
        awaited, an ``AsyncConnection``); return how many were inserted.

        The rows are ``task.args(...)`` or mappings of keyword arguments, and the options
        those of ``session.enqueue_many``. Every row is checked before any is written;
        with ``unique=True``, rows whose key a live job holds are skipped (and not
        counted).
        """
        given = many_options(options)
        if isinstance(connection, sa.Connection):
            return core.enqueue_many(connection, self, task, arguments, given)
        return core.enqueue_many_async(
            core.async_connection(connection), self, task, arguments, given
        )

    def periodic(
        self,
        cron: str,
        *,
        name: str | None = None,
        args: Mapping[str, Any] | None = None,
        queue: str | None = None,
        priority: int | None = None,
        tz: str | None = None,
    ) -> Callable[[T], T]:
        """Enqueue a task on a cron schedule, from the workers themselves.

        Stack it on ``@jobs.task``. The expression is read in UTC, or in the IANA time zone
        ``tz`` (``"Europe/Paris"``: 9 a.m. there, summer and winter). The expression, the
        time zone and the arguments are checked here, at declaration: a bad one fails at
        import, not at 3 a.m. See :mod:`sqla_jobs.periodic` and :mod:`sqla_jobs.cron`.
        """
        check_timezone(tz)
        check_cron(cron, tz=tz)

        def register(task: T) -> T:
            if not isinstance(task, Task):
                raise TypeError("@jobs.periodic goes above @jobs.task")
            schedule_name = name or task.name
            if not isinstance(schedule_name, str):
                raise ValueError(f"schedule name must be a string, got {schedule_name!r}")
            check_schedule_name(
                schedule_name,
                "" if name else " (it is the task's name: pass name= to @jobs.periodic)",
            )
            if schedule_name in self.schedules:
                raise ValueError(f"a schedule named {schedule_name!r} is already declared")
            # Checked as an enqueue would be; nothing is enqueued (no enqueue hooks).
            self.job_values(
                task, (), dict(args or {}), queue=queue, priority=priority, meta_prepared=True
            )
            self.schedules[schedule_name] = Schedule(
                schedule_name, task.name, cron, dict(args or {}), queue, priority, tz
            )
            return task

        return register

    # -- results and workflows (see sqla_jobs.flow) ---------------------------------------

    def result(
        self,
        engine: sa.Engine,
        job_id: int,
        *,
        timeout: float | None = None,
        listen: bool | None = None,
    ) -> Any:
        """Wait for a job enqueued with ``keep_result`` and return what its handler
        returned.

        LISTENs on the table's results channel, looks at the row, and looks again at each
        notification about this job (sent when it finishes), so it neither polls nor misses
        a job that finished before the call.

        Behind a pooler in transaction mode (PgBouncer) a LISTEN hears nothing and stays
        on a server connection that other clients then use, so there the wait polls the
        row instead: after 20 ms, then 1.5 times as long each time, at most every 0.5 s,
        each look on a pooled connection of its own, and it leaves nothing behind.

        :param listen: ``True``: LISTEN (a direct connection, or a pooler in session
            mode); ``False``: poll; ``None`` (the default): LISTEN unless the engine's
            connections go through a pooler, which is found out once per engine (a pooler
            answers with a backend pid of its own: one query, at the first wait).
        :raises TimeoutError: not finished within ``timeout`` seconds (naming the job).
        :raises JobFailedError: it ended dead or cancelled (``last_error`` says why).
        :raises LookupError: no such row (a job that keeps no result is deleted when it
            succeeds), or a job that does not keep its result.
        """
        return _flow.result(engine, self, job_id, timeout=timeout, listen=listen)

    async def result_async(
        self,
        engine: AsyncEngine,
        job_id: int,
        *,
        timeout: float | None = None,
        listen: bool | None = None,
    ) -> Any:
        """:meth:`result`, awaited, on an ``AsyncEngine``."""
        return await _flow.result_async(engine, self, job_id, timeout=timeout, listen=listen)

    # -- durable steps (see sqla_jobs.steps) ----------------------------------------------

    def signal(
        self, connection: Session | sa.Connection, job_id: int, name: str, payload: Any = None
    ) -> str:
        """Send the signal ``name`` (with a JSON ``payload``) to job ``job_id``, whose
        handler waits for it with ``steps.wait(name)``; in the caller's transaction, so it
        is sent only if the caller commits.

        Returns ``"woken"`` (the job was suspended in that wait: it is ready again) or
        ``"kept"`` (it has not reached the wait yet, or is running: the wait returns the
        payload when it gets there). The job's row is locked until the caller's COMMIT,
        which serialises the signal with the wait and with its timeout: one of them wins,
        once.

        On a sharded database, ``connection`` is the shard's (``session.connection(
        bind_arguments={"shard_id": ...})``): each shard numbers its own jobs, so a
        ``ShardedSession`` is refused with ``TypeError`` rather than left to pick one.

        :raises SignalError: no such job (never enqueued, or finished and deleted), a
            finished, dead or cancelled job, a wait that already has its signal or timed
            out, a step of that name that is no wait (its ``reason`` says which). Nothing is
            written then.
        """
        return _steps.signal(connection, self, job_id, name, payload)

    async def signal_async(
        self,
        connection: AsyncSession | AsyncConnection,
        job_id: int,
        name: str,
        payload: Any = None,
    ) -> str:
        """:meth:`signal`, awaited, on an ``AsyncSession`` or an ``AsyncConnection``."""
        return await _steps.signal_async(connection, self, job_id, name, payload)

    def group(
        self, session: Any, members: Iterable[Any], then: Any, *, results: str = "results"
    ) -> tuple[list[Any], Any]:
        """Enqueue ``members`` (``(task, task.args(...))`` pairs) and a callback ``then``
        (a pair too) that runs once, after all of them succeeded, with their return values
        as its ``results`` argument; see :func:`sqla_jobs.flow.group`."""
        return _flow.group(session, members, then, results=results)

    def get(self, task: Task[Any, Any] | str) -> Task[Any, Any]:
        """The registered task of that name (or that task, checked to belong here)."""
        if isinstance(task, Task):
            if task.registry is not self:
                raise EnqueueError(
                    f"task {task.name!r} belongs to the registry of table "
                    f"{task.registry.table.fullname!r}, not {self.table.fullname!r}"
                )
            return task
        if not isinstance(task, str):
            raise EnqueueError(f"expected a task or a task name, got {task!r}")
        try:
            return self.tasks[task]
        except KeyError:
            raise UnknownTaskError(f"unknown task {task!r}") from None

    def job_values(
        self,
        task: Task[Any, Any] | str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        **options: Any,
    ) -> dict[str, Any]:
        """Check a job and return its column values, as :meth:`bind_row` does, with what
        is not a column put back in as two keys: ``values["unique_scope"]`` (a scoped
        unique job's :class:`UniqueScope`) and ``values["after"]`` (its parents). For
        callers that check a job without enqueueing it (schedules, ``admin``); the enqueue
        paths take :meth:`bind_row`'s parts instead (``sqla_jobs._enqueue.bind``)."""
        values, scope, parents = self.bind_row(task, args, kwargs, **options)
        if scope is not None:
            values["unique_scope"] = scope
        if parents is not None:
            values["after"] = parents
        return values

    def bind_row(
        self,
        task: Task[Any, Any] | str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        unique: bool | Unique = False,
        unique_key: str | None = None,
        meta: Mapping[str, Any] | None = None,
        meta_prepared: bool = False,
        now: datetime | None = None,
        unique_for: float | timedelta | None = None,
        unique_states: Iterable[str] | None = None,
        unique_on_conflict: str | None = None,
        keep_result: bool | float | timedelta | None = None,
        after: Iterable[Any] | None = None,
        on_parent_failure: str | None = None,
    ) -> tuple[dict[str, Any], UniqueScope | None, list[Any] | None]:
        """Check a job; return its column values, and how it is placed: the
        :class:`UniqueScope` of a scoped unique job (``unique_for``, ``unique_states``,
        ``unique_on_conflict``, given here or by the task), and the parents it waits for
        (``after=``, a non-empty list), or None. Raises :class:`EnqueueError`.

        ``meta`` is checked and handed to the enqueue hooks (:meth:`job_meta`), unless
        ``meta_prepared`` says it is already :meth:`job_meta`'s result: ``enqueue_many``
        prepares it once for all its rows.

        The keywords are :class:`EnqueueOptions`' (``unique`` may be a :class:`Unique`),
        and ``meta_prepared`` and ``now``, which ``enqueue_many`` gives.
        """
        t = self.get(task)
        if unique.__class__ is not bool and isinstance(unique, Unique):
            unique_key, unique_for, unique_states, unique_on_conflict = _unique_fields(
                unique, unique_key, unique_for, unique_states, unique_on_conflict
            )
            unique = True
        arguments = t.bind_args(args, kwargs)
        # The task's own queue, priority and max_attempts were checked when it was
        # registered; only the caller's overrides need it here (once per enqueue_many row).
        # The checks give plain values (an enum member's): see _check_queue.
        q = t.queue if queue is None else _check_queue(queue)
        prio = t.priority if priority is None else _check_priority(priority)
        attempts = t.max_attempts if max_attempts is None else _check_max_attempts(max_attempts)
        values: dict[str, Any] = {
            "task": t.name,
            "queue": q,
            "args": arguments,
            "priority": prio,
            "max_attempts": attempts,
            "status": _READY,
        }
        if meta_prepared:
            if meta is not None:
                values["meta"] = meta
        elif meta is not None or self.events.enqueue_hooks:
            prepared = self.job_meta(t.name, q, meta)
            if prepared is not None:
                values["meta"] = prepared
        if t.concurrency_key is not None:
            key = concurrency_key_of(t.name, t.concurrency_key, arguments, t.signature)
            if key is not None:
                if q != t.queue and not (self.limits(q).keyed or self.limits(q).fair):
                    raise EnqueueError(
                        f"task {t.name!r}: queue {q!r} does not enforce concurrency keys (no "
                        f"task of it declares concurrency_key); declare "
                        f"jobs.queue({q!r}, key_concurrency=1) to send keyed jobs there"
                    )
                values["concurrency_key"] = key
        when = _run_at(run_at, delay, now)
        if when is not None:
            values["run_at"] = when
            if when > (now or _utcnow()):
                values["status"] = JobStatus.SCHEDULED.value
        scope = t.unique_scope
        scoped = not (unique_for is None and unique_states is None and unique_on_conflict is None)
        if scoped:
            scope = check_unique_scope(
                unique_for,
                unique_states,
                unique_on_conflict,
                EnqueueError,
                default=scope,
            )
        if unique_key is not None:
            _check_unique_key(unique_key)
            values["unique_key"] = unique_key
        elif unique or t.unique or scoped:
            values["unique_key"] = derive_unique_key(t.name, arguments)
        keep = keep_seconds(t.keep_result if keep_result is None else keep_result, self)
        parents = None
        if keep is not None or after is not None or on_parent_failure is not None:
            parents = self._flow_values(values, keep, after, on_parent_failure)
        return values, scope, parents

    def _flow_values(
        self,
        values: dict[str, Any],
        keep: float | None,
        after: Iterable[Any] | None,
        on_parent_failure: str | None,
    ) -> list[Any] | None:
        """Results and dependencies of one job: the library's keys in ``meta`` (read by
        the worker from the claimed row, so the claim needs no new column); returns the
        parents to link once the job has an id (None: none)."""
        flow: dict[str, Any] = {}
        parents = None
        if keep is not None:
            flow[KEEP_KEY] = keep
        if on_parent_failure is not None:
            _check_on_parent_failure(on_parent_failure)
            if after is None:
                raise EnqueueError("on_parent_failure= needs after=[...]")
            if on_parent_failure == "run":
                flow[RUN_ANYWAY_KEY] = True
        if after is not None:
            if isinstance(after, (str, bytes)) or not isinstance(after, Iterable):
                raise EnqueueError(f"after= takes a list of jobs or job ids, got {after!r}")
            parents = list(after)
            if parents:
                if "run_at" in values:
                    raise EnqueueError(
                        "a job with after= runs when its parents have succeeded: "
                        "run_at and delay cannot be given too"
                    )
                if "unique_key" in values:
                    # Refused here, before anything reaches the session or the database.
                    raise EnqueueError(
                        "a job with after= cannot be unique (unique, unique_key, "
                        "unique_for, unique_states or unique_on_conflict, given here or by "
                        "the task)"
                    )
                values["status"] = JobStatus.SCHEDULED.value
            else:
                parents = None
        if flow:
            values["meta"] = {**(values.get("meta") or {}), **flow}
        return parents

    def job_meta(
        self, task: str, queue: str, meta: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        """The ``meta`` of the jobs of one enqueue call: the caller's, checked
        (:func:`check_meta`), with what the enqueue hooks add (see :mod:`sqla_jobs.events`);
        None when it is empty. A hook that raises is logged and skipped: an integration
        must never fail the caller's enqueue. Nor does one that adds what ``meta`` cannot
        hold (a ``datetime``, more than its size): its additions are logged and dropped
        (the enqueue raised ``TypeError`` at the caller, and a cron tick's failed the
        whole maintenance pass)."""
        prepared = check_meta(meta) if meta is not None else {}
        for hook in self.events.enqueue_hooks:
            before = dict(prepared)
            try:
                hook(task, queue, prepared)
                check_meta(prepared, own_keys=True)
            except Exception as exc:
                if isinstance(exc, EnqueueError):
                    log.error("enqueue hook %r: %s; what it added is dropped", hook, exc)
                else:
                    log.exception("enqueue hook %r failed", hook)
                prepared.clear()
                prepared.update(before)
        return prepared or None

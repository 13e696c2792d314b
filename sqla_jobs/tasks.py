"""Tasks and the registry that binds them to one jobs table.

.. code-block:: python

    jobs = Jobs(Job)

    @jobs.task(queue="previews", max_attempts=5, retry=Backoff(base=2, cap=600))
    def fetch_preview(code: str) -> None: ...

A job stores a task *name* and its arguments as JSON. Arguments are checked against the
handler's signature when the job is enqueued, in the caller's process, so a typo fails
the web request that made it instead of a worker an hour later.

:class:`Jobs` is the registry (:class:`sqla_jobs._tasks.Registry`, below the enqueue
paths) plus the methods that call those paths: enqueue on a Core connection
(:mod:`sqla_jobs.connection`), results and groups (:mod:`sqla_jobs.flow`). It sits above
them, so that they import the registry and not this module, and no import runs in a
circle. The tasks and their options live in ``_tasks`` too, and are re-exported here,
where they are documented.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, overload

import sqlalchemy as sa

from . import connection as core
from . import flow as _flow
from ._tasks import (
    Backoff,
    ConfiguredTask,
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
    many_options,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
    from typing_extensions import Unpack

__all__ = [
    "Backoff",
    "ConfiguredTask",
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

    def group(
        self, session: Any, members: Iterable[Any], then: Any, *, results: str = "results"
    ) -> tuple[list[Any], Any]:
        """Enqueue ``members`` (``(task, task.args(...))`` pairs) and a callback ``then``
        (a pair too) that runs once, after all of them succeeded, with their return values
        as its ``results`` argument; see :func:`sqla_jobs.flow.group`."""
        return _flow.group(session, members, then, results=results)

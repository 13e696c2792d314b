"""``session.enqueue(...)``: jobs that ride the caller's unit of work.

.. code-block:: python

    Session = sessionmaker(engine, class_=JobSession, jobs=jobs)

    with Session.begin() as session:
        session.add(Link(code="x7Kp", long_url=url))
        session.enqueue(fetch_preview, code="x7Kp")

``enqueue`` checks the job at once (arguments against the handler's signature, options),
adds a ``Job`` object to the session and returns it. Like any object added to a session,
it is INSERTed at the next flush, is visible to workers only once the caller commits, and
is gone if the transaction rolls back. Nothing here flushes or commits on the caller's
behalf.

``enqueue_many`` is for bulk: the rows are kept on the session and inserted by one
``INSERT ... SELECT FROM unnest(...)`` statement, right after the session's next flush or,
at the latest, when it commits, in the caller's transaction either way.

Both work on ``AsyncSession`` (:class:`AsyncJobSession`) too: they only add to the
unit of work, so they do no I/O and need no ``await``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from .errors import EnqueueError
from .queries import insert_rows
from .tasks import Jobs, Task, _utcnow

__all__ = ["AsyncJobSession", "EnqueueMixin", "JobSession"]

_JOBS_KEY = "sqla_jobs.jobs"
_PENDING_KEY = "sqla_jobs.pending"
_ANNOUNCE_KEY = "sqla_jobs.announce"


class EnqueueMixin:
    """Adds :meth:`enqueue` and :meth:`enqueue_many` to a ``Session`` or ``AsyncSession``.

    Mix it in front of your own session class, or use :class:`JobSession` /
    :class:`AsyncJobSession`. The ``jobs=`` keyword (which ``sessionmaker`` passes through)
    names the registry used to resolve task *names*; task objects know their own registry.
    """

    info: dict[Any, Any]

    if TYPE_CHECKING:

        def add(self, instance: object, _warn: bool = True) -> None: ...

    def __init__(self, *args: Any, jobs: Jobs | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        if jobs is not None:
            self.info[_JOBS_KEY] = jobs

    def enqueue(
        self,
        task: Task[Any, Any] | str,
        /,
        *args: Any,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        unique: bool = False,
        unique_key: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Add one job to the unit of work and return it (a new, pending ``Job`` object).

        :param task: a task, or the name of one registered with this session's ``jobs``.
        :param args, kwargs: the handler's arguments; checked now, stored as JSON.
        :param queue: overrides the task's queue.
        :param priority: ``>= 0``; higher is claimed first. Overrides the task's.
        :param run_at: not before this (timezone-aware) time. Or ``delay``: seconds or a
            ``timedelta`` from now.
        :param max_attempts: overrides the task's.
        :param unique_key: at most one live (scheduled, ready or running) job per key.
            ``unique=True`` derives the key from the task and its arguments. A unique job
            is INSERTed at once (``ON CONFLICT DO NOTHING``, in the caller's transaction,
            without flushing anything else), because the answer is needed now: the new
            job, or the live one that already holds the key, is returned.
        :raises EnqueueError: bad arguments or options; the session is left untouched.
        """
        registry = _registry(self, task)
        values = registry.job_values(
            task,
            args,
            kwargs,
            queue=queue,
            priority=priority,
            run_at=run_at,
            delay=delay,
            max_attempts=max_attempts,
            unique=unique,
            unique_key=unique_key,
        )
        inserted = True
        if "unique_key" in values:
            job, inserted = insert_unique(_sync(self), registry, values)
        else:
            job = registry.model(**values)
            self.add(job)
        if inserted and registry.events.wants("enqueued"):
            _announce(_sync(self), registry, [job])
        return job

    def enqueue_many(
        self,
        task: Task[Any, Any] | str,
        arguments: Iterable[Mapping[str, Any]],
        /,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        unique: bool = False,
    ) -> int:
        """Add many jobs of one task, one per mapping of keyword arguments; return how many.

        Every job is checked before any is kept: one bad item raises :class:`EnqueueError`
        and none of the batch is added. The rows go to the database in one statement at the
        session's next flush or commit. With ``unique=True`` each job gets a key derived
        from its task and arguments, and one equal to a live job is silently skipped.
        """
        registry = _registry(self, task)
        # One clock reading for the whole batch: with a delay, every row gets the same
        # run_at, so the batch stays one run of the bulk INSERT.
        now = _utcnow() if delay is not None else None
        rows = [
            registry.job_values(
                task,
                (),
                kwargs,
                queue=queue,
                priority=priority,
                run_at=run_at,
                delay=delay,
                max_attempts=max_attempts,
                unique=unique,
                now=now,
            )
            for kwargs in arguments
        ]
        if rows:
            _pending(_sync(self), registry).extend(rows)
            if registry.events.wants("enqueued"):
                _announce(_sync(self), registry, rows)
        return len(rows)


class JobSession(EnqueueMixin, Session):
    """A ``Session`` with ``enqueue``; ``sessionmaker(engine, class_=JobSession, jobs=jobs)``."""


try:
    from sqlalchemy.ext.asyncio import AsyncSession
except ImportError:  # SQLAlchemy's asyncio needs greenlet: pip install 'sqla-jobs[asyncio]'
    pass
else:

    class AsyncJobSession(EnqueueMixin, AsyncSession):
        """An ``AsyncSession`` with ``enqueue``; ``async_sessionmaker(...,
        class_=AsyncJobSession, jobs=jobs)``.

        ``enqueue`` and ``enqueue_many`` are plain methods, not coroutines: they only add to
        the unit of work, and the INSERT happens at the (awaited) flush or commit. A unique
        job must be inserted at once to know whether it is new, which on asyncio means
        awaiting: use :meth:`enqueue_unique` for those.
        """

        def enqueue(self, task: Any, /, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("unique") or kwargs.get("unique_key") is not None:
                raise EnqueueError(
                    "a unique job is inserted at once: use `await session.enqueue_unique(...)` "
                    "on an AsyncSession"
                )
            return super().enqueue(task, *args, **kwargs)

        async def enqueue_unique(self, task: Any, /, *args: Any, **kwargs: Any) -> Any:
            """``enqueue(..., unique=True)`` (or with ``unique_key=``), awaited."""
            if kwargs.get("unique_key") is None:
                kwargs["unique"] = True

            def run(sync_session: Any) -> Any:
                return EnqueueMixin.enqueue(sync_session, task, *args, **kwargs)

            return await self.run_sync(run)


def _registry(session: Any, task: Task[Any, Any] | str) -> Jobs:
    if isinstance(task, Task):
        return task.registry
    jobs = session.info.get(_JOBS_KEY)
    if jobs is None:
        raise EnqueueError(
            f"cannot resolve task name {task!r}: this session has no Jobs registry "
            "(create it with sessionmaker(..., jobs=jobs)) or pass the task itself"
        )
    return jobs  # type: ignore[no-any-return]


def insert_unique(session: Session, registry: Jobs, values: dict[str, Any]) -> tuple[Any, bool]:
    """INSERT a unique job now; return it (or the live job holding its key) and whether it
    is new."""
    q = registry.queries
    connection = session.connection()
    for _ in range(5):
        job_id = connection.execute(q.insert_unique, values).scalar()
        inserted = job_id is not None
        if not inserted:
            # The key is held by a live job (committed: ON CONFLICT waits for an
            # uncommitted one to settle). It may finish before we look: then insert.
            job_id = connection.execute(q.live_by_key, {"key": values["unique_key"]}).scalar()
        if job_id is not None:
            with session.no_autoflush:
                return session.get(registry.model, job_id), inserted
    raise EnqueueError(f"unique key {values['unique_key']!r} keeps changing hands; try again")


def _sync(session: Any) -> Session:
    """The plain Session behind a Session or an AsyncSession (which keeps its unit of
    work in one)."""
    sync = getattr(session, "sync_session", session)
    assert isinstance(sync, Session)
    return sync


def _pending(session: Session, registry: Jobs) -> list[dict[str, Any]]:
    """Rows waiting for the next flush, per registry; hooks the session the first time."""
    pending: dict[Jobs, list[dict[str, Any]]] | None = session.info.get(_PENDING_KEY)
    if pending is None:
        pending = session.info[_PENDING_KEY] = {}
        if not event.contains(session, "after_flush", _after_flush):
            event.listen(session, "after_flush", _after_flush)
            event.listen(session, "before_commit", _before_commit)
            event.listen(session, "after_transaction_end", _after_transaction_end)
    return pending.setdefault(registry, [])


def session_registry(session: Session) -> Jobs | None:
    """The registry a session resolves task names with (its ``jobs=``), if any."""
    jobs: Jobs | None = _sync(session).info.get(_JOBS_KEY)
    return jobs


def pending_jobs(session: Session) -> dict[Jobs, list[dict[str, Any]]]:
    """``enqueue_many`` rows still waiting for the session's next flush (read only)."""
    pending: dict[Jobs, list[dict[str, Any]]] = _sync(session).info.get(_PENDING_KEY) or {}
    return pending


def insert_pending(session: Session) -> None:
    """INSERT the waiting ``enqueue_many`` rows now, as the next flush would."""
    _insert_pending(_sync(session))


def _announce(session: Session, registry: Jobs, jobs: list[Any]) -> None:
    """Fire ``enqueued`` for these jobs once the session's transaction commits (never for
    a rolled-back one): metrics count jobs that exist."""
    announce: list[tuple[Jobs, Any]] | None = session.info.get(_ANNOUNCE_KEY)
    if announce is None:
        announce = session.info[_ANNOUNCE_KEY] = []
        if not event.contains(session, "after_commit", _after_commit):
            event.listen(session, "after_commit", _after_commit)
            event.listen(session, "after_soft_rollback", _after_soft_rollback)
    announce.extend((registry, job) for job in jobs)


def _after_commit(session: Session) -> None:
    for registry, job in session.info.pop(_ANNOUNCE_KEY, None) or ():
        registry.events.fire("enqueued", job)


def _after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    if previous_transaction.parent is None:
        session.info.pop(_ANNOUNCE_KEY, None)


def _insert_pending(session: Session) -> None:
    pending: dict[Jobs, list[dict[str, Any]]] | None = session.info.get(_PENDING_KEY)
    if not pending:
        return
    session.info[_PENDING_KEY] = {}
    connection = session.connection()
    for registry, rows in pending.items():
        insert_rows(connection, registry.queries, rows)


def _after_flush(session: Session, flush_context: Any) -> None:
    # After the session's own objects: a job table with a foreign key to an app table
    # finds the referenced rows already there.
    _insert_pending(session)


def _before_commit(session: Session) -> None:
    # A session holding only enqueue_many rows is "clean" and would skip its flush.
    session.flush()
    _insert_pending(session)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        # Committed rows were inserted already; rolled-back ones must not leak into the
        # session's next transaction.
        session.info.pop(_PENDING_KEY, None)

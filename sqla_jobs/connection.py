"""Enqueue on a Core ``Connection``: for code without an ORM session.

.. code-block:: python

    with engine.begin() as conn:                         # in your transaction
        conn.execute(orders.update().values(paid=True).where(orders.c.id == 7))
        job_id = jobs.enqueue(conn, send_receipt, order_id=7)

    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        jobs.enqueue(conn, send_receipt, order_id=8)      # one round trip, committed

    async with async_engine.begin() as conn:
        await jobs.enqueue(conn, send_receipt, order_id=9)

Scripts, other services and data pipelines that hold a connection rather than a unit of
work call :meth:`Jobs.enqueue <sqla_jobs.Jobs.enqueue>` and :meth:`Jobs.enqueue_many
<sqla_jobs.Jobs.enqueue_many>`, which land here. The job is checked exactly as
``session.enqueue`` checks it, then INSERTed at once with one prepared statement, in the
connection's transaction: it commits and rolls back with it. Nothing here begins,
commits or rolls back anything; in autocommit the INSERT is the whole round trip.

``enqueued`` fires at once on a connection in autocommit (the job is committed); in a
transaction, as the connection commits it, and never if it rolls back. A Core savepoint
is not followed: a job enqueued in a ``begin_nested()`` that rolls back is still
announced at the commit (an ORM session follows savepoints; prefer it when that matters).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event

from .errors import EnqueueError
from .limits import database_encodings
from .queries import enqueue_scoped, insert_json, insert_rows, job_params
from .tasks import (
    OPTION_NAMES,
    ConfiguredTask,
    Jobs,
    Task,
    TaskArgs,
    check_encoding,
    merge_options,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = ["enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async"]


def enqueue(
    connection: sa.Connection,
    jobs: Jobs,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> int:
    """INSERT one checked job; its id (for a unique job, the id of the live job that holds
    the key, new or not)."""
    registry, plain, options = _resolve(jobs, task, kwargs)
    values = registry.job_values(plain, args, kwargs, **options)
    encodings = database_encodings(connection)
    if encodings is not None:
        check_encoding([values], encodings)
    scope = values.pop("unique_scope", None)
    if "after" in values:
        return _enqueue_after(connection, registry, values)
    params = job_params(values)
    q = registry.queries
    job_id: int
    if scope is not None:
        # See sqla_jobs.queries.enqueue_scoped: the id of the new job, or of the holder
        # (replaced, kept, or the finished one whose period still holds the key).
        job_id, outcome = enqueue_scoped(connection, q, params, scope)
        inserted = outcome == "new"
    elif params["unique_key"] is None:
        job_id = connection.execute(q.insert_job, params).scalar_one()
        inserted = True
    else:
        job_id, inserted = _insert_unique(connection, registry, params)
    if inserted and registry.events.wants("enqueued"):
        _announce(connection, registry, [values])
    return job_id


def enqueue_many(
    connection: sa.Connection,
    jobs: Jobs,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    given: dict[str, Any],
) -> int:
    """INSERT many checked jobs of one task in one statement; how many were inserted."""
    from .session import many_json

    if isinstance(task, ConfiguredTask):
        jobs.get(task.task)  # raises if the task belongs to another table's registry
    # The rows are written now and kept nowhere: when they differ only in their
    # arguments, their JSON is all there is to write (no dict per row, nothing for the
    # garbage collector to walk), checked block by block as it is sent (sqla_jobs.bulk).
    registry, rows, texts = many_json(task, arguments, jobs, **given)
    if texts is not None:
        return insert_json(connection, registry.queries, rows[0], texts)
    if not rows:
        return 0
    inserted = insert_rows(connection, registry.queries, rows)
    if registry.events.wants("enqueued"):
        _announce(connection, registry, rows)
    return inserted


async def enqueue_async(
    connection: AsyncConnection,
    jobs: Jobs,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> int:
    """:func:`enqueue` on an ``AsyncConnection`` (through ``run_sync``: the same code)."""
    return await connection.run_sync(enqueue, jobs, task, args, kwargs)


async def enqueue_many_async(
    connection: AsyncConnection,
    jobs: Jobs,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    given: dict[str, Any],
) -> int:
    """:func:`enqueue_many` on an ``AsyncConnection``."""
    return await connection.run_sync(enqueue_many, jobs, task, arguments, given)


def async_connection(connection: object) -> AsyncConnection:
    """``connection`` if it is an ``AsyncConnection``; a clear error for anything else (a
    Session, an Engine), rather than a coroutine that would never run."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

    if isinstance(connection, AsyncConnection):
        return connection
    hint = ""
    if isinstance(connection, (Session, AsyncSession)):
        hint = "; with a session, use session.enqueue (or session.enqueue_many)"
    elif isinstance(connection, sa.Engine):
        hint = "; with an engine, use `with engine.begin() as conn:`"
    raise TypeError(
        "jobs.enqueue and jobs.enqueue_many take a Connection or an AsyncConnection, got "
        f"{type(connection).__name__}{hint}"
    )


def _enqueue_after(connection: sa.Connection, registry: Jobs, values: dict[str, Any]) -> int:
    """A job with ``after=``: INSERTed held, then linked to its parents, atomically (in
    autocommit, inside a BEGIN/COMMIT of its own)."""
    from .flow import HELD_UNTIL, link, parent_ids

    if values.get("unique_key") is not None:
        raise EnqueueError("a job with after= cannot be unique")
    parents = parent_ids(registry, values.pop("after"), pending_ok=False)
    run_anyway = bool((values.get("meta") or {}).get("sqla_jobs.run_anyway"))
    values["run_at"] = HELD_UNTIL
    q = registry.queries
    own = _autocommit(connection)
    if own:
        connection.exec_driver_sql("BEGIN")
    try:
        job_id: int = connection.execute(q.insert_job, job_params(values)).scalar_one()
        link(connection, q, job_id, parents, run_anyway)
    except BaseException:
        if own:
            connection.exec_driver_sql("ROLLBACK")
        raise
    if own:
        connection.exec_driver_sql("COMMIT")
    if registry.events.wants("enqueued"):
        _announce(connection, registry, [values])
    return job_id


def _resolve(
    jobs: Jobs, task: Task[Any, Any] | ConfiguredTask[Any, Any] | str, kwargs: dict[str, Any]
) -> tuple[Jobs, Task[Any, Any] | str, dict[str, Any]]:
    """The registry, the task and the options of a call; option keywords are taken out of
    ``kwargs`` (no handler may have a parameter of those names)."""
    given = {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}
    if isinstance(task, ConfiguredTask):
        plain, options = merge_options(task, given)
        return jobs, jobs.get(plain), options
    return jobs, task, {k: v for k, v in given.items() if v is not None}


def _insert_unique(connection: sa.Connection, registry: Jobs, params: Any) -> tuple[int, bool]:
    """INSERT a unique job; its id (or that of the live job holding the key), and whether
    it is new. The holder may finish between the two statements: then try again."""
    q = registry.queries
    for _ in range(5):
        job_id = connection.execute(q.insert_job_unique, params).scalar()
        if job_id is not None:
            return int(job_id), True
        held = connection.execute(q.live_by_key, {"key": params["unique_key"]}).scalar()
        if held is not None:
            return int(held), False
    raise EnqueueError(f"unique key {params['unique_key']!r} keeps changing hands; try again")


# -- the enqueued event -------------------------------------------------------------------

#: Jobs enqueued on a connection in a transaction, waiting for its commit.
_waiting: weakref.WeakKeyDictionary[sa.Connection, list[tuple[Jobs, Sequence[Any]]]] = (
    weakref.WeakKeyDictionary()
)


def _announce(connection: sa.Connection, registry: Jobs, jobs: Sequence[Any]) -> None:
    if _autocommit(connection):
        for job in jobs:
            registry.events.fire("enqueued", job)
        return
    waiting = _waiting.get(connection)
    if waiting is None:
        waiting = _waiting[connection] = []
        event.listen(connection, "commit", _committed)
        event.listen(connection, "rollback", _rolled_back)
    waiting.append((registry, jobs))


def _autocommit(connection: sa.Connection) -> bool:
    """Whether the driver connection commits every statement by itself (psycopg's own
    flag: asking SQLAlchemy for the isolation level would cost a round trip)."""
    return bool(getattr(connection.connection.driver_connection, "autocommit", False))


def _committed(connection: sa.Connection) -> None:
    for registry, jobs in _waiting.pop(connection, ()):
        for job in jobs:
            registry.events.fire("enqueued", job)


def _rolled_back(connection: sa.Connection) -> None:
    _waiting.pop(connection, None)

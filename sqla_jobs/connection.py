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

from ._direct import autocommit
from ._enqueue import (
    bind_call,
    insert_json,
    insert_rows,
    many_json,
    place_on_connection,
)
from ._storable import database_encodings
from ._tasks import (
    ConfiguredTask,
    Task,
    TaskArgs,
    check_encoding,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from .tasks import Jobs

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
    pending = bind_call(task, args, kwargs, jobs)
    encodings = database_encodings(connection)
    if encodings is not None:
        check_encoding([pending.row], encodings)
    job_id, inserted = place_on_connection(connection, pending)
    if inserted and jobs.events.wants("enqueued"):
        _announce(connection, jobs, [pending.row])
    return job_id


def enqueue_many(
    connection: sa.Connection,
    jobs: Jobs,
    task: Task[Any, Any] | ConfiguredTask[Any, Any] | str,
    arguments: Iterable[TaskArgs[Any] | Mapping[str, Any]],
    given: dict[str, Any],
) -> int:
    """INSERT many checked jobs of one task in one statement; how many were inserted."""
    if isinstance(task, ConfiguredTask):
        jobs.get(task.task)  # raises if the task belongs to another table's registry
    # The rows are written now and kept nowhere: when they differ only in their
    # arguments, their JSON is all there is to write (no dict per row, nothing for the
    # garbage collector to walk), checked block by block as it is sent (sqla_jobs._bulk).
    registry, rows, texts = many_json(task, arguments, jobs, **given)
    if texts is not None:
        return insert_json(connection, registry.queries, rows[0], texts)
    if not rows:
        return 0
    written: list[dict[str, Any]] | None = [] if registry.events.wants("enqueued") else None
    inserted = insert_rows(connection, registry.queries, rows, written)
    if written:
        _announce(connection, registry, written)
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


# -- the enqueued event -------------------------------------------------------------------

#: Jobs enqueued on a connection in a transaction, waiting for its commit.
_waiting: weakref.WeakKeyDictionary[sa.Connection, list[tuple[Jobs, Sequence[Any]]]] = (
    weakref.WeakKeyDictionary()
)


def _announce(connection: sa.Connection, registry: Jobs, jobs: Sequence[Any]) -> None:
    if autocommit(connection):
        for job in jobs:
            registry.events.fire("enqueued", job)
        return
    waiting = _waiting.get(connection)
    if waiting is None:
        waiting = _waiting[connection] = []
        event.listen(connection, "commit", _committed)
        event.listen(connection, "rollback", _rolled_back)
    waiting.append((registry, jobs))


def _committed(connection: sa.Connection) -> None:
    for registry, jobs in _waiting.pop(connection, ()):
        for job in jobs:
            registry.events.fire("enqueued", job)


def _rolled_back(connection: sa.Connection) -> None:
    _waiting.pop(connection, None)

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
transaction, as the connection commits it, and never if it rolls back, nor for a job
enqueued in a ``begin_nested()`` savepoint that rolls back (at any depth). "As it
commits" is SQLAlchemy's ``commit`` connection event, the only one a connection has: it
runs just before the COMMIT is sent, so a listener cannot see the job from another
connection yet, and a COMMIT that then fails (a deferred constraint, a serialization
failure) has announced jobs it did not write. A session fires after its COMMIT returned;
prefer it when that matters.
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
#
# Jobs enqueued in a transaction wait for its commit, each batch tagged with the savepoint
# that was innermost when it was written (``Connection.get_nested_transaction()``, None
# for the transaction itself), as a session tags its own (sqla_jobs.session):
#
# * a savepoint rolls back (``rollback_savepoint``, sent while it is still the innermost):
#   what is tagged with it goes;
# * a savepoint is released (``release_savepoint``, likewise): what is tagged with it is
#   its parent's from then on. The parent is the innermost savepoint once the release is
#   done, which no event tells: the batches are handed on at the next event (a new
#   savepoint's included, sent before it is the innermost) or enqueue on the connection
#   (``_settle``), when it still is;
# * the transaction commits or rolls back: what is left fires, or goes.


class _Waiting:
    """The ``enqueued`` announcements of one connection's transaction."""

    __slots__ = ("batches", "released")

    def __init__(self) -> None:
        #: (savepoint or None, registry, jobs), in the order they were written.
        self.batches: list[tuple[sa.NestedTransaction | None, Jobs, Sequence[Any]]] = []
        #: Savepoints released since the last event, whose batches go to their parent.
        self.released: list[sa.NestedTransaction] = []


#: Jobs enqueued on a connection in a transaction, waiting for its commit.
_waiting: weakref.WeakKeyDictionary[sa.Connection, _Waiting] = weakref.WeakKeyDictionary()


def _announce(connection: sa.Connection, registry: Jobs, jobs: Sequence[Any]) -> None:
    if autocommit(connection):
        for job in jobs:
            registry.events.fire("enqueued", job)
        return
    waiting = _waiting.get(connection)
    if waiting is None:
        waiting = _waiting[connection] = _Waiting()
        for name, fn in _HOOKS:
            if not event.contains(connection, name, fn):
                event.listen(connection, name, fn)
    _settle(connection, waiting)
    waiting.batches.append((connection.get_nested_transaction(), registry, jobs))


def _settle(connection: sa.Connection, waiting: _Waiting) -> None:
    """Hand the batches of the savepoints released since the last event to their parent:
    the innermost savepoint now (or the transaction)."""
    if waiting.released:
        released, heir = waiting.released, connection.get_nested_transaction()
        waiting.released = []
        waiting.batches = [
            (heir if tag is not None and any(tag is r for r in released) else tag, reg, jobs)
            for tag, reg, jobs in waiting.batches
        ]


def _began_savepoint(connection: sa.Connection, name: str | None) -> None:
    # Sent before the new savepoint is the innermost: the last moment its parent is.
    waiting = _waiting.get(connection)
    if waiting is not None:
        _settle(connection, waiting)


def _released_savepoint(connection: sa.Connection, name: str, context: Any) -> None:
    waiting = _waiting.get(connection)
    if waiting is not None:
        _settle(connection, waiting)
        released = connection.get_nested_transaction()  # still the innermost
        if released is not None:
            waiting.released.append(released)


def _rolled_back_savepoint(connection: sa.Connection, name: str, context: Any) -> None:
    waiting = _waiting.get(connection)
    if waiting is not None:
        _settle(connection, waiting)
        rolled = connection.get_nested_transaction()  # still the innermost
        if rolled is not None:
            waiting.batches = [b for b in waiting.batches if b[0] is not rolled]


def _committed(connection: sa.Connection) -> None:
    # SQLAlchemy's commit event: just before the COMMIT is sent (see the module's docstring).
    waiting = _waiting.pop(connection, None)
    if waiting is not None:
        for _, registry, jobs in waiting.batches:
            for job in jobs:
                registry.events.fire("enqueued", job)


def _rolled_back(connection: sa.Connection) -> None:
    _waiting.pop(connection, None)


#: The connection events the announcements follow (listened to on the connection once it
#: holds one).
_HOOKS: tuple[tuple[str, Any], ...] = (
    ("commit", _committed),
    ("rollback", _rolled_back),
    ("savepoint", _began_savepoint),
    ("release_savepoint", _released_savepoint),
    ("rollback_savepoint", _rolled_back_savepoint),
)

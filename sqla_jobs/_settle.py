"""Statement I/O shared by the worker and the caller-side claims (:mod:`sqla_jobs.claiming`):
settling what waits on finished parents, the text kept in ``last_error``, and the name a
claimer goes by.

Internal (the underscore): it sits below both users, so that the session API does not
import the worker to settle a job it claimed itself.
"""

from __future__ import annotations

import os
import socket
import traceback
import uuid
from typing import TYPE_CHECKING

import sqlalchemy as sa

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ._queries import Queries

__all__ = ["cap_error", "format_error", "settle_children", "worker_name"]

#: ``last_error`` keeps at most this much of a traceback.
_MAX_ERROR_CHARS = 64 * 1024


def worker_name() -> str:
    """Unique per worker: host, pid and a random suffix (several workers per process)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def format_error(exc: BaseException) -> str:
    """The exception and its traceback, as kept in ``last_error`` (capped at 64 KiB)."""
    return cap_error("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def cap_error(text: str) -> str:
    """``text`` as kept in ``last_error``: at most 64 KiB, the cut said, and storable.

    An exception's message is whatever the handler put in it, and two things Python
    strings hold PostgreSQL's text cannot: NUL (refused by the server) and a lone
    surrogate (refused by the driver's encoder). Either failed the completer's write of
    the whole batch, for as long as the worker ran, or stopped the worker (and the next
    one to run the job again). Both are written as their escapes (``\\x00``,
    ``\\ud800``).

    That makes it storable in UTF-8. What a connection or a database that is not UTF-8
    cannot carry (a LATIN1 database, a WIN1252 client) is escaped where the worker binds
    its outcomes, which knows the connection (``worker._statements._outcome_statements``)."""
    if len(text) > _MAX_ERROR_CHARS:
        text = text[: _MAX_ERROR_CHARS - 20] + "\n[truncated]"
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def settle_children(
    conn: sa.Connection | Session, queries: Queries, succeeded: list[int], ended: list[int]
) -> None:
    """What waits on these parents: children of ``succeeded`` ones are released (ready
    once their last parent has succeeded); children of ``ended`` ones (dead or cancelled)
    are cancelled down the chain, except those that run anyway, which are released;
    children already cancelled by another parent record that these ended too (see
    ``_record_ended_parents`` in :mod:`sqla_jobs._queries`). Statements of their own, run
    after the parents' own in the same transaction.

    Each release first locks the children it settles, in a statement of its own: the
    release that reads the parents' rows (a group callback's results) then sees every
    sibling parent whose completion committed while it waited for a child, which a
    statement that had waited for the lock itself would not (see ``_lock_children`` in
    :mod:`sqla_jobs._queries`). That needs READ COMMITTED, a snapshot per statement: under
    REPEATABLE READ a sibling completing concurrently makes the lock fail with a
    serialization error (the transaction is retried) instead of reading a stale result.

    A group callback whose results ``jsonb`` cannot hold is made dead by its release
    (see ``_release`` in :mod:`sqla_jobs._queries`): what waits on it is settled in turn,
    as for any parent that ended dead.
    """
    dead: list[int] = []
    if ended:
        reason = (
            "cancelled: a job it waited for (after=) ended dead or cancelled "
            f"(job {', '.join(map(str, ended[:10]))})"
        )
        rows = conn.execute(queries.cancel_children, {"parent_ids": ended, "reason": reason})
        cancelled = [r[0] for r in rows]
        # Children a parent's end cancelled before record these ones too: a retry must skip
        # them while any parent that ended is dead, cancelled or gone (pruned, purged).
        conn.execute(queries.record_ended_parents, {"parent_ids": ended})
        dead += _release(conn, queries, ended + cancelled)
    if succeeded:
        dead += _release(conn, queries, succeeded)
    if dead:
        settle_children(conn, queries, [], dead)


def _release(conn: sa.Connection | Session, queries: Queries, parent_ids: list[int]) -> list[int]:
    """Lock the children still waiting on these parents, then release them (nothing more
    when none waits); the group callbacks the release made dead."""
    children = list(conn.execute(queries.lock_children, {"parent_ids": parent_ids}).scalars())
    if not children:
        return []
    release = {"parent_ids": parent_ids, "child_ids": children}
    return [row[2] for row in conn.execute(queries.release, release) if row[2] is not None]

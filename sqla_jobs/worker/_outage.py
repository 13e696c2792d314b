"""Database errors a worker waits out, and how long it waits: shared by the fetch loop and
every duty.

A worker never dies of the database: a server restart, a dropped connection, a missing
table or a pooler that loses prepared statements are all retried, each with the pause
:func:`retry_pause` decides. What differs is how loudly: weather is a WARNING, a pooler
that loses prepared statements is a misconfiguration, said once (:data:`POOLING_ADVICE`).
"""

from __future__ import annotations

import psycopg
import psycopg.errors
import sqlalchemy as sa

from ..errors import unreachable

__all__ = [
    "MAX_DUTY_FAILURES",
    "POOLING_ADVICE",
    "is_database_error",
    "lost_prepared_statement",
    "refused_row",
    "retry_pause",
]

#: Consecutive unexpected (non-database) errors after which a duty stops the worker.
MAX_DUTY_FAILURES = 5


def is_database_error(exc: BaseException) -> bool:
    """Errors the database, the driver or the pool raise, which a worker waits out: never
    fatal. Everything SQLAlchemy raises (a pool ``TimeoutError`` included, though it is no
    ``DBAPIError``), and psycopg's own errors from the LISTEN connection, which is used
    without SQLAlchemy."""
    return isinstance(exc, (sa.exc.SQLAlchemyError, psycopg.Error))


#: SQLSTATE classes of errors that come from what a row holds, and repeat as long as it is
#: written: data exceptions (22: NUL in text, a value out of range), integrity
#: constraints (23), a program limit (54: more than ``jsonb`` holds; retried as an outage,
#: the one row held up every outcome of the worker for as long as it ran) and what a
#: trigger of the application's raises (P0).
_REFUSED_CLASSES = ("22", "23", "54", "P0")


def refused_row(exc: BaseException) -> bool:
    """The database (or the driver's encoder) refused what a statement's rows hold: the
    same write fails again however long it is retried, unlike the outage
    :func:`retry_pause` waits out. The completer writes such a batch apart, to find the
    row (see ``Completer.write_apart``)."""
    if isinstance(exc, UnicodeError):
        return True
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    state = getattr(orig, "sqlstate", None)
    return isinstance(state, str) and state[:2] in _REFUSED_CLASSES


def lost_prepared_statement(exc: BaseException) -> bool:
    """A statement psycopg had prepared was not there on the server connection it went to
    (or another one was, under its name): the worker's connections go through a pooler in
    transaction mode (PgBouncer before 1.21, or without ``max_prepared_statements``), which
    lends each transaction whichever server connection is free. Not the database's fault,
    nor a passing one: a misconfiguration, said once (:data:`POOLING_ADVICE`)."""
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    if isinstance(
        orig, (psycopg.errors.InvalidSqlStatementName, psycopg.errors.DuplicatePreparedStatement)
    ):
        return True
    # "bind message supplies 2 parameters, but prepared statement "_pg3_2" requires 6"
    return isinstance(orig, psycopg.errors.ProtocolViolation) and "prepared statement" in str(orig)


#: The one line a worker logs at its first lost prepared statement.
POOLING_ADVICE = (
    "worker %s: %s: its connections go through a pooler in transaction mode (PgBouncer) "
    "that does not keep psycopg's prepared statements, so statements fail, or run another "
    "statement's plan. Fix it: set max_prepared_statements in pgbouncer.ini (PgBouncer 1.21 "
    "or later), or turn preparing off for the worker's engine, "
    "connect_args={'prepare_threshold': None} (sqla-jobs worker --engine MODULE:ATTR, or "
    "?prepare_threshold=None in the URL); see the docs' PgBouncer section "
    "(https://github.com/sqla-jobs/sqla-jobs/blob/main/docs/operating/deploy.md#pgbouncer). "
    "Until then such failures are retried at once and logged at DEBUG"
)


def retry_pause(failures: int, exc: BaseException) -> float:
    """Seconds to wait after ``failures`` consecutive database errors.

    The first failure of a held connection that the server dropped (a restart, a
    terminated backend) is retried at once on a fresh one. Failures to reach the server
    back off to at most half a second, so a worker is back within about a second of the server
    accepting connections again; other errors (a missing table) back off to 30 s. A
    prepared statement lost by a pooler is retried at once, then every 50 ms: the next
    try usually finds a server connection that works, and backing off only loses time.
    """
    if failures <= 1 and getattr(exc, "connection_invalidated", False):
        return 0.0
    if lost_prepared_statement(exc):
        return 0.0 if failures <= 1 else 0.05
    cap = 0.5 if unreachable(exc) else 30.0
    return min(cap, 0.05 * 2.0 ** max(failures - 1, 0))

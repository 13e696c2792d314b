"""Statements sent under SQLAlchemy, straight to psycopg (internal).

Three of the library's paths talk to the psycopg connection beneath a SQLAlchemy
``Connection``: ``COPY`` (:mod:`._bulk`), which SQLAlchemy's execution cannot do; the
limited claim's and the completion's statements in one psycopg pipeline (one round trip
instead of one per statement, :func:`~sqla_jobs.worker._statements.claim_limited`); and
one job enqueued on a connection and the worker's plain statements (:func:`execute`),
where SQLAlchemy's own execution was a third of the client's time (``benchmarks/peers.py``,
row 1t). All go around what SQLAlchemy does for its own statements, so all say when they
may:

* :func:`pipeline_allowed`: a psycopg 3 connection, no ``schema_translate_map`` to honour,
  and nobody watching the statements (no ``before_cursor_execute``,
  ``after_cursor_execute``, ``before_execute``, ``after_execute`` or ``handle_error``
  listener, no ``echo``, the ``sqlalchemy.engine`` logger not at INFO). Tracing
  instrumentation and tests that listen for the statements therefore see every one of
  them, sent the ordinary way; only an unwatched connection takes the short cut.
* :func:`raise_as_dbapi_error`: a driver error is raised as SQLAlchemy's ``DBAPIError``, as
  SQLAlchemy raises its own, and a connection the server ended is invalidated, so that the
  worker's outage handling, the pool and the caller's rollback treat it alike.

Their rows come in PostgreSQL's binary format (``binary=True``), to the same Python values
as the text format: a claim's rows hold two timestamps each, which psycopg reads from
binary without parsing text (a plain claim of 200 rows: 758 µs of client CPU against 853
in text, alternating). The JSON columns are sent as text by the statements themselves
(``CAST(args AS TEXT)``), decoded by the worker, row by row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, cast

import sqlalchemy as sa
from sqlalchemy.sql.compiler import SQLCompiler

__all__ = [
    "Compiled",
    "autocommit",
    "compiled",
    "execute",
    "execute_each",
    "pipeline_allowed",
    "raise_as_dbapi_error",
    "run_pipeline",
]

#: The logger SQLAlchemy's ``echo`` writes to: at INFO, statements are logged.
_ENGINE_LOG = logging.getLogger("sqlalchemy.engine.Engine")


class Compiled:
    """A statement compiled once for a dialect: its SQL (psycopg's ``%(name)s`` style) and
    how to turn the caller's parameters into the driver's (its literal values and its
    types' bind processors, as SQLAlchemy would apply them)."""

    __slots__ = ("_compiled", "_processors", "sql")

    def __init__(self, statement: sa.ClauseElement, dialect: sa.Dialect) -> None:
        compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
        if "POSTCOMPILE" in compiled.string:
            # An expanding IN would need SQLAlchemy's per-call rendering.
            raise ValueError("a statement with expanding parameters cannot be sent directly")
        self.sql = compiled.string
        self._compiled = compiled
        processors = {}
        for name, bind in compiled.binds.items():
            processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if processor is not None:
                processors[name] = processor
        self._processors = processors

    def params(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The driver's parameters for ``given`` (the statement's own literals included)."""
        values = dict(self._compiled.construct_params(dict(given)) or {})
        for name, processor in self._processors.items():
            if name in values:
                values[name] = processor(values[name])
        return values


def compiled(
    cache: dict[tuple[Any, ...], Compiled], statement: sa.ClauseElement, dialect: sa.Dialect
) -> Compiled:
    """``statement`` compiled for ``dialect``, once per ``cache`` (the caller's, kept with
    the statements it holds)."""
    key = (id(statement), type(dialect), dialect.server_version_info)
    found = cache.get(key)
    if found is None:
        found = cache[key] = Compiled(statement, dialect)
    return found


def autocommit(connection: sa.Connection) -> bool:
    """Whether the driver connection commits every statement by itself (psycopg's own
    flag: asking SQLAlchemy for the isolation level would cost a round trip)."""
    return bool(getattr(connection.connection.driver_connection, "autocommit", False))


def pipeline_allowed(connection: sa.Connection) -> bool:
    """Whether statements may go to psycopg directly on ``connection`` (see the module's
    docstring for each condition)."""
    if connection.dialect.driver != "psycopg":
        return False
    if connection.get_execution_options().get("schema_translate_map"):
        return False
    engine = connection.engine
    if engine.echo or _ENGINE_LOG.isEnabledFor(logging.INFO):
        return False
    # SQLAlchemy marks an engine or a connection that anything listens on, and its own
    # execution reads the mark before it dispatches an event; unmarked, neither has a
    # listener to look for. The look itself is the slow part on the session's connection,
    # a new Connection each transaction, whose joined dispatch builds each event's
    # listener list on first access (9 µs a transaction, more in a real one). Without
    # the mark (another SQLAlchemy), look.
    if getattr(connection, "_has_events", True) or getattr(engine, "_has_events", True):
        for target in (connection, engine):
            dispatch: Any = target.dispatch
            if (
                dispatch.before_cursor_execute
                or dispatch.after_cursor_execute
                or dispatch.before_execute
                or dispatch.after_execute
            ):
                return False
    # A dialect event, listened for on the engine.
    return not connection.dialect.dispatch.handle_error


def execute(
    connection: sa.Connection, made: Compiled, params: Mapping[str, Any]
) -> list[tuple[Any, ...]]:
    """Run one compiled statement on ``connection``'s psycopg connection (sync, or an
    ``AsyncConnection``'s under ``run_sync``); its rows. For callers that checked
    :func:`pipeline_allowed`.

    SQLAlchemy begins the connection's transaction at its first statement (autobegin);
    a statement sent around it would leave the ``Connection`` thinking none was begun, and
    its ``commit()`` would then commit nothing. So the transaction is begun here the same
    way first, which also fires the ``begin`` event as SQLAlchemy's own statement would."""
    if not connection.in_transaction():
        connection.begin()
    driver: Any = connection.connection.driver_connection
    values = made.params(params)
    try:
        if hasattr(driver, "__aenter__"):
            from sqlalchemy.util import await_only

            rows: list[tuple[Any, ...]] = await_only(_execute_async(driver, made.sql, values))
            return rows
        cursor = driver.execute(made.sql, values, binary=True)
        return cast("list[tuple[Any, ...]]", cursor.fetchall())
    except connection.dialect.loaded_dbapi.Error as exc:
        raise_as_dbapi_error(connection, made.sql, exc)


async def _execute_async(driver: Any, sql: str, values: dict[str, Any]) -> list[tuple[Any, ...]]:
    cursor = await driver.execute(sql, values, binary=True)
    return cast("list[tuple[Any, ...]]", await cursor.fetchall())


def execute_each(
    connection: sa.Connection, made: Compiled, params: Sequence[Mapping[str, Any]]
) -> list[list[tuple[Any, ...]]]:
    """Run one compiled statement once per item of ``params``, in ``connection``'s
    transaction (begun as :func:`execute` begins it); the rows of each run, in order.

    One run is :func:`execute`. Several go in one psycopg pipeline, one round trip for
    all: the jobs one transaction enqueues (the link, its preview, its webhook) cost the
    round trip of one. Unlike :func:`run_pipeline` this is the caller's transaction, not
    one of its own: a failure is raised and the transaction is left to its owner, who
    must roll it back (PostgreSQL has already aborted it), as after any failed
    statement."""
    if len(params) == 1:
        return [execute(connection, made, params[0])]
    if not connection.in_transaction():
        connection.begin()
    driver: Any = connection.connection.driver_connection
    values = [made.params(p) for p in params]
    try:
        if hasattr(driver, "__aenter__"):
            from sqlalchemy.util import await_only

            found: list[list[tuple[Any, ...]]] = await_only(_each_async(driver, made.sql, values))
            return found
        with driver.pipeline():
            cursors = [driver.execute(made.sql, v, binary=True) for v in values]
        return [cursor.fetchall() for cursor in cursors]
    except connection.dialect.loaded_dbapi.Error as exc:
        raise_as_dbapi_error(connection, made.sql, exc)


async def _each_async(
    driver: Any, sql: str, values: list[dict[str, Any]]
) -> list[list[tuple[Any, ...]]]:
    async with driver.pipeline():
        cursors = [await driver.execute(sql, v, binary=True) for v in values]
    return [await cursor.fetchall() for cursor in cursors]


#: What :func:`run_pipeline` gives back of one statement: its rows and column names.
Rows = tuple[list[tuple[Any, ...]], list[str]]


def run_pipeline(
    connection: sa.Connection,
    statements: Sequence[tuple[str, dict[str, Any] | None]],
    rows_of: Sequence[int],
) -> list[Rows]:
    """Send ``statements`` in one psycopg pipeline (one round trip) on ``connection``'s
    driver connection; the rows and column names of each one at the indexes ``rows_of``.

    The statements are meant to be a whole transaction on a connection in autocommit:
    ``BEGIN`` ... ``COMMIT``, or none of the two, and then the server's implicit
    transaction, which a pipeline's statements before its one Sync share (PostgreSQL
    commits them at the Sync). If one fails, the server skips the rest, the transaction is
    rolled back (here, when it was begun), and the error is raised as SQLAlchemy's
    ``DBAPIError``."""
    driver: Any = connection.connection.driver_connection
    try:
        if hasattr(driver, "__aenter__"):  # psycopg.AsyncConnection, under run_sync
            from sqlalchemy.util import await_only

            result: list[Rows] = await_only(_run_async(driver, statements, rows_of))
            return result
        return _run_sync(driver, statements, rows_of)
    except connection.dialect.loaded_dbapi.Error as exc:
        raise_as_dbapi_error(connection, statements[rows_of[-1]][0], exc)


def _run_sync(
    driver: Any, statements: Sequence[tuple[str, dict[str, Any] | None]], rows_of: Sequence[int]
) -> list[Rows]:
    try:
        with driver.pipeline():
            cursors = [driver.execute(sql, params, binary=True) for sql, params in statements]
        return [(cursors[i].fetchall(), _names(cursors[i])) for i in rows_of]
    except BaseException:
        _rollback_sync(driver)
        raise


async def _run_async(
    driver: Any, statements: Sequence[tuple[str, dict[str, Any] | None]], rows_of: Sequence[int]
) -> list[Rows]:
    try:
        async with driver.pipeline():
            cursors = [await driver.execute(sql, params, binary=True) for sql, params in statements]
        return [(await cursors[i].fetchall(), _names(cursors[i])) for i in rows_of]
    except BaseException:
        await _rollback_async(driver)
        raise


def _names(cursor: Any) -> list[str]:
    """The column names of ``cursor``'s result, read from the result itself: its
    ``description`` builds a ``Column`` (with a type lookup) per column at each call, a
    tenth of a limited claim's client CPU (12 columns, cProfile)."""
    result = cursor.pgresult
    if result is None:
        return []
    return [result.fname(i).decode() for i in range(result.nfields)]


def _rollback_sync(driver: Any) -> None:
    """After a pipeline failed: end the transaction it left open, if any, and make
    psycopg forget the statements it prepared (nothing to do on a lost connection).

    A ROLLBACK does both: psycopg clears its prepared statements (and deallocates them on
    the server) at every ROLLBACK it runs, and one sent outside a transaction only draws
    a warning. The second matters: when a statement of a pipeline fails on the very run
    at which psycopg prepares a later one (its ``prepare_threshold``), the server skips
    that Parse but psycopg counts the statement as prepared, and every later run of it on
    the connection failed (``prepared statement "_pg3_1" does not exist``; a queue's lock
    not granted in time, the worker's "busy" claim, was enough)."""
    try:
        if not driver.closed:
            driver.execute("ROLLBACK")
    except Exception:  # the original error is the one to raise
        pass


async def _rollback_async(driver: Any) -> None:
    try:
        if not driver.closed:
            await driver.execute("ROLLBACK")
    except Exception:
        pass


def raise_as_dbapi_error(connection: sa.Connection, statement: str, exc: Any) -> NoReturn:
    """Raise a driver error as SQLAlchemy's ``DBAPIError`` (what SQLAlchemy does for its own
    statements): a connection the server ended is invalidated first, so that the caller's
    rollback, and the pool, let it go instead of failing on it again."""
    lost = connection.dialect.is_disconnect(exc, connection.connection.dbapi_connection, None)
    if lost and not connection.invalidated:
        connection.invalidate(exc)
    raise sa.exc.DBAPIError.instance(
        statement,
        None,
        exc,
        connection.dialect.loaded_dbapi.Error,
        connection_invalidated=lost,
        dialect=connection.dialect,
    ) from exc

"""``COPY`` for big ``enqueue_many`` calls.

An ``enqueue_many`` call writes one run of rows that differ only in their arguments. Past
a few hundred rows, ``COPY ... FROM STDIN`` costs the server less per row than the
``INSERT ... SELECT FROM unnest(...)`` of :func:`~sqla_jobs._queries.insert_rows`, and
costs Python less too: each row is one line of text, the shared values written once and
repeated, the arguments' JSON (pure ASCII, see ``queries._dumps``) escaped with one
``str.replace``. Below :data:`COPY_MIN_ROWS` the INSERT wins: COPY has a round trip more
and no prepared plan.

COPY goes through the psycopg connection under the SQLAlchemy connection, inside the
caller's transaction (it is never committed here). The table's statement-level
``AFTER INSERT`` trigger fires for COPY as for an INSERT, so the workers are woken alike.
What COPY cannot do is skip a conflicting row, so rows with unique keys stay on the
``INSERT ... ON CONFLICT DO NOTHING`` path (:func:`copy_allowed` says no for them).

It would also go around what SQLAlchemy does for its own statements: ``echo`` logging,
the ``before_cursor_execute`` events and ``schema_translate_map``. A connection with any
of them therefore keeps the INSERT (the table's name would be wrong, a listener would not
see the call), and an error of the COPY is raised as SQLAlchemy's ``DBAPIError``, as the
INSERT's would be.

A call on a connection (or a session's big call, written at the call) checks its rows
after the first block while the COPY sends them (:class:`CheckedLater`); a bad one ends
the COPY inside a savepoint of its own, which takes back what was sent (see
:func:`copy_run`).
"""

from __future__ import annotations

import gc
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.pq import TransactionStatus

from ._direct import pipeline_allowed, raise_as_dbapi_error
from ._queries import defaulted_columns

__all__ = [
    "COPY_BLOCK_ROWS",
    "COPY_MIN_ROWS",
    "GC_PAUSE_MIN_ROWS",
    "CheckedLater",
    "copy_allowed",
    "copy_run",
    "gc_paused",
    "python_defaults",
]

#: The smallest run of rows written with COPY. Measured with ``benchmarks/curves.py
#: --rows bulk`` on the 2-core machine: at 300 rows per call COPY gives 1.3-1.4 times the
#: unnest INSERT's rate, at 10 rows plain psycopg's COPY is no faster than its INSERT (the
#: extra round trip eats what COPY saves per row); 200 lies between.
COPY_MIN_ROWS = 200

#: Rows per ``write``: the server parses a block while the next is made and checked
#: (see :func:`copy_run`), and the text held in memory stays bounded. Small enough that
#: a call of 1,000 rows overlaps three quarters of its checks with the server's work.
COPY_BLOCK_ROWS = 250

#: The columns a run writes, in the order of each line; ``run_at`` only when given (the
#: column's default is the same ``now()`` the INSERT would use).
_COLUMNS = ("task", "queue", "priority", "max_attempts", "status", "meta", "args")


#: The smallest ``enqueue_many`` call during whose checks the garbage collector is paused
#: (:func:`gc_paused`); a call whose length is unknown (an iterator) pauses it too.
GC_PAUSE_MIN_ROWS = 1_000

_gc_lock = threading.Lock()
#: How many threads are inside :func:`gc_paused`, and whether the collector was on when
#: the first of them came in (the last one out turns it back on only then).
_gc_pausers = 0
_gc_was_enabled = False


@contextmanager
def gc_paused(rows: Iterable[Any]) -> Iterator[None]:
    """Pause the garbage collector while a big ``enqueue_many`` call builds its rows.

    Each row is two new dicts (its checked arguments and its column values) that live
    until the rows are written: at 100,000 rows per call the collector ran again and again
    over a heap growing by 200,000 containers and doubled the call's Python time
    (measured: 3.4 µs a row with it paused, 5.6-7 µs without). Nothing built here is
    garbage, let alone a cycle, so a collection finds nothing to free.

    It is never paused across I/O: a COPY waiting on a lock could keep it off for minutes.
    (``Jobs.enqueue_many`` on a connection keeps only the rows' JSON text, strings, which
    the collector does not track.)

    The collector is a setting of the whole process: other threads run without it while
    the call checks its rows (tens of milliseconds per 10,000 rows; reference counting
    still frees everything but cycles), and a ``gc.enable()`` or ``gc.disable()``
    of theirs meanwhile may be undone when the last caller leaves. Threads in here at once
    share one pause: the collector comes back when the last one leaves, and only if it was
    on when the first came in. Calls below :data:`GC_PAUSE_MIN_ROWS` rows leave it alone.
    """
    global _gc_pausers, _gc_was_enabled
    if isinstance(rows, Sized) and len(rows) < GC_PAUSE_MIN_ROWS:
        yield
        return
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


class CheckedLater:
    """The arguments of a run, their JSON made and checked a block at a time as COPY
    sends them (``Jobs.enqueue_many`` on a connection, a session's big call).

    Checking a row costs Python about a quarter of what writing it costs the server.
    Checked all before the COPY, that time adds to the server's; checked block by block
    between the writes, it is spent while the server parses the block before (plain
    psycopg's ``write_row`` overlaps its formatting the same way). The first row was
    checked whole by the caller, with the call's options; ``encode`` checks a list of
    the others and gives their JSON texts, or raises :class:`~sqla_jobs.errors.EnqueueError`
    for the first bad one. :func:`copy_run` makes a bad row of a later block undo the
    blocks sent before it (see there)."""

    __slots__ = ("encode", "first", "rest")

    def __init__(self, first: str, rest: list[Any], encode: Callable[[list[Any]], list[str]]):
        self.first = first
        self.rest = rest
        self.encode = encode

    def __len__(self) -> int:
        return 1 + len(self.rest)

    def blocks(self, size: int) -> Iterator[list[str]]:
        """The texts, ``size`` rows at a time, each block checked when it is asked for."""
        rest, encode = self.rest, self.encode
        yield [self.first, *encode(rest[: size - 1])]
        for i in range(size - 1, len(rest), size):
            yield encode(rest[i : i + size])

    def all(self) -> list[str]:
        """Every text, all checked now (for the INSERT, which sends them at once)."""
        return [self.first, *self.encode(self.rest)]


def copy_allowed(
    connection: Any, table: sa.Table, count: int, unique_keys: Sequence[str | None]
) -> bool:
    """Whether a run of ``count`` rows goes through COPY: big enough, no unique keys, and
    no column that SQLAlchemy would fill from Python (:func:`python_defaults`), on a
    connection where statements may go to psycopg directly
    (:func:`~sqla_jobs._direct.pipeline_allowed`: psycopg 3, no ``schema_translate_map``
    to honour, no ``echo``, nothing listening for the statements). A COPY with a
    listener went around it: tracing, a statement counter or a comment added to every
    statement saw nothing of the call."""
    if count < COPY_MIN_ROWS or any(key is not None for key in unique_keys):
        return False
    if not isinstance(connection, sa.Connection):
        return False
    if python_defaults(table):
        return False
    return pipeline_allowed(connection)


_python_defaults: weakref.WeakKeyDictionary[sa.Table, bool] = weakref.WeakKeyDictionary()


def python_defaults(table: sa.Table) -> bool:
    """Whether a column of ``table`` that the job INSERTs leave out (a column of the
    application's model, a tenant) has a default of SQLAlchemy's, not the server's
    (``mapped_column(default="acme")``).

    SQLAlchemy puts such a default into each statement it runs (the bulk INSERT's
    ``SELECT``, the single INSERT), so the server never sees it: COPY, and a statement
    sent to psycopg as compiled, wrote NULL there (or failed on NOT NULL) where the
    INSERT wrote the default. Those paths are not taken for such a table. Worked out once
    per table."""
    try:
        return _python_defaults[table]
    except KeyError:
        pass
    found = _python_defaults[table] = bool(defaulted_columns(table))
    return found


def _text(value: Any) -> str:
    """One field of COPY's text format: ``\\N`` for NULL, the four special characters
    escaped.

    The text is the value's own, as the INSERT's driver sends it, never its ``__str__``:
    a ``str`` or ``int`` enum member's ``str()`` is ``'Queue.MAIL'`` (the checks give plain
    values already; this keeps any other caller from storing the member's name). A time
    is written as its UTC instant: PostgreSQL refuses an offset past 15:59 (``+23:59``,
    which Python allows and the INSERT's binary parameter carries)."""
    if value is None:
        return "\\N"
    if isinstance(value, str):
        text = str.__str__(value)
    elif isinstance(value, int):
        text = int.__repr__(value)
    elif isinstance(value, datetime):
        text = value.astimezone(timezone.utc).isoformat()
    else:
        text = str(value)
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _statement(connection: sa.Connection, table: sa.Table, with_run_at: bool) -> str:
    columns = _COLUMNS[:-1] + (("run_at",) if with_run_at else ()) + ("args",)
    quote = connection.dialect.identifier_preparer.quote
    return "COPY {} ({}) FROM STDIN".format(
        connection.dialect.identifier_preparer.format_table(table),
        ", ".join(quote(c) for c in columns),
    )


def copy_run(
    connection: sa.Connection,
    table: sa.Table,
    shared: dict[str, Any],
    args: Sequence[Any] | CheckedLater,
    to_json: Callable[[Any], str] | None = None,
) -> int:
    """COPY one run of rows into ``table``: ``shared`` holds the values every row has
    (``meta`` as JSON text), ``args`` each row's checked arguments, ``to_json`` gives their
    JSON text (without it, ``args`` are that text), or ``args`` is a
    :class:`CheckedLater`. Returns the number of rows written, from COPY's command tag:
    fewer than were sent when an application's ``BEFORE INSERT`` trigger skipped some
    (it returned NULL), as the INSERT's count says. (No row's id is read back, so a
    skipped row misplaces nothing.)

    The text is made a block of :data:`COPY_BLOCK_ROWS` rows at a time, each block sent
    before the next is made, so the server parses one block while Python makes the next,
    and a call of a million rows never holds all its text at once.

    Rows of a :class:`CheckedLater` are checked as their block is made; the first block
    before the COPY begins. A bad row in a later block ends the COPY with an error, which
    would abort the caller's transaction: when there is one (or psycopg will open one),
    the COPY runs inside a savepoint of its own, rolled back and released before the
    :class:`~sqla_jobs.errors.EnqueueError` goes on, so the caller's transaction is left
    as it was, as it is when a bad row is found before anything is sent. It costs two
    round trips, paid only by calls of more than one block. Without a transaction
    (autocommit), the COPY is one: its end with an error leaves nothing behind."""
    run_at = shared.get("run_at")
    prefix = "\t".join(_text(shared[name]) for name in _COLUMNS[:-1]) + "\t"
    if run_at is not None:
        prefix += _text(run_at) + "\t"
    statement = _statement(connection, table, run_at is not None)
    if isinstance(args, CheckedLater):
        later = len(args) > COPY_BLOCK_ROWS
        chunks = (_block(prefix, block, None) for block in args.blocks(COPY_BLOCK_ROWS))
    else:
        later = False
        chunks = (
            _block(prefix, args[i : i + COPY_BLOCK_ROWS], to_json)
            for i in range(0, len(args), COPY_BLOCK_ROWS)
        )
    first = next(chunks)  # made, and checked, before anything is sent
    # The COPY goes around SQLAlchemy, which begins the connection's transaction only at
    # its own first statement: without this, psycopg would open one that the Connection
    # does not know of, its commit() would commit nothing, and the pool would roll the
    # rows back (as _direct.execute does, and for the same reason).
    if not connection.in_transaction():
        connection.begin()
    driver = connection.connection.driver_connection
    guard = later and not (
        driver.autocommit  # type: ignore[union-attr]
        and driver.info.transaction_status == TransactionStatus.IDLE  # type: ignore[union-attr]
    )
    try:
        if hasattr(driver, "__aenter__"):  # psycopg.AsyncConnection, under run_sync
            from sqlalchemy.util import await_only

            written = await_only(_copy_async(driver, statement, first, chunks, guard))
        else:
            written = _copy_sync(driver, statement, first, chunks, guard)
    except connection.dialect.loaded_dbapi.Error as exc:
        raise_as_dbapi_error(connection, statement, exc)
    return len(args) if written < 0 else written


_SAVEPOINT = "SAVEPOINT sqla_jobs_copy"
_UNDO = "ROLLBACK TO SAVEPOINT sqla_jobs_copy; RELEASE SAVEPOINT sqla_jobs_copy"
_RELEASE = "RELEASE SAVEPOINT sqla_jobs_copy"


def _copy_sync(driver: Any, statement: str, first: str, chunks: Iterator[str], guard: bool) -> int:
    """Send the COPY; the number of rows it wrote (its command tag's), -1 if unknown."""
    with driver.cursor() as cursor:
        if guard:
            cursor.execute(_SAVEPOINT)
        try:
            with cursor.copy(statement) as copy:
                copy.write(first)
                for chunk in chunks:
                    copy.write(chunk)
        except Exception as exc:
            # A row refused by its check (not by the server): psycopg ended the COPY with
            # an error, and the savepoint takes back the blocks already written.
            if guard and _undo_needed(driver, exc):
                cursor.execute(_UNDO)
            raise
        written: int = cursor.rowcount  # read before the RELEASE replaces it
        if guard:
            cursor.execute(_RELEASE)
        return written


async def _copy_async(
    driver: Any, statement: str, first: str, chunks: Iterator[str], guard: bool
) -> int:
    async with driver.cursor() as cursor:
        if guard:
            await cursor.execute(_SAVEPOINT)
        try:
            async with cursor.copy(statement) as copy:
                await copy.write(first)
                for chunk in chunks:
                    await copy.write(chunk)
        except Exception as exc:
            if guard and _undo_needed(driver, exc):
                await cursor.execute(_UNDO)
            raise
        written: int = cursor.rowcount
        if guard:
            await cursor.execute(_RELEASE)
        return written


def _undo_needed(driver: Any, exc: Exception) -> bool:
    """Whether the COPY was ended by a refused row (the savepoint is rolled back then), not
    by the server: a database error leaves the transaction failed, as an INSERT's would."""
    return (
        not isinstance(exc, psycopg.Error)
        and driver.info.transaction_status == TransactionStatus.INERROR
    )


#: The text :class:`~sqla_jobs.tasks.CheckedArgs` carries, read in C (see :func:`_block`).
_checked_text = operator.attrgetter("json")


def _block(prefix: str, args: Sequence[Any], to_json: Callable[[Any], str] | None) -> str:
    """The lines of COPY's text format for some rows: ``prefix`` (the shared columns,
    escaped, each followed by a tab), then each row's arguments as JSON.

    Made with a few passes of C over the whole block rather than a format and a replace
    per row (0.25 µs a row, about the server's time for a tenth of a row). JSON text never
    holds a raw tab, newline or carriage return (JSON escapes every control character),
    so the texts can be joined with newlines, and a backslash is the one character COPY
    needs escaped in them: the joined text is escaped once, then each newline gets the
    prefix after it."""
    texts: Sequence[str]
    if to_json is None:
        texts = args
    else:
        try:
            # Checked arguments carry their text; anything else (or a CheckedArgs whose
            # text was never set) is encoded by ``to_json``.
            texts = list(map(_checked_text, args))
        except AttributeError:
            texts = [to_json(a) for a in args]
    body = "\n".join(texts)
    if "\\" in body:
        body = body.replace("\\", "\\\\")
    return prefix + body.replace("\n", "\n" + prefix) + "\n"

"""The worker's statement I/O, written once, as functions of a plain ``Connection``.

The threaded worker calls them directly; the asyncio worker calls the very same functions
through ``AsyncConnection.run_sync``. Each runs one statement or a few from
:class:`~sqla_jobs._queries.Queries` with the parameters its typed builders make.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from .. import periodic
from .._direct import Rows, autocommit, compiled, execute, pipeline_allowed, run_pipeline
from .._queries import (
    LOCK_NOT_AVAILABLE,
    NOT_READ_COMMITTED,
    ClaimParams,
    FairClaimParams,
    LimitedClaimParams,
    Queries,
    WorkerSeenParams,
    batch_params,
    heartbeat_params,
    limited_statement,
    status_literal,
    throughput_params,
)

# Named here for the drivers' listeners (``db.listen_sql``); they live with the statements.
from .._queries import listen_sql as listen_sql
from .._queries import unlisten_sql as unlisten_sql
from .._settle import format_error, settle_children
from .._storable import Encodings, database_encodings
from ..errors import WorkerError, answered, describe
from .job import (
    ClaimedJob,
    Outcome,
    OutcomeKind,
    job_log,
    keeps,
    outcome_statements,
    result_json,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ..tasks import Jobs

__all__ = [
    "HeldConnection",
    "Refresh",
    "Written",
    "beat",
    "claim",
    "claim_limited",
    "complete_in",
    "hand_back",
    "prune",
    "prune_batch",
    "refresh",
    "worker_gone",
    "worker_seen",
    "write_and_claim",
    "write_outcomes",
]

#: ``{queue: [succeeded, failed, dead]}``: outcomes written, not yet added to
#: ``<table>_throughput``.
Tally = dict[str, list[int]]

T = TypeVar("T")

#: Rows per promotion, rescue and retention batch.
BATCH = PRUNE_BATCH = 1000

log = logging.getLogger("sqla_jobs.worker")


#: The limited and fair claims' transaction; READ COMMITTED whatever the server's
#: default: the limited claim must see what committed while it waited for the lock, which
#: a REPEATABLE READ snapshot would not.
_BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"
# The plan the limited and fair claims run on (``GENERIC_PLAN``, sent with the queue's lock
# or alone before the claim): PostgreSQL's generic plan, planned once per connection, for
# the claim's transaction only. Left alone, once psycopg has prepared a claim PostgreSQL
# compares the generic plan's estimate with the custom plans' and keeps whichever looked
# cheaper at that moment, for the connection's life, so the same claim ran on either from
# one run to the next. Measured on both (a claim of 10,
# embedded PostgreSQL 18): over 1,000 keys at 4,000 to 100,000 jobs, keyed 0.73 ms
# generic against 1.2 custom, ``key_rate`` 1.3-1.7 against 2.4-2.5, fifo 1.3 against 2.6
# (planning them was most of their cost); without keys, once the claim probed its rows
# by primary key (``id = ANY(...)``; its generic plan had joined them to a scan of the
# whole table), 0.82-0.87 against 1.1 at 20,000 jobs and 0.40 against 0.71 at 200,000,
# a rated one 0.65-0.8 against 1.0.


def running_in(
    conn: sa.Connection, queries: Queries, queues: Sequence[str], ordered: Sequence[str] = ()
) -> bool:
    """Whether any of ``queues`` has a running job, whichever worker runs it, or any of
    ``ordered`` (queues in key order) a keyed job cancelled while it ran whose lease has
    not passed: its handler may still run, and it holds its key until then (time frees
    that). Those are read through ``<table>_key_order``, which holds the queue's keyed
    cancelled jobs."""
    c = queries.table.c
    found: sa.ColumnElement[bool] = sa.exists().where(
        c.status == status_literal("running"), c.queue.in_(list(queues))
    )
    if ordered:
        leased = sa.exists().where(
            c.queue.in_(list(ordered)),
            c.concurrency_key.is_not(None),
            c.status == status_literal("cancelled"),
            c.locked_until > sa.func.now(),
        )
        found = sa.or_(found, leased)
    return bool(conn.execute(sa.select(found)).scalar())


def claim(conn: sa.Connection, queries: Queries, params: ClaimParams) -> list[Any]:
    """Claim up to ``params["limit"]`` ready jobs of one queue; the claimed rows.

    At READ COMMITTED whatever the server's default, as the other claims: at SERIALIZABLE
    the claim made each transactional run beside it a pivot ("could not serialize access
    due to read/write dependencies"), run after run. Where the default is not READ
    COMMITTED, between :data:`_BEGIN` and COMMIT, in one pipeline where it is allowed."""
    if not autocommit(conn) or _implicit_transaction(conn):
        return _rows(conn, queries, queries.claim, params)
    if pipeline_allowed(conn):
        made = compiled(queries.compiled, queries.claim, conn.dialect)
        sent = [(_BEGIN, None), (made.sql, made.params(params)), ("COMMIT", None)]
        [(rows, _names)] = run_pipeline(conn, sent, [1])
        return rows
    with _read_committed(conn):
        return _rows(conn, queries, queries.claim, params)


def _rows(
    conn: sa.Connection, queries: Queries, statement: Any, params: Mapping[str, Any]
) -> list[Any]:
    """Every row of one of the worker's statements: sent straight to psycopg where
    :func:`~sqla_jobs._direct.pipeline_allowed` says it may, as the enqueue on a
    connection is, otherwise through SQLAlchemy. The rows are read by position either
    way."""
    if pipeline_allowed(conn):
        return execute(conn, compiled(queries.compiled, statement, conn.dialect), params)
    return list(conn.execute(statement, dict(params)).all())


def claim_fair(
    conn: sa.Connection, queries: Queries, params: FairClaimParams
) -> tuple[list[Any], str | None, tuple[str, int] | None]:
    """Claim from a queue with ``fair=True`` (one statement, as the plain claim: no lock);
    the claimed rows, the key where its walk over the keys stopped (the next claim's
    ``after_key``), and the key it took the most jobs from with the last id it took (the
    next claim's floor, see :func:`~sqla_jobs._queries.fair_claim_params`), or None.

    When :func:`~sqla_jobs._direct.pipeline_allowed` says it may, the statement runs on
    PostgreSQL's generic plan, asked for in a transaction of its own (the plan mode, the
    claim: one pipeline, one round trip, see :func:`_claim_in_pipeline`). Left to itself,
    PostgreSQL keeps custom plans for it, and planning the walk over the keys was a third
    of the claim: a claim of 200 took 4.9 ms on custom plans and 3.8 on the generic one, a
    claim of 10 2.3 and 1.2 (20,000 and 101,000 jobs alike, embedded PostgreSQL 18).
    Watched (a listener, ``echo``), it stays one statement in autocommit, through
    SQLAlchemy, on whatever plan PostgreSQL keeps."""
    statement = queries.fair_claim()
    if pipeline_allowed(conn):
        [(found, names)] = _claim_in_pipeline(conn, queries, statement, params, locked=False)
    else:
        result: list[Any] = list(conn.execute(statement, dict(params)).all())
        found, names = result, list(result[0]._fields) if result else []
    if not found:
        return [], None, None
    rows = _claimed_rows(found)
    first = found[0]
    key, floor = first[names.index("floor_key")], first[names.index("floor_id")]
    return rows, first[names.index("last_key")], None if key is None else (key, floor)


@dataclass(frozen=True)
class LimitedClaim:
    """What :func:`claim_limited` found: the claimed rows, whether the queue's limits held
    ready jobs back, and when its rate allows the next start (seconds, or None)."""

    rows: list[Any]
    held: bool
    rate_free_in: float | None
    #: Seconds until the first key held by the queue's ``key_rate`` has room (or None).
    key_free_in: float | None = None
    #: A queue in key order: where the claim's walk over the keys stopped (the next
    #: claim's ``after_key``), or None.
    last_key: str | None = None
    #: Its lock (or a row the claim writes) was held by another transaction past
    #: ``CLAIM_LOCK_TIMEOUT``: nothing was claimed, the queue is to be tried again later.
    busy: bool = False


def claim_limited(
    conn: sa.Connection, queries: Queries, params: LimitedClaimParams
) -> LimitedClaim:
    """Claim within a queue's limits (see :mod:`sqla_jobs.throttle`): take the queue's
    lock, then claim in a second statement, which sees every claim committed before the
    lock was granted; commit. ``conn`` is in autocommit (the claim connection), so the
    transaction is the pipeline's implicit one, or begun and ended here, by hand.

    The statements (the lock with the plan mode, the claim) go in one psycopg pipeline,
    one round trip and one transaction (see :func:`_claim_in_pipeline`), when
    :func:`~sqla_jobs._direct.pipeline_allowed` says they may: the round trips were most
    of what a limited claim cost beyond the plain one (``benchmarks/limits.py
    --round-trips``). Otherwise (another driver, a ``schema_translate_map``, something
    listening for the statements), BEGIN, the lock with the plan mode, the claim and
    COMMIT, one round trip each, through SQLAlchemy."""
    statement = limited_statement(queries, params)
    try:
        if pipeline_allowed(conn):
            [(result, names)] = _claim_in_pipeline(conn, queries, statement, params, locked=True)
            return _limited_found(result, names)
        stepwise = _claim_limited_stepwise(conn, queries, statement, params)
    except sa.exc.DBAPIError as exc:
        busy = _busy(exc)
        if busy is None:
            raise
        return busy
    return _limited_found(stepwise, list(stepwise[0]._fields) if stepwise else [])


def _busy(exc: sa.exc.DBAPIError) -> LimitedClaim | None:
    """What a limited claim found when its queue's lock (or a row it writes) was another
    transaction's past ``CLAIM_LOCK_TIMEOUT``: nothing, the queue busy (its transaction
    rolled back, the connection idle); None for any other error."""
    if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
        return None
    return LimitedClaim([], held=True, rate_free_in=None, busy=True)


def _claimed_rows(result: Sequence[Any]) -> list[Any]:
    """The claimed jobs' rows of a limited or fair claim's result, as they came: the
    claimed columns (:data:`~sqla_jobs._queries.CLAIMED_COLUMNS`) first, then what the
    claim says of its limits, which the worker, reading by position, never looks at.

    The result is ``info LEFT JOIN claimed ON true``: one row of NULL jobs when nothing
    was claimed, else one row per job. Slicing each row down to its job's columns copied
    every row of every claim (28 µs against 3.4 for a claim of 200, timeit)."""
    if not result or result[0][0] is None:
        return []
    return list(result)


def _limited_found(result: Sequence[Any], names: Sequence[str]) -> LimitedClaim:
    """A limited claim's rows read: the jobs, and what its first row says of the limits."""
    column = {name: i for i, name in enumerate(names)}
    rows = _claimed_rows(result)
    first = result[0]

    def info(name: str) -> Any:
        at = column.get(name)
        return None if at is None else first[at]

    free_in, key_free_in = info("rate_free_in"), info("key_free_in")
    return LimitedClaim(
        rows,
        int(info("ready_seen")) > len(rows),
        None if free_in is None else float(free_in),
        None if key_free_in is None else float(key_free_in),
        info("last_key"),
    )


def _claim_in_pipeline(
    conn: sa.Connection,
    queries: Queries,
    statement: sa.ClauseElement,
    params: Mapping[str, Any],
    *,
    locked: bool,
    before: Sequence[tuple[sa.Executable, Mapping[str, Any]]] = (),
) -> list[Rows]:
    """A claim's transaction in one psycopg pipeline: the statements ``before`` it (an
    outcome batch's, see :func:`write_and_claim`), its plan mode, with ``locked`` the
    queue's lock, then the claim ``statement``; each a Core statement of ``queries``,
    compiled once. The rows and column names of each statement of ``before``, then of the
    claim.

    No BEGIN and no COMMIT where :func:`_implicit_transaction` says the server's own
    transaction is the one wanted: the statements of a pipeline before its Sync are one
    implicit transaction (the lock is held to its end, and an error rolls all of them
    back), and the plan mode rides with the lock (:data:`~sqla_jobs._queries.GENERIC_PLAN`).
    Two statements instead of five: each is another wait on the socket in psycopg's
    pipeline, which gives the GIL up and waits to take it back; beside 64 threads busy in
    Python a limited claim of 200 took 24 ms in five statements and 18 in two, against 10
    for the plain claim's one (a worker's executor threads are such neighbours). Elsewhere,
    the same statements between BEGIN ISOLATION LEVEL READ COMMITTED and COMMIT.

    The server's default isolation, asked once per connection, can change under a live
    connection (a reload of its configuration): the lock's statement checks the level
    (:data:`~sqla_jobs._queries.READ_COMMITTED`), and where it finds another, nothing was
    claimed or written, the connection's answer is forgotten, and the claim is sent again
    between BEGIN and COMMIT."""

    def sent(statement: Any, params: Mapping[str, Any]) -> tuple[str, Any]:
        made = compiled(queries.compiled, statement, conn.dialect)
        return made.sql, made.params(params)

    first = _plan_and_lock(queries, params, locked)
    statements = [*(sent(s, p) for s, p in before), sent(*first), sent(statement, params)]
    rows_of = [*range(len(before)), len(statements) - 1]
    if _implicit_transaction(conn):
        try:
            return run_pipeline(conn, statements, rows_of)
        except sa.exc.DBAPIError as exc:
            if not locked or getattr(exc.orig, "sqlstate", None) != NOT_READ_COMMITTED:
                raise
            conn.connection.info.pop(_READ_COMMITTED, None)  # asked again at the next claim
    explicit = [(_BEGIN, None), *statements, ("COMMIT", None)]
    return run_pipeline(conn, explicit, [i + 1 for i in rows_of])


def _plan_and_lock(
    queries: Queries, params: Mapping[str, Any], locked: bool
) -> tuple[sa.Executable, Mapping[str, Any]]:
    """The statement a claim's transaction begins with: the generic plan asked for, with
    ``locked`` in the same statement as the queue's lock."""
    if locked:
        return queries.limit_lock_generic, {"queue_name": params["queue_name"]}
    return queries.generic_plan, {}


#: Where :func:`_implicit_transaction` keeps what it found, in the pooled connection's
#: ``info`` (it lives as long as the database connection does).
_READ_COMMITTED = "sqla_jobs.read_committed"


def _implicit_transaction(conn: sa.Connection) -> bool:
    """Whether a claim's pipeline may be the server's implicit transaction: the driver
    connection is in autocommit (else psycopg would begin a transaction of its own and
    leave it open), and the server's ``default_transaction_isolation`` is READ COMMITTED
    (the limited claim must see what committed while it waited for the lock, which a
    REPEATABLE READ snapshot, taken by the lock's statement, would not). The isolation is
    asked once per database connection (one query, at its first claim)."""
    if not autocommit(conn):
        return False
    info = conn.connection.info
    found = info.get(_READ_COMMITTED)
    if found is None:
        level = conn.exec_driver_sql("SHOW default_transaction_isolation").scalar()
        found = info[_READ_COMMITTED] = level == "read committed"
    return bool(found)


#: Where :func:`_read_committed` keeps whether a pooled connection's transactions begin
#: READ COMMITTED (the engine's ``isolation_level``, or else the server's default).
_BEGINS_READ_COMMITTED = "sqla_jobs.begins_read_committed"


@contextlib.contextmanager
def _read_committed(conn: sa.Connection, whole: bool = False) -> Iterator[None]:
    """Run the worker's own statements of the block (a heartbeat, an outcome batch) at
    READ COMMITTED, whatever the engine's isolation or the server's default, as the
    claims run (:data:`_BEGIN`). Under REPEATABLE READ or SERIALIZABLE such a statement
    failed with a serialization error wherever it met a row another transaction changed
    since its snapshot (a completion beside a renewal of the same lease): a heartbeat that
    failed so renewed no lease, and an outcome batch was written again.

    No round trip more where the level already is READ COMMITTED (found once per
    database connection, one query). Elsewhere, in autocommit, the block is one
    transaction between :data:`_BEGIN` and COMMIT (always, with ``whole``: a block of
    several statements, or with savepoints, that must be one transaction); in a
    transaction (``engine.begin()``), its first statement is ``SET TRANSACTION ISOLATION
    LEVEL READ COMMITTED`` (the ``SHOW`` that asks takes no snapshot, so it may come
    before it)."""
    if autocommit(conn):
        if not whole and _implicit_transaction(conn):
            yield
            return
        conn.exec_driver_sql(_BEGIN)
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                conn.exec_driver_sql("ROLLBACK")
            raise
        conn.exec_driver_sql("COMMIT")
        return
    info = conn.connection.info
    found = info.get(_BEGINS_READ_COMMITTED)
    if found is None:
        level = conn.exec_driver_sql("SHOW transaction_isolation").scalar()
        found = info[_BEGINS_READ_COMMITTED] = level == "read committed"
    if not found:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
    yield


def in_read_committed(conn: sa.Connection, fn: Callable[..., T], args: Sequence[Any]) -> T:
    """``fn(conn, *args)`` at READ COMMITTED, in ``conn``'s transaction, which it begins:
    the worker's statements of :attr:`~._steps.Conn.TX` (the maintenance pass, the hand
    back, the worker's row), as its claims, heartbeats and outcome writes run. Under
    REPEATABLE READ (an engine's ``isolation_level``, the database's
    ``default_transaction_isolation``) the maintenance pass's snapshot was taken at its
    first statement, the rescue: a due schedule, a retry or an expired lease that another
    worker's pass, a completion or an operator changed in the milliseconds after it made
    the pass fail with a serialization error, its rescues and promotions rolled back.

    One transaction on an engine in autocommit too (``isolation_level="AUTOCOMMIT"``,
    given to a worker): there the pass's first savepoint failed ("SAVEPOINT can only be
    used in transaction blocks"), every pass, and no lease was rescued, no retry promoted."""
    with _read_committed(conn, whole=True):
        return fn(conn, *args)


def lone_read_committed(conn: sa.Connection, ask: bool = False) -> bool | None:
    """Whether a lone statement on ``conn`` runs at READ COMMITTED (see
    :func:`_implicit_transaction`), as far as known without a query (None: not asked yet
    on this connection); with ``ask``, asked if not known. The asyncio worker's plain
    claim goes straight to psycopg only where it does."""
    if not autocommit(conn):
        return False
    if ask:
        return _implicit_transaction(conn)
    found = conn.connection.info.get(_READ_COMMITTED)
    return None if found is None else bool(found)


def _claim_limited_stepwise(
    conn: sa.Connection, queries: Queries, statement: Any, params: LimitedClaimParams
) -> list[Any]:
    conn.exec_driver_sql(_BEGIN)
    try:
        conn.execute(*_plan_and_lock(queries, params, locked=True))
        result = list(conn.execute(statement, dict(params)).all())
    except BaseException:
        with contextlib.suppress(Exception):
            conn.exec_driver_sql("ROLLBACK")
        raise
    conn.exec_driver_sql("COMMIT")
    return result


def write_outcomes(conn: sa.Connection, queries: Queries, batch: Iterable[Outcome]) -> Written:
    """Record a batch of outcomes: one statement for all successes, one per failure.
    Returns how many succeeded, failed and died per queue, as the database confirmed
    (a claim the guard no longer matches is not counted), and what failed after the
    plain statements committed (:attr:`Written.rest_error`: those are counted, and match
    nothing when the batch is written again).

    Jobs that use no workflow are written in autocommit, each statement atomic by itself;
    if a later one fails, the completer writes the whole batch again, and the guard makes
    the repeated ones match nothing (and count nothing). Jobs that keep a result or have
    children ("flow" jobs) are completed in one transaction with the release (or the
    cancelling) of their children, so that no crash can leave a child waiting on a parent
    that is done. A job whose child was enqueued while it ran was claimed as a plain job:
    the autocommit completion leaves it running (it has children now), and it is completed
    with the flow jobs, kept ``done`` until retention like any parent.
    """
    batch = list(batch)
    plain, flow = _outcome_statements(queries, batch, database_encodings(conn))
    # READ COMMITTED whatever the server's default (see _read_committed).
    with _read_committed(conn) if autocommit(conn) and plain else contextlib.nullcontext():
        results = [
            _rows(conn, queries, _sent(queries, statement), params) for statement, params in plain
        ]
    return _written(conn, queries, batch, plain, results, flow)


@dataclass(frozen=True)
class Written:
    """What :func:`write_and_claim` did: the outcomes written (as :func:`write_outcomes`
    counts them), and the claim that rode with them, or why it could not."""

    tally: Tally
    claim: LimitedClaim | None = None
    #: The claim's database error: the outcomes were written all the same.
    claim_error: sa.exc.DBAPIError | None = None
    #: What failed after the plain statements (and the claim) committed, writing the rest
    #: of the batch (its flow jobs, the children of its dead ones): what committed is in
    #: :attr:`tally`, the claim's jobs are to run, and the batch is to be written again
    #: (its guards make the written part match nothing).
    rest_error: Exception | None = None


def write_and_claim(
    conn: sa.Connection,
    queries: Queries,
    batch: Iterable[Outcome],
    limited: LimitedClaimParams | None,
) -> Written:
    """Write an outcome batch and, with ``limited``, claim from the limited queue whose
    slots it frees, in one round trip where the pipeline is allowed.

    Why: a queue whose concurrency limit binds can be claimed again only once the
    completions that free its slots have committed (the limit counts the table's
    ``running`` rows, which keeps it exact across workers, kills and lease expiry). Written
    by the completer and claimed by the fetch loop, each freed slot waited for two round
    trips in a row and a hand-off between them, and a binding ``concurrency=64`` drained
    at half of what 64 unlimited slots do (``benchmarks/limits.py``). Here the batch's
    statements, the queue's lock and the claim are one transaction in one pipeline: the
    claim counts the rows the batch has just ended, and the limit still holds exactly (a
    slot is reused only by the statement after the one that freed it, in the same
    transaction).

    A failing claim does not hold the outcomes up: its transaction rolls back, the batch
    is written alone, and the error is handed back in :attr:`Written.claim_error` (the
    fetch loop claims instead). Watched (see :func:`~sqla_jobs._direct.pipeline_allowed`),
    the batch is written and then claimed, one statement at a time."""
    batch = list(batch)
    if limited is None:
        return write_outcomes(conn, queries, batch)
    statement = limited_statement(queries, limited)
    if pipeline_allowed(conn):
        plain, flow = _outcome_statements(queries, batch, database_encodings(conn))
        before = [(_sent(queries, s), p) for s, p in plain]
        try:
            *results, (found, names) = _claim_in_pipeline(
                conn, queries, statement, limited, locked=True, before=before
            )
        except sa.exc.DBAPIError as exc:
            if exc.connection_invalidated:
                raise  # nothing was written; the completer writes the batch again
            alone = write_outcomes(conn, queries, batch)
            busy = _busy(exc)
            if busy is not None:
                return Written(alone.tally, busy, rest_error=alone.rest_error)
            return Written(alone.tally, claim_error=exc, rest_error=alone.rest_error)
        # The claim has committed: its jobs are this worker's, whatever follows.
        claim = _limited_found(found, names)
        rest = _written(conn, queries, batch, plain, [r for r, _ in results], flow)
        return Written(rest.tally, claim, rest_error=rest.rest_error)
    written = write_outcomes(conn, queries, batch)
    if written.rest_error is not None:
        return written
    try:
        return Written(written.tally, claim_limited(conn, queries, limited))
    except sa.exc.DBAPIError as exc:
        return Written(written.tally, claim_error=exc)


def _outcome_statements(
    queries: Queries, batch: Sequence[Outcome], encodings: Encodings | None = None
) -> tuple[list[tuple[sa.Executable, dict[str, Any]]], list[tuple[sa.Executable, dict[str, Any]]]]:
    """A batch's statements, the plain ones (written one by one, in autocommit, or ahead
    of a claim) apart from the flow ones (written in a transaction of their own).

    With ``encodings`` (the connection or the database is not UTF-8, see
    :func:`~sqla_jobs._storable.database_encodings`), what the batch holds is made
    storable first (:func:`_storable_outcomes`), and its texts escaped."""
    if encodings is not None:
        _storable_outcomes(batch, encodings)
    plain: list[tuple[sa.Executable, dict[str, Any]]] = []
    flow: list[tuple[sa.Executable, dict[str, Any]]] = []
    for statement, params in outcome_statements(queries, batch):
        if encodings is not None:
            if params.get("error"):
                params["error"] = encodings.escape(params["error"])
            if params.get("progress"):
                params["progress"] = encodings.escape_json(params["progress"])
        is_flow = statement is queries.complete_flow or statement is queries.fail_flow
        (flow if is_flow else plain).append((statement, params))
    return plain, flow


def _storable_outcomes(batch: Sequence[Outcome], encodings: Encodings) -> None:
    """Over a connection, or to a database, that is not UTF-8: a kept result it cannot
    carry fails its run, dead, with a :class:`~sqla_jobs.ResultError` saying why (the
    rule :meth:`Jobs.enqueue <sqla_jobs.Jobs.enqueue>` holds arguments to: non-ASCII JSON
    needs a UTF-8 connection, since psycopg reads JSON back as UTF-8).

    Sent as it was, the completion failed in the driver's encoder (``UnicodeEncodeError``):
    its outcome was never written, and the job that had succeeded ran again once its
    lease passed. The run is not retried: it would return the same value."""
    for outcome in batch:
        error = None if outcome.result is None else encodings.result_error(outcome.result)
        if error is None:
            continue
        outcome.kind, outcome.result = OutcomeKind.FAILED, None
        outcome.error, outcome.permanent = format_error(error), True
        job_log(logging.ERROR, outcome.job, "its result cannot be stored: %s", error)


def check_result(conn: sa.Connection, text: str) -> None:
    """Raise :class:`~sqla_jobs.ResultError` if ``conn`` cannot carry the result ``text``
    (JSON; see :func:`_storable_outcomes`)."""
    if text.isascii():
        return
    encodings = database_encodings(conn)
    error = None if encodings is None else encodings.result_error(text)
    if error is not None:
        raise error


def _sent(queries: Queries, statement: sa.Executable) -> sa.Executable:
    """What is sent for a plain statement: the worker's completion leaves a job that has
    children running (see :func:`write_outcomes`)."""
    return queries.complete_childless if statement is queries.complete else statement


def _written(
    conn: sa.Connection,
    queries: Queries,
    batch: Sequence[Outcome],
    plain: Sequence[tuple[sa.Executable, dict[str, Any]]],
    results: Sequence[Sequence[Any]],
    flow: list[tuple[sa.Executable, dict[str, Any]]],
) -> Written:
    """Count the plain statements' ``results``, then write what follows from them: the
    children of plain jobs that died, and the flow jobs (with the plain successes left
    running, parents now) in one transaction. What fails there is handed back with the
    count of what committed (:attr:`Written.rest_error`)."""
    queue_of = {o.job.id: o.job.queue for o in batch}
    tally: Tally = {}
    succeeded: list[int] = []
    ended: list[int] = []
    for (statement, params), rows in zip(plain, results, strict=True):
        if statement is queries.complete:
            done = {r[0] for r in rows}
            if len(done) < len(params["ids"]):
                # Left running: a parent now (or a lost claim, which matches nothing again).
                flow = _complete_with_flow(queries, flow, params, done)
        _count(rows, statement, queries, queue_of, tally, succeeded, ended)
    try:
        _write_rest(conn, queries, queue_of, tally, ended, flow)
    except Exception as exc:
        return Written(tally, rest_error=exc)
    return Written(tally)


def _write_rest(
    conn: sa.Connection,
    queries: Queries,
    queue_of: dict[int, str],
    tally: Tally,
    ended: list[int],
    flow: list[tuple[sa.Executable, dict[str, Any]]],
) -> None:
    """The children of the plain jobs that died, then the flow jobs, counted in
    ``tally`` once their transaction commits."""
    if ended:
        # A plain job that died with a child enqueued while it ran: that child is cancelled
        # (or released) in a statement of its own. A crash before it leaves the parent dead
        # with {"sqla_jobs.children": true}, which the retention pass settles. READ
        # COMMITTED, as the rest (see settle_children).
        with _read_committed(conn) if autocommit(conn) else contextlib.nullcontext():
            settle_children(conn, queries, [], ended)
    if not flow:
        return
    counted: Tally = {}
    succeeded: list[int] = []
    ended = []
    # READ COMMITTED whatever the server's default: the release reads what sibling
    # parents committed while it waited for their children (see settle_children).
    conn.exec_driver_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
    try:
        for statement, params in flow:
            rows = conn.execute(statement, params).all()
            _count(rows, statement, queries, queue_of, counted, succeeded, ended)
        settle_children(conn, queries, succeeded, ended)
    except BaseException:
        # On a connection the server ended, the ROLLBACK fails too: the error to raise
        # is the first one.
        with contextlib.suppress(Exception):
            conn.exec_driver_sql("ROLLBACK")
        raise
    conn.exec_driver_sql("COMMIT")
    for queue, counts in counted.items():
        mine = tally.setdefault(queue, [0, 0, 0])
        for i, n in enumerate(counts):
            mine[i] += n


def _complete_with_flow(
    queries: Queries,
    flow: list[tuple[sa.Executable, dict[str, Any]]],
    plain: dict[str, Any],
    done: set[int],
) -> list[tuple[sa.Executable, dict[str, Any]]]:
    """``flow`` with the plain successes not in ``done`` added to its completion (keeping
    nothing: no result, expired at once), which comes first and stays in id order (the
    order every statement that locks a batch takes its rows in, see ``batch_params``)."""
    left = [i not in done for i in plain["ids"]]
    rows = [
        (i, a, None, 0.0)
        for i, a, keep in zip(plain["ids"], plain["attempt_list"], left, strict=True)
        if keep
    ]
    rest = []
    for s, p in flow:
        if s is queries.complete_flow:
            lists = (p["ids"], p["attempt_list"], p["result_list"], p["keep_list"])
            rows += zip(*lists, strict=True)
        else:
            rest.append((s, p))
    if not rows:
        # Every id was completed: the batch held one job twice (an attempt whose lease
        # lapsed while its outcome waited, and the next one), and the stale one, a lost
        # claim, matches nothing wherever it goes.
        return flow
    rows.sort(key=operator.itemgetter(0))
    ids, attempts, results, keeps = (list(column) for column in zip(*rows, strict=True))
    params = {"ids": ids, "attempt_list": attempts, "result_list": results, "keep_list": keeps}
    return [(queries.complete_flow, params), *rest]


def _count(
    rows: Sequence[Any],
    statement: sa.Executable,
    queries: Queries,
    queue_of: dict[int, str],
    tally: Tally,
    succeeded: list[int],
    ended: list[int],
) -> None:
    """Add written outcomes to the tally, and note the parents among them."""
    if statement is queries.complete or statement is queries.complete_flow:
        for row in rows:
            tally.setdefault(queue_of[row[0]], [0, 0, 0])[0] += 1
            if row[1]:
                succeeded.append(row[0])
    elif statement is queries.fail or statement is queries.fail_flow:
        for row in rows:
            counts = tally.setdefault(queue_of[row[0]], [0, 0, 0])
            counts[1] += 1
            dead = row[1] == "dead"
            counts[2] += dead
            if dead and row[2]:
                ended.append(row[0])


def beat(
    conn: sa.Connection,
    queries: Queries,
    claims: list[ClaimedJob],
    lease: timedelta,
    progress: list[str | None] | None = None,
) -> set[tuple[int, int]]:
    """Extend the leases of these claims (and write their new progress notes, one per
    claim, None for none); the ``(id, attempts)`` of those still held.

    A note the connection cannot carry (a LATIN1 database, a WIN1252 client) is written
    with those characters escaped (see :meth:`~sqla_jobs._storable.Encodings.escape_json`):
    sent as it was, it failed every beat in the driver's encoder, until the worker
    stopped and every running job's lease lapsed."""
    if progress is not None and any(n is not None and not n.isascii() for n in progress):
        encodings = database_encodings(conn)
        if encodings is not None:
            progress = [None if n is None else encodings.escape_json(n) for n in progress]
    # READ COMMITTED whatever the server's default (see _read_committed): under a
    # snapshot a renewal that met a completion failed, and renewed no lease of the beat.
    with _read_committed(conn):
        rows = conn.execute(queries.heartbeat, dict(heartbeat_params(claims, lease, progress)))
        return {(r.id, r.attempts) for r in rows}


def hand_back(conn: sa.Connection, queries: Queries, claims: list[ClaimedJob]) -> int:
    """Make these claims ready again (the attempt not counted) and NOTIFY their queues;
    how many were still this worker's."""
    rows = conn.execute(queries.hand_back, dict(batch_params(claims))).all()
    return sum(int(r.n) for r in rows)


def complete_in(
    session: Session | sa.Connection, queries: Queries, job: ClaimedJob, value: Any = None
) -> bool:
    """The guarded completion of one claim, in the caller's transaction (a transactional
    task's), with its children released in it too. False if the claim is no longer this
    worker's. A result-keeping job keeps ``value`` (the handler's return; a value that is
    not JSON raises :class:`~sqla_jobs.ResultError`, which fails the run)."""
    keep = keeps(job)
    if keep is not None:
        result = result_json(value)
        check_result(
            session if isinstance(session, sa.Connection) else session.connection(), result
        )
        params = dict(batch_params([job]))
        params.update(result_list=[result], keep_list=[keep])
        row = session.execute(queries.complete_flow, params).first()
    else:
        row = session.execute(queries.complete, dict(batch_params([job]))).first()
    if row is not None and row[1]:
        settle_children(session, queries, [job.id], [])
    return row is not None


def worker_seen(
    conn: sa.Connection, queries: Queries, seen: WorkerSeenParams, tally: Tally, tidy: bool
) -> None:
    """Refresh this worker's row in ``<table>_workers`` and add its counts to
    ``<table>_throughput``; with ``tidy``, also forget workers long gone and counts more
    than a day old."""
    conn.execute(queries.worker_seen, dict(seen))
    if tally:
        conn.execute(queries.add_throughput, dict(throughput_params(tally)))
    if tidy:
        conn.execute(queries.forget_workers)
        conn.execute(queries.forget_throughput)


def worker_gone(conn: sa.Connection, queries: Queries, name: str, tally: Tally) -> None:
    """A worker stopped cleanly: add its last counts, and delete its row."""
    if tally:
        conn.execute(queries.add_throughput, dict(throughput_params(tally)))
    conn.execute(queries.worker_gone, {"name": name})


@dataclass(frozen=True)
class Refresh:
    """What a worker learns from :func:`refresh`."""

    #: Seconds until the next scheduled job is due (None: nothing scheduled).
    due_in: float | None
    paused: frozenset[str]
    #: Queues that have ready jobs now because this refresh promoted or rescued some: a
    #: worker that does not LISTEN hears of them only here (its dry queues, see
    #: ``WorkerCore._claim_order``, are claimed again at once).
    woken: frozenset[str] = frozenset()


#: How long a worker's schedule sync waits for a schedule's row: another worker's pass
#: holds it while it enqueues that schedule's tick (a worker paused there, for as long as
#: it is paused).
SYNC_LOCK_TIMEOUT = "1s"
_SYNC_BOUNDED = sa.select(sa.func.set_config("lock_timeout", SYNC_LOCK_TIMEOUT, True))


def sync_schedules(conn: sa.Connection, jobs: Jobs) -> bool:
    """:func:`sqla_jobs.periodic.sync_declared`, as a worker starts and, until it has
    succeeded, before each maintenance refresh: False when a schedule's row was locked
    past :data:`SYNC_LOCK_TIMEOUT` (the next pass tries again; the refresh goes on).

    It waited on such a lock without bound: a paused worker's lock on a schedule row kept
    a starting worker from claiming anything for as long as it was paused (a rolling
    deploy stalled). See ``WorkerCore.starting`` for the errors that stop a start.

    First, what the server said of the connection's settings (:func:`check_settings`):
    run as the worker starts, so that a setting no worker can run under stops it there,
    saying so."""
    check_settings(conn)
    # Learnt now (no round trip), for the runs' results (see Run.__exit__).
    database_encodings(conn)
    conn.execute(_SYNC_BOUNDED)  # local to this transaction
    try:
        with conn.begin_nested():
            periodic.sync_declared(conn, jobs)
    except sa.exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available
            raise
        return False
    return True


def check_settings(conn: sa.Connection) -> None:
    """Raise :class:`~sqla_jobs.WorkerError` if the connection's ``DateStyle`` is not ISO.

    psycopg 3 reads a timestamp only in ISO's format: under another ``DateStyle`` (``ALTER
    DATABASE ... SET datestyle = 'SQL, DMY'``) every statement that returns one fails with
    ``NotImplementedError: can't parse timestamptz with DateStyle ...``, the worker's own
    first among them. :func:`sqla_jobs.create_engine` sets ISO on its connections; an
    engine the application made itself is told here how to. Read from what the server
    reported (no round trip)."""
    driver = conn.connection.driver_connection
    status = getattr(getattr(driver, "info", None), "parameter_status", None)
    style = status("DateStyle") if status is not None else None
    if not style or style.upper().startswith("ISO"):
        return
    raise WorkerError(
        f"the connection's DateStyle is {style!r}, and psycopg reads timestamps only under "
        "DateStyle ISO: make the engine with sqla_jobs.create_engine (or "
        "create_async_engine), which sets it, or pass "
        "connect_args={'options': '-c DateStyle=ISO'} to your engine, or set it for the "
        "role or the database (ALTER ROLE ... SET DateStyle = 'ISO, DMY', or ALTER "
        "DATABASE ...; the second part, DMY or MDY, is the order your dates are read in)"
    )


def refresh(conn: sa.Connection, jobs: Jobs, rescue: bool, queues: Iterable[str] = ()) -> Refresh:
    """Every worker's maintenance, each poll interval, in one transaction: rescue expired
    leases (if asked), promote due jobs, enqueue due cron ticks, and read the pause state
    and the next due time (of a job of ``queues``, the worker's, that is not paused).

    Doing it in every worker means no leader has to be alive for retries to happen; it is
    a few index lookups, and SKIP LOCKED keeps concurrent runs apart.
    """
    queries = jobs.queries
    woken: set[str] = set()
    if rescue:
        woken.update(_apart(conn, "rescuing expired leases", queries.rescue))
    woken.update(_apart(conn, "promoting due jobs", queries.promote))
    periodic.enqueue_due(conn, jobs)
    paused = frozenset(conn.execute(queries.paused).scalars())
    unpaused = [q for q in queues if q not in paused]
    due_in = conn.execute(queries.next_due, {"queues": unpaused}).scalar()
    return Refresh(None if due_in is None else float(due_in), paused, frozenset(woken))


def _apart(conn: sa.Connection, what: str, statement: sa.Executable) -> list[str]:
    """The queues of the rows ``statement`` (a rescue, a promotion) moved, in a savepoint:
    a row the database refuses to move (an application's trigger, a constraint) fails
    only this part of the pass, which is said and tried again at the next one. It failed
    the whole pass, whose cron ticks, pause state and due time went with it, on every
    worker of the table, and the fetch loop claimed nothing behind it."""
    try:
        with conn.begin_nested():
            return [row.queue for row in conn.execute(statement, {"limit": BATCH})]
    except sa.exc.DBAPIError as exc:
        if not answered(exc):
            raise
        log.warning("%s failed (tried again at the next pass): %s", what, describe(exc))
        return []


def prune_work(jobs: Jobs) -> list[tuple[sa.Delete, timedelta]]:
    """What retention deletes: dead and cancelled after ``keep_dead``, done after
    ``keep_done``."""
    queries = jobs.queries
    return [
        (queries.prune_dead, jobs.keep_dead),
        (queries.prune_done, jobs.keep_done or timedelta(0)),
        # Keys of scoped unique jobs whose period has passed and whose job is not live.
        (queries.prune_unique_keys, timedelta(0)),
        # Per-key rate logs (sqla_jobs.throttle) whose newest start left the window.
        (queries.prune_key_starts, timedelta(0)),
        # Durable steps' records whose job is gone (sqla_jobs.steps).
        (jobs.step_queries.prune, timedelta(0)),
    ]


def settle_unsettled(conn: sa.Connection, jobs: Jobs) -> int:
    """Settle the children of dead or cancelled parents that were not (a parent rescued
    dead by its lease): cancelled, or released if they run anyway. Run by the pruner
    before each batch of dead rows, so that no parent is pruned unsettled. How many
    parents were settled."""
    ids = list(conn.execute(jobs.queries.unsettled_parents, {"limit": PRUNE_BATCH}).scalars())
    if ids:
        settle_children(conn, jobs.queries, [], ids)
    return len(ids)


def prune_batch(
    conn: sa.Connection, jobs: Jobs, statement: sa.Executable, age: timedelta
) -> int | None:
    """Delete one batch (in its own short transaction); None if another worker is pruning."""
    if not conn.execute(jobs.queries.try_lock).scalar():
        return None
    if statement is jobs.queries.prune_unique_keys:
        return prune_unique_keys(conn, jobs)
    if statement is jobs.queries.prune_dead:
        settle_unsettled(conn, jobs)
    return int(conn.execute(statement, {"age": age, "limit": PRUNE_BATCH}).rowcount)


def prune_unique_keys(conn: sa.Connection, jobs: Jobs) -> int:
    """Delete a batch of stale ``<table>_unique_keys`` rows, in two statements: lock the
    rows whose period has passed (SKIP LOCKED: never wait for an enqueue that holds one),
    then delete those whose job is not live. The second statement's snapshot is taken
    with the rows locked, so it sees the job of any enqueue that took one of those keys
    before: a single statement would judge a just-taken key by its old job."""
    q = jobs.queries
    keys = list(conn.execute(q.lock_stale_keys, {"limit": PRUNE_BATCH}).scalars())
    if not keys:
        return 0
    return int(conn.execute(q.prune_unique_keys, {"keys": keys}).rowcount)


def prune(engine: sa.Engine, jobs: Jobs, *, max_batches: int = 20) -> int:
    """Run retention now; how many rows were deleted. Does nothing while another worker
    holds the pruner lock. (Workers do this by themselves every ``prune_interval``.)"""
    total = 0
    for statement, age in prune_work(jobs):
        for _ in range(max_batches):
            with engine.begin() as conn:
                deleted = prune_batch(conn, jobs, statement, age)
            if deleted is None:
                return total
            total += deleted
            if deleted < PRUNE_BATCH:
                break
    return total


class HeldConnection:
    """A pooled connection that one duty keeps between statements, in autocommit.

    The claim and an outcome batch are atomic statements by themselves. Through
    ``engine.begin()`` each would cost four round trips: the pool's pre-ping
    (``create_engine`` turns ``pool_pre_ping`` on), BEGIN, the statement, COMMIT. The fetch
    loop claims hundreds of times a second, so it keeps one connection in autocommit and
    pays one round trip per claim. After any error the connection is dropped, and the next
    call takes a fresh one from the pool (whose pre-ping weeds out connections that died
    with a database restart).
    """

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self._engine.connect().execution_options(
                isolation_level="AUTOCOMMIT"
            )
        try:
            return fn(conn, *args)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

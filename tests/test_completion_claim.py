"""A completion that claims (``worker._statements.write_and_claim``): the outcome batch that
frees a limited queue's slots and the claim of the jobs that take them, in one transaction
(one pipeline where allowed). The limit counts the rows the batch has just ended, holds
exactly, and a failing claim does not hold the outcomes up."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus

from sqla_jobs._direct import pipeline_allowed
from sqla_jobs._queries import claim_params, interval, queue_claim_params
from sqla_jobs.worker import _statements as worker_db
from sqla_jobs.worker.job import Outcome, OutcomeKind, decode_rows

from . import app
from .helpers import rows, terminate_backend

jobs = app.limited_jobs


def _params(limit: int = 10) -> Any:
    return queue_claim_params(
        claim_params("limited", limit, interval(30), "claimer"), jobs.limits("limited")
    )


@pytest.fixture
def conn(db: sa.Engine) -> Iterator[sa.Connection]:
    with db.connect() as c:
        yield c.execution_options(isolation_level="AUTOCOMMIT")


@pytest.fixture(params=["pipelined", "stepwise"])
def way(request: pytest.FixtureRequest, conn: sa.Connection) -> Iterator[list[str]]:
    """Both ways of sending: one pipeline, or (a listener on the connection) one statement
    at a time through SQLAlchemy; the statements the listener saw."""
    seen: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    if request.param == "stepwise":
        sa.event.listen(conn, "before_cursor_execute", listen)
    assert pipeline_allowed(conn) is (request.param == "pipelined")
    yield seen
    if request.param == "stepwise":
        sa.event.remove(conn, "before_cursor_execute", listen)


def _running(db: sa.Engine, conn: sa.Connection, n: int) -> list[Any]:
    """``n`` ready jobs of the queue limited to three, and the three it lets one claim run,
    as the worker holds them."""
    with db.begin() as c:
        jobs.enqueue_many(c, app.limited_work, [{"seconds": 0}] * n)
    found = worker_db.claim_limited(conn, jobs.queries, _params())
    assert len(found.rows) == 3 and found.held
    claimed, unreadable = decode_rows(found.rows, "claimer")
    assert not unreadable
    return claimed


def _statuses(db: sa.Engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows(db):
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def test_the_slots_a_batch_frees_are_claimed_in_its_transaction(
    db: sa.Engine, conn: sa.Connection, way: list[str]
) -> None:
    """Two of three running jobs succeed: the write ends them and claims two more, no
    more (the limit of three counts the rows just ended, not the ones still running), and
    tells that the limit held the rest back; its tally is the write's, as the completer
    reports it."""
    claimed = _running(db, conn, 8)
    batch = [Outcome(OutcomeKind.SUCCEEDED, job) for job in claimed[:2]]
    way.clear()
    written = worker_db.write_and_claim(conn, jobs.queries, batch, _params())
    assert written.tally == {"limited": [2, 0, 0]}
    assert written.claim is not None and written.claim_error is written.rest_error is None
    assert len(written.claim.rows) == 2 and written.claim.held
    ended = {job.id for job in claimed[:2]}
    assert not ended & {r[0] for r in written.claim.rows}
    assert all(r.status != "running" for r in rows(db) if r.id in ended)
    assert _statuses(db).get("running") == 3 and _statuses(db).get("ready") == 3
    if way:  # stepwise: the batch's statements, then the lock and the claim
        # (On a new connection, a SHOW first: whether its lone statements run at READ
        # COMMITTED, asked once per connection.)
        sent = [s for s in way if not s.startswith("SHOW ")]
        lock = next(i for i, s in enumerate(sent) if "pg_advisory_xact_lock" in s)
        assert lock > 0 and "has_children" in sent[0]  # the worker's completion, first
    driver: Any = conn.connection.driver_connection
    assert driver.info.transaction_status == TransactionStatus.IDLE


def test_a_batch_of_failures_and_successes_frees_what_it_ends(
    db: sa.Engine, conn: sa.Connection, way: list[str]
) -> None:
    """A failure with a retry leaves its job waiting (scheduled), not running: its slot is
    freed as a success's is, and the claim fills both."""
    claimed = _running(db, conn, 6)
    batch = [
        Outcome(OutcomeKind.SUCCEEDED, claimed[0]),
        Outcome(OutcomeKind.FAILED, claimed[1], error="boom", delay=60.0),
    ]
    written = worker_db.write_and_claim(conn, jobs.queries, batch, _params())
    assert written.tally == {"limited": [1, 1, 0]}
    assert written.claim is not None and len(written.claim.rows) == 2
    assert _statuses(db).get("running") == 3


def test_a_claim_that_fails_leaves_the_batch_written(
    db: sa.Engine, conn: sa.Connection, way: list[str]
) -> None:
    """The claim fails (here: the statement it is sent with is cancelled by a
    ``statement_timeout`` while it waits for the queue's lock): the outcomes are written
    all the same (the pipeline's transaction rolled back, the batch then written alone),
    the claim's error is handed back, nothing more is claimed, and the connection is idle
    for the next write."""
    claimed = _running(db, conn, 5)
    conn.exec_driver_sql("SET statement_timeout = '50ms'")
    with db.connect() as holder:
        holder.begin()
        holder.execute(jobs.queries.limit_lock, {"queue_name": "limited"})
        batch = [Outcome(OutcomeKind.SUCCEEDED, claimed[0])]
        written = worker_db.write_and_claim(conn, jobs.queries, batch, _params())
        holder.rollback()
    conn.exec_driver_sql("SET statement_timeout = 0")
    assert written.claim is None and written.tally == {"limited": [1, 0, 0]}
    assert isinstance(written.claim_error, sa.exc.OperationalError)
    assert "statement timeout" in str(written.claim_error)
    assert _statuses(db).get("running") == 2 and _statuses(db).get("ready") == 2
    driver: Any = conn.connection.driver_connection
    assert driver.info.transaction_status == TransactionStatus.IDLE and not conn.invalidated


def test_a_claim_whose_queue_is_locked_elsewhere_finds_it_busy(
    db: sa.Engine, conn: sa.Connection, way: list[str]
) -> None:
    """The queue's lock is held by another transaction (an application's open
    ``session.claim``) past the claim's own ``lock_timeout``: the outcomes are written,
    nothing is claimed, and the queue is reported busy (left for a while), not as
    an error."""
    claimed = _running(db, conn, 5)
    with db.connect() as holder:
        holder.begin()
        holder.execute(jobs.queries.limit_lock, {"queue_name": "limited"})
        batch = [Outcome(OutcomeKind.SUCCEEDED, claimed[0])]
        written = worker_db.write_and_claim(conn, jobs.queries, batch, _params())
        holder.rollback()
    assert written.tally == {"limited": [1, 0, 0]} and written.claim_error is None
    assert written.claim is not None and written.claim.busy and written.claim.rows == []
    assert _statuses(db).get("running") == 2


def test_without_a_claim_it_is_the_plain_write(db: sa.Engine, conn: sa.Connection) -> None:
    claimed = _running(db, conn, 4)
    written = worker_db.write_and_claim(
        conn, jobs.queries, [Outcome(OutcomeKind.SUCCEEDED, claimed[0])], None
    )
    assert written == worker_db.Written({"limited": [1, 0, 0]})
    assert _statuses(db).get("running") == 2 and _statuses(db).get("ready") == 1


def test_a_worker_claims_a_held_queue_with_the_completions_that_free_it(
    db: sa.Engine, make_worker: Any
) -> None:
    """A worker draining a queue limited to three: its first claim finds the limit full
    (the queue is held), and from then on the completions that free its slots claim the
    next jobs on the completer's own connection, after the outcomes and before the lock,
    as the pipeline sends them. (Seen through a listener, so sent one statement at a time:
    the pipelined statements are those of the tests above.)"""
    with db.begin() as c:
        jobs.enqueue_many(c, app.limited_work, [{"seconds": 0}] * 20)
    seen: list[tuple[int, str]] = []

    def listen(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "has_children" in statement:
            seen.append((id(conn.connection.dbapi_connection), "completion"))
        elif "pg_advisory_xact_lock" in statement:
            seen.append((id(conn.connection.dbapi_connection), "lock"))

    sa.event.listen(sa.Engine, "before_cursor_execute", listen)
    try:
        worker: Any = make_worker(jobs, db, queues=["limited"])
        assert worker.run_until_empty() == 20
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", listen)
    writers = {c for c, kind in seen if kind == "completion"}
    rides = [
        i
        for i, (c, kind) in enumerate(seen)
        if kind == "lock" and c in writers and i and seen[i - 1] == (c, "completion")
    ]
    assert rides, seen
    assert _statuses(db) == {}  # every job ran and was deleted


def test_a_write_whose_connection_the_server_ended_writes_and_claims_nothing(
    db: sa.Engine, conn: sa.Connection
) -> None:
    """The backend is gone when the batch and its claim are sent: the error is a lost
    connection (the completer writes the batch again on a new one), the job is still
    running, nothing was claimed, and the batch written again frees and claims."""
    claimed = _running(db, conn, 5)
    pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    terminate_backend(db, pid)
    batch = [Outcome(OutcomeKind.SUCCEEDED, claimed[0])]
    with pytest.raises(sa.exc.DBAPIError) as raised:
        worker_db.write_and_claim(conn, jobs.queries, batch, _params())
    assert raised.value.connection_invalidated
    assert _statuses(db) == {"running": 3, "ready": 2}
    with db.connect() as c:
        fresh = c.execution_options(isolation_level="AUTOCOMMIT")
        written = worker_db.write_and_claim(fresh, jobs.queries, batch, _params())
    assert written.tally == {"limited": [1, 0, 0]} and written.claim is not None
    assert len(written.claim.rows) == 1 and _statuses(db) == {"running": 3, "ready": 1}

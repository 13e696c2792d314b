"""The limited claim in one psycopg pipeline (``sqla_jobs._direct``): when it is sent that
way, that a failure inside it leaves the connection as a failed claim through SQLAlchemy
would (rolled back, or invalidated when the server ended it), and that both ways of
sending it find the same."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import AsyncConnection

from sqla_jobs import Jobs, create_async_engine, create_engine
from sqla_jobs._direct import pipeline_allowed
from sqla_jobs._queries import claim_params, fair_claim_params, interval, queue_claim_params
from sqla_jobs.worker import _statements as worker_db

from . import app
from .helpers import count, rows, terminate_backend

jobs = app.limited_jobs


def _params(queue: str, limit: int = 10) -> Any:
    return queue_claim_params(
        claim_params(queue, limit, interval(30), "claimer"), jobs.limits(queue)
    )


@pytest.fixture
def conn(db: sa.Engine) -> Iterator[sa.Connection]:
    with db.connect() as c:
        yield c.execution_options(isolation_level="AUTOCOMMIT")


def test_the_pipeline_is_taken_only_when_nothing_watches_the_statements(
    db: sa.Engine, database_url: str
) -> None:
    """Tracing instrumentation, ``echo`` and tests listen for statements: with any of them,
    and with a ``schema_translate_map`` the direct SQL could not honour, the claim goes
    through SQLAlchemy, one statement at a time."""
    with db.connect() as c:
        assert pipeline_allowed(c)
        assert not pipeline_allowed(c.execution_options(schema_translate_map={None: "x"}))
    watched = create_engine(database_url)
    try:

        def seen(*_: Any) -> None: ...

        with watched.connect() as c:
            assert pipeline_allowed(c)
            sa.event.listen(c, "after_cursor_execute", seen)
            assert not pipeline_allowed(c)
        sa.event.listen(watched, "before_cursor_execute", seen)
        with watched.connect() as c:
            assert not pipeline_allowed(c)
    finally:
        watched.dispose()
    echoed = create_engine(database_url, echo=True)
    try:
        with echoed.connect() as c:
            assert not pipeline_allowed(c)
    finally:
        echoed.dispose()


def test_both_ways_of_sending_the_claim_find_the_same(db: sa.Engine, conn: sa.Connection) -> None:
    """Pipelined, then through SQLAlchemy (a listener on the connection): a rate of 20 a
    minute lets 20 of 25 jobs start, both ways tell the same window, and the statements
    of the second way are the lock and the shaped claim, as a listener sees them. (A
    minute's window: however slow the machine, both claims fall in it.)"""
    minute = Jobs(app.Job)
    minute.queue("per_minute", rate="20/minute")

    @minute.task(queue="per_minute")
    def paced() -> None: ...

    def claim() -> Any:
        params = queue_claim_params(
            claim_params("per_minute", 15, interval(30), "claimer"), minute.limits("per_minute")
        )
        return worker_db.claim_limited(conn, minute.queries, params)

    with db.begin() as c:
        minute.enqueue_many(c, paced, [{}] * 25)
    assert pipeline_allowed(conn)
    first = claim()
    assert len(first.rows) == 15 and not first.held and first.rate_free_in is None
    seen: list[str] = []

    def listen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    sa.event.listen(conn, "before_cursor_execute", listen)
    try:
        assert not pipeline_allowed(conn)
        second = claim()
    finally:
        sa.event.remove(conn, "before_cursor_execute", listen)
    assert len(second.rows) == 5 and second.held
    assert second.rate_free_in is not None and 0 < second.rate_free_in <= 60
    assert any("pg_advisory_xact_lock" in s for s in seen) and any("rate_log" in s for s in seen)
    # Both ways' rows are the claimed columns, in order: the worker reads them alike.
    assert [len(r) for r in first.rows + second.rows] == [len(first.rows[0])] * 20
    assert count(db, status="running") == 20 and count(db, status="ready") == 5


def test_a_pipelined_claim_that_fails_is_rolled_back_and_the_connection_claims_again(
    db: sa.Engine, conn: sa.Connection
) -> None:
    """The claim waits for the queue's lock, held by another transaction, past its own
    ``lock_timeout`` (the worker's, set in the claim's transaction): the transaction begun
    in the pipeline is rolled back (not left open, holding or waiting), nothing was
    claimed, the queue is reported busy, and the next claim on the same connection, once
    the lock is free, claims."""
    with db.begin() as c:
        jobs.enqueue(c, app.limited_work, seconds=0)
    assert pipeline_allowed(conn)
    with db.connect() as holder:
        holder.begin()
        holder.execute(jobs.queries.limit_lock, {"queue_name": "limited"})
        busy = worker_db.claim_limited(conn, jobs.queries, _params("limited"))
        assert busy.busy and busy.rows == []
        driver: Any = conn.connection.driver_connection
        assert driver.info.transaction_status == TransactionStatus.IDLE
        assert not conn.invalidated
        assert [r.status for r in rows(db)] == ["ready"]
        holder.rollback()
    found = worker_db.claim_limited(conn, jobs.queries, _params("limited"))
    assert len(found.rows) == 1 and [r.status for r in rows(db)] == ["running"]


@pytest.mark.parametrize("claims_before", [4, 5, 6])
def test_a_busy_claim_at_the_prepare_threshold_leaves_the_connection_able_to_claim(
    db: sa.Engine, database_url: str, claims_before: int
) -> None:
    """psycopg prepares a statement at its sixth run (``prepare_threshold``, 5). When the
    pipeline's lock statement fails on that very run (the queue busy, a cancel, a
    statement timeout), the server skips the claim's Parse while psycopg counts the claim
    as prepared: every later claim on the connection failed (``prepared statement
    "_pg3_N" does not exist``), and the worker took it for a pooler in transaction mode.
    (Found by an audit's storm of ``pg_cancel_backend``.)"""
    with db.begin() as c:
        for _ in range(5):
            jobs.enqueue(c, app.limited_work, seconds=0)
    # A server connection of its own, whose statements psycopg counts from zero.
    engine = create_engine(database_url)
    try:
        with engine.connect() as raw:
            conn = raw.execution_options(isolation_level="AUTOCOMMIT")
            for _ in range(claims_before):
                worker_db.claim_limited(conn, jobs.queries, _params("limited", limit=0))
            with db.connect() as holder:
                holder.begin()
                holder.execute(jobs.queries.limit_lock, {"queue_name": "limited"})
                busy = worker_db.claim_limited(conn, jobs.queries, _params("limited"))
                assert busy.busy and busy.rows == []
                holder.rollback()
            found = worker_db.claim_limited(conn, jobs.queries, _params("limited"))
            assert len(found.rows) == 3  # the queue's limit
    finally:
        engine.dispose()


def test_a_pipelined_claim_whose_connection_the_server_ends_invalidates_it(
    db: sa.Engine, conn: sa.Connection
) -> None:
    """A claim on a connection the server has ended raises SQLAlchemy's error flagged as a
    lost connection, and the connection is invalidated (the worker's held connection and
    the pool let it go); after the rollback SQLAlchemy asks for, it reconnects and claims."""
    with db.begin() as c:
        jobs.enqueue(c, app.limited_work, seconds=0)
    pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    terminate_backend(db, pid)
    with pytest.raises(sa.exc.DBAPIError) as raised:
        worker_db.claim_limited(conn, jobs.queries, _params("limited"))
    assert raised.value.connection_invalidated and conn.invalidated
    assert [r.status for r in rows(db)] == ["ready"]
    conn.rollback()
    found = worker_db.claim_limited(conn, jobs.queries, _params("limited"))
    assert len(found.rows) == 1


def test_the_pipelined_claim_on_an_asyncio_connection_holds_the_limit(
    db: sa.Engine, database_url: str
) -> None:
    """The asyncio worker's way (``run_sync`` over psycopg's ``AsyncConnection``): eight
    claimers at once, on their own connections, claim three jobs in all from a queue
    limited to three, and a failed claim there is rolled back like a sync one."""
    with db.begin() as c:
        jobs.enqueue_many(c, app.limited_work, [{"seconds": 0}] * 10)

    async def main() -> list[Any]:
        engine = create_async_engine(database_url)
        try:

            async def claim() -> Any:
                async with engine.connect() as c:
                    ac = await c.execution_options(isolation_level="AUTOCOMMIT")
                    assert await ac.run_sync(pipeline_allowed)
                    return await ac.run_sync(
                        worker_db.claim_limited, jobs.queries, _params("limited")
                    )

            found = await asyncio.gather(*(claim() for _ in range(8)))
            async with engine.connect() as c:
                ac = await c.execution_options(isolation_level="AUTOCOMMIT")
                held = threading.Event()
                release = threading.Event()

                def hold() -> None:
                    with db.connect() as holder, holder.begin():
                        holder.execute(jobs.queries.limit_lock, {"queue_name": "limited"})
                        held.set()
                        release.wait(30)

                thread = threading.Thread(target=hold)
                thread.start()
                try:
                    assert await asyncio.to_thread(held.wait, 30)
                    busy = await ac.run_sync(
                        worker_db.claim_limited, jobs.queries, _params("limited")
                    )
                    assert busy.busy and busy.rows == []
                    raw = await ac.get_raw_connection()
                    driver: Any = raw.driver_connection
                    assert driver.info.transaction_status == TransactionStatus.IDLE
                finally:
                    release.set()
                    await asyncio.to_thread(thread.join, 30)
            return found
        finally:
            await engine.dispose()

    found = asyncio.run(main())
    assert sum(len(f.rows) for f in found) == 3
    assert count(db, status="running") == 3 and count(db, status="ready") == 7


def _claim_while_another_marks_three_running(db: sa.Engine, claimer: sa.Connection) -> Any:
    """A limited claim of the queue "limited" on ``claimer``, sent while another claimer
    holds the queue's lock; once the claim waits for it, that one marks three jobs running
    (the queue's limit) and commits. What the claim found.

    The claim waits for the lock 100 ms at most (``CLAIM_LOCK_TIMEOUT``): on a loaded
    machine the look at ``pg_stat_activity`` missed that window, or the other claimer's
    commit came after it, and the claim was busy rather than waiting. Such a try is undone
    and made again: what is tested is a claim that did wait."""
    t = app.Job.__table__
    waiting = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND wait_event = 'advisory' AND datname = current_database()"
    )
    for _ in range(20):
        found: list[Any] = []
        with db.connect() as holder:
            holder.begin()
            holder.execute(jobs.queries.limit_lock, {"queue_name": "limited"})
            thread = threading.Thread(
                target=lambda found=found: found.append(
                    worker_db.claim_limited(claimer, jobs.queries, _params("limited"))
                )
            )
            thread.start()
            seen = False
            with db.connect() as look:
                deadline = time.monotonic() + 5
                while thread.is_alive() and time.monotonic() < deadline:
                    if look.execute(waiting).scalar_one() == 1:
                        seen = True
                        break
                    look.rollback()  # pg_stat_activity is read once per transaction
                    time.sleep(0.005)
            if seen:
                three = sa.select(t.c.id).where(t.c.status == "ready").limit(3)
                marked = holder.execute(
                    sa.update(t)
                    .where(t.c.id.in_(three.scalar_subquery()))
                    .values(status="running", locked_by="other", locked_until=sa.func.now())
                    .returning(t.c.id)
                ).scalars()
                ids = list(marked)
                holder.commit()
            else:
                holder.rollback()
            thread.join(30)
        [claim] = found
        if seen and not claim.busy:
            return claim
        if seen:  # committed after the claim gave up: undone, and tried again
            with db.begin() as conn:
                conn.execute(
                    sa.update(t).where(t.c.id.in_(ids)).values(status="ready", locked_by=None)
                )
    raise AssertionError("the claim never waited for the lock in 20 tries")


@pytest.mark.parametrize("default", ["read committed", "repeatable read", "serializable"])
def test_a_limited_claim_counts_what_committed_while_it_waited_for_the_lock(
    db: sa.Engine, database_url: str, default: str
) -> None:
    """Another claimer holds the queue's lock and marks three jobs running (the queue's
    limit) when the claim is already waiting for the lock; once it commits, the claim
    counts those three and takes nothing, whatever the server's default isolation. The
    pipelined claim is the server's implicit transaction only under READ COMMITTED; under
    REPEATABLE READ that transaction's snapshot would be the lock statement's, taken before
    the wait, and the claim would take three more."""
    with db.begin() as c:
        jobs.enqueue_many(c, app.limited_work, [{"seconds": 0}] * 6)
    option = "-c default_transaction_isolation=" + default.replace(" ", "\\ ")
    engine = create_engine(database_url, connect_args={"options": option})
    try:
        with engine.connect() as c:
            claimer = c.execution_options(isolation_level="AUTOCOMMIT")
            assert claimer.exec_driver_sql("SHOW default_transaction_isolation").scalar() == default
            assert pipeline_allowed(claimer)
            claim = _claim_while_another_marks_three_running(db, claimer)
    finally:
        engine.dispose()
    assert claim.rows == [] and claim.held
    assert count(db, status="running") == 3 and count(db, status="ready") == 3


@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
def test_a_limited_claim_checks_the_isolation_it_assumed(
    db: sa.Engine, database_url: str, level: str
) -> None:
    """The worker asks the server's default isolation once per connection, but a reload
    of the server's configuration changes it under live connections. Here the default
    changes after the connection's first claim (a session-level SET, which only this
    connection sees): the next claim, sent without BEGIN on the answer it kept, must still
    count the three jobs another claimer marked running while it waited for the lock, and
    take nothing; the one after it asks again."""
    with db.begin() as c:
        jobs.enqueue_many(c, app.limited_work, [{"seconds": 0}] * 6)
    engine = create_engine(database_url)
    try:
        with engine.connect() as c:
            claimer = c.execution_options(isolation_level="AUTOCOMMIT")
            assert pipeline_allowed(claimer)
            # The first claim (of an empty limited queue) keeps "read committed".
            assert worker_db.claim_limited(claimer, jobs.queries, _params("rated")).rows == []
            assert claimer.connection.info[worker_db._READ_COMMITTED] is True
            claimer.exec_driver_sql(f"SET default_transaction_isolation = '{level}'")
            claim = _claim_while_another_marks_three_running(db, claimer)
            assert claim.rows == [] and claim.held
            assert count(db, status="running") == 3 and count(db, status="ready") == 3
            # Asked again: the claims of this connection now begin their own transaction.
            assert worker_db.claim_limited(claimer, jobs.queries, _params("limited")).rows == []
            assert claimer.connection.info[worker_db._READ_COMMITTED] is False
    finally:
        engine.dispose()


@pytest.mark.parametrize("watched", [False, True], ids=["pipelined", "through SQLAlchemy"])
def test_every_limited_claim_runs_on_the_generic_plan(
    db: sa.Engine, conn: sa.Connection, watched: bool
) -> None:
    """Once psycopg has prepared them, the claims of a keyed queue and of a queue without
    keys run on PostgreSQL's generic plan from their first prepared run, never on custom
    plans. Left alone, PostgreSQL plans each five times for its parameters, then keeps
    whichever its estimates favour at that moment. The same on both ways of sending the
    claim."""
    with db.begin() as c:
        jobs.enqueue_many(
            c, app.keyed_work, [{"account": f"a{i}", "seconds": 0} for i in range(40)]
        )
        jobs.enqueue_many(c, app.limited_work, [{"seconds": 0}] * 40)

    def noop(*_: Any) -> None: ...

    if watched:
        sa.event.listen(conn, "before_cursor_execute", noop)
    try:
        for _ in range(12):
            worker_db.claim_limited(conn, jobs.queries, _params("keyed", 1))
            # Held by its limit of three after three claims: the statement runs all the same.
            worker_db.claim_limited(conn, jobs.queries, _params("limited", 1))
    finally:
        if watched:
            sa.event.remove(conn, "before_cursor_execute", noop)
    plans = conn.exec_driver_sql(
        "SELECT statement LIKE '%%busy_keys%%', generic_plans, custom_plans"
        " FROM pg_prepared_statements WHERE statement LIKE '%%claimed AS%%'"
    ).all()
    keyed = [(g, c) for is_keyed, g, c in plans if is_keyed]
    unkeyed = [(g, c) for is_keyed, g, c in plans if not is_keyed]
    assert len(keyed) == 1 and len(unkeyed) == 1, plans
    assert keyed[0][0] > 0 and keyed[0][1] == 0, plans
    assert unkeyed[0][0] > 0 and unkeyed[0][1] == 0, plans


def test_the_fair_claim_runs_on_the_generic_plan_in_a_transaction_of_its_own(
    db: sa.Engine, conn: sa.Connection
) -> None:
    """Pipelined, the fair claim runs on PostgreSQL's generic plan from its first prepared
    run, in a transaction of its own that leaves the connection idle; it shares the jobs
    between the keys as before (one of each of four tenants in a claim of four)."""
    with db.begin() as c:
        jobs.enqueue_many(
            c, app.shared_work, [{"tenant": f"t{i % 4}", "seconds": 0} for i in range(80)]
        )
    assert pipeline_allowed(conn)
    after: str | None = None
    for _ in range(12):
        params = fair_claim_params(
            claim_params("shared", 4, interval(30), "claimer"), jobs.limits("shared"), after
        )
        claimed, after, _ = worker_db.claim_fair(conn, jobs.queries, params)
        assert len(claimed) == 4
        driver: Any = conn.connection.driver_connection
        assert driver.info.transaction_status == TransactionStatus.IDLE
    plans = conn.exec_driver_sql(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
        " WHERE statement LIKE '%%fair_pick%%'"
    ).all()
    assert len(plans) == 1 and plans[0][0] > 0 and plans[0][1] == 0, plans
    with db.connect() as c:
        t = app.Job.__table__
        per_tenant = c.execute(
            sa.select(t.c.concurrency_key, sa.func.count())
            .where(t.c.status == "running")
            .group_by(t.c.concurrency_key)
        ).all()
    assert sorted(per_tenant) == [(f"t{i}", 12) for i in range(4)]


# -- the asyncio worker's plain claim, awaited on psycopg itself -------------------------


def test_the_asyncio_plain_claim_goes_straight_to_psycopg_and_fails_as_sqlalchemy_does(
    db: sa.Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_HeldConnection.claim`` (the asyncio worker's plain claim) awaits psycopg itself
    when nothing watches the statements, and takes the jobs the sync claim would; a
    connection the server ended raises SQLAlchemy's error, invalidated, the held
    connection is let go, and the next claim connects again. Watched, the claim goes
    through ``run_sync``, and the listener sees it."""
    from sqla_jobs.worker.aio import _HeldConnection

    with db.begin() as c:
        app.jobs.enqueue_many(c, app.record_run, [{"n": n} for n in range(6)])
    params = claim_params("records", 2, interval(30), "claimer")

    async def main() -> None:
        engine = create_async_engine(database_url)
        held = _HeldConnection(engine)
        greenlets: list[str] = []
        run_sync = AsyncConnection.run_sync

        async def recorded(self: Any, fn: Any, *args: Any, **kw: Any) -> Any:
            greenlets.append(getattr(fn, "__name__", ""))
            return await run_sync(self, fn, *args, **kw)

        monkeypatch.setattr(AsyncConnection, "run_sync", recorded)
        try:
            first = await held.claim(app.jobs.queries, params)
            assert [r[0] for r in first] == [1, 2]  # oldest first, as the sync claim
            assert "claim" not in greenlets  # awaited on psycopg, not through run_sync
            conn = held._conn
            assert conn is not None
            pid = (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar()
            await asyncio.to_thread(terminate_backend, db, pid)
            with pytest.raises(sa.exc.DBAPIError) as raised:
                await held.claim(app.jobs.queries, params)
            assert raised.value.connection_invalidated
            assert held._conn is None  # let go: the next claim connects anew
            assert [r[0] for r in await held.claim(app.jobs.queries, params)] == [3, 4]

            seen: list[str] = []

            def statement(conn: Any, cursor: Any, sql: str, *rest: Any) -> None:
                seen.append(sql)

            sa.event.listen(engine.sync_engine, "before_cursor_execute", statement)
            assert [r[0] for r in await held.claim(app.jobs.queries, params)] == [5, 6]
            assert any("next_jobs" in s for s in seen) and "claim" in greenlets
        finally:
            await held.close()
            await engine.dispose()

    asyncio.run(main())
    assert count(db, status="running") == 6

"""A worker's heartbeat and its completions lock rows of the same running set, on two
connections: they must not deadlock.

The completions lock rows in one order (id order). The heartbeat waits for no row: one
another transaction holds is skipped (and kept as held), so a third connection holding
the lowest row stalls neither the heartbeat nor the worker's other leases, and the
completion, queued behind that row, goes on when it is let go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs._queries import batch_params, claim_params, heartbeat_params

from . import app
from .helpers import rows, wait_for


class Claim(NamedTuple):
    id: int
    attempts: int


def test_batches_are_in_id_order_with_their_lists_alongside() -> None:
    claims = [Claim(5, 1), Claim(2, 3), Claim(9, 2)]
    assert batch_params(claims) == {"ids": [2, 5, 9], "attempt_list": [3, 1, 2]}
    beat = heartbeat_params(claims, timedelta(seconds=30), ["five", None, "nine"])
    assert beat["ids"] == [2, 5, 9]
    assert beat["attempt_list"] == [3, 1, 2]
    assert beat["progress_list"] == [None, "five", "nine"]


def _waiting_on_a_lock(db: sa.Engine, pid: int) -> Callable[[], bool]:
    def check() -> bool:
        with db.connect() as conn:
            event = conn.execute(
                sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).scalar()
            return bool(event == "Lock")

    return check


def test_a_heartbeat_skips_a_held_row_and_a_completion_waits_for_it(
    db: sa.Engine, jobs: Jobs, Session: Any
) -> None:
    @jobs.task
    def work(i: int) -> None:
        pass

    t = app.Job.__table__
    with Session.begin() as session:
        session.enqueue_many(work, [{"i": i} for i in range(6)])
    with db.begin() as conn:
        conn.execute(
            sa.update(t).values(
                status="running", attempts=1, locked_until=sa.func.now() + timedelta(seconds=5)
            )
        )
    ids = sorted(r.id for r in rows(db))
    claims = [Claim(i, 1) for i in ids]
    q = jobs.queries
    errors: list[BaseException] = []

    def in_thread(target: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    with db.connect() as holder, db.connect() as beating, db.connect() as completing:
        pid = completing.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        for c in (beating, completing):
            # The plan a big table gets: a nested loop over the batch, one index lookup
            # per id, locking rows in the batch's order (six rows alone would be scanned,
            # and locked in the table's order, whatever the batch's).
            for setting in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin"):
                c.execute(sa.text(f"SET {setting} = off"))
            c.commit()  # end the transaction the SELECT and SETs began
        holder.begin()
        holder.execute(sa.select(t.c.id).where(t.c.id == ids[0]).with_for_update())

        # Not waiting for the held row: all six still held, five renewed.
        with beating.begin():
            params = heartbeat_params(claims, timedelta(hours=1))
            beat_rows = beating.execute(q.heartbeat, dict(params)).all()
        assert sorted(r.id for r in beat_rows) == ids
        renewed = {r.id for r in rows(db) if r.locked_until > sa_now(db) + timedelta(minutes=30)}
        assert renewed == set(ids[1:])

        def complete() -> None:
            with completing.begin():
                completing.execute(q.complete, dict(batch_params(reversed(claims))))

        waiting = in_thread(complete)
        wait_for(_waiting_on_a_lock(db, pid))
        holder.rollback()
        waiting.join(10)
    assert not errors, errors
    assert rows(db) == []


def sa_now(db: sa.Engine) -> Any:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.now())).scalar_one()


def test_a_lease_runs_from_when_its_statement_got_the_row_not_from_when_it_began(
    db: sa.Engine, jobs: Jobs, Session: Any
) -> None:
    """A claim and a heartbeat that waited for a lock on the jobs table (a migration's)
    set leases from the clock when they write, not from their transaction's start: with
    ``now()``, a beat that waited past a lease renewed the lease into the past, and the
    rescue behind the same lock took the running job and ran it again (found by an audit
    running migrations under live workers)."""
    from sqla_jobs.worker import _statements as statements
    from sqla_jobs.worker.job import decode_rows

    @jobs.task(queue="q")
    def work() -> None:
        pass

    with Session.begin() as session:
        session.enqueue(work)
    lease = timedelta(seconds=1)
    t = app.Job.__table__
    left: list[Any] = []

    def lease_left() -> Any:
        with db.connect() as conn:
            return conn.execute(
                sa.select(t.c.locked_until - sa.func.clock_timestamp())
            ).scalar_one()

    def locked_while(action: Callable[[], None]) -> None:
        with db.connect() as migration:
            migration.begin()
            migration.execute(sa.text(f'LOCK TABLE "{app.SCHEMA}".jobs IN ACCESS EXCLUSIVE MODE'))
            thread = threading.Thread(target=action)
            thread.start()
            thread.join(1.5)  # it waits for the lock, longer than its lease
            migration.rollback()
        thread.join(10)
        left.append(lease_left())

    claimed: list[Any] = []

    def claim() -> None:
        with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            params = claim_params("q", 10, lease, "w")
            claimed.extend(statements.claim(conn, jobs.queries, params))

    locked_while(claim)
    [job], failures = decode_rows(claimed, "w")
    assert failures == []

    def beat() -> None:
        with db.begin() as conn:
            assert statements.beat(conn, jobs.queries, [job], lease) == {(job.id, 1)}

    locked_while(beat)
    assert all(timedelta(seconds=0.5) < each <= lease for each in left), left

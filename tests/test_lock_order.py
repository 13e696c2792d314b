"""A worker's heartbeat and its completions lock rows of the same running set, on two
connections: they must lock them in one order (id order), or they can deadlock.

The deadlock needs a particular interleaving, which the test builds with a third
connection holding the lowest row: the heartbeat queues for it first, then the
completion, given its claims in the opposite order, starts. When the third lets go, the
heartbeat gets the row and goes on to the next; had the completion locked that next one
before queueing (the unsorted order), each would wait for the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs._queries import batch_params, heartbeat_params

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


def test_a_heartbeat_and_a_completion_of_the_same_jobs_do_not_deadlock(
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
                status="running", attempts=1, locked_until=sa.func.now() + timedelta(hours=1)
            )
        )
    ids = sorted(r.id for r in rows(db))
    claims = [Claim(i, 1) for i in ids]
    q = jobs.queries
    errors: list[BaseException] = []
    beat_rows: list[Any] = []

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
        pids = [
            c.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            for c in (beating, completing)
        ]
        for c in (beating, completing):
            # The plan a big table gets: a nested loop over the batch, one index lookup
            # per id, locking rows in the batch's order (six rows alone would be scanned,
            # and locked in the table's order, whatever the batch's).
            for setting in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin"):
                c.execute(sa.text(f"SET {setting} = off"))
            c.commit()  # end the transaction the SELECT and SETs began
        holder.begin()
        holder.execute(sa.select(t.c.id).where(t.c.id == ids[0]).with_for_update())

        def beat() -> None:
            with beating.begin():
                params = heartbeat_params(claims, timedelta(seconds=30))
                beat_rows.extend(beating.execute(q.heartbeat, dict(params)).all())

        def complete() -> None:
            with completing.begin():
                completing.execute(q.complete, dict(batch_params(reversed(claims))))

        first = in_thread(beat)
        wait_for(_waiting_on_a_lock(db, pids[0]))
        second = in_thread(complete)
        wait_for(_waiting_on_a_lock(db, pids[1]))
        holder.rollback()
        first.join(10)
        second.join(10)
    assert not errors, errors
    assert len(beat_rows) == len(ids)  # the heartbeat went first, the completion after
    assert rows(db) == []

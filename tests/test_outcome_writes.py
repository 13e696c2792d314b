"""The completer's writes against rows the database refuses: one job's outcome must never
hold up (or stop) the writing of every other outcome of its worker.

Found by an audit of concurrent completions: a handler's error message holding a NUL
failed every write of the batch it was in, retried for as long as the worker ran (the job
``running``, every later outcome waiting behind it); a lone surrogate stopped the worker
(the driver's encoder raised, which the completer took for a bug), and every worker that
ran the job again after it; an application's trigger refusing one row's completion held
up the rest of its batch the same way.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs.worker._statements import write_outcomes
from sqla_jobs.worker.job import Outcome, OutcomeKind

from .helpers import refusing, rows, wait_for


@pytest.mark.parametrize(
    ("message", "kept"), [("a NUL \x00 inside", "\\x00"), ("a lone \ud800 surrogate", "\\ud800")]
)
def test_an_error_message_postgresql_cannot_store_is_kept_escaped(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, message: str, kept: str
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def bad() -> None:
        raise ValueError(message)

    @jobs.task(queue="q")
    def good() -> None:
        pass

    with Session.begin() as session:
        failing = session.enqueue(bad)
        for _ in range(3):
            session.enqueue(good)
        session.flush()
        bad_id = failing.id
    worker = make_worker(jobs, db, queues=["q"], concurrency=4, listen=False)
    assert worker.run_until_empty(timeout=20) == 4
    [dead] = rows(db)
    assert (dead.id, dead.status) == (bad_id, "dead")
    assert message.replace("\x00", kept).replace("\ud800", kept) in dead.last_error


def test_a_row_the_database_refuses_is_left_to_its_lease_and_the_rest_is_written(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, caplog: Any
) -> None:
    go = threading.Event()
    started = threading.Semaphore(0)

    @jobs.task(queue="q")
    def work(poison: bool = False) -> None:
        started.release()
        go.wait(10)

    refuse = refusing(
        db,
        "refuse_poison",
        "BEFORE DELETE ON JOBS FOR EACH ROW",
        "IF (OLD.args->>'poison')::boolean THEN RAISE EXCEPTION 'not this one'; END IF; "
        "RETURN OLD;",
    )
    with refuse:
        with Session.begin() as session:
            poison = session.enqueue(work, poison=True)
            for _ in range(5):
                session.enqueue(work)
            session.flush()
            poison_id = poison.id
        # One batch: the six end together, and the completer waits for all of them.
        worker = make_worker(
            jobs, db, queues=["q"], concurrency=6, completion_interval=1.0, listen=False
        )
        thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
        thread.start()
        try:
            for _ in range(6):
                assert started.acquire(timeout=10)
            go.set()
            # The five others are written (done, deleted); the refused one is left running,
            # for its lease to pass (the heartbeat renews it no more).
            wait_for(lambda: [(r.id, r.status) for r in rows(db)] == [(poison_id, "running")])
            wait_for(lambda: "its outcome could not be written" in caplog.text)
            assert "not this one" in caplog.text
        finally:
            go.set()
            worker.stop()
            thread.join(30)


def test_what_committed_before_a_batchs_flow_part_failed_is_counted(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """A batch's plain completions commit on their own (autocommit); its result-keeping
    ones follow in a transaction. When that fails, the plain ones are counted with the
    error: written again, they match nothing and count nothing (they went uncounted in
    the queue's throughput)."""

    @jobs.task(queue="q")
    def plain() -> None: ...

    @jobs.task(queue="q", keep_result=True)
    def keeper() -> int:
        return 7

    with Session.begin() as session:
        session.enqueue(plain)
        session.enqueue(keeper)
    with Session(expire_on_commit=False) as session, session.begin():
        a, k = session.claim("q", limit=2)
    kept_id = k.id
    batch = [Outcome(OutcomeKind.SUCCEEDED, a), Outcome(OutcomeKind.SUCCEEDED, k, result="7")]
    refuse = refusing(
        db,
        "refuse_results",
        "BEFORE UPDATE ON JOBS FOR EACH ROW WHEN (NEW.result IS NOT NULL)",
        "RAISE EXCEPTION 'no results today';",
    )
    with refuse, db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        written = write_outcomes(conn, jobs.queries, batch)
    assert written.tally == {"q": [1, 0, 0]}
    assert "no results today" in str(written.rest_error)
    assert [(r.id, r.status) for r in rows(db)] == [(kept_id, "running")]


def test_a_batch_holding_one_job_twice_is_written(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    """An attempt whose outcome waited while its lease lapsed, and the next attempt of the
    same job, in one batch: the current one is written, the stale one matches nothing.
    (The completion's search for parents among the rows it left running found none and
    failed on it, every time the batch was written.)"""
    from sqla_jobs.worker.job import ClaimedJob

    @jobs.task(queue="q")
    def plain() -> None: ...

    with Session.begin() as session:
        session.enqueue(plain)
    with Session(expire_on_commit=False) as session, session.begin():
        [row] = session.claim("q")

    def claimed(attempts: int) -> ClaimedJob:
        return ClaimedJob(
            id=row.id,
            queue=row.queue,
            task=row.task,
            args=row.args,
            attempts=attempts,
            max_attempts=row.max_attempts,
            priority=row.priority,
            run_at=row.run_at,
            created_at=row.created_at,
        )

    stale, current = claimed(row.attempts - 1), claimed(row.attempts)
    batch = [Outcome(OutcomeKind.SUCCEEDED, stale), Outcome(OutcomeKind.SUCCEEDED, current)]
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        written = write_outcomes(conn, jobs.queries, batch)
    assert written.tally == {"q": [1, 0, 0]} and written.rest_error is None
    assert rows(db) == []

"""Retention and purges racing workflows and scoped unique keys: a child cancelled by a
parent stays skipped once that parent's row is gone, keys of live jobs do not stall the
pruning of the others, and the pruner's log says what it deleted."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, PermanentError, Worker, admin
from sqla_jobs._settle import settle_children
from sqla_jobs.worker import _statements as statements
from sqla_jobs.worker._statements import prune

from . import app
from .helpers import wait_for

T = app.Job.__table__


def _status(db: sa.Engine, job_id: int) -> str | None:
    with db.connect() as conn:
        return conn.execute(sa.select(T.c.status).where(T.c.id == job_id)).scalar()


def _retry(db: sa.Engine, jobs: Jobs, ids: list[int]) -> Any:
    with db.begin() as conn:
        return admin.retry_report(conn, jobs, ids)


def _purge(db: sa.Engine, jobs: Jobs, ids: list[int]) -> None:
    with db.begin() as conn:
        admin.purge_jobs(conn, jobs, ids)


def test_a_child_whose_lease_rescued_parent_was_pruned_is_skipped_by_its_retry(
    db: sa.Engine,
) -> None:
    """The rescue marks the parent dead; the retention pass cancels the child later; the
    parent is pruned first. The retry skips the child, naming the deleted parent."""
    jobs = Jobs(app.Job, keep_dead=timedelta(days=7))
    ran: list[int] = []

    @jobs.task(queue="p", max_attempts=1)
    def parent() -> None: ...

    @jobs.task(queue="c")
    def child() -> None:
        ran.append(1)

    with JobSession(db, jobs=jobs) as session:
        p = session.enqueue(parent)
        c = session.enqueue(child.with_options(after=[p]))
        session.commit()
        p_id, c_id = p.id, c.id
    with JobSession(db, jobs=jobs) as session:
        assert len(session.claim("p")) == 1
        session.commit()
    with db.begin() as conn:
        conn.execute(
            sa.update(T)
            .where(T.c.id == p_id)
            .values(locked_until=sa.func.now() - timedelta(seconds=5))
        )
        statements.refresh(conn, jobs, True)
    prune(db, jobs)
    assert _status(db, p_id) == "dead" and _status(db, c_id) == "cancelled"
    with db.begin() as conn:
        conn.execute(
            sa.update(T).where(T.c.id == p_id).values(finished_at=sa.func.now() - timedelta(days=8))
        )
    assert prune(db, jobs) == 1 and _status(db, p_id) is None

    report = _retry(db, jobs, [c_id])
    assert not report.acted and [i for i, _ in report.skipped] == [c_id]
    assert f"job {p_id}" in report.skipped[0][1] and "was deleted" in report.skipped[0][1]
    Worker(jobs, db, queues=["c"], listen=False).run_until_empty(timeout=10)
    assert ran == [] and _status(db, c_id) == "cancelled"


def test_a_callback_whose_dead_member_was_purged_is_skipped_by_its_retry(db: sa.Engine) -> None:
    jobs = Jobs(app.Job)
    got: list[object] = []

    @jobs.task(queue="p", max_attempts=1)
    def member(n: int) -> int:
        if n:
            raise PermanentError("no")
        return n

    @jobs.task(queue="c")
    def callback(results: list[object]) -> None:
        got.append(results)

    with JobSession(db, jobs=jobs) as session:
        members, cb = jobs.group(
            session,
            [(member, member.args(0)), (member, member.args(1))],
            then=(callback, callback.args()),
        )
        session.commit()
        dead_id, cb_id = members[1].id, cb.id
    Worker(jobs, db, queues=["p"], listen=False).run_until_empty(timeout=10)
    assert _status(db, dead_id) == "dead" and _status(db, cb_id) == "cancelled"
    _purge(db, jobs, [dead_id])
    report = _retry(db, jobs, [cb_id])
    assert [i for i, _ in report.skipped] == [cb_id], report
    Worker(jobs, db, queues=["c"], listen=False).run_until_empty(timeout=10)
    assert got == []


def test_a_child_linked_to_a_dead_parent_that_was_purged_is_skipped_by_its_retry(
    db: sa.Engine,
) -> None:
    """Enqueued after its parent died: cancelled at its enqueue, which records the parent."""
    jobs = Jobs(app.Job)

    @jobs.task(queue="p", max_attempts=1)
    def parent() -> None:
        raise PermanentError("no")

    @jobs.task(queue="c")
    def child() -> None: ...

    with db.begin() as conn:
        p_id = jobs.enqueue(conn, parent)
    Worker(jobs, db, queues=["p"], listen=False).run_until_empty(timeout=10)
    with db.begin() as conn:
        c_id = jobs.enqueue(conn, child.with_options(after=[p_id]))
    assert _status(db, c_id) == "cancelled"
    _purge(db, jobs, [p_id])
    report = _retry(db, jobs, [c_id])
    assert [i for i, _ in report.skipped] == [c_id], report
    assert _status(db, c_id) == "cancelled"


def test_a_grandchild_whose_cancelled_parent_was_purged_is_skipped_by_its_retry(
    db: sa.Engine,
) -> None:
    """A dies, B (after A) and C (after B) are cancelled down the chain; B is purged."""
    jobs = Jobs(app.Job)

    @jobs.task(queue="p", max_attempts=1)
    def a() -> None:
        raise PermanentError("no")

    @jobs.task(queue="c")
    def step() -> None: ...

    with JobSession(db, jobs=jobs) as session:
        ja = session.enqueue(a)
        jb = session.enqueue(step.with_options(after=[ja]))
        jc = session.enqueue(step.with_options(after=[jb]))
        session.commit()
        b_id, c_id = jb.id, jc.id
    Worker(jobs, db, queues=["p"], listen=False).run_until_empty(timeout=10)
    assert _status(db, c_id) == "cancelled"
    _purge(db, jobs, [b_id])
    report = _retry(db, jobs, [c_id])
    assert [i for i, _ in report.skipped] == [c_id], report
    assert f"job {b_id}" in report.skipped[0][1]


def _two_parents(db: sa.Engine, jobs: Jobs, ran: list[int]) -> tuple[Any, Any, Any]:
    @jobs.task(queue="p", max_attempts=1)
    def parent(name: str) -> None:
        if name in fail:
            raise PermanentError(name)

    @jobs.task(queue="c")
    def child() -> None:
        ran.append(1)

    fail = {"A", "B"}
    with JobSession(db, jobs=jobs) as session:
        ja = session.enqueue(parent, "A")
        jb = session.enqueue(parent.with_options(queue="p2"), "B")
        jc = session.enqueue(child.with_options(after=[ja, jb]))
        session.commit()
        return (ja.id, jb.id, jc.id), fail, parent


def test_retrying_one_dead_parent_leaves_a_child_whose_other_dead_parent_was_purged(
    db: sa.Engine,
) -> None:
    """C waits for A and B; A dies (C cancelled), then B (C already cancelled). B is purged;
    retrying A must not bring C back waiting for A alone."""
    jobs = Jobs(app.Job)
    ran: list[int] = []
    (a_id, b_id, c_id), fail, _ = _two_parents(db, jobs, ran)
    Worker(jobs, db, queues=["p"], listen=False).run_until_empty(timeout=10)
    assert _status(db, c_id) == "cancelled"
    Worker(jobs, db, queues=["p2"], listen=False).run_until_empty(timeout=10)
    assert _status(db, a_id) == _status(db, b_id) == "dead"
    _purge(db, jobs, [b_id])
    fail.clear()
    report = _retry(db, jobs, [a_id])
    assert list(report.acted) == [a_id] and not report.rearmed, report
    Worker(jobs, db, queues=["p", "p2", "c"], listen=False).run_until_empty(timeout=10)
    assert ran == [] and _status(db, c_id) == "cancelled"


def test_parents_dying_concurrently_both_hold_back_their_cancelled_child(db: sa.Engine) -> None:
    """A's settling cancels C; B's, concurrent, waits for C's row and finds it cancelled:
    it still records B on C. Then B is purged and A retried: C stays cancelled."""
    jobs = Jobs(app.Job)
    ran: list[int] = []
    (a_id, b_id, c_id), fail, _ = _two_parents(db, jobs, ran)
    q = jobs.queries

    def die(conn: sa.Connection, job_id: int) -> None:
        conn.execute(
            sa.update(T).where(T.c.id == job_id).values(status="dead", finished_at=sa.func.now())
        )
        settle_children(conn, q, [], [job_id])

    first = db.connect()
    txn = first.begin()
    die(first, a_id)  # C cancelled, its row locked until this commits
    errors: list[BaseException] = []

    def second() -> None:
        try:
            with db.begin() as conn:
                die(conn, b_id)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    with db.connect() as watch:
        wait_for(
            lambda: (
                watch.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database()"
                    )
                ).scalar()
                == 1
            )
        )
    txn.commit()
    first.close()
    thread.join(30)
    assert not errors, errors
    assert _status(db, c_id) == "cancelled"
    _purge(db, jobs, [b_id])
    fail.clear()
    _retry(db, jobs, [a_id])
    Worker(jobs, db, queues=["p", "p2", "c"], listen=False).run_until_empty(timeout=10)
    assert ran == [] and _status(db, c_id) == "cancelled"


def test_a_retried_parent_that_succeeds_and_is_deleted_does_not_hold_its_child_back(
    db: sa.Engine,
) -> None:
    """C waits for A and B, both die. A is retried (C stays cancelled: B is dead),
    succeeds and is purged. Retrying B then brings C back, and it runs."""
    jobs = Jobs(app.Job)
    ran: list[int] = []
    (a_id, b_id, c_id), fail, _ = _two_parents(db, jobs, ran)
    Worker(jobs, db, queues=["p", "p2"], listen=False).run_until_empty(timeout=10)
    fail.clear()
    _retry(db, jobs, [a_id])
    Worker(jobs, db, queues=["p", "p2"], listen=False).run_until_empty(timeout=10)
    assert _status(db, a_id) == "done" and _status(db, c_id) == "cancelled"
    _purge(db, jobs, [a_id])  # or pruned after keep_done
    report = _retry(db, jobs, [b_id])
    assert list(report.rearmed) == [c_id], report
    Worker(jobs, db, queues=["p", "p2", "c"], listen=False).run_until_empty(timeout=10)
    assert ran == [1]


def test_a_child_marked_true_before_the_ids_were_recorded_reads_as_before(db: sa.Engine) -> None:
    """Rows cancelled by an older version say ``true``: skipped while the parent is dead,
    back with it when it is retried."""
    jobs = Jobs(app.Job)
    ran: list[int] = []
    (a_id, b_id, c_id), fail, _ = _two_parents(db, jobs, ran)
    Worker(jobs, db, queues=["p", "p2"], listen=False).run_until_empty(timeout=10)
    with db.begin() as conn:
        conn.execute(
            sa.update(T)
            .where(T.c.id == c_id)
            .values(
                meta=T.c.meta.op("||")(sa.text("""'{"sqla_jobs.cancelled_by_parent": true}'"""))
            )
        )
    assert [i for i, _ in _retry(db, jobs, [c_id]).skipped] == [c_id]
    fail.clear()
    assert list(_retry(db, jobs, [a_id, b_id]).rearmed) == [c_id]
    Worker(jobs, db, queues=["p", "p2", "c"], listen=False).run_until_empty(timeout=10)
    assert ran == [1]


# -- scoped unique keys ------------------------------------------------------------------


def test_keys_of_live_jobs_do_not_stall_the_pruning_of_the_others(
    db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More live keys than a batch, first in the table: one pass still deletes the keys
    whose jobs finished behind them."""
    monkeypatch.setattr(statements, "PRUNE_BATCH", 10)
    jobs = Jobs(app.Job)

    @jobs.task(queue="s", unique_states=("scheduled", "ready"))
    def later(n: int) -> None: ...

    @jobs.task(queue="f", unique_states=("scheduled", "ready"))
    def quick(n: int) -> None: ...

    with db.begin() as conn:
        for i in range(25):
            jobs.enqueue(conn, later.with_options(delay=3600), i)
        for i in range(15):
            jobs.enqueue(conn, quick, i)
    Worker(jobs, db, queues=["f"], listen=False).run_until_empty(timeout=30)
    k = jobs.queries.unique_keys_table
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(k)).scalar() == 40
    prune(db, jobs)
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(k)).scalar() == 25


# -- the pruner's log --------------------------------------------------------------------


def test_the_pruner_log_names_what_it_deleted(db: sa.Engine, caplog: Any) -> None:
    from sqla_jobs.steps import Steps

    jobs = Jobs(app.Job)

    @jobs.task(durable=True, queue="d")
    def quick(steps: Steps) -> None:
        for i in range(5):
            steps.run(f"s{i}", lambda i=i: i)

    with db.begin() as conn:
        jobs.enqueue(conn, quick)
    Worker(jobs, db, queues=["d"], listen=False).run_until_empty(timeout=10)
    caplog.set_level(logging.INFO, logger="sqla_jobs.worker")
    Worker(jobs, db, queues=["d"], listen=False).run_until_empty(timeout=10)
    said = [r.getMessage() for r in caplog.records if "pruned" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("pruned 5 step records"), said

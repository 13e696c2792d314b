"""Retention of finished jobs, and a claim that stays on its index beside them. Time is
moved by the tests (rows' timestamps set into the past), never waited for."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from sqla_jobs import (
    Jobs,
    JobSession,
    PermanentError,
    Worker,
)
from sqla_jobs._queries import interval
from sqla_jobs.worker._statements import prune

from . import app
from .helpers import count, rows


def test_retention_keeps_then_prunes_in_one_elected_worker(db: sa.Engine) -> None:
    jobs = Jobs(app.Job, keep_done=timedelta(hours=1), keep_dead=timedelta(days=7))

    @jobs.task(queue="q", max_attempts=1)
    def task(fail: bool) -> None:
        if fail:
            raise PermanentError("no")

    with JobSession(db, jobs=jobs) as session:
        session.enqueue_many(task, [{"fail": i % 2 == 0} for i in range(6)])
        session.commit()
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert count(db, status="done") == 3 and count(db, status="dead") == 3
    assert all(r.finished_at is not None for r in rows(db))

    assert prune(db, jobs) == 0  # nothing old enough yet
    t = app.Job.__table__
    with db.begin() as conn:
        old_done = (
            conn.execute(sa.select(t.c.id).where(t.c.status == "done").limit(2)).scalars().all()
        )
        old_dead = (
            conn.execute(sa.select(t.c.id).where(t.c.status == "dead").limit(1)).scalars().all()
        )
        conn.execute(
            sa.update(t)
            .where(t.c.id.in_(old_done))
            .values(finished_at=sa.func.now() - timedelta(hours=2))
        )
        conn.execute(
            sa.update(t)
            .where(t.c.id.in_(old_dead))
            .values(finished_at=sa.func.now() - timedelta(days=8))
        )

    # While another worker holds the pruner lock, this one does nothing.
    with db.connect() as other:
        other.execute(jobs.queries.try_lock)
        assert prune(db, jobs) == 0
        other.rollback()
    assert prune(db, jobs) == 3
    assert count(db, status="done") == 1 and count(db, status="dead") == 2


def test_claim_stays_on_the_index_with_100k_scheduled_and_1k_dead(
    db: sa.Engine, jobs: Jobs
) -> None:
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {app.SCHEMA}.jobs (task, queue, status, run_at, finished_at) "
                "SELECT 't', 'q', CASE WHEN i <= 1000 THEN 'dead' WHEN i <= 2000 THEN 'ready' "
                "ELSE 'scheduled' END, now() + i * interval '1 s', now() "
                "FROM generate_series(1, 102000) AS i"
            )
        )
        conn.execute(
            sa.text(
                f"UPDATE {app.SCHEMA}.jobs SET run_at = now() - interval '1 s' "
                "WHERE status = 'ready'"
            )
        )
        conn.execute(sa.text(f"ANALYZE {app.SCHEMA}.jobs"))
    compiled = jobs.queries.claim.compile(dialect=db.dialect)
    params = compiled.construct_params(
        {"queue_name": "q", "limit": 10, "lease": interval(30), "worker": "w"}
    )
    with db.connect() as conn:
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {compiled}", params))
    assert "jobs_claim" in plan and "Seq Scan" not in plan, plan


def test_a_dead_parent_is_not_pruned_before_its_children_are_settled(db: sa.Engine) -> None:
    """A parent rescued dead by its lease has children the rescue did not settle: the
    retention pass settles such parents a batch at a time before it deletes dead rows. A
    parent it did not reach (more than a batch of them, or one locked then) must not be
    deleted by that delete: its children would wait for it for ever (1,500 such parents
    left 478 children so)."""
    from sqla_jobs.worker import _statements as statements

    jobs = Jobs(app.Job, keep_dead=timedelta(0))

    @jobs.task(queue="p", max_attempts=1)
    def parent() -> None: ...

    @jobs.task(queue="c")
    def child() -> None: ...

    with JobSession(db, jobs=jobs) as session:
        p = session.enqueue(parent)
        session.enqueue(child.with_options(after=[p]))
        session.commit()
    with JobSession(db, jobs=jobs) as session:
        assert len(session.claim("p")) == 1
        session.commit()
    t = app.Job.__table__
    with db.begin() as conn:  # its worker died; time moved past the lease
        conn.execute(
            sa.update(t)
            .where(t.c.status == "running")
            .values(locked_until=sa.func.now() - timedelta(seconds=5))
        )
    with db.begin() as conn:
        statements.refresh(conn, jobs, True)
    assert sorted((r.task.rsplit(".", 1)[1], r.status) for r in rows(db)) == [
        ("child", "scheduled"),
        ("parent", "dead"),
    ]
    # The delete alone, as if the settling before it had not reached this parent.
    with db.begin() as conn:
        deleted = conn.execute(jobs.queries.prune_dead, {"age": timedelta(0), "limit": 1000})
        assert deleted.rowcount == 0
    # The pass settles it (the child is cancelled), then deletes it.
    assert prune(db, jobs) == 1
    assert [(r.task.rsplit(".", 1)[1], r.status) for r in rows(db)] == [("child", "cancelled")]

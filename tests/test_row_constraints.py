"""The jobs table's own CHECK constraints (issue 20, item 4), against the library's writes.

What the worker assumes of a row is checked by the database: ``args`` is a JSON object,
``meta`` an object or NULL, a waiting job has an attempt left (which also keeps the claim's
``attempts + 1`` inside the column), ``waiting`` is not negative. tests/test_upgrade.py
checks that an upgraded install refuses the rows that break them; this file checks the
other side: no statement of the library breaks them. A statement that did would fail its
whole batch (every claim of a queue, every heartbeat of a worker), so each statement that
writes ``status``, ``attempts`` or ``max_attempts`` is run here at the edge, on a job's last
attempt.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, admin
from sqla_jobs._queries import batch_params, claim_params, fail_params, interval, snooze_params

from . import app


def claim(conn: sa.Connection, jobs: Jobs) -> Any:
    [row] = conn.execute(jobs.queries.claim, claim_params("edge", 1, interval(60), "w")).all()
    assert row.attempts == row.max_attempts  # on its last attempt: the edge
    return row


def state(conn: sa.Connection, job_id: int) -> tuple[str, int, int]:
    t = app.Job.__table__
    row = conn.execute(
        sa.select(t.c.status, t.c.attempts, t.c.max_attempts).where(t.c.id == job_id)
    ).one()
    return row.status, row.attempts, row.max_attempts


def test_every_write_on_the_last_attempt_keeps_the_constraints(db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="edge", max_attempts=1)
    def edge() -> None:
        pass

    q, t = jobs.queries, app.Job.__table__
    with JobSession(db, jobs=jobs) as session:
        job = session.enqueue(edge)
        session.commit()
        job_id = job.id
    with db.begin() as conn:
        # A stopping worker hands back a claim it did not start: ready, one more attempt.
        conn.execute(q.hand_back, batch_params([claim(conn, jobs)])).all()
        assert state(conn, job_id) == ("ready", 1, 2)
        # "Not yet": scheduled, one more attempt; promoted once due.
        conn.execute(q.snooze, snooze_params(claim(conn, jobs), 0.0)).all()
        assert state(conn, job_id) == ("scheduled", 2, 3)
        conn.execute(sa.update(t).values(run_at=sa.func.now() - timedelta(seconds=1)))
        conn.execute(q.promote, {"limit": 10}).all()
        assert state(conn, job_id) == ("ready", 2, 3)
        # A lease that lapsed on the last attempt: dead, not ready.
        claim(conn, jobs)
        conn.execute(sa.update(t).values(locked_until=sa.func.now() - timedelta(seconds=1)))
        conn.execute(q.rescue, {"limit": 10}).all()
        assert state(conn, job_id) == ("dead", 3, 3)
        # An operator's retry: ready, with an attempt to run.
        assert admin.retry_jobs(conn, jobs, [job_id]) == 1
        assert state(conn, job_id) == ("ready", 3, 4)
        # A failure on the last attempt: dead.
        conn.execute(q.fail, fail_params(claim(conn, jobs), "boom", 0.0, permanent=False)).all()
        assert state(conn, job_id) == ("dead", 4, 4)


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("args", "[1]", "jobs_args_object"),
        ("args", '"text"', "jobs_args_object"),
        ("meta", "[1]", "jobs_meta_object"),
        ("meta", "7", "jobs_meta_object"),
    ],
)
def test_json_that_is_not_an_object_is_refused(
    db: sa.Engine, column: str, value: str, constraint: str
) -> None:
    """The rows of issue 20 item 1 (``meta = '[1]'`` killed an executor thread) cannot be
    written any more, by the library or anyone else."""
    with pytest.raises(sa.exc.IntegrityError, match=constraint), db.begin() as conn:
        conn.execute(
            sa.text(
                f'INSERT INTO "{app.SCHEMA}".jobs (task, {column}) '
                f"VALUES ('t', CAST(:v AS jsonb))"
            ),
            {"v": value},
        )

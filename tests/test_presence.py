"""Workers say they are alive (``<table>_workers``) and count what they wrote
(``<table>_throughput``), on both workers, through the core's presence duty."""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa

from sqla_jobs import Jobs, PermanentError
from sqla_jobs.model import companion_tables, job_table

from . import app
from .helpers import running, wait_for

COMPANIONS = companion_tables(job_table(app.Job))


def worker_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(COMPANIONS.workers)))


def throughput(engine: sa.Engine) -> dict[str, tuple[int, int, int]]:
    t = COMPANIONS.throughput
    stmt = sa.select(
        t.c.queue, sa.func.sum(t.c.succeeded), sa.func.sum(t.c.failed), sa.func.sum(t.c.dead)
    ).group_by(t.c.queue)
    with engine.connect() as conn:
        return {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in conn.execute(stmt)}


def test_a_running_worker_has_a_row_that_follows_it_and_goes_when_it_stops(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    release = threading.Event()

    @jobs.task(queue="q")
    def hold() -> None:
        release.wait(20)

    worker = make_worker(jobs, db, queues=["q"], concurrency=3, presence_interval=0.05)
    with running(worker):
        (row,) = wait_for(lambda: worker_rows(db))
        assert row.name == worker.name
        assert row.queues == ["q"]
        assert row.concurrency == 3
        assert row.running == 0
        assert row.kind in ("Worker", "AsyncWorker")
        assert row.expires_at > row.last_seen
        first_seen = row.last_seen
        with Session.begin() as session:
            session.enqueue_many(hold, [{}, {}])
        busy = wait_for(lambda: [r for r in worker_rows(db) if r.running == 2])
        assert busy[0].last_seen > first_seen
        assert busy[0].started_at == row.started_at
        release.set()
        wait_for(lambda: [r for r in worker_rows(db) if r.running == 0 and r.processed == 2])
    assert worker_rows(db) == []


def test_outcomes_are_counted_per_queue_as_the_database_confirmed_them(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q")
    def ok() -> None: ...

    @jobs.task(queue="q", max_attempts=2)
    def flaky() -> None:
        raise RuntimeError("no")

    @jobs.task(queue="r")
    def doomed() -> None:
        raise PermanentError("never")

    @jobs.task(queue="r", transactional=True)
    def in_tx(session: Any) -> None: ...

    with Session.begin() as session:
        session.enqueue_many(ok, [{} for _ in range(5)])
        session.enqueue(flaky)
        session.enqueue(doomed)
        session.enqueue(in_tx)
    worker = make_worker(jobs, db, queues=["q", "r"], presence_interval=60)
    worker.run_until_empty(wait_scheduled=1.0, timeout=30)
    # Counted at the end of the run even though no presence interval passed.
    assert throughput(db) == {"q": (5, 2, 1), "r": (1, 1, 1)}
    assert worker_rows(db) == []


def test_a_missing_presence_table_does_not_stop_the_worker(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, caplog: Any
) -> None:
    @jobs.task(queue="q")
    def ok() -> None: ...

    workers = COMPANIONS.workers
    with db.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {workers.fullname} RENAME TO moved_away"))
    try:
        with Session.begin() as session:
            session.enqueue_many(ok, [{} for _ in range(3)])
        worker = make_worker(jobs, db, queues=["q"])
        assert worker.run_until_empty(timeout=30) == 3
    finally:
        with db.begin() as conn:
            conn.execute(sa.text(f'ALTER TABLE "{app.SCHEMA}".moved_away RENAME TO {workers.name}'))
    assert "could not record its presence" in caplog.text

"""session.claim / complete / fail / retry / snooze: jobs worked off in the caller's own
transaction."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Backoff, Jobs, JobSession, JobStatus, admin

from . import app
from .helpers import count, rows


@pytest.fixture
def report(jobs: Jobs) -> Any:
    @jobs.task(queue="reports", max_attempts=2, retry=Backoff(base=120, cap=120, jitter=0))
    def build_report(n: int) -> None:
        pass

    return build_report


def test_claim_returns_locked_running_jobs_in_claim_order(
    Session: Any, db: sa.Engine, report: Any
) -> None:
    with Session.begin() as session:
        session.enqueue_many(report, [{"n": i} for i in range(3)])
        session.enqueue(report.with_options(priority=5), n=99)
        session.enqueue(report.with_options(queue="other"), n=100)
    with Session.begin() as session:
        claimed = session.claim("reports", limit=3, name="my-loop")
        assert [j.args["n"] for j in claimed] == [99, 0, 1]
        assert isinstance(claimed[0], app.Job) and claimed[0] in session
        assert {(j.status, j.attempts, j.locked_by) for j in claimed} == {("running", 1, "my-loop")}
        # Another connection's claim skips the locked rows instead of waiting for them.
        with Session.begin() as other:
            assert [j.args["n"] for j in other.claim("reports", limit=5)] == [2]
            other.rollback()
        for job in claimed:
            assert session.complete(job)
            assert job not in session
    assert sorted(r.args["n"] for r in rows(db)) == [2, 100]


def test_a_rolled_back_claim_leaves_the_job_ready(Session: Any, db: sa.Engine, report: Any) -> None:
    with Session.begin() as session:
        session.enqueue(report, n=1)
    with pytest.raises(RuntimeError), Session.begin() as session:
        assert len(session.claim("reports")) == 1
        raise RuntimeError("the work failed and took the transaction with it")
    (row,) = rows(db)
    assert (row.status, row.attempts) == ("ready", 0)


def test_fail_follows_the_retry_policy_then_dies(Session: Any, db: sa.Engine, report: Any) -> None:
    with Session.begin() as session:
        session.enqueue(report, n=1)
    with Session.begin() as session:
        (job,) = session.claim("reports")
        try:
            raise ValueError("no data")
        except ValueError as exc:
            assert session.fail(job, exc) is JobStatus.SCHEDULED
        assert job.status == "scheduled"  # expired and read back
    (row,) = rows(db)
    assert row.status == "scheduled" and "ValueError: no data" in row.last_error
    assert "Traceback" in row.last_error
    assert timedelta(seconds=110) < row.run_at - sa_now(db) < timedelta(seconds=130)
    with Session.begin() as session:
        session.execute(sa.update(app.Job).values(status="ready", run_at=sa.func.now()))
        (job,) = session.claim("reports")
        assert job.attempts == 2
        assert session.fail(job, "still no data") is JobStatus.DEAD  # max_attempts=2
    (row,) = rows(db)
    assert (row.status, row.last_error) == ("dead", "still no data")
    assert row.finished_at is not None


def test_fail_permanently_retry_and_snooze(Session: Any, db: sa.Engine, report: Any) -> None:
    with Session.begin() as session:
        session.enqueue_many(report, [{"n": i} for i in range(3)])
    with Session.begin() as session:
        a, b, c = session.claim("reports", limit=3)
        assert session.fail(a, "bad input", permanent=True) is JobStatus.DEAD
        assert session.retry(b, 60) is JobStatus.SCHEDULED
        assert session.snooze(c, timedelta(minutes=5))
    by_n = {r.args["n"]: r for r in rows(db)}
    assert by_n[0].status == "dead"
    assert (by_n[1].status, by_n[1].attempts, by_n[1].max_attempts) == ("scheduled", 1, 2)
    assert (by_n[2].status, by_n[2].attempts, by_n[2].max_attempts) == ("scheduled", 1, 3)
    assert by_n[2].run_at - by_n[1].run_at > timedelta(minutes=3)


def test_settling_a_claim_no_longer_held_changes_nothing(
    Session: Any, db: sa.Engine, report: Any
) -> None:
    with Session.begin() as session:
        session.enqueue(report, n=1)
    # Claim in one transaction, settle in another: the claim lives on its lease.
    with Session.begin() as session:
        (job,) = session.claim("reports", lease=30)
        job_id, attempt = job.id, job.attempts
    with db.begin() as conn:  # meanwhile an operator cancels it
        admin.cancel_jobs(conn, report.registry, [job_id])
    with Session.begin() as session:
        stale = session.get(app.Job, job_id)
        assert stale.attempts == attempt
        assert session.complete(stale) is False
        assert session.fail(stale, "late") is None
        assert session.retry(stale) is None
        assert session.snooze(stale, 1) is False
    (row,) = rows(db)
    assert row.status == "cancelled"


def test_a_paused_queue_gives_nothing(Session: Any, db: sa.Engine, report: Any) -> None:
    with Session.begin() as session:
        session.enqueue(report, n=1)
        admin.pause_queue(session, report.registry, "reports")
    with Session.begin() as session:
        assert session.claim("reports") == []
        admin.resume_queue(session, report.registry, "reports")
    with Session.begin() as session:
        assert len(session.claim("reports")) == 1


def test_claim_checks_its_arguments(Session: Any, db: sa.Engine) -> None:
    with Session() as session:
        with pytest.raises(ValueError, match="limit"):
            session.claim("reports", limit=0)
        with pytest.raises(ValueError, match="lease"):
            session.claim("reports", lease=0)
    with JobSession(db) as session, pytest.raises(Exception, match="no Jobs registry"):
        session.claim("reports")


def test_eight_concurrent_sessions_claim_each_job_once(
    db: sa.Engine, jobs: Jobs, report: Any
) -> None:
    total = 400
    with db.begin() as conn:
        jobs.enqueue_many(conn, report, [report.args(n=i) for i in range(total)])
    Session = sa.orm.sessionmaker(db, class_=JobSession, jobs=jobs)
    taken: list[list[int]] = [[] for _ in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def loop(k: int) -> None:
        try:
            start.wait(timeout=30)
            while True:
                with Session.begin() as session:  # each thread: its own connection
                    claimed = session.claim("reports", limit=5, name=f"loop-{k}")
                    if not claimed:
                        return
                    for job in claimed:
                        taken[k].append(job.args["n"])
                        session.complete(job)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    everything = [n for part in taken for n in part]
    assert sorted(everything) == list(range(total))  # each job exactly once
    assert sum(1 for part in taken if part) >= 2  # the sessions really did share the work
    assert count(db) == 0


def test_async_session_claim(db: sa.Engine, database_url: str, jobs: Jobs, report: Any) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    with db.begin() as conn:
        jobs.enqueue_many(conn, report, [report.args(n=i) for i in range(4)])

    async def main() -> list[int]:
        engine = create_async_engine(database_url)
        try:
            make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with make.begin() as session:
                a, b, c, d = await session.claim("reports", limit=4)
                assert await session.complete(a)
                assert await session.fail(b, "boom") is JobStatus.SCHEDULED
                assert await session.retry(c, 5) is JobStatus.SCHEDULED
                assert await session.snooze(d, 5)
                return [job.args["n"] for job in (a, b, c, d)]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert [(r.args["n"], r.status) for r in rows(db)] == [
        (1, "scheduled"),
        (2, "scheduled"),
        (3, "scheduled"),
    ]


def sa_now(db: sa.Engine) -> Any:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.now())).scalar_one()

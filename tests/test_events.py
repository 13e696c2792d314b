"""Events and job logs. Time is moved by the tests (rows'
timestamps set into the past), never waited for."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    Jobs,
    Worker,
)
from sqla_jobs.events import JobEvent

from .helpers import rows


def test_events_fire_through_a_jobs_life(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen: list[tuple[str, Any]] = []
    for name in ("enqueued", "started", "succeeded", "failed", "retried", "dead"):
        jobs.events.connect(name, lambda e: seen.append((e.name, e.duration)))

    @jobs.events.on("failed")
    def broken_listener(event: JobEvent) -> None:
        raise RuntimeError("a listener bug must not hurt the worker")

    with pytest.raises(ValueError, match="unknown event"):
        jobs.events.connect("finished", print)

    @jobs.task(queue="q", max_attempts=2)
    def flaky(fail: bool) -> None:
        if fail:
            raise RuntimeError("no")

    with Session() as session:
        session.enqueue(flaky, False)
        session.rollback()  # never enqueued: no event
    with Session.begin() as session:
        session.enqueue(flaky, False)
        session.enqueue(flaky, True)
    assert [n for n, _ in seen] == ["enqueued", "enqueued"]
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(wait_scheduled=5, timeout=20)
    names = [n for n, _ in seen]
    assert names.count("started") == 3
    assert names.count("succeeded") == 1
    assert names.count("failed") == 2
    assert names.count("retried") == 1 and names.count("dead") == 1
    assert all(d is not None and d >= 0 for n, d in seen if n in ("succeeded", "failed"))


def test_job_logs_carry_the_job_context(
    Session: Any, db: sa.Engine, jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def broken() -> None:
        raise ValueError("nope")

    with Session.begin() as session:
        session.enqueue(broken)
    with caplog.at_level("INFO", logger="sqla_jobs"):
        Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    (record,) = [r for r in caplog.records if "failed" in r.getMessage()]
    (job,) = rows(db)
    assert record.job_id == job.id  # type: ignore[attr-defined]
    assert (record.task, record.queue, record.attempt) == (broken.name, "q", 1)  # type: ignore[attr-defined]
    assert f"job {job.id} ({broken.name}, queue q, attempt 1/1): failed" in record.getMessage()


def test_enqueued_fires_once_for_a_unique_job(Session: Any, jobs: Jobs) -> None:
    seen: list[int] = []
    jobs.events.connect("enqueued", lambda e: seen.append(e.job.id))

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session.begin() as session:
        session.enqueue(refresh, 1, unique=True)
        session.enqueue(refresh, 1, unique=True)  # the same live job, handed back
    assert len(seen) == 1


@pytest.mark.parametrize("via", ["session", "connection", "async session"])
def test_enqueued_fires_only_for_the_rows_enqueue_many_inserted(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, via: str
) -> None:
    """``unique=True``: a row whose key a live job holds, and a second row of one key, are
    not inserted, and the listeners (the metrics' counter among them) hear only of the
    rows that were (they heard of every row given)."""
    seen: list[int] = []

    @jobs.events.on("enqueued")
    def heard(event: JobEvent) -> None:  # a row of enqueue_many is a dict
        seen.append(event.job["args"]["user_id"])

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with db.begin() as conn:
        jobs.enqueue(conn, refresh, 1, unique=True)
    seen.clear()
    given = [{"user_id": i} for i in (1, 2, 2, 3)]
    if via == "session":
        with Session.begin() as session:
            inserted = session.enqueue_many(refresh, given, unique=True)
    elif via == "connection":
        with db.begin() as conn:
            inserted = jobs.enqueue_many(conn, refresh, given, unique=True)
    else:
        from sqlalchemy.ext.asyncio import async_sessionmaker

        from sqla_jobs import create_async_engine
        from sqla_jobs.aio import AsyncJobSession

        async def main() -> int:
            engine = create_async_engine(database_url)
            try:
                make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
                async with make() as session, session.begin():
                    return await session.enqueue_many(refresh, given, unique=True)
            finally:
                await engine.dispose()

        inserted = asyncio.run(main())
    assert inserted == 2 and sorted(seen) == [2, 3]
    assert sorted(r.args["user_id"] for r in rows(db)) == [1, 2, 3]


def test_an_enqueue_hook_adding_what_meta_cannot_hold_fails_no_enqueue(
    Session: Any, db: sa.Engine, jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    """An enqueue hook that added a value JSON cannot hold (a ``datetime``) made the
    caller's enqueue raise ``TypeError`` (and a cron tick's fail the maintenance pass),
    though a hook never fails an enqueue. Its additions are dropped and logged; the
    other hooks' stay, on every path."""
    from datetime import datetime, timezone

    def bad(task: str, queue: str, meta: dict[str, Any]) -> None:
        meta["tenant"] = "t1"
        meta["when"] = datetime.now(timezone.utc)

    def good(task: str, queue: str, meta: dict[str, Any]) -> None:
        meta["sqla_jobs.origin"] = "web"  # the library's own hooks write such keys

    jobs.events.add_enqueue_hook(bad)
    jobs.events.add_enqueue_hook(good)

    @jobs.task(queue="q")
    def work() -> None: ...

    with caplog.at_level("ERROR", logger="sqla_jobs"):
        with Session.begin() as session:
            session.enqueue(work)
            session.enqueue_many(work, [{}])
        with db.begin() as conn:
            jobs.enqueue(conn, work)
    metas = [row.meta for row in rows(db)]
    assert metas == [{"sqla_jobs.origin": "web"}] * 3
    assert "is not JSON-serialisable" in caplog.text and "what it added is dropped" in caplog.text

"""Job metadata (``meta``, given at enqueue) and progress notes (``set_progress``, written by
the heartbeat), against a real PostgreSQL and both workers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs, admin, current_job
from sqla_jobs.session import AsyncJobSession

from . import app
from .helpers import rows, running, wait_for
from .test_cli import JOBS, cli


def test_meta_given_at_enqueue_is_stored_and_reaches_the_handler(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen: dict[int, Any] = {}

    @jobs.task(queue="q")
    def work(n: int) -> None:
        job = current_job()
        seen[n] = job.meta

    with Session.begin() as session:
        session.enqueue(work, 1, meta={"tenant": 7, "tags": ["vip", "eu"]})
        session.enqueue_many(work, [{"n": 2}, {"n": 3}], meta={"batch": "b-1"})
        session.enqueue(work, 4)
        unique = session.enqueue(work, 5, unique=True, meta={"request_id": "r-5"})
        assert unique.meta == {"request_id": "r-5"}
    stored = {r.args["n"]: r.meta for r in rows(db)}
    assert stored == {
        1: {"tenant": 7, "tags": ["vip", "eu"]},
        2: {"batch": "b-1"},
        3: {"batch": "b-1"},
        4: None,
        5: {"request_id": "r-5"},
    }
    with db.connect() as conn:
        (info,) = admin.list_jobs(conn, jobs, meta={"tenant": 7})
    assert info.meta == {"tenant": 7, "tags": ["vip", "eu"]} and info.progress is None
    assert info.to_dict()["meta"] == info.meta

    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert seen == stored


def test_meta_on_an_async_session(db: sa.Engine, database_url: str, jobs: Jobs) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine

    @jobs.task(queue="q")
    def work(n: int) -> None: ...

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        try:
            async with make.begin() as session:
                session.enqueue(work, 1, meta={"k": "one"})
                await session.enqueue_many(work, [{"n": 2}], meta={"k": "two"})
                await session.enqueue_unique(work, 3, meta={"k": "three"})
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert sorted(r.meta["k"] for r in rows(db)) == ["one", "three", "two"]


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        (["a"], "meta must be a dict"),
        ({1: "a"}, "meta keys must be strings, got 1"),
        ({"sqla_jobs.trace": {}}, "reserved for sqla-jobs"),
        ({"k": "a\x00b"}, "meta key 'k' contains a NUL character"),
        ({"k": {"deep": "\ud800"}}, r"surrogate code point U\+D800"),
        ({"k": {1: "x"}}, "has the dict key 1, which is not a string"),
        ({"k": object()}, "meta is not JSON-serialisable"),
        ({"k": "x" * 9000}, "at most 8192 are allowed"),
    ],
)
def test_meta_that_cannot_be_stored_is_refused_at_enqueue(
    Session: Any, db: sa.Engine, jobs: Jobs, meta: Any, message: str
) -> None:
    @jobs.task(queue="q")
    def work(n: int) -> None: ...

    with Session() as session:
        with pytest.raises(EnqueueError, match=message):
            session.enqueue(work, 1, meta=meta)
        with pytest.raises(EnqueueError, match=message):
            session.enqueue_many(work, [{"n": 1}], meta=meta)
        with pytest.raises(EnqueueError, match=message):
            session.enqueue_many(work, [], meta=meta)
        session.enqueue(work, 2, meta={"fine": True})  # the session is still usable
        session.commit()
    assert [r.meta for r in rows(db)] == [{"fine": True}]


def test_a_handler_may_not_take_a_parameter_named_meta(jobs: Jobs) -> None:
    with pytest.raises(TypeError, match=r"\['meta'\] are enqueue options"):

        @jobs.task()
        def tag(meta: dict[str, Any]) -> None: ...


def test_finding_jobs_by_meta_reads_the_partial_gin_index(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def work(n: int) -> None: ...

    with Session.begin() as session:
        session.enqueue(work, 1, meta={"tenant": 7, "tags": ["vip", "eu"]})
        session.enqueue(work, 2, meta={"tenant": "7", "tags": "vip"})
        session.enqueue(work, 3, meta={"tenant": 8})
        session.enqueue(work, 4)

    def found(**meta: Any) -> list[int]:
        with db.connect() as conn:
            return sorted(j.args["n"] for j in admin.list_jobs(conn, jobs, meta=meta))

    assert found(tenant=7) == [1]  # a number is not the string "7"
    assert found(tenant="7") == [2]
    assert found(tags="vip") == [1, 2]  # equal, or held by a list
    assert found(tags=["eu"]) == [1]
    assert found(tags="vip", tenant=8) == []
    with pytest.raises(ValueError, match="non-empty dict"), db.connect() as conn:
        admin.list_jobs(conn, jobs, meta={})

    # The planner can use <table>_meta for the filter (its predicate is implied), which
    # it would pick by itself on a large table; on four rows it must be told.
    table = jobs.table
    stmt = sa.select(table.c.id).where(*admin.meta_filter(table, {"tags": "vip"}))

    def explain(conn: Any, cursor: Any, statement: str, params: Any, *rest: Any) -> Any:
        return "EXPLAIN " + statement, params

    with db.begin() as conn:
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        sa.event.listen(conn, "before_cursor_execute", explain, retval=True)
        plan = "\n".join(map(str, conn.execute(stmt).scalars()))
    assert "Bitmap Index Scan on jobs_meta" in plan, plan


def test_the_cli_filters_by_meta_and_shows_meta_and_progress(Session: Any, db: sa.Engine) -> None:
    with Session.begin() as session:
        session.enqueue(app.record_run, n=1, meta={"tenant": 7})
        session.enqueue(app.record_run, n=2, meta={"tenant": "7", "tags": ["vip"]})
    with db.begin() as conn:
        note = {"value": 0.5, "note": "half way", "at": "2026-01-01T00:00:00+00:00"}
        conn.execute(sa.update(app.Job).where(app.Job.id == 2).values(progress=note))

    listing = cli("jobs", "list", JOBS, "--meta", "tenant=7", "--json")
    assert listing.returncode == 0, listing.stderr
    assert [j["id"] for j in json.loads(listing.stdout)] == [1]
    quoted = cli("jobs", "list", JOBS, "--meta", 'tenant="7"', "--meta", "tags=vip", "--json")
    (job,) = json.loads(quoted.stdout)
    assert job["id"] == 2 and job["meta"] == {"tenant": "7", "tags": ["vip"]}
    assert job["progress"] == note
    bad = cli("jobs", "list", JOBS, "--meta", "tenant")
    assert bad.returncode == 2 and "expected KEY=VALUE" in bad.stderr

    shown = cli("jobs", "show", JOBS, "2")
    assert shown.returncode == 0, shown.stderr
    assert '  meta          {"tags": ["vip"], "tenant": "7"}' in shown.stdout
    assert '  progress      0.5 "half way" (at 2026-01-01T00:00:00+00:00)' in shown.stdout
    assert "  progress      -" in cli("jobs", "show", JOBS, "1").stdout


def test_progress_is_written_within_about_a_second_while_the_handler_runs(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """With a 60 s lease the heartbeat beats every 20 s; a waiting note makes it beat
    within about a second, so the note is in the row long before that."""
    release = threading.Event()

    @jobs.task(queue="q")
    def export(pages: int) -> None:
        job = current_job()
        for page in range(1, pages + 1):
            job.set_progress(page / pages, note=f"page {page} of {pages}")
        release.wait(30)

    with Session.begin() as session:
        session.enqueue(export, 4)
    worker = make_worker(jobs, db, queues=["q"], lease=60, poll_interval=0.1)
    with running(worker):
        started = time.monotonic()
        (row,) = wait_for(lambda: [r for r in rows(db) if r.progress], timeout=10)
        took = time.monotonic() - started
        release.set()
        wait_for(lambda: not rows(db), timeout=20)
    assert row.status == "running"
    assert row.progress["value"] == 1.0 and row.progress["note"] == "page 4 of 4"
    assert row.progress["at"].endswith("+00:00")
    assert took < 5, took


def test_a_failure_writes_the_last_progress_note_with_the_error(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", max_attempts=1)
    def export() -> None:
        current_job().set_progress({"done": 3, "of": 7}, note="stuck on page 4")
        raise RuntimeError("page 4 is broken")

    with Session.begin() as session:
        session.enqueue(export)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    (row,) = rows(db)
    assert row.status == "dead" and "page 4 is broken" in row.last_error
    assert row.progress["value"] == {"done": 3, "of": 7}
    assert row.progress["note"] == "stuck on page 4"


def test_meta_through_with_options_and_on_a_core_connection(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def work(n: int) -> None:
        pass

    tagged = work.with_options(meta={"tenant": 1})
    with Session.begin() as session:
        session.enqueue(tagged, n=1)
        session.enqueue_many(tagged, [work.args(n=2)])
        with pytest.raises(EnqueueError, match="option 'meta' given both"):
            session.enqueue(tagged, n=9, meta={"tenant": 2})
    with db.begin() as conn:
        jobs.enqueue(conn, work, n=3, meta={"tenant": 3})
        jobs.enqueue_many(conn, tagged, [{"n": 4}])
    with pytest.raises(EnqueueError, match="meta"):
        work.with_options(meta={"\x00": 1})
    assert {r.args["n"]: r.meta for r in rows(db)} == {
        1: {"tenant": 1},
        2: {"tenant": 1},
        3: {"tenant": 3},
        4: {"tenant": 1},
    }

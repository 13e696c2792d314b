"""Results and workflows (sqla_jobs.flow): kept return values, jobs.result, dependencies,
groups. Real PostgreSQL, both worker drivers."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    EnqueueError,
    JobFailedError,
    Jobs,
    JobSession,
    admin,
    create_engine,
    current_job,
)
from sqla_jobs.worker.db import prune

from . import app
from .helpers import rows, running


@pytest.fixture
def Session(db: sa.Engine, jobs: Jobs) -> Any:
    """Job objects keep their ids after the commit (the tests read them outside)."""
    return sa.orm.sessionmaker(db, class_=JobSession, jobs=jobs, expire_on_commit=False)


def _row(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(app.Job).where(app.Job.id == job_id)).first()


# -- results ---------------------------------------------------------------------------


def test_result_is_kept_and_returned(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def add(a: int, b: int) -> dict[str, int]:
        return {"sum": a + b}

    @jobs.task(queue="q")
    def plain() -> int:
        return 7

    with Session.begin() as session:
        kept = session.enqueue(add, a=2, b=3)
        dropped = session.enqueue(plain)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty()

    assert jobs.result(db, kept.id, timeout=5) == {"sum": 5}
    row = _row(db, kept.id)
    assert row.status == "done" and row.result == {"sum": 5}
    assert row.locked_until is not None  # kept until then (a day: keep_result=True)
    assert _row(db, dropped.id) is None  # keeps nothing: deleted as before
    with pytest.raises(LookupError, match="keep_result"):
        jobs.result(db, dropped.id, timeout=1)
    # Retention keeps the row until its result expires.
    assert prune(db, jobs) == 0
    with db.connect() as conn:
        info = admin.get_job(conn, jobs, kept.id)
    assert info is not None and info.result == {"sum": 5}


def test_result_waits_through_notify(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    gate = threading.Event()

    @jobs.task(queue="q", keep_result=timedelta(minutes=5))
    def slow() -> str:
        gate.wait(10)
        return "late"

    with Session.begin() as session:
        job = session.enqueue(slow)
    got: list[Any] = []
    one = create_engine(db.url, pool_size=1, max_overflow=0)  # the waiter's connection, alone
    waiter = threading.Thread(target=lambda: got.append(jobs.result(one, job.id, timeout=20)))
    with running(make_worker(jobs, db, queues=["q"])):
        waiter.start()
        time.sleep(0.2)  # the waiter is listening and has seen the job running
        assert not got
        started = time.monotonic()
        gate.set()
        waiter.join(15)
        # Woken by the NOTIFY, not by its 5 s safety re-check.
        assert time.monotonic() - started < 3
    assert got == ["late"]
    # The connection went back to the pool no longer listening.
    with one.connect() as conn:
        listening = conn.exec_driver_sql("SELECT pg_listening_channels()").scalars().all()
    one.dispose()
    assert listening == []


def test_result_timeout_names_the_job(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q", keep_result=True)
    def never() -> None: ...

    with Session.begin() as session:
        job = session.enqueue(never)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"job {job.id} "):
        jobs.result(db, job.id, timeout=0.3)
    assert time.monotonic() - started < 2


def test_result_async(Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any) -> None:
    from sqla_jobs import create_async_engine

    @jobs.task(queue="q", keep_result=True)
    def answer() -> int:
        return 42

    with Session.begin() as session:
        job = session.enqueue(answer)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty()

    async def main() -> Any:
        engine = create_async_engine(db.url.render_as_string(hide_password=False))
        try:
            return await jobs.result_async(engine, job.id, timeout=5)
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == 42


def test_failed_job_raises_its_error(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", keep_result=True, max_attempts=1)
    def boom() -> None:
        raise RuntimeError("the partner API said no")

    with Session.begin() as session:
        job = session.enqueue(boom)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty()
    with pytest.raises(JobFailedError, match="the partner API said no") as info:
        jobs.result(db, job.id, timeout=5)
    assert info.value.status == "dead" and "Traceback" in (info.value.last_error or "")


def test_non_json_result_fails_the_job(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def odd() -> object:
        return {1, 2}

    with Session.begin() as session:
        job = session.enqueue(odd)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty()
    row = _row(db, job.id)
    assert row.status == "dead" and row.attempts == 1  # permanent: no retry
    assert "ResultError" in row.last_error and "returned a set" in row.last_error
    with pytest.raises(JobFailedError, match="set"):
        jobs.result(db, job.id, timeout=5)


# -- dependencies ------------------------------------------------------------------------


def _order_task(jobs: Jobs, log: list[tuple[str, float]], lock: threading.Lock) -> Any:
    @jobs.task(queue="flow", name="step")
    def step(name: str) -> None:
        with lock:
            log.append((name, time.monotonic()))
        time.sleep(0.05)

    return step


def test_diamond_runs_the_last_job_once_after_both(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    log: list[tuple[str, float]] = []
    lock = threading.Lock()
    step = _order_task(jobs, log, lock)
    with Session.begin() as session:
        a = session.enqueue(step, name="A")
        b = session.enqueue(step.with_options(after=[a]), name="B")
        c = session.enqueue(step.with_options(after=[a]), name="C")
        d = session.enqueue(step.with_options(after=[b, c]), name="D")
    held = {r.id: r for r in rows(db)}
    assert held[d.id].status == "scheduled" and held[d.id].waiting == 2
    assert held[d.id].parents == [b.id, c.id]
    assert held[b.id].run_at.year > 9000  # held: the promoter never reaches it

    # Several slots: B and C run at the same time and complete concurrently.
    make_worker(jobs, db, queues=["flow"], concurrency=4, listen=False).run_until_empty()
    names = [n for n, _ in log]
    assert sorted(names) == ["A", "B", "C", "D"]
    at = dict(log)
    assert names[0] == "A" and names[-1] == "D"
    assert at["D"] >= max(at["B"], at["C"])
    # Parents stay 'done' (nothing to keep: expired at once) until retention prunes them.
    assert sorted(r.id for r in rows(db) if r.status == "done") == [a.id, b.id, c.id]
    assert prune(db, jobs) == 3 and rows(db) == []


def test_sibling_parents_completing_concurrently_release_once(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """Two parents completed at the same moment on two connections: exactly one of the
    two release statements takes the child's count to 0, whatever the interleaving."""
    from sqla_jobs.worker.db import settle_children

    @jobs.task(queue="p")
    def parent() -> None: ...

    @jobs.task(queue="c")
    def child() -> None: ...

    for _ in range(10):
        with Session.begin() as session:
            p1, p2 = session.enqueue(parent), session.enqueue(parent)
            kid = session.enqueue(child.with_options(after=[p1, p2]))
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def finish(
            pid: int, barrier: threading.Barrier = barrier, errors: list[BaseException] = errors
        ) -> None:
            try:
                with db.begin() as conn:
                    conn.execute(sa.delete(app.Job).where(app.Job.id == pid))
                    barrier.wait(5)
                    settle_children(conn, jobs.queries, [pid], [])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=finish, args=(p,)) for p in (p1.id, p2.id)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors
        row = _row(db, kid.id)
        assert (row.status, row.waiting) == ("ready", 0)
        with db.begin() as conn:
            conn.execute(sa.delete(app.Job))


def test_dead_parent_cancels_its_children_down_the_chain(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    ran: list[str] = []

    @jobs.task(queue="flow", max_attempts=1)
    def fails() -> None:
        raise RuntimeError("no")

    @jobs.task(queue="flow")
    def after(name: str) -> None:
        ran.append(name)

    with Session.begin() as session:
        a = session.enqueue(fails)
        b = session.enqueue(after.with_options(after=[a]), name="B")
        c = session.enqueue(after.with_options(after=[b]), name="C")
        anyway = session.enqueue(after.with_options(after=[a], on_parent_failure="run"), name="R")
    make_worker(jobs, db, queues=["flow"], listen=False).run_until_empty()
    assert ran == ["R"]
    by_id = {r.id: r for r in rows(db)}
    assert by_id[a.id].status == "dead"
    for child in (b, c):
        assert by_id[child.id].status == "cancelled"
        assert "ended dead or cancelled" in by_id[child.id].last_error
    assert anyway.id not in by_id  # it ran, and kept nothing
    with pytest.raises(JobFailedError, match="cancelled"):
        jobs.result(db, b.id, timeout=1)


def test_admin_cancel_cancels_the_children(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        a = session.enqueue(step)
        b = session.enqueue(step.with_options(after=[a]))
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, ids=[a.id]) == 1
    assert _row(db, b.id).status == "cancelled"
    with db.connect() as conn:
        info = admin.get_job(conn, jobs, b.id)
    assert info is not None and info.parents == [a.id] and info.waiting == 1


def test_core_enqueue_after_existing_ids(db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with db.begin() as conn:
        a = jobs.enqueue(conn, step)
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        b = jobs.enqueue(conn, step.with_options(after=[a]))
    row = _row(db, b)
    assert (row.status, row.waiting, row.parents) == ("scheduled", 1, [a])
    with db.begin() as conn, pytest.raises(EnqueueError, match="no job 999"):
        jobs.enqueue(conn, step.with_options(after=[999]))
    # An ORM job of another jobs table is refused by name.
    with pytest.raises(EnqueueError, match="another table"), db.begin() as conn:
        jobs.enqueue(conn, step.with_options(after=[app.OtherJob(id=1, task="x")]))


def test_rolled_back_workflow_leaves_nothing(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session() as session, session.begin():
        a = session.enqueue(step)
        session.enqueue(step.with_options(after=[a]))
        session.flush()  # both inserted and linked...
        assert len(session.execute(sa.select(app.Job)).all()) == 2
        session.rollback()  # ...and gone with the transaction
    assert rows(db) == []
    # In a savepoint: the workflow rolls back with it, the job before it stays.
    with Session.begin() as session:
        keep = session.enqueue(step)
        with pytest.raises(RuntimeError), session.begin_nested():
            x = session.enqueue(step.with_options(after=[keep]))
            session.enqueue(step.with_options(after=[x]))
            raise RuntimeError
    assert [r.id for r in rows(db)] == [keep.id]
    assert _row(db, keep.id).meta is None or "sqla_jobs.children" not in _row(db, keep.id).meta


def test_group_callback_sees_every_result_once(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    seen: list[Any] = []

    @jobs.task(queue="flow")
    def square(n: int) -> int:
        time.sleep(0.01 * (5 - n))  # finish out of order
        return n * n

    @jobs.task(queue="flow")
    def total(label: str, results: list[int]) -> None:
        seen.append((label, results, current_job().id))

    with Session.begin() as session:
        members, callback = jobs.group(
            session, [(square, square.args(n=i)) for i in range(5)], (total, total.args("sum"))
        )
    assert len(members) == 5
    make_worker(jobs, db, queues=["flow"], concurrency=5, listen=False).run_until_empty()
    assert seen == [("sum", [0, 1, 4, 9, 16], callback.id)]


def test_validation(Session: Any, jobs: Jobs) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        with pytest.raises(EnqueueError, match="on_parent_failure"):
            session.enqueue(step.with_options(on_parent_failure="maybe"))
        with pytest.raises(EnqueueError, match="run_at and delay"):
            session.enqueue(step.with_options(after=[1], delay=5))
        with pytest.raises(EnqueueError, match="keep_result"):
            session.enqueue(step.with_options(keep_result="yes"))  # type: ignore[arg-type]
        with pytest.raises(EnqueueError, match="enqueue_many"):
            session.enqueue_many(step.with_options(after=[1]), [{}])


def test_cli_and_web_show_parents_children_and_result(Session: Any, db: sa.Engine) -> None:
    from starlette.testclient import TestClient

    from sqla_jobs.web import create_app

    from .test_cli import JOBS, cli

    with Session.begin() as session:
        a = session.enqueue(app.record_run, n=1)
        b = session.enqueue(app.record_run.with_options(after=[a]), n=2)
    with db.begin() as conn:
        conn.execute(sa.update(app.Job).where(app.Job.id == a.id).values(result={"ok": 1}))
    parent, child = cli("jobs", "show", JOBS, str(a.id)), cli("jobs", "show", JOBS, str(b.id))
    assert parent.returncode == 0, parent.stderr
    assert f"  children      {b.id}" in parent.stdout
    assert '  result        {"ok": 1}' in parent.stdout
    assert f"  parents       {a.id}" in child.stdout and "  waiting for   1" in child.stdout
    client = TestClient(create_app(app.jobs, db), base_url="http://localhost")
    page = client.get(f"/jobs/{b.id}").text
    assert "waiting for" in page and f"{a.id}" in page


def test_transactional_task_keeps_its_result(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    @jobs.task(queue="q", keep_result=True, transactional=True)
    def write(session: Any, code: str) -> str:
        session.add(app.Link(code=code, url="u"))
        return code.upper()

    @jobs.task(queue="q", keep_result=True, transactional=True)
    def odd(session: Any) -> object:
        session.add(app.Link(code="odd", url="u"))
        return object()

    with Session.begin() as session:
        job = session.enqueue(write, code="ab")
        bad = session.enqueue(odd)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty()
    assert jobs.result(db, job.id, timeout=5) == "AB"
    with pytest.raises(JobFailedError, match="ResultError"):
        jobs.result(db, bad.id, timeout=5)
    assert [r.code for r in rows(db, app.Link)] == ["ab"]  # odd's write rolled back


def test_run_queued_jobs_follows_dependencies(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    from sqla_jobs.testing import run_queued_jobs

    order: list[str] = []

    @jobs.task(queue="flow", keep_result=True)
    def step(name: str) -> str:
        order.append(name)
        return name

    @jobs.task(queue="flow")
    def total(results: list[str]) -> None:
        order.append("+".join(results))

    with Session() as session, session.begin():
        last = session.enqueue(step.with_options(queue="other"), name="first")
        b = session.enqueue(step.with_options(after=[last]), name="second")
        jobs.group(
            session, [(step, step.args("g1")), (step, step.args("g2"))], (total, total.args())
        )
        summary = run_queued_jobs(session, jobs, include_scheduled=True)
        assert summary.succeeded == 5
        assert order.index("first") < order.index("second")
        assert order[-1] == "g1+g2"
        assert session.get(app.Job, b.id).result == "second"  # type: ignore[union-attr]
        session.rollback()


def test_retention_cancels_children_of_a_parent_that_died_by_its_lease(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        a = session.enqueue(step)
        b = session.enqueue(step.with_options(after=[a]))
        c = session.enqueue(step.with_options(after=[b]))
        r = session.enqueue(step.with_options(after=[a], on_parent_failure="run"))
    # What the rescue does to a job out of attempts: dead, without looking for children.
    with db.begin() as conn:
        conn.execute(sa.update(app.Job).where(app.Job.id == a.id).values(status="dead"))
    prune(db, jobs)
    state = {row.id: (row.status, row.waiting) for row in rows(db)}
    assert state[b.id][0] == state[c.id][0] == "cancelled"
    assert state[r.id] == ("ready", 0)  # it runs anyway
    # Settled once: another pass changes nothing.
    with db.begin() as conn:
        conn.execute(
            sa.update(app.Job).where(app.Job.id == r.id).values(status="scheduled", waiting=1)
        )
    prune(db, jobs)
    assert _row(db, r.id).waiting == 1


def test_session_claim_complete_and_fail_settle_children(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="own")
    def step() -> None: ...

    with Session.begin() as session:
        a, b = session.enqueue(step), session.enqueue(step)
        ok = session.enqueue(step.with_options(queue="kids", after=[a]))
        gone = session.enqueue(step.with_options(queue="kids", after=[b]))
    with Session.begin() as session:
        first, second = session.claim("own", limit=2)
        session.complete(first)
        session.fail(second, "no", permanent=True)
    assert _row(db, ok.id).status == "ready"
    assert _row(db, gone.id).status == "cancelled"


def test_async_session_workflow(db: sa.Engine, jobs: Jobs) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.session import AsyncJobSession

    @jobs.task(queue="flow")
    def step(n: int) -> int:
        return n

    @jobs.task(queue="flow")
    def total(results: list[int]) -> None: ...

    async def main() -> list[int]:
        engine = create_async_engine(db.url.render_as_string(hide_password=False))
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs, expire_on_commit=False)
        try:
            async with make.begin() as session:
                a = session.enqueue(step, 1)
                b = session.enqueue(step.with_options(after=[a]), 2)
                _, cb = jobs.group(session, [(step, step.args(3))], (total, total.args()))
            return [a.id, b.id, cb.id]
        finally:
            await engine.dispose()

    a, b, cb = asyncio.run(main())
    state = {r.id: (r.status, r.parents) for r in rows(db)}
    assert state[a] == ("ready", None)
    assert state[b] == ("scheduled", [a]) and state[cb][0] == "scheduled"

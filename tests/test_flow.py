"""Results and workflows (sqla_jobs.flow): kept return values, jobs.result, dependencies,
groups. Real PostgreSQL, both worker drivers."""

from __future__ import annotations

import asyncio
import json
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
from sqla_jobs.worker._statements import prune

from . import app
from .helpers import rows, running, wait_for


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


def _claim_pair(Session: Any, jobs: Jobs, queue: str) -> list[Any]:
    """Claim the two members of a group, as two workers would (committed)."""
    with Session.begin() as session:
        claimed = session.claim(queue, limit=2)
    assert len(claimed) == 2
    return sorted(claimed, key=lambda j: j.id)


def _complete_member(conn: sa.Connection, jobs: Jobs, job: Any, value: Any) -> None:
    """What the completer writes for a result-keeping member: its guarded completion with
    the result (the statement the worker runs), before the release."""
    from sqla_jobs._queries import batch_params

    params: dict[str, Any] = dict(batch_params([job]))
    params.update(result_list=[json.dumps(value)], keep_list=[3600.0])
    assert conn.execute(jobs.queries.complete_flow, params).all()


def test_sibling_parents_completing_concurrently_release_once(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """Two members of a group completed at the same moment on two connections: exactly
    one of the two releases takes the callback's count to 0, and the callback gets both
    results, in order, whatever the interleaving."""
    from sqla_jobs._settle import settle_children

    @jobs.task(queue="p", keep_result=True)
    def member(n: int) -> int:
        return n

    @jobs.task(queue="c")
    def callback(results: list[int]) -> None: ...

    for round_ in range(10):
        with Session.begin() as session:
            _, cb = jobs.group(
                session,
                [(member, member.args(1)), (member, member.args(2))],
                (callback, callback.args()),
            )
        first, second = _claim_pair(Session, jobs, "p")
        values = {first.id: f"a{round_}", second.id: f"b{round_}"}
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def finish(
            job: Any,
            value: str,
            barrier: threading.Barrier = barrier,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                with db.begin() as conn:
                    _complete_member(conn, jobs, job, value)
                    barrier.wait(5)
                    settle_children(conn, jobs.queries, [job.id], [])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=finish, args=(j, values[j.id])) for j in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors
        row = _row(db, cb.id)
        assert (row.status, row.waiting) == ("ready", 0)
        assert row.args["results"] == [values[first.id], values[second.id]], f"round {round_}"
        with db.begin() as conn:
            conn.execute(sa.delete(app.Job))


def _waiting_for_a_lock(engine: sa.Engine, pid: int) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": pid},
            ).scalar()
        )


@pytest.mark.parametrize("first_index", [0, 1])
def test_callback_gets_a_sibling_result_committed_while_its_release_waited(
    Session: Any, db: sa.Engine, jobs: Jobs, first_index: int
) -> None:
    """The interleaving that lost a result, made certain: one member's release has
    counted the callback down (2 -> 1) and holds its row lock, uncommitted; the other
    member's release starts (its snapshot taken) and waits for that lock; the first
    commits. The second release frees the callback, and must read the first member's
    result as committed, not as its snapshot had it (null)."""
    from sqla_jobs._settle import settle_children

    @jobs.task(queue="p", keep_result=True)
    def member(n: int) -> int:
        return n

    @jobs.task(queue="c")
    def callback(results: list[Any]) -> None: ...

    with Session.begin() as session:
        _, cb = jobs.group(
            session,
            [(member, member.args(1)), (member, member.args(2))],
            (callback, callback.args()),
        )
    claimed = _claim_pair(Session, jobs, "p")
    early, late = claimed[first_index], claimed[1 - first_index]
    values = {claimed[0].id: {"n": 1}, claimed[1].id: {"n": 2}}
    both_completed = threading.Barrier(2)
    early_released = threading.Event()
    late_pid: list[int] = []
    errors: list[BaseException] = []

    def run_early() -> None:
        try:
            with db.begin() as conn:
                _complete_member(conn, jobs, early, values[early.id])
                both_completed.wait(5)
                settle_children(conn, jobs.queries, [early.id], [])
                early_released.set()
                # Commit only once the other release is waiting for the callback's lock.
                wait_for(lambda: late_pid and _waiting_for_a_lock(db, late_pid[0]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            early_released.set()

    def run_late() -> None:
        try:
            with db.begin() as conn:
                late_pid.append(int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()))
                _complete_member(conn, jobs, late, values[late.id])
                both_completed.wait(5)
                assert early_released.wait(5)
                settle_children(conn, jobs.queries, [late.id], [])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run_early), threading.Thread(target=run_late)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    row = _row(db, cb.id)
    assert (row.status, row.waiting) == ("ready", 0)
    assert row.args["results"] == [{"n": 1}, {"n": 2}]


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


def test_child_enqueued_while_its_parent_ran_survives_a_cut_between_completion_and_release(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """A child enqueued while its parent runs is not in the parent's claimed meta. The
    worker's connection dies (its backend terminated, as by a crash or a failover) just
    as the statements that settle the parent's children begin: the parent's completion
    must not outlive them (it did, in autocommit, and the child waited forever)."""
    from sqla_jobs import Worker

    started, gate = threading.Event(), threading.Event()
    ran: list[int] = []

    @jobs.task(queue="flow")
    def parent() -> None:
        started.set()
        assert gate.wait(10)

    @jobs.task(queue="kids")
    def kid() -> None:
        ran.append(current_job().id)

    with Session.begin() as session:
        p = session.enqueue(parent)
    killer = create_engine(db.url.render_as_string(hide_password=False), poolclass=sa.pool.NullPool)
    settling = {jobs.queries.lock_children, jobs.queries.release, jobs.queries.cancel_children}
    cut: list[int] = []

    def cut_before_settling(
        conn: sa.Connection, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        # The statement run, not context.compiled.statement: a cached compilation may
        # belong to an equal statement of another test's registry.
        if cut or getattr(context, "invoked_statement", None) not in settling:
            return
        pid = cursor.connection.info.backend_pid
        cut.append(pid)
        with killer.connect() as k:
            # Waits until the backend is gone: the statement about to run cannot reach it.
            k.execute(sa.text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})

    worker = Worker(jobs, db, queues=["flow", "kids"], listen=False, poll_interval=0.05)
    try:
        with running(worker):
            assert started.wait(10)
            with Session.begin() as session:
                k = session.enqueue(kid.with_options(after=[p.id]))
            sa.event.listen(db, "before_cursor_execute", cut_before_settling)
            try:
                gate.set()
                wait_for(lambda: ran, timeout=15)
            finally:
                sa.event.remove(db, "before_cursor_execute", cut_before_settling)
    finally:
        killer.dispose()
    assert cut, "the connection was cut before the release"
    assert ran == [k.id]


def test_a_batch_mixing_plain_flow_and_new_parents_is_written_whole(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """One completer batch: a plain job, a plain job that got a child while it ran, a
    result-keeping job, a lost claim. The new parent is completed with the flow job, in
    one statement, and its child released; the lost claim changes nothing."""
    from sqla_jobs.worker._statements import write_outcomes
    from sqla_jobs.worker.job import Outcome, OutcomeKind

    @jobs.task(queue="own")
    def plain() -> None: ...

    @jobs.task(queue="own", keep_result=True)
    def keeper() -> int:
        return 7

    @jobs.task(queue="kids")
    def kid() -> None: ...

    with Session.begin() as session:
        session.enqueue(plain)
        session.enqueue(plain)
        session.enqueue(keeper)
        session.enqueue(plain)
    with Session.begin() as session:
        a, b, f, lost = session.claim("own", limit=4)
    with Session.begin() as session:
        child = session.enqueue(kid.with_options(after=[b.id]))
    with db.begin() as conn:  # lost: retried by an operator's hand in the meantime
        conn.execute(sa.update(app.Job).where(app.Job.id == lost.id).values(status="ready"))
    batch = [
        Outcome(OutcomeKind.SUCCEEDED, a),
        Outcome(OutcomeKind.SUCCEEDED, b),
        Outcome(OutcomeKind.SUCCEEDED, f, result="7"),
        Outcome(OutcomeKind.SUCCEEDED, lost),
    ]
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert write_outcomes(conn, jobs.queries, batch).tally == {"own": [3, 0, 0]}
        # Written again (the completer's retry after an error): nothing more happens.
        assert write_outcomes(conn, jobs.queries, batch).tally == {}
    state = {r.id: (r.status, r.result) for r in rows(db)}
    assert a.id not in state  # deleted, as ever
    assert state[b.id] == ("done", None)  # a parent: done until retention
    assert state[f.id] == ("done", 7)
    assert state[lost.id] == ("ready", None)
    assert state[child.id] == ("ready", None)


# -- retrying a parent ------------------------------------------------------------------


def _state(db: sa.Engine) -> dict[int, tuple[str, int | None]]:
    return {r.id: (r.status, r.waiting) for r in rows(db)}


def test_retrying_a_dead_parent_brings_back_what_it_cancelled(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A chain and a group: the dead parent and the dead member are retried, and what
    they had cancelled waits for them again, then runs in order, the callback once with
    every result."""
    ran: list[Any] = []
    broken = {"A", "m1"}

    @jobs.task(queue="flow", max_attempts=1, keep_result=True)
    def step(name: str) -> str:
        ran.append(name)
        if name in broken:
            raise RuntimeError(f"{name} broke")
        return name.upper()

    @jobs.task(queue="flow")
    def total(results: list[str]) -> None:
        ran.append(("total", results))

    with Session.begin() as session:
        a = session.enqueue(step, "A")
        b = session.enqueue(step.with_options(after=[a]), "B")
        c = session.enqueue(step.with_options(after=[b]), "C")
        (m1, _), cb = jobs.group(
            session, [(step, step.args("m1")), (step, step.args("m2"))], (total, total.args())
        )
    make_worker(jobs, db, queues=["flow"], listen=False).run_until_empty()
    state = _state(db)
    assert state[a.id][0] == state[m1.id][0] == "dead"
    assert state[b.id][0] == state[c.id][0] == state[cb.id][0] == "cancelled"

    broken.clear()
    ran.clear()
    with db.begin() as conn:
        report = admin.retry_report(conn, jobs, status="dead")
    assert sorted(report.acted) == sorted([a.id, m1.id])
    assert sorted(report.rearmed) == sorted([b.id, c.id, cb.id])
    assert report.skipped == ()
    state = _state(db)
    assert state[b.id] == state[c.id] == state[cb.id] == ("scheduled", 1)
    with db.connect() as conn:
        info = admin.get_job(conn, jobs, b.id)
    assert info is not None and info.last_error is None
    assert "sqla_jobs.cancelled_by_parent" not in (info.meta or {})

    make_worker(jobs, db, queues=["flow"], listen=False).run_until_empty()
    names = [r for r in ran if isinstance(r, str)]
    assert names.index("A") < names.index("B") < names.index("C")
    assert [r for r in ran if isinstance(r, tuple)] == [("total", ["M1", "M2"])]
    assert {s for s, _ in _state(db).values()} == {"done"}


def test_a_child_retried_alone_waits_for_its_parent_or_is_skipped_saying_why(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        a = session.enqueue(step)
        b = session.enqueue(step.with_options(after=[a]))
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[a.id])
    assert _state(db)[b.id][0] == "cancelled"
    with db.begin() as conn:
        assert admin.retry_jobs(conn, jobs, ids=[b.id], dry_run=True) == 0
        assert admin.retry_jobs(conn, jobs, ids=[b.id]) == 0
        seen = admin.SeenJob(b.id, 0, "cancelled")
        report = admin.act(conn, jobs, "retry", [seen])
    assert report.acted == ()
    ((job_id, why),) = report.skipped
    assert job_id == b.id
    assert f"job {a.id}, which it waits for, ended; that job is cancelled: retry it" in why
    assert _state(db)[b.id][0] == "cancelled"

    # Retried in one selection with its parent: it waits for it (held, not ready).
    with db.begin() as conn:
        report = admin.retry_report(conn, jobs, status="cancelled")
    assert report.acted == (a.id,) and report.rearmed == (b.id,) and report.skipped == ()
    state = _state(db)
    assert state[a.id][0] == "ready" and state[b.id] == ("scheduled", 1)


def test_an_operator_cancelled_child_stays_cancelled_when_its_parent_is_retried(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        a = session.enqueue(step)
        b = session.enqueue(step.with_options(after=[a]))
        kept = session.enqueue(step.with_options(after=[a]))
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[b.id])  # the operator's choice
        admin.cancel_jobs(conn, jobs, ids=[a.id])
        report = admin.retry_report(conn, jobs, ids=[a.id])
    assert report.rearmed == (kept.id,)
    state = _state(db)
    assert state[b.id][0] == "cancelled" and state[kept.id] == ("scheduled", 1)


def test_a_job_an_operator_cancelled_while_it_waited_is_retried_waiting(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """Cancelled by an operator while held for its parents, then retried: it waits for
    the parents still to run, not ready at once (it ran before its parent, and a group
    callback without its results: a TypeError); one that runs anyway whatever its
    parents' outcome is not held back by a dead one; one whose parent is dead says so."""

    @jobs.task(queue="flow")
    def step() -> None: ...

    @jobs.task(queue="flow", keep_result=True)
    def member(n: int) -> int:
        return n

    called: list[Any] = []

    @jobs.task(queue="flow")
    def callback(results: list[int]) -> None:
        called.append(results)

    from sqla_jobs import Worker

    with Session.begin() as session:
        parent = session.enqueue(step.with_options(delay=3600))
        child = session.enqueue(step.with_options(after=[parent]))
        _, then = jobs.group(
            session,
            [(member, member.args(1)), (member, member.args(2))],
            then=(callback, callback.args()),
        )
        dead, live = session.enqueue(step), session.enqueue(step.with_options(delay=3600))
        anyway = session.enqueue(step.with_options(after=[dead, live], on_parent_failure="run"))
        blocked = session.enqueue(step.with_options(after=[dead]))
    with db.begin() as conn:
        cancelled = [child.id, then.id, anyway.id, blocked.id]
        assert admin.cancel_jobs(conn, jobs, ids=cancelled) == 4
        conn.execute(sa.update(app.Job).where(app.Job.id == dead.id).values(status="dead"))
    with db.begin() as conn:
        report = admin.retry_report(conn, jobs, ids=cancelled)
    assert sorted(report.acted) == sorted([child.id, then.id, anyway.id])
    assert [i for i, _ in report.skipped] == [blocked.id]
    assert f"job {dead.id}, which it waits for, is dead" in report.skipped[0][1]
    state = _state(db)
    assert state[child.id] == ("scheduled", 1) and state[then.id] == ("scheduled", 2)
    assert state[anyway.id] == ("scheduled", 1) and state[blocked.id][0] == "cancelled"
    Worker(jobs, db, queues=["flow"], listen=False).run_until_empty(timeout=10)
    assert called == [[1, 2]]
    assert _state(db)[child.id][0] == "scheduled"  # its parent has not run


def test_a_child_that_runs_anyway_waits_again_for_a_retried_parent(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """R runs after A and Q whatever their outcome. A died and counted R down; retried,
    A is waited for again: R is not freed by Q alone (it was, counted twice)."""
    from sqla_jobs._settle import settle_children

    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        a, q = session.enqueue(step), session.enqueue(step)
        r = session.enqueue(step.with_options(after=[a, q], on_parent_failure="run"))
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[a.id])
    assert _state(db)[r.id] == ("scheduled", 1)
    with db.begin() as conn:
        assert admin.retry_report(conn, jobs, ids=[a.id]).acted == (a.id,)
    assert _state(db)[r.id] == ("scheduled", 2)
    for parent in (q, a):
        with db.begin() as conn:
            conn.execute(sa.update(app.Job).where(app.Job.id == parent.id).values(status="done"))
            settle_children(conn, jobs.queries, [parent.id], [])
        assert _state(db)[r.id] == (("scheduled", 1) if parent is q else ("ready", 0))


def test_a_group_s_results_follow_its_members_as_given_unique_ones_too(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """The callback gets one result per member, in the order given: a unique member is
    written at its enqueue, before the plain ones given ahead of it (its lower id came
    first), and a member given twice (one live unique job) gave one result for two."""
    from sqla_jobs import Worker

    @jobs.task(queue="flow", keep_result=True)
    def plain(n: int) -> str:
        return f"plain{n}"

    @jobs.task(queue="flow", keep_result=True, unique=True)
    def once(n: int) -> str:
        return f"once{n}"

    got: list[Any] = []

    @jobs.task(queue="flow")
    def total(results: list[str]) -> None:
        got.append(results)

    with Session.begin() as session:
        jobs.group(
            session,
            [
                (plain, plain.args(1)),
                (once, once.args(2)),
                (plain, plain.args(3)),
                (once, once.args(2)),  # the same job as the second member
            ],
            then=(total, total.args()),
        )
    Worker(jobs, db, queues=["flow"], listen=False).run_until_empty(timeout=20)
    assert got == [["plain1", "once2", "plain3", "once2"]]


def test_a_group_member_whose_unique_key_a_finished_job_holds_is_named(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """A scoped unique member whose key a finished job holds for its period enqueues
    nothing (``session.enqueue`` returns None): the group says which member and why (it
    failed with "after= takes jobs or job ids, got None")."""

    @jobs.task(queue="flow", keep_result=True, unique_for=timedelta(minutes=5))
    def member(n: int) -> int:
        return n

    @jobs.task(queue="flow")
    def total(results: list[int]) -> None: ...

    with db.begin() as conn:
        jobs.enqueue(conn, member, 1)
        conn.execute(sa.delete(app.Job))  # it ran; its key is held for five minutes
    with Session.begin() as session, pytest.raises(EnqueueError, match=r"member 1 .* unique"):
        jobs.group(session, [(member, member.args(1))], then=(total, total.args()))


def test_purging_a_settled_parent_does_not_count_its_children_down_again(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """A cancelled parent settled its child (which runs anyway) when it ended; purged
    later, it is not settled again: the child ran before its other parent (counted down
    twice), while an unsettled parent (deleted before it ran) still is."""

    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        a, q = session.enqueue(step), session.enqueue(step.with_options(delay=3600))
        r = session.enqueue(step.with_options(after=[a, q], on_parent_failure="run"))
        unrun = session.enqueue(step.with_options(delay=3600))
        held = session.enqueue(step.with_options(after=[unrun]))
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[a.id])
    assert _state(db)[r.id] == ("scheduled", 1)
    with db.begin() as conn:
        assert (
            admin.purge_jobs(conn, jobs, [a.id, unrun.id], status=["cancelled", "scheduled"]) == 2
        )
    state = _state(db)
    assert state[r.id] == ("scheduled", 1)  # still waits for q
    assert state[held.id][0] == "cancelled"  # its parent will never run


def test_linking_to_an_ended_parent_is_settled_once(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """A child enqueued after a parent that already ended is settled by the link; the
    retention pass must not settle that parent for it again (a child that runs anyway
    was counted down twice), unless the parent was never settled (it died by its lease):
    then the child waits for that settling."""

    @jobs.task(queue="flow")
    def step() -> None: ...

    with Session.begin() as session:
        settled, unsettled, q = session.enqueue(step), session.enqueue(step), session.enqueue(step)
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[settled.id])
        # What the rescue does to a job out of attempts: dead, children not looked at.
        conn.execute(
            sa.update(app.Job)
            .where(app.Job.id == unsettled.id)
            .values(status="dead", meta={"sqla_jobs.children": True})
        )
    with Session.begin() as session:
        r1 = session.enqueue(step.with_options(after=[settled, q], on_parent_failure="run"))
        r2 = session.enqueue(step.with_options(after=[unsettled, q], on_parent_failure="run"))
        gone = session.enqueue(step.with_options(after=[settled]))
    state = _state(db)
    assert state[r1.id] == ("scheduled", 1) and state[r2.id] == ("scheduled", 2)
    assert state[gone.id][0] == "cancelled"
    prune(db, jobs)
    state = _state(db)
    assert state[r1.id] == ("scheduled", 1), "settled twice"
    assert state[r2.id] == ("scheduled", 1)
    # Retrying the parent brings the child it cancelled at the link back.
    with db.begin() as conn:
        assert admin.retry_report(conn, jobs, ids=[settled.id]).rearmed == (gone.id,)


def test_bringing_a_child_back_does_not_miss_a_parent_completing_meanwhile(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """C waits for A and P. A is cancelled (C with it); P runs. The retry of A brings C
    back, counting the parents still to run, while P's completion commits on another
    connection: C must end up waiting for A alone, never for a P that is done."""
    from sqla_jobs._queries import batch_params
    from sqla_jobs._settle import settle_children

    @jobs.task(queue="flow")
    def step() -> None: ...

    @jobs.task(queue="run")
    def other() -> None: ...

    with Session.begin() as session:
        a, p = session.enqueue(step), session.enqueue(other)
        c = session.enqueue(step.with_options(after=[a, p]))
    with Session.begin() as session:
        (claimed,) = session.claim("run", limit=1)
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[a.id])
    completer_pid: list[int] = []
    completed = threading.Event()
    errors: list[BaseException] = []

    def complete_p() -> None:
        try:
            with db.begin() as conn:
                completer_pid.append(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
                rows_ = conn.execute(jobs.queries.complete, dict(batch_params([claimed]))).all()
                settle_children(conn, jobs.queries, [r[0] for r in rows_ if r[1]], [])
            completed.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            completed.set()

    thread = threading.Thread(target=complete_p)
    with db.begin() as conn:
        assert admin.retry_report(conn, jobs, ids=[a.id]).rearmed == (c.id,)
        # P completes now: it must wait for this retry (or have committed before it).
        thread.start()
        wait_for(
            lambda: (
                completed.is_set() or (completer_pid and _waiting_for_a_lock(db, completer_pid[0]))
            )
        )
    thread.join(10)
    assert not errors, errors
    assert _state(db)[c.id] == ("scheduled", 1)


def test_a_cancelled_callback_whose_members_all_succeeded_since_runs_with_their_results(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """Its members ended well after all (a member retried by hand before retries brought
    children back): retried, the callback is ready at once, with every result."""

    @jobs.task(queue="flow", keep_result=True)
    def member(n: int) -> int:
        return n

    @jobs.task(queue="flow")
    def total(results: list[int]) -> None: ...

    with Session.begin() as session:
        (m1, m2), cb = jobs.group(
            session, [(member, member.args(1)), (member, member.args(2))], (total, total.args())
        )
    with db.begin() as conn:
        admin.cancel_jobs(conn, jobs, ids=[m1.id])
        for m, value in ((m1, 10), (m2, 20)):
            conn.execute(
                sa.update(app.Job).where(app.Job.id == m.id).values(status="done", result=value)
            )
    assert _state(db)[cb.id][0] == "cancelled"
    with db.begin() as conn:
        assert admin.retry_report(conn, jobs, ids=[cb.id]).acted == (cb.id,)
    row = _row(db, cb.id)
    assert (row.status, row.waiting, row.args["results"]) == ("ready", 0, [10, 20])


def test_cli_and_dashboard_retry_a_parent_and_say_what_came_back(
    Session: Any, db: sa.Engine
) -> None:
    from starlette.testclient import TestClient

    from sqla_jobs.web import create_app

    from .test_cli import JOBS, cli

    def workflow() -> tuple[int, int, int]:
        with Session.begin() as session:
            a = session.enqueue(app.record_run, n=1)
            b = session.enqueue(app.record_run.with_options(after=[a]), n=2)
            c = session.enqueue(app.record_run.with_options(after=[b]), n=3)
        with db.begin() as conn:
            admin.cancel_jobs(conn, app.jobs, ids=[a.id])
        return a.id, b.id, c.id

    # The CLI: the child alone is skipped, saying why; the parent brings both back.
    a, b, c = workflow()
    alone = cli("jobs", "retry", JOBS, str(b), "--yes")
    assert alone.returncode == 1, alone.stderr
    assert alone.stdout == "retried 0 jobs\n"
    assert f"skipping job {b}: it was cancelled because job {a}, which it waits for" in (
        alone.stderr
    )
    parent = cli("jobs", "retry", JOBS, str(a), "--yes")
    assert parent.returncode == 0, parent.stderr
    assert parent.stdout == "retried 1 job; 2 jobs they had cancelled wait for them again\n"
    assert [(r.status, r.waiting) for r in rows(db) if r.id in (b, c)] == [("scheduled", 1)] * 2
    as_json = cli("jobs", "retry", JOBS, str(a), "--yes", "--json")
    assert json.loads(as_json.stdout)["rearmed"] == 0  # nothing left to retry

    # The dashboard: the job page's Retry, and the selection's.
    client = TestClient(
        create_app(app.jobs, db, read_only=False),
        base_url="http://localhost",
        follow_redirects=False,
    )
    assert client.get("/").status_code == 200
    token = client.cookies.get("sqla_jobs_csrf")
    a, b, c = workflow()
    done = client.post(
        f"/jobs/{a}/retry", data={"csrf_token": token, "attempts": 0, "status": "cancelled"}
    )
    assert done.status_code == 303, done.text
    # The notice's query is signed by the server (text in a URL is no notice).
    assert done.headers["location"].startswith(f"/jobs/{a}?done=retry&rearmed=2&sig=")
    page = client.get(done.headers["location"]).text
    assert "Retried: the job is ready again, due now. 2 jobs it had cancelled by ending" in page
    child = client.get(f"/jobs/{b}").text
    assert "waiting for" in child
    a, b, c = workflow()
    selected = [f"{b}:0:cancelled", f"{c}:0:cancelled"]
    result = client.post(
        "/jobs/act", data={"csrf_token": token, "action": "retry", "job": selected}
    )
    assert "Retried 0 jobs. 2 jobs left alone" in result.text
    assert f"job {a}, which it waits for, ended; that job is cancelled: retry it" in result.text
    result = client.post(
        "/jobs/act",
        data={"csrf_token": token, "action": "retry", "job": [f"{a}:0:cancelled", *selected]},
    )
    assert "Retried 1 job. 2 jobs they had cancelled by ending wait for them again." in result.text
    assert "left alone" not in result.text


# -- a kept result that ends outside the worker's completion ----------------------------


def _waiter(jobs: Jobs, db: sa.Engine, job_id: int) -> tuple[threading.Thread, list[Any]]:
    """A thread waiting on ``jobs.result`` of ``job_id``, returned once it has listened
    and looked at the row (so that it waits on the NOTIFY or on its 5 s re-check), with
    a list that gets the exception its wait ended with."""
    engine = create_engine(db.url, pool_size=1, max_overflow=0)
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    ended: list[Any] = []

    def wait() -> None:
        try:
            jobs.result(engine, job_id, timeout=20)
        except Exception as exc:
            ended.append(exc)
        finally:
            engine.dispose()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    # LISTEN, then the first look at the row: after that it waits.
    wait_for(lambda: len(statements) >= 2 and not ended)
    return thread, ended


def _heard_within(thread: threading.Thread, seconds: float) -> float:
    started = time.monotonic()
    thread.join(10)
    assert not thread.is_alive()
    took = time.monotonic() - started
    # Woken by a NOTIFY at the action's commit, not by the waiter's 5 s re-check.
    assert took < seconds, f"the waiter heard after {took:.1f}s"
    return took


@pytest.mark.parametrize("was", ["ready", "running"])
def test_a_result_waiter_hears_an_operator_cancel_at_once(
    Session: Any, db: sa.Engine, jobs: Jobs, was: str
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def slow() -> None: ...

    with Session.begin() as session:
        job = session.enqueue(slow)
    if was == "running":
        with Session.begin() as session:
            assert [claimed.id for claimed in session.claim("q")] == [job.id]
    thread, ended = _waiter(jobs, db, job.id)
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, ids=[job.id]) == 1
    _heard_within(thread, 3)
    assert isinstance(ended[0], JobFailedError) and "cancelled" in str(ended[0])


def test_a_result_waiter_hears_a_job_dead_by_its_lease_at_once(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    from sqla_jobs.worker._statements import refresh

    @jobs.task(queue="q", keep_result=True, max_attempts=1)
    def lost() -> None: ...

    with Session.begin() as session:
        job = session.enqueue(lost)
    with Session.begin() as session:
        assert [claimed.id for claimed in session.claim("q")] == [job.id]
    # Its worker is gone: the lease has passed.
    with db.begin() as conn:
        conn.execute(
            sa.update(app.Job)
            .where(app.Job.id == job.id)
            .values(locked_until=sa.func.now() - timedelta(seconds=1))
        )
    thread, ended = _waiter(jobs, db, job.id)
    with db.begin() as conn:
        refresh(conn, jobs, rescue=True)
    _heard_within(thread, 3)
    assert isinstance(ended[0], JobFailedError) and "dead" in str(ended[0])
    assert _row(db, job.id).status == "dead"


def test_a_result_waiter_hears_its_unfinished_job_purged_at_once(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q", keep_result=True)
    def never() -> None: ...

    with Session.begin() as session:
        job = session.enqueue(never)
    thread, ended = _waiter(jobs, db, job.id)
    with db.begin() as conn:
        assert admin.purge_jobs(conn, jobs, ids=[job.id], status="ready") == 1
    _heard_within(thread, 3)
    assert isinstance(ended[0], LookupError)

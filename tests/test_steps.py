"""Durable steps (sqla_jobs.steps): steps that run once across attempts, transactional
steps whose writes commit with their checkpoint, cursors, sleeps and waits that hold no
worker, and signals that ride the sender's transaction. Time is moved by the tests (the
rows' times set into the past), never waited for."""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from sqla_jobs import (
    AsyncSteps,
    Backoff,
    Jobs,
    SignalError,
    StepError,
    Steps,
    WaitTimedOut,
    Worker,
    create_engine,
    current_job,
)
from sqla_jobs.model import companion_tables, job_table
from sqla_jobs.worker._statements import prune

from . import app
from .conftest import AsyncWorkerInThread
from .helpers import count, rows, running, wait_for

STEPS = companion_tables(job_table(app.Job)).steps
JOBS = job_table(app.Job)


def drain(jobs: Jobs, db: sa.Engine, wait_scheduled: float = 0.0, timeout: float = 30) -> int:
    worker = Worker(jobs, db, queues=["d"], listen=False)
    return worker.run_until_empty(wait_scheduled=wait_scheduled, timeout=timeout)


def job_row(db: sa.Engine, job_id: int) -> Any:
    with db.connect() as conn:
        return conn.execute(sa.select(JOBS).where(JOBS.c.id == job_id)).one_or_none()


def step_rows(db: sa.Engine, job_id: int) -> dict[str, Any]:
    with db.connect() as conn:
        found = conn.execute(sa.select(STEPS).where(STEPS.c.job_id == job_id)).all()
    return {r.name: r for r in found}


def due_now(db: sa.Engine, job_id: int) -> None:
    """Move a suspended job's time (and its step's) into the past, as if it had passed."""
    with db.begin() as conn:
        past = datetime.now(timezone.utc) - timedelta(seconds=1)
        conn.execute(sa.update(STEPS).where(STEPS.c.job_id == job_id).values(until=past))
        conn.execute(
            sa.update(JOBS)
            .where(JOBS.c.id == job_id, JOBS.c.status == "scheduled")
            .values(run_at=past)
        )


def enqueue(Session: Any, task: Any, *args: Any, **kwargs: Any) -> int:
    with Session.begin() as session:
        job = session.enqueue(task, *args, **kwargs)
        session.flush()
        return int(job.id)


def test_a_step_runs_once_across_attempts_and_returns_its_stored_json(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    calls: list[str] = []

    def charge(order: int) -> dict[str, Any]:
        calls.append("charge")
        return {"order": order, "ids": (1, 2)}  # a tuple: stored as a list

    seen: list[Any] = []

    @jobs.task(durable=True, queue="d", max_attempts=3)
    def fulfil(steps: Steps, order: int) -> None:
        seen.append(steps.run("charge", charge, order))
        if current_job().attempts == 1:
            raise RuntimeError("the worker fell over after the charge")
        seen.append(steps.run("ship", lambda: "shipped"))

    job_id = enqueue(Session, fulfil, order=7)
    drain(jobs, db, wait_scheduled=2)  # the failed attempt, then its retry
    assert calls == ["charge"]  # the second attempt took the stored result
    assert seen == [{"order": 7, "ids": [1, 2]}] * 2 + ["shipped"]
    assert job_row(db, job_id) is None  # succeeded (deleted)


@pytest.mark.parametrize("autocommit", [False, True], ids=["engine", "autocommit-engine"])
def test_a_step_that_takes_a_session_commits_its_writes_with_its_checkpoint(
    Session: Any, db: sa.Engine, jobs: Jobs, autocommit: bool
) -> None:
    """Also on a worker given an engine in autocommit, where the step's session had no
    transaction: its write committed at once, and the failed attempt's stayed."""

    @jobs.task(durable=True, queue="d", max_attempts=3)
    def signup(steps: Steps, code: str) -> None:
        def create(session: Any) -> str:
            session.add(app.Link(code=code, url="made"))
            session.flush()  # sent: only the step's transaction keeps it uncommitted
            if current_job().attempts == 1:
                raise RuntimeError("after the write, before the checkpoint")
            return code

        assert steps.run("create", create) == code
        # The session first (as a transactional handler takes it), or by keyword.
        assert steps.run("first", lambda session, n: n + 1, 1) == 2
        assert steps.run("keyword", lambda n, *, session: n + 2, 1) == 3
        if current_job().attempts == 2:
            raise RuntimeError("after the checkpoint")

    job_id = enqueue(Session, signup, code="x1")
    engine = create_engine(db.url, isolation_level="AUTOCOMMIT") if autocommit else db
    try:
        for _ in range(3):
            drain(jobs, engine, wait_scheduled=2)
    finally:
        if autocommit:
            engine.dispose()
    assert [r.code for r in rows(db, app.Link)] == ["x1"]  # once: rolled back, then committed
    assert job_row(db, job_id) is None


def test_step_misuse_fails_at_the_step_with_a_clear_error(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(durable=True, queue="d", max_attempts=1, name="twice")
    def twice(steps: Steps) -> None:
        steps.run("a", lambda: 1)
        steps.run("a", lambda: 2)

    @jobs.task(durable=True, queue="d", max_attempts=1, name="unjson")
    def unjson(steps: Steps) -> None:
        steps.run("obj", object)

    @jobs.task(durable=True, queue="d", max_attempts=1, name="huge")
    def huge(steps: Steps) -> None:
        steps.run("big", lambda: "x" * (17 * 2**20))

    @jobs.task(durable=True, queue="d", max_attempts=1, name="nameless")
    def nameless(steps: Steps) -> None:
        steps.run("", lambda: 1)

    ids = [enqueue(Session, t) for t in (twice, unjson, huge, nameless)]
    drain(jobs, db)
    errors = [job_row(db, i).last_error for i in ids]
    assert "step 'a' is used twice in one run" in errors[0]
    assert "is a object, which is not JSON" in errors[1]
    assert "more than a step keeps" in errors[2]
    assert "non-empty string" in errors[3]
    assert all(step_rows(db, i).keys() <= {"a"} for i in ids)  # nothing else stored

    with pytest.raises(TypeError, match="must take a 'steps' parameter"):
        jobs.task(durable=True, name="nosteps")(lambda x: None)
    with pytest.raises(TypeError, match="durable and transactional"):
        jobs.task(durable=True, transactional=True, name="both")(lambda steps, session: None)


def test_a_five_megabyte_result_round_trips(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    got: list[int] = []

    @jobs.task(durable=True, queue="d", max_attempts=3)
    def big(steps: Steps) -> None:
        got.append(len(steps.run("blob", lambda: "y" * (5 * 2**20))))
        if len(got) == 1:
            raise RuntimeError("again")

    enqueue(Session, big)
    drain(jobs, db, wait_scheduled=2)
    assert got == [5 * 2**20] * 2


def test_sleep_frees_the_worker_does_not_spend_an_attempt_and_resumes_after_the_steps(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    calls: list[str] = []

    @jobs.task(durable=True, queue="d", max_attempts=1)
    def onboarding(steps: Steps) -> None:
        steps.run("welcome", lambda: calls.append("welcome"))
        steps.sleep("three days", timedelta(days=3))
        steps.run("follow-up", lambda: calls.append("follow-up"))

    job_id = enqueue(Session, onboarding)
    assert drain(jobs, db) == 1  # ran once, and the worker is free: nothing else ready
    row = job_row(db, job_id)
    assert row.status == "scheduled" and row.locked_until is None
    assert row.run_at > datetime.now(timezone.utc) + timedelta(days=2, hours=23)
    assert (row.attempts, row.max_attempts) == (1, 2)  # the attempt was given back
    sleeping = step_rows(db, job_id)["three days"]
    assert (sleeping.kind, sleeping.state) == ("sleep", "sleeping")
    assert sleeping.until == row.run_at

    drain(jobs, db)  # woken early by nothing: not due, not run
    assert calls == ["welcome"]
    due_now(db, job_id)
    drain(jobs, db, wait_scheduled=2)
    assert calls == ["welcome", "follow-up"]
    assert job_row(db, job_id) is None


def test_a_sleep_until_a_time_and_an_early_wake_sleeps_again(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    at = datetime.now(timezone.utc) + timedelta(hours=5)

    @jobs.task(durable=True, queue="d")
    def later(steps: Steps) -> None:
        steps.sleep("till five", until=at)

    job_id = enqueue(Session, later)
    drain(jobs, db)
    assert job_row(db, job_id).run_at == at
    with db.begin() as conn:  # an operator's "run now"
        conn.execute(
            sa.update(JOBS).where(JOBS.c.id == job_id).values(status="ready", run_at=sa.func.now())
        )
    drain(jobs, db)
    row = job_row(db, job_id)
    assert row.status == "scheduled" and row.run_at == at  # back to sleep, same time
    with pytest.raises(StepError, match="not both"):
        Steps._times("x", 1, at)
    # The range of run_at, which the wake time becomes: past it the step failed on every
    # attempt, or (datetime.max) made every job list fail in a session east of UTC.
    for far in (
        datetime.max.replace(tzinfo=timezone.utc),
        datetime.min.replace(tzinfo=timezone(timedelta(hours=14))),
    ):
        with pytest.raises(StepError, match="is out of range"):
            Steps._times("x", None, far)


def test_wait_suspends_until_a_committed_signal_and_a_rolled_back_one_never_wakes_it(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    got: list[Any] = []

    @jobs.task(durable=True, queue="d", max_attempts=1)
    def order(steps: Steps) -> None:
        got.append(steps.wait("shipped"))

    job_id = enqueue(Session, order)
    drain(jobs, db)
    row = job_row(db, job_id)
    assert row.status == "scheduled" and row.run_at.year == 9999  # no timeout
    assert step_rows(db, job_id)["shipped"].state == "waiting"

    with Session() as session:  # a webhook whose transaction rolls back
        assert jobs.signal(session, job_id, "shipped", {"tracking": "no"}) == "woken"
        session.rollback()
    assert job_row(db, job_id).status == "scheduled"
    drain(jobs, db)
    assert got == []

    with Session.begin() as session:
        assert jobs.signal(session, job_id, "shipped", {"tracking": "1Z"}) == "woken"
    assert job_row(db, job_id).status == "ready"
    drain(jobs, db)
    assert got == [{"tracking": "1Z"}]
    assert job_row(db, job_id) is None
    with Session.begin() as session, pytest.raises(SignalError, match="no such job") as caught:
        jobs.signal(session, job_id, "shipped")
    assert caught.value.reason == "unknown"


def test_a_signal_sent_before_the_wait_is_kept_and_duplicates_are_refused(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    got: list[Any] = []

    @jobs.task(durable=True, queue="d")
    def order(steps: Steps) -> None:
        steps.run("first", lambda: None)
        got.append(steps.wait("paid", timeout=60))

    job_id = enqueue(Session, order)
    with db.begin() as conn:  # a Core connection works too
        assert jobs.signal(conn, job_id, "paid", [1, 2]) == "kept"
    with db.begin() as conn, pytest.raises(SignalError, match="already") as caught:
        jobs.signal(conn, job_id, "paid", [3])
    assert caught.value.reason == "resolved"
    drain(jobs, db)
    assert got == [[1, 2]]  # no suspension: it was there


def test_a_wait_times_out_once_and_a_late_signal_is_told_so(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    outcomes: list[str] = []

    @jobs.task(durable=True, queue="d", max_attempts=3)
    def order(steps: Steps) -> None:
        try:
            steps.wait("shipped", timeout=timedelta(days=2))
            outcomes.append("shipped")
        except WaitTimedOut:
            outcomes.append("timed out")
        if len(outcomes) == 1:
            raise RuntimeError("and again")  # a later attempt takes the same branch

    job_id = enqueue(Session, order)
    drain(jobs, db)
    row = job_row(db, job_id)
    assert row.run_at > datetime.now(timezone.utc) + timedelta(days=1, hours=23)
    due_now(db, job_id)
    drain(jobs, db, wait_scheduled=2)
    assert outcomes == ["timed out", "timed out"]
    assert job_row(db, job_id) is None

    job_id = enqueue(Session, order)
    drain(jobs, db)
    due_now(db, job_id)
    with Session.begin() as session:  # the timeout passed, but the signal got there first
        assert jobs.signal(session, job_id, "shipped") == "woken"
    outcomes.clear()
    drain(jobs, db, wait_scheduled=2)
    assert outcomes[0] == "shipped"

    job_id = enqueue(Session, order)
    drain(jobs, db)
    due_now(db, job_id)
    outcomes.clear()
    drain(jobs, db, wait_scheduled=2)
    with Session.begin() as session, pytest.raises(SignalError) as caught:
        jobs.signal(session, job_id, "shipped")
    assert caught.value.reason in ("timed_out", "unknown")


def test_a_signal_and_a_wait_meet_on_the_step_row(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    """A signal whose transaction is still open when the running job reaches its wait:
    the wait blocks on the step's row, and takes the signal once it commits (never
    suspended with its signal already there). Meanwhile the job's heartbeat goes on: a
    signal does not lock the job's row for as long as the sender's transaction lasts."""
    started, go = threading.Event(), threading.Event()
    got: list[Any] = []

    @jobs.task(durable=True, queue="d")
    def order(steps: Steps) -> None:
        started.set()
        go.wait(10)
        got.append(steps.wait("go"))

    job_id = enqueue(Session, order)
    worker = Worker(jobs, db, queues=["d"], listen=False, lease=1.5)
    session = Session()
    try:
        with running(worker):
            assert started.wait(10)
            assert jobs.signal(session, job_id, "go", "payload") == "kept"  # holds the row
            leased = job_row(db, job_id).locked_until
            wait_for(lambda: job_row(db, job_id).locked_until > leased)  # heartbeats go on
            go.set()
            with db.connect() as conn:  # the wait is blocked on the lock the signal holds
                waiting = sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
                # A transaction per look: pg_stat_activity is read once per transaction,
                # and a first look taken before the wait began never saw it (on a loaded
                # machine).
                wait_for(lambda: conn.execute(waiting).scalar() or conn.rollback())
                conn.rollback()
            assert got == []
            session.commit()
            wait_for(lambda: got)
            wait_for(lambda: job_row(db, job_id) is None)
    finally:
        session.close()
    assert got == ["payload"]


def test_a_signal_for_a_finished_job_is_an_error(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(durable=True, queue="d", max_attempts=1)
    def fails(steps: Steps) -> None:
        raise RuntimeError("dead")

    job_id = enqueue(Session, fails)
    drain(jobs, db)
    with Session.begin() as session, pytest.raises(SignalError, match="is dead") as caught:
        jobs.signal(session, job_id, "x")
    assert caught.value.reason == "finished"
    with Session.begin() as session, pytest.raises(StepError):
        jobs.signal(session, job_id, "bad\x00name")
    with Session.begin() as session, pytest.raises(SignalError, match="not a job id"):
        jobs.signal(session, 2**63, "x")  # past bigint: refused here, not by PostgreSQL


def test_a_lost_claim_cannot_commit_a_step(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    """The claim moves on (as a rescue after a lost lease does) while a transactional step
    runs: its writes roll back and nothing is recorded."""

    @jobs.task(durable=True, queue="d", max_attempts=5)
    def write(steps: Steps) -> None:
        def step(session: Any) -> None:
            session.add(app.Link(code="lost", url="u"))
            with db.begin() as conn:  # another worker's claim now
                conn.execute(sa.update(JOBS).values(attempts=JOBS.c.attempts + 1, max_attempts=9))

        steps.run("write", step)

    job_id = enqueue(Session, write)
    drain(jobs, db)
    assert rows(db, app.Link) == []
    assert step_rows(db, job_id) == {}


def test_iterate_resumes_after_the_last_committed_batch_and_writes_each_row_once(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    with db.begin() as conn:
        conn.execute(sa.insert(app.Link), [{"code": f"{i:04}", "url": "old"} for i in range(1050)])
    seen: list[int] = []

    # The retry waits a second: on the fixture's quick policy (0.05 s) a loaded machine
    # could run it within the first drain, before the cursor is looked at.
    @jobs.task(durable=True, queue="d", max_attempts=3, retry=Backoff(base=1, cap=1, jitter=0))
    def backfill(steps: Steps) -> int:
        stmt = sa.select(app.Link).order_by(app.Link.code)
        for batch in steps.iterate("links", stmt, key=app.Link.code, size=100):
            seen.append(len(batch))
            for link in batch:
                link.url = link.url + "+"  # commits with the cursor
            if len(seen) == 4 and current_job().attempts == 1:
                raise RuntimeError("killed in the 4th batch")
        return 0

    job_id = enqueue(Session, backfill)
    drain(jobs, db)
    cursor = step_rows(db, job_id)["links"]
    assert (cursor.state, cursor.result) == ("open", {"after": "0299", "rows": 300})
    drain(jobs, db, wait_scheduled=2)
    assert seen == [100] * 4 + [100] * 7 + [50]  # the 4th batch again, then the rest
    assert {r.url for r in rows(db, app.Link)} == {"old+"}  # every row written once
    assert job_row(db, job_id) is None


def test_retention_prunes_the_steps_of_jobs_that_are_gone(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(durable=True, queue="d")
    def quick(steps: Steps) -> None:
        steps.run("one", lambda: 1)

    @jobs.task(durable=True, queue="d")
    def sleeper(steps: Steps) -> None:
        steps.run("one", lambda: 1)
        steps.sleep("long", 3600)

    done = enqueue(Session, quick)
    asleep = enqueue(Session, sleeper)
    drain(jobs, db)
    assert job_row(db, done) is None and step_rows(db, done)
    prune(db, jobs)
    assert step_rows(db, done) == {}
    assert set(step_rows(db, asleep)) == {"one", "long"}  # a live job keeps its records


def test_ten_thousand_steps(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(durable=True, queue="d", max_attempts=3)
    def many(steps: Steps) -> None:
        for i in range(10_000):
            steps.run(f"s{i}", lambda i=i: i)
        if current_job().attempts == 1:
            raise RuntimeError("again: every step comes from the store")

    job_id = enqueue(Session, many)
    drain(jobs, db, wait_scheduled=2, timeout=120)  # about 3 s unloaded
    assert job_row(db, job_id) is None
    assert count(db, app.Job) == 0


def test_the_asyncio_worker_runs_async_durable_handlers(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    calls: list[str] = []
    got: list[Any] = []

    async def charge(session: AsyncSession) -> str:
        session.add(app.Link(code="async", url="u"))
        calls.append("charge")
        return "ch_1"

    @jobs.task(durable=True, queue="d", max_attempts=3)
    async def fulfil(steps: AsyncSteps) -> None:
        got.append(await steps.run("charge", charge))
        await steps.sleep("cool-off", 3600)
        async for batch in steps.iterate(
            "links", sa.select(app.Link).order_by(app.Link.code), key=app.Link.code, size=1
        ):
            for link in batch:
                link.url = "seen"
        got.append(await steps.wait("shipped"))

    def run() -> None:
        AsyncWorkerInThread(jobs, database_url, queues=["d"], listen=False).run_until_empty(
            timeout=20
        )

    job_id = enqueue(Session, fulfil)
    run()
    assert job_row(db, job_id).status == "scheduled"
    due_now(db, job_id)
    run()
    assert step_rows(db, job_id)["shipped"].state == "waiting"
    with Session.begin() as session:
        assert jobs.signal(session, job_id, "shipped", {"t": 1}) == "woken"
    run()
    assert calls == ["charge"] and got == ["ch_1", "ch_1", "ch_1", {"t": 1}]
    assert [r.url for r in rows(db, app.Link)] == ["seen"]
    assert job_row(db, job_id) is None

    async def send() -> str:
        from sqla_jobs import create_async_engine

        engine = create_async_engine(database_url)
        try:
            async with AsyncSession(engine) as session, session.begin():
                return await jobs.signal_async(session, 10**12, "x")
        finally:
            await engine.dispose()

    with pytest.raises(SignalError, match="no such job"):
        asyncio.run(send())


def test_a_plain_durable_handler_on_the_asyncio_worker_is_told_where_it_runs(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    @jobs.task(durable=True, queue="d", max_attempts=1)
    def plain(steps: Steps) -> None:
        pass

    job_id = enqueue(Session, plain)
    AsyncWorkerInThread(jobs, database_url, queues=["d"], listen=False).run_until_empty(timeout=20)
    assert "runs on the threaded worker" in job_row(db, job_id).last_error


def test_operators_see_each_step_and_what_a_suspended_job_waits_for(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    from sqla_jobs import admin

    from .test_cli import cli

    with db.begin() as conn:
        conn.execute(sa.insert(app.Link), [{"code": f"{i}", "url": "u"} for i in range(5)])

    @jobs.task(durable=True, queue="d")
    def order(steps: Steps) -> None:
        steps.run("charge", lambda: {"id": "ch_1"})
        for _ in steps.iterate(
            "links", sa.select(app.Link).order_by(app.Link.code), key=app.Link.code, size=2
        ):
            pass
        steps.wait("shipped", timeout=3600)

    @jobs.task(queue="d")
    def plain() -> None:
        pass

    job_id = enqueue(Session, order)
    other = enqueue(Session, plain.with_options(delay=3600))
    drain(jobs, db)
    with db.connect() as conn:
        job = admin.get_job(conn, jobs, job_id)
        assert job is not None and job.steps is not None
        assert [(s.name, s.kind, s.state) for s in job.steps] == [
            ("charge", "run", "done"),
            ("links", "cursor", "done"),
            ("shipped", "wait", "waiting"),
        ]
        assert job.steps_done == 2 and job.suspended_in is job.steps[2]
        assert job.steps[1].position == {"after": "4", "rows": 5}
        assert job.steps[0].size == len('{"id":"ch_1"}') + 1  # jsonb's text adds a space
        assert [j.id for j in admin.list_jobs(conn, jobs, suspended=True)] == [job_id]
        assert [j.id for j in admin.list_jobs(conn, jobs, suspended=False)] == [other]
        assert admin.get_job(conn, jobs, other).steps is None
        assert job.to_dict()["steps"][2]["until"].endswith("+00:00")
    shown = cli("jobs", "show", "tests.app:Job", str(job_id))
    assert shown.returncode == 0, shown.stderr
    assert "suspended in  signal 'shipped' (times out" in shown.stdout
    assert "links    cursor  done: 5 rows, after '4'" in shown.stdout
    listed = cli("jobs", "list", "tests.app:Job", "--suspended")
    listed_ids = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert listed_ids == [str(job_id)]


def test_iterate_checks_its_select_and_key_before_any_batch(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    with db.begin() as conn:
        conn.execute(sa.insert(app.Link), [{"code": f"{i}", "url": f"u{i}"} for i in range(3)])
    links = app.Link.__table__
    seen: list[Any] = []

    @jobs.task(durable=True, queue="d", max_attempts=1, name="core_rows")
    def core_rows(steps: Steps) -> None:  # unordered: ordered by its key for it
        for batch in steps.iterate(
            "rows", sa.select(links.c.code, links.c.url), key=links.c.code, size=2
        ):
            seen.extend(tuple(r) for r in batch)

    @jobs.task(durable=True, queue="d", max_attempts=1, name="by_url")
    def by_url(steps: Steps) -> None:
        stmt = sa.select(app.Link).order_by(app.Link.url)
        for _ in steps.iterate("wrong order", stmt, key=app.Link.code):
            pass

    @jobs.task(durable=True, queue="d", max_attempts=1, name="uuid_key")
    def uuid_key(steps: Steps) -> None:
        uuids = sa.select(sa.func.gen_random_uuid().label("u")).subquery()
        for _batch in steps.iterate("uuids", sa.select(uuids.c.u), key=uuids.c.u):
            seen.append("a batch was handed out")  # never: the key cannot be stored

    ids = [enqueue(Session, t) for t in (core_rows, by_url, uuid_key)]
    drain(jobs, db)
    assert seen == [("0", "u0"), ("1", "u1"), ("2", "u2")]
    assert job_row(db, ids[0]) is None
    assert "must be ordered by its key (code) first" in job_row(db, ids[1]).last_error
    assert "key must be an int or a str column" in job_row(db, ids[2]).last_error

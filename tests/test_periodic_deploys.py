"""Periodic schedules across deploys, clocks and the database's moods: what a worker of
other code, an application server with another clock, a migration holding a lock, or a
hook that adds what JSON cannot hold does to a tick. Time is moved by the tests (rows'
ticks set into the past, a clock patched for one call), never waited for."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, Worker, admin, create_engine
from sqla_jobs.periodic import add_schedule, enqueue_due, sync_declared

from . import app
from .helpers import rows, running, wait_for


def make_due(db: sa.Engine, jobs: Jobs, name: str, ago: timedelta) -> None:
    table = jobs.queries.schedules_table
    with db.begin() as conn:
        n = conn.execute(
            sa.update(table)
            .where(table.c.name == name)
            .values(next_run_at=sa.func.date_trunc("minute", sa.func.now()) - ago)
        ).rowcount
    assert n == 1


def schedule(db: sa.Engine, jobs: Jobs, name: str) -> Any:
    table = jobs.queries.schedules_table
    with db.connect() as conn:
        return conn.execute(sa.select(table).where(table.c.name == name)).first()


def db_now(db: sa.Engine) -> datetime:
    with db.connect() as conn:
        return conn.execute(sa.select(sa.func.now())).scalar_one()


def passes_counter(engine: sa.Engine) -> list[int]:
    """Counts the maintenance passes' due-schedule SELECTs run on ``engine``."""
    seen = [0]

    @sa.event.listens_for(engine, "after_cursor_execute")
    def count(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        if "_schedules" in statement and "SKIP LOCKED" in statement:
            seen[0] += 1

    return seen


def test_tick_of_a_var_keyword_handler_gets_the_declared_arguments(
    db: sa.Engine, jobs: Jobs
) -> None:
    """A schedule's arguments are stored bound (``{"a": 1, "extra": {"b": 2}}`` for
    ``def f(a, **extra)``); they were bound *again* at each tick, so the tick's job held
    ``{"extra": {"extra": {"b": 2}}}`` and the handler got ``extra={"b": 2}``. A tick's
    job is now the job of a direct enqueue of the same call."""
    got: list[tuple[int, dict[str, Any]]] = []

    @jobs.periodic("0 0 1 1 *", name="kw", args={"a": 1, "b": 2})
    @jobs.task(queue="q", name="kw_task")
    def kw_task(a: int, **extra: Any) -> None:
        got.append((a, dict(extra)))

    with db.begin() as conn:
        sync_declared(conn, jobs)
        jobs.enqueue(conn, kw_task, a=1, b=2)  # what the schedule declares, enqueued directly
    make_due(db, jobs, "kw", timedelta(0))
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
    direct, tick = rows(db)
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty()
    assert got == [(1, {"b": 2}), (1, {"b": 2})]  # the direct job's run, then the tick's
    assert tick.args == direct.args


def test_run_now_of_a_var_keyword_schedule_gets_the_declared_arguments(
    db: sa.Engine, jobs: Jobs
) -> None:
    """The same double binding in ``admin.run_schedule`` (the dashboard's "Run now")."""

    @jobs.periodic("0 0 1 1 *", name="kw", args={"a": 1, "b": 2})
    @jobs.task(queue="q", name="kw_task")
    def kw_task(a: int, **extra: Any) -> None: ...

    with db.begin() as conn:
        sync_declared(conn, jobs)
        jobs.enqueue(conn, kw_task, a=1, b=2)
        admin.run_schedule(conn, jobs, "kw")
    direct, ran = rows(db)
    assert ran.args == direct.args


class _Skewed(datetime):
    """``datetime`` whose ``now()`` is off by ``offset`` (this process's clock only)."""

    offset = timedelta(0)

    @classmethod
    def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + cls.offset


@pytest.mark.parametrize("skew", ["behind", "ahead"])
def test_add_schedule_uses_the_database_clock(
    db: sa.Engine, jobs: Jobs, monkeypatch: pytest.MonkeyPatch, skew: str
) -> None:
    """``add_schedule`` computed ``next_run_at`` from the caller's Python clock, where the
    sync and the ticks use the database's ``now()``: an app server two hours behind
    stored a daily tick already past (it fired at once, 23 hours early); one two hours
    ahead skipped the day's tick due in an hour. It reads the database's clock."""

    @jobs.task(queue="q")
    def report() -> None: ...

    now = db_now(db)
    if skew == "behind":
        at = now - timedelta(hours=1)  # today's tick passed an hour ago: next is tomorrow
        _Skewed.offset = timedelta(hours=-2)
    else:
        at = now + timedelta(hours=1)  # today's tick comes in an hour
        _Skewed.offset = timedelta(hours=2)
    cron = f"{at.minute} {at.hour} * * *"
    monkeypatch.setattr("sqla_jobs.periodic.datetime", _Skewed)
    with db.begin() as conn:
        add_schedule(conn, jobs, "daily", report, cron)
    monkeypatch.undo()
    stored = schedule(db, jobs, "daily").next_run_at
    with db.begin() as conn:
        fired = enqueue_due(conn, jobs)
    assert fired == 0, f"a daily tick fired at once; next_run_at was {stored}"
    next_real = at.replace(second=0, microsecond=0)
    if next_real <= now:
        next_real += timedelta(days=1)
    assert stored == next_real, stored


@pytest.mark.parametrize("old_kind", ["task unknown", "task with the old signature"])
def test_a_worker_of_the_previous_deploy_does_not_lose_a_tick(db: sa.Engine, old_kind: str) -> None:
    """A rolling deploy: the new code declares a schedule; a worker of the old code (it
    does not know the task, or knows it with the old signature) still runs its passes.
    When its pass locked the due row first, it marked the tick failed and moved it on:
    the tick was never enqueued, though the new workers could have. It now leaves the
    tick due for them."""
    new = Jobs(app.Job)
    old = Jobs(app.Job)

    @new.periodic("0 3 * * *", name="nightly", args={"region": "eu"})
    @new.task(queue="q", name="nightly_task")
    def nightly(region: str) -> None: ...

    if old_kind == "task with the old signature":

        @old.task(queue="q", name="nightly_task")
        def nightly_old() -> None: ...

    else:

        @old.task(queue="q", name="something_else")
        def other() -> None: ...

    with db.begin() as conn:
        sync_declared(conn, new)  # the first new worker started
    make_due(db, new, "nightly", timedelta(0))
    with db.begin() as conn:
        enqueue_due(conn, old)  # an old worker's pass comes first
    with db.begin() as conn:
        enqueue_due(conn, new)  # then a new worker's
    assert len(rows(db)) == 1, schedule(db, new, "nightly").last_error


def test_a_transient_lock_timeout_does_not_skip_the_tick(db: sa.Engine, database_url: str) -> None:
    """A worker whose engine has a ``lock_timeout`` (a common production setting) meets
    a migration holding a lock on the jobs table when a tick is due. The tick's INSERT
    timed out (55P03), which was taken for a trigger's refusal: the schedule moved to
    its next tick (tomorrow), and today's was lost for good. It stays due, and is
    enqueued once the lock is gone."""
    jobs = Jobs(app.Job)
    ran: list[str] = []

    @jobs.periodic("0 3 * * *", name="nightly")
    @jobs.task(queue="q", name="nightly_task")
    def nightly() -> None:
        ran.append("nightly")

    @jobs.task(queue="q", name="plain")
    def plain() -> None:
        ran.append("plain")

    with db.begin() as conn:
        sync_declared(conn, jobs)
    make_due(db, jobs, "nightly", timedelta(0))
    engine = create_engine(database_url, connect_args={"options": "-c lock_timeout=200"})
    holder = create_engine(database_url)
    passes = passes_counter(engine)
    table = app.Job.__table__
    held = holder.connect()
    try:
        migration = held.begin()  # a migration holds the jobs table when the tick comes
        held.execute(sa.text(f'LOCK TABLE "{table.schema}"."{table.name}" IN SHARE MODE'))
        worker = Worker(jobs, engine, queues=["q"], poll_interval=0.05, listen=False)
        with running(worker):
            wait_for(lambda: schedule(db, jobs, "nightly").last_error, timeout=10)
            assert "LockNotAvailable" in schedule(db, jobs, "nightly").last_error
            migration.commit()
            # The lock is gone: the next passes should enqueue the tick.
            with db.begin() as conn:
                jobs.enqueue(conn, plain)
            seen = passes[0]
            wait_for(lambda: passes[0] >= seen + 3 and "plain" in ran, timeout=10)
            wait_for(lambda: "nightly" in ran, timeout=3)
    finally:
        held.close()
        engine.dispose()
        holder.dispose()


def test_a_code_schedule_does_not_silently_replace_a_runtime_one(db: sa.Engine) -> None:
    """``add_schedule(name="digest")`` (a user's run-time schedule) and a later deploy that
    declares ``@jobs.periodic(name="digest")``: the workers' sync overwrote the run-time
    row (its task, expression and arguments) without a word, and the deploy after that,
    which dropped the declaration, deleted it. Each kind keeps to its own names."""
    first = Jobs(app.Job)

    @first.task(queue="q", name="digest_task")
    def digest(user_id: int = 0) -> None: ...

    with db.begin() as conn:
        add_schedule(conn, first, "digest", digest, "0 8 * * mon", args={"user_id": 42})
    later = Jobs(app.Job)

    @later.periodic("*/5 * * * *", name="digest")
    @later.task(queue="q", name="digest_task")
    def digest2(user_id: int = 0) -> None: ...

    with db.begin() as conn:
        sync_declared(conn, later)
    row = schedule(db, first, "digest")
    assert (row.origin, row.cron, row.args) == ("runtime", "0 8 * * mon", {"user_id": 42})
    # Nor does a run-time schedule take over a code one.
    with db.begin() as conn:
        conn.execute(sa.delete(first.queries.schedules_table))
        sync_declared(conn, later)
    with pytest.raises(ValueError, match="'digest' is declared in code"), db.begin() as conn:
        add_schedule(conn, first, "digest", digest, "0 8 * * mon", args={"user_id": 42})
    assert schedule(db, first, "digest").origin == "code"


def test_a_tick_whose_job_cannot_be_written_fails_only_that_tick(db: sa.Engine, jobs: Jobs) -> None:
    """An enqueue hook that adds a value JSON cannot hold to one task's meta: the tick's
    INSERT raised TypeError, which was not caught (only database errors were), so every
    maintenance pass failed and the fetch loop stopped the worker, on every worker of
    the table (a plain delayed job never ran). That tick fails alone."""
    ran: list[str] = []

    def hook(task: str, queue: str, meta: dict[str, Any]) -> None:
        if task == "nightly_task":
            meta["at"] = datetime.now(timezone.utc)

    jobs.events.add_enqueue_hook(hook)

    @jobs.periodic("0 3 * * *", name="nightly")
    @jobs.task(queue="q", name="nightly_task")
    def nightly() -> None: ...

    @jobs.task(queue="q", name="plain")
    def plain() -> None:
        ran.append("plain")

    with db.begin() as conn:
        sync_declared(conn, jobs)
        jobs.enqueue(conn, plain.with_options(delay=0.2))  # needs a promotion
    make_due(db, jobs, "nightly", timedelta(0))
    worker = Worker(jobs, db, queues=["q"], poll_interval=0.05, listen=False)
    with running(worker):
        wait_for(lambda: ran == ["plain"], timeout=5)

"""Periodic jobs: cron schedules declared in code or added at run time, each tick
enqueued once. Time is moved by the tests (rows' timestamps set into the past), never
waited for."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import (
    EnqueueError,
    Jobs,
    Worker,
    create_engine,
)
from sqla_jobs.periodic import add_schedule, enqueue_due, remove_schedule, sync_declared

from . import app
from .helpers import rows, running, wait_for


def make_due(db: sa.Engine, jobs: Jobs, name: str, ago: timedelta) -> None:
    """Move a schedule's next tick into the past: the test's clock, not a wait."""
    table = jobs.queries.schedules_table
    with db.begin() as conn:
        conn.execute(
            sa.update(table)
            .where(table.c.name == name)
            .values(next_run_at=sa.func.date_trunc("minute", sa.func.now()) - ago)
        )


def test_periodic_task_is_declared_checked_and_enqueued_once_per_tick(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    with pytest.raises(ValueError, match="invalid cron expression"):
        jobs.periodic("61 * * * *")
    with pytest.raises(ValueError, match="invalid cron expression"):
        jobs.periodic("every minute")

    @jobs.periodic("* * * * *", args={"kind": "minutely"})
    @jobs.task(queue="q")
    def tick(kind: str) -> None:
        pass

    with pytest.raises(EnqueueError, match="missing a required argument"):

        @jobs.periodic("* * * * *", name="bad-args")
        @jobs.task(queue="q", name="needs_args")
        def needs_args(x: int) -> None:
            pass

    with db.begin() as conn:
        sync_declared(conn, jobs)
    (schedule,) = rows(db, jobs.queries.schedules_table)
    assert schedule.next_run_at > datetime.now(timezone.utc)
    make_due(db, jobs, tick.name, timedelta(0))

    # Eight workers' maintenance passes race for the same due tick.
    engines = [create_engine(database_url) for _ in range(8)]
    barrier = threading.Barrier(8)
    made: list[int] = []

    def race(engine: sa.Engine) -> None:
        with engine.begin() as conn:
            barrier.wait()
            made.append(enqueue_due(conn, jobs))

    threads = [threading.Thread(target=race, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for e in engines:
        e.dispose()
    assert sorted(made) == [0] * 7 + [1]
    (job,) = rows(db)
    assert (job.task, job.args, job.queue) == (tick.name, {"kind": "minutely"}, "q")
    assert job.unique_key.startswith(f"periodic:{tick.name}:")


def test_a_tick_s_job_is_announced_at_commit(db: sa.Engine, jobs: Jobs) -> None:
    """The ``enqueued`` listeners (the metrics' counter among them) hear of a tick's job
    when the maintenance pass commits, as of any job, and of none when it rolls back
    (they heard of no tick's job at all)."""
    heard: list[str] = []
    jobs.events.connect("enqueued", lambda event: heard.append(event.job["task"]))

    @jobs.periodic("* * * * *")
    @jobs.task(queue="q")
    def tick() -> None:
        pass

    with db.begin() as conn:
        sync_declared(conn, jobs)
    make_due(db, jobs, tick.name, timedelta(0))
    with db.connect() as conn, conn.begin() as transaction:
        assert enqueue_due(conn, jobs) == 1
        transaction.rollback()
    assert heard == []
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
        assert heard == []  # not before the commit
    assert heard == [tick.name]


def test_a_schedule_run_now_is_announced_at_commit(db: sa.Engine, jobs: Jobs) -> None:
    """The dashboard's "Run now" (``admin.run_schedule``) enqueued a job the ``enqueued``
    listeners (the metrics' counter) never heard of; they hear of it at commit, on a
    connection as in a session, and of none rolled back."""
    from sqla_jobs import admin

    heard: list[str] = []
    jobs.events.connect("enqueued", lambda event: heard.append(event.job["task"]))

    @jobs.periodic("0 0 1 1 *")
    @jobs.task(queue="q")
    def yearly() -> None:
        pass

    with db.begin() as conn:
        sync_declared(conn, jobs)
    with db.connect() as conn, conn.begin() as transaction:
        admin.run_schedule(conn, jobs, yearly.name)
        transaction.rollback()
    assert heard == []
    with db.begin() as conn:
        admin.run_schedule(conn, jobs, yearly.name)
        assert heard == []  # not before the commit
    assert heard == [yearly.name]
    with sa.orm.Session(db) as session, session.begin():
        admin.run_schedule(session, jobs, yearly.name)
        assert heard == [yearly.name]
    assert heard == [yearly.name] * 2


def test_missed_ticks_fire_once_for_the_latest(db: sa.Engine, jobs: Jobs) -> None:
    @jobs.periodic("* * * * *")
    @jobs.task(queue="q")
    def tick() -> None:
        pass

    with db.begin() as conn:
        sync_declared(conn, jobs)
    make_due(db, jobs, tick.name, timedelta(minutes=30))  # no worker for half an hour
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
        assert enqueue_due(conn, jobs) == 0
    (job,) = rows(db)
    (schedule,) = rows(db, jobs.queries.schedules_table)
    now = datetime.now(timezone.utc)
    assert now - timedelta(minutes=1) <= schedule.last_run_at <= now
    assert job.unique_key == f"periodic:{tick.name}:{schedule.last_run_at.isoformat()}"
    assert schedule.next_run_at > now


def test_changing_a_declared_schedule_in_code_is_picked_up(db: sa.Engine) -> None:
    first = Jobs(app.Job)
    second = Jobs(app.Job)
    for registry, cron in ((first, "0 * * * *"), (second, "30 * * * *")):

        @registry.periodic(cron, name="hourly")
        @registry.task(queue="q", name="hourly_task")
        def hourly() -> None:
            pass

    with db.begin() as conn:
        sync_declared(conn, first)
        sync_declared(conn, second)
    (row,) = rows(db, first.queries.schedules_table)
    assert (row.cron, row.next_run_at.minute, row.origin) == ("30 * * * *", 30, "code")
    with db.begin() as conn:
        sync_declared(conn, Jobs(app.Job))  # the code no longer declares it
    assert rows(db, first.queries.schedules_table) == []


def test_runtime_schedules_are_checked_and_picked_up_without_restart(
    db: sa.Engine, jobs: Jobs
) -> None:
    ran: list[int] = []

    @jobs.task(queue="q")
    def report(user_id: int) -> None:
        ran.append(user_id)

    with db.begin() as conn:
        with pytest.raises(ValueError, match="invalid cron"):
            add_schedule(conn, jobs, "r1", report, "0 25 * * *", args={"user_id": 1})
        with pytest.raises(EnqueueError, match="unknown task"):
            add_schedule(conn, jobs, "r1", "no_such_task", "0 8 * * *")
        with pytest.raises(EnqueueError, match="missing a required argument"):
            add_schedule(conn, jobs, "r1", report, "0 8 * * *")
    assert rows(db, jobs.queries.schedules_table) == []

    worker = Worker(jobs, db, queues=["q"], poll_interval=0.05, listen=False)
    with running(worker):
        with db.begin() as conn:
            add_schedule(conn, jobs, "report:42", report, "0 8 * * mon", args={"user_id": 42})
        make_due(db, jobs, "report:42", timedelta(0))
        wait_for(lambda: ran == [42])
        # Changed at run time: a new expression and arguments.
        with db.begin() as conn:
            add_schedule(conn, jobs, "report:42", report, "*/5 * * * *", args={"user_id": 43})
        make_due(db, jobs, "report:42", timedelta(0))
        wait_for(lambda: ran == [42, 43])
        with db.begin() as conn:
            assert remove_schedule(conn, jobs, "report:42")
            assert not remove_schedule(conn, jobs, "report:42")
    assert ran == [42, 43]
    assert rows(db, jobs.queries.schedules_table) == []


def test_schedules_in_a_time_zone_are_stored_and_tick_in_it(db: sa.Engine) -> None:
    jobs = Jobs(app.Job)

    @jobs.periodic("0 9 * * *", tz="Europe/Paris")
    @jobs.task(queue="q", name="morning")
    def morning() -> None:
        pass

    with pytest.raises(ValueError, match="unknown time zone"):
        jobs.periodic("0 9 * * *", tz="Mars/Olympus")
    with db.begin() as conn:
        sync_declared(conn, jobs)
        add_schedule(conn, jobs, "evening", morning, "0 18 * * *", tz="America/New_York")
        with pytest.raises(ValueError, match="unknown time zone"):
            add_schedule(conn, jobs, "nope", morning, "0 18 * * *", tz="Nowhere/Else")
    code, runtime = sorted(
        rows(db, jobs.queries.schedules_table), key=lambda r: r.name != "morning"
    )
    assert (code.tz, code.origin, runtime.tz) == ("Europe/Paris", "code", "America/New_York")
    from zoneinfo import ZoneInfo

    assert code.next_run_at.astimezone(ZoneInfo("Europe/Paris")).hour == 9
    assert runtime.next_run_at.astimezone(ZoneInfo("America/New_York")).hour == 18

    # A tick enqueues the job and moves on to the next 9:00 in Paris.
    make_due(db, jobs, "morning", timedelta(0))
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
    (code,) = [r for r in rows(db, jobs.queries.schedules_table) if r.name == "morning"]
    assert code.next_run_at.astimezone(ZoneInfo("Europe/Paris")).hour == 9

    # Changing the declared zone in code moves the schedule to the new zone's next tick.
    again = Jobs(app.Job)

    @again.periodic("0 9 * * *", tz="Asia/Tokyo", name="morning")
    @again.task(queue="q", name="morning")
    def morning_tokyo() -> None:
        pass

    with db.begin() as conn:
        sync_declared(conn, again)
    (code,) = [r for r in rows(db, again.queries.schedules_table) if r.name == "morning"]
    assert code.tz == "Asia/Tokyo"
    assert code.next_run_at.astimezone(ZoneInfo("Asia/Tokyo")).hour == 9


# -- rows and outages a pass must get through (found by an audit) -----------------------------

#: Schedule rows written around the API with values Python cannot read, each of which
#: raised for the whole maintenance pass (which also promotes retries and rescues leases):
#: every worker of the table stopped claiming, or stopped for good.
_POISON = {
    "a tick of -infinity": {"next_run_at": "'-infinity'"},
    "args nested 10,000 deep": {
        "args": """('{"x": ' || repeat('[', 10000) || repeat(']', 10000) || '}')::jsonb""",
        "next_run_at": "now() - interval '1 min'",
    },
    "a 5,000-digit number": {
        "args": """('{"x": ' || repeat('9', 5000) || '}')::jsonb""",
        "next_run_at": "now() - interval '1 min'",
    },
}


@pytest.mark.parametrize("poison", list(_POISON))
def test_a_schedule_row_python_cannot_read_is_failed_alone(
    db: sa.Engine, jobs: Jobs, poison: str
) -> None:
    ran: list[str] = []

    @jobs.task(queue="q")
    def work(x: object = None) -> None:
        ran.append("tick" if x is None else "plain")

    table = jobs.queries.schedules_table
    columns = {"name": "'poison'", "task": f"'{work.name}'", "cron": "'* * * * *'"}
    columns.update(_POISON[poison])
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"INSERT INTO {table.schema}.{table.name} ({', '.join(columns)}) "
                f"VALUES ({', '.join(columns.values())})"
            )
        )
        add_schedule(conn, jobs, "good", work, "* * * * *")
        jobs.enqueue(conn, work, x=1)
    make_due(db, jobs, "good", timedelta(minutes=1))
    worker = Worker(jobs, db, queues=["q"], poll_interval=0.05, listen=False)
    with running(worker):
        wait_for(lambda: sorted(ran) == ["plain", "tick"])
    with db.connect() as conn:
        error = conn.execute(
            sa.select(table.c.last_error).where(table.c.name == "poison")
        ).scalar_one()
    assert error  # the row says why it did not run, and the others ran


def test_a_schedule_down_for_days_fires_once_for_its_latest_tick(db: sa.Engine, jobs: Jobs) -> None:
    """The latest missed tick was found by stepping forward from the due one, at most
    10,000 steps: a minutely schedule down for eight days fired for a tick a day old (and
    each such schedule cost 1.4 s of CPU inside the maintenance pass)."""

    @jobs.task(queue="q")
    def every_minute() -> None: ...

    with db.begin() as conn:
        add_schedule(conn, jobs, "m", every_minute, "* * * * *")
    make_due(db, jobs, "m", timedelta(days=8))
    with db.begin() as conn:
        assert enqueue_due(conn, jobs) == 1
    table = jobs.queries.schedules_table
    with db.connect() as conn:
        latest = conn.execute(
            sa.select(table.c.last_run_at).where(table.c.name == "m")
        ).scalar_one()
    now = datetime.now(timezone.utc)
    assert now - timedelta(minutes=1) <= latest <= now
    (job,) = rows(db)
    assert job.unique_key == f"periodic:m:{latest.isoformat()}"


def _plain_and_yearly(db: sa.Engine, jobs: Jobs) -> list[str]:
    """A declared yearly schedule (its row synced) and a plain job waiting to run."""
    ran: list[str] = []

    @jobs.periodic("0 0 1 1 *", name="yearly")
    @jobs.task(queue="q", name="yearly_task")
    def yearly() -> None: ...

    @jobs.task(queue="q", name="plain")
    def plain() -> None:
        ran.append("plain")

    with db.begin() as conn:
        sync_declared(conn, jobs)
        jobs.enqueue(conn, plain)
    return ran


def test_a_starting_worker_claims_beside_a_schedule_row_another_worker_holds(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A worker paused in its pass holds the rows of the schedules it took. A worker
    starting then (a deploy) synced the declared schedules before anything else, its
    upsert waiting on that lock without end: it claimed nothing while the other was
    paused. The sync now waits a second at most and is tried again at the next pass."""
    ran = _plain_and_yearly(db, jobs)
    table = jobs.queries.schedules_table
    holder = create_engine(database_url)
    try:
        with holder.begin() as held:
            held.execute(
                sa.select(table).where(table.c.name == "yearly").with_for_update(key_share=True)
            ).all()
            worker = Worker(jobs, db, queues=["q"], poll_interval=0.05, listen=False)
            with running(worker):
                wait_for(lambda: ran == ["plain"])  # while the row is still held
    finally:
        holder.dispose()


def test_a_worker_waits_out_a_database_error_in_its_schedule_sync(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """The sync ran at start, outside the worker's supervision: its backend terminated (a
    failover) ended ``Worker.run`` with the error, where every other database error is
    waited out."""
    from .helpers import terminate_backend

    ran = _plain_and_yearly(db, jobs)
    engine = create_engine(database_url)
    cut: list[int] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def cut_the_sync(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        if not cut and "_schedules" in statement and statement.lstrip().startswith("INSERT"):
            cut.append(conn.connection.driver_connection.info.backend_pid)
            terminate_backend(db, cut[0])

    errors: list[BaseException] = []
    worker = Worker(jobs, engine, queues=["q"], poll_interval=0.05, listen=False)

    def run() -> None:
        try:
            worker.run(install_signal_handlers=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: ran == ["plain"] or errors)
    finally:
        worker.stop()
        thread.join(15)
        engine.dispose()
    assert cut and errors == [] and ran == ["plain"]

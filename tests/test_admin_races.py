"""Operator actions racing the workers, and the rows they read: the order in which an
action locks its jobs, the transactions the dashboard and ``sqla-jobs`` open for an action
(run again when the database undoes one, at ``READ COMMITTED`` whatever the default), the
answer a page gives for an error the database answered, and rows that hold what Python
cannot (times at ``infinity``, the largest ``attempts``). Real PostgreSQL throughout."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("starlette")
from starlette.testclient import TestClient

from sqla_jobs import Jobs, admin, create_engine
from sqla_jobs.model import job_table
from sqla_jobs.web import app as web_app
from sqla_jobs.web import create_app

from . import app
from .helpers import wait_for
from .test_cli import JOBS, cli

TABLE = job_table(app.Job)
S = app.SCHEMA
BASE = "http://localhost"


def _client(jobs: Any, engine: sa.Engine) -> TestClient:
    c = TestClient(
        create_app(jobs, engine, read_only=False),
        base_url=BASE,
        follow_redirects=False,
        raise_server_exceptions=False,
    )
    assert c.get("/").status_code == 200
    return c


def _post(c: TestClient, url: str, **form: Any) -> Any:
    return c.post(url, data={"csrf_token": c.cookies.get("sqla_jobs_csrf"), **form})


def _text(r: Any) -> str:
    return re.sub(r"\s+", " ", r.text)


def _insert(db: sa.Engine, values: str) -> int:
    """One job row written by SQL: ``values`` after ``(task, queue, args, ...)``."""
    columns, _, rest = values.partition(" VALUES ")
    with db.begin() as conn:
        return int(
            conn.exec_driver_sql(
                f'INSERT INTO "{S}".jobs {columns} VALUES {rest} RETURNING id'
            ).scalar_one()
        )


def _running(db: sa.Engine) -> int:
    return _insert(
        db,
        "(task, queue, args, status, attempts, max_attempts, locked_until, locked_by) "
        "VALUES ('t.work', 'a', '{}', 'running', 1, 3, now() + interval '1 hour', 'w')",
    )


def _status(db: sa.Engine, job_id: int) -> Any:
    with db.connect() as conn:
        c = TABLE.c
        return conn.execute(sa.select(c.attempts, c.status).where(c.id == job_id)).first()


def _waits_for_a_lock(db: sa.Engine, like: str) -> bool:
    """Some other session of this database waits for a lock, in a statement like ``like``."""
    with db.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' "
                    "AND query LIKE :like"
                ),
                {"like": like},
            ).scalar_one()
        )


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def _reruns(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "sqla_jobs.admin" and "running it again" in r.getMessage()
    ]


# -- the order of an action's locks, and a deadlock with a worker's write --------------------


def test_act_locks_its_rows_in_id_order(db: sa.Engine, jobs: Jobs) -> None:
    """``admin.act`` locks the jobs it was given in id order, the order each worker
    statement that locks a batch takes them in, whatever the plan reads them in: here a
    sequential scan meets job 2 first (job 1 was rewritten after it). Waiting for job 1,
    it must not hold job 2 yet."""
    first, second = _running(db), _running(db)
    with db.begin() as conn:  # job 1's row now lies after job 2's in the table
        conn.execute(sa.update(TABLE).where(TABLE.c.id == first).values(locked_by="w2"))
    seen = [admin.SeenJob(i, 1, "running") for i in (first, second)]
    with db.connect() as holder:
        holder.begin()
        holder.execute(sa.select(TABLE.c.id).where(TABLE.c.id == first).with_for_update())

        def action() -> admin.ActionReport:
            with db.begin() as conn:
                conn.exec_driver_sql("SET LOCAL enable_indexscan = off")
                conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")
                return admin.act(conn, jobs, "cancel", seen)

        t, out = _in_thread(action)
        try:
            wait_for(lambda: _waits_for_a_lock(db, "%FOR NO KEY UPDATE%"), 10)
            with db.connect() as probe:
                probe.exec_driver_sql("SET lock_timeout = '100ms'")
                free = probe.execute(
                    sa.select(TABLE.c.id).where(TABLE.c.id == second).with_for_update(nowait=True)
                ).all()
                probe.rollback()
            assert free == [(second,)]
        finally:
            holder.rollback()
            t.join(10)
    assert out and set(out[0].acted) == {first, second}


def test_a_dashboard_action_undone_by_a_deadlock_is_run_again(
    db: sa.Engine, jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's outcome write holds job 2 and then wants job 1, which the operator's
    Cancel of jobs 1 and 2 holds while it waits for job 2: PostgreSQL undoes the action
    (it waited first, so its deadlock check runs first). The dashboard answered 503 "The
    database cannot be reached: DeadlockDetected"; it now runs the action again, which
    finds both jobs changed by the worker's write and says so."""
    caplog.set_level(logging.INFO, logger="sqla_jobs.admin")
    first, second = _running(db), _running(db)
    c = _client(jobs, db)
    form = {"action": "cancel", "job": [f"{first}:1:running", f"{second}:1:running"]}
    with db.connect() as worker:
        worker.begin()
        # The worker never checks first: the dashboard's session is the one undone.
        worker.exec_driver_sql("SET LOCAL deadlock_timeout = '60s'")
        fail = sa.update(TABLE).values(attempts=TABLE.c.attempts + 1, status="ready")
        worker.execute(fail.where(TABLE.c.id == second))
        t, out = _in_thread(lambda: _post(c, "/jobs/act", **form))
        try:
            wait_for(lambda: _waits_for_a_lock(db, "%FOR NO KEY UPDATE%"), 10)
            worker.execute(fail.where(TABLE.c.id == first))  # waits until it is undone
            worker.commit()
        finally:
            worker.rollback()
            t.join(20)
    r = out[0]
    assert r.status_code == 200, _text(r)[-400:]
    assert "Cancelled 0 jobs" in _text(r) and "2 jobs left alone" in _text(r)
    assert _status(db, first).status == _status(db, second).status == "ready"
    assert _reruns(caplog), "the action was never undone: the test did not race"


@pytest.mark.parametrize(
    ("sqlstate", "code", "heading"),
    [
        ("40P01", 503, "Database busy"),  # a deadlock, at every try
        ("40001", 503, "Database busy"),  # a serialization failure
        ("55006", 500, "Database error"),  # OperationalError too, answered by the server
    ],
)
def test_an_error_the_database_answered_is_never_called_unreachable(
    db: sa.Engine,
    jobs: Jobs,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    sqlstate: str,
    code: int,
    heading: str,
) -> None:
    """Every non-timeout ``OperationalError`` was "Database unavailable: The database
    cannot be reached". Here PostgreSQL itself raises the error in the action's
    transaction (``RAISE ... USING ERRCODE``), at every try: a conflict is run again a few
    times, then "Database busy, try again"; another answered error is a database error."""
    caplog.set_level(logging.INFO, logger="sqla_jobs.admin")
    tries: list[int] = []

    def act(conn: sa.Connection, *args: Any) -> Any:
        tries.append(1)
        conn.exec_driver_sql(
            f"DO $$ BEGIN RAISE EXCEPTION 'raised here' USING ERRCODE = '{sqlstate}'; END $$"
        )

    job_id = _running(db)
    c = _client(jobs, db)
    monkeypatch.setattr(web_app.admin, "act", act)
    r = _post(c, f"/jobs/{job_id}/cancel", attempts=1, status="running")
    text = _text(r)
    assert (r.status_code, heading in text) == (code, True), text[-400:]
    assert "cannot be reached" not in text and "unavailable" not in text
    conflict = sqlstate != "55006"
    assert len(tries) == (admin.ACTION_TRIES if conflict else 1)
    assert len(_reruns(caplog)) == (admin.ACTION_TRIES - 1 if conflict else 0)


# -- snapshot isolation: an action waiting for a running transactional job's row ----------


@pytest.fixture
def repeatable_read(database_url: str, db: sa.Engine) -> Iterator[str]:
    """Every new session of this test's database starts at ``REPEATABLE READ``."""
    name = sa.make_url(database_url).database
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        )
    try:
        yield database_url
    finally:
        with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" RESET default_transaction_isolation')


def _run_commits_while_waited_for(db: sa.Engine, job_id: int, act: Any, like: str) -> Any:
    """What ``act`` answers when it waits for the job's row, held by its run (a
    transactional job's run locks it under snapshot isolation), and the run then commits:
    the job succeeded, and its row is deleted."""
    with db.connect() as run:
        run.begin()
        run.execute(sa.select(TABLE.c.id).where(TABLE.c.id == job_id).with_for_update())
        t, out = _in_thread(act)
        try:
            wait_for(lambda: _waits_for_a_lock(db, like), 20)
            run.execute(sa.delete(TABLE).where(TABLE.c.id == job_id))
            run.commit()
        finally:
            run.rollback()
            t.join(60)
    return out[0]


@pytest.mark.parametrize("where", ["database", "engine"])
def test_a_dashboard_cancel_under_repeatable_read_reports_the_job_the_run_left(
    db: sa.Engine,
    jobs: Jobs,
    repeatable_read: str,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """Under ``REPEATABLE READ`` (the database's default, or the engine's), Cancel on a
    running transactional job waits for its run, then failed "could not serialize
    access" once the run committed. The action's transaction now runs at ``READ
    COMMITTED``: it reads the job as the run left it (gone), at its first try."""
    caplog.set_level(logging.INFO, logger="sqla_jobs.admin")
    options = {"isolation_level": "REPEATABLE READ"} if where == "engine" else {}
    engine = create_engine(repeatable_read, **options)
    try:
        with engine.connect() as conn:
            level = conn.exec_driver_sql("SHOW transaction_isolation").scalar_one()
        assert level == "repeatable read"
        job_id = _running(db)
        c = _client(jobs, engine)
        r = _run_commits_while_waited_for(
            db,
            job_id,
            lambda: _post(c, f"/jobs/{job_id}/cancel", attempts=1, status="running"),
            "%FOR NO KEY UPDATE%",
        )
    finally:
        engine.dispose()
    assert r.status_code == 303, _text(r)[-400:]
    assert "done=cancel" not in r.headers["location"]
    assert not _reruns(caplog), "the action failed at its first try"


def test_a_cli_cancel_under_repeatable_read_reports_the_job_the_run_left(
    db: sa.Engine, repeatable_read: str
) -> None:
    """``sqla-jobs jobs cancel ID`` opens its own transaction: under a database default of
    ``REPEATABLE READ`` it said "database error: could not serialize access" for a
    running job whose run committed while it waited; it now says the job was not
    cancelled, since it no longer matched."""
    job_id = _running(db)
    done = _run_commits_while_waited_for(
        db,
        job_id,
        lambda: cli("jobs", "cancel", JOBS, str(job_id), "--yes"),
        "%FOR NO KEY UPDATE%",
    )
    assert "serialize" not in done.stderr and "database error" not in done.stderr, done.stderr
    assert done.stdout == "cancelled 0 jobs\n", (done.stdout, done.stderr)
    assert f"skipping job {job_id}" in done.stderr


# -- what a list says ---------------------------------------------------------------------


def test_a_cancelled_job_with_an_open_wait_is_not_suspended(db: sa.Engine, jobs: Jobs) -> None:
    """A step's row keeps its ``waiting`` state when an operator cancels the job around
    it: the "Suspended in a step" filter listed the cancelled job."""
    job_id = _insert(
        db, "(task, queue, args, status, attempts) VALUES ('t.order', 'd', '{}', 'scheduled', 1)"
    )
    with db.begin() as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{S}".jobs_steps (job_id, name, kind, state, attempt) '
            f"VALUES ({job_id}, 'shipped', 'wait', 'waiting', 1)"
        )

    def listed(suspended: bool) -> list[int]:
        with db.connect() as conn:
            return [j.id for j in admin.list_jobs(conn, jobs, suspended=suspended)]

    assert (listed(True), listed(False)) == ([job_id], [])
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, [job_id]) == 1
    assert (listed(True), listed(False)) == ([], [job_id])


def test_running_a_schedule_of_an_unknown_task_says_so(db: sa.Engine, jobs: Jobs) -> None:
    """ "Run now" on a schedule of a task this registry does not know answered 404 "No
    such schedule" (an unknown task is a ``LookupError`` too), its text cut; a schedule
    that is not there is still a 404, its name whole."""
    with db.begin() as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{S}".jobs_schedules (name, task, cron) '
            "VALUES ('nightly', 'nope.task', '0 3 * * *')"
        )
    c = _client(jobs, db)
    r = _post(c, "/schedules/run", name="nightly")
    assert (r.status_code, "Cannot run it" in _text(r)) == (400, True), _text(r)[-300:]
    assert "nope.task'" in _text(r) or "nope.task&#39;" in _text(r)
    r = _post(c, "/schedules/run", name="absent")
    assert r.status_code == 404 and "no schedule named &#39;absent&#39;" in _text(r)
    with db.begin() as conn, pytest.raises(admin.NoSuchSchedule):
        admin.run_schedule(conn, jobs, "absent")


# -- times and numbers Python cannot hold -------------------------------------------------


@pytest.mark.parametrize("when", ["infinity", "-infinity"])
def test_a_worker_row_with_an_unreadable_time_is_listed(
    db: sa.Engine, jobs: Jobs, when: str
) -> None:
    """A presence row whose times Python cannot hold made the overview and the workers
    page a 500 for as long as it was kept: its times now read as missing."""
    with db.begin() as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{S}".jobs_workers (name, host, pid, kind, queues, concurrency, '
            "running, processed, started_at, last_seen, expires_at) VALUES ('w1', 'h', 1, "
            f"'threads', '{{a}}', 1, 0, 0, '{when}', '{when}', '{when}')"
        )
    with db.connect() as conn:
        (w,) = admin.list_workers(conn, jobs)
    assert (w.started_at, w.last_seen, w.expires_at) == (None, None, None)
    assert w.alive == (when == "infinity")
    c = TestClient(create_app(jobs, db, read_only=True), base_url=BASE)
    assert c.get("/").status_code == 200
    assert c.get("/workers").status_code == 200


@pytest.mark.parametrize("when", ["infinity", "-infinity"])
def test_a_step_row_with_an_unreadable_time_leaves_the_job_page_readable(
    db: sa.Engine, jobs: Jobs, when: str
) -> None:
    job_id = _insert(db, "(task, queue, args, status) VALUES ('t', 'a', '{}', 'scheduled')")
    with db.begin() as conn:
        conn.exec_driver_sql(
            f'INSERT INTO "{S}".jobs_steps (job_id, name, kind, state, until, created_at, '
            f"updated_at) VALUES ({job_id}, 'w', 'wait', 'waiting', '{when}', '{when}', "
            f"'{when}')"
        )
    with db.connect() as conn:
        (step,) = admin.job_steps(conn, jobs, job_id)
    assert (step.name, step.until, step.created_at, step.updated_at) == ("w", None, None, None)
    c = TestClient(create_app(jobs, db, read_only=True), base_url=BASE)
    r = c.get(f"/jobs/{job_id}")
    assert r.status_code == 200


def test_retrying_a_job_whose_lease_python_cannot_hold_says_why_not(
    db: sa.Engine, jobs: Jobs
) -> None:
    """A job cancelled while it ran, its lease ``infinity``: the retry read the lease
    into Python to say why it held the job back, and failed (the page a 500)."""
    job_id = _insert(
        db,
        "(task, queue, args, status, attempts, max_attempts, locked_until, locked_by) VALUES "
        "('t.work', 'a', '{}', 'cancelled', 1, 2, 'infinity', 'w')",
    )
    with db.begin() as conn:
        report = admin.act(conn, jobs, "retry", [admin.SeenJob(job_id, 1, "cancelled")])
    assert report.acted == ()
    ((skipped, why),) = report.skipped
    assert skipped == job_id and "once its lease has passed (-)" in why
    c = _client(jobs, db)
    r = _post(c, f"/jobs/{job_id}/retry", attempts=1, status="cancelled")
    assert r.status_code == 303 and "skipped=" in r.headers["location"]


def test_deleting_a_job_cancelled_while_it_ran_waits_for_its_lease_and_says_why(
    db: sa.Engine, jobs: Jobs
) -> None:
    """A purge, from the page's Delete as from ``act``, leaves a job cancelled while it
    ran until its lease has passed (its handler may still be running), and says why, a
    lease Python cannot hold included."""
    job_id = _insert(
        db,
        "(task, queue, args, status, attempts, max_attempts, locked_until, locked_by, "
        "finished_at) VALUES ('t.work', 'a', '{}', 'cancelled', 1, 2, 'infinity', 'w', now())",
    )
    with db.begin() as conn:
        report = admin.act(conn, jobs, "purge", [admin.SeenJob(job_id, 1, "cancelled")])
    assert report.acted == ()
    ((skipped, why),) = report.skipped
    assert skipped == job_id and "delete it once its lease has passed (-)" in why
    c = _client(jobs, db)
    r = _post(c, f"/jobs/{job_id}/purge", attempts=1, status="cancelled")
    assert r.status_code == 303 and "skipped=" in r.headers["location"]
    page = c.get(r.headers["location"])
    assert "handler may still be running" in _text(page)
    with db.connect() as conn:
        assert admin.get_job(conn, jobs, job_id) is not None


def test_retrying_a_job_at_the_largest_attempts_is_refused_with_a_reason(
    db: sa.Engine, jobs: Jobs
) -> None:
    """A dead job at ``attempts = 2**31 - 1``: a retry gives it one more attempt, which
    overflowed (the whole retry failed, "integer out of range", a 500 on the page). Such a
    job is now left alone, with the reason; the others of the selection are retried."""
    top = 2**31 - 1
    stuck = _insert(
        db,
        "(task, queue, args, status, attempts, max_attempts, finished_at) VALUES "
        f"('t.work', 'a', '{{}}', 'dead', {top}, 1, now())",
    )
    other = _insert(
        db,
        "(task, queue, args, status, attempts, max_attempts, finished_at) VALUES "
        "('t.work', 'a', '{}', 'dead', 3, 3, now())",
    )
    with db.begin() as conn:
        assert admin.retry_jobs(conn, jobs, dry_run=True, all_jobs=True) == 1
        report = admin.act(
            conn,
            jobs,
            "retry",
            [admin.SeenJob(stuck, top, "dead"), admin.SeenJob(other, 3, "dead")],
        )
    assert report.acted == (other,)
    ((skipped, why),) = report.skipped
    assert skipped == stuck and "largest number of attempts" in why
    assert _status(db, stuck).status == "dead"
    c = _client(jobs, db)
    r = _post(c, f"/jobs/{stuck}/retry", attempts=top, status="dead")
    assert r.status_code == 303 and "skipped=" in r.headers["location"]

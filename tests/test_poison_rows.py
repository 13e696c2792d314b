"""Rows a worker cannot run, written by something other than this library (SQL, another
service, an older or newer version), next to ordinary jobs, with a real ``sqla-jobs
worker`` process: each poison row ends dead with an error naming its column and why,
every other job runs once, the worker keeps running, and its health says so.

Before, a ``meta`` that was not an object killed an executor thread (its job stayed
``running``, heartbeated, for ever, and ``/healthz`` said 200 while the worker ran
nothing); an undecodable value broke the claim of its whole batch (every job of it
stranded until its lease passed, and in a limited queue the same row was claimed first
again and again, so nothing behind it ran); a renamed parameter ran with its default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import JobSession

from . import app
from .helpers import count, wait_for
from .test_cli_observability import free_ports, get
from .test_cli_worker import ROOT

QUEUES = {"poison": "poison.work", "poison-limited": "poison.limited_work"}

#: name: (column values as SQL, what last_error must say).
POISON: dict[str, tuple[dict[str, str], str]] = {
    "meta not an object": ({"meta": "'[1]'"}, "meta is a JSON array, not a JSON object"),
    "keep not a duration": (
        {"meta": """'{"sqla_jobs.keep": "soon"}'"""},
        """meta['sqla_jobs.keep'] is "soon", not a number of seconds""",
    ),
    "a 5,000-digit number": (
        {"args": """('{"i": ' || repeat('9', 5000) || '}')::jsonb"""},
        "args cannot be decoded by Python (ValueError: Exceeds the limit (4300",  # 3.10: "(4300)"
    ),
    # Deeper than any supported Python decodes (3.12 reads 1,200 levels, 3.13 5,000), and
    # within what jsonb stores (its own limit is the server's stack depth).
    "args nested 10,000 deep": (
        {"args": "(repeat('[', 10000) || repeat(']', 10000))::jsonb"},
        "args is nested too deeply for Python to decode",
    ),
    "args not an object": ({"args": "'[1, 2]'"}, "args is a JSON array, not a JSON object"),
    "run_at -infinity": (
        {"run_at": "'-infinity'"},
        "run_at is infinite, before the year 1 or after the year 9999",
    ),
    "created_at BC": (
        {"created_at": "'0044-03-15 BC'"},
        "created_at is infinite, before the year 1 or after the year 9999",
    ),
    "a renamed parameter": (
        {"args": """'{"i": -1, "user_id": 7}'"""},
        "the job's stored argument(s) 'user_id' are not parameters of its handler",
    ),
}
ORDINARY = 15


def _checks(conn: sa.Connection) -> list[tuple[str, str]]:
    return [
        (r[0], r[1])
        for r in conn.execute(
            sa.text(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = CAST(:table AS regclass) AND contype = 'c'"
            ),
            {"table": f'"{app.SCHEMA}".jobs'},
        )
    ]


@pytest.fixture
def written_before_checks(db: sa.Engine) -> Iterator[Any]:
    """Insert rows into the table as an install from before its CHECK constraints has it
    (they are dropped, and stay dropped while the test runs: with them, no such row can
    exist, since the upgrade that adds them validates every row); put back once the rows
    are gone."""
    table = f'"{app.SCHEMA}".jobs'
    checks: list[tuple[str, str]] = []

    def insert(values: list[dict[str, str]]) -> list[int]:
        ids = []
        with db.begin() as conn:
            present = _checks(conn)  # none from the second call on
            checks.extend(present)
            for name, _ in present:
                conn.execute(sa.text(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"'))
            for row in values:
                columns = ", ".join(row)
                sql = f"INSERT INTO {table} ({columns}) VALUES ({', '.join(row.values())})"
                ids.append(conn.execute(sa.text(sql + " RETURNING id")).scalar_one())
        return ids

    yield insert
    with db.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {table}"))
        for name, definition in checks:
            conn.execute(sa.text(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}'))


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_poison_rows_end_dead_with_their_reason_and_every_other_job_runs(
    flavour: str, db: sa.Engine, written_before_checks: Any
) -> None:
    poison: dict[int, str] = {}
    for queue, task in QUEUES.items():
        rows = []
        for columns, _ in POISON.values():
            row = {
                "queue": f"'{queue}'",
                "task": f"'{task}'",
                "args": """'{"i": -1}'""",
                "max_attempts": "1",
                # Claimed first, beside ordinary jobs of the same batch.
                "run_at": "now() - interval '1 hour'",
            }
            row.update(columns)
            rows.append(row)
        ids = written_before_checks(rows)
        poison.update(zip(ids, (why for _, why in POISON.values()), strict=True))
    with JobSession(db) as session:
        for queue in QUEUES:
            task = app.poison_jobs.tasks[QUEUES[queue]]
            session.enqueue_many(task, [{"i": i} for i in range(ORDINARY)])
        session.commit()

    port = free_ports()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", "tests.app:poison_jobs"]
        + ["--queues", ",".join(QUEUES), "--concurrency", "2", "--lease", "2"]
        + ["--poll-interval", "0.2", "--health-port", f"127.0.0.1:{port}"]
        + (["--asyncio"] if flavour == "asyncio" else []),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The ordinary jobs done (and deleted), the poison rows dead.
        wait_for(lambda: count(db) == count(db, status="dead") == len(poison), timeout=60)
        with db.connect() as conn:
            left = {
                r.id: r
                for r in conn.execute(
                    sa.select(app.Job.id, app.Job.status, app.Job.last_error, app.Job.queue)
                )
            }
            runs = [r.job_id for r in conn.execute(sa.select(app.Run.job_id))]
        # Every poison row is dead, naming its column and why; nothing else is left.
        assert set(left) == set(poison)
        for job_id, why in poison.items():
            assert left[job_id].status == "dead"
            assert why in left[job_id].last_error, (why, left[job_id].last_error)
        # Every ordinary job ran, once; no poison row's handler ran.
        assert len(runs) == len(set(runs)) == 2 * ORDINARY and not set(runs) & set(poison)
        # The worker keeps running, and says it is healthy: it runs what it is given.
        assert proc.poll() is None
        status, body = get(port, "/healthz")
        report = json.loads(body)
        assert status == 200 and report["healthy"], report
        assert report["state"] == "running" and report["running"] == 0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "unreadable job row" in out and "Traceback" not in out


def test_a_scheduled_row_at_infinity_leaves_the_maintenance_working(
    db: sa.Engine, written_before_checks: Any
) -> None:
    """The next due time ignores times Python cannot hold: before PostgreSQL 17, one
    scheduled row at 'infinity' made the statement raise ("cannot subtract infinite
    timestamps"), every worker's maintenance failed, and no worker claimed anything;
    from 17 on it said 'due in infinite seconds'."""
    from sqla_jobs.worker import _statements as worker_db

    written_before_checks(
        [
            {"queue": "'poison'", "task": "'poison.work'", "status": "'scheduled'", "run_at": at}
            for at in ("'infinity'", "'-infinity'")
        ]
    )
    with db.begin() as conn:
        found = worker_db.refresh(conn, app.poison_jobs, True)
    assert found.due_in is None  # the '-infinity' one was promoted, the other is never due
    assert count(db, status="ready") == 1 and count(db, status="scheduled") == 1


def test_one_odd_row_leaves_the_job_and_schedule_lists_readable(db: sa.Engine, jobs: Any) -> None:
    """Rows the CHECK constraints allow but Python cannot read (a time at infinity, a
    number of 5,000 digits in the arguments), written by hand: the job lists, a job's
    own page, the queue states and the schedule list read the others, and show such a
    value as missing (a time) or as what it is (``{"sqla_jobs.unreadable": ...}``). One
    of them failed every listing for as long as the row was kept (``keep_dead``: a week),
    and the row could not be opened to purge it."""
    from sqla_jobs import admin
    from sqla_jobs.periodic import list_schedules

    table = f'"{app.SCHEMA}".jobs'
    with db.begin() as conn:
        conn.exec_driver_sql(f"INSERT INTO {table} (task, queue, args) VALUES ('ok', 'q', '{{}}')")
        conn.exec_driver_sql(
            f"INSERT INTO {table} (task, queue, args, status, run_at) "
            "VALUES ('odd', 'q', '{}', 'ready', '-infinity')"
        )
        conn.exec_driver_sql(
            f"INSERT INTO {table} (task, queue, args, status, finished_at) "
            f"VALUES ('huge', 'q', '{{\"n\": {'9' * 5000}}}', 'dead', 'infinity')"
        )
        conn.exec_driver_sql(
            f'INSERT INTO "{app.SCHEMA}".jobs_schedules (name, task, cron, next_run_at) '
            "VALUES ('odd', 't', '* * * * *', 'infinity')"
        )
        deep = "[" * 5000 + "]" * 5000
        conn.exec_driver_sql(
            f'INSERT INTO "{app.SCHEMA}".jobs_schedules (name, task, cron, args) '
            f"VALUES ('deep', 't', '* * * * *', '{{\"a\": {deep}}}')"
        )
    with db.connect() as conn:
        listed = {j.task: j for j in admin.list_jobs(conn, jobs)}
        assert set(listed) == {"ok", "odd", "huge"}
        assert listed["odd"].run_at is None and listed["ok"].run_at is not None
        assert "sqla_jobs.unreadable" in listed["huge"].args
        assert listed["huge"].finished_at is None
        page = admin.browse_jobs(conn, jobs)
        assert {s.task for s in page.jobs} == {"ok", "odd", "huge"}
        assert admin.get_job(conn, jobs, listed["odd"].id) is not None
        [state] = admin.queue_states(conn, jobs)
        assert state.ready == 2
        deep, odd = list_schedules(conn, jobs)
        assert odd.name == "odd" and odd.next_run_at is None and odd.args == {}
        assert deep.name == "deep" and "sqla_jobs.unreadable" in deep.args

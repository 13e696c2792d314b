"""What ``admin.queue_states`` and ``admin.list_queues`` read on a table with a long history.

Run it as ``python benchmarks/admin_scans.py`` (``DATABASE_URL`` or a throwaway embedded
PostgreSQL; a schema of its own, dropped at the end). It fills a jobs table with
``--jobs`` rows (by default 300,000: 55% done, 40% dead, the rest ready, scheduled or
running, over 20 queues), ANALYZEs it, then prints each call's median time over
``--repeat`` calls and the plan nodes of its statements (which indexes, any Seq Scan).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, Jobs, admin, create_engine
from sqla_jobs.db import database_url

SCHEMA = "sqla_jobs_bench_admin"


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)

FILL = """
INSERT INTO {t} (queue, task, status, run_at, finished_at, locked_until, locked_by, attempts)
SELECT 'q' || (i % 20), 'task' || (i % 7), s.status,
       now() - interval '1 hour' + (CASE WHEN s.status = 'scheduled' THEN interval '2 hours'
                                          ELSE interval '0' END),
       CASE WHEN s.status IN ('done', 'dead') THEN now() - (i % 86400) * interval '1 s' END,
       CASE WHEN s.status = 'running' THEN now() + interval '1 min' END,
       CASE WHEN s.status = 'running' THEN 'w' END,
       CASE WHEN s.status IN ('running', 'done', 'dead') THEN 1 ELSE 0 END
FROM generate_series(1, :n) AS i,
     LATERAL (SELECT CASE WHEN i % 100 < 55 THEN 'done' WHEN i % 100 < 95 THEN 'dead'
                          WHEN i % 100 < 98 THEN 'ready' WHEN i % 100 < 99 THEN 'scheduled'
                          ELSE 'running' END AS status) AS s
"""


def plans(engine: sa.Engine, call: Any) -> list[str]:
    """The plan node lines of every SELECT the call runs (EXPLAIN of each)."""
    captured: list[tuple[str, Any]] = []

    def spy(conn: Any, cursor: Any, statement: str, parameters: Any, *rest: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            captured.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", spy)
    try:
        with engine.connect() as conn:
            call(conn)
    finally:
        sa.event.remove(engine, "before_cursor_execute", spy)
    lines = []
    with engine.connect() as conn:
        for statement, parameters in captured:
            for (line,) in conn.exec_driver_sql("EXPLAIN " + statement, parameters):
                if "Scan" in line:
                    lines.append(line.strip())
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    engine = create_engine(database_url())
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        conn.exec_driver_sql(f"CREATE SCHEMA {SCHEMA}")
        Base.metadata.create_all(conn)
        conn.execute(sa.text(FILL.format(t=f"{SCHEMA}.jobs")), {"n": args.jobs})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"VACUUM ANALYZE {SCHEMA}.jobs")
    try:
        calls = {
            "admin.queue_states": lambda conn: admin.queue_states(conn, jobs),
            "admin.list_queues": lambda conn: admin.list_queues(conn, jobs),
            "admin.queue_states(finished=False)": lambda conn: admin.queue_states(
                conn, jobs, finished=False
            ),
        }
        print(f"{args.jobs:,} jobs; median of {args.repeat} calls")
        for name, call in calls.items():
            times = []
            with engine.connect() as conn:
                call(conn)  # warm
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    call(conn)
                    times.append(time.perf_counter() - start)
            print(f"{name:20} {statistics.median(times) * 1000:8.1f} ms")
            for line in plans(engine, call):
                print(f"    {line}")
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {SCHEMA} CASCADE")
        engine.dispose()


if __name__ == "__main__":
    main()

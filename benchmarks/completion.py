"""What the worker's completion statements cost, before and after a change, side by side.

Run it as ``python benchmarks/completion.py`` (``DATABASE_URL`` or a throwaway embedded
PostgreSQL; a schema of its own, dropped at the end). Each row times one way of writing
``--jobs`` outcomes in batches of ``--batch``, on a table refilled before every run with
that many running jobs, interleaved run by run with its "before" twin (which goes first
alternates), and prints the median jobs/s over ``--repeat`` runs with the range:

* **plain**: the autocommit completion of jobs that keep nothing and have no children.
  Before: ``Queries.complete``, the guarded DELETE. After: ``Queries.complete_childless``,
  the same DELETE that also leaves a job that has children now (it is completed with its
  release instead).
* **parents**: jobs that each have one waiting child, completed with the release of their
  children in one transaction per batch. Before: one release statement that finds the
  children by ``parents && :parent_ids``. After: ``settle_children``, which locks the
  waiting children first (found the same way), then releases them by primary key, so that
  a group callback reads every sibling's result.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, Jobs, create_engine
from sqla_jobs.db import database_url
from sqla_jobs.worker._statements import settle_children

SCHEMA = "sqla_jobs_bench_completion"


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)

RUNNING = """
INSERT INTO {t} (queue, task, status, run_at, locked_until, locked_by, attempts, meta)
SELECT 'q', 'noop', 'running', now(), now() + interval '1 min', 'w', 1, {meta}
FROM generate_series(1, :n)
"""

CHILDREN = """
INSERT INTO {t} (queue, task, status, run_at, parents, waiting)
SELECT 'kids', 'noop', 'scheduled', '9999-01-01', ARRAY[id], 1 FROM {t} WHERE status = 'running'
"""

Writer = Callable[[sa.Connection, list[int]], None]


def fill(engine: sa.Engine, n: int, parents: bool) -> list[int]:
    t = f'"{SCHEMA}"."jobs"'
    meta = """'{"sqla_jobs.children": true}'::jsonb""" if parents else "NULL"
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {t} RESTART IDENTITY"))
        conn.execute(sa.text(RUNNING.format(t=t, meta=meta)), {"n": n})
        if parents:
            conn.execute(sa.text(CHILDREN.format(t=t)))
        ids = list(conn.execute(sa.select(Job.id).where(Job.status == "running")).scalars())
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"VACUUM ANALYZE {t}")
    return ids


def plain(statement: sa.Executable) -> Writer:
    def write(conn: sa.Connection, ids: list[int]) -> None:
        conn.execute(statement, {"ids": ids, "attempt_list": [1] * len(ids)}).all()

    return write


def with_release(settle: Callable[[sa.Connection, list[int]], None]) -> Writer:
    def write(conn: sa.Connection, ids: list[int]) -> None:
        conn.exec_driver_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
        rows = conn.execute(jobs.queries.complete, {"ids": ids, "attempt_list": [1] * len(ids)})
        settle(conn, [r[0] for r in rows if r[1]])
        conn.exec_driver_sql("COMMIT")

    return write


def _release_before() -> sa.Executable:
    """The release as it was before the children were locked first: one statement that
    finds them by ``parents && :parent_ids`` itself."""
    from sqlalchemy.dialects.postgresql import ARRAY

    from sqla_jobs._queries import (
        _SCHEDULED_VIA_PK,
        _notify_queues,
        _parent_count,
        _with_results,
    )

    t = jobs.table
    c = t.c
    free = c.waiting - _parent_count(c) <= 0
    released = (
        sa.update(t)
        .where(
            c.parents.overlap(sa.bindparam("parent_ids", type_=ARRAY(sa.BigInteger))),
            c.status == _SCHEDULED_VIA_PK,
            c.waiting > 0,
        )
        .values(
            waiting=sa.func.greatest(c.waiting - _parent_count(c), 0),
            status=sa.case((free, "ready"), else_=c.status),
            run_at=sa.case((free, sa.func.now()), else_=c.run_at),
            args=_with_results(t, free),
        )
        .returning(c.queue, c.status)
        .cte("released")
    )
    return _notify_queues(jobs.queries.channel, released)


RELEASE_BEFORE = _release_before()


def release_only(conn: sa.Connection, parent_ids: list[int]) -> None:
    conn.execute(RELEASE_BEFORE, {"parent_ids": parent_ids}).all()


def lock_and_release(conn: sa.Connection, parent_ids: list[int]) -> None:
    settle_children(conn, jobs.queries, parent_ids, [])


def run(engine: sa.Engine, write: Writer, n: int, batch: int, parents: bool) -> float:
    ids = fill(engine, n, parents)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        started = time.perf_counter()
        for i in range(0, n, batch):
            write(conn, ids[i : i + batch])
        elapsed = time.perf_counter() - started
        left = conn.execute(sa.select(sa.func.count()).where(Job.status == "running")).scalar()
    assert left == 0, f"{left} jobs not completed"
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    engine = create_engine(database_url())
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{SCHEMA}"'))
        Base.metadata.create_all(conn)
    rows = [
        ("plain", False, plain(jobs.queries.complete), plain(jobs.queries.complete_childless)),
        ("parents", True, with_release(release_only), with_release(lock_and_release)),
    ]
    try:
        print(f"{args.jobs:,} jobs in batches of {args.batch}, median of {args.repeat} (jobs/s)")
        for name, parents, before, after in rows:
            # Warm-up: compiled statements, prepared plans, buffers.
            run(engine, before, args.batch * 2, args.batch, parents)
            run(engine, after, args.batch * 2, args.batch, parents)
            timed: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(args.repeat):
                order = [("before", before), ("after", after)]
                for label, write in order if r % 2 == 0 else order[::-1]:
                    timed[label].append(run(engine, write, args.jobs, args.batch, parents))
            cells = [
                f"{label} {statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})"
                for label, v in timed.items()
            ]
            print(f"{name:<8} " + "   ".join(cells))
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
        engine.dispose()


if __name__ == "__main__":
    main()

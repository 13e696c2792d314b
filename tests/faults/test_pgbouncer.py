"""Behind PgBouncer in transaction pooling mode, as the README says to run it.

Debian's PgBouncer (1.18, which keeps no prepared statements) in front of the suite's
PostgreSQL, with a small pool, so that each transaction may get another server connection.
Through it: producers committing business rows with their jobs (plain, limited, unique),
``--no-listen`` workers on the application's own engine (``--engine``, with
``prepare_threshold=None`` in its ``connect_args``), a periodic job, and ``jobs.result``
waits. Then a worker left listening, which must notice that its LISTEN hears nothing and
say so once. And workers left preparing statements, which must say once what is wrong
and keep draining.

Needs ``pgbouncer`` on the PATH or in /usr/sbin (``apt-get install -y pgbouncer``); the
test is skipped without it, unless ``SQLA_JOBS_REQUIRE_PGBOUNCER=1`` (CI) makes that a
failure.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from sqla_jobs import JobSession, create_engine, flow

from . import bouncer_app as bapp
from . import faults_app as app
from .bouncer import Bouncer, available
from .checks import figures, live_jobs, runs, wait_until
from .pg import CrashablePostgres
from .workers import WorkerGroup

pytestmark = pytest.mark.faults

POLL = 0.5
PRODUCERS = 3
ORDERS = 120
RESULTS = 12
#: The longest pickup allowed, from the COMMIT to the handler's start (see the assertion).
PICKUP = POLL + 0.3


@pytest.fixture
def bouncer(pg: CrashablePostgres, faults_db: sa.Engine) -> Iterator[Bouncer]:
    if not available():
        if os.environ.get("SQLA_JOBS_REQUIRE_PGBOUNCER"):
            pytest.fail("pgbouncer is not installed (apt-get install -y pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    with faults_db.begin() as conn:
        bapp.Base.metadata.create_all(conn)
        conn.execute(sa.text(f'TRUNCATE "{app.SCHEMA}"."bounce_spans" RESTART IDENTITY'))
    server = Bouncer(pg, pool_size=8)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


def through(bouncer: Bouncer) -> Callable[[str], tuple[list[str], dict[str, str]]]:
    """A worker's database: the application's engine (``bouncer_app.engine``), through
    PgBouncer, named after the worker's slot."""

    def database(name: str) -> tuple[list[str], dict[str, str]]:
        return ["--engine", "bouncer_app:engine"], {bapp.BOUNCER_URL_ENV: bouncer.url_for(name)}

    return database


def engine_through(bouncer: Bouncer, name: str, **kw: Any) -> sa.Engine:
    """sqla-jobs' own create_engine, told by the URL not to prepare statements."""
    return create_engine(bouncer.url_for(name) + "&prepare_threshold=None", **kw)


class OrderProducer:
    """One thread committing orders through PgBouncer: each an ``orders`` row with its
    jobs (one plain, one in the limited queue, one unique per pair of orders)."""

    def __init__(self, number: int, bouncer: Bouncer, until: Callable[[], bool]) -> None:
        self.number = number
        self.engine = engine_through(bouncer, f"faults-producer-{number}", poolclass=NullPool)
        self.until = until
        self.acked: set[int] = set()
        #: When each order's COMMIT returned (time.monotonic()).
        self.committed_at: dict[int, float] = {}
        self.errors: Counter[str] = Counter()
        self.thread = threading.Thread(target=self.run, name=f"producer-{number}", daemon=True)

    def run(self) -> None:
        while not self.until():
            enq = time.monotonic()
            try:
                with JobSession(self.engine, jobs=bapp.jobs) as s:
                    order = app.Order(producer=self.number, slots=[])
                    s.add(order)
                    s.flush()
                    order_id = order.id
                    s.enqueue(bapp.work, order_id=order_id, enq=enq)
                    s.enqueue(bapp.limited, order_id=order_id)
                    s.enqueue(bapp.unique, pair=order_id // 2)
                    s.commit()
            except sa.exc.DBAPIError as exc:
                self.errors[f"{type(exc.orig).__name__}: {exc.orig}".splitlines()[0]] += 1
                time.sleep(0.05)
            else:
                self.acked.add(order_id)
                self.committed_at[order_id] = time.monotonic()
            time.sleep(0.01)

    def stop(self) -> None:
        self.thread.join(timeout=30)
        self.engine.dispose()


def enqueue(engine: sa.Engine, task: Any, **kw: Any) -> int:
    with JobSession(engine, jobs=bapp.jobs) as s:
        job = s.enqueue(task, **kw)
        s.flush()
        job_id = int(job.id)
        s.commit()
    return job_id


def force_tick(engine: sa.Engine) -> None:
    """Make the periodic schedule due now (the test's clock, not a minute's wait)."""
    table = bapp.jobs.queries.schedules_table
    with engine.begin() as conn:
        updated = conn.execute(
            sa.update(table)
            .where(table.c.name == "bounce.tick")
            .values(next_run_at=sa.func.now() - sa.text("interval '1 second'"))
        ).rowcount
    assert updated == 1


def ticks_run(engine: sa.Engine) -> int:
    return sum(r.task == bapp.tick.name for r in runs(engine))


def max_overlap(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def log_lines(groups: list[WorkerGroup], pattern: str) -> list[str]:
    return [line for g in groups for p in g.all for line in p.log().splitlines() if pattern in line]


def new_text(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def test_through_pgbouncer_in_transaction_mode_nothing_is_lost_and_nothing_waits(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    bouncer: Bouncer,
    workers: Callable[..., WorkerGroup],
) -> None:
    pg_log_from = pg.log_path.stat().st_size
    common: dict[str, Any] = {
        "concurrency": 4,
        "lease": 5.0,
        "poll_interval": POLL,
        "registry": "bouncer_app:jobs",
        "database": through(bouncer),
    }
    # One queue per worker of group A, so that pickup is its own poll interval's alone.
    plain = workers(queues=[bapp.QUEUE], extra=["--no-listen"], app="faults-bplain", **common)
    others = workers(
        queues=[bapp.LIMITED, bapp.OTHERS], extra=["--no-listen"], app="faults-bother", **common
    )
    plain.start(2)
    others.start(1)
    plain.wait_started()
    others.wait_started()

    started = time.monotonic()
    producers: list[OrderProducer] = []

    def enough() -> bool:
        return sum(len(p.acked) for p in producers) >= ORDERS

    producers += [OrderProducer(n, bouncer, enough) for n in range(PRODUCERS)]
    for p in producers:
        p.thread.start()

    # Meanwhile: results waited for through PgBouncer, and two ticks of the periodic job.
    waiter = engine_through(bouncer, "faults-results")
    returned: dict[int, float] = {}
    values: dict[int, Any] = {}
    try:
        force_tick(faults_db)
        for n in range(RESULTS):
            job_id = enqueue(waiter, bapp.result, n=n)
            values[job_id] = bapp.jobs.result(waiter, job_id, timeout=15)
            returned[job_id] = time.monotonic()
            if n == RESULTS // 2:
                # The second tick once the first has run (a tick's job is unique while live).
                wait_until(lambda: ticks_run(faults_db) >= 1, timeout=15, what="the first tick")
                force_tick(faults_db)
        assert flow._DIRECT[waiter] is False  # found out: a pooler, so it polled
    finally:
        waiter.dispose()
    wait_until(enough, timeout=60, what="the producers commit their orders")
    for p in producers:
        p.stop()
    wait_until(lambda: live_jobs(faults_db) == 0, timeout=60, interval=0.1, what="the drain")
    wait_until(
        lambda: ticks_run(faults_db) >= 2,
        timeout=15,
        what="both ticks of the periodic job ran",
    )
    drained_for = time.monotonic() - started
    bouncer_log_phase_a = bouncer.log()

    # A worker left listening: its LISTEN hears nothing, which it must say once.
    listening = workers(
        queues=["bounce-listen"], app="faults-blisten", **{**common, "poll_interval": POLL}
    )
    listening.start(1)
    listening.wait_started()
    direct = faults_db
    listened_pickups: list[float] = []
    for n in range(10):
        enq = time.monotonic()
        job_id = enqueue(
            direct, bapp.work.with_options(queue="bounce-listen"), order_id=-n, enq=enq
        )
        wait_until(
            lambda: any(r.job_id == job_id for r in runs(faults_db)),  # noqa: B023
            timeout=10,
            what="the listening worker runs its job",
        )
        run = next(r for r in runs(faults_db) if r.job_id == job_id)
        listened_pickups.append(run.mono - enq)
        if log_lines([listening], "its LISTEN hears nothing") and n >= 4:
            break
    plain.stop()
    others.stop()
    listening.stop()

    # -- what happened ---------------------------------------------------------------------
    all_runs = runs(faults_db)
    by_task: dict[str, Counter[int]] = {}
    for r in all_runs:
        by_task.setdefault(r.task, Counter())[r.item] += 1
    with faults_db.connect() as conn:
        orders = set(
            conn.execute(sa.select(app.Order.id).where(app.Order.producer < PRODUCERS)).scalars()
        )
        spans = [(s.started, s.ended) for s in conn.execute(sa.select(bapp.Span))]
    acked = set().union(*(p.acked for p in producers))
    producer_errors = sum((p.errors for p in producers), Counter())
    work_runs = by_task.get(bapp.work.name, Counter())
    limited_runs = by_task.get(bapp.limited.name, Counter())
    unique_runs = by_task.get(bapp.unique.name, Counter())
    pairs = {o // 2 for o in orders}
    lost = sorted(o for o in orders if work_runs[o] == 0 or limited_runs[o] == 0)
    twice = sorted(o for o in orders if work_runs[o] > 1 or limited_runs[o] > 1)
    orphans = sorted(set(limited_runs) - orders)
    unique_wrong = sorted(p for p in pairs if unique_runs[p] != 1)
    ticks = sum(by_task.get(bapp.tick.name, Counter()).values())
    enq_of = {r.job_id: r for r in all_runs if r.task == bapp.work.name and r.item in orders}
    committed_at = {k: v for p in producers for k, v in p.committed_at.items()}
    pickups = sorted(r.mono - committed_at[r.item] for r in enq_of.values())
    tx_times = sorted(committed_at[r.item] - r.enq for r in enq_of.values())
    started_at = {r.job_id: r.mono for r in all_runs if r.task == bapp.result.name}
    result_waits = sorted(returned[j] - started_at[j] for j in returned)
    wrong_values = {j: v for j, v in values.items() if v["square"] != v["n"] ** 2}
    prepared = [
        line
        for line in log_lines([plain, others, listening], "prepared statement")
        + new_text(pg.log_path, pg_log_from).splitlines()
        if "prepared statement" in line
    ]
    deaf = log_lines([listening], "its LISTEN hears nothing")
    troubles = log_lines([plain, others, listening], " ERROR ") + log_lines(
        [plain, others, listening], "Traceback"
    )
    exited = [p for g in (plain, others, listening) for p in g.exited() if p.returncode != 0]
    figures(
        "pgbouncer",
        pool_mode="transaction",
        server_connections=8,
        orders=len(orders),
        acked=len(acked),
        producer_errors=sum(producer_errors.values()),
        jobs_run=len(all_runs),
        seconds=drained_for,
        lost=len(lost),
        ran_twice=len(twice),
        limited_max_running=max_overlap(spans),
        unique_pairs=len(pairs),
        periodic_runs=ticks,
        pickup_p50_s=statistics.median(pickups),
        pickup_max_s=pickups[-1],
        producer_tx_max_s=tx_times[-1],
        poll_interval_s=POLL,
        result_wait_max_s=result_waits[-1],
        prepared_statement_errors=len(prepared),
        listen_deaf_warnings=len(deaf),
        listening_pickup_max_s=max(listened_pickups),
    )

    assert not exited, [(p.pid, p.returncode, p.log_tail()) for p in exited]
    assert not prepared, prepared[:5]
    assert not troubles, troubles[:5]
    assert not producer_errors, producer_errors
    assert acked <= orders and len(orders) >= ORDERS
    assert not lost, f"orders whose jobs never ran: {lost[:10]}"
    assert not twice, f"orders whose jobs ran twice (no fault was injected): {twice[:10]}"
    assert not orphans, f"runs for orders that were not committed: {orphans[:10]}"
    assert not unique_wrong, [(p, unique_runs[p]) for p in unique_wrong[:10]]
    assert max_overlap(spans) <= bapp.LIMIT
    assert ticks == 2, f"the periodic job ran {ticks} times for two ticks"
    assert not wrong_values and len(values) == RESULTS
    # Pickup within the poll interval, give or take a claim's round trip through a busy
    # PgBouncer and a handler's start on this busy machine (a queue's empty mark lasts until
    # the next poll round, so no poll is skipped, for any number of queues).
    assert pickups[-1] < PICKUP, pickups[-10:]
    # Results within a second of the job's start.
    assert result_waits[-1] < 1.0, result_waits
    # Neither the --no-listen workers nor the result waits left a LISTEN behind: PgBouncer
    # logs every notification that reaches a server connection no client is on.
    assert "when not linked" not in bouncer_log_phase_a
    # The listening worker: told once, and it still found its jobs by polling.
    assert len(deaf) == 1, deaf
    assert "--no-listen" in deaf[0]
    assert max(listened_pickups) < PICKUP, listened_pickups


def test_through_pgbouncer_with_preparing_on_the_worker_says_so_once_and_keeps_draining(
    pg: CrashablePostgres,
    faults_db: sa.Engine,
    bouncer: Bouncer,
    workers: Callable[..., WorkerGroup],
) -> None:
    """The misconfiguration of issue 19 (no ``prepare_threshold=None``, PgBouncer 1.18):
    statements fail with lost prepared statements. Each worker says so once, as an ERROR
    naming the fix, and retries at once instead of backing off."""
    jobs_n = 400
    with JobSession(faults_db, jobs=bapp.jobs) as s:
        s.enqueue_many(bapp.work, [{"order_id": i, "enq": 0.0} for i in range(jobs_n)])
        s.commit()

    def database(name: str) -> tuple[list[str], dict[str, str]]:
        return ["--database-url", bouncer.url_for(name)], {}  # psycopg prepares

    group = workers(
        queues=[bapp.QUEUE],
        concurrency=4,
        lease=5.0,
        poll_interval=POLL,
        extra=["--no-listen", "--log-level", "DEBUG"],
        registry="bouncer_app:jobs",
        database=database,
        app="faults-bprep",
    )
    started = time.monotonic()
    group.start(2)
    wait_until(lambda: live_jobs(faults_db) == 0, timeout=60, interval=0.1, what="the drain")
    drained_for = time.monotonic() - started
    group.stop()
    ran = Counter(r.item for r in runs(faults_db))
    advice = log_lines([group], "max_prepared_statements")
    per_process = [p.log().count("max_prepared_statements") for p in group.all]
    warned = [
        line
        for line in log_lines([group], "prepared statement")
        if " WARNING " in line or " ERROR " in line
    ]
    logs = "".join(p.log() for p in group.all)
    pauses = [float(m) for m in re.findall(r"retrying in ([0-9.]+)s", logs)]
    figures(
        "pgbouncer-preparing",
        jobs=jobs_n,
        seconds=drained_for,
        advice_lines=per_process,
        lost_prepared_statements=len(log_lines([group], "prepared statement")),
        longest_retry_pause_s=max(pauses, default=0.0),
    )
    failed = [p for p in group.all if p.returncode != 0]
    assert not failed, [p.log_tail() for p in failed]
    assert set(ran) == set(range(jobs_n)), "jobs lost"
    assert advice, "no worker lost a prepared statement: the scenario did not happen"
    assert all(n <= 1 for n in per_process), per_process
    assert len(warned) == len(advice), warned[:5]  # the advice is the only loud line
    assert "prepare_threshold" in advice[0] and "--engine" in advice[0]
    assert drained_for < 30

"""Producers through crashes: the dual-write promise (a business row and its jobs commit
together or not at all) while PostgreSQL is crashed and restarted and connections are cut.

Each producer thread loops on one transaction: insert an ``orders`` row, enqueue its jobs
with ``session.enqueue`` and ``session.enqueue_many``, and inside ``begin_nested()``
savepoints, one that is kept (sometimes) and one that is rolled back on purpose (always,
in one of four shapes). The row records which slots its transaction kept. A producer whose
transaction fails starts again with a new row. What committed is read from the database
afterwards, never taken from the producers' belief: a COMMIT whose answer was lost in the
crash may have committed or not.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from sqla_jobs import JobSession, create_engine

from . import faults_app as app
from .checks import figures, live_jobs, runs, status_counts, wait_until
from .pg import CrashablePostgres
from .workers import WorkerGroup

pytestmark = pytest.mark.faults

PRODUCERS = 4
#: Slots every transaction keeps: one ``enqueue``, three ``enqueue_many``.
BASE_SLOTS = [0, 1, 2, 3]
#: Slots of the savepoint that is kept (half of the transactions): enqueue + enqueue_many.
KEPT_SAVEPOINT_SLOTS = [4, 5, 6]
#: Shapes of the savepoint that is rolled back; its slots are 100 + 10 * shape + (0, 1, 2).
ROLLED_BACK_SHAPES = ("enqueue", "enqueue_many", "enqueue+enqueue_many", "both+flush")


class Discard(Exception):
    """Raised inside a savepoint to roll it back on purpose."""


class Producer:
    def __init__(self, number: int, url: str) -> None:
        self.number = number
        self.engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 2})
        self.rng = random.Random(number)
        #: Order ids whose COMMIT returned, and those whose transaction raised after the
        #: row got its id (committed or not: only the database knows).
        self.acked: set[int] = set()
        self.unknown: set[int] = set()
        self.failures = 0
        self.errors: Counter[str] = Counter()
        self.shapes: Counter[str] = Counter()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"producer-{number}", daemon=True)

    def one(self) -> None:
        kept = self.rng.random() < 0.5
        shape = self.rng.randrange(len(ROLLED_BACK_SHAPES))
        slots = BASE_SLOTS + (KEPT_SAVEPOINT_SLOTS if kept else [])
        order_id: int | None = None
        try:
            with JobSession(self.engine, jobs=app.jobs) as s:
                order = app.Order(producer=self.number, slots=slots)
                s.add(order)
                s.flush()
                order_id = order.id
                s.enqueue(app.order_job, order_id=order_id, slot=0)
                s.enqueue_many(
                    app.order_job, [{"order_id": order_id, "slot": k} for k in (1, 2, 3)]
                )
                if kept:
                    with s.begin_nested():
                        s.enqueue(app.order_job, order_id=order_id, slot=4)
                        s.enqueue_many(
                            app.order_job, [{"order_id": order_id, "slot": k} for k in (5, 6)]
                        )
                base = 100 + 10 * shape
                name = ROLLED_BACK_SHAPES[shape]
                try:
                    with s.begin_nested():
                        if name != "enqueue_many":
                            s.enqueue(app.order_job, order_id=order_id, slot=base)
                        if name != "enqueue":
                            s.enqueue_many(
                                app.order_job,
                                [{"order_id": order_id, "slot": base + k} for k in (1, 2)],
                            )
                        if name == "both+flush":
                            s.flush()
                        raise Discard
                except Discard:
                    pass
                s.commit()
        except sa.exc.DBAPIError as exc:
            self.failures += 1
            self.errors[type(exc.orig).__name__] += 1
            if order_id is not None:
                self.unknown.add(order_id)
            return
        self.shapes[ROLLED_BACK_SHAPES[shape]] += 1
        self.acked.add(order_id)

    def run(self) -> None:
        while not self._stop.is_set():
            failures = self.failures
            self.one()
            # A short breath between transactions, a longer one after a failure (the
            # server may be down: no point hammering it).
            self._stop.wait(0.005 if self.failures == failures else 0.05)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)
        self.engine.dispose()


def test_producers_through_crashes_commit_rows_and_jobs_together(
    pg: CrashablePostgres, faults_db: sa.Engine, workers: Callable[..., WorkerGroup]
) -> None:
    group = workers(queues=["orders"], concurrency=8, lease=2.0, poll_interval=0.5)
    procs = group.start(2)
    group.wait_started()
    producers = [Producer(n, pg.url_for(f"faults-producer-{n}")) for n in range(PRODUCERS)]
    pause = threading.Event()
    started = time.monotonic()
    for p in producers:
        p.thread.start()
    terminated = 0
    try:
        wait_until(
            lambda: sum(len(p.acked) for p in producers) >= 50,
            timeout=30,
            what="the producers commit before the crash",
        )
        before = sum(len(p.acked) for p in producers)
        stopped, ready = pg.restart_after(1.5)
        wait_until(
            lambda: sum(len(p.acked) for p in producers) >= before + 50,
            timeout=30,
            what="the producers commit again after the restart",
        )
        for _ in range(6):  # cut every producer and worker connection, every 0.5 s
            terminated += pg.terminate_backends("faults-producer-%")
            terminated += pg.terminate_backends("faults-worker-%")
            pause.wait(0.5)
    finally:
        for p in producers:
            p.stop()
    produced_for = time.monotonic() - started
    wait_until(lambda: live_jobs(faults_db) == 0, timeout=60, interval=0.1, what="the queue drains")
    exited = [(p.pid, p.returncode, p.log_tail(5)) for p in procs if not p.alive]
    group.stop()

    with faults_db.connect() as conn:
        orders = {o.id: o.slots for o in conn.execute(sa.select(app.Order.id, app.Order.slots))}
        table_jobs = conn.execute(
            sa.select(
                app.Job.id,
                app.Job.status,
                app.Job.args["order_id"].as_integer(),
                app.Job.args["slot"].as_integer(),
            )
        ).all()
    all_runs = [r for r in runs(faults_db) if r.task == app.order_job.name]
    # (order id, slot) -> the distinct jobs that carry it, run or still in the table.
    jobs_of: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r in all_runs:
        jobs_of[(r.item, r.slot)].add(r.job_id)
    for job_id, _status, order_id, slot in table_jobs:
        jobs_of[(order_id, slot)].add(job_id)

    acked = set().union(*(p.acked for p in producers))
    unknown = set().union(*(p.unknown for p in producers))
    acked_lost = sorted(acked - set(orders))
    orphans = sorted({k for k in jobs_of if k[0] not in orders})
    kept_slots: dict[int, set[int]] = defaultdict(set)
    for order_id, slot in jobs_of:
        if slot < 100:
            kept_slots[order_id].add(slot)
    wrong = {
        oid: (sorted(slots), sorted(kept_slots.get(oid, set())))
        for oid, slots in orders.items()
        if set(slots) != kept_slots.get(oid, set())
    }
    duplicated = {k: sorted(v) for k, v in jobs_of.items() if len(v) > 1}
    leaked = sorted(k for k in jobs_of if k[1] >= 100)
    leaked_by_shape = Counter(ROLLED_BACK_SHAPES[(slot - 100) // 10] for _, slot in leaked)
    rolled_back_by_shape = sum((p.shapes for p in producers), Counter())
    left = status_counts(faults_db)
    figures(
        "producers",
        producers=PRODUCERS,
        seconds=produced_for,
        committed_rows=len(orders),
        acked=len(acked),
        failed_tx=sum(p.failures for p in producers),
        failed_but_committed=len(unknown & set(orders)),
        acked_but_missing=len(acked_lost),
        jobs=sum(len(v) for v in jobs_of.values()),
        backends_terminated=terminated,
        downtime_s=ready - stopped,
        rows_with_wrong_jobs=len(wrong),
        duplicated_jobs=len(duplicated),
        orphan_jobs=len(orphans),
        rolled_back_savepoint_jobs_leaked=len(leaked),
        leaked_by_shape=dict(leaked_by_shape),
        savepoints_rolled_back_by_shape=dict(rolled_back_by_shape),
        rows_left=sum(left.values()),
        exited=len(exited),
    )

    assert not exited, f"worker processes exited: {exited}"
    assert not acked_lost, f"rows whose COMMIT succeeded are missing: {acked_lost[:10]}"
    assert not orphans, f"jobs without a committed row (order id, slot): {orphans[:10]}"
    assert not wrong, (
        f"{len(wrong)} committed rows do not have exactly the jobs their transaction kept "
        f"(expected slots, found slots): {dict(list(wrong.items())[:5])}"
    )
    assert not duplicated, f"a slot enqueued once made several jobs: {list(duplicated.items())[:5]}"
    assert not left, f"job rows left after the drain: {left}"
    assert not leaked, (
        f"{len(leaked)} jobs enqueued inside a savepoint that was rolled back exist anyway, "
        f"by shape of that savepoint: {dict(leaked_by_shape)} (of "
        f"{dict(rolled_back_by_shape)} committed transactions per shape); e.g. (order id, "
        f"slot) {leaked[:5]}"
    )

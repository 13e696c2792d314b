"""When a worker's run decides it is done: ``run_until_empty`` (its timeout, its
``wait_scheduled``, its last look at queues walked by key, paused queues, what it counts),
``run_queued_jobs`` and ``ShardedWorker.run_until_empty``; and two ways an idle worker's
fetch loop went round without end (a held queue paused, a due job's row locked)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Backoff, Jobs, WorkerSettings

from . import app
from .helpers import count

dx = Jobs(app.Job, retry=Backoff(base=0.05, cap=0.05, jitter=0))

#: Opened by each test at its end: the handlers that block wait on it.
gate = threading.Event()
#: How many times stuck_once was called.
stuck_calls: list[int] = []
#: The calls of counted().
counted_calls: list[int] = []

dx.queue("dxrate", rate="2/s")
# In order per key with a concurrency limit: its claims walk 64 keys each, one a round.
dx.queue("dxord", key_order="fifo", concurrency=10)
dx.queue("dxfair", fair=True)


@dx.task(queue="dxa")
def blocking() -> None:
    gate.wait(30)


@dx.task(queue="dxa")
def stuck_once() -> None:
    """The first call blocks until the gate opens; the next ones return at once."""
    stuck_calls.append(1)
    if len(stuck_calls) == 1:
        gate.wait(30)


@dx.task(queue="dxa")
def quick(n: int = 0) -> None:
    pass


@dx.task(queue="dxa")
def counted(n: int = 0) -> None:
    counted_calls.append(n)


@dx.task(queue="dxb")
def elsewhere(n: int = 0) -> None:
    pass


@dx.task(queue="dxp")
def in_paused(n: int = 0) -> None:
    pass


@dx.task(queue="dxrate")
def rated(n: int = 0) -> None:
    pass


@dx.task(queue="dxref")
def refused(n: int = 0) -> None:
    pass


@dx.task(queue="dxord", concurrency_key=lambda account, **_: account)
def ordered(account: str) -> None:
    pass


@dx.task(queue="dxfair", concurrency_key=lambda tenant, **_: tenant)
def shared(tenant: str) -> None:
    pass


@pytest.fixture(autouse=True)
def _gate() -> Any:
    gate.clear()
    stuck_calls.clear()
    counted_calls.clear()
    yield
    gate.set()


def _pause(db: sa.Engine, queue: str) -> None:
    from sqla_jobs import admin

    with db.begin() as conn:
        admin.pause_queue(conn, dx, queue)


# -- the timeout ---------------------------------------------------------------------------


def test_the_timeout_ends_the_run_while_a_handler_runs_past_it(
    db: sa.Engine, make_worker: Any
) -> None:
    """Fetcher.fetch slept a whole poll interval (10 s) past the deadline: nothing wakes
    the idle loop while a handler runs. Now it sleeps no later than the deadline."""
    with db.begin() as conn:
        dx.enqueue(conn, blocking)
    worker = make_worker(dx, db, queues=["dxa"], listen=False, poll_interval=10.0, grace_period=0.2)
    began = time.monotonic()
    try:
        worker.run_until_empty(timeout=1.0)  # time for a loaded machine to start the handler
    finally:
        gate.set()
    took = time.monotonic() - began
    assert took < 4.0, f"run_until_empty(timeout=1.0) took {took:.1f}s"
    assert count(db, status="ready") == 1  # handed back


def test_a_run_after_a_cut_off_run_starts_with_every_slot_and_counts_its_own_runs(
    db: sa.Engine, make_worker: Any
) -> None:
    """A first run's handler is cut off by the grace period (its job handed back) and
    runs on. The next run of the same worker runs the job again at once (its slot was
    given back) and says 1 (the abandoned handler's end is not counted in it). The first
    run counts the cut-off run, which did start, in both drivers."""
    with db.begin() as conn:
        dx.enqueue(conn, stuck_once)
    worker = make_worker(
        dx, db, queues=["dxa"], listen=False, concurrency=1, poll_interval=0.2, grace_period=0.2
    )
    # (Time for a loaded machine to start the run and the handler: 0.4 s once was not.)
    assert worker.run_until_empty(timeout=1.5) == 1
    assert count(db, status="ready") == 1
    opener = threading.Timer(2.5, gate.set)  # the abandoned handler returns then
    opener.start()
    began = time.monotonic()
    try:
        ran = worker.run_until_empty(timeout=20)
        took = time.monotonic() - began
        gate.wait(10)
        # Whatever the abandoned handler's end does, it does it outside both runs.
        deadline = time.monotonic() + 5
        while worker.core._cut_off and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        opener.cancel()
        gate.set()
    assert (ran, count(db, status="ready")) == (1, 0)
    assert took < 2.0, f"the second run waited {took:.1f}s for the first run's handler"
    assert worker.core.free == 1


#: How many ``overlapping`` handlers run now, and the most that ever did.
running_now = [0, 0]
running_lock = threading.Lock()


@dx.task(queue="dxa")
def overlapping(n: int = 0) -> None:
    with running_lock:
        running_now[0] += 1
        running_now[1] = max(running_now)
    time.sleep(0.05)
    with running_lock:
        running_now[0] -= 1


def test_a_cut_off_handler_s_thread_does_not_join_the_next_run(
    db: sa.Engine, make_worker: Any
) -> None:
    """Threaded worker: the executor thread of a handler cut off by the grace period read
    the worker's inbox afresh after its handler returned, the next run's: it ran that
    run's jobs beside the run's own executors (two at once at ``concurrency=1``), and
    took the run's end-of-run sentinel, leaving one of that run's executors blocked for
    good. It ends with its own run's inbox now."""
    running_now[:] = [0, 0]
    with db.begin() as conn:
        dx.enqueue(conn, stuck_once)
    worker = make_worker(
        dx, db, queues=["dxa"], listen=False, concurrency=1, poll_interval=0.2, grace_period=0.2
    )
    worker.run_until_empty(timeout=1.5)  # time for a loaded machine to start the handler
    with db.begin() as conn:
        dx.enqueue_many(conn, overlapping, [{"n": n} for n in range(30)])
    opener = threading.Timer(0.3, gate.set)  # the abandoned handler returns mid-run
    opener.start()
    try:
        worker.run_until_empty(timeout=20)
    finally:
        opener.cancel()
        gate.set()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        executors = [t for t in threading.enumerate() if t.name.startswith("sqla-jobs-executor")]
        if not executors:
            break
        time.sleep(0.05)
    assert running_now[1] == 1, f"{running_now[1]} handlers at once at concurrency=1"
    assert executors == []


# -- wait_scheduled ------------------------------------------------------------------------


def test_wait_scheduled_waits_for_the_worker_s_own_unpaused_queues_only(
    db: sa.Engine, make_worker: Any
) -> None:
    """The next due time was read across every queue of the table: a worker of dxa waited
    for dxb's scheduled jobs, and for those of its own paused queue dxp."""
    _pause(db, "dxp")
    with db.begin() as conn:
        dx.enqueue(conn, quick, n=1)
        for d in (1.0, 2.0, 3.0):
            dx.enqueue(conn, elsewhere.with_options(delay=d))
            dx.enqueue(conn, in_paused.with_options(delay=d))
    worker = make_worker(dx, db, queues=["dxa", "dxp"], listen=False, poll_interval=0.5)
    began = time.monotonic()
    assert worker.run_until_empty(wait_scheduled=5, timeout=30) == 1
    took = time.monotonic() - began
    # It waited until the last of them was due (3 s); a loaded machine's run, well under.
    assert took < 2.5, f"waited {took:.1f}s for scheduled jobs it does not run"


def test_wait_scheduled_still_waits_for_its_own_queue(db: sa.Engine, make_worker: Any) -> None:
    """The control: its own queue's scheduled job is waited for and run."""
    with db.begin() as conn:
        dx.enqueue(conn, quick.with_options(delay=0.5), n=1)
    worker = make_worker(dx, db, queues=["dxa"], listen=False, poll_interval=5.0)
    assert worker.run_until_empty(wait_scheduled=3, timeout=30) == 1


# -- queues walked by key ------------------------------------------------------------------


def _dead_keys(db: sa.Engine, task: Any, name: str, n: int, *, behind: bool) -> None:
    """``n`` keys whose first job is dead (and, ``behind``, a ready job held behind it),
    then a free key ``zz`` after them with 5 ready jobs."""
    keys = [{name: f"k{i:05}"} for i in range(n)]
    table = app.Job.__table__
    with db.begin() as conn:
        dx.enqueue_many(conn, task, keys)
        conn.execute(
            sa.update(table)
            .where(table.c.queue == task.queue)
            .values(status="dead", finished_at=sa.func.now(), attempts=1)
        )
        if behind:
            dx.enqueue_many(conn, task, keys)
        dx.enqueue_many(conn, task, [{name: "zz"}] * 5)


def test_a_free_tenant_beyond_two_walks_of_dead_tenants_runs_before_the_run_ends(
    db: sa.Engine, make_worker: Any
) -> None:
    """A fair claim walks at most 16 x 64 keys; the run's last look (a claim after the
    loop's) saw 2,048 of 2,100 dead tenants and called the queue empty. Now a walk that
    did not come round keeps the queue not empty, and goes on from where it stopped."""
    _dead_keys(db, shared, "tenant", 2100, behind=False)
    settings = WorkerSettings(concurrency=4, listen=False, poll_interval=5.0)
    worker = make_worker(dx, db, settings=settings, queues=["dxfair"])
    began = time.monotonic()
    assert worker.run_until_empty(timeout=90) == 5
    # Its last look walks round (from the free key, the last one) and ends the run, well
    # before its timeout: half a second here, 11 s once on a machine loaded five times
    # over, 25 s once in a CI run's slowest phase (Python 3.10, SQLAlchemy 2.0). The
    # bound tells a run that ended by itself from one its timeout ended.
    assert time.monotonic() - began < 75
    assert count(db, status="ready") == 0


def test_a_free_key_beyond_held_keys_in_a_limited_ordered_queue_runs_before_the_run_ends(
    db: sa.Engine, make_worker: Any
) -> None:
    """key_order with a concurrency limit: a claim walks 64 keys and stops. The last look
    (the loop's claim, then held_for_good's) saw 128 of 200 keys held behind dead heads
    and called the queue empty, the free key's jobs ready."""
    _dead_keys(db, ordered, "account", 200, behind=True)
    settings = WorkerSettings(concurrency=4, listen=False, poll_interval=5.0)
    worker = make_worker(dx, db, settings=settings, queues=["dxord"])
    began = time.monotonic()
    assert worker.run_until_empty(timeout=30) == 5
    assert time.monotonic() - began < 20  # well before its timeout, on a loaded machine too
    assert count(db, status="ready") == 200  # behind their dead heads


def test_a_queue_of_held_keys_only_is_still_called_empty(db: sa.Engine, make_worker: Any) -> None:
    """The control: with no free key, a walk comes round and the run ends."""
    _dead_keys(db, ordered, "account", 150, behind=True)
    table = app.Job.__table__
    with db.begin() as conn:
        conn.execute(sa.delete(table).where(table.c.concurrency_key == "zz"))
    settings = WorkerSettings(concurrency=4, listen=False, poll_interval=5.0)
    worker = make_worker(dx, db, settings=settings, queues=["dxord"])
    began = time.monotonic()
    assert worker.run_until_empty(timeout=30) == 0
    assert time.monotonic() - began < 20  # well before its timeout, on a loaded machine too


# -- paused queues -------------------------------------------------------------------------


def test_a_rate_held_queue_paused_during_the_run_lets_it_end(
    db: sa.Engine, make_worker: Any
) -> None:
    """A queue held by its rate stayed held (only a claim, which a paused queue never
    gets, ended the hold): the run went on to its timeout."""
    with db.begin() as conn:
        for n in range(20):
            dx.enqueue(conn, rated, n=n)
    pauser = threading.Timer(0.8, _pause, (db, "dxrate"))
    worker = make_worker(dx, db, queues=["dxrate"], listen=False, poll_interval=0.2)
    pauser.start()
    began = time.monotonic()
    try:
        worker.run_until_empty(timeout=12)
    finally:
        pauser.cancel()
    took = time.monotonic() - began
    assert count(db, status="ready") > 0  # paused with jobs left
    assert took < 8, f"the run went on {took:.1f}s; the queue was paused at 0.8 s"


def test_a_queue_paused_while_its_claims_are_refused_lets_the_run_end(
    db: sa.Engine, make_worker: Any
) -> None:
    """A queue whose claims the database refuses is not empty (Fetcher.failing); paused,
    it is, but it left ``failing`` only on a claim that went through."""
    table = f'"{app.SCHEMA}".jobs'
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE FUNCTION dx_refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'dx: refused'; END $$"
            )
        )
        conn.execute(
            sa.text(
                f"CREATE TRIGGER dx_refuse BEFORE UPDATE ON {table} FOR EACH ROW "
                "WHEN (NEW.queue = 'dxref' AND NEW.status = 'running') "
                "EXECUTE FUNCTION dx_refuse()"
            )
        )
        dx.enqueue(conn, refused, n=1)
    pauser = threading.Timer(0.8, _pause, (db, "dxref"))
    try:
        worker = make_worker(dx, db, queues=["dxref", "dxa"], listen=False, poll_interval=0.2)
        pauser.start()
        began = time.monotonic()
        worker.run_until_empty(timeout=15)
        took = time.monotonic() - began
    finally:
        pauser.cancel()
        with db.begin() as conn:
            conn.execute(sa.text(f"DROP TRIGGER IF EXISTS dx_refuse ON {table}"))
            conn.execute(sa.text("DROP FUNCTION IF EXISTS dx_refuse()"))
    assert took < 9, f"the run went on {took:.1f}s after the queue was paused at 0.8 s"


def _counting_rounds(worker: Any) -> list[int]:
    rounds = [0]
    order = worker.core.fetcher.claim_order

    def counted_order() -> list[str]:
        rounds[0] += 1
        return order()

    worker.core.fetcher.claim_order = counted_order
    return rounds


def test_an_idle_worker_does_not_spin_while_a_held_queue_is_paused(db: sa.Engine) -> None:
    """Held by its rate, then paused: the expired hold made Fetcher.sleep_for answer 1 ms,
    and the loop went round ~800 times a second while the queue stayed paused."""
    from sqla_jobs import Worker

    with db.begin() as conn:
        for n in range(20):
            dx.enqueue(conn, rated, n=n)
    worker = Worker(dx, db, queues=["dxrate"], listen=False, poll_interval=0.5)
    rounds = _counting_rounds(worker)
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    runner.start()
    try:
        time.sleep(0.8)
        _pause(db, "dxrate")
        time.sleep(1.0)  # the pause is read within a poll interval
        before = rounds[0]
        time.sleep(1.0)
        spun = rounds[0] - before
    finally:
        worker.stop()
        runner.join(30)
    assert spun < 10, f"{spun} fetch rounds in 1 s while the queue was paused"


def test_an_idle_worker_does_not_spin_while_a_due_job_s_row_is_locked(db: sa.Engine) -> None:
    """A due job whose row another transaction holds locked is not promoted (SKIP
    LOCKED), and its due time, read back, is past: the loop ran a refresh transaction
    every millisecond. Now it looks again after DUE_RECHECK; and the job runs once the
    lock is gone."""
    from sqla_jobs import Worker

    with db.begin() as conn:
        job_id = dx.enqueue(conn, counted.with_options(delay=0.2), n=1)
    worker = Worker(dx, db, queues=["dxa"], listen=False, poll_interval=5.0)
    passes = [0]
    run_once = worker.core.maintenance.run_once

    def counted_pass() -> Any:
        m, now = worker.core.maintenance, time.monotonic()
        if now >= m.next_refresh or (m.next_due is not None and now >= m.next_due):
            passes[0] += 1  # a pass that runs
        return run_once()

    worker.core.maintenance.run_once = counted_pass  # type: ignore[method-assign]
    table = app.Job.__table__
    locker = db.connect()
    tx = locker.begin()
    locker.execute(sa.select(table.c.id).where(table.c.id == job_id).with_for_update())
    runner = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    runner.start()
    try:
        time.sleep(0.5)  # due since 0.2 s
        before = passes[0]
        time.sleep(1.5)
        spun = passes[0] - before
        tx.rollback()
        locker.close()
        deadline = time.monotonic() + 5
        while not counted_calls and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if tx.is_active:
            tx.rollback()
        locker.close()
        worker.stop()
        runner.join(30)
    assert spun < 8, f"{spun} maintenance passes (refresh transactions) in 1.5 s"
    assert counted_calls == [1]


# -- what a run counts ---------------------------------------------------------------------


def test_a_job_cancelled_before_its_handler_was_called_is_not_counted(db: sa.Engine) -> None:
    """Claimed, then cancelled before an executor started it: the handler is not called,
    and run_until_empty said 1 job ran."""
    from sqla_jobs import Worker, admin

    worker = Worker(dx, db, queues=["dxa"], listen=False, concurrency=1, lease=0.9)
    start = worker.core.start

    def late_start(job: Any) -> Any:
        if job.task.endswith(".counted") and not job.is_cancelled:
            with db.begin() as conn:
                admin.cancel_jobs(conn, dx, [job.id])
            deadline = time.monotonic() + 5  # until a heartbeat finds the claim gone
            while not job.is_cancelled and time.monotonic() < deadline:
                time.sleep(0.02)
        return start(job)

    worker.core.start = late_start  # type: ignore[method-assign]
    with db.begin() as conn:
        dx.enqueue(conn, counted, n=7)
        dx.enqueue(conn, quick, n=8)
    ran = worker.run_until_empty(timeout=20)
    assert counted_calls == [] and count(db, status="cancelled") == 1
    assert ran == 1, "run_until_empty counted a job whose handler was never called"


# -- run_queued_jobs -----------------------------------------------------------------------


def test_run_queued_jobs_keeps_a_key_s_order(db: sa.Engine) -> None:
    """The plain claim ran a key's second job while its head waited for its retry; now a
    queue in key order gives only a key's head, and another key's job still runs."""
    from sqla_jobs import JobSession
    from sqla_jobs.testing import run_queued_jobs

    jobs = app.limited_jobs
    Session = sa.orm.sessionmaker(db, class_=JobSession, jobs=jobs)
    with Session() as session:
        session.enqueue(app.ordered_work, account="a", fail=True)  # head: fails, retries
        session.enqueue(app.ordered_work, account="a")  # behind it
        session.enqueue(app.ordered_work, account="b")  # another key: runs
        summary = run_queued_jobs(session, jobs, queues=["ordered"])
        ran = sorted((r.attempt, r.outcome) for r in summary.runs)
        table = app.Job.__table__
        left = session.execute(
            sa.select(table.c.concurrency_key, table.c.status).order_by(table.c.id)
        ).all()
        session.rollback()
    assert ran == [(1, "retried"), (1, "succeeded")], ran
    assert [tuple(r) for r in left] == [("a", "scheduled"), ("a", "ready")]


# -- a sharded run -------------------------------------------------------------------------


def test_a_sharded_run_until_empty_with_a_shard_down_ends_on_time(db: sa.Engine) -> None:
    """A shard that cannot be reached is started again after pauses of 0.5, 1, 2, 4 s,
    each waited in full whatever was left of the timeout: timeout=2 returned at ~3.5 s."""
    from sqla_jobs.sharding import ShardedWorker

    dead = "postgresql+psycopg://postgres@127.0.0.1:9/nothing?connect_timeout=2"
    with db.begin() as conn:
        dx.enqueue(conn, quick, n=1)
    worker = ShardedWorker(dx, {"down": dead, "a": db}, concurrency=2, queues=["dxa"])
    began = time.monotonic()
    counts = worker.run_until_empty(timeout=2.0)
    took = time.monotonic() - began
    assert counts == {"a": 1}
    assert took < 3.0, f"run_until_empty(timeout=2) took {took:.1f}s"

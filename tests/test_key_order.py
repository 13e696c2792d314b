"""Strict order per key (``jobs.queue(name, key_order="fifo")``): the jobs of one key start
in the order of their ids, one at a time, across claimers and worker processes; a job waits
behind an earlier one of its key that is scheduled (delayed, retrying), ready or running,
and, unless the queue says ``on_head_failure="continue"``, behind one that ended dead or
cancelled, until an operator retries or deletes it."""

from __future__ import annotations

import itertools
import json
import threading
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, admin
from sqla_jobs._bulk import COPY_MIN_ROWS
from sqla_jobs._queries import claim_params, interval, queue_claim_params
from sqla_jobs.worker import _statements as worker_db

from . import app
from .helpers import count, wait_for
from .test_throttle import _spans, _start_workers, workers  # noqa: F401 (a fixture)

jobs = app.limited_jobs
ordered = app.ordered_work
Job = app.Job.__table__


def test_declarations() -> None:
    registry = Jobs(app.Job)
    limits = registry.queue("a", key_order="fifo")
    assert (limits.keyed, limits.key_concurrency, limits.on_head_failure) == (True, 1, "hold")
    assert limits.describe() == "in order per key"
    assert registry.queue("b", key_order="fifo", key_concurrency=1).key_order == "fifo"
    assert registry.queue("c", key_order="fifo", key_rate="5/s").key_concurrency == 1
    go_on = registry.queue("d", key_order="fifo", on_head_failure="continue")
    assert go_on.on_head_failure == "continue"
    for bad, message in (
        ({"key_order": "lifo"}, "key_order must be 'fifo' or None"),
        ({"key_order": "fifo", "key_concurrency": 2}, "key_concurrency=2 cannot go with it"),
        ({"on_head_failure": "hold"}, "on_head_failure is for key_order='fifo'"),
        ({"key_order": "fifo", "on_head_failure": "skip"}, "must be 'hold' or 'continue'"),
    ):
        with pytest.raises(ValueError, match=message):
            registry.queue("e", **bad)
    assert "e" not in registry.queue_limits


def _claim(db: sa.Engine, queue: str = "ordered", limit: int = 10, name: str = "t") -> list[int]:
    """One limited claim of ``queue``, as a worker's fetcher makes it: the claimed ids."""
    with db.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        params = queue_claim_params(
            claim_params(queue, limit, interval(30), name), jobs.limits(queue)
        )
        # Busy past CLAIM_LOCK_TIMEOUT (another claimer held the queue's lock, on a loaded
        # machine): tried again, as the fetcher does.
        for _ in range(100):
            found = worker_db.claim_limited(conn, jobs.queries, params)
            if not found.busy:
                break
        return sorted(int(r[0]) for r in found.rows)  # the rows start with the id


def _finish(db: sa.Engine, ids: list[int], status: str | None = None) -> None:
    """The claimed jobs end: deleted (done), or left ``status`` (dead, cancelled)."""
    with db.begin() as conn:
        if status is None:
            conn.execute(sa.delete(Job).where(Job.c.id.in_(ids)))
        else:
            conn.execute(
                sa.update(Job)
                .where(Job.c.id.in_(ids))
                .values(status=status, finished_at=sa.func.now(), locked_until=None)
            )


def _enqueue(db: sa.Engine, accounts: str, **options: Any) -> list[int]:
    task = ordered.with_options(**options) if options else ordered
    with db.begin() as conn:
        return [jobs.enqueue(conn, task, account=a) for a in accounts]


def _blocked(db: sa.Engine, **kw: Any) -> list[admin.BlockedKey]:
    with db.connect() as conn:
        return admin.blocked_keys(conn, jobs, **kw)


def test_each_key_starts_its_jobs_in_id_order_one_at_a_time(db: sa.Engine) -> None:
    ids = _enqueue(db, "abcabcab")  # a: 1 4 7, b: 2 5 8, c: 3 6
    first = _claim(db)
    assert first == [ids[0], ids[1], ids[2]]  # each key's head, and only that
    assert _claim(db) == []  # the heads run: nothing behind them starts
    _finish(db, [ids[0]])  # a's head is done: a's next, only
    assert _claim(db) == [ids[3]]
    _finish(db, [ids[1], ids[2], ids[3]])
    assert _claim(db) == [ids[4], ids[5], ids[6]]


def test_concurrent_claimers_take_each_key_s_head_once(db: sa.Engine) -> None:
    ids = _enqueue(db, "abcd" * 5)
    barrier = threading.Barrier(6)
    found: list[list[int]] = []

    def claim(n: int) -> None:
        barrier.wait()
        found.append(_claim(db, limit=2, name=f"claimer-{n}"))

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    claimed = sorted(itertools.chain(*found))
    assert claimed == ids[:4], found  # the four heads, each once, whoever claimed them


def test_a_retrying_or_delayed_job_holds_its_place(db: sa.Engine) -> None:
    [delayed] = _enqueue(db, "a", delay=3600)
    later = _enqueue(db, "ab")
    assert _claim(db) == [later[1]]  # a waits for its delayed head; b goes
    [retried] = _enqueue(db, "c")
    behind = _enqueue(db, "c")
    assert _claim(db) == [retried]
    with db.begin() as conn:  # its run failed: a retry, an hour from now
        conn.execute(
            sa.update(Job)
            .where(Job.c.id == retried)
            .values(status="scheduled", run_at=sa.func.now() + sa.text("interval '1 hour'"))
        )
    assert _claim(db) == []  # c's next waits behind the retrying head
    with db.begin() as conn:
        conn.execute(sa.delete(Job).where(Job.c.id.in_([delayed, retried])))
    assert _claim(db) == sorted([later[0], *behind])


def test_priority_orders_the_heads_of_keys_never_the_jobs_of_one(db: sa.Engine) -> None:
    low = _enqueue(db, "ab")
    urgent = _enqueue(db, "ac", priority=9)
    assert _claim(db, limit=1) == [urgent[1]]  # c's head: the most urgent head
    assert _claim(db, limit=1) == [low[0]]  # a's head, not a's urgent second job
    assert _claim(db, limit=5) == [low[1]]


def test_a_failed_head_holds_its_key_until_an_operator_acts(db: sa.Engine) -> None:
    ids = _enqueue(db, "aaab")
    assert _claim(db) == [ids[0], ids[3]]
    _finish(db, [ids[0]], "dead")
    _finish(db, [ids[3]])
    assert _claim(db) == []  # held behind the dead head
    [blocked] = _blocked(db)
    assert (blocked.queue, blocked.key, blocked.head_id, blocked.head_status) == (
        "ordered",
        "a",
        ids[0],
        "dead",
    )
    assert blocked.waiting == 2
    assert _blocked(db, queue="ordered_on") == []
    # Retried: it runs first, then the rest of its key.
    with db.begin() as conn:
        assert admin.retry_jobs(conn, jobs, ids=[ids[0]]) == 1
    assert _claim(db) == [ids[0]]
    _finish(db, [ids[0]], "cancelled")  # cancelled holds too
    assert [b.head_status for b in _blocked(db)] == ["cancelled"]
    # Deleted (purged): the key goes on.
    _finish(db, [ids[0]])
    assert _blocked(db) == []
    assert _claim(db) == [ids[1]]


def test_a_job_cancelled_behind_a_running_head_is_blocked_only_once_that_head_ends(
    db: sa.Engine,
) -> None:
    """Running jobs are not in ``<table>_key_order``: a blocked key is one whose dead or
    cancelled head has nothing before it there, nor running."""
    ids = _enqueue(db, "aa")
    assert _claim(db) == [ids[0]]
    with db.begin() as conn:  # an operator cancels the job waiting behind the running head
        assert admin.cancel_jobs(conn, jobs, ids=[ids[1]]) == 1
    assert _blocked(db) == []  # a's head runs: nothing holds a yet
    _finish(db, [ids[0]])
    [blocked] = _blocked(db)
    assert (blocked.key, blocked.head_id, blocked.head_status) == ("a", ids[1], "cancelled")


def test_the_cli_lists_blocked_keys_and_exits_1(db: sa.Engine) -> None:
    from .test_cli_worker import run_cli

    clear = run_cli("queues", "blocked", "tests.app:limited_jobs")
    assert (clear.returncode, clear.stdout.strip()) == (0, "no blocked keys"), clear.stderr
    ids = _enqueue(db, "aa")
    assert _claim(db) == [ids[0]]
    _finish(db, [ids[0]], "dead")
    shown = run_cli("queues", "blocked", "tests.app:limited_jobs")
    assert shown.returncode == 1, shown.stderr
    header, line = shown.stdout.splitlines()
    assert header.split() == ["QUEUE", "KEY", "HEAD", "STATUS", "SINCE", "WAITING"]
    assert line.split()[:4] == ["ordered", "a", str(ids[0]), "dead"] and line.split()[-1] == "1"
    as_json = run_cli("queues", "blocked", "tests.app:limited_jobs", "--json", "--queue", "ordered")
    [entry] = json.loads(as_json.stdout)
    assert (entry["key"], entry["head_id"], entry["waiting"]) == ("a", ids[0], 1)
    model_only = run_cli("queues", "blocked", "tests.app:Job")
    assert model_only.returncode == 2 and "needs the Jobs registry" in model_only.stderr


def test_on_head_failure_continue_goes_on_past_a_failed_head(db: sa.Engine) -> None:
    task = ordered.with_options(queue="ordered_on")
    with db.begin() as conn:
        ids = [jobs.enqueue(conn, task, account="a") for _ in range(3)]
    assert _claim(db, "ordered_on") == [ids[0]]
    _finish(db, [ids[0]], "dead")
    assert _claim(db, "ordered_on") == [ids[1]]
    assert _blocked(db) == []


def test_a_head_cancelled_while_it_ran_holds_its_key_till_its_lease_passes_with_continue(
    db: sa.Engine, make_worker: Any
) -> None:
    """``on_head_failure="continue"`` goes on past a cancelled head, but one cancelled
    while it ran keeps its lease, its handler maybe still running: the key's next job
    started beside it. It now waits for the lease, and ``run_until_empty`` waits with it
    (time frees the key), then runs the job."""
    import time

    task = ordered.with_options(queue="ordered_on")
    with db.begin() as conn:
        ids = [jobs.enqueue(conn, task, account="a") for _ in range(2)]
    assert _claim(db, "ordered_on") == [ids[0]]  # its handler runs, a 30 s lease
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, ids=[ids[0]]) == 1
    assert _claim(db, "ordered_on") == []  # held while the cancelled head may still run
    with db.begin() as conn:  # the lease passes in a second
        conn.execute(
            sa.update(Job)
            .where(Job.c.id == ids[0])
            .values(locked_until=sa.func.now() + sa.text("interval '1 second'"))
        )
    worker = make_worker(jobs, db, queues=["ordered_on"], poll_interval=0.1)
    began = time.monotonic()
    assert worker.run_until_empty(timeout=30) == 1
    assert time.monotonic() - began >= 0.5  # it waited for the lease, then ran the job
    assert count(db, status="ready") == 0 and _blocked(db) == []


def test_a_bulk_call_and_a_savepoint_keep_the_order(db: sa.Engine) -> None:
    """A COPY-sized enqueue_many over five keys (keyed rows are INSERTed in the call's
    order), and a savepoint rolled back in the middle: each key's jobs come out in the
    order of the call, one per claim round."""
    rows = [{"account": f"a{i % 5}", "seconds": 0} for i in range(COPY_MIN_ROWS + 50)]
    with JobSession(db, jobs=jobs) as session:
        session.enqueue_many(ordered, rows[:50])
        with session.begin_nested() as nested:
            session.enqueue(ordered, account="a0")
            nested.rollback()
        session.enqueue_many(ordered, rows[50:])  # COPY-sized: 200 rows
        session.commit()
    ids: dict[str, list[int]] = {}
    with db.connect() as conn:
        for job_id, key in conn.execute(
            sa.select(Job.c.id, Job.c.concurrency_key).order_by(Job.c.id)
        ):
            ids.setdefault(key, []).append(job_id)
    assert sorted(ids) == [f"a{k}" for k in range(5)]
    assert sum(map(len, ids.values())) == len(rows)
    for n in range(3):
        claimed = _claim(db, limit=10)
        assert claimed == sorted(ids[key][n] for key in ids)
        _finish(db, claimed)


def test_claims_walk_the_keys_in_turn_so_that_none_is_out_of_reach(db: sa.Engine) -> None:
    """A claim visits at most ``scan`` keys (64 here), starting after the key where the
    last one stopped and wrapping around: with the first hundred keys' heads running, each
    with a job waiting behind it, the one key that can go, last in key order, is reached
    by the second claim. (A key whose jobs all run is not walked: running jobs are not in
    ``<table>_key_order``.)"""
    accounts = [f"k{n:03}" for n in range(101)]
    with db.begin() as conn:
        ids = {a: jobs.enqueue(conn, ordered, account=a) for a in accounts}
        waiting = {a: jobs.enqueue(conn, ordered, account=a) for a in accounts[:100]}
        behind = waiting["k000"]
        conn.execute(
            sa.update(Job)
            .where(Job.c.id.in_([ids[a] for a in accounts[:100]]))
            .values(status="running", locked_until=sa.func.now() + sa.text("interval '1 hour'"))
        )
    limits = jobs.limits("ordered")
    params = queue_claim_params(claim_params("ordered", 10, interval(30), "w"), limits)
    with db.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        first = worker_db.claim_limited(conn, jobs.queries, params)
        assert first.rows == [] and first.last_key == "k063"  # 64 keys, all busy
        second = worker_db.claim_limited(conn, jobs.queries, {**params, "after_key": "k063"})
        assert [r[0] for r in second.rows] == [ids["k100"]]
        assert second.last_key == "k026"  # k064-k100, then from the start: 64 in all
    # session.claim keeps no cursor: it walks every key.
    with JobSession(db, jobs=jobs) as session:
        assert session.claim(queue="ordered", limit=10) == []  # k100 runs now; k000 busy
    _finish(db, [ids["k000"]])
    with JobSession(db, jobs=jobs) as session:
        assert [j.id for j in session.claim(queue="ordered", limit=10)] == [behind]
        session.commit()


def test_the_walk_wraps_from_any_place_and_steps_over_finished_keys(db: sa.Engine) -> None:
    """Where the last claim stopped may be past every key, or a key that has gone; keys
    whose jobs all ended dead, in a queue that goes on past failed heads, are walked over
    without being claimed; an empty queue claims nothing and says where nothing stopped."""
    limits = jobs.limits("ordered_on")
    params = queue_claim_params(claim_params("ordered_on", 10, interval(30), "w"), limits)

    def claim(after: str | None) -> worker_db.LimitedClaim:
        with db.connect() as c:
            conn = c.execution_options(isolation_level="AUTOCOMMIT")
            return worker_db.claim_limited(conn, jobs.queries, {**params, "after_key": after})

    empty = claim(None)
    assert (empty.rows, empty.last_key) == ([], None)
    task = ordered.with_options(queue="ordered_on")
    with db.begin() as conn:
        dead = [jobs.enqueue(conn, task, account=a) for a in ("a", "b")]
        live = [jobs.enqueue(conn, task, account=a) for a in ("c", "d")]
    _finish(db, dead, "dead")  # a and b: only dead jobs left
    for after in ("zzz", "bb", None):
        found = claim(after)
        assert sorted(r[0] for r in found.rows) == live, after
        with db.begin() as conn:  # handed back, for the next round
            conn.execute(
                sa.update(Job)
                .where(Job.c.id.in_(live))
                .values(status="ready", locked_until=None, locked_by=None, attempts=0)
            )


def test_jobs_without_a_key_are_not_ordered(db: sa.Engine) -> None:
    with db.begin() as conn:
        ids = [jobs.enqueue(conn, ordered, account=None) for _ in range(3)]  # type: ignore[arg-type]
    assert _claim(db) == ids


def test_session_claim_keeps_the_order(db: sa.Engine) -> None:
    ids = _enqueue(db, "aab")
    with JobSession(db, jobs=jobs) as session:
        claimed = session.claim(queue="ordered", limit=10)
        assert sorted(j.id for j in claimed) == [ids[0], ids[2]]
        session.commit()


def test_order_per_key_across_worker_processes(
    db: sa.Engine,
    workers: list[Any],  # noqa: F811
) -> None:
    """Three worker processes of eight slots, 24 keys of 12 jobs, enqueued interleaved and
    in bulk: per key, the handlers start in id order and never overlap; keys overlap."""
    workers += _start_workers(3, "ordered", 8, db)
    with db.begin() as conn:
        for round_ in range(12):
            accounts = [f"k{n:02}" for n in range(24)]
            jobs.enqueue_many(
                conn, ordered, [{"account": a, "seconds": 0.002 * (round_ % 3)} for a in accounts]
            )
    total = 24 * 12
    wait_for(lambda: count(db, app.Span) == total, timeout=120, interval=0.1)
    spans = _spans(db)
    by_key: dict[str, list[Any]] = {}
    for s in spans:
        by_key.setdefault(s.key, []).append(s)
    assert len(by_key) == 24 and all(len(v) == 12 for v in by_key.values())
    for key, mine in by_key.items():
        assert [s.job_id for s in mine] == sorted(s.job_id for s in mine), key
        for before, after in itertools.pairwise(mine):
            assert before.ended <= after.started, f"two jobs of key {key!r} overlapped"
    assert len({s.pid for s in spans}) > 1
    overlapping = sum(
        1
        for s, o in itertools.combinations(spans, 2)
        if s.started < o.ended and o.started < s.ended
    )
    assert overlapping > 0, "no two keys ever ran at the same time"


def test_run_until_empty_ends_beside_a_key_held_by_a_dead_head(
    db: sa.Engine, make_worker: Any
) -> None:
    """A key held behind a dead head waits for an operator, so ``run_until_empty`` (and
    ``--until-empty``) calls its queue empty, as it does a paused one; it waited forever.
    While the head runs (another worker's job), the key is only waiting for it, and the
    run waits too."""
    import time

    ids = _enqueue(db, "aab")
    assert _claim(db) == [ids[0], ids[2]]
    _finish(db, [ids[2]])  # b is done; a's head runs elsewhere
    worker = make_worker(jobs, db, queues=["ordered"], poll_interval=0.1)
    began = time.monotonic()
    assert worker.run_until_empty(timeout=1.0) == 0  # waited for the running head
    assert time.monotonic() - began >= 0.9
    _finish(db, [ids[0]], "dead")
    began = time.monotonic()
    assert worker.run_until_empty(timeout=30) == 0
    assert time.monotonic() - began < 10
    assert count(db, status="ready") == 1 and [b.key for b in _blocked(db)] == ["a"]


@pytest.mark.parametrize("queue", ["ordered", "ordered_on"])
def test_a_free_key_beside_hundreds_of_held_keys_runs_before_the_queue_counts_empty(
    db: sa.Engine, make_worker: Any, queue: str
) -> None:
    """300 keys behind dead heads (``hold``: a job waits behind each), or whose only job
    died (``continue``), and one free key after them: each claim walks 64 keys, and one
    that found nothing to start is followed at once by the next, from where it stopped,
    until the walk comes round. ``run_until_empty`` ran nothing and ended with the free
    key's job ready (it looked once more at the next 64 keys only), and a worker started
    one of that key's jobs every recheck."""
    from sqla_jobs import WorkerSettings

    task = ordered.with_options(queue=queue)
    keys = [{"account": f"k{i:05}"} for i in range(300)]
    table = app.Job.__table__
    with db.begin() as conn:
        jobs.enqueue_many(conn, task, keys)
        conn.execute(sa.update(table).values(status="dead", finished_at=sa.func.now(), attempts=1))
        if queue == "ordered":
            jobs.enqueue_many(conn, task, keys)  # held behind their dead heads
        jobs.enqueue_many(conn, task, [{"account": "zz"}] * 10)
    settings = WorkerSettings(concurrency=4, listen=False, poll_interval=5.0)
    worker = make_worker(jobs, db, settings=settings, queues=[queue])
    assert worker.run_until_empty(timeout=20) == 10
    assert count(db, status="ready") == (300 if queue == "ordered" else 0)


def test_run_until_empty_runs_a_key_s_next_job_claimed_with_the_last_outcome(
    db: sa.Engine,
) -> None:
    """When the last running job ends, its outcome's write claims the key's next job in
    the same round trip (``Fetcher.ride``), while the fetch loop, seeing every slot free,
    waits for that write to look once more. It then found nothing ready, called the queue
    empty and handed the just-claimed job back if no executor had started it yet:
    ``run_until_empty`` returned short with a job left ready (a sharded run in CI counted
    99 of 100). Here each start comes late, as on a loaded machine."""
    import time

    from sqla_jobs import Worker

    worker = Worker(jobs, db, queues=["ordered"], concurrency=2, poll_interval=5.0)
    start = worker.core.start

    def late_start(job: Any) -> Any:
        time.sleep(0.1)
        return start(job)

    worker.core.start = late_start  # type: ignore[method-assign]
    _enqueue(db, "aaa")
    assert worker.run_until_empty(timeout=30) == 3
    assert count(db, status="ready") == 0


def test_a_cancelled_head_whose_run_may_go_on_holds_its_key_through_purge_and_retention(
    db: sa.Engine,
) -> None:
    """A running head cancelled keeps its lease: its handler may run on until it passes.
    Deleting it then (a purge, or retention with ``keep_dead=0``) let the key's next job
    start beside that handler. Both now leave it until its lease has passed, as a retry
    does, and the purge says why."""
    ids = _enqueue(db, "aa")
    assert _claim(db) == [ids[0]]  # its handler runs, a 30 s lease
    with db.begin() as conn:
        assert admin.cancel_jobs(conn, jobs, ids=[ids[0]]) == 1
    with db.begin() as conn:
        assert admin.purge_jobs(conn, jobs, ids=[ids[0]]) == 0
        report = admin.act(conn, jobs, "purge", admin.Selection([ids[0]]))
        assert report.acted == ()
        [(skipped, why)] = report.skipped
        assert skipped == ids[0] and "its handler may still be running" in why
        assert admin.preview(conn, jobs, "purge", admin.Selection([ids[0]])).count == 0
    zero = Jobs(app.Job, keep_dead=timedelta(0))
    with db.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        assert worker_db.prune_batch(conn, zero, zero.queries.prune_dead, timedelta(0)) == 0
    assert count(db, status="cancelled") == 1
    assert _claim(db) == []  # the key is held: the cancelled head may still run
    # Once the lease has passed, both delete it, and the key goes on.
    with db.begin() as conn:
        conn.execute(
            sa.update(Job)
            .where(Job.c.id == ids[0])
            .values(locked_until=sa.func.now() - sa.text("interval '1 second'"))
        )
        assert admin.purge_jobs(conn, jobs, ids=[ids[0]]) == 1
    assert _claim(db) == [ids[1]]

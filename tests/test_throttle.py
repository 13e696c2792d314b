"""Concurrency and rate limits (sqla_jobs.throttle): declarations, the keys written at
enqueue, the limited claim under concurrent claimers, and real worker processes."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import EnqueueError, Jobs, JobSession
from sqla_jobs._queries import claim_params, interval, limited_claim_params
from sqla_jobs.model import companion_tables
from sqla_jobs.throttle import parse_rate
from sqla_jobs.worker import _statements as worker_db

from . import app
from .helpers import count, rows, running, wait_for

ROOT = Path(__file__).resolve().parent.parent


# -- declarations -------------------------------------------------------------------------


def test_rates_parse() -> None:
    assert parse_rate("100/minute") == (100, 60.0)
    assert parse_rate("20/s") == (20, 1.0)
    assert parse_rate("5/10s") == (5, 10.0)
    assert parse_rate("1000 / hours") == (1000, 3600.0)
    assert parse_rate("10/day") == (10, 86400.0)


@pytest.mark.parametrize(
    ("rate", "message"),
    [
        ("100/fortnight", "unknown period 'fortnight'"),
        ("0/s", "between 1 and"),
        ("-1/minute", "between 1 and"),
        ("100", "is not '<count>/<period>'"),
        ("5/0s", "longer than 0"),
        ("100/ms", "unknown period 'ms'"),
        # Past what the claim can subtract from the clock (every claim failed), or a
        # float (the worker stopped).
        ("1/100000000d", "at most 36525 days"),
        ("1/" + "9" * 400 + "s", "at most 36525 days"),
    ],
)
def test_bad_rates_are_refused_at_declaration(rate: str, message: str) -> None:
    jobs = Jobs(app.Job)
    with pytest.raises(ValueError, match=message):
        jobs.queue("q", rate=rate)
    assert "q" not in jobs.queue_limits


@pytest.mark.parametrize("field", ["concurrency", "key_concurrency"])
@pytest.mark.parametrize("value", [0, -3, 1.5, True, 2**31])
def test_bad_concurrency_is_refused_at_declaration(field: str, value: Any) -> None:
    """2**31: past the claim's integer parameter, every claim of the queue failed."""
    jobs = Jobs(app.Job)
    message = f"queue 'q': {field} must be an integer from 1 to 2147483647"
    with pytest.raises(ValueError, match=message):
        jobs.queue("q", **{field: value})


def test_a_queue_is_declared_once_and_unlimited_queues_stay_plain() -> None:
    jobs = Jobs(app.Job)
    with pytest.raises(ValueError, match="queue must be a non-empty string"):
        jobs.queue("", concurrency=2)
    with pytest.raises(ValueError, match="rate must be a string"):
        jobs.queue("q", rate=100)  # type: ignore[arg-type]
    limits = jobs.queue("q", concurrency=2)
    assert limits.describe() == "concurrency 2"
    assert jobs.queue("r", rate="100/minute", key_concurrency=2).describe() == (
        "100/60s, 2 per key"
    )
    with pytest.raises(ValueError, match="already declared"):
        jobs.queue("q", rate="1/s")
    assert jobs.limits("q").limited
    assert not jobs.limits("other").limited
    with pytest.raises(ValueError, match="concurrency_key must be a function"):
        jobs.task(lambda: None, name="bad", concurrency_key="account")  # type: ignore[arg-type]


# -- the key, at every enqueue ------------------------------------------------------------


@pytest.fixture
def keyed() -> Jobs:
    jobs = Jobs(app.Job)

    @jobs.task(queue="k", concurrency_key=lambda account, **_: account)
    def sync(account: Any, n: int = 0) -> None: ...

    return jobs


def _keys(db: sa.Engine) -> list[str | None]:
    return [r.concurrency_key for r in rows(db)]


def test_every_enqueue_path_stores_the_key(db: sa.Engine, keyed: Jobs) -> None:
    sync = keyed.tasks[next(iter(keyed.tasks))]
    with JobSession(db, jobs=keyed) as session:
        session.enqueue(sync, account="a")
        session.enqueue(sync.with_options(priority=2), account="b")
        session.enqueue_many(sync, [{"account": "c"}, {"account": None, "n": 1}])
        session.commit()
    with db.begin() as conn:
        keyed.enqueue(conn, sync, account="d")
        keyed.enqueue(conn, sync.with_options(unique=True), account="e")
        keyed.enqueue_many(conn, sync, [{"account": "f"}])
        # A scoped unique job (sqla_jobs._queries.enqueue_scoped) stores it too, and a
        # debounce that replaces the arguments replaces the key with them.
        keyed.enqueue(conn, sync.with_options(unique_for=60), account="g")
        debounce = sync.with_options(unique_key="debounced", unique_on_conflict="replace", delay=60)
        keyed.enqueue(conn, debounce, account="h")
        keyed.enqueue(conn, debounce, account="i")
    assert _keys(db) == ["a", "b", "c", None, "d", "e", "f", "g", "i"]


def test_periodic_jobs_get_their_key(db: sa.Engine) -> None:
    from sqla_jobs import periodic

    jobs = Jobs(app.Job)

    @jobs.periodic("* * * * *", args={"account": "cron"})
    @jobs.task(queue="k", concurrency_key=lambda account: account)
    def tick(account: str) -> None: ...

    with db.begin() as conn:
        periodic.sync_declared(conn, jobs)
        conn.execute(sa.update(jobs.queries.schedules_table).values(next_run_at=sa.func.now()))
        assert periodic.enqueue_due(conn, jobs) == 1
    assert _keys(db) == ["cron"]


@pytest.mark.parametrize(
    ("account", "message"),
    [
        (12, "must return a non-empty string or None, got 12"),
        ("", "must return a non-empty string or None"),
        ("x" * 2000, "is 2000 bytes in UTF-8"),
        ("a\x00b", "NUL"),
    ],
)
def test_a_bad_key_fails_the_enqueue_and_loses_nothing(
    db: sa.Engine, keyed: Jobs, account: Any, message: str
) -> None:
    sync = keyed.tasks[next(iter(keyed.tasks))]
    with JobSession(db, jobs=keyed) as session:
        session.enqueue(sync, account="ok")
        with pytest.raises(EnqueueError, match=message):
            session.enqueue(sync, account=account)
        with pytest.raises(EnqueueError, match=message):
            session.enqueue_many(sync, [{"account": "fine"}, {"account": account}])
        session.commit()
    with db.begin() as conn, pytest.raises(EnqueueError, match=message):
        keyed.enqueue(conn, sync, account=account)
    assert _keys(db) == ["ok"]


def test_a_key_function_that_raises_fails_the_enqueue(db: sa.Engine) -> None:
    jobs = Jobs(app.Job)

    @jobs.task(queue="k", concurrency_key=lambda **kw: kw["tenant"])
    def work(account: str) -> None: ...

    with JobSession(db, jobs=jobs) as session, pytest.raises(EnqueueError) as info:
        session.enqueue(work, account="a")
    assert "concurrency_key function raised KeyError: 'tenant'" in str(info.value)
    assert count(db) == 0


def test_the_key_function_sees_the_handler_defaults(db: sa.Engine) -> None:
    jobs = Jobs(app.Job)

    @jobs.task(queue="k", concurrency_key=lambda region, **_: f"region:{region}")
    def work(n: int, region: str = "eu") -> None: ...

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(work, n=1)
        session.enqueue(work, 2, region="us")
        session.commit()
    assert _keys(db) == ["region:eu", "region:us"]


def test_a_keyed_job_needs_a_keyed_queue(db: sa.Engine, keyed: Jobs) -> None:
    sync = keyed.tasks[next(iter(keyed.tasks))]
    with JobSession(db, jobs=keyed) as session:
        with pytest.raises(EnqueueError, match="queue 'plain' does not enforce concurrency keys"):
            session.enqueue(sync.with_options(queue="plain"), account="a")
        keyed.queue("other", key_concurrency=2)
        session.enqueue(sync.with_options(queue="other"), account="a")
        session.commit()
    assert [(r.queue, r.concurrency_key) for r in rows(db)] == [("other", "a")]


# -- the limited claim, raced by real connections ------------------------------------------


def _race(
    db: sa.Engine, jobs: Jobs, queue: str, claimers: int, **limits: Any
) -> list[worker_db.LimitedClaim]:
    """``claimers`` connections run the limited claim at the same moment."""
    barrier = threading.Barrier(claimers)
    found: list[worker_db.LimitedClaim] = []
    errors: list[BaseException] = []

    def claim(n: int) -> None:
        try:
            with db.connect() as c:
                conn = c.execution_options(isolation_level="AUTOCOMMIT")
                params = limited_claim_params(
                    claim_params(queue, 10, interval(30), f"claimer-{n}"),
                    concurrency=limits.get("concurrency"),
                    rate=limits.get("rate"),
                    period=limits.get("period"),
                    key_limit=limits.get("key_limit", 1),
                )
                barrier.wait()
                # A claim that waited past CLAIM_LOCK_TIMEOUT for the queue's lock (another
                # racer held it, on a loaded machine) is busy: tried again, as a worker does.
                for _ in range(100):
                    got = worker_db.claim_limited(conn, jobs.queries, params)
                    if not got.busy:
                        break
                found.append(got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return found


def test_concurrent_claims_never_pass_the_concurrency_limit(db: sa.Engine) -> None:
    with db.begin() as conn:
        app.limited_jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0}] * 40)
    found = _race(db, app.limited_jobs, "limited", 6, concurrency=3)
    assert sum(len(f.rows) for f in found) == 3
    assert count(db, status="running") == 3
    assert all(f.held for f in found if len(f.rows) < 10)
    # A second round claims nothing: the three still run.
    assert sum(len(f.rows) for f in _race(db, app.limited_jobs, "limited", 3, concurrency=3)) == 0


def test_a_claim_past_the_concurrency_reads_one_row_more_to_tell_it_held_jobs_back(
    db: sa.Engine,
) -> None:
    """A claim of 10 from a queue of ``concurrency=3`` reads four ready rows, not ten (see
    ``limited_claim_params``): with exactly three ready it takes them and holds nothing
    back; with a fourth, it takes three and says the limit held the queue."""
    queries = app.limited_jobs.queries

    def claim(worker: str) -> Any:
        params = limited_claim_params(
            claim_params("limited", 10, interval(30), worker),
            concurrency=3,
            rate=None,
            period=None,
            key_limit=None,
            keyed=False,
        )
        assert params["scan"] == 4
        with db.connect() as c:
            conn = c.execution_options(isolation_level="AUTOCOMMIT")
            return worker_db.claim_limited(conn, queries, params)

    with db.begin() as conn:
        app.limited_jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0}] * 3)
    exact = claim("a")
    assert len(exact.rows) == 3 and not exact.held
    with db.begin() as conn:
        t = app.Job.__table__
        conn.execute(sa.update(t).where(t.c.status == "running").values(status="done"))
        app.limited_jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0}] * 4)
    over = claim("b")
    assert len(over.rows) == 3 and over.held
    assert count(db, status="running") == 3 and count(db, status="ready") == 1


def test_concurrent_claims_take_one_job_per_key(db: sa.Engine) -> None:
    with db.begin() as conn:
        for account in "abc":
            app.limited_jobs.enqueue_many(
                conn, app.keyed_work, [{"account": account, "seconds": 0}] * 20
            )
        app.limited_jobs.enqueue(
            conn, app.keyed_work.with_options(priority=5), account="d", seconds=0
        )
    found = _race(db, app.limited_jobs, "keyed", 6, key_limit=1)
    assert sum(len(f.rows) for f in found) == 4
    running = [r.concurrency_key for r in rows(db) if r.status == "running"]
    assert sorted(running) == ["a", "b", "c", "d"]
    found = _race(db, app.limited_jobs, "keyed", 2, key_limit=2)
    assert sum(len(f.rows) for f in found) == 3  # a, b, c get a second; d has no more


def test_a_keyed_claim_tells_when_a_key_at_its_limit_held_jobs_back(db: sa.Engine) -> None:
    """A keyed claim reads only its candidates (the first ready rows of keys with room),
    and a key at its limit holds its ready rows back unseen: the claim looks for one, so
    that a worker does not take the queue for empty (and wait for a NOTIFY that never
    comes) while the key's next job waits for its running one, nor hold an empty queue."""
    queries = app.limited_jobs.queries

    def claim(worker: str) -> Any:
        params = limited_claim_params(
            claim_params("keyed", 10, interval(30), worker),
            concurrency=None,
            rate=None,
            period=None,
            key_limit=1,
        )
        with db.connect() as c:
            return worker_db.claim_limited(
                c.execution_options(isolation_level="AUTOCOMMIT"), queries, params
            )

    def finish_running() -> None:
        with db.begin() as conn:
            t = app.Job.__table__
            conn.execute(sa.update(t).where(t.c.status == "running").values(status="done"))

    with db.begin() as conn:
        app.limited_jobs.enqueue_many(
            conn, app.keyed_work, [{"account": a, "seconds": 0} for a in "aab"]
        )
    first = claim("w1")  # a and b; a's second is behind a
    assert len(first.rows) == 2 and first.held
    second = claim("w2")  # nothing: a's second waits for a, unseen by the candidates
    assert not second.rows and second.held
    finish_running()
    third = claim("w3")
    assert len(third.rows) == 1 and not third.held
    fourth = claim("w4")  # a runs, with nothing behind it: the queue is empty
    assert not fourth.rows and not fourth.held


def test_concurrent_claims_share_one_rate(db: sa.Engine) -> None:
    with db.begin() as conn:
        app.limited_jobs.enqueue_many(conn, app.rated_work, [{}] * 40)
    began = time.monotonic()
    found = _race(db, app.limited_jobs, "rated", 5, rate=7, period=60.0)
    took = time.monotonic() - began
    assert sum(len(f.rows) for f in found) == 7
    late = [f for f in found if not f.rows]
    # The window opened at the first start, inside the race (however slow the machine).
    assert late and all(f.held and 60 - took - 1 < (f.rate_free_in or 0) <= 60 for f in late)
    queues = app.limited_jobs.queries.queues_table
    with db.connect() as conn:
        log, counts = conn.execute(
            sa.select(queues.c.rate_log, queues.c.rate_counts).where(queues.c.name == "rated")
        ).one()
    # One entry per claim that started jobs, with how many it started.
    assert len(log) == len(counts) and sum(counts) == 7
    assert sorted(counts) == sorted(len(f.rows) for f in found if f.rows)
    assert all(abs((datetime.now(timezone.utc) - at).total_seconds()) < 30 for at in log)


def test_the_rate_log_keeps_one_entry_per_claim_and_reads_a_log_of_one_per_job(
    db: sa.Engine,
) -> None:
    """A claim of five jobs adds one entry to the log, counting five, however many jobs it
    starts (a log of one entry per job grew with the rate: 10,000 timestamps rewritten at
    every claim at 10,000 a second). An entry without a count, as a log written one entry
    per job has, counts one: six of them and a rate of seven leave room for one."""
    with db.begin() as conn:
        app.limited_jobs.enqueue_many(conn, app.rated_work, [{}] * 12)
    [first] = _race(db, app.limited_jobs, "rated", 1, rate=100, period=60.0)
    queues = app.limited_jobs.queries.queues_table
    logged = sa.select(queues.c.rate_log, queues.c.rate_counts).where(queues.c.name == "rated")
    with db.connect() as conn:
        log, counts = conn.execute(logged).one()
    assert len(first.rows) == 10 and len(log) == 1 and counts == [10]
    with db.begin() as conn:
        conn.execute(
            sa.update(queues)
            .where(queues.c.name == "rated")
            .values(rate_log=sa.func.array_fill(sa.func.now(), sa.literal([6])), rate_counts=None)
        )
    [second] = _race(db, app.limited_jobs, "rated", 1, rate=7, period=60.0)
    assert len(second.rows) == 1 and second.held and second.rate_free_in is not None
    with db.connect() as conn:
        log, counts = conn.execute(logged).one()
    assert len(log) == 7 and counts == [1] * 7


def test_an_unlimited_queue_keeps_the_plain_claim(db: sa.Engine, make_worker: Any) -> None:
    """The plain claim statement, byte for byte, for the unlimited queue; the lock and the
    limited claim for the limited one; and both queues' jobs run."""
    with db.begin() as conn:
        app.limited_jobs.enqueue(conn, app.unlimited_work)
        app.limited_jobs.enqueue(conn, app.limited_work, seconds=0)
    claims: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "UPDATE" in statement and "running" in str(params):
            name = params.get("queue_name") if isinstance(params, dict) else None
            claims.append((statement, name))

    sa.event.listen(sa.Engine, "before_cursor_execute", seen)
    try:
        worker = make_worker(app.limited_jobs, db, queues=["unlimited", "limited"])
        assert set(worker.core.limits) == {"limited"}
        assert worker.run_until_empty() == 2
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", seen)
    plain = str(app.limited_jobs.queries.claim.compile(db))
    # The limited queue has a concurrency limit only: its claim has no rate log, and no
    # per-key parts (no keyed task uses it).
    shaped = app.limited_jobs.queries.shaped_claim(
        key_rated=False, fifo=False, rated=False, capped=True, keyed=False
    )
    limited = str(shaped.compile(db))
    assert "busy_keys" not in limited
    assert "rate_log" not in limited and "rate_log" in str(
        app.limited_jobs.queries.limited_claim.compile(db)
    )
    assert {q for s, q in claims if s == plain} == {"unlimited"}
    assert {q for s, q in claims if s == limited} == {"limited"}


def test_a_limited_queue_locked_by_an_open_session_claim_holds_up_no_other_queue(
    db: sa.Engine, make_worker: Any
) -> None:
    """An application's ``session.claim`` on a limited queue, left in an open transaction
    (a paused process, a slow request), holds that queue's lock. The worker's claim of it
    waits for the lock a moment only: its other queues' jobs run meanwhile, and its stop
    is not held up. (It waited for as long as the transaction stayed open: the fetch loop,
    which claims every queue in turn, claimed nothing, and the stop waited too.)"""
    with db.begin() as conn:
        app.limited_jobs.enqueue(conn, app.limited_work, seconds=0)
        for _ in range(5):
            app.limited_jobs.enqueue(conn, app.unlimited_work)
    worker = make_worker(
        app.limited_jobs, db, queues=["limited", "unlimited"], poll_interval=0.2, listen=False
    )
    with JobSession(db, jobs=app.limited_jobs) as holder:
        assert len(holder.claim("limited")) == 1  # its transaction stays open, the lock too
        thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
        thread.start()
        try:
            wait_for(lambda: count(db, queue="unlimited") == 0, timeout=15)
        finally:
            began = time.monotonic()
            worker.stop()
            thread.join(15)
        assert not thread.is_alive()
        assert time.monotonic() - began < 5
        holder.rollback()
    assert [(r.queue, r.status) for r in rows(db)] == [("limited", "ready")]


def test_limits_are_listed(db: sa.Engine) -> None:
    from sqla_jobs import admin

    with db.connect() as conn:
        listed = {q.name: q.limits for q in admin.list_queues(conn, app.limited_jobs)}
    assert listed == {
        "key_rated": "10/1s per key",
        "keyed": "1 per key",
        "limited": "concurrency 3",
        "ordered": "in order per key",
        "ordered_on": "in order per key, past a failed head",
        "rated": "20/1s",
        "shared": "fair share per key (premium=3)",
        "unlimited": "",
    }
    with db.connect() as conn:
        summaries = {
            q.queue: q.limits for q in admin.queue_states(conn, app.limited_jobs, finished=False)
        }
    assert summaries == listed
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from sqla_jobs.web import create_app

    page = TestClient(create_app(app.limited_jobs, db), base_url="http://localhost").get("/")
    assert page.status_code == 200
    assert '<span class="muted small" title="limits">concurrency 3</span>' in page.text
    result = subprocess.run(
        [sys.executable, "-m", "sqla_jobs.cli", "queues", "list", "tests.app:limited_jobs"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["QUEUE", "STATE", "SINCE", "LIMITS"]
    assert any(line.split()[0] == "limited" and "concurrency 3" in line for line in lines)


# -- worker processes ---------------------------------------------------------------------


def _start_workers(
    n: int, queue: str, concurrency: int, db: sa.Engine | None = None
) -> list[subprocess.Popen[str]]:
    """``n`` worker processes on ``queue``. With ``db``, wait until each has reported its
    presence (``<table>_workers``): jobs enqueued after that are claimed by workers that
    are all up, so the test sees several of them at work, not the one that started first
    on a loaded machine."""
    procs = _popen_workers(n, queue, concurrency)
    if db is not None:
        table = companion_tables(app.Job.__table__).workers
        up = sa.select(sa.func.count()).where(sa.literal(queue) == sa.any_(table.c.queues))

        def ready() -> bool:
            with db.connect() as conn:
                return int(conn.execute(up).scalar_one()) >= n

        try:
            wait_for(ready, timeout=60, interval=0.1)
        except BaseException:
            _stop(procs)
            raise
    return procs


def _popen_workers(n: int, queue: str, concurrency: int) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sqla_jobs.cli",
                "worker",
                "tests.app:limited_jobs",
                "--queues",
                queue,
                "--concurrency",
                str(concurrency),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    _stop(procs)


def _spans(db: sa.Engine) -> list[Any]:
    return sorted(rows(db, app.Span), key=lambda s: s.started)


def test_four_workers_never_run_more_than_three(
    db: sa.Engine, workers: list[subprocess.Popen[str]]
) -> None:
    # Two slots each: eight in all against the limit of three, and three running at once
    # needs two processes at least (with sixteen each, the first one up could take every
    # job while the others looked again a moment later, and nothing crossed processes).
    workers += _start_workers(4, "limited", 2, db)
    with db.begin() as conn:
        app.limited_jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0.05}] * 60)
    most = 0
    samples = 0
    running = sa.select(sa.func.count()).where(
        app.Job.__table__.c.status == "running", app.Job.__table__.c.queue == "limited"
    )
    deadline = time.monotonic() + 60
    with db.connect() as conn:
        while count(db, app.Span) < 60:
            assert time.monotonic() < deadline, "the jobs did not finish"
            most = max(most, int(conn.execute(running).scalar_one()))
            conn.rollback()
            samples += 1
    assert samples > 20
    assert most == 3  # reached, and never passed
    wait_for(lambda: count(db) == 0, timeout=20)
    # The spans agree: at no moment did four handlers run.
    spans = _spans(db)
    for s in spans:
        assert sum(1 for o in spans if o.started <= s.started < o.ended) <= 3
    assert len({s.pid for s in spans}) > 1


def test_one_job_per_key_at_a_time_across_workers(
    db: sa.Engine, workers: list[subprocess.Popen[str]]
) -> None:
    workers += _start_workers(3, "keyed", 8, db)
    with db.begin() as conn:
        for account in ("a", "b", "c"):
            app.limited_jobs.enqueue_many(
                conn, app.keyed_work, [{"account": account, "seconds": 0.01}] * 50
            )
    wait_for(lambda: count(db, app.Span) == 150, timeout=90, interval=0.1)
    spans = _spans(db)
    by_key: dict[str, list[Any]] = {}
    for s in spans:
        by_key.setdefault(s.key, []).append(s)
    assert sorted(by_key) == ["a", "b", "c"] and all(len(v) == 50 for v in by_key.values())
    for key, mine in by_key.items():
        for before, after in itertools.pairwise(mine):
            assert before.ended <= after.started, f"two jobs of key {key!r} overlapped"
    overlapping = sum(
        1
        for s in spans
        for o in spans
        if s.key != o.key and s.started < o.ended and o.started < s.ended
    )
    assert overlapping > 0, "jobs of different keys never ran at the same time"


@contextlib.contextmanager
def server_stamps(
    db: sa.Engine, table: str, key: str, log: str, counts: str | None = None
) -> Iterator[Callable[[], list[tuple[str, datetime, int]]]]:
    """Every claim's starts, as the server stamped them, for a rate's sliding log: column
    ``log`` of companion table ``table`` (``<table>_queues.rate_log`` by queue name, with
    ``counts``, ``rate_counts``: a claim appends its clock_timestamp() once, and how many
    jobs it claimed; ``<table>_key_starts.log`` by key: a claim appends its stamp once per
    job). A trigger keeps each write's new stamp and how many jobs it counts, where the
    log itself is trimmed to its window. Yields a function that reads them: (queue or key,
    at, jobs).

    The worker's clock sees when a claim was *sent*, and on a busy machine a claim can
    wait a while for the queue's lock before the server runs it: 18 jobs of a key rated
    at 10/s were "sent within 0.8 s" by that clock in CI, each claim within the rate."""
    schema = app.SCHEMA
    jobs = (
        f"NEW.{counts}[cardinality(NEW.{counts})]"
        if counts
        else f"(SELECT count(*) FROM unnest(NEW.{log}) AS s WHERE s = newest)"
    )
    ddl = [
        f'CREATE TABLE "{schema}".claim_stamps (key text, at timestamptz, n integer)',
        f"""CREATE FUNCTION "{schema}".claim_stamp() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            newest timestamptz := NEW.{log}[cardinality(NEW.{log})];
        BEGIN
            IF newest IS NULL
               OR (TG_OP = 'UPDATE' AND OLD.{log} IS NOT NULL AND newest = ANY (OLD.{log}))
            THEN
                RETURN NULL;
            END IF;
            INSERT INTO "{schema}".claim_stamps VALUES (NEW.{key}, newest, {jobs});
            RETURN NULL;
        END $$""",
        f'CREATE TRIGGER claim_stamp AFTER INSERT OR UPDATE ON "{schema}"."{table}" '
        f'FOR EACH ROW EXECUTE FUNCTION "{schema}".claim_stamp()',
    ]
    with db.begin() as conn:
        for statement in ddl:
            conn.exec_driver_sql(statement)

    def read() -> list[tuple[str, datetime, int]]:
        with db.connect() as conn:
            found = conn.exec_driver_sql(f'SELECT key, at, n FROM "{schema}".claim_stamps')
            return [(r.key, r.at, r.n) for r in found]

    try:
        yield read
    finally:
        with db.begin() as conn:
            conn.exec_driver_sql(f'DROP TRIGGER claim_stamp ON "{schema}"."{table}"')
            conn.exec_driver_sql(f'DROP FUNCTION "{schema}".claim_stamp()')
            conn.exec_driver_sql(f'DROP TABLE "{schema}".claim_stamps')


def most_in_a_window(stamps: list[tuple[datetime, int]], period: float) -> int:
    """The most jobs stamped in any window of ``period`` seconds (half-open, from each
    stamp): what a sliding log of that period keeps at or under its rate."""
    window = timedelta(seconds=period)
    stamps = sorted(stamps)
    return max(
        (
            sum(n for other, n in stamps[i:] if other < at + window)
            for i, (at, _) in enumerate(stamps)
        ),
        default=0,
    )


def test_a_rate_of_twenty_per_second_across_workers(
    db: sa.Engine, workers: list[subprocess.Popen[str]]
) -> None:
    queues = app.limited_jobs.queries.queues_table
    with server_stamps(db, queues.name, "name", "rate_log", "rate_counts") as claimed:
        workers += _start_workers(3, "rated", 8, db)
        with db.begin() as conn:
            app.limited_jobs.enqueue_many(conn, app.rated_work, [{}] * 300)
        wait_for(lambda: count(db, app.Span) >= 1, timeout=30)
        first = min(s.started for s in _spans(db))
        wait_for(lambda: time.time() > first + 5.0, timeout=30, interval=0.05)
        spans = [s for s in _spans(db) if s.started < first + 5.0]
        stamps = [(at, n) for queue, at, n in claimed() if queue == "rated"]
    starts = [s.started for s in spans]
    # The rate holds where it is enforced, at the claim, by the server's clock (a handler
    # can start a long while after its claim on a busy machine, and a claim be sent a
    # while before it runs: see server_stamps).
    assert most_in_a_window(stamps, 1.0) <= 20, stamps
    assert sum(n for _, n in stamps) >= len(starts) > 0  # every claim was stamped
    # ... and the limit is a rate, not a stall: about 20 a second got through on a quiet
    # machine, and more than two windows' worth on any (a slow machine's claims spend
    # part of each window waiting for the lock). At most 100 were *claimed* in any 5 s;
    # the first handler may start a while after its claim (a loaded machine), which
    # stretches the claims whose handlers start in the 5 s measured here over up to one
    # more window: hence 120, not 100.
    assert 40 < len(starts) <= 120
    assert count(db, status="ready") > 0
    assert all(r.attempts <= 1 and r.max_attempts == 5 for r in rows(db))


@pytest.mark.parametrize("also", [{}, {"concurrency": 5}], ids=["key_rate", "and concurrency"])
def test_run_until_empty_waits_for_a_key_s_rate(
    db: sa.Engine, make_worker: Any, also: dict[str, Any]
) -> None:
    """Jobs a key's rate holds back wait for its window too, a concurrency limit beside it
    or not: nothing runs while they wait, yet time frees them (the run calls a queue empty
    only when nothing can, see the fifo key behind a dead head)."""
    jobs = Jobs(app.Job)
    jobs.queue("per_key", key_rate="3/s", **also)

    @jobs.task(queue="per_key", concurrency_key=lambda account, **_: account)
    def tick(account: str) -> None: ...

    with db.begin() as conn:
        jobs.enqueue_many(conn, tick, [{"account": "a"}] * 5)
    worker = make_worker(jobs, db, queues=["per_key"], concurrency=8, poll_interval=30)
    assert worker.run_until_empty(timeout=30) == 5
    assert count(db) == 0


def test_run_until_empty_waits_for_the_rate(db: sa.Engine, make_worker: Any) -> None:
    """Ready jobs that the rate holds back are not "empty": the run waits for the window,
    and spends no attempt on them."""
    jobs = Jobs(app.Job)
    jobs.queue("slow", rate="4/s")
    ran: list[float] = []

    @jobs.task(queue="slow")
    def tick() -> None:
        ran.append(time.monotonic())

    with db.begin() as conn:
        jobs.enqueue_many(conn, tick, [{}] * 9)
    # A poll interval far longer than the run: the worker wakes when the window has room,
    # which the claim told it, not at its next poll.
    worker = make_worker(jobs, db, queues=["slow"], concurrency=8, poll_interval=30)
    began = time.monotonic()
    assert worker.run_until_empty() == 9
    assert time.monotonic() - began < 15
    assert count(db) == 0
    ran.sort()
    assert ran[-1] - ran[0] >= 1.9  # 4, then 4 a second later, then 1 a second after that
    for i, at in enumerate(ran):
        assert sum(1 for other in ran[i:] if other < at + 0.9) <= 4


def test_session_claim_honours_the_limit_across_transactions(db: sa.Engine) -> None:
    """A session claim of a limited queue holds its lock until its transaction ends; the
    next one waits for it, then sees what it claimed."""
    jobs = app.limited_jobs
    with db.begin() as conn:
        jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0}] * 10)
    other: list[int] = []
    with JobSession(db, jobs=jobs) as first:
        assert len(first.claim("limited", limit=2)) == 2

        def second() -> None:
            with JobSession(db, jobs=jobs) as session, session.begin():
                other.append(len(session.claim("limited", limit=5)))

        thread = threading.Thread(target=second)
        thread.start()
        waiting = sa.text(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' "
            "AND datname = current_database()"
        )
        with db.connect() as conn:
            wait_for(lambda: conn.execute(waiting).scalar_one() == 1 or conn.rollback())
        assert thread.is_alive() and not other
        first.commit()
    thread.join(10)
    assert other == [1]  # 3 - 2
    assert count(db, status="running") == 3
    with JobSession(db, jobs=jobs) as session:
        assert session.claim("limited", limit=5) == []


def test_session_claim_of_a_limited_queue_needs_read_committed(db: sa.Engine) -> None:
    with JobSession(db, jobs=app.limited_jobs) as session:
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        with pytest.raises(ValueError, match="only enforce under READ COMMITTED"):
            session.claim("limited")


def test_session_claim_of_a_limited_queue_refuses_autocommit(db: sa.Engine) -> None:
    """In autocommit the queue's lock would end with its own statement, and two claims
    could count the same free slots. SQLAlchemy's ``get_isolation_level`` says READ
    COMMITTED there (the level beneath autocommit), so the driver's flag is what tells."""
    with db.begin() as conn:
        app.limited_jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0}] * 2)
    bind = db.execution_options(isolation_level="AUTOCOMMIT")
    with (
        JobSession(bind, jobs=app.limited_jobs) as session,
        pytest.raises(ValueError, match="this transaction is AUTOCOMMIT"),
    ):
        session.claim("limited")
    assert count(db, status="running") == 0


def test_a_rate_held_queue_waits_without_spinning_or_blocking_others(
    db: sa.Engine, make_worker: Any
) -> None:
    """Two jobs a minute: the third waits, ready, no attempt spent, while another queue of
    the same worker is drained, and the held queue is claimed about once a poll interval
    (not in a loop)."""
    from .helpers import running

    jobs = Jobs(app.Job)
    jobs.queue("slow", rate="2/minute")

    @jobs.task(queue="slow")
    def slow() -> None: ...

    @jobs.task(queue="fast")
    def fast(n: int) -> None: ...

    with db.begin() as conn:
        jobs.enqueue_many(conn, slow, [{}] * 5)
    claims: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        held = isinstance(params, dict) and params.get("queue_name") == "slow"
        if held and "pg_advisory_xact_lock" in statement:
            claims.append("slow")

    sa.event.listen(sa.Engine, "before_cursor_execute", seen)
    try:
        worker = make_worker(jobs, db, queues=["slow", "fast"], poll_interval=0.5)
        with running(worker):
            wait_for(lambda: count(db, queue="slow", status="ready") == 3)
            with db.begin() as conn:
                jobs.enqueue_many(conn, fast, [{"n": n} for n in range(20)])
            wait_for(lambda: count(db, queue="fast") == 0)
            started = len(claims)
            began = time.monotonic()
            wait_for(lambda: len(claims) >= started + 3, timeout=20)
            took = time.monotonic() - began
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", seen)
    # Three more claims of the held queue took a poll interval each (0.5 s), not a loop's
    # few milliseconds.
    assert took >= 1.0, took
    left = [r for r in rows(db) if r.queue == "slow"]
    assert [(r.status, r.attempts) for r in left] == [("ready", 0)] * 3


def test_a_freed_slot_of_a_held_queue_is_written_at_once(db: sa.Engine, make_worker: Any) -> None:
    """The completer waits up to ``completion_interval`` for more outcomes to write them
    together, but not when the batch frees a slot of a limited queue that holds ready
    jobs back: its next claim waits for that write. With a minute's wait and another job
    still running (so the batch could still grow), the second job of a queue limited to
    one at a time starts at once, not a minute later."""
    jobs = Jobs(app.Job)
    jobs.queue("one_at_a_time", concurrency=1)
    gate = threading.Event()
    ran: list[int] = []

    @jobs.task(queue="slow")
    def block() -> None:
        gate.wait(30)

    @jobs.task(queue="one_at_a_time")
    def quick(n: int) -> None:
        ran.append(n)

    with db.begin() as conn:
        jobs.enqueue(conn, block)
        jobs.enqueue_many(conn, quick, [{"n": 1}, {"n": 2}, {"n": 3}])
    worker = make_worker(
        jobs,
        db,
        queues=["slow", "one_at_a_time"],
        completion_interval=60.0,
        listen=False,
        poll_interval=0.05,
    )
    with running(worker):
        try:
            wait_for(lambda: sorted(ran) == [1, 2, 3], timeout=15)
            # The blocked job still runs: the batches were not cut short for want of it.
            assert count(db, queue="slow", status="running") == 1
        finally:
            gate.set()

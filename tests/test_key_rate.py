"""Per-key rate limits (``jobs.queue(name, key_rate="10/minute")``): declarations, the
limited claim raced by real connections, and worker processes sharing one key rate."""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import datetime, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession
from sqla_jobs._queries import claim_params, interval, limited_claim_params
from sqla_jobs.model import companion_tables, job_table
from sqla_jobs.worker import _statements as worker_db
from sqla_jobs.worker._statements import prune

from . import app
from .helpers import count, rows, running, wait_for
from .test_throttle import _spans, _start_workers, most_in_a_window, server_stamps
from .test_throttle import workers as workers  # the fixture, re-exported

KEY_STARTS = companion_tables(job_table(app.Job)).key_starts


def test_key_rates_are_declared_and_described() -> None:
    jobs = Jobs(app.Job)
    alone = jobs.queue("a", key_rate="10/minute")
    assert (alone.key_rate, alone.key_rate_period, alone.key_concurrency) == (10, 60.0, None)
    assert alone.keyed and alone.limited
    assert alone.describe() == "10/60s per key"
    both = jobs.queue("b", key_rate="5/s", key_concurrency=2, rate="100/minute")
    assert both.describe() == "100/60s, 2 per key, 5/1s per key"
    # A keyed queue without a key rate keeps its one job per key.
    assert jobs.queue("c", concurrency=2, key_concurrency=None).key_concurrency == 1


@pytest.mark.parametrize(
    ("key_rate", "message"),
    [
        ("0/s", "queue 'q': key_rate '0/s': the count must be between 1 and"),
        ("10", "queue 'q': key_rate '10' is not '<count>/<period>'"),
        ("10/fortnight", "unknown period 'fortnight'"),
        ("3/0s", "longer than 0"),
        (10, "queue 'q': key_rate must be a string"),
    ],
)
def test_bad_key_rates_are_refused_at_declaration(key_rate: Any, message: str) -> None:
    jobs = Jobs(app.Job)
    with pytest.raises(ValueError, match=message):
        jobs.queue("q", key_rate=key_rate)
    assert "q" not in jobs.queue_limits


def _key_rated(key_rate: str) -> tuple[Jobs, Any]:
    """A registry whose queue "kr" has ``key_rate``, and its no-op task keyed by the
    ``account`` argument (None: no key)."""
    jobs = Jobs(app.Job)
    jobs.queue("kr", key_rate=key_rate)

    @jobs.task(queue="kr", concurrency_key=lambda account, **_: account)
    def sync(account: str | None) -> None: ...

    return jobs, sync


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
                    concurrency=None,
                    rate=None,
                    period=None,
                    key_limit=limits.get("key_limit"),
                    key_rate=limits["key_rate"],
                    key_period=limits["key_period"],
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


def _logs(db: sa.Engine, queue: str) -> dict[str, Any]:
    with db.connect() as conn:
        return {
            r.key: r for r in conn.execute(sa.select(KEY_STARTS).where(KEY_STARTS.c.queue == queue))
        }


def test_concurrent_claims_share_each_key_rate(db: sa.Engine) -> None:
    """Six connections claim at once: each key starts three jobs a minute, however the
    claims interleave; a key with fewer ready jobs than its rate starts them all; jobs
    without a key are not held; nothing held spends an attempt."""
    jobs, sync = _key_rated("3/minute")

    with db.begin() as conn:
        for account in ("a", "b"):
            jobs.enqueue_many(conn, sync, [{"account": account}] * 12)
        jobs.enqueue_many(conn, sync, [{"account": "c"}] * 2 + [{"account": None}] * 4)
    began = time.monotonic()
    found = _race(db, jobs, "kr", 6, key_rate=3, key_period=60.0)
    took = time.monotonic() - began
    started = [r for r in rows(db) if r.status == "running"]
    by_key: dict[str | None, int] = {}
    for r in started:
        by_key[r.concurrency_key] = by_key.get(r.concurrency_key, 0) + 1
    assert by_key == {"a": 3, "b": 3, "c": 2, None: 4}
    assert {(r.status, r.attempts) for r in rows(db) if r.status != "running"} == {("ready", 0)}
    late = [f for f in found if not f.rows]
    # The key's window opened at its first start, inside the race: a held claim waits
    # what is left of the minute, so no less than 60 s minus the race's own length.
    assert late and all(f.held and 60 - took - 1 < (f.key_free_in or 0) <= 60 for f in late)
    logs = _logs(db, "kr")
    assert sorted(logs) == ["a", "b", "c"]
    now = datetime.now(timezone.utc)
    assert [len(logs[k].log) for k in "abc"] == [3, 3, 2]
    assert logs["a"].full_until is not None and logs["c"].full_until is None
    assert all(abs((now - at).total_seconds()) < 30 for k in "abc" for at in logs[k].log)
    # A second round starts nothing more of a and b, and the last of c... none: c has none.
    again = _race(db, jobs, "kr", 2, key_rate=3, key_period=60.0)
    assert sum(len(f.rows) for f in again) == 0
    # Once the window has passed (moved back, not waited for), a and b get three more.
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"UPDATE {KEY_STARTS.fullname} SET full_until = now() - interval '1 second', "
                "log = ARRAY(SELECT at - interval '61 seconds' FROM unnest(log) AS at)"
            )
        )
    again = _race(db, jobs, "kr", 3, key_rate=3, key_period=60.0)
    assert sum(len(f.rows) for f in again) == 6
    assert [len(_logs(db, "kr")[k].log) for k in "ab"] == [3, 3]


def test_a_log_partly_out_of_its_window_leaves_room_for_what_left_it(db: sa.Engine) -> None:
    """The claim takes a log's length as an upper bound of the starts in the window, and
    counts the log only when that bound says no: a full log of three whose two oldest
    starts have left the window gives its key room for exactly two more, and the key's
    new log is the start still in the window and the two new ones, trimmed and full."""
    jobs, sync = _key_rated("3/minute")

    with db.begin() as conn:
        jobs.enqueue_many(conn, sync, [{"account": "a"}] * 3)
    assert sum(len(f.rows) for f in _race(db, jobs, "kr", 1, key_rate=3, key_period=60.0)) == 3
    with db.begin() as conn:
        jobs.enqueue_many(conn, sync, [{"account": "a"}] * 5)
        # The two oldest starts moved out of the window, the third kept; the key no longer
        # held by full_until, so only its log decides.
        conn.execute(
            sa.text(
                f"UPDATE {KEY_STARTS.fullname} SET full_until = NULL, "
                "log = ARRAY[now() - interval '90 seconds', now() - interval '61 seconds', "
                "now() - interval '10 seconds']"
            )
        )
    found = _race(db, jobs, "kr", 1, key_rate=3, key_period=60.0)
    assert sum(len(f.rows) for f in found) == 2
    log = _logs(db, "kr")["a"]
    now = datetime.now(timezone.utc)
    assert len(log.log) == 3 and 5 < (now - log.log[0]).total_seconds() < 30
    assert all((now - at).total_seconds() < 5 for at in log.log[1:])
    assert log.full_until is not None
    # Full again: nothing more until the oldest start in the window leaves it.
    assert sum(len(f.rows) for f in _race(db, jobs, "kr", 2, key_rate=3, key_period=60.0)) == 0


def test_a_key_held_by_its_rate_wakes_the_worker_when_it_has_room(
    db: sa.Engine, make_worker: Any
) -> None:
    """Two starts per second per key, a poll interval of a minute: six jobs of one key
    take about two seconds (the worker sleeps until the key has room, not to its next
    poll), and the held queue is claimed about once per window, not in a loop, while a job
    of another key and one without a key run at once."""
    jobs = Jobs(app.Job)
    jobs.queue("kr", key_rate="2/s")
    started: dict[str | None, list[float]] = {}

    @jobs.task(queue="kr", concurrency_key=lambda account, **_: account)
    def sync(account: str | None) -> None:
        started.setdefault(account, []).append(time.monotonic())

    claims: list[float] = []

    def seen(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        ours = isinstance(params, dict) and params.get("queue_name") == "kr"
        if ours and "pg_advisory_xact_lock" in statement:
            claims.append(time.monotonic())

    with db.begin() as conn:
        jobs.enqueue_many(
            conn, sync, [{"account": "a"}] * 6 + [{"account": "b"}, {"account": None}]
        )
    sa.event.listen(sa.Engine, "before_cursor_execute", seen)
    try:
        worker = make_worker(jobs, db, queues=["kr"], poll_interval=60, listen=False)
        began = time.monotonic()
        with running(worker):
            wait_for(lambda: count(db, queue="kr") == 0, timeout=20)
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", seen)
    took = time.monotonic() - began
    assert len(started["a"]) == 6 and len(started["b"]) == 1 and len(started[None]) == 1
    a = sorted(started["a"])
    # Two per second: the fifth start comes a second after the third, and so on (less
    # the time a busy machine may take to start a handler after its claim).
    for i in range(2, 6):
        assert a[i] - a[i - 2] >= 0.8, a
    # The other keys are not held behind "a"'s rate: they start with its first window,
    # not with a later one (timed from "a"'s first start, so the worker's own start-up on
    # a busy machine does not count).
    assert started["b"][0] - a[0] < 0.8 and started[None][0] - a[0] < 0.8, (a, started)
    assert 1.9 <= took < 10, took
    # One claim per second of the key's window (three here), give or take: not a claim
    # every LIMIT_RECHECK, nor a loop.
    assert len(claims) <= 6, len(claims)


def test_two_keys_at_ten_per_second_across_workers(
    db: sa.Engine, workers: list[subprocess.Popen[str]]
) -> None:
    """Three worker processes share the key rate "10/s": in no window of a key do more
    than ten of its jobs start, and both keys progress side by side."""
    with server_stamps(db, KEY_STARTS.name, "key", "log") as key_claims:
        workers += _start_workers(3, "key_rated", 8, db)
        with db.begin() as conn:
            for account in ("a", "b"):
                app.limited_jobs.enqueue_many(
                    conn, app.key_rated_work, [{"account": account}] * 100
                )
        wait_for(lambda: count(db, app.Span) >= 1, timeout=30)
        first = min(s.started for s in _spans(db))
        wait_for(lambda: time.time() > first + 3.0, timeout=30, interval=0.05)
        spans = [s for s in _spans(db) if s.started < first + 3.0]
        claimed = key_claims()
    for key in ("a", "b"):
        starts = [s.started for s in spans if s.key == key]
        # The rate holds at the claim, where it is enforced, by the server's clock (see
        # server_stamps: the worker's clock says when a claim was sent).
        stamps = [(at, n) for k, at, n in claimed if k == key]
        assert most_in_a_window(stamps, 1.0) <= 10, (key, stamps)
        # Every job that started was stamped (the trigger saw every claim).
        assert sum(n for _, n in stamps) >= len(starts) > 0, (key, stamps)
        # ... and it is a rate, not a stall: more than one window's ten got through in
        # three windows (a stall would stop at ten), about ten a second on a quiet
        # machine; a slow CI machine's claims spent a third of it waiting (18).
        assert 10 < len(starts) <= 40, (key, len(starts))
    assert len({s.pid for s in spans}) > 1
    assert count(db, status="ready") > 0
    assert all(r.attempts <= 1 for r in rows(db))


def test_retention_forgets_key_logs_that_left_their_window(db: sa.Engine) -> None:
    """A key's log row lives until its newest start leaves the window (``expires_at``),
    then the pruner deletes it; the logs still in their window stay."""
    jobs, sync = _key_rated("5/minute")

    with db.begin() as conn:
        jobs.enqueue_many(conn, sync, [{"account": a} for a in "abc"])
    found = _race(db, jobs, "kr", 1, key_rate=5, key_period=60.0)
    assert len(found[0].rows) == 3 and sorted(_logs(db, "kr")) == ["a", "b", "c"]
    assert prune(db, jobs) == 0  # all three still in their minute
    with db.begin() as conn:
        conn.execute(
            sa.update(KEY_STARTS)
            .where(KEY_STARTS.c.key != "b")
            .values(expires_at=sa.func.now() - interval(1))
        )
    assert prune(db, jobs) == 2
    assert sorted(_logs(db, "kr")) == ["b"]


def test_session_claim_honours_the_key_rate(db: sa.Engine) -> None:
    """``session.claim`` of a key-rated queue starts ten jobs of a key a minute, across
    transactions (the second sees the first's log)."""
    jobs, sync = _key_rated("10/minute")

    with db.begin() as conn:
        jobs.enqueue_many(conn, sync, [{"account": "a"}] * 15)
    with JobSession(db, jobs=jobs) as session, session.begin():
        assert len(session.claim("kr", limit=4)) == 4
    with JobSession(db, jobs=jobs) as session, session.begin():
        assert len(session.claim("kr", limit=20)) == 6
    with JobSession(db, jobs=jobs) as session, session.begin():
        assert session.claim("kr", limit=20) == []
    assert count(db, status="running") == 10 and count(db, status="ready") == 5

"""Fair share between keys (``jobs.queue(name, fair=True, weights=...)``): each claim
shares its jobs between the keys in turn, by weight, so one key's burst does not hold back
the others; claims take no lock and never take a job twice."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, WorkerSettings
from sqla_jobs._queries import claim_params, fair_claim_params, interval
from sqla_jobs.worker import _statements as worker_db

from . import app
from .helpers import count, rows

jobs = app.limited_jobs
shared = app.shared_work
Job = app.Job.__table__


def test_declarations() -> None:
    registry = Jobs(app.Job)
    limits = registry.queue("a", fair=True, weights={"premium": 3, "free": 1})
    assert (limits.fair, limits.limited, limits.keyed) == (True, False, False)
    assert limits.weights == (("free", 1), ("premium", 3))
    assert limits.describe() == "fair share per key (free=1, premium=3)"
    assert registry.queue("b", fair=True).describe() == "fair share per key"

    @registry.task(queue="a", concurrency_key=lambda tenant, **_: tenant)
    def work(tenant: str) -> None: ...

    # A keyed task keeps a fair queue fair: the keys are for the share, not one at a time.
    assert (registry.limits("a").keyed, registry.limits("a").limited) == (False, False)
    for bad, message in (
        ({"fair": True, "concurrency": 3}, "fair=True goes alone in this release"),
        ({"fair": True, "key_order": "fifo"}, "cannot go with key_order"),
        ({"weights": {"x": 2}}, "weights are for fair=True"),
        ({"fair": True, "weights": {"x": 0}}, "must be an integer from 1 to 100"),
        ({"fair": True, "weights": {"x": True}}, "must be an integer from 1 to 100"),
        ({"fair": True, "weights": {"": 2}}, "must be a non-empty string"),
        ({"fair": True, "weights": {"a\x00b": 2}}, "weight's key .* contains a NUL character"),
        ({"fair": True, "weights": {"k" * 2000: 2}}, "at most 1024 are allowed"),
        ({"fair": True, "weights": lambda key: 2}, "a function cannot"),
        ({"fair": "yes"}, "fair must be True or False"),
    ):
        with pytest.raises(ValueError, match=message):
            registry.queue("c", **bad)
    assert "c" not in registry.queue_limits


def _claim(db: sa.Engine, limit: int, after: str | None = None, name: str = "t") -> Any:
    """A fair claim without a floor: its rows and where its walk stopped."""
    return _claim_floored(db, limit, after, name)[:2]


def _claim_floored(
    db: sa.Engine,
    limit: int,
    after: str | None = None,
    name: str = "t",
    floor: tuple[str, int] | None = None,
) -> Any:
    with db.connect() as c:
        conn = c.execution_options(isolation_level="AUTOCOMMIT")
        params = fair_claim_params(
            claim_params("shared", limit, interval(30), name),
            jobs.limits("shared"),
            after,
            floor=floor,
        )
        return worker_db.claim_fair(conn, jobs.queries, params)


def _tenants(db: sa.Engine, ids: list[int]) -> Counter[str | None]:
    return Counter(r.concurrency_key for r in rows(db) if r.id in set(ids))


def _burst(db: sa.Engine, big: int = 2_000, small: int = 20, each: int = 10) -> None:
    """One tenant's burst first, then the others' jobs behind it."""
    with db.begin() as conn:
        jobs.enqueue_many(conn, shared, [{"tenant": "burst"}] * big)
        for _ in range(each):
            jobs.enqueue_many(conn, shared, [{"tenant": f"t{n:02}"} for n in range(small)])


def test_a_burst_does_not_hold_back_the_other_keys(db: sa.Engine) -> None:
    """2,000 jobs of one tenant, then 20 tenants of 10: a claim of 100 gives every tenant
    its turn (4 or 5 each), and the 200 small ones are all claimed among the first 300,
    not after the 2,000."""
    _burst(db)
    claimed, last = _claim(db, 100)
    per = _tenants(db, [r[0] for r in claimed])
    assert len(claimed) == 100 and len(per) == 21
    assert all(4 <= n <= 5 for n in per.values()), per
    total = [r[0] for r in claimed]
    while len(total) < 300:  # a claim comes back short once the small ones run low
        more, last = _claim(db, 100, last)
        assert more
        total += [r[0] for r in more]
    per = _tenants(db, total)
    assert sum(n for t, n in per.items() if t != "burst") == 200, per


def test_claims_smaller_than_the_keys_take_the_keys_in_turn(db: sa.Engine) -> None:
    """A worker whose slots free one or two at a time claims 1 or 2 jobs at once, fewer
    than there are keys: each key's share rounds up to 1, and every pick ties at the first
    turn. The ties go by the walk's order from where the last claim stopped, so the keys
    take turns; by age, every such claim took the burst's oldest job (found by the fault
    suite: 142-237 burst jobs before the last small one, where about 20 were due)."""
    _burst(db, big=300, small=10, each=3)
    order: list[int] = []
    last = None
    while True:
        claimed, last = _claim(db, 1 + len(order) % 2, last)
        if not claimed:
            break
        order += [r[0] for r in claimed]
    keys = [r.concurrency_key for r in sorted(rows(db), key=lambda r: order.index(r.id))]
    last_small = max(i for i, k in enumerate(keys) if k != "burst")
    assert keys[:last_small].count("burst") <= 4, keys[: last_small + 1]
    assert len(order) == 330


def test_the_busiest_key_is_read_from_its_floor(db: sa.Engine) -> None:
    """A claim says which key it took the most from and the last id it took; the next
    claim, given that floor, reads that key from past it (the other keys from their start).
    A job of that key behind the floor, ready again (here: handed back), is not a candidate
    while the floor is used, and is claimed by a claim without one, oldest first."""
    with db.begin() as conn:
        jobs.enqueue_many(conn, shared, [{"tenant": "burst"}] * 30)
        jobs.enqueue_many(conn, shared, [{"tenant": "small"}] * 2)
    claimed, last, floor = _claim_floored(db, 10)
    burst = sorted(r.id for r in rows(db) if r.concurrency_key == "burst")
    taken = [r[0] for r in claimed]
    assert _tenants(db, taken) == {"burst": 5, "small": 2}  # a share of 10 / 2 keys each
    assert floor is not None and floor[0] == "burst"
    assert floor[1] == max(i for i in taken if i in set(burst))
    # The burst's first claimed job is ready again, behind the floor.
    back = min(taken)
    with db.begin() as conn:
        t = app.Job.__table__
        conn.execute(
            t.update().where(t.c.id == back).values(status="ready", locked_by=None, attempts=0)
        )
    more, _, next_floor = _claim_floored(db, 3, last, floor=floor)
    got = [r[0] for r in more]
    assert back not in got and all(i > floor[1] for i in got if i in set(burst)), (got, floor)
    assert next_floor is not None and next_floor[1] > floor[1]
    again, _, _ = _claim_floored(db, 3, last)
    assert back in [r[0] for r in again]


def test_a_weight_gives_its_key_that_many_shares(db: sa.Engine) -> None:
    with db.begin() as conn:
        for tenant in ("premium", "a", "b"):
            jobs.enqueue_many(conn, shared, [{"tenant": tenant}] * 50)
    claimed, _ = _claim(db, 50)
    per = _tenants(db, [r[0] for r in claimed])
    assert per["premium"] == 30 and per["a"] == per["b"] == 10, per


def test_jobs_without_a_key_take_their_turn(db: sa.Engine) -> None:
    with db.begin() as conn:
        jobs.enqueue_many(conn, shared, [{"tenant": None}] * 10)
        jobs.enqueue_many(conn, shared, [{"tenant": "a"}] * 10)
    claimed, _ = _claim(db, 10)
    assert _tenants(db, [r[0] for r in claimed]) == {None: 5, "a": 5}


def test_concurrent_claims_never_take_a_job_twice(db: sa.Engine) -> None:
    """Keyed jobs are locked as they are read, jobs without a key once chosen: both kinds
    are raced (those first in the queue: the claim looks for them among its first ready
    jobs)."""
    with db.begin() as conn:
        jobs.enqueue_many(conn, shared, [{"tenant": None}] * 60)
    _burst(db, big=300, small=10, each=10)
    barrier = threading.Barrier(6)
    found: list[list[int]] = []
    errors: list[BaseException] = []

    def claim(n: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                got, _ = _claim(db, 20, name=f"claimer-{n}")
                found.append([r[0] for r in got])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    claimed = list(itertools.chain(*found))
    assert len(claimed) == len(set(claimed)) > 0
    assert count(db, status="running") == len(claimed)
    assert None in _tenants(db, claimed)  # jobs without a key were among them


def test_session_claim_shares_too(db: sa.Engine) -> None:
    _burst(db, big=100, small=3, each=2)
    with JobSession(db, jobs=jobs) as session:
        claimed = session.claim(queue="shared", limit=8)
        assert Counter(j.concurrency_key for j in claimed) == {
            "burst": 2,
            "t00": 2,
            "t01": 2,
            "t02": 2,
        }
        session.commit()


def test_a_worker_starts_the_small_tenants_early(db: sa.Engine, make_worker: Any) -> None:
    """A worker (threaded, then asyncio) drains the burst and the small tenants: every
    small tenant's job has started before a fifth of the burst has."""
    _burst(db, big=1_000, small=10, each=5)
    settings = WorkerSettings(concurrency=16, claim_limit=50, listen=False)
    worker = make_worker(jobs, db, settings=settings, queues=["shared"])
    assert worker.run_until_empty(timeout=60) == 1_050
    spans = sorted(rows(db, app.Span), key=lambda s: (s.started, s.id))
    small = [i for i, s in enumerate(spans) if s.key != "burst"]
    burst_before = sum(1 for s in spans[: small[-1]] if s.key == "burst")
    assert burst_before < 200, f"{burst_before} of the burst started before the last small job"


def test_keys_with_nothing_ready_hold_up_neither_the_drain_nor_its_end(
    db: sa.Engine, make_worker: Any
) -> None:
    """300 tenants whose one job died (dead jobs are kept a week), and one tenant with 20
    jobs, whose key sorts after them: each claim walks 64 keys, and one that found nothing
    ready is followed at once by the next, from where it stopped. The worker drains the
    tenant in one go, and ``run_until_empty`` ends once it has (it ran a job or two a poll
    interval, a claim that walked dead keys only making the queue dry; and it ended with
    the tenant's jobs left ready, having looked at the dead keys only)."""
    with db.begin() as conn:
        jobs.enqueue_many(conn, shared, [{"tenant": f"t{i:05}"} for i in range(300)])
        conn.execute(
            sa.update(Job)
            .where(Job.c.queue == "shared")
            .values(status="dead", finished_at=sa.func.now(), attempts=1)
        )
        jobs.enqueue_many(conn, shared, [{"tenant": "zz-live"}] * 20)
    settings = WorkerSettings(concurrency=4, listen=False, poll_interval=5.0)
    worker = make_worker(jobs, db, settings=settings, queues=["shared"])
    assert worker.run_until_empty(timeout=4) == 20  # within the first poll interval
    assert count(db, status="ready") == 0

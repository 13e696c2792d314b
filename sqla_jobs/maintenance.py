"""Small duties the workers share, each one statement or a few, each safe to run anywhere.

* :func:`refresh`: promote due scheduled jobs, rescue expired leases, read the paused
  queues and the next due time. Every worker runs it every poll interval: it is a few
  index lookups, SKIP LOCKED keeps concurrent runs apart, and doing it everywhere means no
  leader has to be alive for retries to happen.
* :func:`periodic.enqueue_due <sqla_jobs.periodic.enqueue_due>`: cron ticks, exactly once.
* :func:`prune`: retention. Elected with an advisory lock, so one worker at a time
  deletes, in small batches that never hold locks for long.

They take a plain ``Connection``; the asyncio worker calls them through ``run_sync``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import sqlalchemy as sa

from .queries import Queries

if TYPE_CHECKING:
    from .tasks import Jobs

__all__ = ["Refresh", "prune", "refresh"]

BATCH = 1000


@dataclass(frozen=True)
class Refresh:
    """What a worker learns from :func:`refresh`."""

    #: Seconds until the next scheduled job is due (None: nothing scheduled).
    due_in: float | None
    paused: frozenset[str]


def refresh(conn: sa.Connection, q: Queries, *, rescue: bool) -> Refresh:
    """Rescue expired leases (if asked), promote due jobs, read pause state and due time."""
    if rescue:
        conn.execute(q.rescue, {"limit": BATCH}).all()
    conn.execute(q.promote, {"limit": BATCH}).all()
    paused = frozenset(conn.execute(q.paused).scalars())
    due_in = conn.execute(q.next_due).scalar()
    return Refresh(None if due_in is None else float(due_in), paused)


def prune_batch(
    conn: sa.Connection, jobs: Jobs, statement: sa.Delete, age: timedelta
) -> int | None:
    """Delete one batch (its own short transaction); None if another worker is pruning."""
    if not conn.execute(jobs.queries.try_lock).scalar():
        return None
    return int(conn.execute(statement, {"age": age, "limit": BATCH}).rowcount)


def prune_work(jobs: Jobs) -> list[tuple[sa.Delete, timedelta]]:
    """What retention deletes: dead and cancelled after ``keep_dead``, done after
    ``keep_done``."""
    q = jobs.queries
    return [(q.prune_dead, jobs.keep_dead), (q.prune_done, jobs.keep_done or timedelta(0))]


def prune(engine: sa.Engine, jobs: Jobs, *, max_batches: int = 20) -> int:
    """Run retention; return how many rows were deleted. Does nothing while another
    worker holds the pruner lock."""
    total = 0
    for statement, age in prune_work(jobs):
        for _ in range(max_batches):
            with engine.begin() as conn:
                deleted = prune_batch(conn, jobs, statement, age)
            if deleted is None:
                return total
            total += deleted
            if deleted < BATCH:
                break
    return total

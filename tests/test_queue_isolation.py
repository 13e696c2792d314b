"""One queue's trouble stays that queue's: a claim, a schedule or a promotion the database
refuses (an application's trigger here; a statement timeout, a constraint alike) leaves
every other queue of the worker running as usual."""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from sqla_jobs import Jobs

from .helpers import refusing, rows, running, wait_for


def test_a_queue_whose_claims_are_refused_holds_up_no_other_queue(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """Claims from queue ``bad`` fail for seconds on end: jobs of queue ``good`` start as
    quickly as ever all along (they waited behind the whole loop's pause, which grew to
    seconds as ``bad`` kept failing), and ``bad`` is claimed once it is let be."""
    started: dict[int, float] = {}

    @jobs.task(queue="good")
    def good(i: int) -> None:
        started[i] = time.monotonic()

    @jobs.task(queue="bad")
    def bad() -> None:
        pass

    with Session.begin() as session:
        session.enqueue(bad)
    worker = make_worker(jobs, db, queues=["good", "bad"], poll_interval=0.2)
    with running(worker):
        with refusing(
            db,
            "refuse_claim",
            "BEFORE UPDATE ON JOBS FOR EACH ROW WHEN (NEW.queue = 'bad' "
            "AND NEW.status::text = 'running')",
            "RAISE EXCEPTION 'no claims of queue bad'; RETURN NEW;",
        ):
            end = time.monotonic() + 4.0  # long enough for the pauses to grow past a second
            i = 0
            while time.monotonic() < end:
                with Session.begin() as session:
                    session.enqueue(good, i)
                committed = time.monotonic()
                wait_for(lambda i=i: i in started, timeout=20)
                waited = started[i] - committed
                assert waited < 1.0, f"job {i} of queue good waited {waited:.2f}s"
                threading.Event().wait(0.2)  # pace the rounds
                i += 1
        wait_for(lambda: not rows(db), timeout=20)  # bad's job runs once let be

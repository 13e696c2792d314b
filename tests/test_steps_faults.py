"""Durable steps when the run is stopped or its connections fail: a stop between two
steps starts no further step, a lost connection costs no step's result, a failed
suspension is recorded, and a signal sent under a running step's name is a clear failure,
not a lost claim. Real PostgreSQL, both worker drivers where the case allows."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import AsyncSteps, Jobs, Steps, Worker, admin, current_job
from sqla_jobs.events import JobEvent
from sqla_jobs.model import job_table
from sqla_jobs.worker._core import WorkerCore

from . import app
from .helpers import running, terminate_backend, wait_for

JOBS = job_table(app.Job)


def _row(db: sa.Engine, job_id: int) -> Any:
    with db.connect() as conn:
        return conn.execute(sa.select(JOBS).where(JOBS.c.id == job_id)).one_or_none()


def _enqueue(Session: Any, task: Any) -> int:
    with Session.begin() as session:
        job = session.enqueue(task)
        session.flush()
        return int(job.id)


def _events(jobs: Jobs) -> list[JobEvent]:
    seen: list[JobEvent] = []
    for name in ("failed", "retried", "dead", "snoozed", "cancelled", "succeeded"):
        jobs.events.connect(name, seen.append)
    return seen


def _backends(db: sa.Engine, state: str, like: str, unlike: str = "") -> list[int]:
    """The other backends of this database in ``state`` whose last statement matches
    ``like`` (and not ``unlike``)."""
    with db.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND state = :state AND query ILIKE :like "
                    "AND (:unlike = '' OR query NOT ILIKE :unlike)"
                ),
                {"state": state, "like": like, "unlike": unlike},
            ).scalars()
        )


@pytest.mark.parametrize("kind", ["sleep", "wait"])
def test_a_suspension_that_fails_after_settling_the_claim_is_recorded(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, monkeypatch: Any, kind: str
) -> None:
    """The suspension settles the claim (the heartbeat must not take the suspended row
    for a lost lease), then its UPDATE fails: its backend was terminated. The claim must
    be opened again so that the failure is recorded; it was left settled, the error
    dropped, and the job stayed ``running``, its lease no longer renewed, until the rescue."""
    settle, cut = WorkerCore.settle, []

    def settle_then_cut(self: WorkerCore, job: Any) -> bool:
        settled = settle(self, job)
        if not cut:  # the suspension's transaction waits, idle, after its lock_claim
            # (FOR NO KEY UPDATE without SKIP LOCKED: the heartbeat's renewal, which skips
            # locked rows, may be caught idle before its COMMIT too, and is not the one.)
            cut.extend(_backends(db, "idle in transaction", "%FOR NO KEY UPDATE%", "%SKIP LOCKED%"))
            for pid in cut:
                terminate_backend(db, pid)
        return settled

    monkeypatch.setattr(WorkerCore, "settle", settle_then_cut)
    events = _events(jobs)

    @jobs.task(durable=True, queue="d", max_attempts=5, name="sync_suspender")
    def suspender(steps: Steps) -> None:
        steps.run("one", lambda: 1)
        steps.sleep("nap", 3600) if kind == "sleep" else steps.wait("signal")

    @jobs.task(durable=True, queue="d", max_attempts=5, name="async_suspender")
    async def async_suspender(steps: AsyncSteps) -> None:
        await steps.run("one", lambda: 1)
        await (steps.sleep("nap", 3600) if kind == "sleep" else steps.wait("signal"))

    worker = make_worker(jobs, db, queues=["d"], listen=False, lease=30)
    is_async = not isinstance(worker, Worker)
    job_id = _enqueue(Session, async_suspender if is_async else suspender)
    worker.run_until_empty(timeout=20)
    assert len(cut) == 1
    row = _row(db, job_id)
    names = [e.name for e in events]
    assert row.status in ("scheduled", "ready"), (row.status, names)
    assert names[:2] == ["failed", "retried"], names
    assert "terminat" in (row.last_error or "").lower() or "connection" in row.last_error.lower()


def test_a_timed_out_attempt_starts_no_further_step(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """A timeout decided while the handler's own code ran between two steps: the late
    handler's next ``steps.run`` must not call its function (its checkpoint would be
    refused, and the retry would call it again: a charge made twice)."""
    charges: list[int] = []
    retry_started, late_done = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def charge() -> str:
        charges.append(current_job().attempts)
        return "ch_1"

    @jobs.task(durable=True, queue="d", max_attempts=3, timeout=0.5)
    def fulfil(steps: Steps) -> None:
        steps.run("prepare", lambda: 1)
        me = current_job()
        if me.attempts > 1:
            retry_started.set()
            steps.run("charge", charge)
            return
        try:  # work between two steps that outlasts the timeout, until the retry runs
            assert me.cancelled.wait(10) and retry_started.wait(10)
            steps.run("charge", charge)
        except BaseException as exc:
            refused.append(exc)
            raise
        finally:
            late_done.set()

    job_id = _enqueue(Session, fulfil)
    Worker(jobs, db, queues=["d"], listen=False, concurrency=2).run_until_empty(
        wait_scheduled=3, timeout=20
    )
    assert late_done.wait(10)
    assert _row(db, job_id) is None  # the retry succeeded
    assert charges == [2]
    assert "was not started: this run is over" in str(refused[0])


def test_an_operator_cancel_stops_a_durable_job_before_its_next_step(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    charges: list[int] = []
    between, go = threading.Event(), threading.Event()
    claims: list[Any] = []

    @jobs.task(durable=True, queue="d", max_attempts=3)
    def fulfil(steps: Steps) -> None:
        steps.run("prepare", lambda: 1)
        claims.append(current_job())
        between.set()
        go.wait(10)  # the handler's own work between two steps
        steps.run("charge", lambda: charges.append(1))

    job_id = _enqueue(Session, fulfil)
    worker = Worker(jobs, db, queues=["d"], lease=30)
    with running(worker):
        assert worker.listening.wait(10) and between.wait(10)
        with db.begin() as conn:
            assert admin.cancel_jobs(conn, jobs, ids=[job_id]) == 1
        wait_for(lambda: claims[0].is_cancelled)  # the heartbeat found it cancelled
        go.set()
        wait_for(lambda: worker.core.idle)
    assert _row(db, job_id).status == "cancelled"
    assert charges == []


@pytest.mark.parametrize("with_session", [False, True])
def test_a_signal_sent_under_a_running_step_s_name_fails_the_run_clearly(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, with_session: bool
) -> None:
    """The signal is kept as a wait step's row; the run step's checkpoint then writes
    nothing. That was taken for a lost claim ("no longer this worker's", a ``cancelled``
    event, nothing recorded, the job left running until the rescue): it is the clash of
    two kinds under one name, recorded as the run's failure."""
    events = _events(jobs)

    def plain() -> int:
        with Session.begin() as session:
            assert jobs.signal(session, current_job().id, "charge", {"x": 1}) == "kept"
        return 1

    def sync_step(session: Any) -> int:
        return plain()

    async def async_step(session: Any) -> int:
        return plain()

    @jobs.task(durable=True, queue="d", max_attempts=1, name="sync_signalled")
    def fulfil(steps: Steps) -> None:
        steps.run("charge", sync_step if with_session else plain)

    @jobs.task(durable=True, queue="d", max_attempts=1, name="async_signalled")
    async def async_fulfil(steps: AsyncSteps) -> None:
        await steps.run("charge", async_step if with_session else plain)

    worker = make_worker(jobs, db, queues=["d"], listen=False, lease=30)
    job_id = _enqueue(Session, fulfil if isinstance(worker, Worker) else async_fulfil)
    worker.run_until_empty(timeout=20)
    row = _row(db, job_id)
    assert row.status == "dead"
    assert "step 'charge' is a run step, but a signal was sent under that name" in row.last_error
    assert [e.name for e in events] == ["failed", "dead"]


def test_a_step_connection_lost_while_the_step_ran_keeps_the_step_s_result(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """The run holds one connection, idle, between checkpoints (and while a step's
    function runs: minutes, for an external call). If the server ends it meanwhile (an
    idle reaper, a failover), the checkpoint is sent again on a fresh connection: failing
    the attempt threw away the result in hand, and the retry called the function again."""
    charges: list[int] = []
    cut: list[int] = []

    def charge() -> str:
        charges.append(current_job().attempts)
        if not cut:
            cut.extend(_backends(db, "idle", "%jobs_steps%"))
            for pid in cut:
                terminate_backend(db, pid)
        return "ch_1"

    @jobs.task(durable=True, queue="d", max_attempts=3, name="sync_charger")
    def fulfil(steps: Steps) -> None:
        steps.run("prepare", lambda: 1)
        steps.run("charge", charge)

    @jobs.task(durable=True, queue="d", max_attempts=3, name="async_charger")
    async def async_fulfil(steps: AsyncSteps) -> None:
        await steps.run("prepare", lambda: 1)
        await steps.run("charge", charge)

    worker = make_worker(jobs, db, queues=["d"], listen=False)
    job_id = _enqueue(Session, fulfil if isinstance(worker, Worker) else async_fulfil)
    worker.run_until_empty(wait_scheduled=3, timeout=20)
    assert len(cut) == 1
    assert _row(db, job_id) is None
    assert charges == [1]

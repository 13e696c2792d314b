"""What a step or a job returns, as stored: a step returns on its first run exactly what its
replays read back, a result that cannot be stored fails its job (never the worker), and a
group's callback gets a result for every member or fails saying why."""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from typing import Any

import psycopg.errors
import pytest
import sqlalchemy as sa

from sqla_jobs import AsyncSteps, EnqueueError, Jobs, Steps, Worker, current_job
from sqla_jobs.model import job_table
from sqla_jobs.worker._outage import refused_row

from . import app

JOBS = job_table(app.Job)


def _enqueue(Session: Any, task: Any, *args: Any, **kwargs: Any) -> int:
    with Session.begin() as session:
        job = session.enqueue(task, *args, **kwargs)
        session.flush()
        return int(job.id)


def _row(db: sa.Engine, job_id: int) -> Any:
    with db.connect() as conn:
        return conn.execute(sa.select(JOBS).where(JOBS.c.id == job_id)).one_or_none()


def _is_async(worker: Any) -> bool:
    return not isinstance(worker, Worker)


# -- a step's value: the stored JSON, on the first run too --------------------------------


def _shape(value: Any) -> Any:
    """``value`` with what JSON equality hides: key order, each number's type, the sign of
    a zero."""
    if isinstance(value, dict):
        return [(k, _shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_shape(v) for v in value]
    if isinstance(value, float):
        return ("float", repr(value), math.copysign(1.0, value))
    return (type(value).__name__, value)


def test_a_step_returns_on_its_first_run_what_its_replays_read_back(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A step returned ``json.loads`` of the text Python wrote on its first run, and what
    jsonb stored on a replay: a dict's keys in another order (a loop over it named its
    steps differently, charging one account twice), 1e16 and 1.5e300 as ints, -0.0 as
    0.0. Plain steps and steps that take a session alike."""
    value = {"carol": 1, "alice": [1e16, 1.5e300, -0.0, 0.5], "bob": {"zz": 1, "a": None}}
    seen: list[tuple[Any, Any]] = []

    def plain() -> dict[str, Any]:
        return value

    def with_session(session: Any) -> dict[str, Any]:
        assert session.execute(sa.select(1)).scalar() == 1
        return value

    async def with_async_session(session: Any) -> dict[str, Any]:
        assert (await session.execute(sa.select(1))).scalar() == 1
        return value

    @jobs.task(durable=True, queue="d", max_attempts=3, name="fit_sync_shape")
    def sync_shape(steps: Steps) -> None:
        seen.append((steps.run("plain", plain), steps.run("session", with_session)))
        if current_job().attempts == 1:
            raise RuntimeError("again, from the stored steps")

    @jobs.task(durable=True, queue="d", max_attempts=3, name="fit_async_shape")
    async def async_shape(steps: AsyncSteps) -> None:
        got = (await steps.run("plain", plain), await steps.run("session", with_async_session))
        seen.append(got)
        if current_job().attempts == 1:
            raise RuntimeError("again, from the stored steps")

    worker = make_worker(jobs, db, queues=["d"], listen=False)
    job_id = _enqueue(Session, async_shape if _is_async(worker) else sync_shape)
    worker.run_until_empty(wait_scheduled=3, timeout=20)
    assert _row(db, job_id) is None
    first, replay = seen
    assert _shape(first[0]) == _shape(replay[0])
    assert _shape(first[1]) == _shape(replay[1])
    assert list(first[0]) == list(replay[0]) == ["bob", "alice", "carol"]  # jsonb's order


# -- a step's result that cannot be stored: permanent ------------------------------------


def test_a_step_whose_result_is_not_json_fails_the_job_at_once_without_running_it_again(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """The step's function ran (a card charged), then its result was refused with a
    ``StepError`` that was retried like any error: the card was charged on every attempt,
    for a value that could never be stored."""
    charges: list[int] = []

    def charge() -> Decimal:
        charges.append(current_job().attempts)
        return Decimal("9.99")

    @jobs.task(durable=True, queue="d", max_attempts=3, name="fit_sync_decimal")
    def sync_decimal(steps: Steps) -> None:
        steps.run("charge", charge)

    @jobs.task(durable=True, queue="d", max_attempts=3, name="fit_async_decimal")
    async def async_decimal(steps: AsyncSteps) -> None:
        await steps.run("charge", charge)

    worker = make_worker(jobs, db, queues=["d"], listen=False)
    job_id = _enqueue(Session, async_decimal if _is_async(worker) else sync_decimal)
    worker.run_until_empty(wait_scheduled=3, timeout=20)
    row = _row(db, job_id)
    assert row.status == "dead", row.status
    assert "StepError" in row.last_error and "not JSON" in row.last_error
    assert charges == [1]


def test_a_step_function_that_is_an_unhashable_callable_runs(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A callable dataclass instance (unhashable: ``eq=True``) failed every attempt with
    ``TypeError: unhashable type``, from the cache of whether a function takes a session."""

    @dataclasses.dataclass
    class Fetch:
        url: str

        def __call__(self) -> str:
            return self.url

    @dataclasses.dataclass
    class Save:
        code: str

        def __call__(self, session: Any) -> str:
            session.add(app.Link(code=self.code, url="saved"))
            return self.code

    got: list[Any] = []

    @jobs.task(durable=True, queue="d", max_attempts=1, name="fit_sync_fetch")
    def sync_fetch(steps: Steps) -> None:
        got.append(steps.run("fetch", Fetch("https://example.test/a")))
        got.append(steps.run("save", Save("saved-1")))

    @jobs.task(durable=True, queue="d", max_attempts=1, name="fit_async_fetch")
    async def async_fetch(steps: AsyncSteps) -> None:
        got.append(await steps.run("fetch", Fetch("https://example.test/a")))

    worker = make_worker(jobs, db, queues=["d"], listen=False)
    job_id = _enqueue(Session, async_fetch if _is_async(worker) else sync_fetch)
    worker.run_until_empty(timeout=20)
    row = _row(db, job_id)
    assert row is None, row.last_error[-400:]
    assert got == (
        ["https://example.test/a"] if _is_async(worker) else ["https://example.test/a", "saved-1"]
    )


# -- a result past what jsonb holds: the job fails, the worker goes on -------------------


def test_the_completer_takes_a_program_limit_for_a_row_it_cannot_write_not_an_outage() -> None:
    """SQLSTATE class 54 (a program limit: "total size of jsonb array elements exceeds
    the maximum") was retried as an outage, the same batch for as long as the worker ran;
    it is written apart, as a row refused for what it holds."""
    limit = psycopg.errors.ProgramLimitExceeded("total size of jsonb array elements")
    assert refused_row(limit)
    assert refused_row(sa.exc.OperationalError("UPDATE ...", {}, limit))
    assert not refused_row(psycopg.errors.AdminShutdown("terminating connection"))


def test_a_result_past_what_jsonb_holds_fails_the_job_dead_and_the_worker_goes_on(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """A list of two 128 MiB strings (jsonb holds 256 MiB less a byte in one array): its
    size was checked only when the JSON held a ``{`` or an escape, so PostgreSQL refused
    the completion, which the completer retried for as long as the worker ran, writing no
    later outcome."""
    half = 2**27

    @jobs.task(queue="fit", keep_result=True, max_attempts=3)
    def export() -> list[str]:
        return ["x" * half, "y" * half]

    @jobs.task(queue="fit", keep_result=True)
    def ping() -> str:
        return "pong"

    big_id = _enqueue(Session, export)
    ping_id = _enqueue(Session, ping)
    worker = make_worker(jobs, db, queues=["fit"], listen=False, concurrency=1)
    worker.run_until_empty(timeout=30)
    big = _row(db, big_id)
    assert big.status == "dead" and big.attempts == 1, (big.status, big.attempts)
    assert "ResultError" in big.last_error and "jsonb" in big.last_error, big.last_error[-300:]
    assert jobs.result(db, ping_id, timeout=5) == "pong"


def test_a_group_whose_results_exceed_jsonb_fails_its_callback_dead_and_settles_what_waits(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    """Each member's result fits, their array does not: the release in the last member's
    completion failed with SQLSTATE 54000 (retried for ever, the worker wedged). The
    callback is dead, saying why; what waits on it is cancelled; the members are done."""
    # Two members' results are made big in the database (no 128 MiB over the wire): the
    # third, last to run, makes them so before it returns.
    big = 2**27

    @jobs.task(queue="fit")
    def member(n: int) -> int:
        if n == 3:
            with db.begin() as conn:
                conn.execute(
                    sa.update(JOBS)
                    .where(JOBS.c.id.in_(ids[:2]), JOBS.c.status == "done")
                    .values(result=sa.func.to_jsonb(sa.func.repeat("x", big)))
                )
        return n

    called: list[Any] = []

    @jobs.task(queue="fit", keep_result=True)
    def gather(results: list[Any]) -> None:
        called.append(len(results))

    @jobs.task(queue="fit")
    def after_gather() -> None:
        called.append("after")

    ids: list[int] = []
    with Session.begin() as session:
        members, callback = jobs.group(
            session,
            [
                (member, member.args(1)),
                (member, member.args(2)),
                (member.with_options(delay=3600), member.args(3)),  # held: the last to run
            ],
            then=(gather, gather.args()),
        )
        follower = session.enqueue(after_gather.with_options(after=[callback]))
        session.flush()
        ids.extend(m.id for m in members)
        callback_id, follower_id = callback.id, follower.id
    worker = make_worker(jobs, db, queues=["fit"], listen=False, concurrency=1)
    worker.run_until_empty(timeout=30)
    with db.begin() as conn:
        conn.execute(sa.update(JOBS).where(JOBS.c.id == ids[2]).values(run_at=sa.func.now()))
    worker.run_until_empty(wait_scheduled=1, timeout=30)
    states = {i: _row(db, i) for i in (*ids, callback_id, follower_id)}
    assert [states[i].status for i in ids] == ["done"] * 3
    cb = states[callback_id]
    assert cb.status == "dead", (cb.status, cb.last_error)
    assert "jsonb" in cb.last_error and "jobs.group" in cb.last_error, cb.last_error
    assert cb.finished_at is not None and cb.waiting == 0
    assert states[follower_id].status == "cancelled", states[follower_id].status
    assert called == []
    with pytest.raises(Exception, match="dead"):
        jobs.result(db, callback_id, timeout=5)


# -- a group's member that is an earlier unique job ---------------------------------------


def test_a_group_member_held_by_an_earlier_unique_job_that_keeps_nothing_is_refused_by_name(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    """The member deduplicated onto a live job enqueued earlier without keep_result: that
    job keeps nothing (deleted when it succeeds), and the callback got null for it,
    silently. One that keeps its result gives it."""

    @jobs.task(queue="flow", unique=True)
    def lookup(n: int) -> str:
        return f"found{n}"

    got: list[Any] = []

    @jobs.task(queue="flow")
    def total(results: list[Any]) -> None:
        got.append(results)

    earlier = _enqueue(Session, lookup, 2)  # by something else, keeping nothing
    kept = _enqueue(Session, lookup.with_options(keep_result=True), 3)
    with (
        pytest.raises(EnqueueError, match=rf"member 2 \(.*lookup\) is job {earlier}"),
        Session.begin() as session,
    ):
        jobs.group(
            session,
            [(lookup, lookup.args(1)), (lookup, lookup.args(2))],
            then=(total, total.args()),
        )
    with Session.begin() as session:
        jobs.group(
            session,
            [(lookup, lookup.args(3)), (lookup, lookup.args(4))],
            then=(total, total.args()),
        )
    Worker(jobs, db, queues=["flow"], listen=False).run_until_empty(timeout=20)
    assert got == [["found3", "found4"]]
    assert _row(db, kept).status == "done"

"""Right and wrong calls, for ``tests/test_typing.py`` to type-check (never imported).

A line that must fail ends with ``# E: <mypy error code>``; every other line must pass
both mypy and pyright.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Session
from typing_extensions import assert_type

from sqla_jobs import JobMixin, Jobs, JobSession, Task, Unique
from sqla_jobs.session import AsyncJobSession
from sqla_jobs.sharding import AsyncShardedJobSession, ShardedJobSession


class Base(DeclarativeBase): ...


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)


@jobs.task
def bare(user_id: int) -> None: ...


@jobs.task(queue="mail", max_attempts=3)
def send(to: str, subject: str = "hi", *, cc: list[str] | None = None) -> bool:
    return True


@jobs.task(transactional=True)
def pay(session: Session, payment_id: int) -> None: ...


@jobs.task(transactional=True)
async def pay_async(session: AsyncSession, payment_id: int) -> None: ...


@jobs.task(transactional=True)
def session_last(payment_id: int, session: Session) -> None: ...


@jobs.task(unique=Unique(within=timedelta(hours=1)), keep_result=True)
def once_an_hour(report: str) -> None: ...


@jobs.periodic("0 * * * *")
@jobs.task
def hourly() -> int:
    return 1


# Parameter names cannot be written in a type, so the calls below show that the
# signatures are kept; these show what can be written.
assert_type(hourly, Task[[], int])
assert_type(send("a@example.com"), bool)


def right(s: JobSession) -> None:
    s.enqueue(bare, user_id=1)
    s.enqueue(bare, 1)
    s.enqueue(send, "a@example.com", cc=["b@example.com"])
    s.enqueue(send.with_options(queue="urgent", delay=60, priority=3), to="a@example.com")
    s.enqueue(send.with_options(unique=True).with_options(max_attempts=9), "a@example.com")
    s.enqueue(send.with_options(unique_for=timedelta(minutes=5)), "a@example.com")
    s.enqueue(send.with_options(unique_on_conflict="replace", delay=30), "a@example.com")
    s.enqueue(send.with_options(unique_states=("scheduled", "ready")), "a@example.com")
    s.enqueue(send.with_options(unique=Unique(key="k", on_conflict="replace")), "a@b.c")
    s.enqueue(send.with_options(unique=Unique(within=60, states=["ready"])), "a@b.c")
    s.enqueue(pay, payment_id=1)
    s.enqueue(pay_async, 2)
    s.enqueue(session_last, anything="goes")  # session not first: checked at run time only
    s.enqueue("any.task.name", whatever=1, queue="q")  # by name: never checked
    s.enqueue_many(send, [{"to": "x"}], delay=5)  # mappings: checked at run time only
    s.enqueue_many(send, [send.args("y", subject="s"), send.args(to="z")], priority=1)
    s.enqueue_many(send.with_options(queue="q"), [send.args(to="z")])
    s.enqueue_many(send, [send.args(to="z")], meta={"batch": 7}, unique=Unique())
    assert_type(send("a@example.com", "subject", cc=None), bool)
    pay(s, 5)
    # What an enqueue returns: the job (the model's columns), or None (a scoped unique key
    # held by a job that is gone).
    job = s.enqueue(bare, user_id=1)
    assert_type(job, JobMixin | None)
    assert_type(s.enqueue("any.task.name", whatever=1), JobMixin | None)
    assert_type(s.enqueue(send.with_options(unique=True), "a@example.com"), JobMixin | None)
    if job is not None:
        assert_type(job.id, int)
        assert_type(job.meta, dict[str, Any] | None)
    hourly()


def wrong(s: JobSession) -> None:
    s.enqueue(bare, user=1)  # E: call-overload
    s.enqueue(bare, user_id="1")  # E: call-overload
    s.enqueue(bare)  # E: call-overload
    s.enqueue(send, "a@example.com", queue="q")  # E: call-arg
    s.enqueue(send.with_options(queu="q"), to="a")  # E: call-overload call-arg
    s.enqueue(send.with_options(priority="high"), to="a")  # E: call-overload arg-type
    s.enqueue(pay, payment_id=1, session=s)  # E: call-overload
    s.enqueue_many(send, [bare.args(user_id=1)])  # E: misc
    s.enqueue_many(send, [send.args(too="x")])  # E: call-arg
    s.enqueue_many(send, [{"to": "x"}], queu="q")  # E: call-overload
    bare(wrong=1)  # E: call-arg
    send(1)  # E: arg-type
    pay(payment_id=5)  # E: call-arg
    str(s.enqueue(bare, user_id=1).id)  # E: union-attr
    send.with_options(unique=Unique(on_conflict="drop"))  # E: arg-type
    send.with_options(unique="yes")  # E: arg-type
    jobs.task(unique_key="k")  # E: call-overload


async def right_async(s: AsyncJobSession) -> None:
    s.enqueue(send, "a@example.com")
    await s.enqueue_unique(send.with_options(unique_key="k"), to="a@example.com")
    await s.enqueue_unique(bare, user_id=3)
    assert_type(s.enqueue(send, "a@example.com"), JobMixin)  # never unique: always the job
    assert_type(s.enqueue(send, "a@example.com").id, int)
    assert_type(await s.enqueue_unique(bare, user_id=3), JobMixin | None)
    # enqueue_many is awaited: written at the call, as on every session.
    assert_type(await s.enqueue_many(send, [send.args(to="z")], meta={"batch": 7}), int)
    assert_type(await s.enqueue_many(send, [{"to": "x"}], unique=Unique()), int)


async def wrong_async(s: AsyncJobSession) -> None:
    s.enqueue(send, 1)  # E: call-overload
    await s.enqueue_unique(send, too="a")  # E: call-overload
    await s.enqueue_many(send, [send.args(too="x")])  # E: call-arg
    await s.enqueue_many(send, [{"to": "x"}], queu="q")  # E: call-overload


def right_core(conn: Connection) -> None:
    assert_type(jobs.enqueue(conn, send, "a@example.com", cc=["b@example.com"]), int)
    jobs.enqueue(conn, send.with_options(delay=5), to="a@example.com")
    jobs.enqueue(conn, "any.task.name", whatever=1)
    assert_type(jobs.enqueue_many(conn, send, [send.args("a@example.com")], queue="q"), int)
    jobs.enqueue_many(conn, send, [{"to": "b@example.com"}])


async def right_core_async(conn: AsyncConnection) -> None:
    assert_type(await jobs.enqueue(conn, bare, 1), int)
    assert_type(await jobs.enqueue_many(conn, bare, [bare.args(user_id=2)]), int)


def wrong_core(conn: Connection) -> None:
    jobs.enqueue(conn, send, to=1)  # E: call-overload
    jobs.enqueue(conn, bare, user=1)  # E: call-overload
    jobs.enqueue_many(conn, send, [bare.args(user_id=1)])  # E: misc
    jobs.enqueue_many(conn, send, [{"to": "x"}], queu="q")  # E: call-overload


def right_sharded(s: ShardedJobSession, order: object) -> None:
    assert_type(s.enqueue(send, "a@example.com", cc=None), JobMixin | None)
    s.enqueue(send.with_options(unique=Unique()), to="a@example.com")
    s.enqueue(send, "a@example.com", shard="eu")  # names its shard: arguments unchecked
    s.enqueue(bare, user_id=1, shard_with=order)
    assert_type(s.enqueue_many(send, [{"to": "x"}], shard="eu", meta={"k": 1}), int)


async def right_sharded_async(s: AsyncShardedJobSession) -> None:
    assert_type(s.enqueue(send, "a@example.com"), JobMixin)
    assert_type(await s.enqueue_unique(bare, 1), JobMixin | None)
    assert_type(await s.enqueue_many(bare, [bare.args(2)], shard="us", priority=2), int)


def wrong_sharded(s: ShardedJobSession) -> None:
    s.enqueue(send, to=1)  # E: call-overload
    s.enqueue_many(send, [{"to": "x"}], shard="eu", queu="q")  # E: call-arg

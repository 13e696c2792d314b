"""The type-checked forms of enqueue at run time: options bound with ``with_options``,
``enqueue_many`` rows made with ``task.args``, and the older keyword form beside them."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import ConfiguredTask, EnqueueError, Jobs, Task, TransactionalTask

from .helpers import count, rows


@pytest.fixture
def send(jobs: Jobs) -> Any:
    @jobs.task(queue="mail", max_attempts=3)
    def send_email(to: str, subject: str = "hi", *, cc: list[str] | None = None) -> str:
        return f"{to}:{subject}"

    return send_email


def test_the_decorator_keeps_the_handler_callable(jobs: Jobs, send: Any) -> None:
    assert isinstance(send, Task)
    assert send("a@example.com", subject="s") == "a@example.com:s"

    @jobs.task(transactional=True)
    def pay(session: Any, payment_id: int) -> int:
        return payment_id

    assert isinstance(pay, TransactionalTask) and isinstance(pay, Task)
    assert pay(object(), 7) == 7
    assert pay(payment_id=8, session=object()) == 8  # the older keyword call still works


def test_with_options_binds_options_for_each_enqueue(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    later = send.with_options(queue="urgent", priority=7, max_attempts=9, delay=3600)
    assert isinstance(later, ConfiguredTask)
    assert later.name == send.name
    with Session.begin() as session:
        session.enqueue(later, "a@example.com", cc=["b@example.com"])
    with Session.begin() as session:
        session.enqueue(later, to="c@example.com")  # kept and used again
    first, second = rows(db)
    for row in (first, second):
        assert (row.queue, row.priority, row.max_attempts, row.status) == (
            "urgent",
            7,
            9,
            "scheduled",
        )
        # delay counts from each enqueue, not from with_options()
        assert timedelta(minutes=59) < row.run_at - row.created_at < timedelta(minutes=61)
    assert first.args == {"to": "a@example.com", "cc": ["b@example.com"]}


def test_with_options_chains_and_a_later_option_wins(send: Any) -> None:
    at = datetime(2030, 1, 1, tzinfo=timezone.utc)
    configured = send.with_options(queue="a", delay=5).with_options(queue="b", run_at=at)
    assert configured.options == {"queue": "b", "run_at": at}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queue": ""}, "queue must be a non-empty string"),
        ({"priority": -1}, "priority must be >= 0"),
        ({"max_attempts": 0}, "max_attempts must be an integer >= 1"),
        ({"delay": -1}, "delay must be a number of seconds >= 0"),
        ({"run_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"unique_key": ""}, "unique_key must be a non-empty string"),
        ({"unique_key": "k" * 2000}, "unique_key"),
        ({"delay": 5, "run_at": datetime(2030, 1, 1, tzinfo=timezone.utc)}, "not both"),
    ],
)
def test_with_options_checks_options_at_once(send: Any, options: Any, message: str) -> None:
    with pytest.raises(EnqueueError, match=message):
        send.with_options(**options)


def test_an_option_given_twice_is_refused(Session: Any, db: sa.Engine, send: Any) -> None:
    with Session() as session:
        with pytest.raises(EnqueueError, match="option 'queue' given both"):
            session.enqueue(send.with_options(queue="a"), "x@example.com", queue="b")
        with pytest.raises(EnqueueError, match="run_at or delay, not both"):
            session.enqueue(
                send.with_options(delay=5), "x@example.com", run_at=datetime.now(timezone.utc)
            )
        assert not session.new
        # Options bound by with_options and others given as keywords add up.
        session.enqueue(send.with_options(queue="a"), "x@example.com", priority=2)
        session.commit()
    (row,) = rows(db)
    assert (row.queue, row.priority) == ("a", 2)


def test_configured_unique_enqueue_returns_the_live_job(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    unique = send.with_options(unique=True)
    with Session.begin() as session:
        first = session.enqueue(unique, "a@example.com")
        again = session.enqueue(unique, to="a@example.com")
        assert again is first
        keyed = send.with_options(unique_key="mail:b")
        assert session.enqueue(keyed, "b@example.com") is session.enqueue(keyed, "c@example.com")
    assert count(db) == 2


def test_enqueue_many_takes_task_args(Session: Any, db: sa.Engine, send: Any) -> None:
    with Session.begin() as session:
        n = session.enqueue_many(
            send.with_options(queue="bulk"),
            [send.args("a@example.com"), send.args(to="b@example.com", cc=["c@example.com"])],
            priority=4,
        )
        assert n == 2
    assert [(r.args, r.queue, r.priority) for r in rows(db)] == [
        ({"to": "a@example.com"}, "bulk", 4),
        ({"to": "b@example.com", "cc": ["c@example.com"]}, "bulk", 4),
    ]


def test_enqueue_many_checks_task_args_at_run_time_too(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        with pytest.raises(EnqueueError, match="missing a required argument: 'to'"):
            session.enqueue_many(send, [send.args(to="a"), send.args(too="b")])
        with pytest.raises(EnqueueError, match="same unique_key"):
            session.enqueue_many(send.with_options(unique_key="k"), [send.args(to="a")])
        session.commit()
    assert count(db) == 0


def test_async_session_takes_configured_tasks(
    db: sa.Engine, database_url: str, jobs: Jobs, send: Any
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    async def main() -> None:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            session.enqueue(send.with_options(priority=5), "a@example.com")
            with pytest.raises(EnqueueError, match="enqueue_unique"):
                session.enqueue(send.with_options(unique=True), "b@example.com")
            first = await session.enqueue_unique(send.with_options(queue="u"), "b@example.com")
            again = await session.enqueue_unique(send.with_options(queue="u"), "b@example.com")
            assert again is first
            keyed = send.with_options(unique_key="k")
            await session.enqueue_unique(keyed, "c@example.com")
            await session.commit()
        await engine.dispose()

    asyncio.run(main())
    got = {r.args["to"]: (r.priority, r.queue, r.unique_key) for r in rows(db)}
    assert got["a@example.com"] == (5, "mail", None)
    assert got["b@example.com"][1] == "u" and got["b@example.com"][2] is not None
    assert got["c@example.com"][2] == "k"

"""The asyncio worker cancelled: a cancel landing while a claim's rows come back, a second
cancel during the grace period, ``asyncio.run``'s teardown (every task cancelled at
once), and a worker run twice at once."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, Worker

from .helpers import count, rows, wait_for


def _statuses(db: sa.Engine) -> list[str]:
    return [r.status for r in rows(db)]


def _left(db: sa.Engine) -> int:
    """Jobs ready or running."""
    return count(db, status="ready") + count(db, status="running")


async def _pending_tasks() -> list[str]:
    me = asyncio.current_task()
    return sorted(t.get_name() for t in asyncio.all_tasks() if t is not me and not t.done())


def test_cancel_landing_as_the_claims_rows_come_back_hands_them_back(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, monkeypatch: Any
) -> None:
    """The claim committed on the server (autocommit); the cancel lands just as its rows
    are read: the rows reach the core, and the shutdown hands the jobs back unstarted.
    They were dropped, and stayed ``running`` until their lease (here 60 s)."""
    import psycopg

    from sqla_jobs.aio import AsyncWorker

    ran: list[int] = []

    @jobs.task(queue="q")
    async def work(n: int) -> None:
        ran.append(n)

    with Session.begin() as session:
        for n in range(3):
            session.enqueue(work, n)

    target: list[asyncio.Task[Any]] = []
    fetchall = psycopg.AsyncCursor.fetchall

    async def cancelling_fetchall(self: Any) -> Any:
        got = await fetchall(self)
        query = getattr(getattr(self, "_query", None), "query", b"")
        if got and b"WITH next_jobs" in query and target and not target[0].done():
            task = target.pop()
            task.cancel()  # lands while the rows are on their way back to the claim
            await asyncio.sleep(0)
        return got

    monkeypatch.setattr(psycopg.AsyncCursor, "fetchall", cancelling_fetchall)

    async def main() -> str:
        worker = AsyncWorker(
            jobs, database_url, queues=["q"], listen=False, poll_interval=0.05, lease=60
        )
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        target.append(task)
        try:
            await asyncio.wait_for(task, 20)
            return "returned"
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            await worker.engine.dispose()

    assert asyncio.run(main()) == "cancelled"
    assert not target, "the claim's rows were never read"
    assert ran == []
    assert _statuses(db) == ["ready"] * 3  # handed back, unstarted


@pytest.mark.parametrize("first", ["cancel", "stop"])
def test_cancel_during_the_grace_period_ends_it_and_still_hands_back(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, first: str
) -> None:
    """A cancel (the first one's ``wait_for``, say) while the shutdown waits out the grace
    period means the grace period is over: the handler is cancelled, its job handed
    back, the duties ended, and the run raises CancelledError. It cut the shutdown
    short: no hand-back, duties left pending, the job ``running`` until its lease."""
    from sqla_jobs.aio import AsyncWorker

    started = threading.Event()
    cancelled: list[str] = []

    @jobs.task(queue="q")
    async def long() -> None:
        started.set()
        try:
            await asyncio.sleep(20)
        except asyncio.CancelledError:
            cancelled.append("handler")
            raise

    with Session.begin() as session:
        session.enqueue(long)

    async def main() -> dict[str, Any]:
        worker = AsyncWorker(
            jobs, database_url, queues=["q"], listen=True, poll_interval=0.05, grace_period=30
        )
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        await asyncio.to_thread(started.wait, 10)
        if first == "cancel":
            task.cancel()
        else:
            worker.stop()
        deadline = time.monotonic() + 10
        while not worker.core.shutting_down and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # in the grace period's wait
        t0 = time.monotonic()
        task.cancel()
        out: dict[str, Any] = {}
        try:
            await asyncio.wait_for(task, 15)
            out["run"] = "returned"
        except asyncio.CancelledError:
            out["run"] = "cancelled"
        out["took"] = time.monotonic() - t0
        out["pending"] = await _pending_tasks()
        await worker.engine.dispose()
        return out

    out = asyncio.run(main())
    assert out["run"] == "cancelled", out
    assert out["took"] < 10, out  # not the 30 s grace period
    assert out["pending"] == [], out
    assert cancelled == ["handler"], out
    assert _statuses(db) == ["ready"], out


def test_asyncio_run_teardown_writes_the_outcomes_waiting_in_the_batch(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """``asyncio.run`` cancels every task at once, the completer's among them, while a
    finished job's outcome waits in its batch (``completion_interval``, lingering while
    another job runs): the completer outlives the cancel and writes it. It died with the
    batch, and the finished job stayed ``running`` until its lease, then ran again. The
    handler the teardown cancels is handed back, not failed."""
    from sqla_jobs.aio import AsyncWorker

    done: list[str] = []
    started = threading.Event()

    @jobs.task(queue="q")
    async def quick() -> None:
        done.append("quick")

    @jobs.task(queue="q", max_attempts=1)
    async def slow() -> None:
        started.set()
        await asyncio.sleep(30)

    with Session.begin() as session:
        session.enqueue(slow)
    with Session.begin() as session:
        session.enqueue(quick)

    async def main() -> None:
        w = AsyncWorker(
            jobs,
            database_url,
            queues=["q"],
            listen=False,
            poll_interval=0.05,
            completion_interval=10.0,
            concurrency=2,
            lease=60,
        )
        # Left running when main returns (held, so that it is not collected meanwhile).
        holder.append(asyncio.create_task(w.run(install_signal_handlers=False)))
        deadline = time.monotonic() + 10
        while not (done and started.is_set()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the completer has taken the outcome, and lingers
        # main returns: asyncio.run cancels what is left, at once

    holder: list[asyncio.Task[None]] = []
    t0 = time.monotonic()
    asyncio.run(main())
    took = time.monotonic() - t0
    assert done == ["quick"]
    left = {r.task.rsplit(".", 1)[1]: r.status for r in rows(db)}
    # A success without a kept result is deleted.
    assert left.get("quick", "succeeded") == "succeeded", left
    # The handler cancelled by the teardown: not its failure (it would be dead, at
    # max_attempts=1), nor left running; it runs again.
    assert left["slow"] in ("ready", "scheduled"), left
    assert took < 8, took


def test_second_async_run_is_refused(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A second ``run()`` of one AsyncWorker while the first runs is refused, and the
    first goes on unharmed. It replaced the first's connections and tasks."""
    from sqla_jobs.aio import AsyncWorker

    ran: list[int] = []

    @jobs.task(queue="q")
    async def work(n: int) -> None:
        ran.append(n)

    async def main() -> tuple[str, int]:
        worker = AsyncWorker(jobs, database_url, queues=["q"], listen=False, poll_interval=0.05)
        first = asyncio.create_task(worker.run(install_signal_handlers=False))
        deadline = time.monotonic() + 10
        while worker.core._state != "running" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match=r"AsyncWorker.run\(\) is already running") as e:
            await asyncio.wait_for(worker.run_until_empty(), 5)
        with Session.begin() as session:
            for n in range(5):
                session.enqueue(work, n)
        await asyncio.to_thread(lambda: wait_for(lambda: len(ran) == 5 and not _left(db)))
        worker.stop()
        await asyncio.wait_for(first, 15)
        # Once the first has ended, the worker runs again.
        n = await asyncio.wait_for(worker.run_until_empty(), 15)
        await worker.engine.dispose()
        return str(e.value), n

    message, n = asyncio.run(main())
    assert "already running" in message and n == 0
    assert sorted(ran) == list(range(5)) and not _left(db)


def test_second_threaded_run_is_refused(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    """The threaded Worker likewise: a second ``run()`` from another thread is refused."""

    ran: list[int] = []

    @jobs.task(queue="q")
    def work(n: int) -> None:
        ran.append(n)

    worker = Worker(jobs, db, queues=["q"], listen=False, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        wait_for(lambda: worker.core._state == "running")
        with pytest.raises(RuntimeError, match=r"Worker.run\(\) is already running"):
            worker.run_until_empty(timeout=5)
        with Session.begin() as session:
            for n in range(5):
                session.enqueue(work, n)
        wait_for(lambda: len(ran) == 5 and not _left(db))
    finally:
        worker.stop()
        thread.join(15)
    assert not thread.is_alive()
    assert worker.run_until_empty(timeout=5) == 0  # runs again once the first has ended


def test_an_event_loop_blocked_past_a_beat_is_said_once(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, caplog: Any
) -> None:
    """An ``async def`` handler that blocks the event loop (``time.sleep``) longer than a
    third of the lease: the heartbeat could not renew the leases, and says so, once for
    the stall (not at every tick after it). Nothing was said; the job just ran twice."""
    import logging

    from sqla_jobs.aio import AsyncWorker

    @jobs.task(queue="q")
    async def blocking() -> None:
        # The mistake: a blocking call in an async def, twice, the loop let go of only
        # for a moment in between (the heartbeat's next tick late too: the same stall).
        time.sleep(1.25)
        await asyncio.sleep(0.05)
        time.sleep(1.25)

    with Session.begin() as session:
        session.enqueue(blocking)
    caplog.set_level(logging.INFO, logger="sqla_jobs")

    async def main() -> None:
        w = AsyncWorker(jobs, database_url, queues=["q"], listen=False, lease=3.0)
        try:
            await asyncio.wait_for(w.run_until_empty(timeout=15), 20)
        finally:
            await w.engine.dispose()

    asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "event loop was blocked" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("worker ") and r"leases may have lapsed" in said[0], said


def test_durable_plain_steps_run_in_the_workers_own_threads(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A durable ``async def`` handler's plain (blocking) step runs in the worker's own
    handler threads, one per slot, as a plain handler does: not in the loop's default
    executor, shared with the application (here of one thread), where the steps of
    ``concurrency`` jobs waited for each other."""
    from concurrent.futures import ThreadPoolExecutor

    from sqla_jobs.aio import AsyncWorker

    lock = threading.Lock()
    inside = [0]
    peak = [0]
    release = threading.Event()
    names: list[str] = []

    def block(n: int) -> int:
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            names.append(threading.current_thread().name)
        release.wait(20)
        with lock:
            inside[0] -= 1
        return n

    @jobs.task(durable=True, queue="d")
    async def flow(n: int, steps: Any) -> None:
        await steps.run("block", block, n)

    with Session.begin() as session:
        for n in range(3):
            session.enqueue(flow, n)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))  # the application's, busy or small
        w = AsyncWorker(jobs, database_url, queues=["d"], listen=False, concurrency=3)
        run = asyncio.create_task(w.run_until_empty(timeout=30))
        deadline = time.monotonic() + 8
        while peak[0] < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seen = peak[0]
        release.set()
        await asyncio.wait_for(run, 30)
        await w.engine.dispose()
        return seen

    seen = asyncio.run(main())
    assert seen == 3, f"only {seen} of 3 plain steps ran at once (concurrency=3)"
    assert set(names) == {"sqla-jobs-handler"}, names
    assert _statuses(db) in ([], ["succeeded"] * 3)


@pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="Task.cancelling() is Python 3.11's: before it, every CancelledError a handler "
    "ends with is taken for a cancel from outside, and handed back",
)
def test_a_handlers_own_cancelled_error_is_its_failure(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """A handler that raises ``CancelledError`` of its own (a future it awaited was
    cancelled), its task not cancelled: its failure, by its retry policy; not handed
    back as a handler cancelled from outside is (run again, the attempt not counted)."""
    from sqla_jobs.aio import AsyncWorker

    calls: list[int] = []

    @jobs.task(queue="q", max_attempts=1)
    async def own() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise asyncio.CancelledError()

    with Session.begin() as session:
        session.enqueue(own)

    async def main() -> None:
        w = AsyncWorker(jobs, database_url, queues=["q"], listen=False, poll_interval=0.05)
        try:
            await asyncio.wait_for(w.run_until_empty(timeout=10), 15)
        finally:
            await w.engine.dispose()

    asyncio.run(main())
    assert len(calls) == 1
    assert _statuses(db) == ["dead"]


def test_asyncio_run_teardown_while_outcomes_are_being_written(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, caplog: Any, monkeypatch: Any
) -> None:
    """``asyncio.run``'s teardown cancels every task, the statement's own too, while the
    completer's write is on its way: the statement runs to its end, and its result is the
    completer's. Cancelled, it left the completer unable to tell whether the outcomes
    were written (a failure, logged with its traceback, and the write sent again)."""
    import logging

    import psycopg

    from sqla_jobs.aio import AsyncWorker

    done: list[int] = []
    writing = threading.Event()
    execute = psycopg.AsyncCursor.execute

    async def slow_write(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        text = query if isinstance(query, (bytes, str)) else b""
        sql = text.decode() if isinstance(text, bytes) else text
        if "USING unnest" in sql and not writing.is_set():
            writing.set()
            await asyncio.sleep(0.3)  # the teardown lands meanwhile
        return await execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", slow_write)

    @jobs.task(queue="q")
    async def quick() -> None:
        done.append(1)

    with Session.begin() as session:
        session.enqueue(quick)
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    holder: list[asyncio.Task[None]] = []

    async def main() -> None:
        w = AsyncWorker(jobs, database_url, queues=["q"], listen=False, poll_interval=0.05)
        holder.append(asyncio.create_task(w.run(install_signal_handlers=False)))
        await asyncio.to_thread(writing.wait, 10)
        # main returns: asyncio.run cancels what is left, the write's task too

    asyncio.run(main())
    assert writing.is_set() and done == [1]
    assert _statuses(db) in ([], ["succeeded"])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors


@pytest.mark.parametrize("kind", ["transactional", "durable"])
def test_asyncio_run_teardown_hands_back_transactional_and_durable_handlers(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str, kind: str
) -> None:
    """As a plain handler, a transactional or durable one whose task the teardown
    cancels is handed back (its transaction rolled back), not failed: at
    ``max_attempts=1`` it died."""
    from sqla_jobs.aio import AsyncWorker

    started = threading.Event()

    if kind == "transactional":

        @jobs.task(queue="q", max_attempts=1, transactional=True)
        async def slow(*, session: Any) -> None:
            await session.execute(sa.text("select 1"))
            started.set()
            await asyncio.sleep(30)

    else:

        @jobs.task(queue="q", max_attempts=1, durable=True)
        async def slow(steps: Any) -> None:
            await steps.run("one", lambda: 1)
            started.set()
            await asyncio.sleep(30)

    with Session.begin() as session:
        session.enqueue(slow)
    holder: list[asyncio.Task[None]] = []

    async def main() -> None:
        w = AsyncWorker(jobs, database_url, queues=["q"], listen=False, poll_interval=0.05)
        holder.append(asyncio.create_task(w.run(install_signal_handlers=False)))
        await asyncio.to_thread(started.wait, 10)
        # main returns: asyncio.run cancels what is left, at once

    asyncio.run(main())
    assert started.is_set()
    assert _statuses(db)[0] in ("ready", "scheduled"), [(r.status, r.last_error) for r in rows(db)]

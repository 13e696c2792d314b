"""The worker's connections against a pool its handlers empty, and session.claim's isolation
check behind a transaction-mode PgBouncer.

- The heartbeat renews leases on a connection of its own (``Conn.BEAT``), taken before any
  handler runs: plain handlers that use the worker's engine (``--engine myapp.db:engine``,
  the application's Session) once held every pooled connection, the heartbeat's
  ``engine.begin()`` waited on the pool past the lease, and the jobs ran again elsewhere.
- The worker's connection budget (``MIN_CONNECTIONS``) counts that connection.
- ``session.claim`` of a limited queue asks the isolation level in the claim's own
  transaction: asked in a transaction of its own, behind PgBouncer the claim could run on
  another server connection, at another level.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, Worker, create_engine
from sqla_jobs.worker import _steps as s
from sqla_jobs.worker._driver import MIN_CONNECTIONS, check_pool, handler_connections

from . import app
from .faults.bouncer import Bouncer, available
from .helpers import count, wait_for

#: Running rows whose lease has passed.
LAPSED = sa.text(
    f'SELECT count(*) FROM "{app.SCHEMA}".jobs '
    "WHERE status = 'running' AND locked_until < clock_timestamp()"
)


# -- 1. the heartbeat's own connection -----------------------------------------------------


@pytest.mark.parametrize("kind", ["threads", "asyncio"])
def test_plain_handlers_holding_every_pooled_connection_do_not_stop_the_heartbeat(
    kind: str, db: sa.Engine, database_url: str, jobs: Jobs, Session: Any
) -> None:
    """Pool of MIN_CONNECTIONS (check_pool accepts it), concurrency=3: plain handlers that
    each hold one of the worker's engine's connections while they work leave none free
    (and one of them waits for one). Over four leases' worth of time no lease lapses, and
    every job runs once."""
    lease = 1.2
    runs: list[int] = []
    holding: list[int] = []
    release = threading.Event()
    if kind == "threads":
        engine: Any = create_engine(
            database_url, pool_size=MIN_CONNECTIONS, max_overflow=0, pool_timeout=20
        )

        @jobs.task(queue="q")
        def hold(i: int) -> None:
            runs.append(i)
            with engine.connect() as conn:  # the application's Session, say
                conn.execute(sa.text("SELECT 1"))
                holding.append(i)
                release.wait(20)

        worker: Any = Worker(
            jobs, engine, queues=["q"], concurrency=3, lease=lease, listen=False, name="A"
        )
    else:
        from sqlalchemy.ext.asyncio import create_async_engine

        from sqla_jobs.aio import AsyncWorker

        engine = create_async_engine(
            database_url.replace("postgresql://", "postgresql+psycopg://", 1)
            if database_url.startswith("postgresql://")
            else database_url,
            pool_size=MIN_CONNECTIONS,
            max_overflow=0,
            pool_timeout=20,
        )

        @jobs.task(queue="q")
        async def hold(i: int) -> None:
            runs.append(i)
            async with engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
                holding.append(i)
                while not release.is_set():
                    await asyncio.sleep(0.02)

        worker = AsyncWorker(
            jobs, engine, queues=["q"], concurrency=3, lease=lease, listen=False, name="A"
        )

    with Session.begin() as session:
        for i in range(3):
            session.enqueue(hold, i)

    def run() -> None:
        if kind == "threads":
            worker.run(install_signal_handlers=False)
            return

        async def main() -> None:
            try:
                await worker.run(install_signal_handlers=False)
            finally:
                await engine.dispose()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    rescuer: Worker | None = None
    rescuing: threading.Thread | None = None
    try:
        wait_for(lambda: len(holding) >= 2 and len(runs) == 3, timeout=15)
        # Another worker rescues whatever lease passes, and would run it again.
        rescuer = Worker(
            jobs, db, queues=["q"], lease=lease, listen=False, name="B",
            rescue_interval=0.2, poll_interval=0.1,
        )  # fmt: skip
        rescuing = threading.Thread(
            target=rescuer.run, kwargs={"install_signal_handlers": False}, daemon=True
        )
        rescuing.start()
        stop = threading.Event()
        threading.Timer(4 * lease, stop.set).start()
        while not stop.is_set():
            with db.connect() as conn:
                assert conn.execute(LAPSED).scalar() == 0, "a lease lapsed"
            assert len(runs) == 3, f"ran again: {runs}"
            stop.wait(0.1)
        release.set()
        wait_for(lambda: count(db) == 0, timeout=20)
    finally:
        release.set()
        worker.stop()
        if rescuer is not None:
            rescuer.stop()
        thread.join(30)
        if rescuing is not None:
            rescuing.join(30)
        if kind == "threads":
            engine.dispose()
    assert sorted(runs) == [0, 1, 2]


def test_the_heartbeat_renews_on_its_own_held_connection() -> None:
    """The beat is an ``Io`` on ``Conn.BEAT``, not a pooled ``Conn.TX`` transaction."""
    from .unit.test_core import make, row

    core, _, _ = make()
    core.claimed([row(1)])
    step = next(core.heartbeat.beat())
    assert isinstance(step, s.Io) and step.on is s.Conn.BEAT


# -- 2. the budget -------------------------------------------------------------------------


def _engine(size: int, overflow: int) -> sa.Engine:
    return create_engine(
        "postgresql+psycopg://nobody@127.0.0.1:1/none", pool_size=size, max_overflow=overflow
    )


def test_the_budget_counts_the_heartbeats_connection() -> None:
    """Claims, completions and the heartbeat, held, and one for presence and maintenance:
    three connections no longer pass check_pool, and handlers get what is left of four."""
    assert MIN_CONNECTIONS == 4
    small = _engine(3, 0)
    with pytest.raises(ValueError, match="a third for its heartbeat"):
        check_pool(small)
    check_pool(_engine(4, 0))
    assert handler_connections(_engine(4, 1), 6) == 1
    assert handler_connections(_engine(6, 4), 6) is None


def test_a_short_pool_says_plain_handlers_using_the_engine_need_connections(
    database_url: str, caplog: Any
) -> None:
    """Only plain tasks: no semaphore bounds them, but the start still says (as information)
    that those using the engine need a connection each; with a transactional task, the
    warning says it too."""
    caplog.set_level(logging.INFO, logger="sqla_jobs")
    plain = Jobs(app.Job)

    @plain.task(queue="q")
    def work() -> None: ...

    engine = create_engine(database_url, pool_size=4, max_overflow=2)
    try:
        Worker(plain, engine, queues=["q"], concurrency=8, listen=False)
        said = [r for r in caplog.records if "plain handlers that use this engine" in r.message]
        assert said and said[0].levelno == logging.INFO, caplog.text
        assert "pool_size + max_overflow >= 12" in said[0].message
        caplog.clear()

        @plain.task(queue="q", transactional=True)
        def write(session: Any) -> None: ...

        Worker(plain, engine, queues=["q"], concurrency=8, listen=False)
        said = [r for r in caplog.records if "plain handlers that use this engine" in r.message]
        assert said and said[0].levelno == logging.WARNING, caplog.text
        assert "at most 2 transactional or durable handlers" in said[0].message
    finally:
        engine.dispose()


# -- 3. session.claim behind PgBouncer -----------------------------------------------------


@pytest.fixture
def bouncer(database_url: str) -> Iterator[Bouncer]:
    if not available():
        pytest.skip("pgbouncer is not installed")
    url = sa.make_url(database_url)
    if not url.host:
        # The embedded server listens on a socket of its own, which PgBouncer (run as
        # another system user, on TCP) does not reach: the server run covers this.
        pytest.skip("PgBouncer is put in front of a server on TCP (DATABASE_URL)")
    pg = types.SimpleNamespace(port=url.port or 5432, system_user="postgres")
    server = Bouncer(pg, pool_size=1)  # type: ignore[arg-type]
    with (server.dir / "pgbouncer.ini").open("a") as ini:
        ini.write("admin_users = postgres\n")
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


def _servers(bouncer: Bouncer) -> str:
    """PgBouncer's SHOW SERVERS (its admin console speaks the simple protocol: psql)."""
    return subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(bouncer.port), "-U", "postgres", "-d",
         "pgbouncer", "-tAc", "SHOW SERVERS"],
        check=True, capture_output=True, text=True, timeout=10,
    ).stdout  # fmt: skip


@pytest.fixture
def repeatable_read_by_default(db: sa.Engine) -> Iterator[Any]:
    """Call it: new server sessions of the database begin REPEATABLE READ (reset after)."""
    name = db.url.database
    auto = db.execution_options(isolation_level="AUTOCOMMIT")

    def set_it() -> None:
        with auto.connect() as conn:
            conn.exec_driver_sql(
                f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
            )

    yield set_it
    with auto.connect() as conn:
        conn.exec_driver_sql(f'ALTER DATABASE "{name}" RESET default_transaction_isolation')


def test_session_claim_behind_pgbouncer_checks_the_level_of_its_own_transaction(
    db: sa.Engine, database_url: str, bouncer: Bouncer, repeatable_read_by_default: Any
) -> None:
    """The server connection PgBouncer gave the check is replaced before the claim's
    transaction (server_lifetime, server_idle_timeout would), by one that begins
    REPEATABLE READ: session.claim refuses, or claims at READ COMMITTED. It checked on the
    old connection and claimed on the new one, at REPEATABLE READ."""
    jobs = app.limited_jobs
    with db.begin() as conn:
        jobs.enqueue_many(conn, app.limited_work, [{"seconds": 0}])
    name = sa.make_url(database_url).database
    behind = create_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{bouncer.port}/{name}?prepare_threshold=None",
        pool_size=1,
        max_overflow=0,
    )
    try:
        with behind.connect() as conn:
            first = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        repeatable_read_by_default()
        replaced = threading.Event()

        @sa.event.listens_for(behind, "before_cursor_execute")
        def replace(*args: Any) -> None:
            # At the session's first statement: the old check had run by then (straight on
            # the driver's cursor), the claim's transaction had not begun.
            if not replaced.is_set():
                replaced.set()
                with db.connect() as direct:
                    direct.execute(sa.text("SELECT pg_terminate_backend(:p, 10000)"), {"p": first})
                wait_for(lambda: f"|{first}|" not in _servers(bouncer))

        claimed: list[Any] = []
        with JobSession(behind, jobs=jobs) as session, session.begin():
            try:
                claimed = session.claim("limited")
            except ValueError as exc:
                assert "only enforce under READ COMMITTED" in str(exc)
                assert "REPEATABLE READ" in str(exc)
                session.rollback()
                return
            level = session.execute(sa.text("SHOW transaction_isolation")).scalar()
            ids = [job.id for job in claimed]
        assert replaced.is_set()
        assert not ids or level == "read committed", f"claimed {ids} at {level}"
    finally:
        behind.dispose()
    assert count(db, status="running") <= 1

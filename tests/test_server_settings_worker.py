"""The worker's own writes and reads under the server settings deployments use: a database
or a connection that is not UTF-8 (LATIN1, a WIN1252 client), and a ``DateStyle`` that is
not ISO.

Self-contained: each test makes its own database (``<db>_enc_<suffix>``) on the server in
``DATABASE_URL`` (the encoding and ``ALTER DATABASE ... SET`` are per database) and drops
it at the end. Run with -n0.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs import (
    Backoff,
    JobFailedError,
    JobMixin,
    Jobs,
    Worker,
    WorkerError,
    create_async_engine,
    create_engine,
    current_job,
)
from sqla_jobs.db import normalize_url
from sqla_jobs.worker import _statements

SCHEMA = "enc_settings"


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


@pytest.fixture
def database(database_url: str) -> Iterator[Any]:
    """``make(suffix, encoding=None, settings={})``: a scratch database with the tables,
    and ``ALTER DATABASE ... SET`` for each setting; its URL. (On this worker's database
    server, asked of the fixture: read from ``DATABASE_URL`` it was there only once
    another test of the worker had set the variable, and a worker whose first test was
    one of these failed.)"""
    base = normalize_url(database_url)
    made: list[str] = []
    admin = create_engine(base, isolation_level="AUTOCOMMIT")

    def make(suffix: str, encoding: str | None = None, settings: dict[str, str] | None = None):
        name = f"{base.database}_enc_{suffix}"
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            extra = (
                f" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
                if encoding
                else ""
            )
            conn.execute(sa.text(f'CREATE DATABASE "{name}"{extra}'))
            made.append(name)
            for key, value in (settings or {}).items():
                conn.execute(sa.text(f'ALTER DATABASE "{name}" SET {key} = {value}'))
        url = base.set(database=name)
        eng = create_engine(url)
        with eng.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{SCHEMA}"'))
            Base.metadata.create_all(conn)
        eng.dispose()
        return url

    yield make
    with admin.connect() as conn:
        for name in made:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _jobs() -> Jobs:
    return Jobs(Job, retry=Backoff(base=0.05, cap=0.05, jitter=0))


def _row(engine: sa.Engine, job_id: int) -> Any:
    """The job's row, its JSON as text (readable over any connection)."""
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                f"SELECT status, attempts, last_error, result::text AS result, "
                f"progress->>'note' AS note FROM {SCHEMA}.jobs WHERE id = :id"
            ),
            {"id": job_id},
        ).one_or_none()


UTF8_CLIENT = {"connect_args": {"client_encoding": "utf8"}}


# -- what a failure, a result and a progress note hold -------------------------------------


@pytest.mark.parametrize(
    "encoding, client, char",
    [("LATIN1", None, "\u20ac"), (None, "WIN1252", "\u2192")],
    ids=["latin1-db", "utf8-db-win1252-client"],
)
def test_failure_message_the_connection_cannot_carry_is_escaped(
    database: Any, encoding: str | None, client: str | None, char: str
) -> None:
    """The failure is written, its message escaped where the connection or the database
    has no room for a character (what it can carry, 'é', is kept): the job dead at once,
    run once. It was left unwritten (the driver's encoder failed), the job running until
    its lease passed and then retried with "lease expired" as its error."""
    url = database("fail", encoding=encoding)
    kw = {"connect_args": {"client_encoding": client}} if client else {}
    engine, jobs = create_engine(url, **kw), _jobs()
    runs: list[int] = []

    @jobs.task(max_attempts=1)
    def enc_fails() -> None:
        runs.append(1)
        raise ValueError(f"caf\u00e9: price in {char} is wrong")

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_fails)
    Worker(jobs, engine, lease=2.0, poll_interval=0.2).run_until_empty(timeout=8)
    row = _row(engine, job_id)
    engine.dispose()
    assert row.status == "dead", row
    escape = f"\\u{ord(char):04x}"
    assert f"ValueError: caf\u00e9: price in {escape} is wrong" in row.last_error, row
    assert runs == [1]


def test_result_the_database_cannot_store_fails_once(database: Any) -> None:
    """A kept result LATIN1 cannot store ('→'), over a UTF-8 connection: the run fails,
    dead, with a ResultError naming the character and the encoding; the handler that
    succeeded is not run again (its completion was never written, so it ran again once
    its lease passed)."""
    url = database("res", encoding="LATIN1")
    engine, jobs = create_engine(url, **UTF8_CLIENT), _jobs()
    runs: list[int] = []

    @jobs.task(max_attempts=2, keep_result=True)
    def enc_returns() -> str:
        runs.append(1)
        return "\u2192 done"

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_returns)
    Worker(jobs, engine, lease=1.0, poll_interval=0.2).run_until_empty(timeout=6)
    row = _row(engine, job_id)
    try:
        assert row.status == "dead", row
        assert "ResultError" in row.last_error and "U+2192" in row.last_error, row
        assert "LATIN1" in row.last_error, row
        with pytest.raises(JobFailedError, match="U\\+2192"):
            jobs.result(engine, job_id, timeout=2)
        assert runs == [1]
    finally:
        engine.dispose()


def test_non_ascii_result_over_a_latin1_connection_fails_once(database: Any) -> None:
    """Over a LATIN1 connection, a kept result holds non-ASCII text ('café'): refused as
    enqueue refuses such arguments (psycopg reads JSON as UTF-8, so no reader could load
    the row), with a ResultError that says to connect with client_encoding=utf8."""
    url = database("resa", encoding="LATIN1")
    engine, jobs = create_engine(url), _jobs()
    runs: list[int] = []

    @jobs.task(max_attempts=2, keep_result=True)
    def enc_cafe() -> str:
        runs.append(1)
        return "caf\u00e9"

    heard: list[str] = []
    for name in ("succeeded", "dead"):
        jobs.events.connect(name, lambda event: heard.append(event.name))
    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_cafe)
    Worker(jobs, engine, lease=1.0, poll_interval=0.2).run_until_empty(timeout=6)
    row = _row(engine, job_id)
    engine.dispose()
    assert row.status == "dead", row
    assert "ResultError" in row.last_error and "client_encoding=utf8" in row.last_error, row
    assert runs == [1]
    # Refused as the run ends: its events say it died, never that it succeeded (found
    # only as its outcome was written, it was "succeeded" and then dead).
    assert heard == ["dead"]


def test_transactional_result_the_database_cannot_store_fails_once(database: Any) -> None:
    """The same for a transactional task, whose completion is written in its own
    transaction: a ResultError (dead, not retried), not the driver's UnicodeEncodeError."""
    url = database("rest", encoding="LATIN1")
    engine, jobs = create_engine(url, **UTF8_CLIENT), _jobs()
    runs: list[int] = []

    @jobs.task(max_attempts=2, keep_result=True, transactional=True)
    def enc_tx_returns(session: Session) -> str:
        runs.append(1)
        return "\u2192 done"

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_tx_returns)
    Worker(jobs, engine, lease=1.0, poll_interval=0.2).run_until_empty(timeout=6)
    row = _row(engine, job_id)
    engine.dispose()
    assert row.status == "dead", row
    assert "ResultError" in row.last_error and "U+2192" in row.last_error, row
    assert runs == [1]


def test_result_stored_over_utf8_is_read_over_latin1(database: Any) -> None:
    """A result a LATIN1 database stores ('café', written by a worker connected with
    client_encoding=utf8) is read by Jobs.result over a LATIN1 connection: it raised
    UnicodeDecodeError (psycopg decodes jsonb as UTF-8); it is read as text now."""
    url = database("read", encoding="LATIN1")
    writer, reader, jobs = create_engine(url, **UTF8_CLIENT), create_engine(url), _jobs()

    @jobs.task(keep_result=True)
    def enc_cafe_ok() -> dict[str, str]:
        return {"caf\u00e9": "cr\u00e8me"}

    with writer.begin() as conn:
        job_id = jobs.enqueue(conn, enc_cafe_ok)
    Worker(jobs, writer, poll_interval=0.2).run_until_empty(timeout=6)
    try:
        assert _row(writer, job_id).status == "done"
        assert jobs.result(reader, job_id, timeout=5) == {"caf\u00e9": "cr\u00e8me"}
    finally:
        writer.dispose()
        reader.dispose()


def _note_seen(engine: sa.Engine, job_id: int, deadline: float) -> str | None:
    while time.monotonic() < deadline:
        row = _row(engine, job_id)
        if row is not None and row.note is not None:
            return str(row.note)
        time.sleep(0.05)
    return None


def test_progress_note_the_database_cannot_store_is_escaped(database: Any) -> None:
    """A progress note LATIN1 cannot store ('→'): the heartbeat writes it escaped and
    keeps renewing the lease (every beat failed in the driver's encoder, until the worker
    stopped with "heartbeat kept failing" and the job ran again)."""
    url = database("note", encoding="LATIN1")
    engine, jobs = create_engine(url, **UTF8_CLIENT), _jobs()
    runs: list[int] = []
    release = threading.Event()

    @jobs.task(max_attempts=3)
    def enc_progress() -> None:
        runs.append(1)
        current_job().set_progress(0.5, note="caf\u00e9 half way \u2192")
        release.wait(10)

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_progress)
    worker = Worker(jobs, engine, lease=1.5, poll_interval=0.2, rescue_interval=0.2)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            worker.run_until_empty(timeout=15)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        note = _note_seen(engine, job_id, time.monotonic() + 5)
        # Held past two leases: only a heartbeat that keeps beating keeps the job.
        time.sleep(3.2)
    finally:
        release.set()
        thread.join(20)
    row = _row(engine, job_id)
    engine.dispose()
    assert not errors, errors
    assert note == "caf\u00e9 half way \\u2192"
    assert runs == [1]
    assert row is None, row  # done and deleted


def test_progress_note_over_a_latin1_connection_asyncio(database: Any) -> None:
    """The same on the asyncio worker, over a LATIN1 connection: the note is written with
    its non-ASCII text escaped, the job runs once and the worker goes on."""
    url = database("notea", encoding="LATIN1")
    engine, jobs = create_engine(url), _jobs()
    runs: list[int] = []
    notes: list[str | None] = []

    @jobs.task(max_attempts=3)
    async def enc_progress_aio() -> None:
        runs.append(1)
        current_job().set_progress(0.5, note="caf\u00e9 \u2192")
        job_id = current_job().id
        deadline = time.monotonic() + 5
        note = None
        while note is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            note = await asyncio.to_thread(lambda: _row(engine, job_id).note)
        notes.append(note)
        await asyncio.sleep(3.2)  # past two leases

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_progress_aio)
    from sqla_jobs.aio import AsyncWorker

    async def main() -> None:
        worker = AsyncWorker(
            jobs,
            url.render_as_string(hide_password=False),
            lease=1.5,
            poll_interval=0.2,
            rescue_interval=0.2,
        )
        try:
            await worker.run_until_empty(timeout=15)
        finally:
            await worker.engine.dispose()

    asyncio.run(main())
    row = _row(engine, job_id)
    engine.dispose()
    assert notes == ["caf\\xe9 \\u2192"]
    assert runs == [1]
    assert row is None, row


def test_heartbeat_goes_on_without_notes_it_cannot_send(
    database: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Binding a note fails outside the database (the driver's encoder): the heartbeat
    beats again without the notes instead of failing until the worker stops."""
    url = database("beat")
    engine, jobs = create_engine(url), _jobs()
    runs: list[int] = []
    beat = _statements.beat

    def refusing_beat(conn: Any, queries: Any, claims: Any, lease: Any, progress: Any = None):
        if progress and any(n is not None for n in progress):
            raise UnicodeEncodeError("latin-1", "\u2192", 0, 1, "ordinal not in range(256)")
        return beat(conn, queries, claims, lease, progress)

    monkeypatch.setattr(_statements, "beat", refusing_beat)

    @jobs.task(max_attempts=3)
    def enc_noted() -> None:
        runs.append(1)
        for i in range(8):  # a new note every beat, past two leases
            current_job().set_progress(i)
            time.sleep(0.4)

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_noted)
    Worker(jobs, engine, lease=1.5, poll_interval=0.2, rescue_interval=0.2).run_until_empty(
        timeout=15
    )
    row = _row(engine, job_id)
    engine.dispose()
    assert runs == [1]
    assert row is None, row


# -- DateStyle -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "datestyle, order",
    [("'SQL, DMY'", "DMY"), ("'German'", "DMY"), ("'Postgres, MDY'", "MDY")],
)
def test_create_engine_reads_under_iso_datestyle(database: Any, datestyle: str, order: str) -> None:
    """A database whose DateStyle is not ISO: sqla_jobs.create_engine's connections (and
    create_async_engine's) are switched to ISO, the date order kept, options given kept;
    a worker runs, timestamps read. psycopg 3 read none: the worker could not start."""
    url = database("ds", settings={"datestyle": datestyle})
    engine = create_engine(url, connect_args={"options": "-c lock_timeout=1234"})
    jobs = _jobs()
    runs: list[int] = []

    @jobs.task()
    def enc_ok() -> None:
        runs.append(1)

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_ok)
        style = conn.execute(sa.text("SHOW DateStyle")).scalar_one()
        timeout = conn.execute(sa.text("SHOW lock_timeout")).scalar_one()
        conn.execute(sa.text("SELECT now()")).scalar_one()
    Worker(jobs, engine, poll_interval=0.2).run_until_empty(timeout=6)
    row = _row(engine, job_id)
    engine.dispose()
    assert style == f"ISO, {order}"
    assert timeout == "1234ms"
    assert runs == [1]
    assert row is None

    async def read() -> str:
        aengine = create_async_engine(url)
        try:
            async with aengine.connect() as conn:
                await conn.execute(sa.text("SELECT now()"))
                return str((await conn.execute(sa.text("SHOW DateStyle"))).scalar_one())
        finally:
            await aengine.dispose()

    assert asyncio.run(read()) == f"ISO, {order}"


def test_own_engine_with_another_datestyle_worker_error(database: Any) -> None:
    """An engine the application made itself, under DateStyle 'SQL, DMY': the worker's
    start fails with a WorkerError naming the setting and the fix, not psycopg's
    NotImplementedError; the job is left as it was."""
    url = database("dse", settings={"datestyle": "'SQL, DMY'"})
    engine, jobs = sa.create_engine(url), _jobs()

    @jobs.task()
    def enc_never() -> None: ...

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, enc_never)
    with pytest.raises(WorkerError, match=r"DateStyle.*SQL, DMY.*ISO"):
        Worker(jobs, engine, poll_interval=0.2).run_until_empty(timeout=6)
    with engine.connect() as conn:
        status = conn.execute(
            sa.text(f"SELECT status FROM {SCHEMA}.jobs WHERE id = :id"), {"id": job_id}
        ).scalar_one()
    engine.dispose()
    assert status == "ready"


def test_session_fail_escapes_what_the_database_cannot_carry(database: Any) -> None:
    """``session.fail`` of a job claimed in the application's own loop (``JobSession.claim``)
    writes its error as the worker does: what a LATIN1 database cannot store escaped. The
    driver's encoder refused the statement, and the claim stayed running."""
    from sqlalchemy.orm import sessionmaker

    from sqla_jobs import JobSession

    url = database("sfail", encoding="LATIN1")
    engine, jobs = create_engine(url, **UTF8_CLIENT), _jobs()

    @jobs.task(queue="own", max_attempts=1)
    def own_loop() -> None: ...

    with engine.begin() as conn:
        job_id = jobs.enqueue(conn, own_loop)
    Session = sessionmaker(engine, class_=JobSession, jobs=jobs)
    with Session.begin() as session:
        (job,) = session.claim("own")
        session.fail(job, "caf\u00e9: price in \u20ac is wrong")
    row = _row(engine, job_id)
    engine.dispose()
    assert row.status == "dead", row
    assert row.last_error == "caf\u00e9: price in \\u20ac is wrong", row

"""The many-rows paths (the INSERT below ``COPY_MIN_ROWS`` rows, COPY from there) store
what one ``enqueue`` stores and count what they wrote: enum options by value, the task's
``keep_result`` next to the call's ``meta``, a Python-side default of the application's
model, ``run_at`` at any offset, rows an application's trigger skipped."""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from sqlalchemy.orm.exc import FlushError

from sqla_jobs import EnqueueError, JobMixin, Jobs, JobSession
from sqla_jobs._bulk import COPY_BLOCK_ROWS, COPY_MIN_ROWS, _text
from sqla_jobs.model import KEEP_KEY
from sqla_jobs.session import CHECK_AS_WRITTEN_MIN_ROWS

from . import app
from .helpers import count, rows

#: A session's call that is checked as COPY writes it, over more than one block.
BIG = CHECK_AS_WRITTEN_MIN_ROWS + COPY_BLOCK_ROWS + 1
#: The INSERT, COPY, and COPY checked block by block.
SIZES = pytest.mark.parametrize("n", [10, COPY_MIN_ROWS, BIG], ids=["insert", "copy", "big"])
VIA = pytest.mark.parametrize("via", ["session", "connection"])


class Queue(str, enum.Enum):
    MAIL = "mail"


class Prio(int, enum.Enum):
    HIGH = 7


class Attempts(int, enum.Enum):
    FEW = 2


@pytest.fixture
def echo(jobs: Jobs) -> Any:
    @jobs.task(queue="q")
    def echo(i: int) -> None: ...

    return echo


@pytest.fixture
def kept(jobs: Jobs) -> Any:
    @jobs.task(queue="q", keep_result=True)
    def kept(i: int) -> int:
        return i

    return kept


def _many(via: str, Session: Any, db: sa.Engine, jobs: Jobs, task: Any, n: int, **kw: Any) -> int:
    given = [{"i": i} for i in range(n)]
    if via == "session":
        with Session.begin() as session:
            return int(session.enqueue_many(task, given, **kw))
    with db.begin() as conn:
        return int(jobs.enqueue_many(conn, task, given, **kw))


# -- 1. enum members ---------------------------------------------------------------------


@SIZES
@VIA
def test_enum_options_are_stored_by_value(
    Session: Any, db: sa.Engine, jobs: Jobs, n: int, via: str
) -> None:
    """A ``str``/``int`` enum member passes the checks; COPY wrote its ``str()``
    (``'Queue.MAIL'``, a queue no worker reads; ``'Prio.HIGH'``, refused)."""

    @jobs.task(queue=Queue.MAIL, priority=Prio.HIGH, max_attempts=Attempts.FEW)
    def declared(i: int) -> None: ...

    @jobs.task(queue="other")
    def plain(i: int) -> None: ...

    heard: set[tuple[type, ...]] = set()
    jobs.events.connect(
        "enqueued",
        lambda e: heard.add(
            (type(e.job["queue"]), type(e.job["priority"]), type(e.job["max_attempts"]))
        ),
    )
    _many(via, Session, db, jobs, declared, n)
    _many(
        via,
        Session,
        db,
        jobs,
        plain,
        n,
        queue=Queue.MAIL,
        priority=Prio.HIGH,
        max_attempts=Attempts.FEW,
    )
    got = {(r.queue, r.priority, r.max_attempts) for r in rows(db)}
    assert got == {("mail", 7, 2)}
    assert count(db) == 2 * n
    # The checks give plain values: no path (nor a listener) sees the member.
    assert heard == {(str, int, int)}


def test_copy_text_of_a_value_is_its_own_not_its_str() -> None:
    assert _text(Queue.MAIL) == "mail"
    assert _text(Prio.HIGH) == "7"


# -- 2. keep_result next to meta -----------------------------------------------------------


@pytest.mark.parametrize("n", [3, BIG], ids=["insert", "copy"])
@pytest.mark.parametrize("via", ["session", "connection", "async", "sharded"])
@pytest.mark.parametrize("source", ["meta", "hook"])
def test_enqueue_many_keeps_the_tasks_keep_result_beside_meta(
    Session: Any,
    db: sa.Engine,
    jobs: Jobs,
    kept: Any,
    database_url: str,
    n: int,
    via: str,
    source: str,
) -> None:
    """The call's ``meta`` (or an enqueue hook's, as tracing adds) replaced the library's
    keys: the task's results were not kept."""
    options: dict[str, Any] = {}
    if source == "meta":
        options["meta"] = {"tag": "x"}
    else:
        jobs.events.add_enqueue_hook(lambda task, queue, meta: meta.update(tag="x"))
    given = [{"i": i} for i in range(n)]
    if via in ("session", "connection"):
        assert _many(via, Session, db, jobs, kept, n, **options) == n
    elif via == "sharded":
        from sqla_jobs.sharding import ShardedJobSession

        maker = sessionmaker(
            class_=ShardedJobSession,
            shards={"a": db},
            shard_chooser=lambda *a, **k: "a",
            identity_chooser=lambda *a, **k: ["a"],
            execute_chooser=lambda c: ["a"],
            jobs=jobs,
        )
        with maker.begin() as session:
            session.enqueue_many(kept, given, shard="a", **options)
    else:
        from sqlalchemy.ext.asyncio import async_sessionmaker

        from sqla_jobs import create_async_engine
        from sqla_jobs.aio import AsyncJobSession

        async def main() -> None:
            engine = create_async_engine(database_url)
            try:
                maker = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
                async with maker.begin() as session:
                    await session.enqueue_many(kept, given, **options)
            finally:
                await engine.dispose()

        asyncio.run(main())
    metas = [r.meta for r in rows(db)]
    assert len(metas) == n
    assert all(m.get("tag") == "x" and KEEP_KEY in m for m in metas), metas[0]


# -- 3. a Python-side default of the application's model ----------------------------------


@pytest.fixture
def tenant_jobs(engine: sa.Engine) -> Iterator[tuple[Jobs, str]]:
    schema = f"bulk_{uuid.uuid4().hex[:8]}"

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    class TenantJob(JobMixin, Base):
        __tablename__ = "jobs"
        tenant: Mapped[str | None] = mapped_column(default="acme")

    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        Base.metadata.create_all(conn)
    try:
        yield Jobs(TenantJob), schema
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@SIZES
@VIA
def test_a_python_default_of_the_model_reaches_every_row(
    engine: sa.Engine, tenant_jobs: tuple[Jobs, str], n: int, via: str
) -> None:
    """COPY, and the single enqueue sent to psycopg as compiled, wrote NULL where the
    INSERT (SQLAlchemy's execution) wrote the model's default."""
    tjobs, schema = tenant_jobs

    @tjobs.task
    def tt(i: int) -> None: ...

    given = [{"i": i} for i in range(n)]
    if via == "session":
        with sessionmaker(engine, class_=JobSession, jobs=tjobs).begin() as session:
            assert session.enqueue_many(tt, given) == n
    else:
        with engine.begin() as conn:
            assert tjobs.enqueue_many(conn, tt, given) == n
            tjobs.enqueue(conn, tt, i=-1)  # one job, on psycopg's own when it may be
    with engine.connect() as conn:
        got = conn.exec_driver_sql(f'SELECT tenant, count(*) FROM "{schema}".jobs GROUP BY 1')
        assert got.all() == [("acme", n + (via == "connection"))]


# -- 4. rows an application's trigger skipped --------------------------------------------


@pytest.fixture
def skip_odd(db: sa.Engine) -> Iterator[None]:
    table = f'"{app.SCHEMA}".jobs'
    function = f'"{app.SCHEMA}".skip_odd'
    with db.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN IF (NEW.args->>'i')::int %% 2 = 1 THEN RETURN NULL; END IF; "
            "RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER skip_odd BEFORE INSERT ON {table} FOR EACH ROW "
            f"EXECUTE FUNCTION {function}()"
        )
    try:
        yield
    finally:
        with db.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER skip_odd ON {table}")
            conn.exec_driver_sql(f"DROP FUNCTION {function}()")


@SIZES
@VIA
def test_the_count_is_of_the_rows_written(
    Session: Any, db: sa.Engine, jobs: Jobs, echo: Any, skip_odd: None, n: int, via: str
) -> None:
    """COPY said every row was written, whatever a ``BEFORE INSERT`` trigger skipped."""
    assert _many(via, Session, db, jobs, echo, n) == count(db) == (n + 1) // 2


def test_one_job_a_trigger_skipped_fails_its_flush_with_the_reason(
    Session: Any, db: sa.Engine, echo: Any, skip_odd: None
) -> None:
    """``session.enqueue``'s job, written around the ORM, failed the commit with
    ``ValueError: not enough values to unpack``; the ORM's own flush says what happened.
    The flush fails whole: the other job of the flush is not written either."""
    with Session() as session:
        session.enqueue(echo, i=2)
        session.enqueue(echo, i=1)
        with pytest.raises(FlushError, match="BEFORE INSERT trigger on the table skipped it"):
            session.commit()
    assert count(db) == 0


@pytest.mark.parametrize("watched", [False, True], ids=["psycopg", "sqlalchemy"])
def test_one_job_a_trigger_skipped_is_refused_on_a_connection(
    db: sa.Engine, jobs: Jobs, echo: Any, skip_odd: None, watched: bool
) -> None:
    """``jobs.enqueue(conn, ...)`` raised an unpacking error (sent to psycopg) or
    ``NoResultFound`` (through SQLAlchemy, when something watches the connection); the
    caller's transaction goes on."""
    with db.begin() as conn:
        if watched:
            sa.event.listen(conn, "before_cursor_execute", lambda *a: None)
        with pytest.raises(
            EnqueueError, match=r"was not written: the INSERT into \S+ returned no row"
        ):
            jobs.enqueue(conn, echo, i=1)
        assert jobs.enqueue(conn, echo, i=2) > 0
    assert count(db) == 1


@pytest.mark.parametrize("kind", ["unique", "scoped", "scoped past its holder", "after"])
@VIA
def test_every_kind_of_single_job_a_trigger_skipped_says_so(
    Session: Any, db: sa.Engine, jobs: Jobs, echo: Any, skip_odd: None, kind: str, via: str
) -> None:
    """A scoped job failed with ``TypeError: int() ... NoneType``, or came back as "kept"
    (the holder, which did not block it); a unique one said its key "keeps changing
    hands"."""
    options: dict[str, Any] = {
        "unique": {"unique": True},
        "scoped": {"unique_for": 60},
        "scoped past its holder": {"unique_key": "k", "unique_states": ("ready",)},
        "after": {"after": []},
    }[kind]
    task = echo.with_options(**options)
    if kind == "scoped past its holder":  # the key's holder runs: it blocks nothing
        with db.begin() as conn:
            holder = jobs.enqueue(conn, task, i=2)
            conn.execute(sa.update(app.Job).where(app.Job.id == holder).values(status="running"))
    error: type[Exception] = FlushError if via == "session" and kind == "after" else EnqueueError
    reason = "BEFORE INSERT trigger"
    if via == "session":
        with Session() as session, pytest.raises(error, match=reason):
            session.enqueue(task, i=1)
            session.commit()
    else:
        with db.begin() as conn, pytest.raises(error, match=reason):
            jobs.enqueue(conn, task, i=1)
    assert count(db) == (kind == "scoped past its holder")


# -- 5. run_at offsets -------------------------------------------------------------------


@SIZES
def test_run_at_at_any_offset_is_the_same_instant(
    db: sa.Engine, jobs: Jobs, echo: Any, n: int
) -> None:
    """COPY wrote the offset as given, and PostgreSQL refuses one past 15:59."""
    when = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=23, minutes=59)))
    with db.begin() as conn:
        assert jobs.enqueue_many(conn, echo, [{"i": i} for i in range(n)], run_at=when) == n
    assert {r.run_at for r in rows(db)} == {when}


# -- 6. the count of a deprecated async call, awaited after a flush wrote it -------------


def test_a_unique_batch_written_by_a_flush_says_how_many_it_inserted(
    db: sa.Engine, jobs: Jobs, echo: Any, database_url: str
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    with db.begin() as conn:
        jobs.enqueue(conn, echo, i=1, unique=True)

    async def main() -> int:
        engine = create_async_engine(database_url)
        try:
            maker = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
            async with maker.begin() as session:
                pending = session.enqueue_many(echo, [{"i": i} for i in (1, 2, 2)], unique=True)
                await session.flush()
                return int(await pending)
        finally:
            await engine.dispose()

    with pytest.warns(DeprecationWarning):
        assert asyncio.run(main()) == 1
    assert count(db) == 2

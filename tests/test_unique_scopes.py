"""Scoped unique jobs: a key held for a period (finished jobs included), by chosen states,
and debounce (``unique_on_conflict="replace"``). Time is moved by the tests (a key's
``until`` set into the past), never waited for."""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_jobs import EnqueueError, JobMixin, Jobs, JobSession, Worker, create_engine
from sqla_jobs.model import companion_tables
from sqla_jobs.worker._statements import prune

from . import app
from .helpers import count, rows, wait_for

KEYS = companion_tables(app.Job.__table__).unique_keys


def _keys(db: sa.Engine) -> dict[str, Any]:
    with db.connect() as conn:
        return {r.key: r for r in conn.execute(sa.select(KEYS))}


def _end_periods(db: sa.Engine) -> None:
    """As if every key's period had run out."""
    with db.begin() as conn:
        conn.execute(sa.update(KEYS).values(until=sa.func.now() - timedelta(seconds=1)))


def _set_status(db: sa.Engine, job_id: int, status: str) -> None:
    with db.begin() as conn:
        conn.execute(sa.update(app.Job.__table__).where(app.Job.id == job_id).values(status=status))


def test_unique_for_holds_the_key_after_the_job_finished(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    hourly = refresh.with_options(unique_for=timedelta(hours=1))
    with Session.begin() as session:
        first = session.enqueue(hourly, 1)
        assert session.enqueue(hourly, user_id=1) is first  # held while live
        other = session.enqueue(hourly, 2)  # another key
        first_id, other_id = first.id, other.id
    assert other_id != first_id and count(db) == 2
    # The scoped key lives in <table>_unique_keys, not in the row's partial unique index.
    assert {r.unique_key for r in rows(db)} == {None}
    assert {k.job_id for k in _keys(db).values()} == {first_id, other_id}

    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=10)
    assert count(db) == 0  # done, and deleted (keep_done=None)
    with Session.begin() as session:
        # Finished and gone, but within the hour: nothing new, and no job to hand back.
        assert session.enqueue(hourly, 1) is None
    with db.begin() as conn:  # the Core enqueue answers with the id of the job that took it
        assert jobs.enqueue(conn, hourly, 1) == first_id
    assert count(db) == 0

    _end_periods(db)
    with Session.begin() as session:
        again = session.enqueue(hourly, 1)
        assert again is not None and again.id not in (first_id, other_id)
    assert count(db) == 1


def test_a_live_job_keeps_its_key_after_the_period(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session.begin() as session:
        first = session.enqueue(refresh.with_options(unique_for=60, delay=3600), 1)
        first_id = first.id
    _end_periods(db)
    with Session.begin() as session:
        # The period is over, but the job still waits: never two live jobs by default.
        assert session.enqueue(refresh.with_options(unique_for=60), 1).id == first_id
    assert count(db) == 1


def test_unique_states_let_a_running_job_be_followed(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q", unique_states=("scheduled", "ready"))
    def reindex(user_id: int) -> None:
        pass

    with Session.begin() as session:
        a = session.enqueue(reindex, 1)
        assert session.enqueue(reindex, 1) is a  # waiting: blocks
        a_id = a.id
    _set_status(db, a_id, "running")
    with Session.begin() as session:
        b = session.enqueue(reindex, 1)  # running: does not block
        assert b.id != a_id
        assert session.enqueue(reindex, 1) is b  # the new one waits, and blocks
    assert sorted(r.status for r in rows(db)) == ["ready", "running"]


def test_debounce_replaces_arguments_and_run_time(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q", unique_on_conflict="replace")
    def sync_profile(user_id: int, fields: list[str]) -> None:
        pass

    with Session.begin() as session:
        first = session.enqueue(
            sync_profile.with_options(delay=60, unique_key="profile:1"), 1, ["name"]
        )
        first_id = first.id
        run_at = first.run_at
    with Session.begin() as session:
        later = session.enqueue(
            sync_profile.with_options(delay=600, unique_key="profile:1"), 1, ["name", "email"]
        )
        assert later.id == first_id
        assert later.args == {"user_id": 1, "fields": ["name", "email"]}
        assert later.run_at > run_at + timedelta(seconds=500) and later.status == "scheduled"
    with Session.begin() as session:
        # The same session sees the replacement on the object it already holds.
        held = session.get(app.Job, first_id)
        assert held.args["fields"] == ["name", "email"]
        now = session.enqueue(sync_profile.with_options(unique_key="profile:1"), 1, ["avatar"])
        assert now is held and held.args["fields"] == ["avatar"] and held.status == "ready"
    [row] = rows(db)
    assert (row.id, row.status, row.args["fields"]) == (first_id, "ready", ["avatar"])

    # Once the job has started, it cannot take new arguments: the next enqueue is a new job.
    _set_status(db, first_id, "running")
    with Session.begin() as session:
        new = session.enqueue(sync_profile.with_options(unique_key="profile:1"), 1, ["bio"])
        assert new.id != first_id
    assert sorted((r.status, r.args["fields"][0]) for r in rows(db)) == [
        ("ready", "bio"),
        ("running", "avatar"),
    ]


def test_debounced_job_runs_once_with_the_last_arguments(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    seen: list[int] = []

    @jobs.task(queue="q", unique=True)
    def notify(user_id: int, count: int) -> None:
        seen.append(count)

    debounced = notify.with_options(unique_key="notify:7", unique_on_conflict="replace")
    for n in range(1, 6):
        with Session.begin() as session:
            session.enqueue(debounced, 7, n)
    Worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=10)
    assert seen == [5]


@pytest.mark.parametrize("mode", ["keep", "replace"])
def test_eight_connections_enqueueing_one_scoped_key_make_one_job(
    db: sa.Engine, jobs: Jobs, database_url: str, mode: str
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int, n: int) -> None:
        pass

    options: dict[str, Any] = {"unique_key": "refresh:7", "unique_on_conflict": mode}
    if mode == "keep":
        options["unique_for"] = 300
    scoped = refresh.with_options(**options)
    with db.begin() as conn:
        # The key's row exists already (an earlier job, finished): a new key's INSERTs
        # would wait for one another anyway; an existing row's lock is what is tested.
        conn.execute(sa.insert(KEYS).values(key="refresh:7"))
    engine = create_engine(database_url, pool_size=8)
    barrier = threading.Barrier(8)
    placed: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def enqueue(n: int) -> None:
        try:
            with JobSession(engine, jobs=jobs) as session:
                barrier.wait()
                job = session.enqueue(scoped, 7, n)
                # The key's row stays locked until this commit: no other enqueue can be
                # placed before this append, so the list is in the order of placing.
                with lock:
                    placed.append((job.id, n))
                session.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=enqueue, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    engine.dispose()
    assert not errors
    [row] = rows(db)
    assert len(placed) == 8 and {i for i, _ in placed} == {row.id}
    # keep: the first enqueue placed wins; replace (debounce): the last one does.
    assert row.args["n"] == placed[0 if mode == "keep" else -1][1]
    assert len(_keys(db)) == 1


def test_core_and_task_defaults_and_with_options(db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q", unique_for=timedelta(minutes=5))
    def report(day: str) -> None:
        pass

    with db.begin() as conn:
        a = jobs.enqueue(conn, report, "2026-11-30")
        assert jobs.enqueue(conn, report, day="2026-11-30") == a
        # A call's scope option replaces the task's one by one: here, states only.
        b = jobs.enqueue(conn, report.with_options(unique_states=("ready",)), "2026-11-30")
        assert b == a  # the period (the task's) still holds it
        with pytest.raises(EnqueueError, match="unique_for"):
            jobs.enqueue(conn, report.with_options(unique_on_conflict="replace"), "2026-11-30")
    assert count(db) == 1

    async def main() -> tuple[int, int]:
        from sqla_jobs import create_async_engine

        engine = create_async_engine(db.url.render_as_string(hide_password=False))
        async with engine.begin() as conn:
            x = await jobs.enqueue(conn, report, "2026-12-01")
            y = await jobs.enqueue(conn, report, "2026-12-01")
        await engine.dispose()
        return x, y

    x, y = asyncio.run(main())
    assert x == y != a
    assert count(db) == 2


def test_async_session_enqueue_unique_with_a_scope(
    database_url: str, db: sa.Engine, jobs: Jobs
) -> None:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_jobs import create_async_engine
    from sqla_jobs.aio import AsyncJobSession

    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    async def main() -> list[Any]:
        engine = create_async_engine(database_url)
        make = async_sessionmaker(engine, class_=AsyncJobSession, jobs=jobs)
        async with make() as session:
            with pytest.raises(EnqueueError, match="enqueue_unique"):
                session.enqueue(refresh.with_options(unique_for=60), 1)
            debounce = refresh.with_options(unique_on_conflict="replace", delay=60)
            a = await session.enqueue_unique(debounce, 1)
            b = await session.enqueue_unique(debounce, user_id=1)
            result = [a.id, b.id]
            await session.commit()
        await engine.dispose()
        return result

    a, b = asyncio.run(main())
    assert a == b
    assert count(db) == 1


def test_a_rolled_back_savepoint_gives_the_key_back(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    hourly = refresh.with_options(unique_for=3600)
    with Session.begin() as session:
        with pytest.raises(RuntimeError), session.begin_nested():
            session.enqueue(hourly, 1)
            raise RuntimeError("undo")
        job = session.enqueue(hourly, 1)  # the key is free again
        assert job is not None
        job_id = job.id
    [row] = rows(db)
    assert row.id == job_id
    assert [k.job_id for k in _keys(db).values()] == [job_id]


def test_bad_scopes_are_refused(Session: Any, db: sa.Engine, jobs: Jobs) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    bad: list[tuple[dict[str, Any], str]] = [
        ({"unique_for": 0}, "unique_for must be a period > 0"),
        ({"unique_for": -5}, "unique_for must be a period > 0"),
        ({"unique_for": timedelta(0)}, "unique_for must be a period > 0"),
        ({"unique_for": "5m"}, "unique_for must be a period > 0"),
        ({"unique_for": float("nan")}, "unique_for must be a period > 0"),
        ({"unique_states": ("done",)}, "cannot hold a key"),
        ({"unique_states": "ready"}, "collection of statuses"),
        ({"unique_states": ()}, "at least one status"),
        ({"unique_on_conflict": "merge"}, "'keep' or 'replace'"),
        ({"unique_on_conflict": "replace", "unique_for": 60}, "cannot be combined"),
        ({"unique_on_conflict": "replace", "unique_states": ("running",)}, "has not started"),
    ]
    for options, message in bad:
        with pytest.raises(EnqueueError, match=message):
            refresh.with_options(**options)
        with Session() as session, pytest.raises(EnqueueError, match=message):
            session.enqueue(refresh, 1, **options)
        with pytest.raises(ValueError, match=message):
            jobs.task(name=f"bad.{len(jobs.tasks)}", **options)(lambda user_id: None)
    with Session() as session, pytest.raises(EnqueueError, match="enqueue_many"):
        session.enqueue_many(refresh.with_options(unique_for=60), [{"user_id": 1}])
    assert count(db) == 0 and not _keys(db)


def test_the_plain_rule_asked_for_explicitly_stays_plain(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    explicit = refresh.with_options(
        unique_states=("scheduled", "ready", "running"), unique_on_conflict="keep"
    )
    with Session.begin() as session:
        a = session.enqueue(explicit, 1)
        assert session.enqueue(refresh.with_options(unique=True), 1) is a
    [row] = rows(db)
    assert row.unique_key is not None  # served by <table>_unique, as unique=True
    assert not _keys(db)


def test_prune_forgets_keys_whose_period_passed_and_job_is_gone(
    Session: Any, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def refresh(user_id: int) -> None:
        pass

    with Session.begin() as session:
        live = session.enqueue(refresh.with_options(unique_for=60, delay=3600), 1).id
        gone = session.enqueue(refresh.with_options(unique_for=60), 2).id
        held = session.enqueue(refresh.with_options(unique_for=3600), 3).id
    with db.begin() as conn:
        conn.execute(sa.delete(app.Job.__table__).where(app.Job.id.in_([gone, held])))
        conn.execute(
            sa.update(KEYS)
            .where(KEYS.c.job_id.in_([live, gone]))
            .values(until=sa.func.now() - timedelta(seconds=1))
        )
    prune(db, jobs)
    # Kept: the live job's key (past its period), and the key still in its period.
    assert sorted(k.job_id for k in _keys(db).values()) == sorted([live, held])


def test_debounce_racing_a_claim_never_replaces_a_started_job(
    Session: Any, db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """The claim has locked the waiting job and not committed yet when a debounce comes:
    the debounce waits for it, sees the job running, and enqueues a new one, so the
    started job keeps the arguments it runs with and the last ones still run."""

    @jobs.task(queue="q", unique_on_conflict="replace")
    def sync(user_id: int, n: int) -> None:
        pass

    keyed = sync.with_options(unique_key="sync:1")
    with Session.begin() as session:
        first_id = session.enqueue(keyed, 1, 1).id
    t = app.Job.__table__
    errors: list[BaseException] = []
    placed: list[int] = []

    def debounce() -> None:
        try:
            with Session.begin() as session:
                placed.append(session.enqueue(keyed, 1, 2).id)
        except BaseException as exc:
            errors.append(exc)

    with db.connect() as claim:
        claim.execute(sa.update(t).where(t.c.id == first_id).values(status="running"))
        thread = threading.Thread(target=debounce)
        thread.start()
        wait_for(lambda: _waiting_on_a_lock(db))
        claim.commit()
    thread.join(15)
    assert not errors and placed and placed[0] != first_id
    assert sorted((r.status, r.args["n"]) for r in rows(db)) == [("ready", 2), ("running", 1)]


def _waiting_on_a_lock(db: sa.Engine) -> bool:
    with db.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()"
                )
            ).scalar()
        )


def test_a_scoped_enqueue_in_autocommit_holds_the_key_until_its_job_is_placed(
    database_url: str, db: sa.Engine, jobs: Jobs
) -> None:
    """Two statements, the key's row taken then the job placed: in autocommit each one
    committed alone, so a second producer found the key free while the first had not
    placed its job yet, and both placed one (2 to 6 live jobs per key under 6 producers).
    They now run in a transaction of their own: the second producer waits for the first."""
    from sqlalchemy import event

    @jobs.task(queue="q")
    def report(customer_id: int) -> None: ...

    hourly = report.with_options(unique_for=3600)
    engine = create_engine(database_url, pool_size=2, isolation_level="AUTOCOMMIT")
    first_took, go_on = threading.Event(), threading.Event()

    @event.listens_for(engine, "before_cursor_execute")
    def pause(conn: Any, cursor: Any, statement: str, *a: Any) -> None:
        # The first producer stops between the key's row and the job's placement.
        if statement.lstrip().startswith("WITH replaced AS") and not first_took.is_set():
            first_took.set()
            assert go_on.wait(10)

    ids: list[int] = []

    def produce() -> None:
        with engine.connect() as conn:
            ids.append(jobs.enqueue(conn, hourly, 7))

    first = threading.Thread(target=produce)
    first.start()
    assert first_took.wait(10)
    second = threading.Thread(target=produce)
    second.start()
    second.join(1)
    assert second.is_alive()  # waiting for the key's row, which the first one holds
    go_on.set()
    first.join(10)
    second.join(10)
    engine.dispose()
    assert count(db) == 1 and len(set(ids)) == 1


def test_scoped_enqueues_in_autocommit_racing_leave_one_live_job_per_key(
    database_url: str, db: sa.Engine, jobs: Jobs
) -> None:
    @jobs.task(queue="q")
    def report(k: str) -> None: ...

    hourly = report.with_options(unique_for=3600)
    producers, keys = 6, 20
    engine = create_engine(database_url, pool_size=producers, isolation_level="AUTOCOMMIT")
    barrier = threading.Barrier(producers, timeout=30)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with engine.connect() as conn:
                for k in range(keys):
                    barrier.wait()
                    jobs.enqueue(conn, hourly, f"k{k}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce) for _ in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    engine.dispose()
    assert errors == []
    assert count(db) == keys


# -- the application's own columns ----------------------------------------------------------


@pytest.fixture
def defaulted_jobs(engine: sa.Engine) -> Any:
    """A job model whose own columns have every kind of SQLAlchemy (Python-side) default."""
    schema = f"scoped_{uuid.uuid4().hex[:8]}"
    made = iter(range(1, 1000))

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    class TenantJob(JobMixin, Base):
        __tablename__ = "jobs"
        tenant: Mapped[str | None] = mapped_column(default="acme")
        serial: Mapped[int | None] = mapped_column(default=lambda: next(made))
        lane: Mapped[str | None] = mapped_column(
            default=lambda context: context.get_current_parameters()["queue"] + "-lane"
        )
        made_at: Mapped[Any] = mapped_column(sa.DateTime(timezone=True), default=sa.func.now())

    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        TenantJob.metadata.create_all(conn)
    try:
        yield Jobs(TenantJob), schema
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize(
    "scope", [{"unique_for": 60}, {"unique_on_conflict": "replace"}], ids=["period", "debounce"]
)
def test_a_scoped_job_gets_the_model_s_python_defaults(
    engine: sa.Engine, defaulted_jobs: Any, scope: dict[str, Any]
) -> None:
    """The scoped job's INSERT is a CTE, where SQLAlchemy fills no Python-side default:
    the application's columns were NULL there, where every other enqueue wrote them."""
    tjobs, schema = defaulted_jobs

    @tjobs.task(queue="mail", **scope)
    def t(i: int) -> None: ...

    with engine.begin() as conn:
        tjobs.enqueue(conn, t.with_options(unique_key="a"), 1)
        tjobs.enqueue(conn, t.with_options(unique_key="a"), 2)  # kept or replaced
    with sessionmaker(engine, class_=JobSession, jobs=tjobs).begin() as session:
        session.enqueue(t.with_options(unique_key="b"), 3)
    with engine.connect() as conn:
        got = conn.exec_driver_sql(
            f'SELECT unique_key, tenant, serial, lane, made_at IS NOT NULL FROM "{schema}".jobs'
            " ORDER BY id"
        ).all()
    # A replaced job keeps what its INSERT wrote. The callable is called once per enqueue,
    # whether or not it places a new job (a gap, as a sequence leaves).
    assert [tuple(r) for r in got] == [
        (None, "acme", 1, "mail-lane", True),
        (None, "acme", 3, "mail-lane", True),
    ]

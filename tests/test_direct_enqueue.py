"""``session.enqueue``'s jobs, written by the session's flush itself (issue 23, item 1).

A plain job is added to the session as ``session.add`` would add it, and the flush writes
it around the ORM's unit of work (:func:`sqla_jobs._enqueue.write_direct`): one prepared
INSERT, several jobs in one pipeline, and the object back in the session as persistent,
holding the row as stored. These tests hold it to what the ORM's flush did: the same
rows, the same object afterwards, the same fate under savepoints, rollbacks and errors,
and the ORM's own way wherever something could tell the difference.

How a test tells which way a job went: the direct write reads the server's defaults back
with the INSERT (its RETURNING), where the ORM's flush (``eager_defaults=False``) leaves
them to load when read.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker

from sqla_jobs import JobMixin, Jobs, JobSession
from sqla_jobs._enqueue import DIRECT_KEY, direct_shape

from . import app
from .helpers import count, rows, terminate_backend


@pytest.fixture
def send(jobs: Jobs) -> Any:
    @jobs.task(queue="mail")
    def send_email(to: str) -> None:
        pass

    return send_email


def written_directly(job: Any) -> bool:
    """The job was written by the session's flush itself: persistent, its server
    defaults read back."""
    state = sa.inspect(job)
    return state.persistent and not {"run_at", "attempts", "created_at"} & state.unloaded


def test_jobs_are_written_in_enqueue_order_and_left_persistent_and_whole(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        session.add(app.Link(code="x7Kp", url="https://example.com"))
        made = [session.enqueue(send, f"{n}@example.com") for n in range(3)]
        assert all(job in session.new for job in made)  # pending until the flush
        session.flush()
        assert all(written_directly(job) for job in made)
        assert [job.id for job in made] == sorted(job.id for job in made)
        job = made[0]
        # The server's own values, read back by the INSERT; the rest loads when read.
        assert job.attempts == 0 and job.run_at == job.created_at  # now(), both
        assert job.locked_by is None and job.meta is None
        assert session.get(app.Job, job.id) is job  # in the session's identity map
        ids = [j.id for j in made]
        session.commit()
    stored = rows(db)
    assert [r.id for r in stored] == ids
    assert [r.args["to"] for r in stored] == [f"{n}@example.com" for n in range(3)]
    assert {r.status for r in stored} == {"ready"} and {r.queue for r in stored} == {"mail"}
    assert count(db, app.Link) == 1


def test_a_written_job_behaves_as_one_the_orm_wrote(Session: Any, db: sa.Engine, send: Any) -> None:
    with Session() as session:
        kept = session.enqueue(send, "kept")
        deleted = session.enqueue(send, "deleted")
        session.flush()
        assert written_directly(kept) and written_directly(deleted)
        session.delete(deleted)  # a persistent object: deleted at the next flush
        kept.priority = 7  # and updated
        session.commit()
        assert sa.inspect(kept).expired_attributes  # expired at COMMIT, as any object
        assert kept.priority == 7  # and loaded again
    (row,) = rows(db)
    assert row.args == {"to": "kept"} and row.priority == 7


def test_expunged_or_rolled_back_before_the_flush_is_never_written(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        session.expunge(session.enqueue(send, "expunged"))
        with pytest.raises(RuntimeError), session.begin_nested():
            session.enqueue(send, "in a rolled-back savepoint")
            raise RuntimeError
        session.enqueue(send, "kept")
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["kept"]


def test_a_savepoint_that_rolls_back_takes_its_written_jobs_and_makes_them_transient(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        before = session.enqueue(send, "before")
        with pytest.raises(RuntimeError), session.begin_nested():
            inside = session.enqueue(send, "inside")
            session.flush()
            assert written_directly(inside)
            raise RuntimeError
        assert sa.inspect(inside).transient  # as the ORM leaves what it wrote there
        assert sa.inspect(before).persistent  # written before the SAVEPOINT, kept
        with session.begin_nested():
            released = session.enqueue(send, "released")
            session.flush()
        session.commit()
        assert sa.inspect(released).persistent
    assert [r.args["to"] for r in rows(db)] == ["before", "released"]


def test_an_outer_rollback_makes_the_written_jobs_transient(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        job = session.enqueue(send, "gone")
        session.flush()
        with session.begin_nested():  # released into the outer transaction
            released = session.enqueue(send, "released, then rolled back")
            session.flush()
        assert written_directly(job) and written_directly(released)
        session.rollback()
        assert sa.inspect(job).transient and sa.inspect(released).transient
        assert released.args == {"to": "released, then rolled back"}  # kept, as the ORM
        session.add(job)  # a new job, as after the ORM's rolled-back flush
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["gone"]


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "through the ORM"])
def test_what_postgresql_refuses_fails_the_flush_as_the_orm_does(
    Session: Any, db: sa.Engine, send: Any, orm: bool
) -> None:
    """A refused job fails the flush the way the ORM's own failure does: the transaction
    rolled back (PostgreSQL had aborted it), every pending object transient, and the
    session needing ``rollback()``. A ``commit()`` instead raises: PostgreSQL answers the
    COMMIT of an aborted transaction with ROLLBACK and no error, so a session that let it
    through would report success and lose the row it flushed before."""
    with Session() as session:
        if orm:
            event.listen(session, "before_flush", lambda *_: None)  # the ORM's own path
        session.add(app.Link(code="t", url="https://example.com"))
        session.flush()
        good = session.enqueue(send, "good")
        bad = session.enqueue(send, "bad")
        bad.args = {"to": "nul \x00 inside"}  # past enqueue's checks, as a later edit is
        with pytest.raises(sa.exc.DataError):
            session.flush()
        assert sa.inspect(good).transient and sa.inspect(bad).transient
        session.expunge_all()
        with pytest.raises(sa.exc.PendingRollbackError):
            session.commit()
        session.rollback()
        session.enqueue(send, "after the rollback")
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["after the rollback"]
    assert count(db, app.Link) == 0


def test_a_failure_of_a_second_table_leaves_the_first_tables_jobs_unwritten(
    Session: Any, db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """Every table's jobs are sent before any becomes persistent: when a later table's
    INSERT fails, the earlier one's jobs are not left persistent with ids of rows the
    rollback took away (a ``session.add`` of such a job would then write nothing)."""
    other = Jobs(app.OtherJob)

    @other.task
    def other_task(x: str) -> None: ...

    with Session() as session:
        first = session.enqueue(send, "first")
        bad = session.enqueue(other_task, "bad")
        bad.args = {"x": "nul \x00 inside"}
        with pytest.raises(sa.exc.DataError):
            session.flush()
        assert sa.inspect(first).transient
        session.rollback()
        session.add(first)  # as after the ORM's failed flush: added anew
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["first"]


def test_a_terminated_backend_writes_nothing_and_the_session_recovers(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        session.add(app.Link(code="t", url="https://example.com"))
        session.flush()  # the transaction has its connection
        pid = session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
        job = session.enqueue(send, "lost")
        terminate_backend(db, pid)
        with pytest.raises(sa.exc.OperationalError) as raised:
            session.flush()
        assert raised.value.connection_invalidated
        assert sa.inspect(job).transient  # as the ORM's failed flush leaves its objects
        session.rollback()
        session.enqueue(send, "again")
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["again"]
    assert count(db, app.Link) == 0


def test_a_session_of_nothing_but_jobs_writes_them_at_commit(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session.begin() as session:
        jobs_made = [session.enqueue(send, "a"), session.enqueue(send, "b")]
    assert [r.args["to"] for r in rows(db)] == ["a", "b"]
    assert all(sa.inspect(j).detached for j in jobs_made)


# -- where the ORM writes the job, as before -------------------------------------------


def test_a_watched_connection_goes_the_orms_way(Session: Any, db: sa.Engine, send: Any) -> None:
    seen: list[str] = []

    def statement(conn: Any, cursor: Any, sql: str, *rest: Any) -> None:
        seen.append(sql)

    event.listen(db, "before_cursor_execute", statement)
    try:
        with Session() as session:
            job = session.enqueue(send, "watched")
            session.flush()
            assert sa.inspect(job).persistent and not written_directly(job)
            session.commit()
    finally:
        event.remove(db, "before_cursor_execute", statement)
    assert any("INSERT INTO" in s and "jobs" in s for s in seen)
    assert count(db) == 1


def test_flush_listeners_see_the_jobs_in_session_new(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    new: list[Any] = []
    with Session() as session:

        @event.listens_for(session, "before_flush")
        def before_flush(s: Any, context: Any, objects: Any) -> None:
            new.extend(o for o in s.new if isinstance(o, app.Job))

        job = session.enqueue(send, "seen")
        session.commit()
    assert new == [job]
    assert count(db) == 1


def test_insert_events_of_the_model_still_fire(Session: Any, db: sa.Engine, send: Any) -> None:
    fired: list[Any] = []

    def before_insert(mapper: Any, connection: Any, target: Any) -> None:
        fired.append(target)

    event.listen(app.Job, "before_insert", before_insert)
    try:
        with Session.begin() as session:
            job = session.enqueue(send, "evented")
    finally:
        event.remove(app.Job, "before_insert", before_insert)
    assert fired == [job]
    assert count(db) == 1


def test_a_job_changed_after_enqueue_is_written_with_its_change(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        job = session.enqueue(send, "changed")
        job.last_error = "set by the application"  # a column enqueue does not write
        session.flush()
        assert not written_directly(job)
        session.commit()
    (row,) = rows(db)
    assert row.last_error == "set by the application"


def test_the_parents_of_a_job_with_after_are_linked_in_the_same_flush(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session.begin() as session:
        first = session.enqueue(send, "first")
        second = session.enqueue(send, "second")
        child = session.enqueue(send.with_options(after=[first]), "child")
        assert [j for _, j in session.info[DIRECT_KEY]] == [second]
        session.flush()
        first_id, child_id = first.id, child.id
    stored = {r.args["to"]: r for r in rows(db)}
    assert stored["child"].parents == [first_id] and stored["child"].waiting == 1
    assert first_id < child_id


def test_a_model_with_a_python_default_of_its_own_goes_the_orms_way(
    engine: sa.Engine, send: Any
) -> None:
    schema = f"direct_{uuid.uuid4().hex[:8]}"

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    class TenantJob(JobMixin, Base):
        __tablename__ = "jobs"
        tenant: Mapped[str] = mapped_column(default="acme")

    class PlainJob(JobMixin, Base):
        __tablename__ = "plain_jobs"
        note: Mapped[str | None] = mapped_column(server_default="hello")

    assert direct_shape(TenantJob) is None
    assert direct_shape(PlainJob) is not None
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        Base.metadata.create_all(conn)
    try:
        tenant_jobs, plain_jobs = Jobs(TenantJob), Jobs(PlainJob)

        @tenant_jobs.task
        def tenant_task() -> None: ...

        @plain_jobs.task
        def plain_task() -> None: ...

        Session = sessionmaker(engine, class_=JobSession)
        with Session.begin() as session:
            tenant = session.enqueue(tenant_task)
            plain = session.enqueue(plain_task)
            session.flush()
            assert written_directly(plain) and plain.note == "hello"  # read back
            assert tenant.tenant == "acme"
        with engine.connect() as conn:
            assert conn.exec_driver_sql(f'SELECT tenant FROM "{schema}".jobs').scalar() == "acme"
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


# -- asyncio ------------------------------------------------------------------------------


def _in_async_session(
    db: sa.Engine, jobs: Jobs, body: Callable[[Any], Awaitable[Any]], session_class: Any = None
) -> Any:
    """``body(session)`` in an asyncio session of ``session_class`` (``AsyncJobSession``
    by default) on ``db``'s database, through psycopg's async driver; what it returns."""
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqla_jobs.aio import AsyncJobSession

    async def main() -> Any:
        engine = create_async_engine(db.url.set(drivername="postgresql+psycopg"))
        try:
            made = async_sessionmaker(engine, class_=session_class or AsyncJobSession, jobs=jobs)
            async with made() as session:
                return await body(session)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def test_an_async_session_writes_its_jobs_in_one_round_trip(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    async def body(session: Any) -> list[Any]:
        made = [session.enqueue(send, f"{n}") for n in range(3)]
        await session.flush()
        assert all(written_directly(j) for j in made)
        ids = [j.id for j in made]
        await session.commit()
        return ids

    ids = _in_async_session(db, jobs, body)
    assert [r.id for r in rows(db)] == ids == sorted(ids)


def test_an_async_session_of_the_applications_own_leaves_its_jobs_to_the_orm(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """``EnqueueMixin`` in front of the application's own ``AsyncSession``, whose session
    behind is a plain one: its flush is SQLAlchemy's, so the ORM writes the jobs, and
    nothing is noted for a flush that will never look."""
    from sqlalchemy.ext.asyncio import AsyncSession

    from sqla_jobs import EnqueueMixin

    class AppSession(EnqueueMixin, AsyncSession):
        pass

    async def body(session: Any) -> None:
        job = session.enqueue(send, "app's own")
        assert not session.sync_session.info.get(DIRECT_KEY)
        await session.flush()
        assert sa.inspect(job).persistent and not written_directly(job)
        await session.commit()

    _in_async_session(db, jobs, body, AppSession)
    assert [r.args["to"] for r in rows(db)] == ["app's own"]


@pytest.mark.parametrize("kind", ["AsyncJobSession", "the app's session", "a plain one behind"])
def test_unawaited_enqueue_many_rows_postgresql_refuses_fail_the_flush(
    db: sa.Engine, jobs: Jobs, send: Any, kind: str
) -> None:
    """The rows of an ``enqueue_many`` that was not awaited (0.1's way) are written at
    the flush, after the ORM's own work; when PostgreSQL refuses them, the flush fails as
    the ORM's does, so that ``commit()`` raises instead of ending the aborted transaction
    without a word (and without the row flushed before). On ``AsyncJobSession`` and on an
    application's ``AsyncSession`` that mixes ``EnqueueMixin`` in front of a plain one, and
    on an ``AsyncJobSession`` given a plain ``sync_session_class``."""
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from sqla_jobs import EnqueueMixin
    from sqla_jobs.aio import AsyncJobSession

    class AppSession(EnqueueMixin, AsyncSession):
        pass

    class PlainBehind(AsyncJobSession):
        sync_session_class = Session

    session_class = {"the app's session": AppSession, "a plain one behind": PlainBehind}

    table = app.Job.__table__.fullname
    schema = app.Job.__table__.schema
    with db.begin() as conn:  # what PostgreSQL refuses: a row the test marks
        conn.exec_driver_sql(
            f"CREATE FUNCTION {schema}.refuse_marked() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN IF NEW.args->>'to' = 'refused' THEN RAISE EXCEPTION 'refused'; END IF; "
            "RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER refuse_marked BEFORE INSERT ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {schema}.refuse_marked()"
        )

    async def body(session: Any) -> None:
        session.add(app.Link(code="t", url="https://example.com"))
        await session.flush()
        session.enqueue_many(send, [{"to": "refused"}])  # not awaited: written at the flush
        with pytest.raises(sa.exc.DBAPIError, match="refused"):
            await session.flush()
        with pytest.raises(sa.exc.PendingRollbackError):
            await session.commit()
        await session.rollback()

    try:
        with pytest.warns(DeprecationWarning, match="awaited"):
            _in_async_session(db, jobs, body, session_class.get(kind))
    finally:
        with db.begin() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER refuse_marked ON {table}")
            conn.exec_driver_sql(f"DROP FUNCTION {schema}.refuse_marked()")
    assert count(db) == 0 and count(db, app.Link) == 0


def test_an_async_session_whose_jobs_postgresql_refuses_writes_none_of_them(
    db: sa.Engine, jobs: Jobs, send: Any
) -> None:
    """The asyncio pipeline's failure is the sync one's: SQLAlchemy's error, every job
    transient, nothing written, and the session enqueues again after its rollback."""

    async def body(session: Any) -> None:
        good = session.enqueue(send, "good")
        bad = session.enqueue(send, "bad")
        bad.args = {"to": "nul \x00 inside"}  # past enqueue's checks
        with pytest.raises(sa.exc.DataError):
            await session.flush()
        assert sa.inspect(good).transient and sa.inspect(bad).transient
        with pytest.raises(sa.exc.PendingRollbackError):
            await session.commit()
        await session.rollback()
        session.enqueue(send, "after the rollback")
        await session.commit()

    _in_async_session(db, jobs, body)
    assert [r.args["to"] for r in rows(db)] == ["after the rollback"]


# -- what the ORM's flush leaves, the direct write leaves (found by an audit) -------------
#
# Each ``orm`` twin sends the jobs through the ORM's unit of work (a ``before_flush``
# listener turns the direct write off): the reference the direct write is held to.


def _orm_way(session: Any) -> None:
    event.listen(session, "before_flush", lambda *_: None)


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_in_place_change_of_args_after_enqueue_is_written(
    Session: Any, db: sa.Engine, send: Any, orm: bool
) -> None:
    """The ORM encodes the dict the job holds at the flush; the direct write once sent the
    JSON text enqueue's check wrote, and lost a change made in place since."""
    with Session.begin() as session:
        if orm:
            _orm_way(session)
        job = session.enqueue(send, "before")
        job.args["to"] = "after"  # in place, as an application may
        session.flush()
        assert job.args == {"to": "after"}
    (row,) = rows(db)
    assert row.args == {"to": "after"}


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_lifecycle_events_as_the_orm(Session: Any, db: sa.Engine, send: Any, orm: bool) -> None:
    seen: list[str] = []
    with Session() as session:
        if orm:
            _orm_way(session)
        for name in (
            "transient_to_pending",
            "pending_to_transient",
            "detached_to_persistent",
            "persistent_to_transient",
            "persistent_to_detached",
            "before_attach",
            "after_attach",
        ):
            event.listen(session, name, (lambda n: lambda *a: seen.append(n))(name))
        session.enqueue(send, "x")
        session.flush()
        session.commit()
    # what the ORM's flush fires (pending_to_persistent is not listened for here: it
    # turns the direct write off)
    assert seen == ["before_attach", "after_attach", "transient_to_pending"]


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_expire_on_commit_false_then_read_after_close(
    db: sa.Engine, jobs: Jobs, send: Any, orm: bool
) -> None:
    made = sessionmaker(db, class_=JobSession, jobs=jobs, expire_on_commit=False)
    with made() as session:
        if orm:
            _orm_way(session)
        job = session.enqueue(send, "x")
        session.commit()
    # detached: what the object holds is readable, as for any object the ORM wrote
    assert job.id is not None
    assert job.args == {"to": "x"} and job.queue == "mail"
    assert job.locked_by is None and job.last_error is None and job.finished_at is None


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_async_expire_on_commit_false_read_after_commit(
    db: sa.Engine, jobs: Jobs, send: Any, orm: bool
) -> None:
    """The common asyncio setup: async_sessionmaker(expire_on_commit=False), then read the
    job after the commit (no I/O may happen implicitly on asyncio)."""
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqla_jobs.aio import AsyncJobSession

    async def main() -> Any:
        engine = create_async_engine(db.url.set(drivername="postgresql+psycopg"))
        try:
            made = async_sessionmaker(
                engine, class_=AsyncJobSession, jobs=jobs, expire_on_commit=False
            )
            async with made() as session:
                if orm:
                    _orm_way(session.sync_session)
                job = session.enqueue(send, "x")
                await session.commit()
                return {"id": job.id, "meta": job.meta, "last_error": job.last_error}
        finally:
            await engine.dispose()

    out = asyncio.run(main())
    assert out["meta"] is None and out["last_error"] is None


@pytest.mark.parametrize("nullable", [False, True], ids=["not_null", "nullable"])
@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_job_added_to_a_one_to_many_collection(
    engine: sa.Engine, orm: bool, nullable: bool
) -> None:
    """A model whose jobs belong to an application row (a NOT NULL foreign key), the job
    put in the parent's collection (a one-to-many without backref): the ORM sets the key
    from the parent at the flush and writes it in the INSERT."""
    schema = f"owned_{uuid.uuid4().hex[:8]}"

    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    class OwnedJob(JobMixin, Base):
        __tablename__ = "jobs"
        owner_id: Mapped[int] = mapped_column(
            sa.ForeignKey(f"{schema}.owners.id"), nullable=nullable
        )

    class Owner(Base):
        __tablename__ = "owners"
        id: Mapped[int] = mapped_column(primary_key=True)
        jobs: Mapped[list[OwnedJob]] = relationship()

    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        Base.metadata.create_all(conn)
    try:
        owned = Jobs(OwnedJob)

        @owned.task
        def work(n: int) -> None: ...

        made = sessionmaker(engine, class_=JobSession)
        with made.begin() as session:
            if orm:
                _orm_way(session)
            owner = Owner(id=1)
            session.add(owner)
            job = session.enqueue(work, 1)
            owner.jobs.append(job)
        with engine.connect() as conn:
            got = conn.exec_driver_sql(f'SELECT owner_id FROM "{schema}".jobs').all()
        assert got == [(1,)]
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_written_jobs_are_not_kept_alive_by_the_session(
    Session: Any, db: sa.Engine, send: Any, orm: bool
) -> None:
    """The ORM holds persistent objects weakly (identity map, the transaction's snapshot):
    a long transaction that writes jobs and lets go of them does not keep them all."""
    with Session() as session:
        if orm:
            _orm_way(session)
        refs = []
        for n in range(50):
            job = session.enqueue(send, str(n))
            session.flush()
            refs.append(weakref.ref(job))
        del job
        gc.collect()
        alive = sum(1 for r in refs if r() is not None)
        session.commit()
    assert alive == 0, alive


def test_two_registries_on_one_table_keep_enqueue_order(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    second = Jobs(app.Job)

    @second.task
    def other(to: str) -> None: ...

    with Session.begin() as session:
        made = [session.enqueue(send, "1"), session.enqueue(other, "2"), session.enqueue(send, "3")]
        session.flush()
        ids = [j.id for j in made]
    assert ids == sorted(ids), ids


@pytest.mark.parametrize("orm", [False, True], ids=["direct", "orm"])
def test_option_set_to_none_after_enqueue(
    Session: Any, db: sa.Engine, send: Any, orm: bool
) -> None:
    with Session.begin() as session:
        if orm:
            _orm_way(session)
        job = session.enqueue(send, "x")
        job.priority = None  # the ORM leaves a None out of the INSERT: the server default
    assert rows(db)[0].priority == 0


def test_rollback_with_savepoints_open(Session: Any, db: sa.Engine, send: Any) -> None:
    with Session() as session:
        a = session.enqueue(send, "a")
        session.begin_nested()
        b = session.enqueue(send, "b")
        session.begin_nested()
        c = session.enqueue(send, "c")
        session.flush()
        session.rollback()
        assert all(sa.inspect(j).transient for j in (a, b, c))
        session.enqueue(send, "d")
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["d"]


def test_rollback_of_an_outer_savepoint_with_an_inner_open(
    Session: Any, db: sa.Engine, send: Any
) -> None:
    with Session() as session:
        a = session.enqueue(send, "a")
        sp1 = session.begin_nested()
        b = session.enqueue(send, "b")
        session.begin_nested()
        c = session.enqueue(send, "c")
        session.flush()
        sp1.rollback()
        assert sa.inspect(a).persistent
        assert sa.inspect(b).transient and sa.inspect(c).transient
        session.commit()
    assert [r.args["to"] for r in rows(db)] == ["a"]

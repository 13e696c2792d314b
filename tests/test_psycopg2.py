"""What works over psycopg2, for an application whose own engine is
``postgresql+psycopg2://``: its migrations (``op.create_jobs_table``) and its enqueues,
every kind, in its own transactions. Workers, the CLI, ``COPY`` and result waits run on
psycopg 3 (the README's Quickstart says which needs what)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy.orm import sessionmaker

import alembic_ext  # noqa: F401  registers op.create_jobs_table
from sqla_jobs import Jobs, JobSession, Worker

from .helpers import count

pytest.importorskip("psycopg2")


@pytest.fixture
def engine2(db: sa.Engine) -> Iterator[sa.Engine]:
    """The same database through psycopg2."""
    url = db.url.set(drivername="postgresql+psycopg2")
    engine = sa.create_engine(url)
    assert engine.dialect.driver == "psycopg2"
    yield engine
    engine.dispose()


def test_enqueues_over_psycopg2_are_run_by_a_worker(
    db: sa.Engine, jobs: Jobs, engine2: sa.Engine
) -> None:
    ran: list[int] = []

    @jobs.task(queue="p2")
    def record(n: int) -> None:
        ran.append(n)

    Session2 = sessionmaker(engine2, class_=JobSession, jobs=jobs)
    with Session2.begin() as session:
        assert session.enqueue(record, 1) is not None
        session.enqueue(record.with_options(unique=True), 2)  # INSERT ... ON CONFLICT
        session.enqueue(record.with_options(unique_for=60), 3)  # a scoped key
        session.enqueue(record.with_options(meta={"tenant": 7}, delay=0), 4)
        session.enqueue_many(record, [record.args(n) for n in range(10, 20)])
        # 1,000 rows or more on an autoflush session: written at the call, by INSERT
        # (COPY is psycopg 3's).
        session.enqueue_many(record, [record.args(n) for n in range(1000, 2200)])
    with engine2.begin() as conn:
        assert isinstance(jobs.enqueue(conn, record, 5), int)
        jobs.enqueue_many(conn, record, [record.args(n) for n in range(3000, 3400)])
    with Session2() as session:  # a rolled-back transaction keeps none of its jobs
        session.enqueue(record, 6)
        session.enqueue_many(record, [record.args(n) for n in range(5000, 6500)])
        session.rollback()
    expected = [1, 2, 3, 4, 5, *range(10, 20), *range(1000, 2200), *range(3000, 3400)]
    assert count(db) == len(expected)
    Worker(jobs, db, queues=["p2"], concurrency=4, listen=False).run_until_empty(timeout=60)
    assert sorted(ran) == sorted(expected)


def test_migrations_over_psycopg2(engine2: sa.Engine) -> None:
    schema = f"p2_{uuid.uuid4().hex[:8]}"
    with engine2.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        with engine2.begin() as conn:
            op = Operations(MigrationContext.configure(conn))
            op.create_jobs_table("jobs", schema=schema, companions=True)  # type: ignore[attr-defined]
        with engine2.connect() as conn:
            inspector = sa.inspect(conn)
            tables = set(inspector.get_table_names(schema=schema))
            assert {"jobs", "jobs_queues", "jobs_schedules", "jobs_workers"} <= tables
            trigger = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = :schema AND t.tgname = 'jobs_notify'"
                ),
                {"schema": schema},
            ).scalar()
            assert trigger == 1
        with engine2.begin() as conn:
            Operations(MigrationContext.configure(conn)).drop_jobs_table(  # type: ignore[attr-defined]
                "jobs", schema=schema, companions=True
            )
    finally:
        with engine2.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))

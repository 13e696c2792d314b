"""The application of the PgBouncer scenario (tests/faults/test_pgbouncer.py): a registry of
its own on the suite's jobs table, with a plain queue, a limited queue, unique jobs, a
result-keeping task and a periodic one, and the workers' engine.

Worker processes load it as ``bouncer_app:jobs`` with ``--engine bouncer_app:engine``:
the application's own engine, through PgBouncer (``FAULTS_BOUNCER_URL``), with psycopg's
preparing turned off in ``connect_args``, as PgBouncer before 1.21 needs. Every handler
records its run through the recorder's own connection (``faults_app.record``: straight to
PostgreSQL, so the instrumentation never depends on what is tested); the limited one also
records when it ended, in ``bounce_spans``.
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import Jobs, current_job

try:
    from . import faults_app as app
except ImportError:  # a worker process loads this module from its folder, as bouncer_app
    import faults_app as app  # type: ignore[no-redef]

#: The URL the workers' engine goes through (PgBouncer), with their application_name.
BOUNCER_URL_ENV = "FAULTS_BOUNCER_URL"

QUEUE = "bounce"
LIMITED = "bounce-limited"
OTHERS = "bounce-others"
LIMIT = 2

jobs = Jobs(app.Job, max_attempts=app.ATTEMPTS)
jobs.queue(LIMITED, concurrency=LIMIT)


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=app.SCHEMA)


class Span(Base):
    """When a job of the limited queue started and ended (time.monotonic())."""

    __tablename__ = "bounce_spans"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger)
    started: Mapped[float] = mapped_column(sa.Float)
    ended: Mapped[float] = mapped_column(sa.Float)


def engine() -> sa.Engine:
    """The workers' engine (``--engine bouncer_app:engine`` calls this once per process)."""
    return sa.create_engine(
        sa.make_url(os.environ[BOUNCER_URL_ENV]),
        connect_args={"prepare_threshold": None},
        pool_pre_ping=True,
        pool_size=8,
    )


@jobs.task(name="bounce.work", queue=QUEUE)
def work(order_id: int, enq: float) -> None:
    app.record(item=order_id, enq=enq)


@jobs.task(name="bounce.limited", queue=LIMITED)
def limited(order_id: int) -> None:
    started = time.monotonic()
    app.record(item=order_id)
    time.sleep(0.02)
    with app._engine().begin() as conn:
        conn.execute(
            sa.insert(Span).values(job_id=current_job().id, started=started, ended=time.monotonic())
        )


@jobs.task(name="bounce.unique", queue=OTHERS, unique_for=600)
def unique(pair: int) -> None:
    app.record(item=pair)


@jobs.task(name="bounce.result", queue=OTHERS, keep_result=True)
def result(n: int) -> dict[str, int]:
    app.record(item=n)
    return {"n": n, "square": n * n}


# Once a year: its ticks in the test are the ones the test makes due.
@jobs.periodic("0 0 1 1 *", name="bounce.tick")
@jobs.task(name="bounce.tick", queue=OTHERS)
def tick() -> None:
    app.record()

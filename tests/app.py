"""The application the tests use: its own metadata, a jobs table, and a few tasks.

It lives in a schema of its own so that the tests never touch anything else in a shared
database (CI runs them against a server that other things may use). Worker processes
started by the tests import it as ``tests.app:jobs``.
"""

from __future__ import annotations

import logging
import os
import time

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_jobs import Backoff, JobMixin, Jobs, current_job

SCHEMA = os.environ.get("SQLA_JOBS_TEST_SCHEMA", "sqla_jobs_tests")


class Base(DeclarativeBase):
    metadata = sa.MetaData(schema=SCHEMA)


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class OtherJob(JobMixin, Base):
    """A second, independent jobs table in the same app."""

    __tablename__ = "other_jobs"


class Link(Base):
    __tablename__ = "links"
    code: Mapped[str] = mapped_column(sa.Text, primary_key=True)
    url: Mapped[str] = mapped_column(sa.Text)


class Run(Base):
    """One row per handler run, written by the handlers below (from any process)."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger)
    attempt: Mapped[int] = mapped_column(sa.Integer)
    worker: Mapped[str] = mapped_column(sa.Text)
    pid: Mapped[int] = mapped_column(sa.Integer)
    at: Mapped[float] = mapped_column(sa.Float)


jobs = Jobs(Job, retry=Backoff(base=0.05, cap=0.05, jitter=0))


def _engine() -> sa.Engine:
    from sqla_jobs import create_engine

    global _ENGINE
    if _ENGINE is None:
        _ENGINE = create_engine(os.environ["DATABASE_URL"], pool_size=2)
    return _ENGINE


_ENGINE: sa.Engine | None = None


def record() -> None:
    job = current_job()
    with _engine().begin() as conn:
        conn.execute(
            sa.insert(Run).values(
                job_id=job.id,
                attempt=job.attempts,
                worker=job.worker,
                pid=os.getpid(),
                at=time.time(),
            )
        )


@jobs.task(queue="records")
def record_run(n: int = 0) -> None:
    record()


@jobs.task(queue="records")
def slow_record(seconds: float) -> None:
    """Record the start, then take a while."""
    record()
    time.sleep(seconds)


# -- limited queues (tests/test_throttle.py) ------------------------------------------------


class Span(Base):
    """When a handler of a limited queue started and ended (from any process)."""

    __tablename__ = "spans"
    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    job_id: Mapped[int] = mapped_column(sa.BigInteger)
    key: Mapped[str | None] = mapped_column(sa.Text)
    pid: Mapped[int] = mapped_column(sa.Integer)
    started: Mapped[float] = mapped_column(sa.Float)
    ended: Mapped[float | None] = mapped_column(sa.Float)
    #: When the worker sent the claim, on the same clock as ``started`` (``time.time()``):
    #: a limit is enforced when jobs are claimed, and a handler may start a while later.
    claimed: Mapped[float | None] = mapped_column(sa.Float)


#: The limited queues' registry, on the same table: tests of other features list the
#: queues of ``jobs`` and should not see these.
limited_jobs = Jobs(Job, retry=Backoff(base=0.05, cap=0.05, jitter=0))
limited_jobs.queue("limited", concurrency=3)
limited_jobs.queue("rated", rate="20/s")
limited_jobs.queue("key_rated", key_rate="10/s")
# Strict order per key (tests/test_key_order.py): a failed head holds its key, or not.
limited_jobs.queue("ordered", key_order="fifo")
limited_jobs.queue("ordered_on", key_order="fifo", on_head_failure="continue")
# Fair share between keys (tests/test_fair_share.py), one key weighted.
limited_jobs.queue("shared", fair=True, weights={"premium": 3})


def span(key: str | None, seconds: float) -> None:
    """Record the start, work for ``seconds``, record the end."""
    job = current_job()
    started = time.time()
    claimed = started - (time.monotonic() - job.claimed_at) if job.claimed_at else None
    time.sleep(seconds)
    with _engine().begin() as conn:
        conn.execute(
            sa.insert(Span).values(
                job_id=job.id,
                key=key,
                pid=os.getpid(),
                started=started,
                ended=time.time(),
                claimed=claimed,
            )
        )


@limited_jobs.task(queue="limited")
def limited_work(seconds: float) -> None:
    span(None, seconds)


@limited_jobs.task(queue="keyed", concurrency_key=lambda account, **_: account)
def keyed_work(account: str, seconds: float) -> None:
    span(account, seconds)


@limited_jobs.task(queue="rated")
def rated_work() -> None:
    span(None, 0.0)


@limited_jobs.task(queue="key_rated", concurrency_key=lambda account, **_: account)
def key_rated_work(account: str) -> None:
    span(account, 0.0)


@limited_jobs.task(queue="ordered", concurrency_key=lambda account, **_: account)
def ordered_work(account: str, seconds: float = 0.0, fail: bool = False) -> None:
    span(account, seconds)
    if fail:
        raise RuntimeError(f"{account}: failed on purpose")


@limited_jobs.task(queue="shared", concurrency_key=lambda tenant, **_: tenant)
def shared_work(tenant: str | None, seconds: float = 0.0) -> None:
    span(tenant, seconds)


@limited_jobs.task(queue="unlimited")
def unlimited_work() -> None:
    """A queue of the same registry with no limits: claimed by the plain statement."""


# -- lines that handlers log (tests/test_cli_observability.py) -------------------------------

log = logging.getLogger("tests.app")

#: A registry of their own, on the same table: tests that list ``jobs``' queues should not
#: see this one.
talk_jobs = Jobs(Job)


@talk_jobs.task(queue="talk")
def talk(text: str) -> None:
    log.warning("handler says %s", text)


@talk_jobs.task(queue="talk")
async def talk_async(text: str) -> None:
    log.warning("async handler says %s", text)


# -- rows written by others (tests/test_poison_rows.py) ------------------------------------

#: A registry of its own, so that no other test's worker serves these queues.
poison_jobs = Jobs(Job, retry=Backoff(base=0.05, cap=0.05, jitter=0))
poison_jobs.queue("poison-limited", concurrency=2)


@poison_jobs.task(queue="poison", name="poison.work")
def poison_work(i: int, account_id: int | None = None) -> None:
    record()


@poison_jobs.task(queue="poison-limited", name="poison.limited_work")
def poison_limited_work(i: int, account_id: int | None = None) -> None:
    record()

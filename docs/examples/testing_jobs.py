"""Test code that enqueues: check what it enqueued, run the jobs, in one rolled-back
transaction. (In a test suite the session comes from a fixture; here it is spelled out.)"""

import os

from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import JobMixin, Jobs, JobSession, create_engine
from sqla_jobs.testing import assert_enqueued, assert_not_enqueued, run_queued_jobs


class Base(DeclarativeBase): ...


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    charged: Mapped[bool] = mapped_column(default=False)


jobs = Jobs(Job)


@jobs.task(transactional=True)  # gets the session: here, the test's
def charge_card(session: Session, order_id: int) -> None:
    session.get_one(Order, order_id).charged = True


@jobs.task()
def send_refund(order_id: int) -> None: ...


@jobs.task()  # five attempts by default
def flaky(order_id: int) -> None:
    raise ConnectionError("the partner's API is down")


def checkout(session: Session, order_id: int) -> None:
    """The code under test: an order and its job, in the caller's transaction."""
    session.add(Order(id=order_id))
    session.enqueue(charge_card, order_id=order_id)


engine = create_engine(os.environ["DATABASE_URL"])
Base.metadata.create_all(engine)
with engine.connect() as conn, conn.begin() as outer:  # the test's transaction
    session = JobSession(bind=conn, jobs=jobs)
    checkout(session, order_id=7)
    assert_enqueued(session, charge_card, order_id=7)  # a subset of the arguments
    assert_not_enqueued(session, send_refund)
    summary = run_queued_jobs(session, jobs)  # the real handlers, here
    assert summary.succeeded == 1, summary
    summary.raise_errors()  # fails with the tracebacks, if any
    assert session.get_one(Order, 7).charged

    session.enqueue(flaky, order_id=7)
    summary = run_queued_jobs(session, jobs, include_scheduled=True)  # retries too
    assert (summary.retried, summary.dead) == (4, 1), summary
    outer.rollback()  # nothing of the test is kept

"""An order's fulfilment as one durable job: charge the card once, reserve the stock in the
shop's own tables exactly once, wait three days (the cooling-off period) holding no worker,
then wait for the carrier's webhook before the shipping e-mail."""

import os
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_jobs import JobMixin, Jobs, JobSession, Steps, Worker, create_engine


class Base(DeclarativeBase): ...


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class Stock(Base):
    __tablename__ = "stock"
    sku: Mapped[str] = mapped_column(primary_key=True)
    left: Mapped[int]


jobs = Jobs(Job)
charges: list[str] = []  # stands for the payment provider
mails: list[str] = []


def charge_card(order_id: int, cents: int) -> dict[str, str]:
    """An external call: it runs again only if the worker dies between its return and the
    checkpoint (pass the provider an idempotency key, here the order id, for that case)."""
    charges.append(f"order {order_id}: {cents} cents")
    return {"charge": f"ch_{order_id}"}


def reserve(session: Session, sku: str) -> int:
    """Takes a session: its UPDATE commits with the step's checkpoint, exactly once."""
    item = session.get(Stock, sku, with_for_update=True)
    assert item is not None
    item.left -= 1
    return item.left


@jobs.task(durable=True, queue="orders")
def fulfil(steps: Steps, order_id: int, sku: str) -> None:
    charge = steps.run("charge", charge_card, order_id, 4200)
    steps.run("reserve stock", reserve, sku)
    steps.sleep("cooling-off", timedelta(days=3))  # the attempt ends here; no slot is held
    parcel = steps.wait("shipped", timeout=timedelta(days=14))  # until jobs.signal(...)
    steps.run("e-mail", lambda: mails.append(f"{charge['charge']}: {parcel['tracking']}"))


engine = create_engine(os.environ["DATABASE_URL"])
Base.metadata.create_all(engine)
Session = sessionmaker(engine, class_=JobSession, jobs=jobs)
with Session.begin() as session:
    session.add(Stock(sku="mug", left=10))
    job = session.enqueue(fulfil, order_id=1042, sku="mug")
    session.flush()
    job_id = job.id

worker = Worker(jobs, engine, queues=["orders"], listen=False)
worker.run_until_empty()  # charge, reserve, then asleep for three days
with engine.connect() as conn:
    assert conn.execute(sa.select(Job.status).where(Job.id == job_id)).scalar() == "scheduled"

# Three days pass (here: the job's time moved to now; a worker would wake it by itself).
with engine.begin() as conn:
    conn.execute(sa.text("UPDATE jobs_steps SET until = now() WHERE name = 'cooling-off'"))
    conn.execute(sa.update(Job).where(Job.id == job_id).values(run_at=sa.func.now()))
worker.run_until_empty(wait_scheduled=1)  # the sleep is over: now it waits for the carrier

# The carrier's webhook, in the web app's own transaction: sent only if it commits.
with Session.begin() as session:
    assert jobs.signal(session, job_id, "shipped", {"tracking": "1Z999"}) == "woken"
worker.run_until_empty()  # the steps before are skipped; the e-mail goes out

assert charges == ["order 1042: 4200 cents"]  # once, over three attempts
assert mails == ["ch_1042: 1Z999"]
with Session() as session:
    stock = session.get(Stock, "mug")
    assert stock is not None and stock.left == 9  # reserved once
print("charged once, reserved once, mailed:", mails[0])

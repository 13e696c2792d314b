"""A Flask app with Flask-SQLAlchemy, whose ``db.session`` enqueues jobs.

Flask-SQLAlchemy takes the session class to use (``session_options={"class_": ...}``),
so ``EnqueueMixin`` goes in front of its own ``Session``: the jobs then ride
``db.session``'s transaction, committed by the same ``db.session.commit()`` as the
order, or rolled back with it. ``db.session`` is a ``scoped_session``, which forwards
only the methods SQLAlchemy's ``Session`` has, so call it, ``db.session()``, to reach
``enqueue``.

``FlaskJobs(jobs, db)`` (:mod:`sqla_jobs.flask`) runs every job inside an app context,
and makes ``db.session`` the session of a transactional job: the receipt's mark commits
with the job's completion. Workers run beside the app, in processes of their own, which
import ``examples/flask_app/worker.py`` (it makes the app):

.. code-block:: sh

    export DATABASE_URL=postgresql://app@db/app
    flask --app 'examples.flask_app.app:create_app' create-tables
    flask --app 'examples.flask_app.app:create_app' run
    sqla-jobs worker examples.flask_app.worker:jobs
"""

from __future__ import annotations

import os
from typing import Any, cast

import sqlalchemy as sa
from flask import Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from flask_sqlalchemy.session import Session as FlaskSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sqla_jobs import EnqueueMixin, JobMixin, Jobs
from sqla_jobs.db import normalize_url
from sqla_jobs.flask import FlaskJobs


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "jobs"


jobs = Jobs(Job)


class AppSession(EnqueueMixin, FlaskSession):
    """Flask-SQLAlchemy's session, with ``enqueue`` and ``enqueue_many``."""


db = SQLAlchemy(model_class=Base, session_options={"class_": AppSession, "jobs": jobs})
flask_jobs = FlaskJobs(jobs, db)  # jobs run in an app context; db.session is theirs


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    item: Mapped[str] = mapped_column(sa.Text)
    receipt_sent: Mapped[bool] = mapped_column(sa.Boolean, default=False)


@jobs.task(queue="receipts", transactional=True)
def send_receipt(session: Session, order_id: int) -> None:
    """Send the receipt (here: record that it went), exactly once: the mark commits with
    the job's completion. ``session`` is ``db.session()``, so helpers that write through
    ``db.session`` write in that transaction too."""
    order = db.session.get(Order, order_id)
    if order is not None:
        order.receipt_sent = True


def session() -> AppSession:
    """The request's session (``db.session`` is a scoped_session around it)."""
    return cast(AppSession, db.session())


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    url = normalize_url(database_url or os.environ["DATABASE_URL"])  # postgresql+psycopg://
    app.config["SQLALCHEMY_DATABASE_URI"] = url.render_as_string(hide_password=False)
    db.init_app(app)
    flask_jobs.init_app(app)

    @app.cli.command("create-tables")
    def create_tables() -> None:
        """Create the tables (orders, and jobs with its indexes, trigger and companions)."""
        db.create_all()
        print("created:", ", ".join(sorted(Base.metadata.tables)))

    @app.post("/orders")
    def place_order() -> tuple[dict[str, Any], int]:
        item = (request.get_json(silent=True) or {}).get("item")
        if not item:
            abort(400)
        order = Order(item=item)
        db.session.add(order)
        db.session.flush()  # the order's id
        session().enqueue(send_receipt, order_id=order.id)
        if item == "crash":  # a request that fails after enqueueing
            raise RuntimeError("the payment provider said no")
        db.session.commit()  # the order and its job, together
        return {"id": order.id}, 201

    @app.get("/orders/<int:order_id>")
    def show(order_id: int) -> dict[str, Any]:
        order = db.get_or_404(Order, order_id)
        return {"id": order.id, "item": order.item, "receipt_sent": order.receipt_sent}

    return app

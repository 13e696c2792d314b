"""A Flask + Flask-SQLAlchemy application written as such apps usually are: the default
``db.Model``, an app factory, ``current_app`` and ``db.session`` in its handlers, and
``url_for(..., _external=True)`` with ``SERVER_NAME``. Its jobs run under a real
``sqla-jobs worker`` process (``tests/test_flask.py``), which imports
``tests.flask_worker:jobs``; :class:`sqla_jobs.flask.FlaskJobs` gives every run an app
context and makes ``db.session`` a transactional run's session.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.operations import Operations
from flask import Flask, abort, current_app, request, url_for
from flask_sqlalchemy import SQLAlchemy
from flask_sqlalchemy.session import Session as FlaskSession
from sqlalchemy.orm import Mapped, Session, mapped_column

import alembic_ext  # noqa: F401  registers op.create_jobs_table
from sqla_jobs import EnqueueMixin, JobMixin, Jobs, current_job
from sqla_jobs.db import normalize_url
from sqla_jobs.flask import FlaskJobs


class AppSession(EnqueueMixin, FlaskSession):
    """Flask-SQLAlchemy's session, with ``enqueue``."""


db = SQLAlchemy(session_options={"class_": AppSession})


class Job(JobMixin, db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "jobs"


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    item: Mapped[str] = mapped_column(sa.Text)
    receipt_url: Mapped[str | None] = mapped_column(sa.Text)
    receipt_by: Mapped[str | None] = mapped_column(sa.Text)
    archived: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    notified: Mapped[str | None] = mapped_column(sa.Text)


jobs = Jobs(Job)
flask_jobs = FlaskJobs(jobs, db)


def mark_receipt(order_id: int) -> None:
    """A model helper, as apps have them: it writes through ``db.session``."""
    order = db.session.get(Order, order_id)
    assert order is not None
    order.receipt_url = url_for("show", order_id=order_id, _external=True)
    order.receipt_by = current_app.config["SHOP_NAME"]


@jobs.task(queue="receipts", transactional=True)
def send_receipt(session: Session, order_id: int) -> None:
    """Exactly once: the helper's writes through ``db.session``, and the job it enqueues
    there, commit with this job's completion."""
    assert session is db.session(), "the run's session is db.session"
    mark_receipt(order_id)
    db.session().enqueue(archive, order_id=order_id)
    if db.session.get(Order, order_id).item == "crash":  # type: ignore[union-attr]
        raise RuntimeError("after writing through db.session")


@jobs.task(queue="receipts")
def archive(order_id: int) -> None:
    """A plain handler: an app context of its own, and a ``db.session`` it commits."""
    order = db.session.get(Order, order_id)
    assert order is not None
    order.archived = True
    db.session.commit()


@jobs.task(queue="receipts")
async def notify(order_id: int) -> None:
    """An ``async def`` handler, inside the run's app context as well."""
    order = db.session.get(Order, order_id)
    assert order is not None
    order.notified = f"{current_app.name} job {current_job().id}"
    db.session.commit()


@jobs.task(queue="durable", durable=True)
def relabel(order_id: int, steps: Any) -> None:
    """A durable handler that reads through ``db.session`` first, as Flask code does, then
    runs a step that writes in a session of its own."""
    order = db.session.get(Order, order_id)
    assert order is not None

    def write(session: Session) -> None:
        assert session is not db.session(), "a step's session is its own"
        mine = session.get(Order, order_id)
        assert mine is not None
        mine.notified = "relabelled"

    steps.run("relabel", write)


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    url = normalize_url(database_url or os.environ["DATABASE_URL"])
    app.config["SQLALCHEMY_DATABASE_URI"] = url.render_as_string(hide_password=False)
    app.config["SERVER_NAME"] = "shop.example"
    app.config["SHOP_NAME"] = "the Flask test shop"
    db.init_app(app)
    flask_jobs.init_app(app)

    @app.post("/orders")
    def place_order() -> tuple[dict[str, Any], int]:
        item = (request.get_json(silent=True) or {}).get("item")
        if not item:
            abort(400)
        order = Order(item=item)
        db.session.add(order)
        db.session.flush()
        db.session().enqueue(send_receipt, order_id=order.id)
        db.session().enqueue(notify, order_id=order.id)
        db.session.commit()
        return {"id": order.id}, 201

    @app.get("/orders/<int:order_id>")
    def show(order_id: int) -> dict[str, Any]:
        order = db.get_or_404(Order, order_id)
        return {
            "receipt_url": order.receipt_url,
            "receipt_by": order.receipt_by,
            "archived": order.archived,
            "notified": order.notified,
        }

    return app


def create_tables(app: Flask) -> None:
    """``db.create_all()``, once ``JobMixin`` builds its whole schema on the default
    ``db.Model``; until then the jobs table (and its companions, trigger and indexes) comes
    from ``op.create_jobs_table``, as a migration would write it."""
    with app.app_context():
        if not Job.__table__.indexes:  # a bare table: the mixin's schema was not attached
            with db.engine.begin() as conn:
                Operations(MigrationContext.configure(conn)).create_jobs_table(  # type: ignore[attr-defined]
                    "jobs", companions=True
                )
        db.create_all()

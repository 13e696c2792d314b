"""``sqla_jobs.flask``: a Flask-SQLAlchemy app (``tests/flask_app.py``: the default
``db.Model``, an app factory) whose jobs run under a real ``sqla-jobs worker`` process, in
the app's context, with ``db.session`` as a transactional run's session."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Worker, create_engine
from sqla_jobs.db import embedded_url, normalize_url
from sqla_jobs.testing import run_queued_jobs

from . import flask_app
from .flask_app import Job, Order, create_app, create_tables, db, jobs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A database of its own for the app's tables, dropped afterwards."""
    server = normalize_url(os.environ.get("DATABASE_URL") or embedded_url())
    name = f"flask_ext_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    create_tables(create_app(url))
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def app(database: str) -> Iterator[Any]:
    flask = create_app(database)
    with flask.app_context():
        db.session.execute(sa.text("TRUNCATE orders, jobs RESTART IDENTITY"))
        db.session.commit()
    yield flask
    with flask.app_context():
        db.engine.dispose()


def order_of(app: Any, order_id: int) -> dict[str, Any]:
    response = app.test_client().get(f"/orders/{order_id}")
    assert response.status_code == 200, response.text
    return dict(response.json)


def left(app: Any) -> list[tuple[str, str]]:
    with app.app_context():
        return [(j.task, j.status) for j in db.session.scalars(sa.select(Job).order_by(Job.id))]


def test_jobs_run_in_the_apps_context_under_a_real_worker_process(app: Any, database: str) -> None:
    created = app.test_client().post("/orders", json={"item": "lamp"})
    assert created.status_code == 201, created.text
    order_id = created.json["id"]
    worker = subprocess.run(
        [
            *(sys.executable, "-m", "sqla_jobs.cli", "worker", "tests.flask_worker:jobs"),
            *("--queues", "receipts", "--until-empty", "--no-listen"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": database},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 0, worker.stderr
    assert "failed" not in worker.stderr, worker.stderr
    # send_receipt (transactional: url_for with SERVER_NAME, current_app, db.session), the
    # archive job it enqueued through db.session, and the async notify, all ran.
    assert order_of(app, order_id) == {
        "receipt_url": f"http://shop.example/orders/{order_id}",
        "receipt_by": "the Flask test shop",
        "archived": True,
        "notified": "tests.flask_app job 2",
    }
    assert left(app) == []


def test_writes_through_db_session_roll_back_with_a_failed_run(app: Any, database: str) -> None:
    order_id = app.test_client().post("/orders", json={"item": "crash"}).json["id"]
    engine = create_engine(database)
    try:
        Worker(jobs, engine, queues=["receipts"], listen=False).run_until_empty(timeout=30)
    finally:
        engine.dispose()
    # The helper's writes and the job enqueued through db.session went with the failure.
    assert order_of(app, order_id)["receipt_url"] is None
    assert ("tests.flask_app.archive", "ready") not in left(app)
    assert [task for task, status in left(app) if status == "scheduled"] == [
        "tests.flask_app.send_receipt"
    ]


def test_a_durable_steps_session_is_its_own_after_the_handler_used_db_session(
    app: Any, database: str
) -> None:
    """A durable handler that read through ``db.session`` (leaving it in a transaction),
    then runs a step that takes a session: the step gets a session of its own, as the
    docs say. (It got ``db.session()``, already in a transaction, which the run refused:
    every attempt failed and the job ended dead.)"""
    order_id = app.test_client().post("/orders", json={"item": "label"}).json["id"]
    with app.app_context():
        db.session().enqueue(flask_app.relabel, order_id=order_id)
        db.session.commit()
    engine = create_engine(database)
    try:
        Worker(jobs, engine, queues=["durable"], listen=False).run_until_empty(timeout=30)
    finally:
        engine.dispose()
    assert order_of(app, order_id)["notified"] == "relabelled"
    assert ("tests.flask_app.relabel", "dead") not in left(app)


def test_run_queued_jobs_in_an_app_context_shares_its_db_session(app: Any) -> None:
    order_id = app.test_client().post("/orders", json={"item": "book"}).json["id"]
    with app.app_context():
        # The test's own transaction: db.session, rolled back at the end.
        summary = run_queued_jobs(db.session(), jobs, queues=["receipts"])
        assert summary.succeeded == 3
        order = db.session.get(Order, order_id)
        assert order is not None and order.receipt_url and order.archived
        db.session.rollback()


def test_the_app_is_the_last_one_initialised(app: Any) -> None:
    # The fixture's app is the last one made: run first in its process, this test found
    # none when it relied on an earlier test's.
    assert flask_app.flask_jobs.app is app
    assert app.extensions["sqla_jobs"] is flask_app.flask_jobs
    with pytest.raises(ValueError, match="already has a session_factory"):
        from sqla_jobs import Jobs
        from sqla_jobs.flask import FlaskJobs

        registry = Jobs(Job, session_factory=lambda bind: db.session())
        FlaskJobs(registry, db, create_app("postgresql://nobody@localhost/nothing"))

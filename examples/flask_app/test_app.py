"""The Flask recipe's tests: requests through Flask's test client, a real PostgreSQL (a
database of their own), the real worker."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Worker, create_engine
from sqla_jobs.db import embedded_url, normalize_url

from .app import Base, Job, Order, create_app, db, jobs, send_receipt


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh database with the app's tables, dropped afterwards."""
    server = normalize_url(os.environ.get("DATABASE_URL") or embedded_url())
    name = f"flask_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url)
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def app(database: str) -> Iterator[Any]:
    flask_app = create_app(database)
    flask_app.config["TESTING"] = False  # let a failing request fail as in production
    with flask_app.app_context():
        db.session.execute(sa.text("TRUNCATE orders, jobs RESTART IDENTITY"))
        db.session.commit()
    yield flask_app
    with flask_app.app_context():
        db.engine.dispose()


def jobs_of(app: Any) -> list[tuple[str, dict[str, Any]]]:
    with app.app_context():
        return [
            (r.task, r.args) for r in db.session.execute(sa.select(Job).order_by(Job.id)).scalars()
        ]


def test_an_order_commits_with_its_job(app: Any) -> None:
    client = app.test_client()
    created = client.post("/orders", json={"item": "book"})
    assert created.status_code == 201, created.text
    order_id = created.json["id"]
    assert jobs_of(app) == [(send_receipt.name, {"order_id": order_id})]
    # A request that fails after enqueueing leaves neither an order nor a job.
    failed = client.post("/orders", json={"item": "crash"})
    assert failed.status_code == 500
    with app.app_context():
        assert db.session.execute(sa.select(sa.func.count()).select_from(Order)).scalar() == 1
    assert len(jobs_of(app)) == 1


def test_the_worker_sends_the_receipt(app: Any, database: str) -> None:
    client = app.test_client()
    order_id = client.post("/orders", json={"item": "lamp"}).json["id"]
    assert client.get(f"/orders/{order_id}").json["receipt_sent"] is False
    engine = create_engine(database)
    try:
        assert Worker(jobs, engine, queues=["receipts"]).run_until_empty(timeout=30) == 1
    finally:
        engine.dispose()
    assert client.get(f"/orders/{order_id}").json["receipt_sent"] is True
    assert jobs_of(app) == []

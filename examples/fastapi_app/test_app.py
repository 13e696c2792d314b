"""The FastAPI recipe's tests: real requests (FastAPI's TestClient), a real PostgreSQL
(a database of their own, created and dropped here), the real worker."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from sqla_jobs import create_engine
from sqla_jobs.aio import AsyncWorker
from sqla_jobs.db import embedded_url, normalize_url

from .app import Base, Job, User, create_app, jobs, send_welcome


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh database with the app's tables, dropped afterwards."""
    server = normalize_url(os.environ.get("DATABASE_URL") or embedded_url())
    name = f"fastapi_{uuid.uuid4().hex[:8]}"
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
def db(database: str) -> Iterator[sa.Engine]:
    engine = create_engine(database)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE users, jobs RESTART IDENTITY"))
    yield engine
    engine.dispose()


def jobs_of(db: sa.Engine) -> list[sa.Row[tuple[str, dict[str, int]]]]:
    with db.connect() as conn:
        return list(conn.execute(sa.select(Job.task, Job.args).order_by(Job.id)))


def test_sign_up_commits_the_user_and_its_job_together(database: str, db: sa.Engine) -> None:
    with TestClient(create_app(database)) as client:
        created = client.post("/users", json={"email": "ada@example.com"})
        assert created.status_code == 201, created.text
        user_id = created.json()["id"]
        # Committed before the response: another connection sees both at once.
        assert [(t, a) for t, a in jobs_of(db)] == [(send_welcome.name, {"user_id": user_id})]
        # A request that fails (the email is taken) leaves neither a user nor a job.
        taken = client.post("/users", json={"email": "ada@example.com"})
        assert taken.status_code == 409
    with db.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(User)).scalar() == 1
    assert len(jobs_of(db)) == 1


def test_the_job_runs_on_a_worker(database: str, db: sa.Engine) -> None:
    with TestClient(create_app(database)) as client:
        user_id = client.post("/users", json={"email": "bob@example.com"}).json()["id"]
        assert client.get(f"/users/{user_id}").json()["welcomed"] is False

    async def drain() -> int:
        worker = AsyncWorker(jobs, database, queues=["mail"])
        try:
            return await worker.run_until_empty(timeout=30)
        finally:
            await worker.engine.dispose()

    assert asyncio.run(drain()) == 1
    with TestClient(create_app(database)) as client:
        assert client.get(f"/users/{user_id}").json()["welcomed"] is True
    assert jobs_of(db) == []


def test_the_worker_beside_the_app(database: str, db: sa.Engine) -> None:
    with TestClient(create_app(database, worker=True)) as client:
        user_id = client.post("/users", json={"email": "cy@example.com"}).json()["id"]
        deadline = time.monotonic() + 20
        while not client.get(f"/users/{user_id}").json()["welcomed"]:
            assert time.monotonic() < deadline, "the in-process worker never ran the job"
            time.sleep(0.05)
    # The lifespan stopped the worker and disposed of the engine; the job is done.
    assert jobs_of(db) == []


def test_the_dashboard_is_mounted_read_only(database: str, db: sa.Engine) -> None:
    # The dashboard answers for localhost only (allowed_hosts=): not for "testserver".
    with TestClient(create_app(database), base_url="http://localhost") as client:
        client.post("/users", json={"email": "grace@example.com"})
        page = client.get("/admin/jobs/jobs")
        assert page.status_code == 200
        assert send_welcome.name in page.text
        assert client.get("/admin/jobs/").status_code == 200

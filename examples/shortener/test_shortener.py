"""Snip's own tests, written the way an app using sqla-jobs would write them: with
``sqla_jobs.testing``, inside a transaction that is rolled back at the end.

They run on a database of their own (created on ``DATABASE_URL``'s server, or on a
throwaway embedded PostgreSQL), migrated with the example's Alembic migrations.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from sqla_jobs import JobSession, create_engine
from sqla_jobs.db import embedded_url, normalize_url
from sqla_jobs.testing import assert_enqueued, assert_not_enqueued, run_queued_jobs

from .app import Link, call_webhook, create_link, fetch_preview, jobs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture
def database() -> Iterator[str]:
    """A fresh database, migrated to head, dropped afterwards: one per test, since the
    demo commits the links the other tests create (in a transaction they roll back), and
    run before them it made their inserts collide."""
    server = normalize_url(os.environ.get("DATABASE_URL") or embedded_url())
    name = f"snip_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    previous = os.environ.get("DATABASE_URL")
    os.environ["DATABASE_URL"] = url
    try:
        config = Config(str(HERE / "alembic.ini"))
        config.attributes["configure_logger"] = False
        command.upgrade(config, "head")
        yield url
    finally:
        if previous is None:
            del os.environ["DATABASE_URL"]
        else:
            os.environ["DATABASE_URL"] = previous
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def session(database: str) -> Iterator[JobSession]:
    """A session in a transaction that the test never commits."""
    engine = create_engine(database)
    with engine.connect() as conn, conn.begin() as transaction:
        with JobSession(bind=conn, jobs=jobs) as s:
            yield s
        transaction.rollback()
    engine.dispose()


@pytest.fixture
def site() -> Iterator[str]:
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html><title>Spring sale</title></html>")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_creating_a_link_enqueues_its_jobs_then_they_run(session: JobSession, site: str) -> None:
    create_link(session, "x7Kp", f"{site}/spring", webhook=f"{site}/hooks")
    create_link(session, "q2Lm", f"{site}/autumn", webhook=None)

    assert_enqueued(session, fetch_preview, code="x7Kp")
    assert_enqueued(session, call_webhook, code="x7Kp", event="link.created")
    assert_not_enqueued(session, call_webhook, code="q2Lm")

    summary = run_queued_jobs(session, jobs)
    summary.raise_errors()
    assert (summary.ran, summary.succeeded) == (3, 3)
    assert session.get(Link, "x7Kp").title == "Spring sale"  # type: ignore[union-attr]


def test_a_preview_for_a_missing_link_fails_permanently(session: JobSession) -> None:
    session.enqueue(fetch_preview, code="nope")
    summary = run_queued_jobs(session, jobs)
    assert (summary.ran, summary.dead) == (1, 1)
    assert "no link 'nope'" in (summary.runs[0].error or "")


def test_the_demo_runs(database: str) -> None:
    result = subprocess.run(
        [sys.executable, str(HERE / "demo.py")],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "queued: 3 jobs (the failed request left none behind)" in result.stdout
    assert "worker: ran 4 jobs" in result.stdout
    assert "title='Snip page /spring'" in result.stdout
    assert '\'{"event": "link.created", "code": "x7Kp"}\'' in result.stdout

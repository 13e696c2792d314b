"""The dashboard (``sqla_jobs.web``) through Starlette's test client, on a real PostgreSQL:
every page, every action, the guards (read-only, CSRF, authorize, what the operator saw),
escaping, bad input, a database that is down, and mounting under a path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("starlette")
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from sqla_jobs import Jobs, admin
from sqla_jobs.model import companion_tables, job_table
from sqla_jobs.periodic import add_schedule
from sqla_jobs.web import create_app
from sqla_jobs.web.app import BLOCKED_SHOWN

from . import app
from .helpers import running, wait_for

TABLE = job_table(app.Job)
#: A host the dashboard answers for by default (the test client's own is "testserver").
BASE = "http://localhost"
COMPANIONS = companion_tables(TABLE)


def insert(engine: sa.Engine, **values: Any) -> int:
    """One job row as it would be at some point of its life."""
    row = {"task": "t.work", "queue": "a", "args": {}, "status": "ready"} | values
    if row["status"] in ("done", "dead", "cancelled"):
        row.setdefault("finished_at", datetime.now(timezone.utc))
    with engine.begin() as conn:
        return int(conn.execute(sa.insert(TABLE).values(**row).returning(TABLE.c.id)).scalar_one())


def job(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(TABLE).where(TABLE.c.id == job_id)).first()


@pytest.fixture
def registry(jobs: Jobs) -> Jobs:
    @jobs.task(queue="a", name="t.work")
    def work(n: int = 0, note: str = "") -> None: ...

    @jobs.task(queue="b", name="t.other")
    def other() -> None: ...

    return jobs


@pytest.fixture
def make_client(db: sa.Engine, registry: Jobs) -> Callable[..., TestClient]:
    def make(**options: Any) -> TestClient:
        return TestClient(
            create_app(registry, db, **options), base_url=BASE, follow_redirects=False
        )

    return make


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    """A dashboard with actions enabled, and its CSRF cookie set by a first page."""
    c = make_client(read_only=False)
    assert c.get("/").status_code == 200
    return c


def token(client: TestClient) -> str:
    value = client.cookies.get("sqla_jobs_csrf")
    assert value
    return value


def post(client: TestClient, url: str, **form: Any) -> Any:
    data = {"csrf_token": token(client), **form}
    return client.post(url, data=data)


# -- pages ----------------------------------------------------------------------------------


def test_every_page_renders(client: TestClient, db: sa.Engine, registry: Jobs) -> None:
    dead = insert(db, status="dead", attempts=5, last_error="Traceback...\nValueError: boom")
    with db.begin() as conn:
        add_schedule(conn, registry, "nightly", "t.other", "0 3 * * *")
    pages = {
        "/": "Overview",
        "/jobs": f"/jobs/{dead}",
        "/jobs?status=dead&queue=a&task=t.work": "ValueError: boom",
        f"/jobs/{dead}": "What happens next",
        "/schedules": "nightly",
        "/workers": "No worker has reported",
        "/static/htmx.min.js": "htmx",
        "/static/dashboard.css": "--accent",
    }
    for url, expected in pages.items():
        response = client.get(url)
        assert response.status_code == 200, url
        assert expected in response.text, url
    page = client.get("/")
    assert "content-security-policy" in page.headers
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_overview_counts_queues_lag_pauses_and_outcomes(
    client: TestClient, db: sa.Engine, registry: Jobs
) -> None:
    old = datetime.now(timezone.utc) - timedelta(minutes=3)
    insert(db, queue="a", status="ready", run_at=old)
    insert(db, queue="a", status="ready")
    insert(db, queue="a", status="scheduled", run_at=old + timedelta(days=1))
    insert(db, queue="b", status="dead")
    insert(db, queue="b", status="running", locked_by="w1", locked_until=old)
    insert(db, queue="b", status="done")
    with db.begin() as conn:
        admin.pause_queue(conn, registry, "c")
        conn.execute(
            sa.insert(COMPANIONS.throughput).values(
                minute=sa.func.date_trunc("minute", sa.func.now()),
                queue="a",
                succeeded=40,
                failed=3,
                dead=1,
            )
        )
    with db.connect() as conn:
        found = {q.queue: q for q in admin.queue_states(conn, registry, finished=False)}
    assert set(found) == {"a", "b", "c"}
    a, b, c = found["a"], found["b"], found["c"]
    assert (a.ready, a.scheduled, a.running, a.dead, a.paused) == (2, 1, 0, 0, False)
    assert a.lag_seconds is not None and 170 < a.lag_seconds < 400
    assert (b.ready, b.running, b.lease_expired, b.dead, b.lag_seconds) == (0, 1, 1, 1, None)
    assert c.paused and c.paused_since is not None
    page = client.get("/").text
    assert "40 succeeded, 3 failed (1 dead)" in page
    assert '<span class="badge paused">paused</span>' in page
    # The live refresh asks for the fragment alone.
    live = client.get("/", headers={"HX-Request": "true"})
    assert live.status_code == 200
    assert live.text.lstrip().startswith('<div id="live"')
    assert "<html" not in live.text


def test_the_overview_shows_keys_blocked_behind_a_failed_head(
    make_client: Callable[..., TestClient], db: sa.Engine, registry: Jobs
) -> None:
    """A queue in key order whose head died: the overview names the key, links the head,
    and says how many wait behind it; nothing is shown once the head is gone."""
    registry.queue("ledger", key_order="fifo")
    client = make_client()
    assert "Blocked keys" not in client.get("/").text
    head = insert(db, queue="ledger", status="dead", concurrency_key="acct-7")
    for _ in range(2):
        insert(db, queue="ledger", status="ready", concurrency_key="acct-7")
    insert(db, queue="ledger", status="ready", concurrency_key="acct-8")
    page = client.get("/").text
    panel = page.split("<h2>Blocked keys</h2>")[1].split("</section>")[0]
    assert "<code>acct-7</code>" in panel and "acct-8" not in panel
    assert f'href="/jobs/{head}">#{head}</a>' in panel
    assert '<span class="badge dead">dead</span>' in panel
    assert '<td class="num">2</td>' in panel
    with db.begin() as conn:
        conn.execute(sa.delete(TABLE).where(TABLE.c.id == head))
    assert "Blocked keys" not in client.get("/").text
    # After an outage that left thousands of keys held, the overview (refreshed every
    # 5 s) lists the first few and points to the CLI: it read and showed them all.
    with db.begin() as conn:
        conn.execute(
            sa.insert(TABLE),
            [
                {"task": "t", "queue": "ledger", "status": "dead", "concurrency_key": f"k{i:03}"}
                for i in range(BLOCKED_SHOWN + 5)
            ],
        )
    panel = client.get("/").text.split("<h2>Blocked keys</h2>")[1].split("</section>")[0]
    assert panel.count("<code>k") == BLOCKED_SHOWN and "<code>k000</code>" in panel
    assert "sqla-jobs queues blocked</code> lists them all" in panel


def test_the_job_list_filters_and_pages_by_keyset_newest_first(
    client: TestClient, db: sa.Engine
) -> None:
    ids = [insert(db, queue="a" if i % 2 else "b", args={"n": i}) for i in range(130)]
    first = client.get("/jobs?queue=a")
    listed = [int(i) for i in re.findall(r'href="/jobs/(\d+)"', first.text)]
    expected = [i for i in reversed(ids) if (i - ids[0]) % 2 == 1]
    assert listed == expected[:50]
    older = re.search(r'href="/jobs\?queue=a&amp;before=(\d+)"', first.text)
    assert older and int(older.group(1)) == expected[49]
    second = client.get(f"/jobs?queue=a&before={older.group(1)}")
    assert [int(i) for i in re.findall(r'href="/jobs/(\d+)"', second.text)] == expected[50:65]
    assert "before=" not in second.text.split('class="pager"')[1].split("Newest")[1]
    # Past the end, and malformed filters, get clear pages with their status code.
    past = client.get(f"/jobs?queue=a&before={min(ids)}")
    assert past.status_code == 404 and "past the end" in past.text
    for url, message in [
        ("/jobs?before=abc", "before must be a whole number"),
        ("/jobs?status=bogus", "unknown status &#39;bogus&#39;"),
        ("/jobs?q=%7Bnope", "not a JSON object"),
        ("/jobs/confirm?action=explode", "unknown action"),
    ]:
        response = client.get(url)
        assert response.status_code == 400, url
        assert message in response.text, url
        assert "Traceback" not in response.text


def test_search_by_id_by_arguments_and_by_text(
    client: TestClient, db: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [insert(db, args={"user_id": i % 7, "note": f"order {i}"}) for i in range(40)]

    def found(q: str) -> list[int]:
        response = client.get("/jobs", params={"q": q})
        assert response.status_code == 200, response.text
        return [int(i) for i in re.findall(r'href="/jobs/(\d+)"', response.text)]

    assert found(str(ids[5])) == [ids[5]]
    assert found(f"#{ids[6]}") == [ids[6]]
    with_user_3 = [j for k, j in enumerate(ids) if k % 7 == 3][::-1]
    assert found("user_id=3") == with_user_3
    assert found('{"user_id": 3}') == with_user_3
    assert found("ORDER 12") == [ids[12]]
    # A search looks at a window of jobs per page, then offers to go further back.
    monkeypatch.setattr(admin, "SEARCH_WINDOW", 10)
    page = client.get("/jobs", params={"q": "order 2"})  # orders 39 to 30: none match
    assert re.findall(r'href="/jobs/(\d+)"', page.text) == []
    assert f"down to #{ids[30]}" in page.text
    further = re.search(r'href="(/jobs\?q=order\+2&amp;before=\d+)">Search older jobs', page.text)
    assert further
    older = client.get(further.group(1).replace("&amp;", "&")).text
    assert [int(i) for i in re.findall(r'href="/jobs/(\d+)"', older)] == ids[20:30][::-1]


def test_a_job_in_full_and_unknown_ids(client: TestClient, db: sa.Engine) -> None:
    dead = insert(
        db,
        status="dead",
        attempts=3,
        max_attempts=3,
        unique_key="k1",
        last_error='Traceback (most recent call last):\n  File "x.py"\nKeyError: 7',
    )
    page = client.get(f"/jobs/{dead}").text
    for text in ("Dead after 3 attempts", "KeyError: 7", "k1", "Retry now", "Delete"):
        assert text in page
    assert "Cancel</button>" not in page
    running = insert(
        db,
        status="running",
        attempts=1,
        locked_by="host:1:abc",
        locked_until=datetime.now(timezone.utc) + timedelta(seconds=30),
    )
    page = client.get(f"/jobs/{running}").text
    assert "Running on host:1:abc" in page and "lease runs until" in page
    tagged = insert(
        db,
        status="running",
        attempts=1,
        meta={"tenant": "acme"},
        progress={"value": 0.5, "note": "half way <b>"},
    )
    page = client.get(f"/jobs/{tagged}").text
    assert "acme" in page and "half way &lt;b&gt;" in page  # meta and progress, escaped
    for url in ("/jobs/987654321", "/jobs/not-a-number", "/jobs/0"):
        response = client.get(url)
        assert response.status_code == 404, url
        assert "Traceback" not in response.text


def test_html_in_arguments_and_errors_is_shown_as_text(client: TestClient, db: sa.Engine) -> None:
    evil = "<script>alert('pwned')</script>"
    job_id = insert(
        db, status="dead", args={"name": evil, "<b>key</b>": 1}, last_error=f"Error: {evil}"
    )
    with db.begin() as conn:
        conn.execute(sa.insert(COMPANIONS.queues).values(name="<img src=x onerror=alert(1)>"))
    for url in (f"/jobs/{job_id}", "/jobs", "/jobs?status=dead", "/"):
        text = client.get(url).text
        assert "<script>alert" not in text, url
        assert "<img src=x" not in text, url
        assert "<b>key" not in text, url
    assert "&lt;script&gt;alert(" in client.get(f"/jobs/{job_id}").text
    assert "&lt;img src=x onerror=alert(1)&gt;" in client.get("/").text


# -- guards ---------------------------------------------------------------------------------


ACTIONS: list[tuple[str, Callable[[int], dict[str, Any]]]] = [
    ("/jobs/{id}/retry", lambda i: {"attempts": 5, "status": "dead"}),
    ("/jobs/{id}/cancel", lambda i: {"attempts": 5, "status": "dead"}),
    ("/jobs/{id}/purge", lambda i: {"attempts": 5, "status": "dead"}),
    ("/jobs/act", lambda i: {"action": "retry", "job": f"{i}:5:dead"}),
    ("/jobs/act-all", lambda i: {"action": "purge", "status": "dead", "up_to_id": i, "count": 1}),
    ("/queues/pause", lambda i: {"name": "a"}),
    ("/queues/resume", lambda i: {"name": "a"}),
    ("/schedules/run", lambda i: {"name": "nightly"}),
]


def _state(engine: sa.Engine) -> tuple[Any, ...]:
    with engine.connect() as conn:
        return (
            tuple(conn.execute(sa.select(TABLE).order_by(TABLE.c.id))),
            tuple(conn.execute(sa.select(COMPANIONS.queues))),
        )


def test_read_only_refuses_every_action(
    make_client: Callable[..., TestClient], db: sa.Engine, registry: Jobs
) -> None:
    job_id = insert(db, status="dead", attempts=5)
    with db.begin() as conn:
        add_schedule(conn, registry, "nightly", "t.other", "0 3 * * *")
    c = make_client()  # no options: read-only
    page = c.get(f"/jobs/{job_id}").text
    assert "read-only" in page and "Retry now" not in page
    before = _state(db)
    for url, form in ACTIONS:
        response = post(c, url.format(id=job_id), **form(job_id))
        assert response.status_code == 403, url
        assert "read-only" in response.text, url
    assert _state(db) == before


def test_an_action_without_the_csrf_token_or_from_another_site_is_refused(
    client: TestClient, db: sa.Engine
) -> None:
    job_id = insert(db, status="dead", attempts=5)
    before = _state(db)
    for url, form in ACTIONS:
        url = url.format(id=job_id)
        missing = client.post(url, data=form(job_id))
        assert missing.status_code == 403 and "CSRF" in missing.text, url
        wrong = client.post(url, data={**form(job_id), "csrf_token": "x" * 43})
        assert wrong.status_code == 403, url
        cross = client.post(
            url,
            data={**form(job_id), "csrf_token": token(client)},
            headers={"Origin": "https://evil.example"},
        )
        assert cross.status_code == 403 and "Cross-site" in cross.text, url
    assert _state(db) == before


def test_authorize_decides_who_may_act(
    make_client: Callable[..., TestClient], db: sa.Engine
) -> None:
    job_id = insert(db, status="dead", attempts=5)
    c = make_client(authorize=lambda request: request.headers.get("x-role") == "admin")
    assert "Retry now" not in c.get(f"/jobs/{job_id}").text
    assert "Retry now" in c.get(f"/jobs/{job_id}", headers={"x-role": "admin"}).text
    form = {"csrf_token": token(c), "attempts": 5, "status": "dead"}
    assert c.post(f"/jobs/{job_id}/retry", data=form).status_code == 403
    assert job(db, job_id).status == "dead"
    ok = c.post(f"/jobs/{job_id}/retry", data=form, headers={"x-role": "admin"})
    assert ok.status_code == 303
    assert job(db, job_id).status == "ready"
    with pytest.raises(ValueError, match="contradict"):
        create_app(Jobs(app.Job), db, read_only=True, authorize=lambda r: True)


# -- actions --------------------------------------------------------------------------------


def test_retry_cancel_and_delete_one_job_as_it_was_seen(client: TestClient, db: sa.Engine) -> None:
    dead = insert(db, status="dead", attempts=5, max_attempts=5)
    done = client.post(
        f"/jobs/{dead}/retry", data={"csrf_token": token(client), "attempts": 5, "status": "dead"}
    )
    assert done.status_code == 303
    assert done.headers["location"].startswith(f"/jobs/{dead}?done=retry&sig=")
    row = job(db, dead)
    assert (row.status, row.attempts, row.max_attempts) == ("ready", 5, 6)
    assert "Retried: the job is ready again" in client.get(done.headers["location"]).text
    # The same form again: the job moved on (it is ready now), so nothing is done.
    again = post(client, f"/jobs/{dead}/retry", attempts=5, status="dead")
    assert "skipped=it+changed" in again.headers["location"]
    assert "Nothing was done: it changed: now ready" in client.get(again.headers["location"]).text

    ready = insert(db, status="ready")
    assert post(client, f"/jobs/{ready}/cancel", attempts=0, status="ready").status_code == 303
    assert job(db, ready).status == "cancelled"
    gone = post(client, f"/jobs/{ready}/purge", attempts=0, status="cancelled")
    assert gone.status_code == 303 and gone.headers["location"] == f"/jobs?deleted={ready}"
    assert job(db, ready) is None
    # A running job is never deleted by the page, even when asked.
    running = insert(db, status="running", attempts=1, locked_until=datetime.now(timezone.utc))
    refused = post(client, f"/jobs/{running}/purge", attempts=1, status="running")
    assert "purge+applies+to" in refused.headers["location"]
    assert job(db, running).status == "running"


def test_a_selection_is_acted_on_job_by_job_and_changed_jobs_are_left_alone(
    client: TestClient, db: sa.Engine
) -> None:
    a, b, c = (insert(db, status="dead", attempts=2) for _ in range(3))
    ready = insert(db, status="ready")
    # Between the page and the click, another operator retried b and a worker took it.
    with db.begin() as conn:
        conn.execute(sa.update(TABLE).where(TABLE.c.id == b).values(status="running", attempts=3))
    response = client.post(
        "/jobs/act",
        data={
            "csrf_token": token(client),
            "action": "retry",
            "job": [
                f"{a}:2:dead",
                f"{b}:2:dead",
                f"{c}:2:dead",
                f"{ready}:0:ready",
                "99999:1:dead",
            ],
        },
    )
    assert response.status_code == 200
    text = response.text
    assert "Retried 2 jobs" in text
    assert f"#{b}</a></td><td>it changed: now running, attempt 3" in text
    assert "retry applies to dead, cancelled jobs, not ready ones" in text
    assert "it no longer exists" in text
    assert [job(db, i).status for i in (a, b, c, ready)] == ["ready", "running", "ready", "ready"]


def test_everything_matching_a_filter_with_a_count_and_a_confirmation(
    client: TestClient, db: sa.Engine
) -> None:
    dead = [insert(db, queue="a", status="dead", attempts=1) for _ in range(5)]
    insert(db, queue="b", status="dead")
    page = client.get("/jobs?queue=a&status=dead").text
    assert 'href="/jobs/confirm?action=retry&amp;queue=a&amp;status=dead"' in page
    confirm = client.get("/jobs/confirm?action=retry&queue=a&status=dead")
    assert confirm.status_code == 200
    assert "Retry 5 jobs?" in confirm.text
    hidden = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', confirm.text))
    assert hidden["up_to_id"] == str(max(dead) + 1)  # the b job was the newest
    # A job that dies after the count is not part of what was confirmed.
    late = insert(db, queue="a", status="dead")
    done = client.post("/jobs/act-all", data=hidden)
    assert done.status_code == 200
    assert "Retried 5 jobs." in done.text
    assert [job(db, i).status for i in dead] == ["ready"] * 5
    assert job(db, late).status == "dead"
    # Deleting needs a status that purge applies to; the confirm page says what it refuses.
    refused = client.get("/jobs/confirm?action=purge&status=running")
    assert refused.status_code == 400 and "refusing to purge running jobs" in refused.text


def test_pause_and_resume_a_queue(client: TestClient, db: sa.Engine, registry: Jobs) -> None:
    paused = post(client, "/queues/pause", name="a")
    assert paused.status_code == 303
    assert "Paused queue a" in client.get(paused.headers["location"]).text
    with db.connect() as conn:
        assert admin.paused_queues(conn, registry) == {"a"}
    assert ">Resume</button>" in client.get("/").text
    assert post(client, "/queues/resume", name="a").status_code == 303
    with db.connect() as conn:
        assert admin.paused_queues(conn, registry) == set()
    assert post(client, "/queues/pause", name="").status_code == 400
    assert post(client, "/queues/explode", name="a").status_code == 404


def test_run_a_schedule_now(client: TestClient, db: sa.Engine, registry: Jobs) -> None:
    with db.begin() as conn:
        add_schedule(conn, registry, "nightly", "t.work", "0 3 * * *", args={"n": 7})
    response = post(client, "/schedules/run", name="nightly")
    assert response.status_code == 303
    job_id = int(re.search(r"ran=(\d+)", response.headers["location"]).group(1))  # type: ignore[union-attr]
    row = job(db, job_id)
    assert (row.task, row.queue, row.args, row.status) == ("t.work", "a", {"n": 7}, "ready")
    assert f"Enqueued job #{job_id}" in client.get(response.headers["location"]).text
    missing = post(client, "/schedules/run", name="nope")
    assert missing.status_code == 404 and "no schedule named" in missing.text


def test_the_workers_page_shows_live_workers_and_their_running_jobs(
    client: TestClient, db: sa.Engine, registry: Jobs, Session: Any
) -> None:
    import threading

    from sqla_jobs import Worker

    release = threading.Event()

    @registry.task(queue="w", name="t.hold")
    def hold() -> None:
        release.wait(20)

    worker = Worker(registry, db, queues=["w"], concurrency=2, presence_interval=0.05)
    try:
        with running(worker):
            with Session.begin() as session:
                session.enqueue(hold)
            wait_for(lambda: "1 / 2" in client.get("/workers").text)
            page = client.get("/workers").text
            assert worker.name in page and '<span class="badge alive">alive</span>' in page
            assert "t.hold" in page
            release.set()
    finally:
        release.set()
    assert worker.name not in client.get("/workers").text


# -- failures and mounting ------------------------------------------------------------------


def test_a_database_that_is_down_gives_a_clear_page(registry: Jobs) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/x")
    c = TestClient(create_app(registry, down), base_url=BASE)
    for url in ("/", "/jobs", "/jobs/1", "/workers", "/schedules"):
        response = c.get(url)
        assert response.status_code == 503, url
        assert "The database cannot be reached" in response.text
        assert "Traceback" not in response.text


def test_mounted_under_a_path_of_a_starlette_app(db: sa.Engine, registry: Jobs) -> None:
    host = Starlette(routes=[Mount("/admin/queue", create_app(registry, db, read_only=False))])
    c = TestClient(host, base_url=BASE, follow_redirects=False)
    job_id = insert(db, status="dead", attempts=1)
    page = c.get("/admin/queue/jobs")
    assert page.status_code == 200
    assert f'href="/admin/queue/jobs/{job_id}"' in page.text
    assert 'src="/admin/queue/static/htmx.min.js"' in page.text
    assert "Path=/admin/queue/" in page.headers["set-cookie"]
    response = c.post(
        f"/admin/queue/jobs/{job_id}/retry",
        data={"csrf_token": c.cookies["sqla_jobs_csrf"], "attempts": 1, "status": "dead"},
    )
    assert response.status_code == 303
    assert response.headers["location"].startswith(f"/admin/queue/jobs/{job_id}?done=retry&")
    assert c.get("/admin/queue/static/htmx.min.js").status_code == 200


def test_mounted_in_flask_through_a2wsgi(db: sa.Engine, registry: Jobs) -> None:
    flask = pytest.importorskip("flask")
    a2wsgi = pytest.importorskip("a2wsgi")
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    web = flask.Flask("shop")
    web.wsgi_app = DispatcherMiddleware(  # type: ignore[method-assign]
        web.wsgi_app, {"/queue": a2wsgi.ASGIMiddleware(create_app(registry, db))}
    )
    job_id = insert(db, status="dead", attempts=1)
    response = web.test_client().get("/queue/jobs")
    assert response.status_code == 200
    assert f'href="/queue/jobs/{job_id}"'.encode() in response.data


def test_sqla_jobs_web_serves_the_dashboard_on_127_0_0_1(db: sa.Engine) -> None:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "web", "tests.app:jobs", "--port", str(port)],
        env={**os.environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/jobs", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(proc.stderr.read() if proc.stderr else "") from None
                time.sleep(0.1)
        assert response.status_code == 200
        assert "read-only" in response.text
        # Its default hosts: the address it listens on, and the loopback names.
        for host, status in (("localhost", 200), ("attacker.example", 400)):
            answer = httpx.get(f"http://127.0.0.1:{port}/jobs", headers={"host": host}, timeout=5)
            assert answer.status_code == status, host
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # waits, and closes the pipes (no ResourceWarning)


# -- hostile input ----------------------------------------------------------------------------


def test_a_hostile_search_is_parsed_in_linear_time(client: TestClient, db: sa.Engine) -> None:
    """``a=a=a=...a= ;`` made the old pattern backtrack exponentially (78 characters: 11 s
    of CPU, holding the GIL of the application the dashboard is mounted in)."""
    size = admin.SEARCH_MAX_CHARS
    hostile = [
        ("a=" * size)[: size - 2] + " ;",
        ("a=1 " * size)[: size - 1] + ";",
        ("a=" + "=" * size)[:size],
        ("a" * (size - 1)) + "=",
        (" a=b," * size)[:size],
        "{" * size,
        '{"a":' * (size // 5),
    ]
    for text in hostile:
        assert len(text) <= size
        started = time.perf_counter()
        with contextlib.suppress(ValueError):
            admin.parse_search(text)
        took = time.perf_counter() - started
        # Linear: milliseconds (a second leaves room for a loaded machine); the old
        # pattern took 11 s at 78 characters and days at 100.
        assert took < 1.0, (text[:20], took)
    # Through the page: answered (a text search, or a 400 naming the problem), never a 500.
    for text in hostile:
        assert client.get("/jobs", params={"q": text}).status_code in (200, 400)
    too_long = client.get("/jobs", params={"q": "x" * (size + 1)})
    assert too_long.status_code == 400 and "at most 10,000" in too_long.text


@pytest.mark.parametrize(
    ("q", "message"),
    [
        ('{"n": NaN}', "nan is not a number"),
        ('{"n": Infinity}', "inf is not a number"),
        ('{"n": -Infinity}', "-inf is not a number"),
        ('{"n": 1e999}', "inf is not a number"),
        ("n=NaN", "nan is not a number"),
        ("n=1e999", "inf is not a number"),
        ('{"note": "a\\u0000b"}', "NUL"),
        ('{"note\\u0000": 1}', "NUL"),
        ('{"note": "\\ud800"}', "U+D800"),
        ('note="\\udfff"', "U+DFFF"),
        ('{"n": ' + "[" * 40 + "1" + "]" * 40 + "}", "nested more than 32"),
        ('{"n": ' + "[" * 3000 + "1" + "]" * 3000 + "}", "nested more than 32"),
        ("n=" + "[" * 3000, "nested more than 32"),
        ("#99999999999999999999", "not a job id"),
    ],
)
def test_searches_postgresql_cannot_take_are_a_400_naming_the_problem(
    client: TestClient, db: sa.Engine, q: str, message: str
) -> None:
    insert(db, args={"n": 1, "note": "x"})
    response = client.get("/jobs", params={"q": q})
    assert response.status_code == 400, response.text[-500:]
    assert message in response.text
    assert "Traceback" not in response.text


def test_numbers_and_selections_from_the_client_are_checked(
    client: TestClient, db: sa.Engine
) -> None:
    dead = insert(db, status="dead", attempts=1)
    before = _state(db)
    for selection in (
        f"¹:{1}:dead",  # str.isdigit() says yes, int() says no
        f"{dead}:¹:dead",
        f"\u0661{dead}:1:dead",  # an Arabic-Indic digit, which int() reads
        "99999999999999999999:1:dead",  # past a bigint
        f"{dead}:99999999999:dead",  # past the int of attempts
        f"{dead}:1:sleeping",
        f"{dead}: 1:dead",
        f"{dead}:1_0:dead",
        "",
    ):
        response = post(client, "/jobs/act", action="retry", job=selection)
        assert response.status_code == 400, selection
        assert "not a job selection" in response.text, selection
    for url in (f"/jobs/{dead}/retry", f"/jobs/{dead}/cancel"):
        for attempts in ("¹", "99999999999", "1" * 30, "-1", " 1"):
            response = post(client, url, attempts=attempts, status="dead")
            assert response.status_code == 400, (url, attempts)
    for page in ("/jobs?before=¹", "/jobs?before=99999999999999999999", "/jobs?before=1_0"):
        assert client.get(page).status_code == 400, page
    for page in ("/jobs/\u0661", "/jobs/99999999999999999999", f"/jobs/%20{dead}"):
        assert client.get(page).status_code == 404, page
    assert _state(db) == before


def test_dns_rebinding_is_refused_by_the_host_check(
    make_client: Callable[..., TestClient], db: sa.Engine, registry: Jobs
) -> None:
    """A page on attacker.example that rebinds its name to 127.0.0.1 is same-origin with
    the dashboard as far as the browser knows: it sends ``Host: attacker.example`` (and a
    matching ``Origin``). The host check refuses it before any page or token is read."""
    job_id = insert(db, status="dead", attempts=5, args={"secret": "s3cr3t"})
    c = make_client(read_only=False)
    for host in ("localhost", "LOCALHOST:8080", "127.0.0.1", "127.0.0.1:8080", "[::1]:8080"):
        page = c.get(f"/jobs/{job_id}", headers={"host": host})
        assert page.status_code == 200, host
    rebinding = {"host": "attacker.example:8080", "origin": "http://attacker.example:8080"}
    for host in ("attacker.example", "attacker.example:8080", "localhost.attacker.example", ""):
        page = c.get(f"/jobs/{job_id}", headers={**rebinding, "host": host})
        assert page.status_code == 400, host
        assert "s3cr3t" not in page.text and "csrf" not in page.text.lower()
        assert "set-cookie" not in page.headers
    before = _state(db)
    acted = c.post(
        f"/jobs/{job_id}/retry",
        data={"csrf_token": token(c), "attempts": 5, "status": "dead"},
        headers=rebinding,
    )
    assert acted.status_code == 400
    assert _state(db) == before
    # Its own names, given; a wildcard for subdomains; any, when asked for.
    named = make_client(allowed_hosts=["Jobs.Example.com", "*.ops.example.com", "::1"])
    for host, status in [
        ("jobs.example.com", 200),
        ("jobs.example.com:443", 200),
        ("eu.ops.example.com", 200),
        ("[::1]", 200),
        ("ops.example.com", 400),
        ("localhost", 400),
        ("jobs.example.com.attacker.example", 400),
        ("jobs.example.com:x", 400),
    ]:
        assert named.get("/", headers={"host": host}).status_code == status, host
    assert make_client(allowed_hosts=["*"]).get("/", headers={"host": "any"}).status_code == 200
    # Over shards: the page of every shard and each shard's own dashboard.
    sharded = TestClient(create_app(registry, engines={"eu": db}), base_url=BASE)
    for url in ("/", "/shards/eu/jobs"):
        assert sharded.get(url).status_code == 200, url
        assert sharded.get(url, headers={"host": "attacker.example"}).status_code == 400, url
    for bad in (["http://jobs.example.com"], ["jobs.example.com:8080"], [], "localhost", ["a*"]):
        with pytest.raises(ValueError, match="allowed_hosts"):
            create_app(registry, db, allowed_hosts=bad)


def test_the_csrf_token_is_signed_and_origin_null_is_refused(
    make_client: Callable[..., TestClient], db: sa.Engine
) -> None:
    job_id = insert(db, status="dead", attempts=5)
    form = {"attempts": 5, "status": "dead"}
    c = make_client(read_only=False)
    before = _state(db)
    # A cookie planted by a sibling subdomain: well formed, equal in cookie and form,
    # not signed by this dashboard.
    elsewhere = make_client(read_only=False)  # another dashboard: another secret
    elsewhere.get("/")
    for planted in ("x" * 43, "A" * 32 + "." + "B" * 32, token(elsewhere)):
        c.cookies.clear()
        c.cookies.set("sqla_jobs_csrf", planted)
        refused = c.post(f"/jobs/{job_id}/retry", data={"csrf_token": planted, **form})
        assert refused.status_code == 403 and "CSRF" in refused.text, planted
    # A page gives a new, signed token in place of a planted one.
    c.cookies.clear()
    c.cookies.set("sqla_jobs_csrf", planted)
    good = c.get("/").cookies["sqla_jobs_csrf"]
    assert good != planted
    c.cookies.clear()
    c.cookies.set("sqla_jobs_csrf", good)
    null = c.post(
        f"/jobs/{job_id}/retry", data={"csrf_token": good, **form}, headers={"origin": "null"}
    )
    assert null.status_code == 403 and "Cross-site" in null.text
    assert _state(db) == before
    assert c.post(f"/jobs/{job_id}/retry", data={"csrf_token": good, **form}).status_code == 303
    # Two processes serving one dashboard share a secret, and each other's tokens.
    one = make_client(read_only=False, secret="k" * 32)
    other = make_client(read_only=False, secret="k" * 32)
    one.get("/")
    other.cookies.set("sqla_jobs_csrf", token(one))
    shared = other.post(
        f"/jobs/{job_id}/cancel",
        data={"csrf_token": token(one), "attempts": 6, "status": "ready"},
    )
    assert shared.status_code == 303
    with pytest.raises(ValueError, match="16 bytes"):
        make_client(secret="short")


def test_notices_come_from_the_action_not_from_the_url(client: TestClient, db: sa.Engine) -> None:
    dead = insert(db, status="dead", attempts=1)
    forged = {
        "/?done=pause&name=billing: call +1-555-0100 to restore it": "call +1-555",
        "/?done=pause&name=x&sig=AAAA": "Paused queue",
        f"/jobs/{dead}?skipped=your account is locked, call +1-555-0100": "call +1-555",
        f"/jobs/{dead}?done=retry": "Retried",
        "/schedules?ran=1&name=phish": "phish",
    }
    for url, text in forged.items():
        page = client.get(url)
        assert page.status_code == 200, url
        assert text not in page.text, url
    paused = post(client, "/queues/pause", name="a")
    assert "Paused queue a" in client.get(paused.headers["location"]).text
    # The signature covers the text: changing the name in a real notice's URL hides it.
    location = paused.headers["location"].replace("name=a", "name=b")
    assert "Paused queue" not in client.get(location).text


def test_a_long_result_and_error_are_cut_on_the_page_and_downloaded_whole(
    client: TestClient, db: sa.Engine
) -> None:
    from sqla_jobs.web.app import ARGS_SHOWN

    size = 3 * ARGS_SHOWN
    job_id = insert(
        db,
        status="dead",
        args={"blob": "a" * size},
        result={"big": "r" * size},
        last_error="Traceback\n" + "e" * size + "\nValueError: the end",
    )
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200
    assert len(page.text) < 4 * ARGS_SHOWN  # each of the three values is cut
    assert "ValueError: the end" in page.text  # an error keeps its end
    for field in ("args", "result", "last_error"):
        assert f'href="/jobs/{job_id}/value/{field}"' in page.text, field
    args = client.get(f"/jobs/{job_id}/value/args")
    assert args.status_code == 200
    assert args.headers["content-type"] == "application/json"
    assert "attachment" in args.headers["content-disposition"]
    assert json.loads(args.text) == {"blob": "a" * size}
    assert json.loads(client.get(f"/jobs/{job_id}/value/result").text) == {"big": "r" * size}
    error = client.get(f"/jobs/{job_id}/value/last_error")
    assert error.text == "Traceback\n" + "e" * size + "\nValueError: the end"
    assert error.headers["content-type"].startswith("text/plain")
    assert client.get(f"/jobs/{job_id}/value/password").status_code == 404
    assert client.get("/jobs/987654/value/args").status_code == 404


def test_sqla_jobs_web_refuses_a_bad_allowed_host_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sqla_jobs.cli", "web", "tests.app:jobs", "--allowed-host", "x/"],
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "sqla-jobs: error: allowed_hosts: 'x/' is not a host name, an "
        "address, '*.domain' or '*' (give no scheme, port or path)"
    ]


# -- guards found by an audit of operator actions --------------------------------------------


def _hidden(page: str) -> dict[str, str]:
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', page))


def test_a_bulk_action_that_acted_on_more_than_confirmed_says_so(
    client: TestClient, db: sa.Engine
) -> None:
    """A job below the page's highest id that came to match after the count (a running
    job that died) is retried with the others: the notice said the others "changed
    meanwhile and were left alone", the opposite of what happened."""
    was_running = insert(db, status="running", attempts=1, locked_by="w")
    dead = [insert(db, status="dead", attempts=1) for _ in range(2)]
    page = client.get("/jobs/confirm?action=retry&queue=a&status=dead")
    assert "Retry 2 jobs?" in page.text
    with db.begin() as conn:  # its worker fails it for good meanwhile
        conn.execute(
            sa.update(TABLE)
            .where(TABLE.c.id == was_running)
            .values(status="dead", finished_at=sa.func.now(), locked_by=None)
        )
    done = client.post("/jobs/act-all", data=_hidden(page.text))
    assert done.status_code == 200
    assert [job(db, i).status for i in dead] == ["ready", "ready"]
    assert "Retried 3 jobs. You confirmed 2; more matched by then" in done.text
    assert "left alone" not in done.text


def test_act_all_refuses_the_filters_a_bulk_action_cannot_take(
    client: TestClient, db: sa.Engine
) -> None:
    """Its confirm page refuses a worker, a search or "suspended"; act-all dropped them,
    so a form naming worker w1 cancelled the running jobs of every worker."""
    insert(db, status="running", attempts=1, locked_by="w1")
    other = insert(db, status="running", attempts=1, locked_by="w2")
    assert client.get("/jobs/confirm?action=cancel&status=running&worker=w1").status_code == 400
    form = {"action": "cancel", "status": "running", "up_to_id": other, "count": 1}
    for extra in ({"worker": "w1"}, {"q": "work"}, {"suspended": "1"}):
        response = post(client, "/jobs/act-all", **form, **extra)
        assert response.status_code == 400 and "Not a bulk filter" in response.text
    assert job(db, other).status == "running"


def test_an_authorize_that_raises_leaves_every_page_readable(
    make_client: Callable[..., TestClient], db: sa.Engine
) -> None:
    """Every page asks ``authorize`` whether to draw its buttons: one that raises (a
    visitor its session middleware does not know) turned every page, the 404 page
    included, into a bare "Internal Server Error". It now means "may not act"."""

    def authorize(request: Any) -> bool:
        return bool(request.session["user"])  # no SessionMiddleware: it raises

    c = make_client(authorize=authorize)
    job_id = insert(db, status="dead", attempts=1)
    for url, code in (("/", 200), ("/jobs", 200), (f"/jobs/{job_id}", 200), ("/nowhere", 404)):
        response = c.get(url)
        assert response.status_code == code, (url, response.text[:200])
        assert "read-only" in response.text, url
    refused = post(c, f"/jobs/{job_id}/retry")
    assert refused.status_code == 403 and job(db, job_id).status == "dead"


def test_running_a_schedule_named_with_a_nul_is_a_404(client: TestClient) -> None:
    response = post(client, "/schedules/run", name="a\x00b")
    assert response.status_code == 404 and "No such schedule" in response.text


def test_the_job_list_offers_only_the_bulk_actions_its_status_can_take(
    client: TestClient, db: sa.Engine
) -> None:
    insert(db, status="running", attempts=1, locked_by="w1")
    for status, offered in (
        ("running", ["cancel"]),
        ("dead", ["retry", "purge"]),
        ("ready", ["cancel", "purge"]),
        ("", ["retry", "cancel", "purge"]),
    ):
        page = client.get(f"/jobs?status={status}").text
        links = re.findall(r'href="(/jobs/confirm\?[^"]*)"', page)
        assert [re.search(r"action=(\w+)", link)[1] for link in links] == offered, status  # type: ignore[index]
        for link in links:
            assert client.get(link.replace("&amp;", "&")).status_code == 200, link


def test_a_page_gives_a_503_while_the_jobs_table_is_locked(
    make_client: Callable[..., TestClient], db: sa.Engine
) -> None:
    """A migration holds the jobs table (ACCESS EXCLUSIVE): a page waited without end,
    holding a thread of the pool its host application's routes share. It now waits at
    most the dashboard's lock timeout and says why."""
    import threading

    from sqla_jobs.web import app as web_app

    c = make_client()
    answers: list[Any] = []
    with db.connect() as locker, locker.begin():
        locker.execute(sa.text(f"LOCK TABLE {TABLE.fullname} IN ACCESS EXCLUSIVE MODE"))
        started = time.monotonic()
        thread = threading.Thread(target=lambda: answers.append(c.get("/jobs")), daemon=True)
        thread.start()
        thread.join(20)
        took = time.monotonic() - started
    assert answers, "no answer while the table was locked"
    (response,) = answers
    assert response.status_code == 503 and "Database busy" in response.text
    assert took < int(web_app.LOCK_TIMEOUT.rstrip("s")) + 5
    assert c.get("/jobs").status_code == 200  # and nothing stayed on the pooled connection

"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against the
app served by uvicorn on a free port of 127.0.0.1 and a real PostgreSQL.

Skipped, with the reason, where no browser can be started; ``.ci/run`` installs Chromium
and sets ``SQLA_JOBS_REQUIRE_BROWSER=1``, which turns that skip into a failure. Each step
saves a screenshot under ``tests/artifacts/`` (ignored by git)."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs
from sqla_jobs.model import companion_tables, job_table
from sqla_jobs.periodic import add_schedule

from . import app

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = os.environ.get("SQLA_JOBS_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TABLE = job_table(app.Job)


def _no_browser(reason: str) -> None:
    if os.environ.get("SQLA_JOBS_REQUIRE_BROWSER") == "1":
        pytest.fail(f"no browser, and SQLA_JOBS_REQUIRE_BROWSER=1: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _no_browser("playwright is not installed (pip install -e '.[dev]')")
    if not Path(CHROMIUM).exists():
        _no_browser(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as p:
        try:
            chromium = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        except Exception as exc:
            _no_browser(f"Chromium at {CHROMIUM} did not start: {exc}")
        yield chromium
        chromium.close()


@pytest.fixture
def served(db: sa.Engine, jobs: Jobs) -> Iterator[tuple[str, Jobs]]:
    """The dashboard with actions on, served by uvicorn in a thread; its base URL."""
    import uvicorn

    from sqla_jobs.web import create_app

    @jobs.task(queue="emails", name="shop.send_receipt")
    def send_receipt(order_id: int) -> None: ...

    @jobs.task(queue="webhooks", name="shop.call_webhook")
    def call_webhook(url: str) -> None: ...

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dashboard = create_app(jobs, db, read_only=False, refresh=1.0, title="Shop jobs")
    server = uvicorn.Server(
        uvicorn.Config(dashboard, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", jobs
    finally:
        server.should_exit = True
        thread.join(10)


def fill(db: sa.Engine) -> int:
    """A shop's queue: ready, scheduled and running jobs, a dead one with a traceback, and
    an hour of outcomes; returns the dead job's id."""
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    defaults = {
        "attempts": 0,
        "max_attempts": 5,
        "run_at": now,
        "locked_by": None,
        "locked_until": None,
        "finished_at": None,
        "last_error": None,
    }
    for i in range(30):
        rows.append(
            {
                "task": "shop.send_receipt",
                "queue": "emails",
                "args": {"order_id": 1000 + i},
                "status": "ready",
                "run_at": now - timedelta(seconds=40 - i),
            }
        )
    for i in range(12):
        rows.append(
            {
                "task": "shop.call_webhook",
                "queue": "webhooks",
                "args": {"url": f"https://hooks.example/{i}"},
                "status": "scheduled",
                "attempts": 1,
                "run_at": now + timedelta(minutes=5 + i),
            }
        )
    for i in range(3):
        rows.append(
            {
                "task": "shop.send_receipt",
                "queue": "emails",
                "args": {"order_id": 900 + i},
                "status": "running",
                "attempts": 1,
                "locked_by": "web-1:4242:a1b2c3",
                "locked_until": now + timedelta(seconds=30),
            }
        )
    for i in range(4):
        rows.append(
            {
                "task": "shop.call_webhook",
                "queue": "webhooks",
                "args": {"url": f"https://old.example/{i}"},
                "status": "dead",
                "attempts": 5,
                "max_attempts": 5,
                "finished_at": now,
                "last_error": "RuntimeError: HTTP 410",
            }
        )
    throughput = companion_tables(TABLE).throughput
    minute = now.replace(second=0, microsecond=0)
    counts = [
        {
            "minute": minute - timedelta(minutes=m),
            "queue": q,
            "succeeded": s,
            "failed": f,
            "dead": 0,
        }
        # The last hour, and the next minute too: the page may be read in the minute after
        # this one (the chart's hour then starts a minute later), and still has 60 bars.
        for m in range(-1, 60)
        for q, s, f in (
            ("emails", 120 + (m * 37) % 90, (m * 7) % 5),
            ("webhooks", 40 + (m * 13) % 30, 1 if m % 9 == 0 else 0),
        )
    ]
    rows = [defaults | r for r in rows]
    with db.begin() as conn:
        conn.execute(sa.insert(TABLE), rows)
        conn.execute(sa.insert(throughput), counts)
        return int(
            conn.execute(
                sa.insert(TABLE)
                .values(
                    task="shop.call_webhook",
                    queue="webhooks",
                    args={
                        "url": "https://partner.example/orders",
                        "order_id": 1042,
                        "note": "<script>alert(1)</script>",
                    },
                    status="dead",
                    attempts=5,
                    max_attempts=5,
                    finished_at=now,
                    last_error=(
                        "Traceback (most recent call last):\n"
                        '  File "shop/tasks.py", line 88, in call_webhook\n'
                        "    response.raise_for_status()\n"
                        "httpx.HTTPStatusError: Server error '503 Service Unavailable' for url "
                        "'https://partner.example/orders'"
                    ),
                )
                .returning(TABLE.c.id)
            ).scalar_one()
        )


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_an_operator_finds_a_dead_job_retries_it_and_pauses_a_queue(
    browser: Any, served: tuple[str, Jobs], db: sa.Engine
) -> None:
    base, jobs = served
    dead = fill(db)
    with db.begin() as conn:
        add_schedule(
            conn, jobs, "nightly-digest", "shop.send_receipt", "0 3 * * *", args={"order_id": 0}
        )
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.on("dialog", lambda dialog: dialog.accept())

    # The overview: counts per status, queues, the chart.
    page.goto(base + "/")
    cards = page.locator(".card")
    assert cards.nth(0).locator(".value").inner_text() == "30"  # ready
    assert cards.nth(1).locator(".value").inner_text() == "12"  # scheduled
    assert cards.nth(2).locator(".value").inner_text() == "3"  # running
    assert cards.nth(3).locator(".value").inner_text() == "5"  # dead
    assert page.locator("svg.chart rect.ok").count() == 60
    shot(page, "overview")

    # Live: a job enqueued now shows up without a reload.
    with db.begin() as conn:
        conn.execute(
            sa.insert(TABLE).values(task="shop.send_receipt", queue="emails", args={"order_id": 1})
        )
    from playwright.sync_api import expect

    expect(page.locator(".card .value").first).to_have_text("31", timeout=10_000)

    # The job list, filtered to dead jobs.
    page.click("header nav >> text=Jobs")
    page.select_option("select[name=status]", "dead")
    page.fill("input[name=queue]", "webhooks")
    page.click("button:has-text('Filter')")
    page.wait_for_url(re.compile(r".*status=dead.*"))
    statuses = page.locator("tbody td .badge").all_inner_texts()
    assert statuses == ["dead"] * 5
    assert page.locator(f"a[href='/jobs/{dead}']").count() == 1
    shot(page, "jobs")

    # The dead job in full, its traceback shown as text, then retried.
    page.click(f"a[href='/jobs/{dead}']")
    assert "HTTPStatusError: Server error '503" in page.locator("pre.error").inner_text()
    assert "<script>alert(1)</script>" in page.locator("pre.block").first.inner_text()
    assert page.locator("h1 .badge").inner_text() == "dead"
    shot(page, "job")
    page.click("button:has-text('Retry now')")
    page.wait_for_url(re.compile(rf".*/jobs/{dead}\?done=retry"))
    assert "Retried: the job is ready again" in page.locator(".notice").inner_text()
    assert page.locator("h1 .badge").inner_text() == "ready"
    shot(page, "job-retried")

    # Pause a queue from the overview, then resume it.
    page.goto(base + "/")
    row = page.locator("tr", has=page.locator("a:has-text('webhooks')"))
    row.locator("button:has-text('Pause')").click()
    page.wait_for_url(re.compile(r".*done=pause.*"))
    assert "Paused queue webhooks" in page.locator(".notice").inner_text()
    row = page.locator("tr", has=page.locator("a:has-text('webhooks')"))
    assert row.locator(".badge").first.inner_text() == "paused"
    shot(page, "overview-paused")
    row.locator("button:has-text('Resume')").click()
    page.wait_for_url(re.compile(r".*done=resume.*"))
    row = page.locator("tr", has=page.locator("a:has-text('webhooks')"))
    assert row.locator(".badge").first.inner_text() == "active"

    # The other pages.
    # (A click does not wait for the page it opens: the URL is waited for, so that no
    # assertion reads the page it left. Without it this failed once in CI.)
    page.click("header nav >> text=Schedules")
    page.wait_for_url(re.compile(r".*/schedules$"))
    expect(page.locator("td:has-text('nightly-digest')")).to_have_count(1)
    shot(page, "schedules")
    page.click("header nav >> text=Workers")
    page.wait_for_url(re.compile(r".*/workers$"))
    expect(page.locator("main")).to_contain_text("shop.send_receipt")
    shot(page, "workers")
    page.close()


def test_an_operator_sees_a_blocked_key_and_retries_its_head(
    browser: Any, served: tuple[str, Jobs], db: sa.Engine
) -> None:
    """A queue in key order: a dead head holds its account's payments; the overview lists
    the key, its head opens from there, and retrying it takes the key off the list."""
    base, jobs = served
    jobs.queue("payments", key_order="fifo")
    now = datetime.now(timezone.utc)
    with db.begin() as conn:
        head = conn.execute(
            sa.insert(TABLE)
            .values(
                task="shop.send_receipt",
                queue="payments",
                args={"order_id": 7},
                status="dead",
                attempts=5,
                max_attempts=5,
                finished_at=now - timedelta(minutes=4),
                last_error="RuntimeError: card declined",
                concurrency_key="acct-1042",
            )
            .returning(TABLE.c.id)
        ).scalar_one()
        conn.execute(
            sa.insert(TABLE),
            [
                {
                    "task": "shop.send_receipt",
                    "queue": "payments",
                    "args": {"order_id": 8 + i},
                    "status": "ready",
                    "concurrency_key": "acct-1042",
                }
                for i in range(3)
            ],
        )
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(base + "/")
    panel = page.locator("section.panel", has=page.locator("h2:has-text('Blocked keys')"))
    row = panel.locator("tbody tr")
    assert row.count() == 1
    assert row.locator("code").inner_text() == "acct-1042"
    assert row.locator(".badge").inner_text() == "dead"
    assert row.locator("td.num").inner_text() == "3"
    shot(page, "overview-blocked-key")
    row.locator(f"a[href='/jobs/{head}']").click()
    page.wait_for_url(re.compile(rf".*/jobs/{head}$"))
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("button:has-text('Retry now')")
    page.wait_for_url(re.compile(rf".*/jobs/{head}\?done=retry"))
    page.goto(base + "/")
    assert page.locator("h2:has-text('Blocked keys')").count() == 0
    page.close()


def test_an_operator_sees_a_durable_job_s_steps_and_what_it_waits_for(
    browser: Any, served: tuple[str, Jobs], db: sa.Engine
) -> None:
    """An order suspended in a wait for its shipping webhook: the job list's "suspended"
    filter finds it, and its page shows each step and what it waits for."""
    from sqla_jobs import Steps, Worker

    base, jobs = served

    @jobs.task(queue="orders", name="shop.fulfil", durable=True)
    def fulfil(steps: Steps, order_id: int) -> None:
        steps.run("charge", lambda: {"charge": "ch_1042", "amount": 4200})
        steps.run("reserve stock", lambda: ["sku-1", "sku-2"])
        steps.wait("shipped", timeout=timedelta(days=14))

    with db.begin() as conn:
        job_id = jobs.enqueue(conn, fulfil, order_id=1042)
        jobs.enqueue(conn, jobs.get("shop.send_receipt"), order_id=1)  # not suspended
    Worker(jobs, db, queues=["orders"], listen=False).run_until_empty(timeout=20)

    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(base + "/jobs")
    page.check("input[name=suspended]")
    page.click("button:has-text('Filter')")
    page.wait_for_url(re.compile(r".*suspended=1.*"))
    listed = page.locator("tbody tr")
    assert listed.count() == 1
    assert "shop.fulfil" in listed.inner_text()
    shot(page, "jobs-suspended")
    page.goto(base + f"/jobs/{job_id}")
    assert "Waits for the signal 'shipped'" in page.locator(".next").inner_text()
    steps = page.locator("table.steps tbody tr")
    assert steps.count() == 3
    assert steps.nth(0).locator("td").nth(0).inner_text() == "charge"
    assert steps.nth(2).locator(".badge").inner_text() == "waiting"
    fields = page.locator("dl.fields").inner_text()
    assert "2 of 3 done" in fields and "signal 'shipped' (times out" in fields
    shot(page, "job-steps")
    page.close()

"""``sqla-jobs worker`` as a real process: signals, crashes, and its errors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import JobSession

from . import app, cli_fork
from .helpers import count, rows, wait_for

ROOT = Path(__file__).resolve().parent.parent


def start_worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", "tests.app:jobs", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Its own process group: tests.helpers.reaped kills a supervisor with its children.
        start_new_session=True,
    )


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return cli_fork.run(
        args, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT, timeout=60
    )


def enqueue_slow(engine: sa.Engine, n: int, seconds: float) -> None:
    with JobSession(engine) as session:
        session.enqueue_many(app.slow_record, [{"seconds": seconds} for _ in range(n)])
        session.commit()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_gracefully(db: sa.Engine, database_url: str, sig: int) -> None:
    enqueue_slow(db, 5, 1.0)
    proc = start_worker("--queues", "records", "--concurrency", "2", "--grace-period", "20")
    try:
        wait_for(lambda: count(db, app.Run) == 2, timeout=20)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    # The two running jobs finished within the grace period; nothing else started, and
    # nothing is left holding a lease.
    assert count(db, app.Run) == 2
    assert count(db, status="running") == 0
    assert count(db, status="ready") == 3
    assert "stopping" in out


def test_a_signal_stops_a_worker_running_until_empty_gracefully(db: sa.Engine) -> None:
    """``--until-empty`` installs no signal handlers of its own: the launcher's early ones
    stop it gracefully, and say so without "while starting" once it runs."""
    enqueue_slow(db, 3, 1.0)
    proc = start_worker(
        "--queues", "records", "--concurrency", "1", "--until-empty", "--log-level", "INFO"
    )
    try:
        wait_for(lambda: count(db, app.Run) == 1, timeout=20)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert count(db, status="running") == 0 and count(db, app.Run) == 1
    assert "received SIGTERM, stopping" in out and "while starting" not in out, out


@pytest.mark.parametrize(
    ("signals", "options"),
    [
        ((signal.SIGTERM, signal.SIGTERM), []),
        ((signal.SIGINT, signal.SIGINT), ["--asyncio"]),
        ((signal.SIGQUIT,), []),
        ((signal.SIGTERM, signal.SIGQUIT), ["--asyncio"]),
        ((signal.SIGTERM, signal.SIGTERM), ["--until-empty"]),
    ],
    ids=["twice", "ctrl-c-twice-asyncio", "sigquit", "then-sigquit-asyncio", "until-empty"],
)
def test_a_second_stop_signal_or_sigquit_skips_the_grace_period(
    db: sa.Engine, signals: tuple[int, ...], options: list[str]
) -> None:
    """A stop signal to a worker already stopping (a second Ctrl-C), or SIGQUIT, stops it
    now: the handler still running (two minutes of work, a two-minute grace period) is cut
    off and its job handed back, and the process exits at once, with code 0. (A worker
    running until empty installs no handlers: the launcher's take the signals.)"""
    enqueue_slow(db, 1, 120.0)
    args = ["--queues", "records", "--concurrency", "1", "--grace-period", "120"]
    proc = start_worker(*args, "--log-level", "INFO", *options)
    try:
        wait_for(lambda: count(db, app.Run) == 1, timeout=30)
        *first, last = signals
        for sig in first:
            proc.send_signal(sig)
            # A graceful stop: the handler has its grace period. (And the next signal
            # comes two seconds later: within a second of the first's handling it is the
            # same stop, see below; a loaded machine may handle the first late.)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
            assert count(db, status="running") == 1
        proc.send_signal(last)
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"the worker waited out its grace period:\n{out}")
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert count(db, status="ready") == 1 and count(db, status="running") == 0, out
    assert f"received {signal.Signals(last).name}, stopping now" in out, out
    assert "handed back 1 cut off by a stop now jobs" in out, out


@pytest.mark.parametrize("options", [[], ["--asyncio"]], ids=["threads", "asyncio"])
def test_one_stop_delivered_twice_at_once_is_one_graceful_stop(
    db: sa.Engine, options: list[str]
) -> None:
    """A terminal's Ctrl-C reaches the worker and a wrapper in its process group (a
    Procfile runner), which passes it on as SIGTERM: two signals within milliseconds.
    That is one stop, not a second Ctrl-C: the running job finishes in its grace period."""
    enqueue_slow(db, 1, 2.0)
    args = ["--queues", "records", "--concurrency", "1", "--grace-period", "60"]
    proc = start_worker(*args, "--log-level", "INFO", *options)
    try:
        wait_for(lambda: count(db, app.Run) == 1, timeout=30)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    # Either one may be taken first (the asyncio loop reads both at once).
    assert re.search(r"received SIG(INT|TERM), already stopping", out), out
    assert "stopping now" not in out, out
    assert count(db, status="ready") == 0 and count(db, status="running") == 0, out


def test_sigkilled_workers_jobs_are_retaken_after_the_lease(db: sa.Engine) -> None:
    enqueue_slow(db, 2, 30.0)
    first = start_worker("--queues", "records", "--concurrency", "2", "--lease", "1")
    try:
        wait_for(lambda: count(db, app.Run) == 2, timeout=20)
    finally:
        first.kill()
        first.wait()
    assert count(db, status="running") == 2
    with db.begin() as conn:
        conn.execute(sa.update(app.Job).values(args={"seconds": 0}))
    second = start_worker(
        "--queues", "records", "--concurrency", "2", "--lease", "1", "--poll-interval", "0.1"
    )
    try:
        wait_for(lambda: count(db) == 0, timeout=20)
    finally:
        second.terminate()
        second.wait(10)
    runs = rows(db, app.Run)
    assert sorted(r.attempt for r in runs) == [1, 1, 2, 2]
    assert {r.pid for r in runs if r.attempt == 1} == {first.pid}
    assert {r.pid for r in runs if r.attempt == 2} == {second.pid}


def test_worker_errors_are_clear(db: sa.Engine, database_url: str) -> None:
    no_url = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    cases: list[tuple[list[str], dict[str, Any] | None, int, str]] = [
        (["worker", "tests.app"], None, 2, "expected module:attribute"),
        (["worker", "tests.nope:jobs"], None, 2, "cannot import 'tests.nope'"),
        (["worker", "tests.app:nope"], None, 2, "has no attribute 'nope'"),
        (["worker", "tests.app:Job"], None, 2, "not a sqla_jobs.Jobs registry"),
        (
            ["--database-url", "mysql://x/y", "worker", "tests.app:jobs"],
            None,
            2,
            "needs PostgreSQL",
        ),
        (
            ["--database-url", "postgresql://nobody@127.0.0.1:1/x", "worker", "tests.app:jobs"],
            None,
            1,
            "cannot connect",
        ),
        (
            ["worker", "tests.app:jobs", "--concurrency", "0"],
            None,
            2,
            "concurrency must be an integer >= 1",
        ),
    ]
    for argv, env, code, message in cases:
        result = subprocess.run(
            [sys.executable, "-m", "sqla_jobs.cli", *argv],
            cwd=ROOT,
            env={**(env or os.environ), "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == code, (argv, result.stderr)
        assert message in result.stderr, (argv, result.stderr)
    result = subprocess.run(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", "tests.app:jobs"],
        cwd=ROOT,
        env={**no_url, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "pass --database-url or set DATABASE_URL" in result.stderr


def test_worker_reports_a_missing_table(db: sa.Engine) -> None:
    env = {"SQLA_JOBS_TEST_SCHEMA": "no_such_schema"}
    result = run_cli("worker", "tests.app:jobs", env=env)
    assert result.returncode == 1
    assert "does not exist: the database lacks what this version of sqla-jobs needs" in (
        result.stderr
    )


def test_losing_the_database_logs_one_line_per_warning(db: sa.Engine, database_url: str) -> None:
    """Each warning names the driver's error in one line: no SQL statement, no parameters,
    no continuation lines."""
    url = sa.make_url(database_url).update_query_dict({"application_name": "cli-victim"})
    proc = start_worker(
        "--database-url",
        url.render_as_string(hide_password=False),
        "--queues",
        "records",
        "--poll-interval",
        "0.05",
    )
    try:
        enqueue_slow(db, 1, 0.0)
        wait_for(lambda: count(db) == 0, timeout=20)  # claimed and completed: connected
        with db.begin() as conn:
            killed = conn.execute(
                sa.text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'cli-victim' AND datname = current_database()"
                )
            ).scalar()
        assert killed
        enqueue_slow(db, 1, 0.0)
        wait_for(lambda: count(db) == 0, timeout=20)  # it came back
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    warnings = [line for line in out.splitlines() if " WARNING " in line]
    assert any("terminating connection" in line for line in warnings), out
    for text in ("[SQL:", "[parameters:", "sqlalche.me", "SELECT", "UPDATE"):
        assert text not in out, (text, out)
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ")
    assert all(stamp.match(line) for line in out.splitlines()), out

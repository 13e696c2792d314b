"""``sqla-jobs worker`` as an operator runs it in production: JSON logs with a line per
finished job, ``--metrics-port`` scraped over HTTP, and ``--health-port`` turning 503 when
the fetch loop is stuck on a locked table and 200 again when it is released. Every
endpoint listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import signal
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import JobSession

from . import app
from .helpers import count, reaped, wait_for
from .test_cli_worker import enqueue_slow, run_cli, start_worker


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return int(first)
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""


def sample(metrics: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_json_logs_metrics_and_a_health_probe_that_sees_a_stuck_fetch_loop(
    db: sa.Engine, flavour: str
) -> None:
    metrics_port, health_port = free_ports(), free_ports()
    args = [
        "--queues",
        "records",
        "--poll-interval",
        "0.1",
        "--stuck-after",
        "1",
        "--log-format",
        "json",
        "--metrics-port",
        f"127.0.0.1:{metrics_port}",
        "--health-port",
        f"127.0.0.1:{health_port}",
    ]
    proc = start_worker(*args, *(["--asyncio"] if flavour == "asyncio" else []))
    try:
        enqueue_slow(db, 3, 0.0)
        wait_for(lambda: count(db) == 0 and count(db, app.Run) == 3, timeout=20)
        status, body = wait_for(lambda: (r := get(health_port, "/healthz"))[0] and r)
        report = json.loads(body)
        assert status == 200, report
        assert report["healthy"] and report["state"] == "running"
        assert {"fetch loop", "completer", "heartbeat", "listener"} <= set(report["loops"])

        status, metrics = get(metrics_port, "/metrics")
        assert status == 200
        labels = {"queue": "records", "task": "tests.app.slow_record"}
        assert sample(metrics, "sqla_jobs_jobs_succeeded_total", **labels) == 3
        assert sample(metrics, "sqla_jobs_queue_stats_up") == 1

        # A table lock stops every statement of the fetch loop: past its poll interval and
        # stuck_after, the probe says so; released, the worker is healthy again.
        with db.connect() as conn, conn.begin():
            conn.execute(sa.text(f'LOCK TABLE "{app.SCHEMA}".jobs IN ACCESS EXCLUSIVE MODE'))
            status, body = wait_for(lambda: (r := get(health_port, "/healthz"))[0] == 503 and r)
        problems = json.loads(body)["problems"]
        assert any(p.startswith("fetch loop stuck: waiting on Io ") for p in problems), problems
        wait_for(lambda: get(health_port, "/healthz")[0] == 200)
        assert get(health_port, "/nothing")[0] == 404

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    lines = [json.loads(line) for line in out.splitlines()]  # every line is one JSON object
    finished = [r for r in lines if r.get("outcome") == "succeeded"]
    assert len(finished) == 3
    for record in finished:
        assert record["level"] == "INFO" and record["logger"] == "sqla_jobs.worker"
        assert record["task"] == "tests.app.slow_record" and record["queue"] == "records"
        assert record["duration"] >= 0 and record["attempt"] == 1
        assert record["message"].startswith(f"job {record['job_id']} (tests.app.slow_record")
    for text in ("SELECT", "UPDATE", "[SQL:"):
        assert text not in out


def test_log_level_and_no_log_jobs(db: sa.Engine) -> None:
    enqueue_slow(db, 2, 0.0)
    quiet = run_cli("worker", "tests.app:jobs", "--until-empty", "--no-log-jobs")
    assert quiet.returncode == 0, quiet.stderr
    assert "succeeded in" not in quiet.stderr and "worker " in quiet.stderr
    enqueue_slow(db, 2, 0.0)
    loud = run_cli(
        "worker", "tests.app:jobs", "--until-empty", "--no-log-jobs", "--log-level", "debug"
    )
    assert loud.returncode == 0, loud.stderr
    # Without log_jobs the line of a success is a DEBUG line.
    assert loud.stderr.count(" DEBUG sqla_jobs.worker: job ") == 2, loud.stderr
    assert loud.stderr.count("): succeeded in ") == 2
    enqueue_slow(db, 1, 0.0)
    terse = run_cli("worker", "tests.app:jobs", "--until-empty", "--log-level", "WARNING")
    assert terse.returncode == 0 and terse.stderr == "", terse.stderr
    bad = run_cli("worker", "tests.app:jobs", "--log-level", "loud")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


@pytest.mark.parametrize("flavour", ["threads", "asyncio"])
def test_lines_that_handlers_log_carry_their_job(db: sa.Engine, flavour: str) -> None:
    def enqueue() -> tuple[int, int]:
        with JobSession(db) as session:
            plain = session.enqueue(app.talk, "hi")
            coroutine = session.enqueue(app.talk_async, "ho")
            session.commit()
            assert plain is not None and coroutine is not None
            return plain.id, coroutine.id

    asyncio = ["--asyncio"] if flavour == "asyncio" else []
    plain, coroutine = enqueue()
    text = run_cli("worker", "tests.app:talk_jobs", "--until-empty", *asyncio)
    assert text.returncode == 0, text.stderr
    for line in (
        f"WARNING tests.app: job {plain} (tests.app.talk, queue talk, attempt 1/5): "
        "handler says hi",
        f"WARNING tests.app: job {coroutine} (tests.app.talk_async, queue talk, attempt 1/5): "
        "async handler says ho",
    ):
        assert line in text.stderr, text.stderr
    # The worker's own job lines keep their one prefix.
    assert f"sqla_jobs.worker: job {plain} (tests.app.talk, queue talk, attempt 1/5): " in (
        text.stderr
    )
    assert "): job " not in text.stderr

    plain, coroutine = enqueue()
    out = run_cli(
        "worker", "tests.app:talk_jobs", "--until-empty", "--log-format", "json", *asyncio
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    said = {r["job_id"]: r for r in lines if r["logger"] == "tests.app"}
    assert set(said) == {plain, coroutine}, lines
    for job_id, task in ((plain, "tests.app.talk"), (coroutine, "tests.app.talk_async")):
        record = said[job_id]
        assert (record["task"], record["queue"], record["attempt"]) == (task, "talk", 1)
        assert record["worker"] and record["message"].endswith(("says hi", "says ho"))
        assert "job_prefix" not in record


def test_commands_set_info_on_the_librarys_loggers_only(db: sa.Engine) -> None:
    # The app's import logs INFO lines (its own, and Alembic's plugin set-up): not printed.
    stats = run_cli("stats", "tests.noisy_app:jobs")
    assert stats.returncode == 0, stats.stderr
    assert stats.stderr == ""
    worker = run_cli("worker", "tests.noisy_app:jobs", "--until-empty")
    assert worker.returncode == 0, worker.stderr
    assert " INFO sqla_jobs.worker: worker " in worker.stderr  # the library's own INFO lines
    assert " INFO " not in worker.stderr.replace(" INFO sqla_jobs.", ""), worker.stderr


def test_each_supervised_process_serves_its_own_endpoints(db: sa.Engine) -> None:
    health, metrics = free_ports(2), free_ports(2)
    proc = start_worker(
        "--processes",
        "2",
        "--queues",
        "records",
        "--health-port",
        f"127.0.0.1:{health}",
        "--metrics-port",
        f"127.0.0.1:{metrics}",
    )
    with reaped(proc):
        for port in (health, health + 1):
            wait_for(lambda port=port: get(port, "/healthz")[0] == 200, timeout=30)  # type: ignore[misc]
        reports: list[Any] = [json.loads(get(p, "/healthz")[1]) for p in (health, health + 1)]
        assert reports[0]["worker"] != reports[1]["worker"]
        for port in (metrics, metrics + 1):
            assert get(port, "/metrics")[0] == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_a_port_in_use_is_a_clear_error(db: sa.Engine) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("worker", "tests.app:jobs", "--health-port", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert f"sqla-jobs: error: --health-port 127.0.0.1:{port}: " in result.stderr
    bad = run_cli("worker", "tests.app:jobs", "--metrics-port", "nine")
    assert bad.returncode == 2 and "expected PORT or HOST:PORT" in bad.stderr

"""``sqla-jobs ... --engine MODULE:ATTR``: the commands run on the application's own engine
(its connect arguments and events), whether it is an engine, a factory, an AsyncEngine for
the asyncio worker, or a mapping of shards; and a URL's ``?prepare_threshold=`` reaches
psycopg as a value, or is refused.

The engines are in tests/engines.py; each names its connections (``application_name``)
after itself and its ``prepare_threshold``, which ``pg_stat_activity`` shows while the
worker runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from sqla_jobs import JobSession
from sqla_jobs.model import companion_tables, job_table

from . import app, cli_fork
from .helpers import count, wait_for

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return cli_fork.run(
        args, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=timeout
    )


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def enqueue(engine: sa.Engine, n: int) -> None:
    with JobSession(engine) as session:
        session.enqueue_many(app.record_run, [{"n": i} for i in range(n)])
        session.commit()


def app_names(engine: sa.Engine, pattern: str) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT DISTINCT application_name FROM pg_stat_activity "
                    "WHERE application_name LIKE :p AND datname = current_database()"
                ),
                {"p": pattern},
            ).scalars()
        )


def workers_seen(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        table = companion_tables(job_table(app.Job)).workers
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def run_worker_until(
    db: sa.Engine, names: set[str], *args: str, jobs: int = 6, workers: int = 1
) -> str:
    """Start ``worker`` with ``args``, wait until it ran ``jobs`` jobs, ``workers`` workers
    said they are alive, and their connections carry every name in ``names``; stop it; its
    output."""
    enqueue(db, jobs)
    proc = start("worker", "tests.app:jobs", "--queues", "records", *args)
    try:
        wait_for(lambda: count(db, app.Run) >= jobs or proc.poll() is not None, timeout=30)
        assert proc.poll() is None, proc.communicate()[0]
        wait_for(lambda: workers_seen(db) >= workers, timeout=15)
        wait_for(lambda: names <= app_names(db, "app-%"), timeout=15)
    finally:
        proc.send_signal(signal.SIGTERM)  # a supervisor stops its children itself
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, out
    assert count(db, app.Job) == 0
    return out


def test_the_worker_runs_on_the_applications_engine(db: sa.Engine) -> None:
    run_worker_until(db, {"app-engine-ptNone"}, "--engine", "tests.engines:engine")


def test_the_worker_runs_on_an_engine_factory_with_several_processes(db: sa.Engine) -> None:
    # Each child of the supervisor loads the factory for itself.
    out = run_worker_until(
        db,
        {"app-factory-ptNone"},
        "--engine",
        "tests.engines:make_engine",
        "--processes",
        "2",
        workers=2,
    )
    assert out.count("started: queues") == 2, out


def test_the_asyncio_worker_runs_on_the_applications_async_engine(db: sa.Engine) -> None:
    run_worker_until(
        db, {"app-async-ptNone"}, "--asyncio", "--engine", "tests.engines:async_engine"
    )


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        (["--one-process"], {"app-shard-eu-ptNone", "app-shard-us-ptNone"}),
        ([], {"app-shard-eu-ptNone", "app-shard-us-ptNone"}),  # a process per shard
        (
            ["--asyncio", "--one-process"],
            {"app-ashard-eu-ptNone", "app-ashard-us-ptNone"},
        ),
    ],
    ids=["one-process", "process-per-shard", "asyncio"],
)
def test_a_sharded_worker_runs_on_the_applications_engines(
    db: sa.Engine, extra: list[str], names: set[str]
) -> None:
    mapping = "async_shards" if "--asyncio" in extra else "shards"
    # Both shards are the test database: each worker claims from the same table.
    run_worker_until(db, names, "--engine", f"tests.engines:{mapping}", *extra, workers=2)


def test_the_operating_commands_run_on_the_applications_engine(db: sa.Engine) -> None:
    enqueue(db, 2)
    with ThreadPoolExecutor(4) as pool:
        stats, listed, sharded, show = pool.map(
            lambda argv: cli(*argv),
            [
                ("stats", "tests.app:jobs", "--engine", "tests.engines:make_engine", "--json"),
                ("jobs", "list", "tests.app:jobs", "--engine", "tests.engines:engine"),
                ("jobs", "list", "tests.app:jobs", "--engine", "tests.engines:shards"),
                ("jobs", "show", "tests.app:jobs", "1", "--engine", "tests.engines:engine"),
            ],
        )
    assert stats.returncode == 0, stats.stderr
    assert '"queue": "records"' in stats.stdout
    assert listed.returncode == 0 and "tests.app.record_run" in listed.stdout, listed.stderr
    assert sharded.returncode == 0, sharded.stderr
    lines = sharded.stdout.splitlines()
    assert lines[0].startswith("SHARD")
    assert {line.split()[0] for line in lines[1:]} == {"eu", "us"}
    assert show.returncode == 0 and show.stdout.startswith("job 1"), show.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("stats", "tests.app:jobs", "--engine", "tests.engines:async_engine"),
            "--engine tests.engines:async_engine is an AsyncEngine; this command runs on an Engine",
        ),
        (
            ("worker", "tests.app:jobs", "--asyncio", "--engine", "tests.engines:engine"),
            "--engine tests.engines:engine is an Engine; the asyncio worker runs on an AsyncEngine",
        ),
        (
            ("worker", "tests.app:jobs", "--engine", "tests.engines:string_threshold"),
            "the engine's URL gives psycopg prepare_threshold as a string ('None'), and every "
            "statement fails",
        ),
        (
            ("stats", "tests.app:jobs", "--engine", "tests.engines:not_an_engine"),
            "--engine tests.engines:not_an_engine is a int, not an Engine",
        ),
        (
            ("jobs", "show", "tests.app:jobs", "1", "--engine", "tests.engines:shards"),
            "--engine tests.engines:shards names 2 shards; this command works on one database",
        ),
        (
            ("stats", "tests.app:jobs", "--engine", "tests.engines:engine", "--database-url", "x"),
            "give either --database-url or --engine, not both",
        ),
        (
            ("stats", "tests.app:jobs", "--engine", "tests.engines:nothing"),
            "module 'tests.engines' has no attribute 'nothing'",
        ),
    ],
    ids=[
        "async-for-sync",
        "sync-for-asyncio",
        "string-threshold",
        "not-an-engine",
        "shards-for-one",
        "both",
        "missing",
    ],
)
def test_a_wrong_engine_is_one_clear_line(
    db: sa.Engine, argv: tuple[str, ...], message: str
) -> None:
    result = cli(*argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"sqla-jobs: error: {message}" + result.stderr.partition(message)[2]
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_a_urls_prepare_threshold_reaches_psycopg_as_a_value(
    db: sa.Engine, database_url: str
) -> None:
    url = sa.make_url(database_url).update_query_dict(
        {"prepare_threshold": "None", "application_name": "app-url"}
    )
    enqueue(db, 3)
    result = cli(
        "--database-url",
        url.render_as_string(hide_password=False),
        "worker",
        "tests.app:jobs",
        "--queues",
        "records",
        "--until-empty",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert count(db, app.Run) == 3
    bad = url.update_query_dict({"prepare_threshold": "never"}).render_as_string(
        hide_password=False
    )
    refused = cli("--database-url", bad, "stats", "tests.app:jobs")
    assert refused.returncode == 2
    assert refused.stderr.startswith(
        "sqla-jobs: error: bad database URL: ?prepare_threshold=never in the database URL: "
        "expected None"
    ), refused.stderr


@pytest.mark.parametrize(
    ("mapping", "names"),
    [("engine", {"app-engine-ptNone"}), ("shards", {"app-shard-eu-ptNone", "app-shard-us-ptNone"})],
)
def test_the_dashboard_runs_on_the_applications_engine(
    db: sa.Engine, mapping: str, names: set[str]
) -> None:
    import socket

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    enqueue(db, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start(
        "web", "tests.app:jobs", "--engine", f"tests.engines:{mapping}", "--port", str(port)
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
                time.sleep(0.1)
        assert page.status_code == 200
        if mapping == "shards":
            assert 'href="/shards/eu/"' in page.text and 'href="/shards/us/"' in page.text
            page = httpx.get(f"http://127.0.0.1:{port}/shards/us/jobs", timeout=5)
        else:
            page = httpx.get(f"http://127.0.0.1:{port}/jobs", timeout=5)
        assert page.status_code == 200 and "tests.app.record_run" in page.text
        assert names <= app_names(db, "app-%")
    finally:
        proc.terminate()
        proc.communicate(timeout=10)

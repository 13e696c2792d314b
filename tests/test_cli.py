"""The operating commands of ``sqla-jobs``, each run as a real process.

Output is checked as an operator reads it (tables) and as a script reads it (``--json``),
with the exit codes: 0 success, 1 failure at run time, 2 bad usage.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import JobSession
from sqla_jobs.model import companion_tables, job_table

from . import app, cli_fork
from .helpers import count, reaped, rows, wait_for

ROOT = Path(__file__).resolve().parent.parent
JOBS = "tests.app:jobs"


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sqla_jobs.cli", *args]


def environment(extra: dict[str, str] | None = None, drop: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra or {})}
    if drop:
        env.pop(drop, None)
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``sqla-jobs *args`` run to completion, in a process of its own (a fork of a process
    that has imported the CLI: see tests/cli_fork.py)."""
    return cli_fork.run(args, env=env or environment(), cwd=ROOT, timeout=60)


def in_parallel(*argvs: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Independent read-only invocations, run side by side to keep the suite quick."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda argv: cli(*argv), argvs))


def add(engine: sa.Engine, n: int = 1, **values: Any) -> list[int]:
    row = {"task": "tests.app.record_run", "queue": "records", **values}
    with engine.begin() as conn:
        stmt = sa.insert(app.Job).values([row] * n).returning(app.Job.id)
        return list(conn.execute(stmt).scalars())


def status_of(engine: sa.Engine, job_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.select(app.Job.status).where(app.Job.id == job_id)).scalar())


def dead(engine: sa.Engine, n: int = 1, **values: Any) -> list[int]:
    error = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom'
    return add(
        engine,
        n,
        status="dead",
        attempts=5,
        finished_at=sa.func.now(),
        last_error=error,
        **values,
    )


HELP = {
    (): ["worker", "stats", "jobs", "queues", "--database-url"],
    ("worker",): ["--concurrency", "--until-empty", "--processes", "--database-url"],
    ("stats",): ["--json", "--watch", "--window", "JOBS", "keep_done"],
    ("jobs",): ["list", "show", "retry", "cancel", "purge"],
    ("jobs", "list"): ["--queue", "--status", "--task", "--limit", "--json"],
    ("jobs", "show"): ["ID", "--json", "last error"],
    ("jobs", "retry"): [
        "--yes",
        "--dry-run",
        "--all",
        "max_attempts",
        "STATUS only this status (repeatable): dead, cancelled;",
    ],
    ("jobs", "cancel"): ["--yes", "--dry-run", "scheduled or ready or running"],
    ("jobs", "purge"): ["--older-than", "--yes", "running jobs never", "default: done or dead"],
    ("queues",): ["list", "pause", "resume"],
    ("queues", "list"): ["--json", "JOBS"],
    ("queues", "pause"): ["NAME", "JOBS", "running jobs finish"],
    ("queues", "resume"): ["NAME", "JOBS"],
}


def test_every_help_is_there() -> None:
    results = in_parallel(*((*argv, "--help") for argv in HELP))
    for (argv, words), result in zip(HELP.items(), results, strict=True):
        assert result.returncode == 0, (argv, result.stderr)
        text = " ".join(result.stdout.split())  # argparse wraps lines
        for word in words:
            assert word in text, (argv, word, result.stdout)


def test_stats(db: sa.Engine) -> None:
    begun = time.monotonic()
    add(db, 2, run_at=sa.func.now() - timedelta(seconds=90))
    dead(db, 1, queue="webhooks")
    queues = companion_tables(job_table(app.Job)).queues
    with db.begin() as conn:
        conn.execute(sa.insert(queues).values(name="webhooks", paused=True))
    table, as_json, from_model = in_parallel(
        ("stats", JOBS), ("stats", JOBS, "--json", "--window", "1h"), ("stats", "tests.app:Job")
    )
    took = time.monotonic() - begun
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith(f"{app.SCHEMA}.jobs at ")
    assert lines[1].split() == [
        "QUEUE", "STATE", "READY", "SCHEDULED", "RUNNING", "EXPIRED", "DEAD", "CANCELLED",
        "DONE", "LAG", "DONE/5m", "DEAD/5m",
    ]  # fmt: skip
    records = lines[2].split()
    assert records[:9] == ["records", "active", "2", "0", "0", "0", "0", "0", "0"]
    # 90 s old when added, and older by however long the commands took to answer (a
    # loaded machine's processes start slowly: "1m3" held only while that was under 10 s).
    lag = re.fullmatch(r"(\d+)m(\d\d)s", records[9])
    assert lag and 90 <= 60 * int(lag[1]) + int(lag[2]) <= 90 + took + 1, records[9]
    assert records[10:] == ["-", "0"]
    assert lines[3].split()[:2] == ["webhooks", "paused"]

    data = json.loads(as_json.stdout)
    assert set(data) == {"time", "table", "window_seconds", "queues"}
    assert data["window_seconds"] == 3600 and data["table"] == f"{app.SCHEMA}.jobs"
    by_queue = {q["queue"]: q for q in data["queues"]}
    assert set(by_queue["records"]) == {
        "queue", "paused", "scheduled", "ready", "running", "lease_expired", "done", "dead",
        "cancelled", "lag_seconds", "done_recent", "dead_recent",
    }  # fmt: skip
    assert by_queue["records"]["ready"] == 2 and by_queue["records"]["done_recent"] is None
    assert by_queue["webhooks"] == {**by_queue["webhooks"], "paused": True, "dead_recent": 1}
    assert by_queue["webhooks"]["lag_seconds"] is None
    assert from_model.returncode == 0 and "records" in from_model.stdout


def test_stats_watch_json_prints_a_line_per_refresh_until_ctrl_c(db: sa.Engine) -> None:
    add(db, 1)
    proc = subprocess.Popen(
        command("stats", JOBS, "--watch", "0.05", "--json"),
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        add(db, 2)
        for _ in range(100):  # refreshes until the new jobs show, bounded
            latest = json.loads(proc.stdout.readline())
            if latest["queues"][0]["ready"] == 3:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert first["queues"][0]["ready"] == 1
    assert latest["queues"][0]["ready"] == 3
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_ctrl_c_during_a_refresh_ends_the_watch_after_it_and_in_the_pause_at_once() -> None:
    """A KeyboardInterrupt raised inside the driver or the pool can be dropped there, and a
    watch then never ends: the first Ctrl-C is only noted while a refresh runs."""
    from sqla_jobs.cli import _CtrlC

    before = signal.getsignal(signal.SIGINT)
    ctrl_c = _CtrlC()
    with ctrl_c.deferred(True):
        os.kill(os.getpid(), signal.SIGINT)  # "during a refresh": noted, nothing raised
        assert ctrl_c.pressed
        started = time.monotonic()
        ctrl_c.sleep(30)  # the watch ends before its pause
        assert time.monotonic() - started < 5
        with pytest.raises(KeyboardInterrupt):  # a second one interrupts at once
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before

    pausing = _CtrlC()
    with pytest.raises(KeyboardInterrupt), pausing.deferred(True):
        previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        try:
            started = time.monotonic()
            pausing.sleep(30)
        finally:
            signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGINT) is before


def test_job_data_reaches_the_terminal_escaped(db: sa.Engine) -> None:
    """An error message (or a queue, a task name) carries what a user typed: ``jobs list``
    and ``jobs show`` print its control characters escaped, not for the terminal to act
    on (ESC ] 52 writes the clipboard, ESC [ 2J clears the screen), and a progress that is
    no object as its JSON (it was a traceback)."""
    hostile = "ValueError: \x1b]52;c;cm0gLXJmIH4=\x07 \x1b[2J \u202egnp.exe"
    [job] = dead(db, 1, queue="q\x1b[31m")
    with db.begin() as conn:
        conn.execute(
            sa.update(app.Job)
            .where(app.Job.id == job)
            .values(last_error=f"Traceback:\n{hostile}", progress="half way")
        )
    listing, show = in_parallel(("jobs", "list", JOBS), ("jobs", "show", JOBS, str(job)))
    assert listing.returncode == 0 and show.returncode == 0, show.stderr
    for out in (listing.stdout, show.stdout):
        assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
        assert "\\x1b]52;c;" in out and "\\u202egnp.exe" in out
    assert "q\\x1b[31m" in listing.stdout
    assert '"half way"' in show.stdout and "Traceback:\nValueError" in show.stdout


def test_jobs_list_and_show(db: sa.Engine) -> None:
    ready = add(db, 2)
    [failed] = dead(db, 1, args={"n": 7})
    add(db, 1, queue="other", task="tests.app.slow_record", args={"seconds": 1})
    listing, filtered, as_json, show, show_json, missing = in_parallel(
        ("jobs", "list", JOBS),
        ("jobs", "list", JOBS, "--status", "dead", "--status", "ready", "--queue", "records"),
        ("jobs", "list", JOBS, "--task", "tests.app.slow_record", "--json", "--limit", "1"),
        ("jobs", "show", JOBS, str(failed)),
        ("jobs", "show", "tests.app:Job", str(failed), "--json"),
        ("jobs", "show", JOBS, "999"),
    )
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "QUEUE", "TASK", "ATTEMPTS", "RUN_AT", "LAST_ERROR"]
    assert [line.split()[0] for line in lines[1:]] == ["4", "3", "2", "1"], "newest first"
    assert lines[2].split()[1:5] == ["dead", "records", "tests.app.record_run", "5/5"]
    assert lines[2].endswith("ValueError: boom")
    assert [line.split()[0] for line in filtered.stdout.splitlines()[1:]] == [
        str(i) for i in [failed, *ready[::-1]]
    ]

    [only] = json.loads(as_json.stdout)
    assert set(only) == {
        "id", "queue", "task", "status", "args", "priority", "attempts", "max_attempts",
        "run_at", "created_at", "finished_at", "locked_until", "locked_by", "unique_key",
        "last_error", "meta", "progress", "result", "parents", "waiting", "children", "steps",
    }  # fmt: skip
    assert only["args"] == {"seconds": 1} and only["queue"] == "other"

    assert show.returncode == 0, show.stderr
    assert f"job {failed}" in show.stdout and "attempts      5 of 5" in show.stdout
    assert 'args          {"n": 7}' in show.stdout
    assert show.stdout.rstrip().endswith(
        'last_error:\nTraceback (most recent call last):\n  File "x.py", line 1\nValueError: boom'
    )
    detail = json.loads(show_json.stdout)
    assert detail["id"] == failed and detail["status"] == "dead"
    assert detail["last_error"].endswith("ValueError: boom")
    assert detail["finished_at"].endswith("+00:00")

    assert missing.returncode == 1
    assert (
        missing.stderr
        == "sqla-jobs: error: no job with id 999 (finished jobs are deleted unless kept)\n"
    )


def test_a_named_job_left_alone_is_warned_about_and_exits_1(db: sa.Engine) -> None:
    """Jobs named by id that the action leaves alone for a reason the count does not see
    (a live job holds the dead job's unique key; a purge's --older-than): a warning each,
    and exit code 1, as the docs promise. It said "retried 1 job" and exited 0."""
    [held, free] = dead(db, 2)
    with db.begin() as conn:
        conn.execute(sa.update(app.Job).where(app.Job.id == held).values(unique_key="k"))
    add(db, 1, unique_key="k")  # its live twin
    retried = cli("jobs", "retry", JOBS, str(held), str(free), "--yes")
    assert retried.returncode == 1, retried.stderr
    assert f"skipping job {held}: a live job holds its unique key" in retried.stderr
    assert "retried 1 job" in retried.stdout
    assert (status_of(db, held), status_of(db, free)) == ("dead", "ready")
    [young] = dead(db, 1)
    kept = cli("jobs", "purge", JOBS, str(young), "--older-than", "7d", "--yes")
    assert kept.returncode == 1, kept.stderr
    assert f"skipping job {young}: it is younger than --older-than" in kept.stderr
    assert status_of(db, young) == "dead"


def test_retry_cancel_purge_confirm_or_refuse(db: sa.Engine) -> None:
    failed = dead(db, 2)
    [ready] = add(db, 1)

    refused = cli("jobs", "retry", JOBS, "--status", "dead")
    assert refused.returncode == 2
    assert "retry would affect 2 jobs; pass --yes to confirm" in refused.stderr
    assert {status_of(db, i) for i in failed} == {"dead"}, "nothing changed"

    dry = cli("jobs", "retry", JOBS, "--queue", "records", "--dry-run")
    assert (dry.returncode, dry.stdout) == (0, "2 jobs would be retried\n")

    retried = cli("jobs", "retry", JOBS, str(failed[0]), "--yes", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout) == {
        "action": "retry",
        "dry_run": False,
        "count": 1,
        "rearmed": 0,
    }
    assert status_of(db, failed[0]) == "ready"

    # An id the action does not apply to is skipped with a warning, and the exit code says so.
    mixed = cli("jobs", "retry", JOBS, str(failed[1]), str(ready), "--yes")
    assert mixed.returncode == 1
    assert mixed.stdout == "retried 1 job\n"
    assert f"skipping job {ready}: it is ready; retry applies to dead or cancelled" in mixed.stderr

    unknown = cli("jobs", "cancel", JOBS, str(ready), "999", "1000", "--yes")
    assert unknown.returncode == 1
    assert "no jobs with ids 999, 1000 (nothing was cancelled)" in unknown.stderr
    assert status_of(db, ready) == "ready"

    cancelled = cli("jobs", "cancel", JOBS, "--queue", "records", "--yes")
    assert (cancelled.returncode, cancelled.stdout) == (0, "cancelled 3 jobs\n")
    nothing = cli("jobs", "cancel", JOBS, "--queue", "records", "--yes")
    assert (nothing.returncode, nothing.stdout) == (0, "cancelled 0 jobs\n")

    unselected = cli("jobs", "purge", JOBS, "--yes")
    assert unselected.returncode == 2 and "which jobs?" in unselected.stderr
    running = cli("jobs", "purge", JOBS, "--status", "running", "--yes")
    assert running.returncode == 2
    assert "refusing to purge running jobs: cancel them first" in running.stderr
    kept = cli("jobs", "purge", JOBS, "--older-than", "1d", "--yes", "--json")
    assert json.loads(kept.stdout)["count"] == 0
    purged = cli("jobs", "purge", JOBS, "--all", "--yes")
    assert (purged.returncode, purged.stdout) == (0, "purged 3 jobs\n")
    assert count(db) == 0


def answer(argv: tuple[str, ...], reply: str) -> tuple[int, str]:
    """Run with a terminal as stdin, type ``reply``, return (exit code, stderr)."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            command(*argv),
            cwd=ROOT,
            env=environment(),
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.write(leader, reply.encode() + b"\n")
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    return proc.returncode, err


def test_a_terminal_is_asked_first(db: sa.Engine) -> None:
    failed = dead(db, 2)
    code, err = answer(("jobs", "retry", JOBS, "--status", "dead"), "n")
    assert code == 1
    assert "Retry 2 jobs? [y/N]" in err and "aborted: nothing was changed" in err
    assert {status_of(db, i) for i in failed} == {"dead"}
    code, err = answer(("jobs", "retry", JOBS, "--status", "dead"), "y")
    assert code == 0, err
    assert {status_of(db, i) for i in failed} == {"ready"}


def test_a_bulk_action_leaves_out_the_jobs_enqueued_while_it_asks(db: sa.Engine) -> None:
    """The command counts, asks, then acts: the jobs that arrived while the question was
    on the screen were acted on too (the dashboard bounds its confirm page by the highest
    id it counted; the command now does the same)."""
    import select

    counted = dead(db, 2)
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            command("jobs", "retry", JOBS, "--status", "dead"),
            cwd=ROOT,
            env=environment(),
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        err, deadline = b"", time.monotonic() + 60
        while b"[y/N]" not in err:
            assert time.monotonic() < deadline and proc.poll() is None, err
            if select.select([proc.stderr], [], [], 0.5)[0]:
                err += os.read(proc.stderr.fileno(), 4096)
        assert b"Retry 2 jobs? [y/N]" in err
        arrived = dead(db, 3)  # while the question waits for its answer
        os.write(leader, b"y\n")
        out, rest = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 0, err + rest
    assert b"retried 2 jobs" in out
    assert {status_of(db, i) for i in counted} == {"ready"}
    assert {status_of(db, i) for i in arrived} == {"dead"}


def test_queues(db: sa.Engine) -> None:
    add(db, 1, queue="records")
    pause = cli("queues", "pause", JOBS, "records")
    assert (pause.returncode, pause.stdout, pause.stderr) == (0, "paused queue 'records'\n", "")
    typo = cli("queues", "pause", "tests.app:Job", "recrods")
    assert typo.returncode == 0 and "no job or task uses queue 'recrods'" in typo.stderr
    listing, as_json = in_parallel(("queues", "list", JOBS), ("queues", "list", JOBS, "--json"))
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["QUEUE", "STATE", "SINCE", "LIMITS"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["records", "paused"],
        ["recrods", "paused"],
    ]
    data = json.loads(as_json.stdout)
    assert [set(q) for q in data] == [{"name", "paused", "updated_at", "limits"}] * 2
    resume = cli("queues", "resume", JOBS, "records")
    assert (resume.returncode, resume.stdout) == (0, "resumed queue 'records'\n")
    after = json.loads(cli("queues", "list", JOBS, "--json").stdout)
    assert [(q["name"], q["paused"]) for q in after] == [("records", False), ("recrods", True)]


def test_errors_are_one_clear_line(db: sa.Engine) -> None:
    cases: list[tuple[tuple[str, ...], int, str]] = [
        (("stats", "tests.nope:jobs"), 2, "cannot import 'tests.nope'"),
        (("stats", "tests.app"), 2, "expected module:attribute"),
        (("stats", "tests.app:Link"), 2, "is a Link, not a sqla_jobs.Jobs registry or JobMixin"),
        (("stats", JOBS, "--database-url", "mysql://x/y"), 2, "needs PostgreSQL"),
        (
            ("--database-url", "postgresql://nobody@127.0.0.1:1/x", "jobs", "list", JOBS),
            1,
            "cannot connect",
        ),
        (("jobs", "show", JOBS, "abc"), 2, "not a job id: 'abc'"),
        (("jobs", "list", JOBS, "--status", "deadd"), 2, "invalid choice: 'deadd'"),
        (("jobs", "purge", JOBS, "--older-than", "soon", "--all"), 2, "not a duration"),
        (("stats", JOBS, "--watch", "0"), 2, "must be > 0"),
        (("worker", JOBS, "--processes", "2", "--until-empty"), 2, "do not mix"),
    ]
    results = in_parallel(*(argv for argv, _, _ in cases))
    for (argv, code, message), result in zip(cases, results, strict=True):
        assert result.returncode == code, (argv, result.stderr)
        assert message in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr, argv
    no_url = cli("stats", JOBS, env=environment(drop="DATABASE_URL"))
    assert no_url.returncode == 2
    assert no_url.stderr == (
        "sqla-jobs: error: no database: pass --database-url or set DATABASE_URL "
        "(or give --engine)\n"
    )


@pytest.fixture
def partly_migrated(db: sa.Engine) -> Any:
    """A schema with the jobs table but not its companion tables (an older migration)."""
    schema = "sqla_jobs_cli_partial"
    metadata = sa.MetaData()
    job_table(app.Job).to_metadata(metadata, schema=schema)
    with db.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        metadata.tables[f"{schema}.jobs"].create(conn)
    yield schema
    with db.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_missing_tables_point_to_the_schema_check(partly_migrated: str) -> None:
    """A missing table is named, with the command that says what else differs; never "run
    your migrations", which is wrong for someone whose migrations ran (issue 21)."""
    no_schema = environment({"SQLA_JOBS_TEST_SCHEMA": "no_such_schema"})
    partial = environment({"SQLA_JOBS_TEST_SCHEMA": partly_migrated})
    missing = cli("stats", JOBS, env=no_schema)
    assert missing.returncode == 1
    assert "table 'no_such_schema.jobs' does not exist: the database lacks" in missing.stderr
    assert "`sqla-jobs check JOBS` says what differs" in missing.stderr
    for argv in (("queues", "list", JOBS), ("queues", "pause", JOBS, "q"), ("stats", JOBS)):
        result = cli(*argv, env=partial)
        assert result.returncode == 1, (argv, result.stderr)
        assert f'relation "{partly_migrated}.jobs_queues" does not exist' in result.stderr
        assert "`sqla-jobs check JOBS` says what differs and how to fix it" in result.stderr
        assert "run your migrations" not in result.stderr
    ok = cli("jobs", "list", JOBS, "--json", env=partial)
    assert (ok.returncode, ok.stdout) == (0, "[]\n"), "what does not need the table works"


def supervised(*args: str) -> subprocess.Popen[str]:
    """``sqla-jobs worker`` (with ``--processes`` 2 or more: a supervisor) in a process
    group of its own."""
    return subprocess.Popen(
        command("worker", JOBS, "--queues", "records", "--concurrency", "1", *args),
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_worker_processes_run_under_a_supervisor(db: sa.Engine) -> None:
    with JobSession(db) as session:
        session.enqueue_many(app.slow_record, [{"seconds": 3.0}, {"seconds": 3.0}])
        session.commit()
    proc = supervised("--processes", "2")
    with reaped(proc):
        # One slot per process: while one runs its 3-second job, the other takes the next.
        wait_for(lambda: count(db) == 0, timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    pids = {r.pid for r in rows(db, app.Run)}
    assert len(pids) == 2 and proc.pid not in pids, out
    assert "all worker processes stopped" in out


def test_supervisor_restarts_a_killed_child_and_stops_all_on_sigterm(db: sa.Engine) -> None:
    with JobSession(db) as session:
        session.enqueue_many(app.slow_record, [{"seconds": 30.0}, {"seconds": 30.0}])
        session.commit()
    proc = supervised("--processes", "2", "--grace-period", "1", "--lease", "5")
    with reaped(proc):
        # Each child runs one long job: their pids are in the runs table.
        first = wait_for(
            lambda: {r.pid for r in rows(db, app.Run)} if count(db, app.Run) == 2 else None,
            timeout=30,
        )
        victim, survivor = sorted(first)
        os.kill(victim, signal.SIGKILL)
        # The replacement child takes the next job (the survivor is busy).
        with JobSession(db) as session:
            session.enqueue(app.record_run)
            session.commit()
        third = wait_for(lambda: {r.pid for r in rows(db, app.Run)} - first, timeout=30)
        (replacement,) = third
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"worker process {victim} exited" in out
    assert f"started worker process {replacement}" in out
    for pid in (survivor, replacement):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_second_signal_to_the_supervisor_stops_its_workers_now(db: sa.Engine) -> None:
    """The first SIGTERM is passed on (a graceful stop: the two-minute job keeps running);
    the second has the supervisor send SIGQUIT, and the child cuts its job off, hands it
    back, and exits: all within seconds, not the grace period."""
    with JobSession(db) as session:
        session.enqueue(app.slow_record, seconds=120.0)
        session.commit()
    proc = supervised("--processes", "2", "--grace-period", "120")
    with reaped(proc):
        wait_for(lambda: count(db, app.Run) == 1, timeout=30)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)  # within a second of its handling: the same stop
        assert count(db, status="running") == 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "supervisor: received SIGTERM, stopping 2 workers now" in out, out
    assert "received SIGQUIT, stopping now" in out, out
    assert count(db, status="ready") == 1 and count(db, status="running") == 0, out


def test_a_stop_signal_to_the_whole_group_is_one_graceful_stop(db: sa.Engine) -> None:
    """Ctrl-C in a terminal, or systemd's default ``KillMode=control-group``, signals every
    process of the group: each child gets the signal itself and again from its
    supervisor. That is one stop, not two: the running job finishes in its grace period.
    (Two processes: with one, ``--processes 1`` runs the worker in the supervisor's place.)"""
    with JobSession(db) as session:
        session.enqueue(app.slow_record, seconds=2.0)
        session.commit()
    proc = supervised("--processes", "2", "--grace-period", "60")
    with reaped(proc):
        wait_for(lambda: count(db, app.Run) == 1, timeout=30)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "stopping now" not in out, out
    assert count(db, status="ready") == 0 and count(db, status="running") == 0, out
    assert "worker process" in out and "all worker processes stopped" in out, out


def test_children_of_a_killed_supervisor_stop_by_themselves(db: sa.Engine) -> None:
    """A supervisor killed outright (``kill -9``, the OOM killer) passes no signal on: its
    children see their parent gone and stop as on SIGTERM, handing their jobs back,
    instead of claiming jobs unsupervised for ever beside the next supervisor."""
    with JobSession(db) as session:
        session.enqueue_many(app.slow_record, [{"seconds": 30.0}, {"seconds": 30.0}])
        session.commit()
    proc = supervised("--processes", "2", "--grace-period", "1")
    with reaped(proc):
        children = wait_for(
            lambda: {r.pid for r in rows(db, app.Run)} if count(db, app.Run) == 2 else None,
            timeout=30,
        )
        proc.kill()
        proc.communicate(timeout=30)

        def gone() -> bool:
            for pid in children:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                return False
            return True

        wait_for(gone, timeout=20)
    assert count(db, status="running") == 0
    assert count(db, status="ready") == 2  # handed back, for the next supervisor


def test_a_heroku_style_url_works(db: sa.Engine, database_url: str) -> None:
    heroku = sa.make_url(database_url).set(drivername="postgres")
    url = heroku.render_as_string(hide_password=False)
    assert url.startswith("postgres://")
    add(db, 1)
    by_option = cli("--database-url", url, "stats", JOBS, "--json")
    assert by_option.returncode == 0, by_option.stderr
    assert json.loads(by_option.stdout)["queues"][0]["ready"] == 1
    by_env = cli("queues", "list", JOBS, env=environment({"DATABASE_URL": url}))
    assert by_env.returncode == 0, by_env.stderr


def test_what_admin_refuses_is_a_one_line_usage_error(db: sa.Engine) -> None:
    cases: list[tuple[tuple[str, ...], str]] = [
        (("queues", "pause", JOBS, ""), "queue name must be a non-empty string"),
        (("queues", "resume", JOBS, ""), "queue name must be a non-empty string"),
        (("queues", "pause", JOBS, "q" * 129), "129 bytes in UTF-8; at most 128"),
        (("queues", "resume", "tests.app:Job", "é" * 65), "130 bytes in UTF-8"),
        (("jobs", "list", JOBS, "--queue", ""), "queue filter must be one or more non-empty"),
        (("jobs", "list", JOBS, "--task", "t", "--task", ""), "task filter must be"),
        (("jobs", "cancel", JOBS, "--queue", "", "--yes"), "queue filter must be"),
        (("jobs", "purge", JOBS, "--task", "", "--yes"), "task filter must be"),
    ]
    results = in_parallel(*(argv for argv, _ in cases))
    for (argv, message), result in zip(cases, results, strict=True):
        assert result.returncode == 2, (argv, result.stderr)
        assert result.stderr.startswith("sqla-jobs: error: "), (argv, result.stderr)
        assert message in result.stderr, (argv, result.stderr)
        assert result.stderr.count("\n") == 1, (argv, result.stderr)
    listed = json.loads(cli("queues", "list", JOBS, "--json").stdout)
    assert [(q["name"], q["paused"]) for q in listed] == [("records", False)], "nothing paused"


def test_an_unreachable_database_is_one_line(db: sa.Engine) -> None:
    nowhere = "postgresql://nobody@127.0.0.1:1/x"
    results = in_parallel(
        ("--database-url", nowhere, "stats", JOBS),
        ("--database-url", nowhere, "queues", "pause", JOBS, "q"),
        ("--database-url", nowhere.replace("postgresql:", "postgres:"), "jobs", "list", JOBS),
    )
    for result in results:
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith("sqla-jobs: error: cannot connect to the database: ")
        assert result.stderr.count("\n") == 1, result.stderr


def test_hostile_arguments_are_one_clear_line(db: sa.Engine) -> None:
    """Values past what a timedelta, a wait, a port, a thread count or Python's json
    recursion holds were tracebacks; each is a usage error that names the limit."""
    huge = str(10**30)
    cases: list[tuple[tuple[str, ...], str]] = [
        (("stats", JOBS, "--window", "9" * 40 + "d"), "too long: at most 100 years"),
        (("jobs", "purge", JOBS, "--older-than", "9" * 40 + "w", "--all"), "at most 100 years"),
        (("stats", JOBS, "--watch", "inf"), "must be at most 86400 seconds"),
        (("stats", JOBS, "--watch", "1e300"), "must be at most 86400 seconds"),
        (("stats", JOBS, "--watch", "nan"), "must be > 0"),
        (("web", JOBS, "--port", huge), "must be at most 65,535"),
        (("jobs", "list", JOBS, "--meta", "a=" + "[" * 5000), "nested too deeply"),
        (("jobs", "list", JOBS, "--meta", "a=NaN"), "--meta a is not JSON-serialisable"),
        (("jobs", "list", JOBS, "--meta", 'a="\\u0000"'), "NUL"),
        (("jobs", "list", JOBS, "--limit", huge), "must be at most"),
        (("jobs", "show", JOBS, huge), "not a job id"),
        (("worker", JOBS, "--processes", huge), "must be at most 1,024"),
        (("worker", JOBS, "--concurrency", huge), "concurrency must be at most 10,000"),
        (("worker", JOBS, "--claim-limit", huge), "claim_limit must be at most 10,000"),
        (("worker", JOBS, "--lease", "1e30"), "lease must be at most 86,400 seconds"),
        (("worker", JOBS, "--lease", "1" + "0" * 400), "lease must be a finite number"),
        (("worker", JOBS, "--grace-period", huge), "grace_period must be at most 86,400"),
        (("worker", JOBS, "--poll-interval", "1e20"), "poll_interval must be at most"),
    ]
    results = in_parallel(*(argv for argv, _ in cases))
    for (argv, message), result in zip(cases, results, strict=True):
        assert result.returncode == 2, (argv[:4], result.stderr[-300:])
        assert "Traceback" not in result.stderr, argv[:4]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("sqla-jobs") and "error: " in last, (argv[:4], last)
        assert message in last, (argv[:4], last)


def test_bytes_that_are_not_utf8_are_one_line_and_hide_the_url() -> None:
    """What the shell passes as bytes reaches Python as surrogates, which psycopg could
    not encode (a traceback deep in the connect). The error says where, not what: the
    argument may be a URL with its password."""
    url = b"postgresql://app:s3cret\xff@localhost/app"
    for argv in (
        [b"stats", JOBS.encode(), b"--database-url", url],
        [b"worker", JOBS.encode(), b"--until-empty", b"--name", b"w\xff"],
        [b"jobs", b"list", JOBS.encode(), b"--queue", b"q\xff"],
    ):
        result = subprocess.run(
            [os.fsencode(sys.executable), b"-m", b"sqla_jobs.cli", *argv],
            cwd=ROOT,
            env=environment(),
            capture_output=True,
            timeout=60,
        )
        stderr = result.stderr.decode()
        assert result.returncode == 2, (argv, stderr)
        assert "Traceback" not in stderr and "s3cret" not in stderr, stderr
        assert stderr.strip().splitlines()[-1].startswith("sqla-jobs: error: argument "), stderr
        assert "is not valid UTF-8 (byte 0xff at character " in stderr, stderr
    env = {**environment(), "DATABASE_URL": os.fsdecode(url)}
    result = subprocess.run(
        command("stats", JOBS), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr == (
        "sqla-jobs: error: DATABASE_URL is not valid UTF-8 (byte 0xff at character 24)\n"
    )


@pytest.fixture
def role_without_rights(db: sa.Engine, database_url: str) -> Any:
    """A login role that may read the tables but not write them (nor the schedules)."""
    role = f"sqla_jobs_reader_{os.getpid()}"
    try:
        with db.begin() as conn:
            conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')
            conn.exec_driver_sql(f"CREATE ROLE \"{role}\" LOGIN PASSWORD 'pw'")
            conn.exec_driver_sql(f'GRANT USAGE ON SCHEMA "{app.SCHEMA}" TO "{role}"')
            conn.exec_driver_sql(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{app.SCHEMA}" TO "{role}"')
    except sa.exc.DBAPIError as exc:
        pytest.skip(f"cannot create a role here: {exc.orig}")
    url = sa.make_url(database_url).set(username=role, password="pw")
    yield url.render_as_string(hide_password=False)
    with db.begin() as conn:
        conn.exec_driver_sql(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{app.SCHEMA}" FROM "{role}"')
        conn.exec_driver_sql(f'REVOKE ALL ON SCHEMA "{app.SCHEMA}" FROM "{role}"')
        conn.exec_driver_sql(f'DROP ROLE IF EXISTS "{role}"')


@pytest.mark.parametrize("mode", [(), ("--asyncio",)], ids=["threads", "asyncio"])
def test_a_worker_without_rights_on_its_tables_says_so_in_one_line(
    role_without_rights: str, mode: tuple[str, ...]
) -> None:
    """It died with 60 lines and the SQL statement of the schedule sync at its start."""
    result = cli("--database-url", role_without_rights, "worker", JOBS, "--until-empty", *mode)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("sqla-jobs: error: permission denied for table "), result.stderr
    assert "the database role lacks a privilege on the jobs tables" in result.stderr

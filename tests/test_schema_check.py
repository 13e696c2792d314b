"""``sqla-jobs check``, and the same check when a worker starts and in ``/healthz``.

Issue 21: with a jobs table built bare (or migrations written without ``import
alembic_ext``), the first symptom was a worker traceback (``relation "job_schedules" does
not exist``) while ``sqla-jobs stats`` said "run your migrations" to someone whose
migrations had run. The check compares the live database with this version's schema and
says what differs and what fixes it.

Each test owns a schema holding the test app's jobs table and its companions, created as
this version declares them, then changed the way an older or hand-made schema differs.
The commands are run as a user runs them (``python -m sqla_jobs.cli``), with
``SQLA_JOBS_TEST_SCHEMA`` pointing ``tests.app`` at that schema.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from alembic_ext.check import schema_differences
from sqla_jobs.model import reference_table

from .helpers import wait_for
from .test_cli_observability import free_ports, get
from .test_cli_worker import ROOT, run_cli

JOBS = "tests.app:jobs"


@pytest.fixture
def schema(engine: sa.Engine) -> Iterator[str]:
    """A schema of its own with the jobs table and its companions, as declared."""
    name = f"check_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
        reference_table("jobs", name).metadata.create_all(conn)
    yield name
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def in_schema(schema: str) -> dict[str, str]:
    return {"SQLA_JOBS_TEST_SCHEMA": schema}


def start_worker(schema: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", JOBS, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **in_schema(schema)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def checked_health(port: int) -> tuple[int, str] | None:
    """``/healthz`` once the worker's schema comparison has run (None before)."""
    status, body = get(port, "/healthz")
    if not status or json.loads(body).get("schema") == "checking":
        return None
    return status, body


def alter(engine: sa.Engine, schema: str, *statements: str) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement.format(s=f'"{schema}"'))


def test_a_schema_as_declared_has_no_differences(engine: sa.Engine, schema: str) -> None:
    with engine.connect() as conn:
        assert schema_differences(conn, reference_table("jobs", schema)) == []
    result = run_cli("check", JOBS, env=in_schema(schema))
    assert result.returncode == 0, result.stderr
    assert f"{schema}.jobs: the schema is this version's" in result.stdout
    as_json = run_cli("check", JOBS, "--json", env=in_schema(schema))
    report = json.loads(as_json.stdout)
    assert (as_json.returncode, report["ok"], report["differences"]) == (0, True, [])


def test_each_difference_is_named_with_the_fix(engine: sa.Engine, schema: str) -> None:
    """Everything the check compares, changed at once: each is one line, and the exit
    code says that the database is not this version's."""
    alter(
        engine,
        schema,
        "DROP TABLE {s}.jobs_schedules",
        "ALTER TABLE {s}.jobs DROP COLUMN progress",
        "DROP INDEX {s}.jobs_claim",
        "ALTER TABLE {s}.jobs RESET (fillfactor)",
        "ALTER TABLE {s}.jobs SET (autovacuum_vacuum_scale_factor = 0.2)",
        "ALTER TABLE {s}.jobs DROP CONSTRAINT jobs_meta_object",
        "DROP TRIGGER jobs_notify ON {s}.jobs",
        "ALTER TABLE {s}.jobs_queues ALTER COLUMN paused DROP NOT NULL",
        "ALTER TABLE {s}.jobs ALTER COLUMN result TYPE json",
    )
    result = run_cli("check", JOBS, env=in_schema(schema))
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    expected = [
        f"table '{schema}.jobs_schedules' is missing (the worker needs it)",
        f"column {schema}.jobs.progress is missing (the worker needs it)",
        f"index 'jobs_claim' on '{schema}.jobs' is missing",
        f"the notify trigger jobs_notify on '{schema}.jobs' is missing",
        f"storage parameters of '{schema}.jobs': fillfactor is not set (80 expected); "
        "autovacuum_vacuum_scale_factor is 0.2 (0.02 expected)",
        f"'{schema}.jobs' lacks CHECK constraint 'jobs_meta_object'",
        f"column {schema}.jobs_queues.paused should be NOT NULL",
        f"column {schema}.jobs.result is JSON in the database; this version declares JSONB",
    ]
    assert sorted(lines[:-1]) == sorted(expected), lines
    assert lines[-1].startswith("Fix: apply the migration that adds it (alembic upgrade head)")
    assert "alembic revision --autogenerate (env.py must import alembic_ext)" in lines[-1]

    report = json.loads(run_cli("check", JOBS, "--json", env=in_schema(schema)).stdout)
    assert not report["ok"] and report["fix"]
    fatal = sorted(d["kind"] for d in report["differences"] if d["fatal"])
    assert fatal == ["column", "table"]


def test_a_missing_table_stops_the_worker_at_start_with_one_line(
    engine: sa.Engine, schema: str
) -> None:
    """The worker's statements could not run: one line that names what is missing and the
    check, instead of a traceback from its first duty (and again at every restart)."""
    alter(engine, schema, "DROP TABLE {s}.jobs_schedules", "ALTER TABLE {s}.jobs DROP COLUMN meta")
    result = run_cli("worker", JOBS, "--until-empty", env=in_schema(schema))
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("sqla-jobs: error: the database lacks what this version of sqla-jobs")
    assert f"table '{schema}.jobs_schedules' is missing" in line
    assert f"column {schema}.jobs.meta is missing" in line
    assert f"`sqla-jobs check {JOBS}` lists every difference" in line
    assert "run your migrations" not in line


def test_other_differences_are_warned_and_shown_in_healthz(engine: sa.Engine, schema: str) -> None:
    """A missing index or trigger makes the queue slower, not wrong: the worker starts, says
    so in its log, and ``/healthz`` shows it (200: a restart would not fix a schema)."""
    alter(engine, schema, "DROP INDEX {s}.jobs_dead", "DROP TRIGGER jobs_notify ON {s}.jobs")
    port = free_ports()
    proc = start_worker(schema, "--health-port", f"127.0.0.1:{port}")
    try:
        # The comparison runs a second after start (SCHEMA_CHECK_DELAY): "checking" until then.
        status, body = wait_for(lambda: (r := checked_health(port)) and r, timeout=30)
        report = json.loads(body)
        assert status == 200 and report["healthy"], report
        assert sorted(report["schema"]) == [
            f"index 'jobs_dead' on '{schema}.jobs' is missing",
            f"the notify trigger jobs_notify on '{schema}.jobs' is missing",
        ]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"schema: index 'jobs_dead' on '{schema}.jobs' is missing" in out
    assert "the worker runs, but the database is not this version's" in out


def test_healthz_says_ok_when_the_schema_is_this_version_s(schema: str) -> None:
    port = free_ports()
    proc = start_worker(schema, "--health-port", f"127.0.0.1:{port}")
    try:
        status, body = wait_for(lambda: (r := checked_health(port)) and r, timeout=30)
        assert status == 200 and json.loads(body)["schema"] == "ok"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "schema:" not in out


def test_shards_are_checked_each(engine: sa.Engine, schema: str, database_url: str) -> None:
    """``check --shard`` and a worker of shards: each shard's differences, named by shard;
    a shard that cannot be reached is not checked, and does not stop the others."""
    alter(engine, schema, "DROP TABLE {s}.jobs_throughput")
    down = "postgresql://nobody@127.0.0.1:1/nothing"
    result = run_cli("check", JOBS, "--shard", f"a={database_url}", env=in_schema(schema))
    assert result.returncode == 1
    assert f"shard a: table '{schema}.jobs_throughput' is missing (the worker needs it)" in (
        result.stdout
    )
    worker = run_cli(
        "worker",
        JOBS,
        "--until-empty",
        "--shard",
        f"a={database_url}",
        "--shard",
        f"b={down}",
        env=in_schema(schema),
    )
    assert worker.returncode == 1
    assert "schema: shard b not checked: cannot connect to the database" in worker.stderr
    assert f"needs: shard a: table '{schema}.jobs_throughput' is missing." in worker.stderr


@pytest.mark.parametrize(
    "damage",
    [
        (),
        ("DROP TABLE {s}.jobs_schedules", "ALTER TABLE {s}.jobs DROP COLUMN progress"),
        ("ALTER TABLE {s}.jobs_queues DROP COLUMN paused", "DROP TABLE {s}.jobs_workers"),
        ("DROP TABLE {s}.jobs CASCADE",),
    ],
)
def test_the_start_probe_finds_what_the_whole_comparison_calls_fatal(
    engine: sa.Engine, schema: str, damage: tuple[str, ...]
) -> None:
    """The worker refuses at start from one catalog query (no Alembic): it must find the
    same missing tables and columns as the comparison, in the same words."""
    from sqla_jobs.cli import _required_missing

    alter(engine, schema, *damage)
    table = reference_table("jobs", schema)
    with engine.connect() as conn:
        fatal = [d.message for d in schema_differences(conn, table) if d.fatal]
        probed = _required_missing(conn, table)
    assert sorted(probed) == sorted(fatal)
    assert bool(probed) == bool(damage)


def test_the_whole_comparison_runs_later_in_the_background_or_not_at_all(
    engine: sa.Engine, schema: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """The comparison (Alembic's) waits SCHEMA_CHECK_DELAY in a thread of its own, so the
    worker claims first; a worker that stops before then skips it (``sqla-jobs check``
    reports it, as ever); once it has run, the log and ``/healthz`` have its warnings."""
    from sqla_jobs import cli

    alter(engine, schema, "DROP INDEX {s}.jobs_dead")
    table = reference_table("jobs", schema)
    args = argparse.Namespace(registry=JOBS)
    monkeypatch.setattr(cli, "SCHEMA_CHECK_DELAY", 3600.0)
    skipped = cli._LaterCheck(table, {"": engine}, args)
    skipped.start()
    skipped.stop()  # at once: the worker ended first
    assert skipped() is None and "schema:" not in caplog.text

    monkeypatch.setattr(cli, "SCHEMA_CHECK_DELAY", 0.0)
    later = cli._LaterCheck(table, {"": engine}, args, unchecked=["b"])
    later.start()
    found = wait_for(later, timeout=30)
    later.stop()
    assert found == [f"index 'jobs_dead' on '{schema}.jobs' is missing", "shard b: not checked"]
    assert f"schema: index 'jobs_dead' on '{schema}.jobs' is missing" in caplog.text


def test_a_worker_until_empty_leaves_the_whole_comparison_to_check(
    engine: sa.Engine, schema: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A ``--until-empty`` worker never runs the comparison, however long its drain: it
    would compete with the drain for the interpreter (see ``_LaterCheck``). What it has is
    said in ``/healthz``, and nothing is logged."""
    from sqla_jobs import cli

    alter(engine, schema, "DROP INDEX {s}.jobs_dead")
    table = reference_table("jobs", schema)
    monkeypatch.setattr(cli, "SCHEMA_CHECK_DELAY", 0.0)
    check = cli._LaterCheck(
        table, {"": engine}, argparse.Namespace(registry=JOBS, until_empty=True)
    )
    check.start()
    assert check._thread is None
    check.stop()
    assert check() == [cli.UNTIL_EMPTY_UNCOMPARED]
    assert "schema:" not in caplog.text


def test_healthz_says_checking_until_the_comparison_has_run() -> None:
    """``/healthz`` reads the comparison's result when asked: "checking", then the list."""
    from sqla_jobs.health import _with_schema

    found: list[str] | None = None
    read = _with_schema(lambda: {"healthy": True}, lambda: found)
    assert read() == {"healthy": True, "schema": "checking"}
    found = []
    assert read()["schema"] == "ok"
    found = ["index 'jobs_dead' on 'jobs' is missing"]
    assert read()["schema"] == found
    assert _with_schema(lambda: {}, ["x"])() == {"schema": ["x"]}
    assert _with_schema(lambda: {}, None)() == {}


def test_the_comparison_runs_without_prepared_statements(engine: sa.Engine) -> None:
    """Behind PgBouncer in transaction mode, a running worker's prepared statements share
    server connections with the comparison's: it prepares none (found by the fault suite's
    PgBouncer scenario: ``prepared statement "_pg3_1" already exists``)."""
    from sqla_jobs.cli import _unprepared

    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        before = raw.prepare_threshold  # type: ignore[union-attr]
        assert before is not None
        inside = _unprepared(conn, lambda: raw.prepare_threshold)  # type: ignore[union-attr]
        assert inside is None
        assert raw.prepare_threshold == before  # type: ignore[union-attr]


# -- a schema_translate_map (one schema per tenant) ------------------------------------------


@pytest.fixture
def tenant(engine: sa.Engine) -> Iterator[str]:
    name = f"tenant_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{name}"')
    yield name
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _triggers(conn: sa.Connection, schema: str) -> list[str]:
    return list(
        conn.execute(
            sa.text(
                "SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = :schema AND NOT t.tgisinternal"
            ),
            {"schema": schema},
        ).scalars()
    )


@pytest.mark.parametrize("how", ["create_all", "alembic"])
def test_a_translate_map_s_schema_gets_the_trigger_and_passes_the_check(
    engine: sa.Engine, tenant: str, how: str
) -> None:
    """The trigger, its function and the storage parameters are text statements, which a
    connection's ``schema_translate_map`` does not reach: they went to the untranslated
    table (failing, or changing another schema's table of that name, silently), and the
    tenant's table had no trigger. The check and the worker's start probe looked in the
    untranslated schema too, and called every table missing."""
    from alembic.operations import Operations
    from alembic.runtime.migration import MigrationContext

    from sqla_jobs.cli import _required_missing

    table = reference_table("jobs", None)  # the application's model: no schema of its own
    with engine.begin() as conn:
        translated = conn.execution_options(schema_translate_map={None: tenant})
        if how == "create_all":
            table.metadata.create_all(translated)
        else:
            Operations(MigrationContext.configure(translated)).create_jobs_table(
                "jobs", companions=True
            )
    with engine.connect() as conn:
        assert _triggers(conn, tenant) == ["jobs_notify"]
        translated = conn.execution_options(schema_translate_map={None: tenant})
        assert [d.message for d in schema_differences(translated, table)] == []
        assert _required_missing(translated, table) == []
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP INDEX "{tenant}".jobs_dead')
    with engine.connect() as conn:
        translated = conn.execution_options(schema_translate_map={None: tenant})
        found = [d.message for d in schema_differences(translated, table)]
    assert len(found) == 1 and "jobs_dead" in found[0] and tenant in found[0]


def test_a_copy_made_with_to_metadata_is_created_with_its_trigger(
    engine: sa.Engine, tenant: str
) -> None:
    """``Table.to_metadata(..., schema=tenant)`` copies the table's info (which says the DDL
    is attached) but not its listeners: the copy was created without trigger, silently."""
    copies = sa.MetaData()
    for table in reference_table("jobs", None).metadata.sorted_tables:
        table.to_metadata(copies, schema=tenant)
    with engine.begin() as conn:
        copies.create_all(conn)
    with engine.connect() as conn:
        assert _triggers(conn, tenant) == ["jobs_notify"]
    with engine.begin() as conn:
        copies.drop_all(conn)
        function = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = :schema AND p.proname = 'jobs_notify'"
            ),
            {"schema": tenant},
        ).scalar()
    assert function == 0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (  # the partial index the claim reads, made whole
            "DROP INDEX {s}.jobs_claim; "
            "CREATE INDEX jobs_claim ON {s}.jobs (queue, priority DESC, run_at, id)",
            "index 'jobs_claim'",
        ),
        (  # the unique index without its live statuses: a finished job keeps its key
            "DROP INDEX {s}.jobs_unique; "
            "CREATE UNIQUE INDEX jobs_unique ON {s}.jobs (unique_key) WHERE unique_key IS NOT NULL",
            "index 'jobs_unique'",
        ),
        (  # the same index, no longer UNIQUE
            "DROP INDEX {s}.jobs_unique; CREATE INDEX jobs_unique ON {s}.jobs (unique_key) "
            "WHERE unique_key IS NOT NULL AND status IN ('scheduled', 'ready', 'running')",
            "index 'jobs_unique'",
        ),
        (
            "ALTER TABLE {s}.jobs DROP CONSTRAINT jobs_priority, "
            "ADD CONSTRAINT jobs_priority CHECK (priority >= -5)",
            "CHECK constraint 'jobs_priority'",
        ),
    ],
)
def test_an_index_or_check_with_another_definition_is_named(
    engine: sa.Engine, schema: str, change: str, named: str
) -> None:
    """Alembic compares an index by its columns and a CHECK constraint by its name: a
    partial index without its WHERE, a unique one made plain, a condition changed by
    hand all passed the check (the unique index's, for one, then made an enqueue fail
    with "keeps changing hands")."""
    table = reference_table("jobs", schema)
    with engine.connect() as conn:
        assert schema_differences(conn, table) == []
    with engine.begin() as conn:
        conn.exec_driver_sql(change.format(s=f'"{schema}"'))
    with engine.connect() as conn:
        found = [d.message for d in schema_differences(conn, table)]
        temp = conn.exec_driver_sql("SELECT count(*) FROM pg_class WHERE relpersistence = 't'")
        assert temp.scalar() == 0  # the reference tables were rolled back
    assert len(found) == 1, found
    assert found[0].startswith(f"{named} on '{schema}.jobs' differs: the database has ")


def test_an_index_a_failed_concurrent_build_left_invalid_is_named(
    engine: sa.Engine, schema: str
) -> None:
    """A ``CREATE INDEX CONCURRENTLY`` that failed (a lock timeout, a cancel: the upgrade
    guide builds the indexes so) leaves an index that PostgreSQL keeps and does not use,
    and spells like a good one: the check said the schema was this version's, while every
    unique enqueue failed on the invalid ``<table>_unique``. (The catalog is changed by
    hand here, as the failed build leaves it.)"""
    table = reference_table("jobs", schema)
    alter(
        engine,
        schema,
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = '{s}.jobs_unique'::regclass",
    )
    with engine.connect() as conn:
        found = [d.message for d in schema_differences(conn, table)]
    assert found == [
        f"index 'jobs_unique' on '{schema}.jobs' is invalid (a CREATE INDEX CONCURRENTLY "
        "that failed): PostgreSQL keeps it but does not use it; drop it and build it again"
    ]


def test_the_check_waits_a_bounded_time_for_a_migrations_lock(
    engine: sa.Engine, schema: str
) -> None:
    """A migration holds the jobs table (``ALTER TABLE`` in an open transaction): the
    check gives up after its lock timeout, in one line, rather than wait for as long as
    the migration runs (the worker's background comparison, the same, says "not
    checked")."""
    with engine.connect() as migration:
        migration.begin()
        migration.exec_driver_sql(f'ALTER TABLE "{schema}".jobs ADD COLUMN extra integer')
        result = run_cli("check", JOBS, env=in_schema(schema))
        migration.rollback()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "lock timeout" in result.stderr

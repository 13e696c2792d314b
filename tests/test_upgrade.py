"""An install of sqla-jobs 0.1 upgraded the way users upgrade: the 0.1 migration applied,
then ``alembic revision --autogenerate`` against the current models, ``upgrade``, and
``alembic check`` clean; then the features of this release work on the upgraded tables.

The 0.1 schema is the example application's first migration
(``examples/shortener/migrations/versions/0001_snip_tables.py``), written by 0.1's
autogenerate, copied into a throwaway project as it is.

Each feature that needs a schema change adds a check to ``UPGRADED_FEATURES``: a function
that takes the upgraded project's ``Jobs`` registry and engine and exercises the feature
on them (raising if it does not work). The upgrade runs once for all of them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, JobSession, Steps, Worker

from .helpers import running, wait_for
from .test_alembic import Project, section
from .test_alembic import make_project as make_project  # the fixture, re-exported

V01_MIGRATION = (
    Path(__file__).parent.parent
    / "examples"
    / "shortener"
    / "migrations"
    / "versions"
    / "0001_snip_tables.py"
)


def check_unique_scopes(jobs: Jobs, engine: sa.Engine) -> None:
    """unique_for (through <table>_unique_keys, new in 0.2) holds a key after the job
    finished; debounce replaces a waiting job's arguments."""

    @jobs.task(queue="upgrade")
    def refresh(user_id: int) -> None:
        pass

    hourly = refresh.with_options(unique_for=timedelta(hours=1))
    with JobSession(engine, jobs=jobs) as session:
        first = session.enqueue(hourly, 1)
        assert session.enqueue(hourly, 1) is first
        session.commit()
    Worker(jobs, engine, queues=["upgrade"], listen=False).run_until_empty(timeout=10)
    with JobSession(engine, jobs=jobs) as session:
        assert session.enqueue(hourly, 1) is None  # finished, deleted, still held
        debounced = refresh.with_options(unique_key="u2", unique_on_conflict="replace", delay=60)
        a = session.enqueue(debounced, 2)
        b = session.enqueue(debounced, 3)
        assert a is b and b.args == {"user_id": 3}
        session.commit()


def check_limits(jobs: Jobs, engine: sa.Engine) -> None:
    """A keyed, rate-limited queue (concurrency_key and <table>_keys on the jobs table,
    rate_log and rate_counts on <table>_queues, new in 0.2) is claimed by the limited
    claim."""
    jobs.queue("upgrade-limited", concurrency=1, rate="1000/minute")

    @jobs.task(queue="upgrade-limited", concurrency_key=lambda account, **_: account)
    def sync(account: str) -> None:
        pass

    with JobSession(engine, jobs=jobs) as session:
        session.enqueue_many(sync, [{"account": "a"}, {"account": "b"}])
        session.commit()
    worker = Worker(jobs, engine, queues=["upgrade-limited"], listen=False)
    assert worker.run_until_empty(timeout=10) == 2
    with engine.connect() as conn:
        started = conn.execute(
            sa.text(
                "SELECT (SELECT sum(n) FROM unnest(rate_counts) AS n) FROM jobs_queues "
                "WHERE name = 'upgrade-limited'"
            )
        ).scalar()
    assert started == 2


def check_key_order(jobs: Jobs, engine: sa.Engine) -> None:
    """Strict order per key (<table>_key_order, new in 0.2): the jobs of one key run one
    after the other, in the order they were enqueued."""
    jobs.queue("upgrade-ordered", key_order="fifo")
    ran: list[int] = []

    @jobs.task(queue="upgrade-ordered", concurrency_key=lambda account, **_: account)
    def step(account: str, n: int) -> None:
        ran.append(n)

    with JobSession(engine, jobs=jobs) as session:
        session.enqueue_many(step, [{"account": "a", "n": n} for n in range(5)])
        session.commit()
    with JobSession(engine, jobs=jobs) as session:
        assert len(session.claim(queue="upgrade-ordered", limit=5)) == 1  # the head alone
        session.rollback()
    worker = Worker(jobs, engine, queues=["upgrade-ordered"], listen=False)
    assert worker.run_until_empty(timeout=10) == 5
    assert ran == list(range(5))
    with engine.connect() as conn:
        assert conn.execute(
            sa.text("SELECT count(*) FROM pg_indexes WHERE indexname = 'jobs_key_order'")
        ).scalar()


def check_results_and_workflows(jobs: Jobs, engine: sa.Engine) -> None:
    """A kept result (the result column) and a chain (parents, waiting and
    <table>_parents, new in 0.2): the child runs after its parent, and both results are
    read back."""

    @jobs.task(queue="upgrade-flow", keep_result=True)
    def double(n: int) -> int:
        return 2 * n

    with JobSession(engine, jobs=jobs) as session:
        parent = session.enqueue(double, 1)
        child = session.enqueue(double.with_options(after=[parent]), 2)
        session.commit()
        ids = parent.id, child.id
    worker = Worker(jobs, engine, queues=["upgrade-flow"], listen=False)
    assert worker.run_until_empty(timeout=10) == 2
    assert [jobs.result(engine, i, timeout=5) for i in ids] == [2, 4]


def check_key_rate(jobs: Jobs, engine: sa.Engine) -> None:
    """A per-key rate (through <table>_key_starts, new in 0.2) starts two jobs of a key a
    minute, and holds the third ready with no attempt spent, while another key runs."""
    jobs.queue("upgrade-keyed", key_rate="2/minute")

    @jobs.task(queue="upgrade-keyed", concurrency_key=lambda account, **_: account)
    def sync(account: str) -> None:
        pass

    with engine.begin() as conn:
        jobs.enqueue_many(conn, sync, [{"account": "a"}] * 3 + [{"account": "b"}])
    query = sa.text("SELECT concurrency_key, status, attempts FROM jobs WHERE queue = :q")

    def left() -> list[Any]:
        with engine.connect() as conn:
            return list(conn.execute(query, {"q": "upgrade-keyed"}).all())

    # The held job waits a minute for its key: run the worker until the others are done.
    with running(Worker(jobs, engine, queues=["upgrade-keyed"], listen=False)):
        wait_for(lambda: len(left()) == 1, timeout=10)
    with engine.connect() as conn:
        logged = conn.execute(sa.text("SELECT key, cardinality(log) FROM jobs_key_starts")).all()
    assert [tuple(r) for r in left()] == [("a", "ready", 0)]
    assert sorted(tuple(r) for r in logged) == [("a", 2), ("b", 1)], logged


#: Rows the worker could not handle (issue 20): each must be refused by the upgraded
#: database itself, by the CHECK constraint named.
REFUSED_ROWS = [
    ("jobs_meta_object", "INSERT INTO jobs (task, meta) VALUES ('t', '[1]')"),
    ("jobs_meta_object", """INSERT INTO jobs (task, meta) VALUES ('t', '"tag"')"""),
    ("jobs_args_object", "INSERT INTO jobs (task, args) VALUES ('t', '[]')"),
    ("jobs_args_object", "INSERT INTO jobs (task, args) VALUES ('t', 'null')"),
    ("jobs_attempts_left", "INSERT INTO jobs (task, attempts, max_attempts) VALUES ('t', 5, 5)"),
    (
        "jobs_attempts_left",
        "INSERT INTO jobs (task, status, attempts, max_attempts) VALUES ('t', 'running', 6, 5)",
    ),
    (
        "jobs_attempts_left",
        "INSERT INTO jobs (task, status, attempts, max_attempts) "
        "VALUES ('t', 'scheduled', 2147483647, 2147483647)",
    ),
    ("jobs_waiting", "INSERT INTO jobs (task, waiting) VALUES ('t', -1)"),
    ("jobs_status", "INSERT INTO jobs (task, status) VALUES ('t', 'finished')"),
    ("jobs_priority", "INSERT INTO jobs (task, priority) VALUES ('t', -1)"),
    (
        "jobs_schedules_args_object",
        "INSERT INTO jobs_schedules (name, task, cron, args) VALUES ('s', 't', '* * * * *', '[]')",
    ),
]


def check_steps(jobs: Jobs, engine: sa.Engine) -> None:
    """Durable steps (through <table>_steps, new in 0.2): a step runs once across
    attempts, a wait suspends the job until its signal commits."""
    calls: list[int] = []

    @jobs.task(queue="upgrade-steps", durable=True)
    def fulfil(steps: Steps) -> None:
        steps.run("charge", lambda: calls.append(1))
        steps.wait("shipped")

    with JobSession(engine, jobs=jobs) as session:
        job = session.enqueue(fulfil)
        session.commit()
        job_id = job.id

    def drain() -> None:
        Worker(jobs, engine, queues=["upgrade-steps"], listen=False).run_until_empty(timeout=10)

    drain()
    with engine.begin() as conn:
        assert jobs.signal(conn, job_id, "shipped", {"t": 1}) == "woken"
    drain()
    assert calls == [1]
    with engine.connect() as conn:
        assert conn.execute(sa.text(f"SELECT count(*) FROM jobs WHERE id = {job_id}")).scalar() == 0


def check_constraints(jobs: Jobs, engine: sa.Engine) -> None:
    """The CHECK constraints of 0.2 (an object ``meta`` and ``args``, an attempt left for a
    waiting job, ...) refuse what the worker cannot handle, and let the rest in: a dead
    job past its attempts, a running job on its last one."""
    for name, statement in REFUSED_ROWS:
        with pytest.raises(sa.exc.IntegrityError, match=name), engine.begin() as conn:
            conn.execute(sa.text(statement))
    with engine.begin() as conn:
        for status, attempts in (("dead", 9), ("cancelled", 0), ("running", 5), ("done", 7)):
            conn.execute(
                sa.text(
                    "INSERT INTO jobs (task, queue, status, attempts, max_attempts, meta) "
                    """VALUES ('t', 'upgrade-checks', :s, :a, 5, '{"k": 1}')"""
                ),
                {"s": status, "a": attempts},
            )
        conn.execute(sa.text("DELETE FROM jobs WHERE queue = 'upgrade-checks'"))


#: (name, check) for each feature of this release that the upgrade must bring along.
UPGRADED_FEATURES: list[tuple[str, Callable[[Jobs, sa.Engine], None]]] = [
    ("unique scopes", check_unique_scopes),
    ("concurrency and rate limits", check_limits),
    ("results and workflows", check_results_and_workflows),
    ("per-key rates", check_key_rate),
    ("strict order per key", check_key_order),
    ("durable steps", check_steps),
    ("CHECK constraints", check_constraints),
]


def test_a_0_1_install_upgrades_through_autogenerate(make_project: Any) -> None:
    project: Project = make_project(explicit_schema=False)
    project.exclude = "links"  # the example app's own table, not ours
    project.write_ini()
    shutil.copy(V01_MIGRATION, project.root / "migrations" / "versions" / V01_MIGRATION.name)
    project.upgrade()
    with project.engine.begin() as conn:  # a 0.1 install in use: a waiting job
        conn.execute(sa.text("INSERT INTO jobs (task, queue) VALUES ('old.task', 'old')"))

    script = project.autogenerate("sqla-jobs 0.2")
    upgrade = section(script, "upgrade")
    # No hand edits: the new companion table is a plain create_table.
    assert any(s.startswith("op.create_table('jobs_unique_keys',") for s in upgrade), upgrade
    assert any(s.startswith("op.create_table('jobs_key_starts',") for s in upgrade), upgrade
    assert any(s.startswith("op.create_table('jobs_steps',") for s in upgrade), upgrade
    # The CHECK constraints 0.1 did not have (Alembic compares none of them).
    checks = [s for s in upgrade if s.startswith("op.create_jobs_checks(")]
    assert [c.split(",")[0] for c in checks] == [
        "op.create_jobs_checks('jobs'",
        "op.create_jobs_checks('jobs_schedules'",
    ], upgrade
    for name in ("jobs_args_object", "jobs_meta_object", "jobs_attempts_left", "jobs_waiting"):
        assert f"'{name}':" in checks[0]
    project.upgrade()
    project.check()  # alembic check: the upgraded database matches the models
    assert [d for d in project.compare() if "links" not in str(d)] == []

    models = project.load_models()
    jobs = Jobs(models.Job)
    for name, check in UPGRADED_FEATURES:
        try:
            check(jobs, project.engine)
        except Exception as exc:
            raise AssertionError(f"{name} does not work on an upgraded 0.1 install") from exc
    with project.engine.connect() as conn:  # the 0.1 job is still there, untouched
        assert conn.execute(sa.text("SELECT count(*) FROM jobs WHERE task = 'old.task'")).scalar()

    project.downgrade("0001")  # and the generated downgrade goes back to 0.1
    project.upgrade()
    project.check()


def test_the_example_s_0_2_migration_reaches_this_version_s_schema(make_project: Any) -> None:
    """The shortener's migrations (0.1's, then the one 0.2's autogenerate wrote, which the
    README points to as "exactly what 0.2 adds") leave nothing for autogenerate to write,
    and ``sqla-jobs check`` finds nothing either."""
    from alembic_ext.check import schema_differences

    project: Project = make_project(explicit_schema=False)
    project.exclude = "links"
    project.write_ini()
    versions = project.root / "migrations" / "versions"
    for migration in sorted(V01_MIGRATION.parent.glob("0*.py")):
        shutil.copy(migration, versions / migration.name)
    project.upgrade()
    project.check()
    models = project.load_models()
    with project.engine.connect() as conn:
        assert schema_differences(conn, models.Job.__table__) == []
    project.downgrade("0001")
    project.upgrade()
    project.check()

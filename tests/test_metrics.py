"""Prometheus metrics: counters and histograms from the events, queue gauges from one
statement at scrape time, busy slots from the worker's core. Each test has a
``CollectorRegistry`` of its own, scraped as Prometheus would (the text format, parsed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sqla_jobs import Jobs, Snooze, current_job
from sqla_jobs.metrics import JobMetrics

from . import app
from .helpers import running, wait_for


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and sorted labels."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    yield CollectorRegistry()


def test_a_scrape_after_a_small_drain_has_the_right_counts(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, registry: CollectorRegistry
) -> None:
    metrics = JobMetrics(jobs, registry=registry, engine=db)

    @jobs.task(queue="q", name="ok")
    def ok(n: int) -> None: ...

    @jobs.task(queue="q", name="flaky", max_attempts=2)
    def flaky() -> None:
        if current_job().attempts == 1:
            raise RuntimeError("first time")

    @jobs.task(queue="q", name="doomed", max_attempts=1)
    def doomed() -> None:
        raise RuntimeError("never")

    @jobs.task(queue="other", name="later")
    def later() -> None:
        if current_job().attempts == 1:
            raise Snooze(0.05)

    with Session.begin() as session:
        session.enqueue_many(ok, [{"n": i} for i in range(3)])
        session.enqueue(flaky)
        session.enqueue(doomed)
        session.enqueue(later)
    worker = make_worker(jobs, db, queues=["q", "other"], listen=False, concurrency=4)
    metrics.track(worker)
    worker.run_until_empty(wait_scheduled=5, timeout=30)

    s = scrape(registry)
    q_ok, q_flaky = {"queue": "q", "task": "ok"}, {"queue": "q", "task": "flaky"}
    q_doomed, q_later = {"queue": "q", "task": "doomed"}, {"queue": "other", "task": "later"}
    expected = {
        "enqueued": {"ok": 3, "flaky": 1, "doomed": 1, "later": 1},
        "started": {"ok": 3, "flaky": 2, "doomed": 1, "later": 2},
        "succeeded": {"ok": 3, "flaky": 1, "doomed": None, "later": 1},
        "failed": {"ok": None, "flaky": 1, "doomed": 1, "later": None},
        "retried": {"ok": None, "flaky": 1, "doomed": None, "later": None},
        "dead": {"ok": None, "flaky": None, "doomed": 1, "later": None},
        "snoozed": {"ok": None, "flaky": None, "doomed": None, "later": 1},
    }
    labels = {"ok": q_ok, "flaky": q_flaky, "doomed": q_doomed, "later": q_later}
    for event, per_task in expected.items():
        for task, count in per_task.items():
            got = value(s, f"sqla_jobs_jobs_{event}_total", **labels[task])
            assert got == (count if count is not None else 0.0), (event, task, got)
    runs = value(s, "sqla_jobs_job_run_seconds_count", **q_ok, outcome="succeeded")
    assert runs == 3
    assert value(s, "sqla_jobs_job_run_seconds_count", **q_flaky, outcome="failed") == 1
    assert value(s, "sqla_jobs_job_run_seconds_count", **q_later, outcome="snoozed") == 1
    assert value(s, "sqla_jobs_job_wait_seconds_count", **q_flaky) == 2
    # Drained: nothing is ready, and the gauges were read.
    assert value(s, "sqla_jobs_queue_stats_up") == 1
    assert not [k for k in s if k[0] == "sqla_jobs_queue_ready_jobs"]
    name = worker.name
    assert value(s, "sqla_jobs_worker_slots", worker=name) == 4
    assert value(s, "sqla_jobs_worker_slots_busy", worker=name) == 0

    # A backlog: the queue gauges come from the table, at scrape time.
    with Session.begin() as session:
        session.enqueue_many(ok, [{"n": i} for i in range(5)])
        session.enqueue(later)
    with db.begin() as conn:
        t = app.Job.__table__
        conn.execute(
            sa.update(t)
            .where(t.c.queue == "q")
            .values(run_at=sa.func.now() - sa.text("interval '90 seconds'"))
        )
    s = scrape(registry)
    assert value(s, "sqla_jobs_queue_ready_jobs", queue="q") == 5
    assert value(s, "sqla_jobs_queue_ready_jobs", queue="other") == 1
    assert 90 <= (value(s, "sqla_jobs_queue_oldest_ready_seconds", queue="q") or 0) < 150
    assert (value(s, "sqla_jobs_queue_oldest_ready_seconds", queue="other") or 99) < 60
    metrics.close()
    assert scrape(registry) == {}


def test_busy_slots_are_read_from_the_running_worker(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, registry: CollectorRegistry
) -> None:
    metrics = JobMetrics(jobs, registry=registry)  # no engine: no queue gauges
    release = threading.Event()

    @jobs.task(queue="q")
    def hold() -> None:
        release.wait(20)

    with Session.begin() as session:
        session.enqueue_many(hold, [{}, {}])
    worker = make_worker(jobs, db, queues=["q"], concurrency=3, poll_interval=0.1)
    metrics.track(worker)
    name = worker.name

    def busy() -> float | None:
        return value(scrape(registry), "sqla_jobs_worker_slots_busy", worker=name)

    try:
        with running(worker):
            wait_for(lambda: busy() == 2)
            release.set()
            wait_for(lambda: busy() == 0)
    finally:
        release.set()
    s = scrape(registry)
    assert value(s, "sqla_jobs_jobs_succeeded_total", queue="q", task=hold.name) == 2
    assert value(s, "sqla_jobs_queue_stats_up") is None
    del worker
    import gc

    gc.collect()  # a worker that is gone is no longer reported
    assert not [k for k in scrape(registry) if k[0] == "sqla_jobs_worker_slots"]


def test_two_registries_in_one_process_need_two_namespaces(
    jobs: Jobs, registry: CollectorRegistry
) -> None:
    other = Jobs(app.OtherJob)
    first = JobMetrics(jobs, registry=registry)
    with pytest.raises(ValueError, match="another namespace= or registry="):
        JobMetrics(other, registry=registry)
    second = JobMetrics(other, registry=registry, namespace="other_jobs")
    assert JobMetrics.attached(jobs) is first and JobMetrics.attached(other) is second
    names = {name for name, _ in scrape(registry)}
    assert "other_jobs_worker_slots" not in names  # no worker tracked: no samples
    families = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {"sqla_jobs_jobs_started", "other_jobs_jobs_started"} <= families
    first.close()
    assert JobMetrics.attached(jobs) is None
    JobMetrics(jobs, registry=registry).close()  # its names are free again


def test_a_database_that_fails_at_scrape_time_does_not_fail_the_scrape(
    jobs: Jobs, registry: CollectorRegistry, caplog: Any
) -> None:
    metrics = JobMetrics(jobs, registry=registry, engine="postgresql://nobody@127.0.0.1:1/x")
    s = scrape(registry)
    assert value(s, "sqla_jobs_queue_stats_up") == 0
    assert "could not read the queue gauges: OperationalError" in caplog.text
    assert "SELECT" not in caplog.text
    metrics.close()


def test_a_scrape_is_bounded_while_a_migration_holds_the_jobs_table(
    jobs: Jobs, db: sa.Engine, registry: CollectorRegistry, caplog: Any
) -> None:
    """A lock held on the jobs table (a migration's ALTER TABLE) makes a scrape say
    ``queue_stats_up 0`` within Prometheus' scrape timeout; unbounded, it waited for as
    long as the lock was held, and the scrape failed on Prometheus' side instead."""
    metrics = JobMetrics(jobs, registry=registry, engine=db)
    with db.connect() as migration:
        migration.begin()
        migration.execute(sa.text(f'LOCK TABLE "{app.SCHEMA}".jobs IN ACCESS EXCLUSIVE MODE'))
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(scrape(registry)), daemon=True)
        thread.start()
        thread.join(9)
        migration.rollback()
    thread.join(10)
    assert done, "the scrape waited for the migration"
    assert value(done[0], "sqla_jobs_queue_stats_up") == 0
    assert "lock timeout" in caplog.text
    assert value(scrape(registry), "sqla_jobs_queue_stats_up") == 1  # and after it
    metrics.close()


def test_constant_labels_and_the_queue_gauges_of_several_shards(
    db: sa.Engine, jobs: Jobs, registry: CollectorRegistry
) -> None:
    @jobs.task(queue="q", name="t")
    def t() -> None: ...

    with db.begin() as conn:
        jobs.enqueue_many(conn, t, [{}] * 2)
    dead = "postgresql://nobody@127.0.0.1:1/x"
    metrics = JobMetrics(
        jobs, registry=registry, engines={"a": db, "down": dead}, labels={"env": "test"}
    )
    try:
        jobs.events.fire("enqueued", {"queue": "q", "task": "t"})
        samples = scrape(registry)
        labels = {"env": "test", "queue": "q", "task": "t"}
        assert value(samples, "sqla_jobs_jobs_enqueued_total", **labels) == 1
        assert value(samples, "sqla_jobs_queue_ready_jobs", env="test", shard="a", queue="q") == 2
        assert value(samples, "sqla_jobs_queue_stats_up", env="test", shard="a") == 1
        assert value(samples, "sqla_jobs_queue_stats_up", env="test", shard="down") == 0
    finally:
        metrics.close()
    with pytest.raises(ValueError, match="not both"):
        JobMetrics(jobs, registry=registry, engine=db, engines={"a": db})
    with pytest.raises(ValueError, match="not in labels"):
        JobMetrics(jobs, registry=registry, engines={"a": db}, labels={"shard": "a"})

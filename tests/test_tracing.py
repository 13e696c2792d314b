"""OpenTelemetry spans of enqueues and runs, recorded by the SDK's in-memory exporter, on
both workers. The provider is given to ``JobTracing`` (never set globally), so tests do
not see each other's spans."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sqla_jobs import Jobs
from sqla_jobs.tracing import TRACE_KEY, JobTracing

from .helpers import rows


@pytest.fixture
def tracing() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_the_enqueuing_span_is_the_parent_of_the_run_span(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, tracing: Any
) -> None:
    provider, exporter = tracing
    tracer = provider.get_tracer("test")
    JobTracing(jobs, tracer_provider=provider)

    @jobs.task(queue="q", name="work")
    def work(n: int) -> None:
        with tracer.start_as_current_span(f"inside {n}"):
            pass

    @jobs.task(queue="q", name="awork")
    async def awork(n: int) -> None:
        with tracer.start_as_current_span(f"inside {n}"):
            pass

    with tracer.start_as_current_span("request") as request, Session.begin() as session:
        session.enqueue(work, 1)
        session.enqueue_many(work, [{"n": 2}, {"n": 3}])
        session.enqueue(awork, 4)
    carriers = [r.meta[TRACE_KEY] for r in rows(db)]
    assert all(c["traceparent"].startswith("00-") for c in carriers)
    ids = {r.args["n"]: r.id for r in rows(db)}

    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    spans = exporter.get_finished_spans()
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}

    enqueues = by_name(spans, "enqueue work") + by_name(spans, "enqueue awork")
    assert len(enqueues) == 3  # enqueue_many makes one span for its call
    for span in enqueues:
        assert span.kind is SpanKind.PRODUCER
        assert parent_id(span) == request.get_span_context().span_id
        assert span.attributes is not None and span.attributes["sqla_jobs.job.queue"] == "q"
    (single, many) = by_name(spans, "enqueue work")
    (asynchronous,) = by_name(spans, "enqueue awork")
    expected_parent = {
        1: single.context.span_id,
        2: many.context.span_id,
        3: many.context.span_id,
        4: asynchronous.context.span_id,
    }
    runs = {s.attributes["sqla_jobs.job.id"]: s for s in spans if s.name.startswith("run ")}  # type: ignore[index]
    assert sorted(runs) == sorted(ids.values())
    for n, job_id in ids.items():
        run = runs[job_id]
        assert run.kind is SpanKind.CONSUMER
        assert parent_id(run) == expected_parent[n], n
        assert run.attributes is not None
        assert run.attributes["sqla_jobs.job.task"] == ("awork" if n == 4 else "work")
        assert run.attributes["sqla_jobs.job.queue"] == "q"
        assert run.attributes["sqla_jobs.job.attempt"] == 1
        assert run.attributes["sqla_jobs.job.outcome"] == "succeeded"
        assert run.status.status_code is StatusCode.UNSET
        # The run span is current inside the handler, in its thread or task.
        (inside,) = by_name(spans, f"inside {n}")
        assert parent_id(inside) == run.context.span_id


def test_a_failed_run_records_the_error_and_each_attempt_has_its_span(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, tracing: Any
) -> None:
    provider, exporter = tracing
    JobTracing(jobs, tracer_provider=provider)

    @jobs.task(queue="q", name="flaky", max_attempts=2)
    def flaky() -> None:
        raise ValueError("not today")

    with Session.begin() as session:
        session.enqueue(flaky)  # no request span: the enqueue span is a root
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(wait_scheduled=5, timeout=20)
    spans = exporter.get_finished_spans()
    (enqueue,) = by_name(spans, "enqueue flaky")
    assert enqueue.parent is None
    runs = sorted(by_name(spans, "run flaky"), key=lambda s: s.attributes["sqla_jobs.job.attempt"])  # type: ignore[index]
    assert [r.attributes["sqla_jobs.job.outcome"] for r in runs] == ["retried", "dead"]  # type: ignore[index]
    for run in runs:
        assert parent_id(run) == enqueue.context.span_id
        assert run.status.status_code is StatusCode.ERROR
        assert run.status.description == "ValueError: not today"
        assert [e.name for e in run.events] == ["exception"]


def test_link_makes_each_run_a_root_span_linked_to_its_enqueue(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, tracing: Any
) -> None:
    provider, exporter = tracing
    tracer = provider.get_tracer("test")
    tracing_ = JobTracing(jobs, tracer_provider=provider, link=True)

    @jobs.task(queue="q", name="work")
    def work() -> None: ...

    with tracer.start_as_current_span("request"), Session.begin() as session:
        session.enqueue(work)
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    spans = exporter.get_finished_spans()
    (enqueue,) = by_name(spans, "enqueue work")
    (run,) = by_name(spans, "run work")
    assert run.parent is None and run.context.trace_id != enqueue.context.trace_id
    assert [link.context.span_id for link in run.links] == [enqueue.context.span_id]

    tracing_.close()  # no more spans, no more trace context in meta
    exporter.clear()
    with Session.begin() as session:
        session.enqueue(work)
    assert [r.meta for r in rows(db)] == [None]
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert exporter.get_finished_spans() == ()


def test_a_broken_hook_never_fails_an_enqueue_or_a_run(
    Session: Any, db: sa.Engine, jobs: Jobs, make_worker: Any, caplog: Any
) -> None:
    class Broken:
        def enter(self, job: Any) -> object:
            raise RuntimeError("enter")

        def exit(self, job: Any, state: object, outcome: str, error: Any) -> None:
            raise RuntimeError("exit")

    def hook(task: str, queue: str, meta: dict[str, Any]) -> None:
        raise RuntimeError("enqueue hook")

    jobs.events.add_enqueue_hook(hook)
    jobs.events.add_run_hook(Broken())
    ran: list[int] = []

    @jobs.task(queue="q")
    def work(n: int) -> None:
        ran.append(n)

    with Session.begin() as session:
        session.enqueue(work, 1, meta={"kept": True})
    assert [r.meta for r in rows(db)] == [{"kept": True}]
    make_worker(jobs, db, queues=["q"], listen=False).run_until_empty(timeout=20)
    assert ran == [1] and rows(db) == []
    assert "enqueue hook" in caplog.text and "failed to enter" in caplog.text

"""OpenTelemetry tracing of enqueues and runs: ``pip install 'sqla-jobs[tracing]'``.

.. code-block:: python

    from sqla_jobs.tracing import JobTracing

    JobTracing(jobs)     # the global TracerProvider and propagator (set up by your app)

In the process that enqueues (a web request, say) and in the workers (import it where the
registry is defined, so that ``sqla-jobs worker`` picks it up too):

* ``enqueue`` and ``enqueue_many`` make a span ``enqueue <task>`` (kind PRODUCER), a child of
  whatever span is current (the request's), and store its context in the job's ``meta``
  under ``sqla_jobs.trace`` (W3C ``traceparent``, and ``baggage`` if any: whatever the
  propagator writes). ``enqueue_many`` makes one span for the call, shared by its jobs.
  The span is short: enqueueing only adds to the unit of work, and the INSERT happens at
  your flush, inside your request's own spans.
* every run of a handler is a span ``run <task>`` (kind CONSUMER), with the job's id, task,
  queue and attempt as attributes, a *child* of the enqueue span (``link=True``: a root
  span of its own, linked to it, for applications whose traces must stay short). It is
  the current span while the handler runs, in its thread or its asyncio task, so spans
  the handler makes (HTTP calls, queries) nest under it. A failure is recorded on it with
  the exception (its type and ``<unprintable ...>`` if the exception cannot be printed:
  the span is ended and exported all the same); a timeout sets its status to error.

Only ``opentelemetry-api`` is needed: with no SDK configured the spans cost next to
nothing and record nothing. The hooks are per registry (:mod:`sqla_jobs.events`), never
global; :meth:`JobTracing.close` removes them.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .errors import describe, missing_extra

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(missing_extra(__name__, "opentelemetry-api", "tracing")) from exc

from . import __version__

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator

    from .tasks import Jobs
    from .worker.job import ClaimedJob

__all__ = ["TRACE_KEY", "JobTracing"]

#: The ``meta`` key that carries the enqueuing span's context.
TRACE_KEY = "sqla_jobs.trace"

#: Attributes of the OpenTelemetry messaging conventions that fit a job queue.
_SYSTEM = "sqla_jobs"


class JobTracing:
    """Spans for the enqueues and runs of one :class:`~sqla_jobs.Jobs` registry.

    :param tracer_provider: default: the global one (``trace.set_tracer_provider``).
    :param propagator: how the context is written into ``meta`` and read back; default:
        the global one (``OTEL_PROPAGATORS``; W3C trace context and baggage).
    :param link: make each run a root span linked to its enqueue span, instead of its
        child.
    """

    def __init__(
        self,
        jobs: Jobs,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        propagator: TextMapPropagator | None = None,
        link: bool = False,
    ) -> None:
        self.jobs = jobs
        self.tracer = trace.get_tracer("sqla_jobs", __version__, tracer_provider=tracer_provider)
        self.propagator = propagator
        self.link = link
        jobs.events.add_enqueue_hook(self.enqueuing)
        jobs.events.add_run_hook(self)

    def __repr__(self) -> str:
        return f"<JobTracing of {self.jobs!r}>"

    def close(self) -> None:
        """Stop tracing this registry."""
        self.jobs.events.remove_enqueue_hook(self.enqueuing)
        self.jobs.events.remove_run_hook(self)

    # -- enqueue -------------------------------------------------------------------------

    def enqueuing(self, task: str, queue: str, meta: dict[str, Any]) -> None:
        """The enqueue hook: a span for this enqueue call, its context into ``meta``."""
        span = self.tracer.start_span(
            f"enqueue {task}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": _SYSTEM,
                "messaging.operation.type": "create",
                "messaging.destination.name": queue,
                "sqla_jobs.job.task": task,
                "sqla_jobs.job.queue": queue,
            },
        )
        try:
            carrier: dict[str, str] = {}
            self._inject(carrier, trace.set_span_in_context(span))
            if carrier:
                meta[TRACE_KEY] = carrier
        finally:
            span.end()

    def _inject(self, carrier: dict[str, str], context: otel_context.Context) -> None:
        if self.propagator is not None:
            self.propagator.inject(carrier, context=context)
        else:
            propagate.inject(carrier, context=context)

    def _extract(self, carrier: Mapping[str, str]) -> otel_context.Context:
        if self.propagator is not None:
            return self.propagator.extract(carrier)
        return propagate.extract(carrier)

    # -- the run hook --------------------------------------------------------------------

    def enter(self, job: ClaimedJob) -> object:
        """A run starts: its span, made current in the handler's context."""
        carrier = (job.meta or {}).get(TRACE_KEY)
        parent: otel_context.Context | None = None
        links: list[Link] = []
        if isinstance(carrier, Mapping):
            enqueued = self._extract(carrier)
            if self.link:
                remote = trace.get_current_span(enqueued).get_span_context()
                if remote.is_valid:
                    links.append(Link(remote))
                # A root span, still carrying the enqueuer's baggage.
                parent = trace.set_span_in_context(trace.INVALID_SPAN, enqueued)
            else:
                parent = enqueued
        span = self.tracer.start_span(
            f"run {job.task}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": _SYSTEM,
                "messaging.operation.type": "process",
                "messaging.destination.name": job.queue,
                "messaging.message.id": str(job.id),
                "sqla_jobs.job.id": job.id,
                "sqla_jobs.job.task": job.task,
                "sqla_jobs.job.queue": job.queue,
                "sqla_jobs.job.attempt": job.attempts,
                "sqla_jobs.worker": job.worker,
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return span, token

    def exit(
        self, job: ClaimedJob, state: object, outcome: str, error: BaseException | None
    ) -> None:
        """The run ended: its outcome on the span, the span ended, the context restored."""
        assert isinstance(state, tuple)
        span: trace.Span = state[0]
        token: object = state[1]
        try:
            try:
                span.set_attribute("sqla_jobs.job.outcome", outcome)
                if error is not None and outcome in ("retried", "dead"):
                    _record(span, error)
                    span.set_status(Status(StatusCode.ERROR, describe(error)))
                elif outcome == "cancelled" and job.cancel_reason:
                    span.set_attribute("sqla_jobs.job.cancel_reason", job.cancel_reason)
                    if job.cancel_reason.startswith("timed out"):
                        span.set_status(Status(StatusCode.ERROR, job.cancel_reason))
            finally:
                # Whatever failed above, the run's span is ended, hence exported.
                span.end()
        finally:
            otel_context.detach(token)  # type: ignore[arg-type]


def _record(span: trace.Span, error: BaseException) -> None:
    """The handler's error on the span, as an ``exception`` event. The SDK's
    ``record_exception`` calls ``str(error)``, which a handler's error may fail at: then
    the event has the error's type and :func:`describe`'s ``<unprintable ...>``."""
    try:
        span.record_exception(error)
    except Exception:
        kind = type(error)
        span.add_event(
            "exception",
            {
                "exception.type": kind.__qualname__
                if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__qualname__}",
                "exception.message": describe(error),
                # The traceback module prints what str() cannot as a placeholder.
                "exception.stacktrace": "".join(traceback.format_exception(error)),
            },
        )

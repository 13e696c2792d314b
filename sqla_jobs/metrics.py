"""Prometheus metrics for a jobs registry and its workers: ``pip install 'sqla-jobs[metrics]'``.

.. code-block:: python

    from prometheus_client import start_http_server
    from sqla_jobs.metrics import JobMetrics

    metrics = JobMetrics(jobs, engine=engine)   # on prometheus_client's default registry
    metrics.track(worker)                        # this worker's busy slots
    start_http_server(9464)                      # or: sqla-jobs worker ... --metrics-port 9464

What is exported (``sqla_jobs`` is the default ``namespace``):

=============================================== ==========================================
``sqla_jobs_jobs_<event>_total{queue, task}``   counters, one per event: ``enqueued``,
                                                ``started``, ``succeeded``, ``failed``,
                                                ``retried``, ``dead``, ``snoozed``,
                                                ``cancelled``
``sqla_jobs_job_run_seconds{queue, task,``      histogram: how long handlers ran, by
  ``outcome}``                                  ``outcome`` (``succeeded``, ``failed``,
                                                ``snoozed``, ``cancelled``)
``sqla_jobs_job_wait_seconds{queue, task}``     histogram: queue wait, from when a job was
                                                due (``run_at``) to its start
``sqla_jobs_queue_ready_jobs{queue}``           gauge: jobs ready now (with ``engine``)
``sqla_jobs_queue_oldest_ready_seconds{queue}`` gauge: how long the oldest ready job has
                                                been due (with ``engine``)
``sqla_jobs_queue_stats_up``                    gauge: 1 if the queue gauges were read at
                                                this scrape, 0 if the database failed
``sqla_jobs_worker_slots{worker}``,             gauges: concurrency, and handlers running,
``sqla_jobs_worker_slots_busy{worker}``         of each worker given to :meth:`track`
=============================================== ==========================================

Sharded (:mod:`sqla_jobs.sharding`): ``engines={"eu": ..., "us": ...}`` reads the queue
gauges of every shard, each with a ``shard`` label (``queue_stats_up`` too); and
``labels={"shard": "eu"}`` adds constant labels to every series, for a process that serves
one shard (``sqla-jobs worker --shard ... --metrics-port``), whose counters would otherwise
be indistinguishable from another shard's process once scraped together.

How it is built
---------------
* The counters and histograms are listeners of the registry's events
  (:mod:`sqla_jobs.events`): per registry, never global, in whichever process the events
  happen. ``enqueued`` happens in the process that enqueues (your web application), the
  others in the workers: export from both.
* The queue gauges are one aggregate statement (``Queries.ready_depth``, an index-only
  scan of the claim index), run when the endpoint is scraped, never per job. Every worker
  process exports the same values: aggregate them with ``max by (queue)``, not ``sum``.
* A worker's slots are read from its core when scraped. Workers given to :meth:`track`
  are held weakly: a worker that is gone stops being reported.

The counters take the labels of each job from a small cache, so a run costs a dictionary
lookup and four updates, not four label lookups.

Two registries in one process
-----------------------------
Metric names are fixed by ``namespace``, so two :class:`JobMetrics` cannot share one
``CollectorRegistry`` under the same namespace (prometheus_client refuses the second).
For two jobs tables in one process, give the second one ``namespace="other_jobs"`` (or a
``CollectorRegistry`` of its own, served on its own port).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .errors import describe, missing_extra

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(missing_extra(__name__, "prometheus-client", "metrics")) from exc

from .db import create_engine
from .events import EVENTS, JobEvent

if TYPE_CHECKING:
    from .tasks import Jobs

__all__ = ["RUN_BUCKETS", "WAIT_BUCKETS", "JobMetrics"]

log = logging.getLogger("sqla_jobs.metrics")

#: Seconds. Jobs run from milliseconds (a webhook) to an hour (a report).
RUN_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600,
)  # fmt: skip
#: Seconds. An idle queue starts jobs within a millisecond or two; a backlog, much later.
WAIT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600,
)  # fmt: skip

#: Outcome label of the run histogram, per event.
_RUN_OUTCOMES = {
    "succeeded": "succeeded",
    "failed": "failed",
    "snoozed": "snoozed",
    "cancelled": "cancelled",
}


@dataclass(frozen=True, slots=True)
class _Children:
    """The labelled series of one (queue, task): what one event updates."""

    counters: dict[str, Any]
    runs: dict[str, Any]
    wait: Any


class JobMetrics:
    """Prometheus metrics of one :class:`~sqla_jobs.Jobs` registry.

    :param jobs: the registry whose events are counted.
    :param registry: the ``CollectorRegistry`` to register on (default: prometheus_client's
        default registry, the one ``start_http_server`` serves by default).
    :param engine: an engine (or URL) to read the queue gauges with; without it there are
        none. A synchronous engine: scrapes are served from a thread (for the asyncio
        worker, pass the URL and a small engine of its own is made).
    :param namespace: the prefix of every metric name.
    :param engines: instead of ``engine``, the shards' engines (or URLs) by name
        (:mod:`sqla_jobs.sharding`): the queue gauges of each, labelled ``shard``.
    :param labels: constant labels given to every series (``{"shard": "eu"}`` in a worker
        process that serves one shard), so that the counters of processes that serve
        different shards stay apart.
    """

    def __init__(
        self,
        jobs: Jobs,
        *,
        registry: CollectorRegistry | None = None,
        engine: sa.Engine | str | sa.URL | None = None,
        namespace: str = "sqla_jobs",
        run_buckets: Sequence[float] = RUN_BUCKETS,
        wait_buckets: Sequence[float] = WAIT_BUCKETS,
        engines: Mapping[str, sa.Engine | str | sa.URL] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        if engine is not None and engines is not None:
            raise ValueError("give engine= or engines=, not both")
        self.jobs = jobs
        self.registry = registry if registry is not None else REGISTRY
        self.namespace = namespace
        self._const = dict(labels or {})
        if engines is not None and "shard" in self._const:
            raise ValueError("engines= labels the queue gauges with 'shard': not in labels=")
        self._own_engine = engine is not None and not isinstance(engine, sa.Engine)
        self.engine: sa.Engine | None = _engine(engine)
        #: The engines the queue gauges are read from: by shard, or ``{None: engine}``.
        self.engines: dict[str | None, sa.Engine] = {}
        self._owned: list[sa.Engine] = []
        if self.engine is not None:
            self.engines[None] = self.engine
            if self._own_engine:
                self._owned.append(self.engine)
        for shard, bind in (engines or {}).items():
            shard_engine = _engine(bind)
            assert shard_engine is not None
            self.engines[shard] = shard_engine
            if shard_engine is not bind:
                self._owned.append(shard_engine)
        self._workers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], _Children] = {}
        self._const_values = tuple(self._const.values())
        names = (*self._const, "queue", "task")
        made: list[Any] = []
        try:
            self._counters = {}
            for name in EVENTS:
                counter = Counter(
                    f"jobs_{name}",
                    f"Jobs {name} (events of sqla_jobs.events)",
                    names,
                    namespace=namespace,
                    registry=self.registry,
                )
                made.append(counter)
                self._counters[name] = counter
            self._run = Histogram(
                "job_run_seconds",
                "Seconds a handler ran, by how the run ended",
                (*names, "outcome"),
                namespace=namespace,
                registry=self.registry,
                buckets=run_buckets,
            )
            made.append(self._run)
            self._wait = Histogram(
                "job_wait_seconds",
                "Seconds from when a job was due (run_at) to when its handler started",
                names,
                namespace=namespace,
                registry=self.registry,
                buckets=wait_buckets,
            )
            made.append(self._wait)
            self._collector = _Gauges(self)
            self.registry.register(self._collector)
            made.append(self._collector)
        except ValueError as exc:  # a second JobMetrics with the same names
            for item in made:
                self.registry.unregister(item)
            raise ValueError(
                f"metrics named {namespace}_* are already registered on this "
                f"CollectorRegistry ({exc}); give this JobMetrics another namespace= or "
                "registry="
            ) from None
        self._collectors = made
        self._listeners = [(name, getattr(self, f"_on_{name}")) for name in EVENTS]
        for name, listener in self._listeners:
            jobs.events.connect(name, listener)

    def __repr__(self) -> str:
        return f"<JobMetrics {self.namespace}_* of {self.jobs!r}>"

    @classmethod
    def attached(cls, jobs: Jobs) -> JobMetrics | None:
        """The JobMetrics already counting this registry's events, if any (the command line
        uses it rather than making a second one when the application made its own)."""
        for listener in jobs.events.listeners("started"):
            owner = getattr(listener, "__self__", None)
            if isinstance(owner, cls):
                return owner
        return None

    def track(self, worker: Any) -> None:
        """Report this worker's slots (``Worker`` or ``AsyncWorker``) while it lives."""
        self._workers.add(worker)

    def close(self) -> None:
        """Stop counting and unregister every metric (tests, reloads)."""
        for name, listener in self._listeners:
            self.jobs.events.disconnect(name, listener)
        self._listeners = []
        for item in self._collectors:
            self.registry.unregister(item)
        self._collectors = []
        for engine in self._owned:
            engine.dispose()

    # -- listeners ---------------------------------------------------------------------

    def _children(self, job: Any) -> _Children:
        # A ClaimedJob, an enqueued Job object, or an enqueue_many row (a dict).
        key = (job["queue"], job["task"]) if isinstance(job, dict) else (job.queue, job.task)
        found = self._cache.get(key)
        if found is None:
            with self._lock:
                found = self._cache.get(key)
                if found is None:
                    full = (*self._const_values, *key)
                    found = self._cache[key] = _Children(
                        {name: c.labels(*full) for name, c in self._counters.items()},
                        {o: self._run.labels(*full, o) for o in _RUN_OUTCOMES.values()},
                        self._wait.labels(*full),
                    )
        return found

    def _count(self, event: JobEvent) -> _Children:
        children = self._children(event.job)
        children.counters[event.name].inc()
        return children

    def _observe_run(self, event: JobEvent) -> None:
        children = self._count(event)
        if event.duration is not None:
            children.runs[_RUN_OUTCOMES[event.name]].observe(event.duration)

    def _on_started(self, event: JobEvent) -> None:
        children = self._count(event)
        due = event.job.run_at.timestamp()
        children.wait.observe(max(0.0, time.time() - due))

    _on_enqueued = _count
    _on_retried = _count
    _on_dead = _count
    _on_succeeded = _observe_run
    _on_failed = _observe_run
    _on_snoozed = _observe_run
    _on_cancelled = _observe_run


class _Gauges(Collector):
    """The gauges read when scraped: queue depth (one statement) and busy slots."""

    def __init__(self, metrics: JobMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        # Names only: without describe(), registering would run collect(), statement and all.
        return list(self._families())

    def _families(self) -> Iterator[GaugeMetricFamily]:
        metrics = self.metrics
        ns = metrics.namespace
        const = list(metrics._const)
        # Queue gauges per shard when read from several; one set otherwise.
        shard = ["shard"] if None not in metrics.engines and metrics.engines else []
        yield GaugeMetricFamily(
            f"{ns}_queue_ready_jobs", "Jobs ready now", labels=[*const, *shard, "queue"]
        )
        yield GaugeMetricFamily(
            f"{ns}_queue_oldest_ready_seconds",
            "Seconds the oldest ready job of the queue has been due",
            labels=[*const, *shard, "queue"],
        )
        yield GaugeMetricFamily(
            f"{ns}_queue_stats_up",
            "1 if the queue gauges could be read at this scrape",
            labels=[*const, *shard],
        )
        yield GaugeMetricFamily(
            f"{ns}_worker_slots",
            "Handlers the worker may run at once",
            labels=[*const, "worker"],
        )
        yield GaugeMetricFamily(
            f"{ns}_worker_slots_busy", "Handlers the worker is running", labels=[*const, "worker"]
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ready, oldest, up, slots, busy = self._families()
        metrics = self.metrics
        const = list(metrics._const_values)
        read = False
        for name, engine in metrics.engines.items():
            at = [*const] if name is None else [*const, name]
            try:
                with engine.connect() as conn:
                    conn.execute(_BOUNDED)
                    rows = conn.execute(metrics.jobs.queries.ready_depth).all()
            except sa.exc.SQLAlchemyError as exc:
                # A scrape must not fail because the database does: say so, in one line.
                where = "" if name is None else f" of shard {name}"
                log.warning("metrics: could not read the queue gauges%s: %s", where, describe(exc))
                up.add_metric(at, 0)
            else:
                read = True
                up.add_metric(at, 1)
                for row in rows:
                    ready.add_metric([*at, row.queue], row.ready)
                    oldest.add_metric([*at, row.queue], row.age)
        if read:
            yield ready
            yield oldest
        if metrics.engines:
            yield up
        for worker in list(metrics._workers):
            core = worker.core
            slots.add_metric([*const, core.name], core.settings.concurrency)
            busy.add_metric([*const, core.name], core.busy)
        yield slots
        yield busy


#: How long a scrape waits for a lock on the jobs table, and for its statement: below
#: Prometheus' default scrape timeout (10 s). Unbounded, a migration's lock held every
#: scrape (and a pooled connection, and a thread of the exporter, or of the application
#: serving /metrics) for as long as it lasted, and the scrape failed on Prometheus' side,
#: every series of the process with it, rather than as ``queue_stats_up 0``. Local to the
#: scrape's transaction, so nothing stays on a pooled connection of the application's.
_BOUNDED = sa.select(
    sa.func.set_config("lock_timeout", "2s", True),
    sa.func.set_config("statement_timeout", "5s", True),
)


def _engine(engine: sa.Engine | str | sa.URL | None) -> sa.Engine | None:
    if engine is None or isinstance(engine, sa.Engine):
        return engine
    url = sa.make_url(engine)
    # An asyncio URL names psycopg's async driver; scrapes run in a plain thread. A scrape
    # that finds both connections in use (scrapes held up by the database) waits 5 s.
    return create_engine(
        url.set(drivername="postgresql+psycopg"), pool_size=1, max_overflow=1, pool_timeout=5
    )

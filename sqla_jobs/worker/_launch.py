"""How ``sqla-jobs worker`` runs: one plan for processes, shards, asyncio, until-empty,
and the metrics and health endpoints.

The command line parses its flags, loads the registry and the engines, and makes a
:class:`LaunchPlan`; the plan says what runs where, and :meth:`LaunchPlan.run` runs it:

* one database, one process: a :class:`~sqla_jobs.Worker` (or, ``asyncio``, an
  :class:`~sqla_jobs.worker.AsyncWorker` on its own event loop), until signalled or,
  ``until_empty``, until no job is ready;
* ``processes`` > 1, or shards (without ``one_process``): a supervisor
  (:mod:`.supervisor`) runs that many children, each a plain ``sqla-jobs worker`` of one
  database (:meth:`LaunchPlan.child_argv`), and restarts one that dies; child ``i`` of a
  sharded plan serves shard ``i mod len(shards)``, and every child serves its endpoints
  on the port given plus ``i``;
* shards with ``one_process`` (or ``until_empty``): every shard's worker in this process,
  a :class:`~sqla_jobs.sharding.ShardedWorker` (threads) or an ``AsyncShardedWorker``.

Which flags do not mix is decided here too (:class:`LaunchError`), so that a plan that
exists can run. The extras (asyncio, metrics) are imported only when a plan uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from .. import sharding
from ..db import create_async_engine
from ..health import Schema, serve_health
from ..sharding import ShardedWorker
from ._driver import pool_options
from ._signals import EarlyStop
from .supervisor import supervise, watch_supervisor
from .threaded import Worker

if TYPE_CHECKING:
    from ..tasks import Jobs
    from .settings import WorkerSettings

__all__ = ["EndpointError", "LaunchError", "LaunchPlan"]

T = TypeVar("T")

#: ``(host, port)`` of an endpoint (``port`` 0: any free port).
Address = tuple[str, int]


class LaunchError(ValueError):
    """The plan's flags do not mix (a usage error)."""


class EndpointError(Exception):
    """An endpoint could not listen on its address (the port is taken, say)."""


def _is_url(bind: Any) -> bool:
    return isinstance(bind, (str, sa.URL))


@dataclass(frozen=True)
class LaunchPlan:
    """What ``sqla-jobs worker`` runs, built from its arguments and checked at once.

    :param jobs: the registry.
    :param registry: its import path (``module:attr``), handed on to children.
    :param settings: the worker's settings.
    :param bind: one database: an engine (the application's, or made from the URL) or,
        for the asyncio worker without ``--engine``, the URL (its engine is made on its
        own event loop). None with ``shards``.
    :param shards: shard name to engine or URL, one worker per shard.
    """

    jobs: Jobs
    registry: str
    settings: WorkerSettings
    bind: Any = None
    shards: Mapping[str, Any] | None = None
    processes: int = 1
    asyncio: bool = False
    until_empty: bool = False
    #: With shards: every shard's worker in this process (the CLI refuses it without).
    one_process: bool = False
    metrics_at: Address | None = None
    health_at: Address | None = None
    #: Handed on to every child: ``-v`` this many times.
    verbose: int = 0
    #: Handed on to the children of one database (``--database-url``), if given.
    database_url: str | None = None
    #: The logging flags, handed on to the children.
    log_argv: Sequence[str] = field(default=())
    #: ``--engine MODULE:ATTR``, handed on to the children (each loads its own).
    engine_path: str | None = None
    #: Stop signals that arrive while the endpoints start, before the worker's own handlers.
    _early: EarlyStop = field(default_factory=EarlyStop, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.shards is None:
            if self.processes > 1 and self.until_empty:
                raise LaunchError(
                    "--until-empty and --processes do not mix: a supervisor "
                    "restarts the workers that stop"
                )
        elif self.in_process and self.processes > 1:
            flag = "--until-empty" if self.until_empty else "--one-process"
            raise LaunchError(f"{flag} and --processes do not mix: one process serves all")

    @property
    def in_process(self) -> bool:
        """Whether the workers run in this process (else a supervisor runs children)."""
        if self.shards is None:
            return self.processes <= 1
        return self.until_empty or self.one_process

    @property
    def children(self) -> int:
        """How many children the supervisor runs (0: none, the workers run here)."""
        if self.in_process:
            return 0
        return self.processes * (len(self.shards) if self.shards is not None else 1)

    # -- children ----------------------------------------------------------------------

    def child_argv(self, index: int) -> list[str]:
        """The ``sqla-jobs`` arguments of child ``index`` (the same for its restarts)."""
        return [*self._common_argv(), *self._own_argv(index)]

    def _common_argv(self) -> list[str]:
        """What every child gets: the same command, settings and logging."""
        argv = ["-v"] * self.verbose
        if self.shards is None:
            if self.database_url:
                argv += ["--database-url", self.database_url]
            argv += ["worker", self.registry, *self.settings.to_argv(), *self.log_argv]
            argv += self._engine_argv()
        else:
            # The settings carry --name: each child's worker is named NAME@shard.
            argv += ["worker", self.registry, *self.settings.to_argv(), *self.log_argv]
            argv.append("--one-process")
        if self.asyncio:
            argv.append("--asyncio")
        return argv

    def _own_argv(self, index: int) -> list[str]:
        """Child ``index``'s own: its shard, and its endpoints on the port given plus
        ``index``."""
        own: list[str] = []
        if self.shards is not None:
            names = list(self.shards)
            name = names[index % len(names)]
            bind = self.shards[name]
            own += (
                [*self._engine_argv(), "--engine-shard", name]
                if not _is_url(bind)
                else [
                    "--shard",
                    f"{name}={bind}",
                ]
            )
        for flag, at in (("--metrics-port", self.metrics_at), ("--health-port", self.health_at)):
            if at is not None:
                host, port = at
                own += [flag, f"{host}:{port + index if port else 0}"]
        return own

    def _engine_argv(self) -> list[str]:
        return ["--engine", self.engine_path] if self.engine_path else []

    # -- running -----------------------------------------------------------------------

    def run(self, *, schema_drift: Schema = None) -> int:
        """Run the plan until it is done (signalled, or empty); the exit code.

        ``schema_drift`` is what the schema check found (or will find), for ``/healthz``.

        :raises ~sqla_jobs.errors.WorkerError: a worker stopped because a duty kept failing.
        :raises EndpointError: an endpoint could not listen.
        """
        if not self.in_process:
            return supervise(
                self._common_argv(),
                self.children,
                grace_period=self.settings.grace_period,
                child_args=self._own_argv,
            )
        with self._early.installed(), watch_supervisor():
            self._run_here(schema_drift)
        return 0

    def _run_here(self, schema_drift: Schema) -> None:
        """The worker of this process, with its endpoints."""
        if self.shards is not None:
            if self.asyncio:
                self._run_async_sharded(self.shards, schema_drift)
            else:
                worker = ShardedWorker(self.jobs, self.shards, self.settings)
                self._early.attach(worker)
                with self._endpoints(worker, shards=self.shards, schema_drift=schema_drift):
                    if self.until_empty:
                        worker.run_until_empty()
                    else:
                        worker.run()
        elif self.asyncio:
            self._run_async_worker(self.bind, schema_drift)
        else:
            one = Worker(self.jobs, self.bind, self.settings)
            self._early.attach(one)
            with self._endpoints(one, self.bind, schema_drift=schema_drift):
                if self.until_empty:
                    one.run_until_empty()
                else:
                    one.run()

    def _run_async_worker(self, bind: Any, schema_drift: Schema) -> None:
        """The asyncio worker on the application's ``AsyncEngine``, or on one made from the
        URL ``bind`` on this loop. (The metrics' engine is made from the URL either way: an
        ``AsyncEngine`` cannot serve the exporter's thread.)"""
        from .aio import AsyncWorker  # the extra: SQLAlchemy's asyncio support (greenlet)

        async def main() -> None:
            engine = (
                create_async_engine(bind, **pool_options(self.settings.concurrency))
                if _is_url(bind)
                else bind
            )
            try:
                worker = AsyncWorker(self.jobs, engine, self.settings)
                self._early.attach(worker)
                url = bind if _is_url(bind) else engine.url
                with self._endpoints(worker, url, schema_drift=schema_drift):
                    if self.until_empty:
                        await worker.run_until_empty()
                    else:
                        await worker.run()
            finally:
                await engine.dispose()

        asyncio.run(main())

    def _run_async_sharded(self, shards: Mapping[str, Any], schema_drift: Schema) -> None:
        async def main() -> None:
            # Made from the URLs: each shard's engine is made, and disposed of, by its
            # worker; the application's own engines are disposed of here (their
            # connections belong to this loop).
            # Defined only with the extra (SQLAlchemy's asyncio support, greenlet): looked
            # up when called.
            worker = sharding.AsyncShardedWorker(self.jobs, dict(shards), self.settings)
            self._early.attach(worker)
            try:
                with self._endpoints(worker, shards=shards, schema_drift=schema_drift):
                    if self.until_empty:
                        await worker.run_until_empty()
                    else:
                        await worker.run()
            finally:
                for bind in shards.values():
                    if not _is_url(bind):
                        await bind.dispose()

        asyncio.run(main())

    @contextlib.contextmanager
    def _endpoints(
        self,
        worker: Any,
        engine: sa.Engine | sa.URL | str | None = None,
        *,
        shards: Mapping[str, Any] | None = None,
        schema_drift: Schema = None,
    ) -> Iterator[None]:
        """Serve the metrics and health endpoints while the worker runs.

        For a sharded worker (``shards``): the health of every shard; the queue gauges of
        every shard, labelled ``shard``, and when the process serves one shard (a child of
        the supervisor), every series labelled with it, so that processes of different
        shards scraped together stay apart."""
        closers: list[Callable[[], None]] = []
        try:
            metrics_at = self.metrics_at
            if metrics_at is not None:
                # The extra: prometheus-client.
                from prometheus_client import start_http_server

                from ..metrics import JobMetrics

                # The application may have made its own (to count in its web processes
                # too): then that one, and its CollectorRegistry, are served.
                metrics = JobMetrics.attached(self.jobs)
                if metrics is None:
                    where: dict[str, Any] = {"engine": engine}
                    # The gauges are read from the exporter's thread: an application's
                    # AsyncEngine is read through an engine made from its URL.
                    binds = {
                        n: getattr(b, "url", b) if hasattr(b, "sync_engine") else b
                        for n, b in (shards or {}).items()
                    }
                    if len(binds) == 1:
                        [(name, bind)] = binds.items()
                        where = {"engine": bind, "labels": {"shard": name}}
                    elif binds:
                        where = {"engines": binds}
                    metrics = JobMetrics(self.jobs, **where)
                    closers.append(metrics.close)
                for each in [worker] if shards is None else worker.workers.values():
                    metrics.track(each)
                host, port = metrics_at
                registry = metrics.registry
                server, _ = _listening(
                    "--metrics-port", metrics_at, lambda: start_http_server(port, host, registry)
                )
                closers += [server.shutdown, server.server_close]
            health_at = self.health_at
            if health_at is not None:
                at = health_at
                health = _listening(
                    "--health-port",
                    at,
                    lambda: serve_health(worker, at[1], at[0], schema=schema_drift),
                )
                closers.append(health.close)
            yield
        finally:
            for close in reversed(closers):
                with contextlib.suppress(Exception):
                    close()


def _listening(flag: str, at: Address, start: Callable[[], T]) -> T:
    try:
        return start()
    except OSError as exc:
        raise EndpointError(f"{flag} {at[0]}:{at[1]}: {exc.strerror or exc}") from None

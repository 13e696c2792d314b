"""A worker's health, over HTTP: ``sqla-jobs worker ... --health-port 8080``.

.. code-block:: python

    from sqla_jobs.health import serve_health

    server = serve_health(worker, 8080)       # GET /healthz: 200 or 503, and a JSON body
    worker.run()
    server.close()

What counts as healthy is decided by the worker's core
(:meth:`~sqla_jobs.worker._core.WorkerCore.health`): the run is on, no loop (fetch loop,
completer, heartbeat, listener) has been stuck on one step for longer than the step allows
plus ``stuck_after``, and outcomes do not wait for a write while the database answers.
This server only reports it, from a thread of its own (the standard library's
``http.server``; no dependency), so it answers even while the worker's own threads or its
event loop are stuck, which is the point of a liveness probe.

The body is the report as JSON::

    {"healthy": false, "state": "running", "worker": "web-1:4242:a1b2c3",
     "problems": ["fetch loop stuck: waiting on Io claim for 75.2s"],
     "loops": {"fetch loop": {"waiting_on": "Io claim", "seconds": 75.2}, ...},
     "running": 3, "concurrency": 16, "unwritten_outcomes": 0, "database": "ok",
     "schema": "ok"}

``schema`` is there when ``sqla-jobs worker`` checks the schema: ``"ok"``, or the
differences it found that let the worker start (a missing index, another storage
parameter, the trigger; see ``sqla-jobs check``), or ``"checking"`` in the second after
start before the comparison has run (a missing table or column is refused at start).

An HTTP endpoint rather than a file that a probe script compares timestamps of: a
Kubernetes ``httpGet`` probe (or ``curl -f`` in a Docker ``HEALTHCHECK``) reads it as is, and
the body says why.

For a worker of several shards (:mod:`sqla_jobs.sharding`) the body is the report of each
shard under ``shards``, with ``unhealthy`` and ``unreachable`` naming shards, and the
status is 503 when any shard's worker is unhealthy.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["HealthServer", "serve_health"]

#: What ``/healthz`` says of the schema: the differences found (``[]``: "ok"), or a callable
#: that returns them, None while the comparison has not run; None: nothing (no check).
Schema = Sequence[str] | Callable[[], Sequence[str] | None] | None

PATHS = ("/healthz", "/livez", "/")


class HealthServer:
    """Serves ``GET /healthz`` for one worker, from a daemon thread."""

    def __init__(
        self,
        worker: Any,
        port: int = 0,
        host: str = "0.0.0.0",
        *,
        schema: Schema = None,
    ) -> None:
        read = _with_schema(_reader(worker), schema)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in PATHS:
                    self.send_error(404)
                    return
                report = read()
                body = json.dumps(report).encode()
                self.send_response(200 if report["healthy"] else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not news

        server_class = _Server6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="sqla-jobs-health", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (useful with ``port=0``)."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def serve_health(
    worker: Any, port: int, host: str = "0.0.0.0", *, schema: Schema = None
) -> HealthServer:
    """Start serving ``/healthz`` for ``worker``: a ``Worker`` or an ``AsyncWorker``, or a
    :class:`~sqla_jobs.sharding.ShardedWorker` or ``AsyncShardedWorker`` (every shard on
    one port: see their ``health()``).

    ``schema``: what the schema check found different in the database (see
    :mod:`alembic_ext.check`), shown as the body's ``"schema"`` (``"ok"``, or the list);
    or a callable that returns it, or None while the check has not run (``"checking"``).
    It does not make the worker unhealthy: a worker that started can run its statements
    (a missing table or column stops it at start), and a restart would not change the
    schema; the body says what to fix."""
    return HealthServer(worker, port, host, schema=schema)


def _with_schema(
    read: Callable[[], dict[str, Any]], schema: Schema
) -> Callable[[], dict[str, Any]]:
    """The report, with the schema check's result when there is one."""
    if schema is None:
        return read
    if callable(schema):
        later = schema

        def with_later() -> dict[str, Any]:
            found = later()
            return {**read(), "schema": "checking" if found is None else list(found) or "ok"}

        return with_later
    found: str | list[str] = list(schema) or "ok"
    return lambda: {**read(), "schema": found}


def _reader(worker: Any) -> Callable[[], dict[str, Any]]:
    """What a probe reads: one worker's report, or a sharded worker's report of all its
    shards (which says which of them is unhealthy)."""
    core = getattr(worker, "core", None)
    if core is not None:
        return lambda: core.health().to_dict()
    report: Callable[[], dict[str, Any]] = worker.health
    return report

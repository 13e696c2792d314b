"""Celery's side of ``benchmarks/peers.py``: its app and two tasks, in a module of their own.

The ``celery worker`` process imports only this (``-A peers_celery``), and the sqla-jobs
worker process only ``peers``, so neither pays for importing the other's library at
start-up, which the drain row times.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from celery import Celery

QUEUE = "sqla_jobs_peers"
#: Incremented by each drained job: how the benchmark sees the end of a Celery drain.
COUNTER = "sqla_jobs_peers:done"

app = Celery("peers_celery", broker=os.environ.get("PEERS_REDIS", "redis://127.0.0.1:6379/15"))
app.conf.update(
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
)

_redis: Any = None
_udp: socket.socket | None = None


@app.task(name="peers.celery_noop")
def noop(i: int) -> None:
    """The drained job: counts itself, so the benchmark sees the drain end."""
    global _redis
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(app.conf.broker_url)
    _redis.incr(COUNTER)


@app.task(name="peers.celery_ping")
def ping(n: int) -> None:
    """An idle-pickup sample: ``n`` and the moment the handler started, to the producer
    (the same message as ``peers.started`` sends)."""
    global _udp
    now = time.perf_counter()
    if _udp is None:
        _udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    _udp.sendto(f"{n} {now!r}".encode(), ("127.0.0.1", int(os.environ["PEERS_UDP_PORT"])))

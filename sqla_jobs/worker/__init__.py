"""The worker: claim jobs, run their handlers, record how they ended, stay out of the way.

.. code-block:: python

    from sqla_jobs import Worker, WorkerSettings

    worker = Worker(jobs, engine, queues=["previews", "webhooks"], concurrency=16)
    worker.run()              # until SIGINT/SIGTERM or worker.stop()
    worker.run_until_empty()  # tests and scripts: until no ready job is left

    from sqla_jobs.worker import AsyncWorker       # the same on asyncio
    await AsyncWorker(jobs, async_engine, concurrency=200).run()

How it is built
---------------
* :mod:`.settings`: :class:`WorkerSettings`, the one place where settings live.
* :mod:`.core`: every decision, once, without I/O: what to claim and when, slots, lost
  claims, timeouts, retries after database errors, the shutdown policy, the supervision
  of side duties. Its loops yield steps for a driver to carry out.
* :mod:`.hearing`: whether the listener hears the notifications it should (it does not
  behind a pooler in transaction mode), judged from the claims the core makes anyway.
* :mod:`.statements`: the statement I/O, as functions of a plain ``Connection``.
* :mod:`.threaded` (:class:`Worker`) and :mod:`.aio` (:class:`AsyncWorker`): the two
  drivers. Each keeps only how it waits, how it runs a handler and how it stops.
* :mod:`.job`: a claimed job, how a run ends (:class:`Outcome`), :func:`current_job`.
* :mod:`.supervisor`: several worker processes (``sqla-jobs worker --processes N``).

Delivery is at least once: a worker that dies mid-job (or before its batched completion
reaches the database) loses its lease, and the job runs again. Handlers must be safe to
repeat. Transactional tasks get exactly-once database effects.
"""

from __future__ import annotations

from typing import Any

from .job import CANCEL_PAYLOAD, ClaimedJob, Outcome, OutcomeKind, current_job
from .settings import WorkerSettings
from .threaded import Worker

__all__ = [
    "CANCEL_PAYLOAD",
    "AsyncWorker",
    "ClaimedJob",
    "Outcome",
    "OutcomeKind",
    "Worker",
    "WorkerSettings",
    "current_job",
]


def __getattr__(name: str) -> Any:
    # The asyncio worker needs SQLAlchemy's asyncio support (greenlet): imported on demand.
    if name == "AsyncWorker":
        from .aio import AsyncWorker

        return AsyncWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

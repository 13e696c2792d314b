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
From the bottom up: a module imports only those above it in this list, and modules of the
package below the worker (``errors``, ``queries``, ``tasks``, ``periodic``, ``db``,
``_settle``; the threaded driver takes ``insert_pending`` from ``session``). Only
:mod:`._launch`, which the CLI alone imports, reaches up, to ``sharding``, ``health`` and
``metrics``.

* :mod:`.settings`: :class:`WorkerSettings`, the one place where settings live.
* :mod:`.job`: a claimed job, how a run ends (:class:`Outcome`), :func:`current_job`.
* :mod:`._statements`: the statement I/O, as functions of a plain ``Connection``.
* :mod:`._steps`: the vocabulary of steps the core yields and a driver carries out.
* :mod:`._outage`: which errors are the database's, and how long to wait them out.
* :mod:`._hearing`: whether the listener hears the notifications it should (it does not
  behind a pooler in transaction mode), judged from the claims the core makes anyway.
* :mod:`._fetch` and :mod:`._duties`: the fetch loop (claim order, dry queues, claim-ahead,
  limited claims) and the side duties (completer, heartbeat, presence, listener,
  maintenance), one small class each over the core's shared state.
* :mod:`._supervise` (duties restarted or the worker stopped) and :mod:`._vitals` (health).
* :mod:`._core`: the shared state, the slots, the start and end of a run, ``run()``. It
  does no I/O: its loops yield steps for a driver to carry out.
* :mod:`._signals`: SIGINT and SIGTERM stop a worker, one handler for every kind.
* :mod:`._driver`, then :mod:`.threaded` (:class:`Worker`) and :mod:`.aio`
  (:class:`AsyncWorker`): the two drivers. Each keeps only how it waits, how it runs a
  handler and how it stops.
* :mod:`.supervisor`: several worker processes (``sqla-jobs worker --processes N``).
* :mod:`._launch`: what ``sqla-jobs worker`` runs (processes, shards, asyncio,
  until-empty, endpoints), as one plan.

The design, and why: ``docs/design/worker.md``.

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

"""The side duties a worker runs beside its fetch loop, one small class each.

Each holds the state only it needs and works on the shared state of its
:class:`~sqla_jobs.worker._core.WorkerCore` (the running set, the slots, the lock). Each
has a ``run_once()`` that yields steps for a driver and returns whether to run again;
the core's supervisor (:mod:`.._supervise`) runs it again and again, and restarts it after
a failure.

* :mod:`.completer`: writes the outcomes of finished runs, in batches.
* :mod:`.heartbeat`: enforces timeouts, extends leases, and stops lost claims.
* :mod:`.presence`: the worker's row in ``<table>_workers`` and its throughput counts.
* :mod:`.listener`: holds the LISTEN and wakes the fetch loop for its queues.
* :mod:`.maintenance`: the shared upkeep the fetch loop runs when due (refresh, rescue,
  retention); no loop of its own.
"""

from __future__ import annotations

from .completer import Completer
from .heartbeat import Heartbeat
from .listener import Listener
from .maintenance import Maintenance
from .presence import Presence

__all__ = ["Completer", "Heartbeat", "Listener", "Maintenance", "Presence"]

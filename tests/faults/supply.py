"""A steady supply of jobs, from a thread of the test process, through outages."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from sqla_jobs import JobSession, create_engine

from . import faults_app as app


class SteadyProducer:
    """Enqueue ``batch`` ``faults.work`` jobs every ``interval`` seconds, one transaction
    per batch, each job carrying ``enq=time.monotonic()`` (taken as the transaction
    starts) and a fresh item number. A transaction that fails (the server is down, the
    connection was cut) is retried after ``interval`` with new jobs.

    ``committed`` maps the id of every job whose COMMIT this producer saw succeed to its
    ``enq``; a commit whose answer was lost is not in it (the job may exist anyway).
    A new connection per transaction (``NullPool``): the producer's own reconnection must
    not be what a recovery measurement sees.
    """

    def __init__(
        self,
        url: str,
        *,
        batch: int,
        interval: float,
        sleep: float = 0.0,
        queue: str | None = None,
        first_item: int = 0,
    ) -> None:
        self.engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 2})
        self.batch = batch
        self.interval = interval
        self.sleep = sleep
        self.queue = queue
        self.committed: dict[int, float] = {}
        #: time.monotonic() of every successful commit.
        self.commits: list[float] = []
        self.failures = 0
        self.last_error: str | None = None
        self._items = itertools.count(first_item)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-producer", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            enq = time.monotonic()
            try:
                with JobSession(self.engine) as session:
                    kw: dict[str, Any] = {"queue": self.queue} if self.queue else {}
                    jobs = [
                        session.enqueue(
                            app.work, i=next(self._items), enq=enq, sleep=self.sleep, **kw
                        )
                        for _ in range(self.batch)
                    ]
                    session.flush()
                    ids = [j.id for j in jobs]
                    session.commit()
            except sa.exc.DBAPIError as exc:
                self.failures += 1
                self.last_error = str(exc.orig).strip()
            else:
                self.commits.append(time.monotonic())
                for job_id in ids:
                    self.committed[job_id] = enq
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - enq)))

    def first_commit_after(self, moment: float) -> float | None:
        return next((t for t in self.commits if t >= moment), None)

    def __enter__(self) -> SteadyProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.engine.dispose()

"""Presence: this worker's row in ``<table>_workers`` (what the dashboard and
``sqla-jobs stats`` show as alive), and its throughput counts in ``<table>_throughput``.

Every ``presence_interval`` the row is upserted with a time to live of
:data:`PRESENCE_MISSES` intervals, together with the outcomes written since the last
report; one report in :data:`TIDY_EVERY` also deletes the rows of workers long gone. A
database error only delays the report (the counts are kept for the next one). At the end
of a run the row is deleted (:meth:`Presence.leave`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from ..._queries import WorkerReport, WorkerSeenParams, interval
from ...errors import describe
from .. import _statements as statements
from .._outage import is_database_error
from .._steps import Conn, Duty, Io, Pause, Steps

if TYPE_CHECKING:
    from .._core import WorkerCore
    from .._statements import Tally

__all__ = ["PRESENCE_MISSES", "TIDY_EVERY", "Presence"]

log = logging.getLogger("sqla_jobs.worker")

#: A worker's row counts as alive for this many presence intervals after its last update.
PRESENCE_MISSES = 3

#: Every this many presence updates (about a minute at the default), one of them also
#: deletes the rows of workers long gone and throughput counts over a day old.
TIDY_EVERY = 12


class Presence(Duty):
    """The worker's row, and the counts it reports (kept from one run to the next until
    they are written)."""

    def __init__(self, core: WorkerCore) -> None:
        super().__init__(core)
        #: Outcomes written (or committed by transactional runs) and not yet added to
        #: <table>_throughput: {queue: [succeeded, failed, dead]}.
        self.tally: Tally = {}
        self.rounds = 0
        #: Whether the last report failed (only the first failure of a streak is logged).
        self.failing = False

    def count(self, tally: Tally | None) -> None:
        """Add written outcomes to what the next presence update reports."""
        if not tally:
            return
        with self.core._lock:
            for queue, (succeeded, failed, dead) in tally.items():
                counts = self.tally.setdefault(queue, [0, 0, 0])
                counts[0] += succeeded
                counts[1] += failed
                counts[2] += dead

    def take_tally(self) -> Tally:
        with self.core._lock:
            tally, self.tally = self.tally, {}
        return tally

    def row(self) -> WorkerSeenParams:
        """This worker's row of ``<table>_workers``, as of now."""
        core = self.core
        report = WorkerReport(
            name=core.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            kind=type(core.driver).__name__,
            queues=list(core.queues),
            concurrency=core.settings.concurrency,
            running=core.running,
            processed=core.processed,
        )
        return report.params(interval(core.settings.presence_interval * PRESENCE_MISSES))

    def run_once(self) -> Steps:
        """Say that this worker is alive (its row in ``<table>_workers``) and add the
        outcomes written since the last time to ``<table>_throughput``; then wait
        ``presence_interval``. Returns False once the worker is stopping (its row is
        deleted at the end of the run, see :meth:`leave`).

        A database error only delays the report: the counts are kept for the next one,
        and the first failure of a streak is logged (a missing table means migrations
        were not run; jobs still run, the dashboard just cannot see this worker).
        """
        core = self.core
        if core.stopping:
            return False
        self.rounds += 1
        tidy = self.rounds % TIDY_EVERY == 1
        tally = self.take_tally()
        try:
            yield Io(statements.worker_seen, (core.queries, self.row(), tally, tidy), Conn.TX)
        except Exception as exc:
            self.count(tally)
            if not is_database_error(exc):
                raise
            if not self.failing:
                core.db_warning(
                    exc,
                    "worker %s: could not record its presence (%s); the dashboard will not "
                    "show it until this works",
                    core.name,
                    describe(exc),
                )
            self.failing = True
        else:
            self.failing = False
        generation = core.generation
        yield Pause(core.settings.presence_interval)
        return not core.stopping and core.generation == generation

    def leave(self) -> Steps:
        """At the end of a run: add the last counts and delete this worker's row."""
        core = self.core
        tally = self.take_tally()
        try:
            yield Io(statements.worker_gone, (core.queries, core.name, tally), Conn.TX)
        except Exception as exc:
            if not is_database_error(exc):
                raise
            log.log(
                logging.DEBUG if self.failing else logging.WARNING,
                "worker %s: could not delete its presence row (%s); it expires by itself",
                core.name,
                describe(exc),
            )

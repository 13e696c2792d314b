"""The listener: holds a LISTEN connection and passes notifications on.

A notification names a queue that has new ready jobs (the fetch loop wakes only for its
own queues), or asks for a heartbeat now because a running job was cancelled. Whether the
LISTEN hears what it should is judged by :mod:`.._hearing` from the claims the fetch loop
makes anyway; a deaf LISTEN (behind a pooler in transaction mode) is said once and let go,
and the worker polls.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .._steps import Duty, Listen, Notifications, Steps
from ..job import CANCEL_PAYLOAD

if TYPE_CHECKING:
    from .._hearing import ListenWatch

__all__ = ["Listener"]

log = logging.getLogger("sqla_jobs.worker")


class Listener(Duty):
    """LISTEN, and what a notification means."""

    def reset(self) -> None:
        """A new run has not listened yet."""
        #: Whether this round got as far as its LISTEN (the supervisor then does not count
        #: a dropped connection as one more failure in a row).
        self.listened = False

    def run_once(self) -> Steps:
        """Hold a LISTEN connection and pass notifications on, until the worker stops or
        the connection fails (the supervisor then starts this again after a pause).

        A LISTEN that turns out to hear nothing (see :mod:`.._hearing`) is said once, and
        let go: the worker then polls, as with ``listen=False``."""
        core = self.core
        watch = core.listen_watch
        generation = core.generation
        try:
            yield Listen(core.queries.channel)
            if core.generation != generation:
                return False  # connected after its run ended: let go at once
            self.listened = True
            core.listening.set()
            watch.listening(time.monotonic())
            core.driver.wake()  # catch anything enqueued while we were not listening
            wanted = set(core.queues)
            fetcher = core.fetcher
            while not core.stopping and core.generation == generation:
                for payload in (yield Notifications(0.5)):
                    if payload in wanted:
                        now = time.monotonic()
                        with core._lock:
                            fetcher.heard(payload, now)
                        watch.heard(payload, now)
                        core.driver.wake()
                    elif payload == CANCEL_PAYLOAD:
                        core._poked = True
                        core.driver.poke()
                if watch.active and watch.judge(time.monotonic()) is False:
                    self.deaf(watch)
                    return False
            return False
        finally:
            # The supervisor has the driver close the connection (Unlisten) after each run.
            watch.stopped()
            core.listening.clear()

    def deaf(self, watch: ListenWatch) -> None:
        log.warning(
            "worker %s: its LISTEN hears nothing: jobs came into %s %d times in %.0fs with no "
            "notification; its connection goes through a pooler in transaction mode "
            "(PgBouncer) or a proxy that does not pass notifications. It stops listening and "
            "polls every %gs. Run it with --no-listen (listen=False), or give it a direct "
            "connection (or a PgBouncer pool in session mode) to pick jobs up within "
            "milliseconds; see the docs' PgBouncer section (https://github.com/sqla-jobs/sqla-jobs/blob/main/docs/operating/deploy.md#pgbouncer)",
            self.core.name,
            ", ".join(watch.missed_queues),
            watch.misses,
            max(0.0, time.monotonic() - watch.first_miss),
            self.core.settings.poll_interval,
        )

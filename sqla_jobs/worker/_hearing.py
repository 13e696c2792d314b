"""Noticing a LISTEN that hears nothing, from what the worker does anyway.

Behind a pooler in transaction mode (PgBouncer) or a proxy that drops notifications, the
listener's ``LISTEN`` succeeds and then nothing arrives: the worker still finds its jobs,
but only at its poll interval, and nothing says why pickup is slow. (Worse, the LISTEN
stays on a pooled server connection, which hands every notification to whichever client
it serves next.)

The sign costs no query. When a claim of a queue comes back short, the queue was empty
when that claim began. If a later claim of it finds jobs, something made them ready in
between, and everything that makes a job ready sends a NOTIFY naming its queue at its
commit, before a claim can see the job: the insert trigger, promotion of due jobs, rescue
of expired leases, release of children, a hand-back, a retry, a queue resumed, a debounce
replaced. So a listener that hears no notification naming that queue, from when the empty
claim began until :data:`GRACE` seconds after the find, missed one. :data:`MISSES` such
finds in a row, and no find that was announced, mean that the LISTEN is deaf; one
announced find means that it hears (and the watch ends). Limited queues are left out
(their claims are held back by their limits, not by an empty queue).

:class:`ListenWatch` only keeps the times; the worker core feeds it from the fetch loop
(``claimed``) and the listener (``listening``, ``heard``, ``judge``), and says what it
found once.
"""

from __future__ import annotations

import threading

__all__ = ["GRACE", "MISSES", "ListenWatch"]

#: Seconds a notification may trail the claim that found its jobs (it is sent at the
#: commit the claim saw, so it normally trails by a millisecond or two).
GRACE = 1.0
#: Finds in a row with no notification before the LISTEN counts as deaf.
MISSES = 3


class ListenWatch:
    """Whether the listener of one worker hears the notifications it should.

    ``active`` (a plain attribute: the fetch loop reads it at every claim) is true while a
    LISTEN is held and nothing is known yet. ``verdict`` is None until known, then True
    (it hears) or False (deaf); it is kept across LISTEN rounds, so that a worker says so
    once. The fetch loop and the listener may be threads: the times are kept under a lock.
    """

    def __init__(self) -> None:
        self.active = False
        self.verdict: bool | None = None
        self._lock = threading.Lock()
        self._since = 0.0
        #: queue -> when the last claim that found it empty began (after the LISTEN).
        self._empty: dict[str, float] = {}
        #: queue -> when a notification last named it.
        self._heard: dict[str, float] = {}
        #: (queue, empty since, found at): finds not yet judged.
        self._finds: list[tuple[str, float, float]] = []
        self.misses = 0
        #: The queues of the finds that missed their notification, and when the first was.
        self.missed_queues: list[str] = []
        self.first_miss = 0.0

    def listening(self, now: float) -> None:
        """A LISTEN is held from ``now``: what a claim found before says nothing about it."""
        with self._lock:
            self._since = now
            self._empty.clear()
            self._heard.clear()
            self._finds.clear()
            self.misses = 0
            self.missed_queues = []
            self.active = self.verdict is None

    def stopped(self) -> None:
        """The LISTEN was let go (its connection failed, or the worker stops)."""
        self.active = False

    def heard(self, queue: str, now: float) -> None:
        """A notification named ``queue``."""
        if self.active:
            with self._lock:
                self._heard[queue] = now

    def claimed(self, queue: str, began: float, got: int, wanted: int, now: float) -> None:
        """A claim of ``queue`` that began at ``began`` took ``got`` of ``wanted`` jobs."""
        with self._lock:
            if got:
                empty = self._empty.pop(queue, None)
                if empty is not None:
                    self._finds.append((queue, empty, now))
            if got < wanted and began >= self._since:
                self._empty[queue] = began

    def judge(self, now: float) -> bool | None:
        """Judge the finds old enough to be judged: True if one was announced (the LISTEN
        hears), False once :data:`MISSES` in a row were not (it is deaf; the caller says
        so), None while it cannot tell. Ends the watch once it can."""
        if not self.active:
            return None
        with self._lock:
            ripe = [f for f in self._finds if f[2] + GRACE <= now]
            if not ripe:
                return None
            self._finds = [f for f in self._finds if f[2] + GRACE > now]
            for queue, empty, found in ripe:
                if self._heard.get(queue, -1.0) > empty:
                    self.verdict, self.active = True, False
                    return True
                if not self.misses:
                    self.first_miss = found
                self.misses += 1
                if queue not in self.missed_queues:
                    self.missed_queues.append(queue)
            if self.misses < MISSES:
                return None
            self.verdict, self.active = False, False
            return False

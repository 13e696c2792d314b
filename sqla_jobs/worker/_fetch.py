"""The fetch loop: what to claim, from which queue, and how much.

Claims go out queue by queue in a rotating order (:meth:`Fetcher.claim_order`), so that
no queue always goes first. A queue whose last claim came back short is *dry* and skipped
until a NOTIFY names it or the next poll round; a limited queue (:mod:`sqla_jobs.throttle`)
is never dry, but *held* until its slot or its rate window frees. Each claim asks for the
free slots plus a claim-ahead estimated from how fast handlers finish and how long a claim
takes (:meth:`Fetcher.estimate_ahead`). Between rounds the loop sleeps until woken, or
until the maintenance (:mod:`._duties.maintenance`) is due.

Like the rest of the core, this does no I/O: it yields steps for a driver.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

from .._queries import (
    ClaimParams,
    LimitedClaimParams,
    claim_params,
    fair_claim_params,
    queue_claim_params,
)
from ..errors import answered, describe
from . import _statements as statements
from ._outage import is_database_error, lost_prepared_statement, retry_pause
from ._steps import Conn, Duty, Io, Pause, Sleep, Step, Steps, WaitWritten

if TYPE_CHECKING:
    from .job import Outcome

__all__ = ["FAIR_FLOOR_FOR", "LIMIT_RECHECK", "Fetcher"]

#: Seconds a worker waits before it claims again from a queue whose concurrency (or key)
#: limit was full, unless one of its own completions frees a slot first. Other workers'
#: completions are not announced; this bounds how late it notices them, at a cost of a
#: few cheap claims a second per worker.
LIMIT_RECHECK = 0.2

#: How many claims in a row a fair queue's claim may send while they find no job ready
#: among the keys they walk (each walks ``scan`` keys on from the last): see
#: ``Fetcher.claim_fair``.
KEY_WALK_ROUNDS = 16

#: Seconds a fair queue's claims read their busiest key from past the last job they took
#: (its floor) before one claim reads every key from its start again.
FAIR_FLOOR_FOR = 1.0


class KeyWalk:
    """Claims walking a queue's keys in turn (in order, wrapping round after the last one),
    from ``start`` on: :meth:`came_round` says, after each, whether they have seen every
    key, and keeps its place for the next."""

    def __init__(self, start: str | None) -> None:
        self.start = start
        #: Where the next claim walks from.
        self.cursor = start
        #: Whether a claim so far wrapped round past the last key.
        self.wrapped = False

    def came_round(self, last: str) -> bool:
        """The last claim walked from :attr:`cursor` to ``last``: whether the walk has
        come round. A claim that ends on the key it started after went all the way round
        by itself; otherwise the walk came round once it wrapped and reached ``start``
        again."""
        if last == self.cursor:
            return True
        wraps = self.cursor is not None and last < self.cursor
        if wraps and self.wrapped:
            # Past the last key a second time, so past ``start`` too: a walk that began
            # at the last key (or one ending just short of ``start``, then past it) never
            # ended on or after ``start`` once it had wrapped, and went round for ever.
            return True
        self.wrapped = self.wrapped or wraps
        if self.wrapped and (self.start is None or last >= self.start):
            return True
        self.cursor = last
        return False


class Fetcher(Duty):
    """The fetch loop over a worker's shared state (slots, the running set, the lock)."""

    def reset(self) -> None:
        """Fresh state for a new run."""
        #: Set by a claim that got as many jobs as asked: there may be more right now.
        self.more = False
        #: Limited queues not to claim from until a monotonic time: their limits held
        #: ready jobs back at the last claim.
        self.held: dict[str, float] = {}
        #: Those of them held by their rate (a completion does not end that wait).
        self.rate_held: set[str] = set()
        #: Those of them whose last claim found a rate or a key's rate holding jobs back:
        #: time frees them, whatever else holds them too (see held_for_good).
        self.time_held: set[str] = set()
        #: Queues in key order: the key where each one's last claim stopped walking.
        self.key_cursor: dict[str, str | None] = {}
        #: Queues whose claims walk their keys (key order, fair) and stopped, finding
        #: nothing, before the walk came round: the keys not seen yet may have jobs ready,
        #: so the queue is not empty (``run_until_empty`` claims on). A claim walks at most
        #: KEY_WALK_ROUNDS x 64 keys (64 when a limit may be full): beside 2,500 dead or
        #: held keys a run called the queue empty with a free key's jobs ready.
        self.walks: dict[str, KeyWalk] = {}
        #: Fair queues: the floor of the key the last claim took most from, and since when
        #: floors are used (dropped every FAIR_FLOOR_FOR seconds; see fair_floor).
        self.floors: dict[str, tuple[tuple[str, int] | None, float]] = {}
        self.turn = 0
        self.dry: dict[str, float] = {}
        #: Queues whose last claims the database refused (see :meth:`refused`): how many
        #: in a row, and the monotonic time before which the queue is not claimed again.
        self.failing: dict[str, tuple[int, float]] = {}
        #: Limited queues whose last claims found their lock another transaction's (see
        #: :meth:`limited_claimed`): how many in a row.
        self.busy: dict[str, int] = {}
        #: When a NOTIFY last named each queue (monotonic): a claim that began before it
        #: may have missed its jobs, so it does not make the queue dry. Written by the
        #: listener, read by the fetch loop, both under the core's lock.
        self.notified: dict[str, float] = {}
        #: For the claim-ahead: handlers finished per second and a claim's round trip,
        #: both smoothed, and since when the rate is counted.
        self.rate = 0.0
        self.rtt = 0.0
        self.rate_mark = (time.monotonic(), self.core.processed)

    def fetch(self, *, wait_scheduled: float = 0.0, deadline: float | None = None) -> Steps:
        """Claim, run maintenance, sleep; until stopped (or, ``until_empty``, until no job is
        ready or running here and none falls due within ``wait_scheduled`` seconds)."""
        core = self.core
        maintenance = core.maintenance
        failures = 0
        while not core.stopping:
            if deadline is not None and time.monotonic() >= deadline:
                return
            try:
                yield from self.maintain()
                yield from self.claim()
                if core.until_empty and not self.more and core.idle:
                    # Outcomes may still be in flight (a retry not yet scheduled): write
                    # them, refresh, and look once more before calling it empty.
                    yield WaitWritten(deadline)
                    if core.stopping or (deadline is not None and time.monotonic() >= deadline):
                        continue
                    maintenance.next_refresh = 0.0
                    self.dry.clear()  # "empty" means every queue looked at now
                    # Refused, its promotions and rescues did not run: not empty yet.
                    refreshed = yield from self.maintain()
                    # A limited queue that held ready jobs back is not empty: wait for
                    # its slot or its rate window (the sleep below ends when it is due),
                    # unless nothing can free it (see held_for_good).
                    claimed = yield from self.claim()
                    if not claimed:
                        claimed = yield from self.walk_round(deadline)
                    # Not idle any more: the write claimed jobs with the outcomes
                    # (``ride``), dispatched and maybe not started yet; called empty, the
                    # shutdown handed them back, unstarted, and the run came back short.
                    if (
                        refreshed
                        and not claimed
                        and core.idle
                        and not self.failing
                        and not self.walks
                        and not maintenance.due_soon(wait_scheduled)
                        and (not self.held or (yield from self.held_for_good(deadline)))
                    ):
                        return
                if failures:
                    failures = 0
                    core.reached()
            except Exception as exc:
                if not is_database_error(exc):
                    raise
                failures += 1
                core.note_unreachable(exc)
                pause = retry_pause(failures, exc)
                core.db_warning(
                    exc,
                    "worker %s: database error, retrying in %.2fs: %s",
                    core.name,
                    pause,
                    describe(exc),
                )
                yield Pause(self.until(deadline, pause))
                continue
            if not self.more:
                yield Sleep(self.until(deadline, self.sleep_for()))

    @staticmethod
    def until(deadline: float | None, seconds: float) -> float:
        """``seconds``, or less: no later than ``deadline`` (``run_until_empty``'s timeout).
        The idle loop slept a whole poll interval, or an outage's pause, past it, and
        nothing wakes it while a handler runs: ``timeout=1`` returned after 11 s."""
        if deadline is None:
            return seconds
        return max(0.0, min(seconds, deadline - time.monotonic()))

    def maintain(self) -> Generator[Step, Any, bool]:
        """The maintenance, when due; False if the database refused it.

        What the database answers with an error about the pass itself (a statement
        timeout, an application's trigger on a companion table) is said, and the pass is
        tried again at the next poll interval: the claims go on meanwhile. It stopped
        every claim of the worker, and was tried again at once, round after round. An
        outage (:func:`~sqla_jobs.errors.answered` false) is the fetch loop's to wait out."""
        maintenance = self.core.maintenance
        try:
            yield from maintenance.run_once()
        except Exception as exc:
            if not answered(exc):
                raise
            core = self.core
            maintenance.next_refresh = time.monotonic() + core.settings.poll_interval
            core.db_warning(
                exc,
                "worker %s: its maintenance pass failed (tried again in %.2fs): %s",
                core.name,
                core.settings.poll_interval,
                describe(exc),
            )
            return False
        return True

    def held_for_good(self, deadline: float | None = None) -> Generator[Step, Any, bool]:
        """Whether the limited queues holding ready jobs back hold them until an operator
        acts, so that ``run_until_empty`` may call them empty: none is held by a rate or
        a key's rate (time frees those) and none has a running job (whose end frees a
        slot, a key, or the head of a key in order). What is left is a key in order
        behind a dead or cancelled head (``on_head_failure="hold"``): waiting for it
        would never end.

        A hold may be older than the end of the jobs that made it (this worker's own,
        finished since): with nothing running, the held queues are claimed once more, and
        only a hold that this claim finds again, still with nothing running, counts. Of a
        queue whose claims walk its keys, only once the walk came round (claimed on, one
        after the other, until it does or the ``deadline`` passes): a claim that walked 64
        of 200 held keys said so of the free key after them."""
        if not (yield from self._held_and_idle()):
            return False
        with self.core._lock:
            self.held.clear()
        if (yield from self.claim()) or (yield from self.walk_round(deadline)) or self.walks:
            return False
        return (yield from self._held_and_idle())

    def walk_round(self, deadline: float | None) -> Generator[Step, Any, int]:
        """For ``run_until_empty``'s last look: claim on, one claim after the other, while
        a queue's walk over its keys has not come round (see ``walks``) and nothing was
        claimed; how many jobs were. Each last look starts a walk of its own, from where
        the last one stopped, and sees it round: a walk that went on at the next look
        never came round before that look began another. A queue held by time, refused,
        or paused waits as it would (``run_until_empty`` does not end meanwhile)."""
        core = self.core
        while self.walks and not core.stopping:
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not core.idle:
                # A claim rode with an outcome meanwhile: the run goes on anyway, and with
                # its slots taken a claim may send nothing, so this would go round idly.
                break
            with core._lock:
                walking = self.walks.keys() - self.time_held - core.maintenance.paused
                walking -= self.failing.keys()
                for queue in walking:
                    self.held.pop(queue, None)
            if not walking:
                break
            claimed = yield from self.claim()
            if claimed:
                return claimed
        return 0

    def _held_and_idle(self) -> Generator[Step, Any, bool]:
        """Some limited queue holds ready jobs back, none by time, and none of them has a
        running job, nor (in key order) a head cancelled while it ran whose lease has not
        passed (see :meth:`held_for_good`)."""
        core = self.core
        with core._lock:
            held = sorted(self.held)
            if not held or self.time_held & set(held):
                return False
        # Queues in key order: a head cancelled while it ran holds its key till its lease
        # passes, which time ends (see running_in).
        ordered = [q for q in held if getattr(core.limits.get(q), "key_order", None)]
        running: bool = yield Io(statements.running_in, (core.queries, held, ordered), Conn.CLAIM)
        return not running

    def claim_order(self) -> list[str]:
        """The queues to claim from this round: unpaused ones, starting from a rotating one
        so that no queue always goes first.

        A queue whose last claim came back short is dry: it is skipped until a NOTIFY names
        it or the next poll round (:meth:`dry_until`). A worker serving 1,000 queues with
        jobs in three of them would otherwise send a thousand claims per round, nearly all
        empty, while the busy queues wait (``benchmarks/curves.py --rows queues``).
        Limited queues are never dry: their own wait (``held``, until a slot or the rate
        window frees) decides when they are claimed again."""
        core = self.core
        dry, now, paused = self.dry, time.monotonic(), core.maintenance.paused
        queues = [q for q in core.queues if q not in paused and not dry.get(q, 0.0) > now]
        if self.failing:
            failing = self.failing
            queues = [q for q in queues if q not in failing or failing[q][1] <= now]
        if self.held:
            with core._lock:
                queues = [q for q in queues if self.held.get(q, 0.0) <= now]
        if not queues:
            return []
        start = self.turn % len(queues)
        self.turn = start + 1
        return queues[start:] + queues[:start]

    def claim(self) -> Generator[Step, Any, int]:
        """Claim up to the free slots (and the claim-ahead), queue by queue; dispatch each
        claim at once.

        Sets ``more`` when a queue gave as many jobs as asked (there may be more right
        now), and marks the worker saturated when too little room is left for a claim
        worth sending (a finishing job must then wake the loop). Otherwise the queues are
        drained for the moment.
        """
        core = self.core
        self.more = False
        self.estimate_ahead()
        with core._lock:
            # Under the lock with the flag: a job finishing in between sees it and wakes us.
            room = core._free + core._ahead
            if room < core._wake_at:
                core._saturated = True
                return 0
        total = 0
        for queue in self.claim_order():
            # Limited queues share the room: their claims, like any, are 'running' rows
            # while they wait, so their limits hold (and kept to the free slots, they
            # would starve beside a busy queue that keeps those below zero).
            want = min(room - total, core.settings.claim_limit)
            if want <= 0:
                break
            try:
                total += yield from self.claim_queue(queue, want)
            except Exception as exc:
                if not answered(exc) or lost_prepared_statement(exc):
                    # The connection's, the server's or a pooler's: the whole loop waits.
                    raise
                self.refused(queue, exc)
                continue
            if self.failing:
                self.failing.pop(queue, None)
        return total

    def refused(self, queue: str, exc: Exception) -> None:
        """The database refused a claim from ``queue`` for what that claim is (an
        application's trigger, a statement timeout, a constraint of a companion table),
        on a connection that still works: that queue waits, by the pause a failing
        database gets, and the other queues are claimed as usual. It once ended the whole
        round, and the loop's own pause, growing to 30 s as the queue kept failing, held
        every other queue of the worker up with it."""
        failures = self.failing.get(queue, (0, 0.0))[0] + 1
        pause = retry_pause(failures, exc)
        self.failing[queue] = (failures, time.monotonic() + pause)
        core = self.core
        core.db_warning(
            exc,
            "worker %s: claiming from queue %r failed, that queue is claimed again in %.2fs: %s",
            core.name,
            queue,
            pause,
            describe(exc),
        )

    def claim_queue(self, queue: str, want: int) -> Generator[Step, Any, int]:
        """Claim up to ``want`` jobs from ``queue`` and dispatch them; how many it gave."""
        core = self.core
        limited = queue in core.limits
        watch = core.listen_watch
        # One statement in autocommit: it has committed when it returns. Only now may
        # the jobs start: a completion written before the claim is visible would find
        # the row still 'ready' and match nothing.
        params = claim_params(queue, want, core.lease, core.name)
        began = time.monotonic()
        if limited:
            rows = yield from self.claim_limited(queue, params)
            self.timed(began)
        else:
            if queue in core.fair:
                rows = yield from self.claim_fair(queue, params, began)
            else:
                rows = yield Io(statements.claim, (core.queries, params), Conn.CLAIM)
            took = self.timed(began)
            if watch.active:
                watch.claimed(queue, began, len(rows), want, began + took)
        # A fair claim gives each key its share, so it comes back short while most keys
        # have little left: any job it gave means there may be more right now.
        # A walk over its keys that did not come round (see walks): run_until_empty
        # claims on at once, rather than after a poll interval.
        walking = core.until_empty and queue in self.walks
        if len(rows) == want or (rows and queue in core.fair) or walking:
            self.more = True
            self.dry.pop(queue, None)
        elif not limited:
            # Not when a NOTIFY for it arrived while this claim was on its way: the
            # claim's snapshot may predate the jobs it announced.
            with core._lock:
                if self.notified.get(queue, 0.0) < began:
                    self.dry[queue] = self.dry_until(began)
        if rows:
            claimed = core.claimed(rows, began)
            if claimed:
                core.driver.dispatch(claimed)
        return len(rows)

    def claim_fair(
        self, queue: str, params: ClaimParams, began: float
    ) -> Generator[Step, Any, list[Any]]:
        """Claim from a fair queue: shared between the keys in turn, each claim walking on
        from where the last one stopped (``key_cursor``).

        A claim walks at most ``scan`` keys. One that found nothing ready among them (keys
        whose jobs all ended dead, kept for a week) is followed at once by the next, from
        where it stopped, until one finds jobs or the walk comes round (at most
        :data:`KEY_WALK_ROUNDS` claims): the queue counted as dry after the first, and a
        tenant behind 500 such keys got a job a poll interval."""
        core = self.core
        walk = self.walks.pop(queue, None) or KeyWalk(self.key_cursor.get(queue))
        rows: list[Any] = []
        for _ in range(KEY_WALK_ROUNDS):
            fair = fair_claim_params(
                params, core.fair[queue], walk.cursor, floor=self.fair_floor(queue, began)
            )
            found: tuple[list[Any], str | None, tuple[str, int] | None] = yield Io(
                statements.claim_fair, (core.queries, fair), Conn.CLAIM
            )
            rows, last, floor = found
            self.key_cursor[queue] = last
            self.floors[queue] = (floor, self.floors.get(queue, (None, began))[1])
            if rows or last is None or walk.came_round(last):
                return rows
        self.walks[queue] = walk  # on from there at the next claim
        return rows

    def timed(self, began: float) -> float:
        """How long a claim sent at ``began`` took, folded into the smoothed round trip
        the claim-ahead is estimated from (:meth:`estimate_ahead`); every kind of claim
        counts. The limited ones once did not: a worker serving only limited queues
        claimed no further ahead than its free slots, so its slots ran dry while each
        claim travelled (a never-binding limit drained at two thirds of the unlimited
        rate, in claims of 126 jobs against 196)."""
        took = time.monotonic() - began
        self.rtt = took if not self.rtt else 0.8 * self.rtt + 0.2 * took
        return took

    def fair_floor(self, queue: str, now: float) -> tuple[str, int] | None:
        """The floor a fair claim reads its busiest key from (see ``_fair_claim``): the
        last claim's, unless floors have been used for ``FAIR_FLOOR_FOR`` seconds; then
        None, and a new period begins. So an older job of that key that is ready again
        behind the floor (a retry, a handed-back claim, one a failed claim let go) is
        claimed within that time, oldest first again."""
        floor, since = self.floors.get(queue, (None, now))
        if now - since >= FAIR_FLOOR_FOR:
            self.floors[queue] = (None, now)
            return None
        return floor

    def dry_until(self, began: float) -> float:
        """Until when a queue whose claim (sent at ``began``) came back short is skipped:
        the next poll round, which is due within a poll interval of ``began``.

        Timed from the round, not from the claim: the idle loop wakes for the round at
        the maintenance's ``next_refresh``, and a mark set a few milliseconds later than
        that (from the end of the claim, or its start) was still "dry" when the loop woke,
        so each queue but the first of a round was claimed only every other poll interval.
        When the round is already overdue (its claims took longer than a poll interval:
        thousands of queues), a poll interval from ``began`` still bounds the wait."""
        round_due = self.core.maintenance.next_refresh
        return round_due if round_due > began else began + self.core.settings.poll_interval

    def estimate_ahead(self) -> None:
        """How far past the free slots to claim: twice the jobs that finish during one
        claim's round trip (both smoothed), at most a claim's worth.

        A claim claims only what its worker can run, so with handlers faster than a round
        trip the slots run dry while the next claim travels: one worker drained at a
        fraction of what the database allows, and only more processes (more claims in
        flight) made up for it. Claimed ahead, the next claim's jobs arrive as the last
        ones end. Slow handlers finish few jobs per round trip, which makes the claim-ahead
        zero, so slow jobs do not queue here behind each other while another worker is
        idle (only what was claimed ahead when quick jobs turned slow can, once). A
        claimed-ahead job waits in this worker, with its lease renewed, for a round trip
        or two; a stop hands it back at once, unstarted.
        """
        core = self.core
        s = core.settings
        if not s.prefetch:
            return
        now = time.monotonic()
        since, processed = self.rate_mark
        elapsed = now - since
        if elapsed < 0.01:  # too short a time to tell a rate; keep the last estimate
            return
        rate = (core.processed - processed) / elapsed
        self.rate = 0.5 * (self.rate + rate) if self.rate else rate
        self.rate_mark = (now, core.processed)
        ahead = min(s.claim_limit, s.concurrency, int(2 * self.rate * self.rtt))
        with core._lock:
            core._ahead = ahead
            # Wait for room for half a claim rather than send a claim per finished job.
            core._wake_at = max(1, ahead // 2)

    def claim_limited(self, queue: str, params: ClaimParams) -> Generator[Step, Any, list[Any]]:
        """Claim from a limited queue. When its limits held ready jobs back, skip it until
        its rate has room again, or for a moment (``LIMIT_RECHECK``) when a concurrency
        limit is full: a slot frees when any worker's completion is written, which no
        NOTIFY announces (this worker's own completions claim for it as they free its
        slots: :meth:`ride`)."""
        limits = self.core.limits[queue]
        # In key order and with no other limit, an empty claim (the keys it walked had
        # their heads running, or dead, or nothing left) is followed at once by the next,
        # from where it stopped, until the walk comes round (as a fair claim is: see
        # claim_fair). Behind hundreds of held keys a free key got a job every
        # LIMIT_RECHECK. A limit that may be full (a concurrency, a rate) would make each
        # of those claims empty for nothing: such queues wait as before.
        walk_on = limits.key_order is not None and limits.concurrency is None
        walk_on = walk_on and limits.rate is None and limits.key_rate is None
        # A walk that stopped before it came round goes on at the next claim (see walks).
        resumed = self.walks.pop(queue, None)
        walk = resumed or KeyWalk(self.key_cursor.get(queue))
        self.key_cursor[queue] = walk.cursor  # a claim that rode may have moved it
        for _ in range(KEY_WALK_ROUNDS if walk_on else 1):
            limited = self.limited_params(queue, params)
            found: statements.LimitedClaim = yield Io(
                statements.claim_limited, (self.core.queries, limited), Conn.CLAIM
            )
            self.limited_claimed(queue, limited, found)
            last = found.last_key
            if found.busy:
                if resumed is not None:
                    self.walks[queue] = walk  # on once the hold has passed
                break
            if found.rows or last is None or walk.came_round(last):
                break
        else:
            self.walks[queue] = walk
        return found.rows

    def limited_params(self, queue: str, params: ClaimParams) -> LimitedClaimParams:
        """The limited claim's parameters: ``params`` and the queue's limits."""
        limited = queue_claim_params(params, self.core.limits[queue])
        # A queue in key order: its claims walk the keys in turn, each after the last.
        limited["after_key"] = self.key_cursor.get(queue)
        return limited

    def limited_claimed(
        self, queue: str, params: LimitedClaimParams, found: statements.LimitedClaim
    ) -> None:
        """After a limited claim (the fetch loop's, or one that rode with a completion):
        where its walk stopped, and whether, and until when, the queue is held."""
        core = self.core
        limits = core.limits[queue]
        self.key_cursor[queue] = found.last_key
        # Under the lock: the completer (another thread in the threaded worker) ends
        # waits in freed() and claims in ride().
        with core._lock:
            self.rate_held.discard(queue)
            self.time_held.discard(queue)
            if found.busy:
                # Its lock was another transaction's for longer than a claim takes (an
                # application's session.claim left open, this worker's own completer on
                # a loaded machine): the other queues go on, and this one is tried again
                # once the hold has passed, held by time (run_until_empty waits for it).
                # The hold grows from LIMIT_RECHECK to the poll interval: the completer's
                # lock is gone in moments, and a whole poll interval for each busy claim
                # left a loaded machine's drain waiting seconds on a queue with jobs.
                tries = self.busy[queue] = self.busy.get(queue, 0) + 1
                hold = min(core.settings.poll_interval, LIMIT_RECHECK * 2.0 ** (tries - 1))
                self.held[queue] = time.monotonic() + hold
                self.time_held.add(queue)
                return
            self.busy.pop(queue, None)
            if len(found.rows) < params["limit"] and found.held:
                if found.rate_free_in is not None or found.key_free_in is not None:
                    self.time_held.add(queue)
                wait = LIMIT_RECHECK
                if found.rate_free_in is not None:
                    wait = found.rate_free_in
                    self.rate_held.add(queue)
                elif found.key_free_in is not None:
                    # Held by a key's rate: nothing frees it before then. Unless a
                    # concurrency limit may be holding jobs too, whose slot a completion
                    # can free: then look again within LIMIT_RECHECK, as for those.
                    if limits.concurrency is None and limits.key_concurrency is None:
                        wait = found.key_free_in
                        self.rate_held.add(queue)
                    else:
                        wait = min(found.key_free_in, LIMIT_RECHECK)
                wait = max(0.0, min(wait, core.settings.poll_interval))
                self.held[queue] = time.monotonic() + wait
            else:
                self.held.pop(queue, None)

    def ride(self, batch: Iterable[Outcome]) -> tuple[str, LimitedClaimParams] | None:
        """A claim to send with this outcome batch (:func:`._statements.write_and_claim`):
        from the first queue the batch frees slots of while its concurrency limit holds
        its claims (the fetch loop waits for this write to claim from it), for the room
        the worker has; None when there is none, or the worker is stopping.

        The queue stays held while the claim travels, so the fetch loop does not claim
        from it too; :meth:`limited_claimed` says afterwards whether it still is."""
        core = self.core
        if not self.held:
            return None
        with core._lock:
            if core.stopping:
                return None
            waiting = self.held.keys() - self.rate_held - core.maintenance.paused
            queue = next((o.job.queue for o in batch if o.job.queue in waiting), None)
            if queue is None:
                return None
            want = min(core._free + core._ahead, core.settings.claim_limit)
            if want <= 0:
                return None
        params = claim_params(queue, want, core.lease, core.name)
        return queue, self.limited_params(queue, params)

    def rode(
        self, queue: str, params: LimitedClaimParams, found: statements.LimitedClaim, at: float
    ) -> Steps:
        """A claim that rode with an outcome batch came back: its jobs run, unless the
        worker began to stop meanwhile (then they are handed back, as the shutdown hands
        back every unstarted claim); the fetch loop is woken if the queue has room left."""
        core = self.core
        self.limited_claimed(queue, params, found)
        claimed = core.claimed(found.rows, at) if found.rows else []
        if core.stopping:
            # The shutdown may have taken its unstarted claims before these were added.
            mine = {job.key for job in claimed}
            back = core._take(lambda j: j.key in mine)
            if back:
                with core._lock:
                    core._free += len(back)
                yield from core._hand_back(back, "unstarted")
            return
        if claimed:
            core.driver.dispatch(claimed)
        with core._lock:
            free = queue not in self.held
        if free:
            core.driver.wake()

    def sleep_for(self) -> float:
        """How long the idle fetch loop may sleep: to the next refresh or due time, or to
        when a held limited queue, or one whose claims were refused, may be claimed
        again."""
        core = self.core
        sleep = core.maintenance.sleep_for()
        if self.held:
            now = time.monotonic()
            with core._lock:
                held = min(self.held.values(), default=now)
            sleep = min(sleep, max(0.0, held - now) + 0.001)
        if self.failing:
            due = min(until for _, until in self.failing.values())
            sleep = min(sleep, max(0.0, due - time.monotonic()) + 0.001)
        return sleep

    def heard(self, queue: str, now: float) -> None:
        """A NOTIFY named ``queue`` (called by the listener, under the core's lock): it is
        not dry, and a claim that began before ``now`` does not make it so. Named while
        paused, it may have been resumed (``resume_queue`` says so this way): the pause
        state is read again at once, not at the next poll interval."""
        self.notified[queue] = now
        self.dry.pop(queue, None)
        if queue in self.core.maintenance.paused:
            self.core.maintenance.next_refresh = 0.0

    def freed(self, batch: Iterable[Outcome], rode: str | None = None) -> None:
        """Written outcomes freed slots of limited queues: claim from them again now (but
        from ``rode``, which a claim that rode with them claimed from already)."""
        core = self.core
        if not core.limits:
            return
        freed = {o.job.queue for o in batch} & core.limits.keys()
        freed.discard(rode)
        woken = False
        with core._lock:
            for queue in freed - self.rate_held:
                if self.held.pop(queue, None) is not None:
                    woken = True
        if woken:
            core.driver.wake()

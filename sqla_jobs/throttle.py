"""Concurrency and rate limits: how many jobs of a queue (or of one key) run, or start, at once.

.. code-block:: python

    jobs.queue("exports", concurrency=3)            # never more than 3 running, all workers
    jobs.queue("partner-api", rate="100/minute")    # at most 100 started in any minute
    jobs.queue("per-partner", key_rate="10/minute")  # at most 10 a minute per key

    @jobs.task(queue="sync", concurrency_key=lambda account_id, **_: account_id)
    def sync_account(account_id: str, full: bool = False) -> None: ...
    # one sync per account at a time (key_concurrency=1 by default), any number of accounts

The limits are declared in code, like the tasks, and every worker enforces the ones its
registry declares. A queue that declares none is claimed by the plain claim statement, the
same SQL as a queue had before limits existed; a limited queue is claimed by another
statement (:func:`sqla_jobs._queries` ``_limited_claim``) that takes a lock for its queue,
counts what runs and what started, and takes only what fits.

Why this design
---------------
* **The lock.** The claims of one limited queue take turns on a transaction-scoped
  advisory lock (``pg_advisory_xact_lock``) keyed by the table and the queue. The limits
  are then checked in the *next* statement of that transaction, which, under READ
  COMMITTED, sees every claim committed before the lock was granted. Checking them in the
  statement that takes the lock would not be safe: its snapshot is older than the lock,
  so it would miss the claim it waited for. The cost is two extra round trips (the lock
  and the COMMIT) and the claims of one queue running one after another; claims of other
  queues, and of unlimited queues, never wait on it.
* **What counts as running.** The rows whose ``status`` is ``running`` (and, for a key,
  whose ``concurrency_key`` is that key): no counter to keep in step with completions,
  retries, rescues, hand-backs and cancels. A job whose worker died keeps counting until
  its lease passes and it is rescued, so a dead worker can hold a slot for up to one lease:
  the limit errs on the side of running fewer, never more.
* **The rate.** A sliding log: ``<table>_queues.rate_log`` holds when each claim within
  the last period started its jobs, and ``rate_counts`` how many, written by the claim
  under the lock (one entry per claim: a log of one per job grew with the rate). "At
  most N in any window of the period" holds exactly, unlike a fixed window or a token
  bucket, which allow up to 2N across a boundary. A job that cannot start stays
  ``ready`` (no attempt spent), and the worker skips that queue until the oldest start
  leaves the window, while it keeps claiming its other queues.
* **The rate of a key.** The same sliding log, one per (queue, key), in the companion
  table ``<table>_key_starts``, read and written by the limited claim under the same
  lock. Its ``full_until`` (indexed) lets the claim skip the keys with no room before it
  scans the ready rows, reading no other key's row; ``expires_at`` lets retention drop
  the logs that say nothing any more. A row per key, not one array on the queue's row,
  so that a claim rewrites only the keys it claimed, whatever the number of keys.
* **Declared in code.** Limits are part of the application, reviewed and deployed with
  the tasks that need them. All workers of a queue must run code that declares the same
  limits: a worker that does not know a queue is limited claims it with the plain
  statement.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from ._storable import DURATION_MAX_SECONDS, INT_MAX, UNIQUE_KEY_MAX_BYTES, check_name
from .errors import EnqueueError

__all__ = [
    "ConcurrencyKey",
    "HeadFailure",
    "KeyOrder",
    "QueueLimits",
    "concurrency_key_of",
    "parse_rate",
]

#: A task's key function: its arguments, as keywords, to the key (None: no key, no limit).
ConcurrencyKey = Callable[..., "str | None"]

#: ``"fifo"``: the jobs of one key start one at a time, in the order of their ids.
KeyOrder = Literal["fifo"]
#: What a dead or cancelled job at the head of its key does to the jobs behind it, in a
#: queue with ``key_order="fifo"``: ``"hold"`` them until an operator retries or deletes
#: it, or ``"continue"`` with the next.
HeadFailure = Literal["hold", "continue"]
_KEY_ORDERS = ("fifo",)
_HEAD_FAILURES = ("hold", "continue")

#: A concurrency key sits in an index (``<table>_keys``), like a unique key.
CONCURRENCY_KEY_MAX_BYTES = UNIQUE_KEY_MAX_BYTES

_PERIODS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
}
_RATE = re.compile(r"^\s*(-?\d+)\s*/\s*(\d*\.?\d*)\s*([a-z]+)\s*$")
#: The log holds one timestamp per start in the window; past this it is not a small row.
RATE_MAX = 10_000


def parse_rate(rate: str) -> tuple[int, float]:
    """``"100/minute"`` (or ``"20/s"``, ``"5/10s"``, ``"1000/hour"``, ``"10/day"``) as
    ``(count, seconds)``. Raises ``ValueError`` naming what is wrong."""
    if not isinstance(rate, str):
        raise ValueError(f"rate must be a string like '100/minute', got {rate!r}")
    match = _RATE.match(rate.lower())
    if match is None:
        raise ValueError(
            f"rate {rate!r} is not '<count>/<period>' (for example '100/minute', '20/s', '5/10s')"
        )
    count_text, multiple_text, unit = match.groups()
    if unit not in _PERIODS and len(unit) > 3 and unit[:-1] in _PERIODS:
        unit = unit[:-1]  # minutes, hours
    if unit not in _PERIODS:
        raise ValueError(
            f"rate {rate!r}: unknown period {unit!r}; use second, minute, hour or day "
            "(or s, m, h, d)"
        )
    count = int(count_text)
    if not 1 <= count <= RATE_MAX:
        raise ValueError(f"rate {rate!r}: the count must be between 1 and {RATE_MAX}")
    multiple = float(multiple_text) if multiple_text not in ("", ".") else 1.0
    if multiple <= 0:
        raise ValueError(f"rate {rate!r}: the period must be longer than 0")
    seconds = multiple * _PERIODS[unit]
    # The claim subtracts the period from the database's clock: one of ten thousand
    # years failed every claim of the queue ("timestamp out of range"), and one too long
    # for a float stopped the worker.
    if not seconds <= DURATION_MAX_SECONDS:
        raise ValueError(
            f"rate {rate!r}: the period must be at most {DURATION_MAX_SECONDS / 86400:.0f} days"
        )
    return count, seconds


def _positive(name: str, value: object, what: str) -> int | None:
    # At most what the claim's integer parameter holds: past it, every claim of the queue
    # failed ("integer out of range").
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT_MAX:
        raise ValueError(
            f"queue {name!r}: {what} must be an integer from 1 to {INT_MAX}, got {value!r}"
        )
    return value


class QueueOptions(TypedDict, total=False):
    """The limits :meth:`Jobs.queue <sqla_jobs.Jobs.queue>` takes (its docstring says what
    each means), passed on as they are to :meth:`QueueLimits.declare`, which checks them."""

    concurrency: int | None
    rate: str | None
    key_concurrency: int | None
    key_rate: str | None
    key_order: KeyOrder | None
    on_head_failure: HeadFailure
    fair: bool
    weights: Mapping[str, int] | None


@dataclass(frozen=True)
class QueueLimits:
    """What a queue may run and start, across every worker (see :meth:`Jobs.queue
    <sqla_jobs.Jobs.queue>`)."""

    name: str
    #: Most jobs of the queue running at once; None: no limit.
    concurrency: int | None = None
    #: Most jobs started per ``rate_period`` seconds, in any window; None: no limit.
    rate: int | None = None
    rate_period: float | None = None
    #: Most running jobs that share one ``concurrency_key``; None: no limit (a queue
    #: that declares a ``key_rate`` and no ``key_concurrency``).
    key_concurrency: int | None = 1
    #: Some task of this queue declares a ``concurrency_key``.
    keyed: bool = False
    #: Most jobs sharing one ``concurrency_key`` started per ``key_rate_period`` seconds,
    #: in any window; None: no per-key rate.
    key_rate: int | None = None
    key_rate_period: float | None = None
    #: ``"fifo"``: the jobs of one key start in the order of their ids, one at a time.
    key_order: KeyOrder | None = None
    #: With ``key_order="fifo"``: whether a dead or cancelled head holds its key.
    on_head_failure: HeadFailure = "hold"
    #: ``fair=True``: each claim shares its jobs between the keys (``concurrency_key``) in
    #: turn, by weight, instead of taking the oldest first.
    fair: bool = False
    #: With ``fair``: ``(key, weight)`` pairs (a key's share of a claim is proportional to
    #: its weight; 1 when not listed).
    weights: tuple[tuple[str, int], ...] = ()

    @classmethod
    def declare(
        cls,
        name: str,
        *,
        concurrency: int | None = None,
        rate: str | None = None,
        key_concurrency: int | None = None,
        key_rate: str | None = None,
        key_order: KeyOrder | None = None,
        on_head_failure: HeadFailure | None = None,
        fair: bool = False,
        weights: Mapping[str, int] | None = None,
    ) -> QueueLimits:
        """Checked limits; ``ValueError`` names the bad one. Giving ``key_concurrency``,
        ``key_rate`` or ``key_order`` makes the queue keyed (it takes keyed jobs of any
        task). A ``key_rate`` without ``key_concurrency`` limits the key's starts only;
        without either, a keyed queue runs one job per key at a time, which
        ``key_order="fifo"`` requires."""
        count, period = parse_rate(rate) if rate is not None else (None, None)
        key_limit = _positive(name, key_concurrency, "key_concurrency")
        try:
            key_count, key_period = parse_rate(key_rate) if key_rate is not None else (None, None)
        except ValueError as exc:
            raise ValueError(f"queue {name!r}: key_{exc}") from None
        if key_order is not None and key_order not in _KEY_ORDERS:
            raise ValueError(f"queue {name!r}: key_order must be 'fifo' or None, got {key_order!r}")
        if key_order is not None and key_limit not in (None, 1):
            raise ValueError(
                f"queue {name!r}: key_order='fifo' runs the jobs of a key one at a time; "
                f"key_concurrency={key_limit} cannot go with it"
            )
        if on_head_failure is not None:
            if key_order is None:
                raise ValueError(f"queue {name!r}: on_head_failure is for key_order='fifo'")
            if on_head_failure not in _HEAD_FAILURES:
                raise ValueError(
                    f"queue {name!r}: on_head_failure must be 'hold' or 'continue', "
                    f"got {on_head_failure!r}"
                )
        pairs = _fair_share(name, fair, weights)
        if fair:
            given = {
                "concurrency": concurrency,
                "rate": rate,
                "key_concurrency": key_concurrency,
                "key_rate": key_rate,
                "key_order": key_order,
            }
            others = [option for option, value in given.items() if value is not None]
            if others:
                raise ValueError(
                    f"queue {name!r}: fair=True goes alone in this release (it shares claims "
                    f"between keys without a lock); it cannot go with {', '.join(others)}"
                )
            return cls(name, fair=True, weights=pairs)
        keyed = key_limit is not None or key_count is not None or key_order is not None
        if key_limit is None and (key_count is None or key_order is not None):
            key_limit = 1  # a keyed queue runs one job per key, unless only its rate is given
        return cls(
            name,
            _positive(name, concurrency, "concurrency"),
            count,
            period,
            key_limit,
            keyed=keyed,
            key_rate=key_count,
            key_rate_period=key_period,
            key_order=key_order,
            on_head_failure=on_head_failure or "hold",
        )

    @property
    def limited(self) -> bool:
        """The queue needs the limited claim (else the plain one, unchanged)."""
        return self.concurrency is not None or self.rate is not None or self.keyed

    def describe(self) -> str:
        """``concurrency 3, 100/60s, 1 per key`` or ``in order per key`` (empty when
        unlimited), for listings."""
        parts = []
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if self.rate is not None:
            parts.append(f"{self.rate}/{self.rate_period:g}s")
        if self.fair:
            shares = ", ".join(f"{key}={weight}" for key, weight in self.weights)
            parts.append(f"fair share per key{f' ({shares})' if shares else ''}")
        if self.key_order is not None:
            # One at a time per key is part of the order.
            past = ", past a failed head" if self.on_head_failure == "continue" else ""
            parts.append(f"in order per key{past}")
        elif self.keyed and self.key_concurrency is not None:
            parts.append(f"{self.key_concurrency} per key")
        if self.key_rate is not None:
            parts.append(f"{self.key_rate}/{self.key_rate_period:g}s per key")
        return ", ".join(parts)


#: The largest weight a key may have: a claim reads up to weight times its share of a key's
#: jobs.
WEIGHT_MAX = 100


def _fair_share(
    name: str, fair: object, weights: Mapping[str, int] | None
) -> tuple[tuple[str, int], ...]:
    """Checked ``fair`` and ``weights``, as sorted ``(key, weight)`` pairs."""
    if not isinstance(fair, bool):
        raise ValueError(f"queue {name!r}: fair must be True or False, got {fair!r}")
    if weights is None:
        return ()
    if not fair:
        raise ValueError(f"queue {name!r}: weights are for fair=True")
    if callable(weights) or not isinstance(weights, Mapping):
        raise ValueError(
            f"queue {name!r}: weights must be a mapping of key to weight (the claim runs in "
            f"SQL, where a function cannot), got {type(weights).__name__}"
        )
    pairs = []
    for key, weight in weights.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"queue {name!r}: a weight's key must be a non-empty string: {key!r}")
        # What a job's key may be (a NUL, or a key past the limit, no job can have; and a
        # NUL would make PostgreSQL refuse every claim of the queue).
        check_name(key, f"queue {name!r}: the weight's key", CONCURRENCY_KEY_MAX_BYTES)
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= WEIGHT_MAX:
            raise ValueError(
                f"queue {name!r}: the weight of key {key!r} must be an integer from 1 to "
                f"{WEIGHT_MAX}, got {weight!r}"
            )
        pairs.append((key, weight))
    return tuple(sorted(pairs))


def concurrency_key_of(
    task: str,
    fn: ConcurrencyKey,
    arguments: Mapping[str, Any],
    signature: inspect.Signature | None = None,
) -> str | None:
    """Run a task's key function on checked arguments, the handler's defaults filled in
    from its ``signature`` (a key may come from a parameter the caller left out);
    ``EnqueueError`` if it raises or returns something that cannot be a key, so the job
    is refused at enqueue, not lost."""
    given = dict(arguments)
    if signature is not None:
        for name, parameter in signature.parameters.items():
            if name not in given and parameter.default is not parameter.empty:
                given[name] = parameter.default
    try:
        key = fn(**given)
    except Exception as exc:
        raise EnqueueError(
            f"task {task!r}: its concurrency_key function raised {type(exc).__name__}: {exc}"
        ) from exc
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise EnqueueError(
            f"task {task!r}: its concurrency_key function must return a non-empty string or "
            f"None, got {key!r}"
        )
    check_name(key, f"task {task!r}: concurrency key", CONCURRENCY_KEY_MAX_BYTES, EnqueueError)
    return key

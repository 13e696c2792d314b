"""Worker settings, in one place: defaults, validation, help text and the command line.

.. code-block:: python

    settings = WorkerSettings(queues=("previews",), concurrency=16)
    Worker(jobs, engine, settings)                  # or Worker(jobs, engine, concurrency=16)
    AsyncWorker(jobs, async_engine, settings)

Both workers take the same :class:`WorkerSettings`, the ``sqla-jobs worker`` command makes
one flag per field (its help and default come from here, so the command line has no
defaults of its own), and a supervisor hands its children the same settings with
:meth:`WorkerSettings.to_argv`. A new setting is one new field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from .._storable import QUEUE_MAX_BYTES, check_name

__all__ = ["WorkerOptions", "WorkerSettings"]


def _setting(default: Any, help: str, *, cli: str | None = None, off: str | None = None) -> Any:
    """A field with its help text; ``cli`` overrides the flag's name.

    A boolean setting is on by default and its flag (``--no-...``) turns it off: ``help``
    says what the setting does, ``off`` what the flag does, and the flag's help is ``off``.
    """
    return field(default=default, metadata={"help": help, "cli": cli, "off": off})


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """How a worker runs. Every field is checked when the settings are made.

    Frozen, so one object can be shared by several workers and handed to processes.
    """

    queues: tuple[str, ...] | None = _setting(
        None, "queues to serve (default: every queue a registered task names)"
    )
    concurrency: int = _setting(10, "handlers running at once (threads, or asyncio tasks)")
    lease: float = _setting(
        30.0,
        "seconds a claim is held without a heartbeat; the heartbeat renews it every third "
        "of that, so it only has to outlast a stall of the worker itself",
    )
    poll_interval: float = _setting(
        1.0,
        "longest sleep between claims when no NOTIFY arrives; also how often maintenance "
        "runs (promote due jobs, rescue expired leases, cron ticks, pause state)",
    )
    grace_period: float = _setting(
        30.0,
        "on stop, seconds running handlers get to finish before they are handed back "
        "(a second stop signal, or SIGQUIT, ends it at once)",
    )
    claim_limit: int = _setting(100, "most jobs one claim statement takes")
    completion_batch: int = _setting(500, "most outcomes one completion write records")
    completion_interval: float = _setting(
        0.005,
        "seconds the completer waits to fill a batch (not when the worker runs nothing "
        "else, nor when the batch frees a slot of a limited queue that is holding jobs)",
    )
    rescue_interval: float | None = _setting(
        None, "seconds between passes that rescue expired leases (default: lease / 2, at most 5)"
    )
    prune_interval: float = _setting(
        60.0, "seconds between retention passes (one elected worker prunes)"
    )
    presence_interval: float = _setting(
        5.0,
        "seconds between the worker's updates of its row in <table>_workers (what the "
        "dashboard's Workers page shows); it counts as gone after three missed updates",
    )
    listen: bool = _setting(
        True,
        "LISTEN for new jobs on a dedicated connection, and claim as soon as a NOTIFY "
        "names a queue served",
        cli="no-listen",
        off="do not LISTEN: find new jobs by polling every --poll-interval only (for "
        "PgBouncer's transaction pooling, which LISTEN does not pass through)",
    )
    prefetch: bool = _setting(
        True,
        "claim jobs ahead of free slots when handlers finish faster than a claim's round "
        "trip, so that the next claim is on its way while the last one's jobs run",
        cli="no-prefetch",
        off="do not claim ahead: claim only into free slots",
    )
    log_jobs: bool = _setting(
        True,
        "log one INFO line per finished run, with its duration and outcome",
        cli="no-log-jobs",
        off="log successes and snoozes at DEBUG instead of one INFO line per finished run "
        "(failures are always logged)",
    )
    stuck_after: float = _setting(
        60.0,
        "seconds a loop of the worker may overrun what it waits for (a statement, a sleep), "
        "or outcomes may wait unwritten while the database answers, before the worker "
        "reports itself unhealthy (see --health-port)",
    )
    name: str | None = _setting(
        None, "this worker's name in locked_by and logs (default: host:pid:random)"
    )

    def __post_init__(self) -> None:
        if self.queues is not None:
            if isinstance(self.queues, str) or not isinstance(self.queues, Iterable):
                raise ValueError(f"queues must be a sequence of names, got {self.queues!r}")
            names = tuple(self.queues)
            if not names:
                raise ValueError("queues must name at least one queue (or be None for all)")
            for queue in names:
                check_queue_name(queue)
            object.__setattr__(self, "queues", names)
        for name in ("concurrency", "claim_limit", "completion_batch"):
            _int(self, name, 1, MAXIMA[name])
        for name in ("grace_period", "completion_interval"):
            _seconds(self, name, positive=False)
        for name in ("lease", "poll_interval", "prune_interval", "presence_interval"):
            _seconds(self, name, positive=True)
        _seconds(self, "stuck_after", positive=True)
        if self.rescue_interval is not None:
            _seconds(self, "rescue_interval", positive=True)
        for flag in ("listen", "prefetch", "log_jobs"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.name is not None:
            if not isinstance(self.name, str) or not self.name:
                raise ValueError(f"name must be a non-empty string, got {self.name!r}")
            # It is written in locked_by and is the key of the worker's row.
            check_name(self.name, "name", NAME_MAX_BYTES)

    @property
    def rescue_every(self) -> float:
        """Seconds between rescue passes: the setting, or half the lease (at most 5 s)."""
        return (
            self.rescue_interval if self.rescue_interval is not None else min(5.0, self.lease / 2)
        )

    def replace(self, **changes: Any) -> WorkerSettings:
        """A copy with some fields changed (checked like any other)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown worker setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_argv(self) -> list[str]:
        """The ``sqla-jobs worker`` flags that make these settings (defaults left out)."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + (f.metadata["cli"] or f.name.replace("_", "-"))
            if isinstance(value, bool):
                argv.append(flag)  # a boolean flag turns a default True off
            elif isinstance(value, tuple):
                argv += [flag, ",".join(value)]
            else:
                argv += [flag, repr(value) if isinstance(value, float) else str(value)]
        return argv

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class WorkerOptions(TypedDict, total=False):
    """The keyword form of :class:`WorkerSettings`, for ``Worker(jobs, bind, **options)``.

    Kept in step with the dataclass by a test.
    """

    queues: Iterable[str] | None
    concurrency: int
    lease: float
    poll_interval: float
    grace_period: float
    claim_limit: int
    completion_batch: int
    completion_interval: float
    rescue_interval: float | None
    prune_interval: float
    presence_interval: float
    listen: bool
    prefetch: bool
    log_jobs: bool
    stuck_after: float
    name: str | None


def resolve(settings: WorkerSettings | None, options: Mapping[str, Any]) -> WorkerSettings:
    """``settings`` (or the defaults) with keyword overrides applied."""
    base = settings if settings is not None else WorkerSettings()
    if not isinstance(base, WorkerSettings):
        raise TypeError(f"settings must be a WorkerSettings, got {base!r}")
    return base.replace(**options) if options else base


def check_queue_name(queue: object) -> str:
    """A queue name: a non-empty string that PostgreSQL can store and index (see
    :mod:`sqla_jobs._storable`)."""
    if not isinstance(queue, str) or not queue:
        raise ValueError(f"queue names must be non-empty strings, got {queue!r}")
    check_name(queue, "queue name", QUEUE_MAX_BYTES)
    return queue


#: The largest value each setting takes. Past these a worker fails far from its settings:
#: ``concurrency`` starts a thread per slot until the OS refuses, and a duration past what a
#: ``timedelta`` (or the platform's wait) holds fails the loop that waits on it. Each is far
#: past any use: ten thousand handlers in one process, a day for a lease or a grace
#: period (a heartbeat renews a lease; a longer handler needs no longer one).
MAXIMA: dict[str, float] = {
    "concurrency": 10_000,
    "claim_limit": 10_000,
    "completion_batch": 100_000,
    "lease": 86_400.0,
    "poll_interval": 3_600.0,
    "grace_period": 86_400.0,
    "completion_interval": 60.0,
    "rescue_interval": 86_400.0,
    "prune_interval": 7 * 86_400.0,
    "presence_interval": 3_600.0,
    "stuck_after": 86_400.0,
}
#: Bytes of UTF-8 a worker's name may take.
NAME_MAX_BYTES = 200


def _int(settings: WorkerSettings, name: str, minimum: int, maximum: float) -> None:
    value = getattr(settings, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,.0f}, got {value}")


def _seconds(settings: WorkerSettings, name: str, *, positive: bool) -> None:
    value = getattr(settings, name)
    try:
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value > 0 if positive else value >= 0)
        )
    except OverflowError:  # an int past what a float holds
        ok = False
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    maximum = MAXIMA[name]
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,.0f} seconds, got {value!r}")
    object.__setattr__(settings, name, float(value))

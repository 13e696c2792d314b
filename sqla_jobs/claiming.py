"""Claim and settle jobs in your own transaction: ``session.claim`` and friends.

.. code-block:: python

    with Session.begin() as session:                    # one transaction for all of it
        for job in session.claim("reports", limit=10):  # locked Job objects
            try:
                build_report(**job.args)
            except Exception as exc:
                session.fail(job, exc)                   # retried later, or dead
            else:
                session.complete(job)                    # deleted (or kept as done)

The simplest way to use the queue, for a loop of your own, a cron script, or a web
request that works off a few jobs: no worker, no lease to keep alive. The claim is the
workers' own statement (the ``FOR NO KEY UPDATE SKIP LOCKED`` CTE), so any number of
these loops and workers share a queue without taking a job twice; it also skips a paused
queue, as workers do, and applies the queue's concurrency and rate limits
(:mod:`sqla_jobs.throttle`): a limited queue's claim holds the queue's lock until your
transaction ends, so keep that transaction short. Settling is guarded by ``(id,
attempts)``, like every worker statement, and follows the task's retry policy and
``max_attempts``. Nothing here commits:
the job's outcome, and whatever else your transaction wrote, commit together.

**The trade-off.** The claimed rows stay locked, and the transaction open, while the work
runs. Keep that work short (seconds, not minutes): a long transaction holds back
autovacuum on every table of the database, and holds a connection. If the process dies,
the transaction rolls back and the jobs are ready again at once. For long work, claim in
one transaction and settle in another: the claim then lives on its ``lease``, and a worker
of the same table puts the job back when the lease passes (there is no heartbeat here).

These functions take a ``Session`` (any: ``JobSession`` and ``AsyncJobSession`` have them
as methods) and the registry, from ``jobs=`` or the session's own. Events
(:mod:`sqla_jobs.events`) are fired by workers only: a loop of your own reports its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from ._enqueue import session_registry
from ._queries import (
    ClaimParams,
    batch_params,
    claim_params,
    fail_params,
    fair_claim_params,
    interval,
    limited_statement,
    queue_claim_params,
    snooze_params,
)
from ._settle import cap_error, format_error, settle_children, worker_name
from ._storable import INT_MAX, database_encodings
from .errors import EnqueueError
from .model import JobStatus
from .throttle import QueueLimits

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from typing_extensions import Unpack

    from .tasks import Jobs

__all__ = ["AsyncClaimMixin", "ClaimMixin", "claim", "complete", "fail", "retry", "snooze"]

log = logging.getLogger("sqla_jobs.claiming")

T = TypeVar("T")

#: Attributes a settling statement may change, expired on the object after it.
_SETTLED = ["status", "run_at", "max_attempts", "locked_until", "last_error", "finished_at"]
_NAMES: list[str] = []


def _default_name() -> str:
    """The claimer's name in ``locked_by`` when none is given: ``session:`` and the
    host, pid and a random suffix, made once per process."""
    if not _NAMES:
        _NAMES.append(f"session:{worker_name()}")
    return _NAMES[0]


# The keyword arguments of claim, fail and retry, declared once for the two mixins, which
# only pass them on: the functions below hold the defaults and the checks.
class ClaimOptions(TypedDict, total=False):
    """The keywords of :func:`claim` after ``queue``."""

    limit: int
    lease: float | timedelta
    name: str | None
    jobs: Jobs | None


class FailOptions(TypedDict, total=False):
    """The keywords of :func:`fail` after ``error``."""

    permanent: bool
    jobs: Jobs | None


class RetryOptions(TypedDict, total=False):
    """The keywords of :func:`retry` after ``delay``."""

    error: BaseException | str | None
    jobs: Jobs | None


def claim(
    session: Session,
    queue: str,
    *,
    limit: int = 1,
    lease: float | timedelta = 30.0,
    name: str | None = None,
    jobs: Jobs | None = None,
) -> list[Any]:
    """Claim up to ``limit`` ready jobs of ``queue`` in the session's transaction.

    Returns the claimed ``Job`` objects, locked until the transaction ends, in claim
    order (priority, then due time). Each is ``running``, its ``attempts`` counted, held
    for ``lease`` (seconds or a timedelta) by ``name`` (``locked_by``). A paused queue
    gives nothing.
    """
    registry = _jobs(session, jobs)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= INT_MAX:
        raise ValueError(f"limit must be an integer from 1 to {INT_MAX}, got {limit!r}")
    seconds = lease.total_seconds() if isinstance(lease, timedelta) else lease
    if not seconds > 0:
        raise ValueError(f"lease must be > 0 seconds, got {lease!r}")
    params = claim_params(queue, limit, interval(seconds), name or _default_name())
    model = registry.model
    limits = registry.limits(queue)
    if limits.limited or limits.fair:
        ids = (
            _claim_fair(session, registry, limits, params)
            if limits.fair
            else _claim_limited(session, registry, limits, params)
        )
        found = select(model).where(model.id.in_(ids)) if ids else None
        claimed = (
            []
            if found is None
            else list(session.scalars(found, execution_options={"populate_existing": True}))
        )
    else:
        claimed = list(
            session.scalars(
                select(model).from_statement(registry.queries.session_claim),
                dict(params),
                execution_options={"populate_existing": True},
            )
        )
    # UPDATE ... RETURNING gives rows in no particular order.
    claimed.sort(key=lambda j: (-j.priority, j.run_at, j.id))
    return claimed


def _claim_fair(
    session: Session, registry: Jobs, limits: QueueLimits, params: ClaimParams
) -> list[int]:
    """The fair claim (``fair=True``) in the caller's transaction, over every key (no
    worker here to remember where the last claim stopped). Nothing from a paused queue."""
    queries = registry.queries
    paused = select(queries.queues_table.c.name).where(
        queries.queues_table.c.name == limits.name, queries.queues_table.c.paused
    )
    if session.execute(paused).first() is not None:
        return []
    fair = fair_claim_params(params, limits, None, scan=FIFO_SESSION_SCAN)
    rows = session.execute(queries.fair_claim(), dict(fair)).all()
    return [r.id for r in rows if r.id is not None]


def _claim_limited(
    session: Session, registry: Jobs, limits: QueueLimits, params: ClaimParams
) -> list[int]:
    """The workers' limited claim (:mod:`sqla_jobs.throttle`) in the caller's transaction:
    the queue's lock, held until that transaction ends (so the queue's other limited
    claims wait for it), then the claim. Needs READ COMMITTED, under which the claim sees
    what committed while it waited for the lock, and a transaction that holds the lock
    to its end: in autocommit the lock's own statement would release it at once (the
    driver's own flag says so, without a query).

    The level is asked in the claim's own transaction (``SHOW``, which takes no snapshot,
    so the level it names is the one the claim runs at). SQLAlchemy's
    ``get_isolation_level`` asked in a transaction of its own on an idle connection:
    behind PgBouncer in transaction mode the claim's transaction could then run on
    another server connection, one opened under another ``default_transaction_isolation``
    (``ALTER DATABASE ... SET``), and a REPEATABLE READ claim, blind to the claims
    committed while it waited for the lock, went past the queue's concurrency."""
    connection = session.connection()
    if getattr(connection.connection.dbapi_connection, "autocommit", False):
        level = "AUTOCOMMIT"
    else:
        shown = connection.exec_driver_sql("SHOW transaction_isolation").scalar()
        level = str(shown).upper()
    if level != "READ COMMITTED":
        raise ValueError(
            f"queue {limits.name!r} has limits, which session.claim can only enforce under "
            f"READ COMMITTED isolation (this transaction is {level})"
        )
    queries = registry.queries
    paused = select(queries.queues_table.c.name).where(
        queries.queues_table.c.name == limits.name, queries.queues_table.c.paused
    )
    if session.execute(paused).first() is not None:
        return []
    session.execute(queries.limit_lock, {"queue_name": limits.name})
    limited = queue_claim_params(params, limits)
    if limits.key_order is not None:
        # No worker here to remember where the last claim's walk over the keys stopped:
        # walk them all (a probe or two per key), so that none is out of reach.
        limited["scan"] = max(limited["scan"], FIFO_SESSION_SCAN)
    rows = session.execute(limited_statement(queries, limited), dict(limited)).all()
    return [r.id for r in rows if r.id is not None]


#: How many keys ``session.claim`` walks in a queue in key order (all of them, in practice).
FIFO_SESSION_SCAN = 1_000_000


def complete(session: Session, job: Any, *, jobs: Jobs | None = None) -> bool:
    """The job is done: deleted (or kept as ``done`` with ``Jobs(keep_done=...)``), in the
    session's transaction. False if this claim was no longer held (nothing changed).

    A deleted job's object leaves the session (``expunge``), so that nothing the session
    flushes later can touch the row.
    """
    registry = _jobs(session, jobs)
    done = session.execute(registry.queries.complete, dict(batch_params([job]))).first()
    if done is None:
        return False
    if done.has_children:  # workflows: its children are released in this transaction
        settle_children(session, registry.queries, [job.id], [])
    if registry.keep_done is None:
        session.expunge(job)
    else:
        session.expire(job, _SETTLED)
    return True


def fail(
    session: Session,
    job: Any,
    error: BaseException | str,
    *,
    permanent: bool = False,
    jobs: Jobs | None = None,
) -> JobStatus | None:
    """The attempt failed: the job is retried after its task's retry policy (scheduled),
    or dead if that was its last attempt or ``permanent`` is true. ``error`` (an exception,
    with its traceback, or a text) goes to ``last_error``. Returns the new status, or None
    if this claim was no longer held."""
    registry = _jobs(session, jobs)
    task = registry.tasks.get(job.task)
    policy = task.retry if task is not None else registry.retry
    return _fail(session, registry, job, _error_text(error), _delay(policy, job), permanent)


def retry(
    session: Session,
    job: Any,
    delay: float | timedelta = 0.0,
    *,
    error: BaseException | str | None = None,
    jobs: Jobs | None = None,
) -> JobStatus | None:
    """Run the job again after ``delay``; the attempt counts (dead if it was the last).
    Returns the new status, or None if this claim was no longer held."""
    registry = _jobs(session, jobs)
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not seconds >= 0:
        raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
    text = None if error is None else _error_text(error)
    return _fail(session, registry, job, text, seconds, False)


def snooze(
    session: Session, job: Any, delay: float | timedelta, *, jobs: Jobs | None = None
) -> bool:
    """ "Not yet": run the job again after ``delay`` without using an attempt. False if
    this claim was no longer held."""
    registry = _jobs(session, jobs)
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not seconds >= 0:
        raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
    row = session.execute(registry.queries.snooze, dict(snooze_params(job, seconds))).first()
    session.expire(job, _SETTLED)
    return row is not None


def _fail(
    session: Session,
    registry: Jobs,
    job: Any,
    error: str | None,
    delay: float,
    permanent: bool,
) -> JobStatus | None:
    if error is not None and not error.isascii():
        # What a LATIN1 database or a WIN1252 client cannot carry, escaped ('\u20ac'), as
        # the worker writes its failures: the driver's encoder refused the statement.
        encodings = database_encodings(session.connection())
        if encodings is not None:
            error = encodings.escape(error)
    params = fail_params(job, error, delay, permanent=permanent)
    row = session.execute(registry.queries.fail, dict(params)).first()
    if row is not None and row.status == JobStatus.DEAD and row.has_children:
        settle_children(session, registry.queries, [], [job.id])
    session.expire(job, _SETTLED)
    return None if row is None else JobStatus(row.status)


def _jobs(session: Session, jobs: Jobs | None) -> Jobs:
    registry = jobs or session_registry(session)
    if registry is None:
        raise EnqueueError(
            "this session has no Jobs registry: create it with sessionmaker(..., jobs=jobs) "
            "or pass jobs="
        )
    return registry


def _delay(policy: Callable[[int], float], job: Any) -> float:
    """Seconds before the next attempt; a broken retry policy must not lose the job."""
    try:
        return max(0.0, float(policy(job.attempts)))
    except Exception:
        log.exception("task %s: retry policy failed; retrying in 60s", job.task)
        return 60.0


def _error_text(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        return format_error(error)
    return cap_error(str(error))


class ClaimMixin:
    """``claim``, ``complete``, ``fail``, ``retry`` and ``snooze`` as methods of a
    ``Session`` (:class:`~sqla_jobs.JobSession` has them). See :mod:`sqla_jobs.claiming`."""

    def claim(self, queue: str, **options: Unpack[ClaimOptions]) -> list[Any]:
        """See :func:`sqla_jobs.claiming.claim`."""
        return claim(_session(self), queue, **options)

    def complete(self, job: Any, *, jobs: Jobs | None = None) -> bool:
        """See :func:`sqla_jobs.claiming.complete`."""
        return complete(_session(self), job, jobs=jobs)

    def fail(
        self, job: Any, error: BaseException | str, **options: Unpack[FailOptions]
    ) -> JobStatus | None:
        """See :func:`sqla_jobs.claiming.fail`."""
        return fail(_session(self), job, error, **options)

    def retry(
        self, job: Any, delay: float | timedelta = 0.0, **options: Unpack[RetryOptions]
    ) -> JobStatus | None:
        """See :func:`sqla_jobs.claiming.retry`."""
        return retry(_session(self), job, delay, **options)

    def snooze(self, job: Any, delay: float | timedelta, *, jobs: Jobs | None = None) -> bool:
        """See :func:`sqla_jobs.claiming.snooze`."""
        return snooze(_session(self), job, delay, jobs=jobs)


def _session(session: Any) -> Session:
    assert isinstance(session, Session)
    return session


class AsyncClaimMixin:
    """The same methods, awaited, for an ``AsyncSession``
    (:class:`~sqla_jobs.aio.AsyncJobSession` has them)."""

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        session: AsyncSession = self  # type: ignore[assignment]
        return await session.run_sync(fn, *args, **kw)

    async def claim(self, queue: str, **options: Unpack[ClaimOptions]) -> list[Any]:
        """See :func:`sqla_jobs.claiming.claim`."""
        return await self._run(claim, queue, **options)

    async def complete(self, job: Any, *, jobs: Jobs | None = None) -> bool:
        """See :func:`sqla_jobs.claiming.complete`."""
        return await self._run(complete, job, jobs=jobs)

    async def fail(
        self, job: Any, error: BaseException | str, **options: Unpack[FailOptions]
    ) -> JobStatus | None:
        """See :func:`sqla_jobs.claiming.fail`."""
        return await self._run(fail, job, error, **options)

    async def retry(
        self, job: Any, delay: float | timedelta = 0.0, **options: Unpack[RetryOptions]
    ) -> JobStatus | None:
        """See :func:`sqla_jobs.claiming.retry`."""
        return await self._run(retry, job, delay, **options)

    async def snooze(self, job: Any, delay: float | timedelta, *, jobs: Jobs | None = None) -> bool:
        """See :func:`sqla_jobs.claiming.snooze`."""
        return await self._run(snooze, job, delay, jobs=jobs)

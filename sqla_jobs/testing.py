"""Testing code that enqueues jobs: assertions, a synchronous runner, pytest fixtures.

.. code-block:: python

    from sqla_jobs.testing import assert_enqueued, run_queued_jobs

    def test_signup_sends_a_welcome_email(session):      # an uncommitted test transaction
        signup(session, email="a@example.com")             # the code under test enqueues
        assert_enqueued(session, send_welcome, email="a@example.com")
        summary = run_queued_jobs(session, jobs)           # runs the real handlers, here
        assert summary.succeeded == 1

Everything here works *inside* the test's transaction, through the session it is given:
nothing commits, so a test that rolls back at the end leaves no job behind, and jobs
enqueued by the code under test are visible without a commit.

This module needs no test framework. The pytest fixtures (``sqla_jobs_engine``,
``sqla_jobs_session`` and friends) are in :mod:`sqla_jobs.pytest_plugin`, opt-in:
``pytest_plugins = ["sqla_jobs.pytest_plugin"]`` in the top-level ``conftest.py``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from . import admin
from ._enqueue import session_registry
from ._queries import ClaimParams, claim_params, interval, limited_claim_params, limited_statement
from ._settle import settle_children
from ._tasks import Task
from .claiming import FIFO_SESSION_SCAN
from .db import require_postgresql
from .model import LIVE_STATUSES, JobStatus
from .session import insert_pending, pending_jobs
from .tasks import Jobs
from .worker import Worker
from .worker.job import ClaimedJob, Outcome, OutcomeKind, decode_rows, outcome_statements

__all__ = [
    "EnqueuedJob",
    "JobRun",
    "RunSummary",
    "assert_enqueued",
    "assert_not_enqueued",
    "enqueued_jobs",
    "run_queued_jobs",
]

_MISSING = object()


# -- what is enqueued ---------------------------------------------------------------------


@dataclass(frozen=True)
class EnqueuedJob:
    """A live job as a test sees it: a row, or one not inserted yet.

    ``id`` is ``None`` for a job still waiting in the session (``enqueue_many`` rows wait
    for the next flush; ``enqueue`` objects wait for it when autoflush is off).
    """

    task: str
    args: dict[str, Any]
    queue: str
    status: str
    id: int | None = None
    run_at: datetime | None = None

    def describe(self) -> str:
        where = f"id {self.id}" if self.id is not None else "not flushed yet"
        return f"{self.task}({_call(self.args)}) [queue {self.queue!r}, {self.status}, {where}]"


def enqueued_jobs(session: Session, jobs: Jobs) -> list[EnqueuedJob]:
    """Every live (scheduled, ready, running) job of ``jobs``' table the session can see.

    Rows are read through the session, so they include what its transaction enqueued and
    has not committed; the query autoflushes as the session is configured to. Jobs still
    held by the session are added: ``enqueue_many`` rows before their flush, and
    ``enqueue`` objects when autoflush is off. Nothing is flushed or written here.
    """
    model = jobs.model
    c = [getattr(model, name) for name in ("id", "task", "args", "queue", "status", "run_at")]
    stmt = sa.select(*c).where(model.status.in_(LIVE_STATUSES)).order_by(model.id)
    found = [
        EnqueuedJob(r.task, dict(r.args), r.queue, r.status, r.id, r.run_at)
        for r in session.execute(stmt)
    ]
    for obj in session.new:
        if isinstance(obj, model) and obj.status in (None, *LIVE_STATUSES):
            found.append(
                EnqueuedJob(
                    obj.task, dict(obj.args), obj.queue, obj.status or JobStatus.READY.value
                )
            )
    pending = pending_jobs(session)
    for registry, rows in pending.items():
        if registry.table is jobs.table:
            found.extend(
                EnqueuedJob(r["task"], dict(r["args"]), r["queue"], r["status"]) for r in rows
            )
    return found


def assert_enqueued(
    session: Session, task: Task[Any, Any] | str, /, *, queue: str | None = None, **args: Any
) -> list[EnqueuedJob]:
    """Fail unless a live job of ``task`` whose arguments include ``args`` is enqueued.

    Only the arguments given are compared (a subset match), after a JSON round trip, as
    they are stored: an expected tuple matches a stored list. Returns the matching jobs, so a
    test can also check how many. The failure message lists what *was* enqueued.

    :param task: the task, or its name (the session must then have a registry:
        ``sessionmaker(..., jobs=jobs)``).
    :param queue: also require this queue.
    :param args: handler arguments by parameter name; a name the handler does not take
        is an error, not a silent mismatch.
    """
    __tracebackhide__ = True
    registry, name, expected = _expectation(session, task, args)
    everything = enqueued_jobs(session, registry)
    matching = [j for j in everything if _matches(j, name, queue, expected)]
    if not matching:
        wanted = _wanted(name, queue, expected)
        raise AssertionError(f"no job {wanted} was enqueued.\n{_listing(everything)}")
    return matching


def assert_not_enqueued(
    session: Session, task: Task[Any, Any] | str, /, *, queue: str | None = None, **args: Any
) -> None:
    """Fail if a live job of ``task`` whose arguments include ``args`` is enqueued.

    With no ``args``, any job of that task fails it.
    """
    __tracebackhide__ = True
    registry, name, expected = _expectation(session, task, args)
    matching = [j for j in enqueued_jobs(session, registry) if _matches(j, name, queue, expected)]
    if matching:
        wanted = _wanted(name, queue, expected)
        lines = "\n".join(f"  - {j.describe()}" for j in matching)
        raise AssertionError(f"expected no job {wanted}, found {len(matching)}:\n{lines}")


def _expectation(
    session: Session, task: Task[Any, Any] | str, args: dict[str, Any]
) -> tuple[Jobs, str, dict[str, Any]]:
    if isinstance(task, Task):
        resolved: Task[Any, Any] = task
    elif isinstance(task, str):
        registry = session_registry(session)
        if not isinstance(registry, Jobs):
            raise TypeError(
                f"cannot resolve task name {task!r}: pass the task itself, or create the "
                "session with sessionmaker(..., jobs=jobs)"
            )
        resolved = registry.get(task)
    else:
        raise TypeError(f"expected a task or a task name, got {task!r}")
    params = resolved.signature.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in args if k not in params)
    if unknown and not takes_kwargs:
        raise TypeError(
            f"task {resolved.name!r} takes no parameter(s) {', '.join(unknown)}; "
            f"its parameters are {', '.join(params) or '(none)'}"
        )
    expected = {k: json.loads(json.dumps(v)) for k, v in args.items()}
    return resolved.registry, resolved.name, expected


def _matches(job: EnqueuedJob, task: str, queue: str | None, expected: dict[str, Any]) -> bool:
    if job.task != task or (queue is not None and job.queue != queue):
        return False
    return all(job.args.get(k, _MISSING) == v for k, v in expected.items())


def _wanted(task: str, queue: str | None, expected: dict[str, Any]) -> str:
    text = f"{task}({_call(expected)})" if expected else f"of task {task!r}"
    return text + (f" on queue {queue!r}" if queue is not None else "")


def _listing(jobs: list[EnqueuedJob]) -> str:
    if not jobs:
        return "Nothing is enqueued."
    lines = "\n".join(f"  - {j.describe()}" for j in jobs)
    return f"Enqueued ({len(jobs)}):\n{lines}"


def _call(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


# -- running jobs in the test -------------------------------------------------------------


@dataclass(frozen=True)
class JobRun:
    """One attempt run by :func:`run_queued_jobs`.

    ``outcome`` is named as the events are (:mod:`sqla_jobs.events`): ``"succeeded"``,
    ``"retried"`` (failed; another attempt is scheduled), ``"dead"`` (failed; none is
    left, or the failure was permanent) or ``"snoozed"``.
    """

    id: int
    task: str
    queue: str
    attempt: int
    outcome: str
    error: str | None = None


@dataclass
class RunSummary:
    """What :func:`run_queued_jobs` did, attempt by attempt."""

    runs: list[JobRun] = field(default_factory=list)

    @property
    def ran(self) -> int:
        """Attempts run (a job retried within the run counts once per attempt)."""
        return len(self.runs)

    @property
    def succeeded(self) -> int:
        return self._count("succeeded")

    @property
    def done(self) -> int:
        """Deprecated since 0.2: :attr:`succeeded`, the name the events use."""
        warnings.warn(
            "RunSummary.done is now RunSummary.succeeded", DeprecationWarning, stacklevel=2
        )
        return self.succeeded

    @property
    def failed(self) -> int:
        """Failed attempts, whether they will be retried or not."""
        return self._count("retried") + self._count("dead")

    @property
    def retried(self) -> int:
        return self._count("retried")

    @property
    def dead(self) -> int:
        return self._count("dead")

    @property
    def snoozed(self) -> int:
        return self._count("snoozed")

    @property
    def errors(self) -> list[str]:
        """The tracebacks of the failed attempts, in order."""
        return [r.error or "" for r in self.runs if r.outcome in ("retried", "dead")]

    def raise_errors(self) -> None:
        """Fail the test with the tracebacks of the failed attempts, if there were any."""
        __tracebackhide__ = True
        failed = [r for r in self.runs if r.outcome in ("retried", "dead")]
        if failed:
            parts = [
                f"job {r.id} ({r.task}) attempt {r.attempt} failed ({r.outcome}):\n{r.error}"
                for r in failed
            ]
            raise AssertionError("\n".join(parts))

    def _count(self, outcome: str) -> int:
        return sum(1 for r in self.runs if r.outcome == outcome)

    def __str__(self) -> str:
        return (
            f"ran {self.ran}: {self.succeeded} succeeded, {self.retried} retried, "
            f"{self.dead} dead, {self.snoozed} snoozed"
        )


def run_queued_jobs(
    session: Session,
    jobs: Jobs,
    queues: Sequence[str] | None = None,
    *,
    include_scheduled: bool = False,
    max_runs: int = 1000,
) -> RunSummary:
    """Run queued jobs in this process, one at a time, until none is ready.

    The jobs go through the real statements (``jobs.queries.claim``, then ``complete``,
    ``fail`` or ``snooze``), on the session's own connection, so jobs the test enqueued
    without committing are found, and what the run changes rolls back with the test.
    Handlers run as a worker runs them (the worker's own code; :func:`~sqla_jobs.current_job`
    works, events fire), except that a transactional task gets a session of its own on
    this session's connection (a ``JobSession``, or the registry's ``session_factory``'s),
    whose transaction is a savepoint: its writes and its completion land in the test's
    transaction together, and a failure, or its own ``rollback()``, rolls back its writes
    only. As on a worker, it may not commit. (Flask-SQLAlchemy's ``db.session`` is this
    session itself, behind a savepoint.) Objects of this session are expired after such a
    run: they load what the handler wrote when next read.

    Jobs a handler enqueues are run too, within the same call. Paused queues are skipped,
    as a worker skips them. A queue's limits (concurrency, rates) and fair share are not
    applied; its order per key (``key_order="fifo"``) is: a job waits while an earlier job
    of its key is unfinished (a retry scheduled), or dead with ``on_head_failure="hold"``.

    Time does not pass inside a transaction (``now()`` is when it began), so a failed
    attempt's retry and a delayed job stay scheduled: they show in the summary and in the
    table, and do not run. ``include_scheduled=True`` runs them anyway, as if their time had
    come, which runs a failing job through all its attempts until it is dead.

    Handlers that open their own connections do not see the test's uncommitted rows, and
    must not write rows the test transaction has written (they would wait on its locks
    forever); a transactional task, which gets the session, has neither problem. An
    ``async def`` handler is run with ``asyncio.run``, so call this from a synchronous test.

    :param queues: only these queues (default: every queue with ready jobs).
    :param max_runs: give up (``RuntimeError``) after this many attempts: a job that keeps
        enqueueing itself, or snoozing under ``include_scheduled``, would never end.
    """
    bind = session.get_bind(jobs.model)
    # The claim and the completions are PostgreSQL's SQL (UPDATE in a WITH, FOR UPDATE SKIP
    # LOCKED, unnest): on SQLite, say so rather than fail inside a statement.
    require_postgresql(bind, "run_queued_jobs (it runs the worker's own statements)")
    engine = bind if isinstance(bind, sa.Engine) else bind.engine
    worker = Worker(jobs, engine, concurrency=1, listen=False, name="sqla_jobs.testing")
    q = jobs.queries
    table = jobs.table
    summary = RunSummary()
    while True:
        conn = _flushed_connection(session)
        conn.execute(q.promote, {"limit": 10000}).all()
        if include_scheduled:
            _make_scheduled_due(conn, table, queues)
        paused = admin.paused_queues(conn, jobs)
        names = [n for n in (queues or _ready_queues(conn, table)) if n not in paused]
        claimed = False
        for name in names:
            params = claim_params(name, 1, interval(3600), worker.name)
            row = _claim_one(conn, jobs, name, params)
            if row is None:
                continue
            claimed = True
            if summary.ran >= max_runs:
                raise RuntimeError(
                    f"run_queued_jobs: still running jobs after {max_runs} attempts ({summary}); "
                    "a job may enqueue itself, or snooze, forever"
                )
            readable, unreadable = decode_rows([row], worker.name)
            outcome = unreadable[0] if unreadable else _run(worker, session, readable[0])
            summary.runs.append(_record(session, q, outcome))
        if not claimed:
            break
    _expire_jobs(session, jobs)
    return summary


def _claim_one(conn: sa.Connection, jobs: Jobs, queue: str, params: ClaimParams) -> Any:
    """One job of ``queue``, claimed, or None. The plain claim, rates and concurrency
    ignored; but of a queue in key order only a job at the head of its key, as a worker
    claims them (the workers' limited claim, without its limits, walking every key): the
    plain claim ran a key's second job while its first waited for its retry, or was dead
    and held the key."""
    queries = jobs.queries
    limits = jobs.limits(queue)
    if limits.key_order is None:
        return conn.execute(queries.claim, dict(params)).first()
    limited = limited_claim_params(
        params,
        concurrency=None,
        rate=None,
        period=None,
        key_limit=limits.key_concurrency,
        keyed=True,
        fifo=limits.key_order == "fifo",
        hold=limits.on_head_failure == "hold",
    )
    limited["scan"] = FIFO_SESSION_SCAN
    rows = conn.execute(limited_statement(queries, limited), dict(limited)).all()
    return next((row for row in rows if row.id is not None), None)


def _flushed_connection(session: Session) -> sa.Connection:
    """The session's connection, with everything it holds written (jobs included)."""
    session.flush()
    insert_pending(session)
    return session.connection()


def _ready_queues(conn: sa.Connection, table: sa.Table) -> list[str]:
    c = table.c
    stmt = sa.select(c.queue).where(c.status == JobStatus.READY).distinct().order_by(c.queue)
    return list(conn.execute(stmt).scalars())


def _make_scheduled_due(conn: sa.Connection, table: sa.Table, queues: Sequence[str] | None) -> None:
    c = table.c
    stmt = (
        sa.update(table)
        # Not a job held for its parents (after=): it runs when they have succeeded.
        .where(c.status == JobStatus.SCHEDULED, sa.or_(c.waiting.is_(None), c.waiting == 0))
        .values(status=JobStatus.READY, run_at=sa.func.now())
    )
    if queues:
        stmt = stmt.where(c.queue.in_(list(queues)))
    conn.execute(stmt)


def _run(worker: Worker, session: Session, job: ClaimedJob) -> Outcome:
    # A transactional task joins the test's transaction (behind a savepoint) instead of
    # committing a session of its own; everything else is exactly the worker's path.
    return worker.execute(job, session=session)


def _record(session: Session, q: Any, outcome: Outcome) -> JobRun:
    """Write one outcome with the real statements, and say what it did."""
    job = outcome.job
    conn = session.connection()
    # A settled outcome (written by the worker's own path) was a success.
    result = "snoozed" if outcome.kind is OutcomeKind.SNOOZED else "succeeded"
    for statement, params in outcome_statements(q, [outcome]):
        row = conn.execute(statement, params).first()
        if outcome.kind is OutcomeKind.FAILED:
            result = "dead" if row is not None and row.status == JobStatus.DEAD else "retried"
        # Workflows: children of this job are released (or cancelled) as a worker would.
        if row is not None and getattr(row, "has_children", False):
            dead = outcome.kind is OutcomeKind.FAILED and row.status == JobStatus.DEAD
            if dead or outcome.kind is OutcomeKind.SUCCEEDED:
                settle_children(conn, q, [] if dead else [job.id], [job.id] if dead else [])
    return JobRun(job.id, job.task, job.queue, job.attempts, result, outcome.error)


def _expire_jobs(session: Session, jobs: Jobs) -> None:
    """Job objects in the session are stale now (their rows changed or were deleted)."""
    for obj in list(session.identity_map.values()):
        if isinstance(obj, jobs.model):
            session.expire(obj)


# -- the pytest plugin's former home ------------------------------------------------------

#: What ``pytest_plugins = ["sqla_jobs.testing"]`` found here before 0.2. It is still
#: served, with a DeprecationWarning, so that such a conftest keeps working for a release.
_FIXTURES = (
    "sqla_jobs_database_url",
    "sqla_jobs_metadata",
    "sqla_jobs_registry",
    "sqla_jobs_engine",
    "sqla_jobs_connection",
    "sqla_jobs_session",
)


def pytest_addoption(parser: Any) -> None:
    """Only called when this module is loaded as a pytest plugin (the old way)."""
    from . import pytest_plugin

    warnings.warn(
        "the pytest plugin moved: use pytest_plugins = ['sqla_jobs.pytest_plugin'] "
        "instead of 'sqla_jobs.testing'",
        DeprecationWarning,
        stacklevel=1,
    )
    pytest_plugin.pytest_addoption(parser)


def __getattr__(name: str) -> Any:
    # pytest looks the fixtures up by name; nothing else asks for them here.
    if name in _FIXTURES:
        from . import pytest_plugin

        return getattr(pytest_plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FIXTURES])

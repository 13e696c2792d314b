"""Results and workflows: keep what a job returned, wait for it, and run jobs after others.

.. code-block:: python

    @jobs.task(keep_result=True)
    def resize(image_id: int) -> dict[str, int]: ...

    @jobs.task(keep_result=True)
    def publish(image_id: int, results: list[dict[str, int]]) -> None: ...

    with Session.begin() as session:                       # one transaction: all or nothing
        a = session.enqueue(resize, image_id=1)
        b = session.enqueue(resize, image_id=2)
        c = session.enqueue(notify.with_options(after=[a, b]), image_id=1)   # after both
        jobs.group(session, [(resize, resize.args(image_id=3)), (resize, resize.args(image_id=4))],
                   then=(publish, publish.args(image_id=9)))   # publish gets both results

    jobs.result(engine, a.id, timeout=30)                  # waits through LISTEN/NOTIFY,
                                                           # or polls behind a pooler

.. warning::

    A job can only wait for jobs of its own table, that exist when it is enqueued (a job
    that succeeded without ``keep_result`` is deleted at once). A parent that ends dead
    or cancelled cancels what waits on it unless ``on_parent_failure="run"``; retrying
    that parent (``admin.retry_jobs``, the CLI, the dashboard) brings them back, waiting
    for it again.

How it is stored (docs/howto/workflows.md says why):

* ``result jsonb``: the return value of a job enqueued with ``keep_result``; the row stays
  ``done`` until ``locked_until`` (its retention) and is pruned after.
* ``parents bigint[]`` and ``waiting int`` on the child: it is held as ``scheduled`` at
  ``run_at`` in the year 9999 (no new status, so the CHECK constraint is unchanged) until
  ``waiting`` reaches 0. ``<table>_parents`` (GIN) finds a parent's children.
* ``meta`` keys in the library's ``sqla_jobs.`` namespace mark what the worker must know
  from the claimed row alone: ``sqla_jobs.keep`` (seconds), ``sqla_jobs.children`` (this
  job has dependents; ``false`` once a dead or cancelled parent's children were
  settled), ``sqla_jobs.run_anyway``, ``sqla_jobs.results`` and
  ``sqla_jobs.cancelled_by_parent`` (cancelled because a parent ended: retrying that
  parent brings it back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypedDict

import psycopg
import sqlalchemy as sa

from ._enqueue import _sync, bind, link, place_on_session
from ._queries import listen_sql, unlisten_sql
from ._storable import BIGINT_MAX
from ._tasks import ConfiguredTask, Task, TaskArgs
from .errors import EnqueueError, JobFailedError
from .model import KEEP_KEY, RESULTS_KEY, JobStatus
from .session import _announce, _boundary

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.orm import Session
    from typing_extensions import Unpack

    from ._queries import Queries
    from .tasks import Jobs

__all__ = ["group", "link", "result", "result_async"]

# ``link`` (and ``after=``'s other machinery: the held placeholder, deferred links) lives in
# sqla_jobs._enqueue, the one writer of job rows; it is named here, where it was public.


# -- groups ---------------------------------------------------------------------------


def group(
    session: Session,
    members: Iterable[tuple[Task[Any, Any] | ConfiguredTask[Any, Any], TaskArgs[Any]] | Any],
    then: Any,
    *,
    results: str = "results",
) -> tuple[list[Any], Any]:
    """Enqueue jobs and a callback that runs once, after all of them succeeded, with their
    return values (in the order given) as its ``results`` argument.

    ``members`` are ``(task, task.args(...))`` pairs; ``then`` is ``(callback_task,
    callback_task.args(...))`` for the callback's other arguments. Each member keeps its
    result (``keep_result=True`` unless its task keeps it longer). Everything is added to
    ``session`` (one transaction: the group is created whole or not at all). Returns the
    member jobs and the callback job. If a member ends dead, the callback is cancelled.
    """
    # Any session with enqueue: JobSession and its kin, or an AsyncJobSession (a proxy
    # of one, whose enqueue does no I/O).
    enqueue = getattr(session, "enqueue", None)
    if not callable(enqueue):
        raise TypeError("jobs.group takes a session with enqueue (sqla_jobs.JobSession)")
    added: list[Any] = []
    for member in members:
        task, args = _pair(member, "member")
        options: dict[str, Any] = {}
        plain = task.task if isinstance(task, ConfiguredTask) else task
        bound = task.options if isinstance(task, ConfiguredTask) else {}
        if not plain.keep_result and "keep_result" not in bound:
            options["keep_result"] = True
        job = enqueue(task.with_options(**options), *args.args, **args.kwargs)
        if job is None:
            # A scoped unique member whose key a finished job holds (its period is not
            # over): nothing was enqueued, and nothing would give this member's result.
            raise EnqueueError(
                f"jobs.group: member {len(added) + 1} ({plain.name}) was not enqueued: a "
                "finished job holds its unique key for its period (unique_for); a group's "
                "members must each be a job to wait for"
            )
        if KEEP_KEY not in (getattr(job, "meta", None) or {}):
            # A unique member whose key a live job holds, enqueued earlier without
            # keep_result: that job keeps nothing (deleted when it succeeds), and the
            # callback would get null for it. Not made to keep it here: a worker that
            # claimed it already decides from the meta it claimed.
            raise EnqueueError(
                f"jobs.group: member {len(added) + 1} ({plain.name}) is job {job.id}, "
                "enqueued earlier under the same unique key without keep_result: it keeps "
                "no result to give the callback (enqueue it with keep_result=, or give "
                "the member another unique key)"
            )
        added.append(job)
    if not added:
        raise EnqueueError("jobs.group needs at least one member job")
    cb_task, cb_args = _pair(then, "then")
    if results in cb_args.kwargs:
        raise EnqueueError(
            f"jobs.group: the callback's {results!r} argument is filled by the group"
        )
    plain = cb_task.task if isinstance(cb_task, ConfiguredTask) else cb_task
    if results not in plain.signature.parameters:
        raise EnqueueError(
            f"jobs.group: callback task {plain.name!r} has no parameter {results!r} "
            "to receive the results"
        )
    registry = plain.registry
    cb_options = dict(cb_task.options) if isinstance(cb_task, ConfiguredTask) else {}
    if "after" in cb_options:
        raise EnqueueError("jobs.group: the callback waits for the group, not for after=")
    # Checked with a placeholder for the results (filled when the last member succeeds).
    pending = bind(
        registry,
        plain,
        cb_args.args,
        {**cb_args.kwargs, results: []},
        {**cb_options, "after": added},
    )
    row = pending.row
    row["args"].pop(results, None)
    row["meta"] = {**(row.get("meta") or {}), RESULTS_KEY: results}
    # A sharded session (sqla_jobs.sharding): the callback goes to its members' shard,
    # where its link and the ids it waits for are.
    sync = _sync(session)
    shard_of_jobs = getattr(sync, "shard_of_jobs", None)
    shard = None if shard_of_jobs is None else shard_of_jobs(added, "jobs.group: the members")
    callback, _ = place_on_session(session, pending)
    if shard is not None:
        sync.place_on_shard(callback, shard)  # type: ignore[attr-defined]
    if registry.events.wants("enqueued"):
        _announce(sync, registry, [callback], _boundary(sync))
    return added, callback


def _pair(item: Any, what: str) -> tuple[Any, TaskArgs[Any]]:
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], (Task, ConfiguredTask))
        and isinstance(item[1], TaskArgs)
    ):
        return item[0], item[1]
    raise EnqueueError(f"jobs.group: each {what} is (task, task.args(...)), got {item!r}")


# -- waiting for a result ---------------------------------------------------------------


class _Waiting:
    """The outcome of one look at the row: a value, an error, or "not yet"."""

    def __init__(self, done: bool, value: Any = None) -> None:
        self.done, self.value = done, value


def _look(conn: sa.Connection, queries: Queries, job_id: int) -> _Waiting:
    row = conn.execute(queries.outcome, {"job_id": job_id}).first()
    if row is None:
        raise LookupError(
            f"job {job_id} is not in {queries.table.fullname}: it never existed, or it "
            "finished and was deleted (enqueue it with keep_result= to wait for its result)"
        )
    status, result, last_error, task, meta_text = row  # JSON as text (see queries.outcome)
    meta = None if meta_text is None else json.loads(meta_text)
    value = None if result is None else json.loads(result)
    if status == JobStatus.DONE:
        if KEEP_KEY not in (meta or {}):
            raise LookupError(
                f"job {job_id} ({task}) succeeded but did not keep its result "
                "(enqueue it with keep_result=)"
            )
        return _Waiting(True, value)
    if status in (JobStatus.DEAD, JobStatus.CANCELLED):
        raise JobFailedError(job_id, status, last_error)
    if KEEP_KEY not in (meta or {}):
        raise LookupError(
            f"job {job_id} ({task}) does not keep its result: nothing announces when it "
            "finishes (enqueue it with keep_result=)"
        )
    return _Waiting(False)


def _timeout(job_id: int, timeout: float) -> TimeoutError:
    return TimeoutError(f"job {job_id} did not finish within {timeout:g}s")


#: Longest wait for a NOTIFY before looking at the row again: a safety net for a
#: notification missed while the listening connection was being set up elsewhere; the
#: wait normally ends with the notification itself.
_RECHECK = 5.0

#: Without notifications (``listen=False``, or behind a pooler), the row is looked at
#: again after this many seconds, then after 1.5 times as long each time, up to
#: ``_POLL_MAX``: a quick job's result comes within tens of milliseconds, a long one's
#: within half a second of its end, for a few cheap primary-key reads a second.
_POLL_FIRST = 0.02
_POLL_GROWTH = 1.5
_POLL_MAX = 0.5

#: Per engine: whether its connections reach PostgreSQL itself (found out once; see
#: :func:`_direct`). Weak: the engine's life is its owner's.
_DIRECT: weakref.WeakKeyDictionary[sa.Engine, bool] = weakref.WeakKeyDictionary()


def _direct(conn: sa.Connection) -> bool:
    """Whether ``conn`` reaches PostgreSQL itself rather than through a pooler.

    A pooler (PgBouncer, in any mode) gives its clients cancel keys of its own, so the
    backend pid the server announced at login is not the pid of the server process that
    runs the next statement. A LISTEN behind a pooler in transaction mode would run on a
    server connection that is then lent to other clients: it hears nothing, and stays
    there (PgBouncer logs ``got packet 'A' from server when not linked`` for every
    notification). One round trip, once per engine.
    """
    announced = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
    return bool(announced == conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())


class WaitOptions(TypedDict, total=False):
    """How :func:`result` and :func:`result_async` wait (see :meth:`Jobs.result
    <sqla_jobs.Jobs.result>`): ``timeout``, seconds at most (None, the default: as long as
    it takes); ``listen``, whether to LISTEN rather than poll (None, the default: LISTEN
    where the engine reaches PostgreSQL itself, not through a pooler)."""

    timeout: float | None
    listen: bool | None


def _check_job_id(job_id: object) -> None:
    """An id the ``bigint`` column can hold (past it PostgreSQL refused the look)."""
    if not isinstance(job_id, int) or isinstance(job_id, bool) or not 1 <= job_id <= BIGINT_MAX:
        raise ValueError(f"job_id must be an integer from 1 to {BIGINT_MAX}, got {job_id!r}")


class _Clock:
    """The timing of one wait for a result, the same whether it is awaited or not: when
    to look at the row again, and when to give up (``TimeoutError``)."""

    __slots__ = ("deadline", "job_id", "pause", "timeout")

    def __init__(self, job_id: int, timeout: float | None) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.pause = _POLL_FIRST

    @classmethod
    def of(
        cls, job_id: int, *, timeout: float | None = None, listen: bool | None = None
    ) -> tuple[_Clock, bool | None]:
        """The clock of a wait given :class:`WaitOptions` (their defaults are these), and
        its ``listen``; an unknown keyword is a ``TypeError`` here."""
        return cls(job_id, timeout), listen

    def _left(self, most: float) -> float:
        if self.deadline is None:
            return most
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _timeout(self.job_id, self.timeout or 0.0)
        return min(most, left)

    def poll(self) -> float:
        """How long to sleep before the next look, when polling: a pause that grows from
        a few milliseconds to ``_POLL_MAX``."""
        pause = self._left(self.pause)
        self.pause = min(_POLL_MAX, self.pause * _POLL_GROWTH)
        return pause

    def notified(self) -> float:
        """How long to wait for a notification before looking anyway, when listening."""
        return self._left(_RECHECK)


def result(engine: sa.Engine, jobs: Jobs, job_id: int, **wait: Unpack[WaitOptions]) -> Any:
    """Wait for a result-keeping job and return its value (see :meth:`Jobs.result`)."""
    _check_job_id(job_id)
    queries, (clock, listen) = jobs.queries, _Clock.of(job_id, **wait)
    if listen is None:
        listen = _DIRECT.get(engine)
    if listen is None:
        with engine.connect() as conn:
            listen = _DIRECT[engine] = _direct(conn)
    if not listen:
        # Each look takes a pooled connection of its own: the wait holds none.
        while True:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                seen = _look(conn, queries, job_id)
            if seen.done:
                return seen.value
            time.sleep(clock.poll())
    while True:
        try:
            return _listen_for(engine, queries, clock)
        except _Lost:
            # The server ended the connection mid-wait (a restart, a terminated backend):
            # a new one, listening again, and a new look, within the same deadline.
            time.sleep(clock.poll())


class _Lost(Exception):
    """The listening connection was lost: the wait goes on on a new one."""


def _lost(raw: Any, exc: Exception) -> bool:
    """Whether ``exc`` (a database error from a look, or from the wait for a
    notification, which psycopg raises itself) came with the connection lost."""
    if not isinstance(exc, (sa.exc.DBAPIError, psycopg.Error)):
        return False
    return getattr(exc, "connection_invalidated", False) or bool(
        raw is not None and (raw.closed or getattr(raw, "broken", False))
    )


def _listen_for(engine: sa.Engine, queries: Queries, clock: _Clock) -> Any:
    """One listening connection's wait: LISTEN, look, wait for a notification, look..."""
    job_id = clock.job_id
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        raw: Any = None
        try:
            conn.exec_driver_sql(listen_sql(queries.results_channel))
            raw = conn.connection.driver_connection
            mine = str(job_id)
            while True:
                seen = _look(conn, queries, job_id)
                if seen.done:
                    return seen.value
                _wait_notify(raw, mine, clock.notified())
        except Exception as exc:
            if _lost(raw, exc):
                if not conn.invalidated:
                    conn.invalidate()  # for the pool to let go of
                raise _Lost from exc
            raise
        finally:
            # The connection goes back to the pool: it must not keep listening (nor keep
            # notifications queued) for whoever takes it next.
            if not conn.invalidated:
                try:
                    conn.exec_driver_sql(unlisten_sql(queries.results_channel))
                    for _ in raw.notifies(timeout=0):
                        pass
                except Exception:
                    conn.invalidate()


def _wait_notify(raw: Any, payload: str, seconds: float) -> None:
    """Wait on a psycopg connection until a notification with ``payload`` (or time)."""
    end = time.monotonic() + seconds
    for note in raw.notifies(timeout=seconds):
        if note.payload == payload or time.monotonic() >= end:
            return
    return


async def result_async(
    engine: AsyncEngine, jobs: Jobs, job_id: int, **wait: Unpack[WaitOptions]
) -> Any:
    """:func:`result` on an ``AsyncEngine``: the same wait, without blocking the loop."""
    _check_job_id(job_id)
    queries, (clock, listen) = jobs.queries, _Clock.of(job_id, **wait)
    if listen is None:
        listen = _DIRECT.get(engine.sync_engine)
    if listen is None:
        async with engine.connect() as conn:
            listen = _DIRECT[engine.sync_engine] = await conn.run_sync(_direct)
    if not listen:
        while True:
            async with engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                seen = await conn.run_sync(_look, queries, job_id)
            if seen.done:
                return seen.value
            await asyncio.sleep(clock.poll())
    while True:
        try:
            return await _listen_for_async(engine, queries, clock)
        except _Lost:
            await asyncio.sleep(clock.poll())  # as the sync wait: a new connection


async def _listen_for_async(engine: AsyncEngine, queries: Queries, clock: _Clock) -> Any:
    """:func:`_listen_for`, awaited."""
    job_id = clock.job_id
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        raw: Any = None
        try:
            await conn.exec_driver_sql(listen_sql(queries.results_channel))
            raw = (await conn.get_raw_connection()).driver_connection
            mine = str(job_id)
            while True:
                seen = await conn.run_sync(_look, queries, job_id)
                if seen.done:
                    return seen.value
                # Past the deadline this raises TimeoutError: asked for
                # first, so that the suppress below takes only the wait's own timeout. In
                # it (on Python 3.11 asyncio's TimeoutError is the builtin), it was taken
                # for the end of a wait: the loop looked again at once, for ever.
                seconds = clock.notified()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_next_note(raw, mine), seconds)
        except Exception as exc:
            if _lost(raw, exc):
                if not conn.invalidated:
                    await conn.invalidate()
                raise _Lost from exc
            raise
        finally:
            if not conn.invalidated:
                try:
                    await conn.exec_driver_sql(unlisten_sql(queries.results_channel))
                    async for _ in raw.notifies(timeout=0):
                        pass
                except Exception:
                    await conn.invalidate()


async def _next_note(raw: Any, payload: str) -> None:
    """Until a notification with ``payload`` arrives on an async psycopg connection."""
    async for note in raw.notifies():
        if note.payload == payload:
            return

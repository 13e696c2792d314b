"""Durable steps: jobs that resume where they stopped, sleep and wait without a worker.

.. code-block:: python

    @jobs.task(durable=True, queue="orders")
    def fulfil(steps: Steps, order_id: int) -> None:
        charge = steps.run("charge", payments.charge, order_id)      # once, across attempts
        steps.run("reserve", reserve_stock, order_id)                # takes a session: its
                                                                     # writes commit with it
        steps.sleep("cool-off", timedelta(days=3))                   # no worker held
        parcel = steps.wait("shipped", timeout=timedelta(days=14))   # jobs.signal(...) wakes it
        steps.run("email", send_shipped_mail, order_id, parcel["tracking"])

    # the shipping webhook, in the app's own transaction:
    with Session.begin() as session:
        jobs.signal(session, job_id, "shipped", {"tracking": "1Z..."})

Every step is a row of ``<table>_steps`` keyed by the job and the step's name: a step's
return value (JSON), a cursor's position, a sleep's wake-up time, a wait's deadline or
signal. A later attempt of the job runs the handler from the top again, and each step
already recorded returns what it stored instead of running: the handler resumes where the
last attempt stopped.

What is promised:

* ``steps.run(name, fn, ...)`` with an ordinary ``fn``: ``fn`` runs, then its result is
  checkpointed in one round trip. A worker that dies between ``fn``'s return and the
  checkpoint runs ``fn`` again on the next attempt: at least once, as any job is.
* with an ``fn`` that takes a ``session``: ``fn``'s writes and the checkpoint commit in one
  transaction, fenced by the claim (``(id, attempts)``, the job row locked until COMMIT):
  a step of a claim that was lost never commits, so its database effects happen exactly
  once.
* ``steps.sleep`` and ``steps.wait`` end the attempt without spending one: the job goes
  back to ``scheduled`` (its slot freed, nothing held) and comes back at its time, or
  when its signal commits (``jobs.signal`` rides the caller's transaction).
* Every value a step returns is its stored JSON read back, on the first run too: a tuple
  comes back a list on every attempt alike, never only on the replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, overload

import sqlalchemy as sa
from sqlalchemy.ext.horizontal_shard import ShardedSession

from ._storable import BIGINT_MAX
from ._tasks import _EARLIEST, _LATEST, json_problem, long_int_problem
from .errors import SignalError, StepError, WaitTimedOut
from .model import SUSPENDED_STEP_STATES

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session

    from ._step_queries import StepQueries

__all__ = [
    "AsyncSteps",
    "Batch",
    "SignalError",
    "StepError",
    "Steps",
    "WaitTimedOut",
    "signal",
    "signal_async",
]

R = TypeVar("R")

#: A step's name is at most this long (UTF-8 bytes): it is a key, shown in the dashboard.
NAME_MAX_BYTES = 200
#: A step's stored JSON is at most this long. Every record of a job is read back at the
#: first step of each attempt, so a step returns a reference to bulky data (a storage key,
#: an id), not the data. Refused at the step, before anything is written.
RESULT_MAX_BYTES = 16 * 2**20


class Kind:
    """The kinds of records (``<table>_steps.kind``)."""

    RUN = "run"
    CURSOR = "cursor"
    SLEEP = "sleep"
    WAIT = "wait"


class State:
    """Where a record stands (``<table>_steps.state``)."""

    #: A run step's result is stored; a cursor reached the end; a sleep is over; a wait
    #: took its signal.
    DONE = "done"
    #: A cursor, between batches.
    OPEN = "open"
    SLEEPING = "sleeping"
    WAITING = "waiting"
    #: A signal that came (before the wait, or while it was suspended), not yet taken.
    SIGNALLED = "signalled"
    TIMED_OUT = "timed_out"


#: The states of a suspended job's step (``<table>_steps_suspended``).
SUSPENDED_STATES = SUSPENDED_STEP_STATES
assert set(SUSPENDED_STATES) == {State.SLEEPING, State.WAITING}


@dataclass(slots=True)
class Record:
    """One step of a job as stored."""

    name: str
    kind: str
    state: str
    result: Any
    attempt: int | None
    until: datetime | None


class Claim(Protocol):
    """What a step is fenced by: the job's id and this claim's attempt."""

    @property
    def id(self) -> int: ...

    @property
    def attempts(self) -> int: ...

    @property
    def is_cancelled(self) -> bool:
        """The run was told to stop (cancelled, timed out, its lease lost)."""
        ...

    @property
    def cancel_reason(self) -> str | None: ...


class Host(Protocol):
    """What the worker does for a step runner: the claim is settled (the heartbeat must
    not take the suspended job's row for a lost lease) before a suspension commits, opened
    again if that COMMIT fails, and marked lost when a fence matched no row."""

    def settle(self) -> bool: ...

    def unsettle(self) -> None: ...

    def lost(self, reason: str) -> None: ...


class Suspended(BaseException):
    """Raised by ``steps.sleep`` and ``steps.wait`` once the job's suspension committed: the
    attempt ends here, and the worker writes nothing more for it. A ``BaseException``, so
    that a handler's ``except Exception`` does not swallow it."""

    def __init__(self, name: str, kind: str, until: datetime | None) -> None:
        super().__init__(f"{kind} {name!r}")
        self.name = name
        self.kind = kind
        self.until = until


# -- names, values ------------------------------------------------------------------------


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise StepError(f"a step's name must be a non-empty string, got {name!r}")
    if "\x00" in name or len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        raise StepError(f"step name {name[:40]!r}: at most {NAME_MAX_BYTES} bytes of UTF-8, no NUL")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise StepError(f"step name {name[:40]!r} is not valid UTF-8 (a lone surrogate)") from None
    return name


_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def encode(value: Any, what: str) -> str:
    """``value`` as the JSON text a step stores, checked as PostgreSQL will take it.

    :raises StepError: not JSON, too large, or what ``jsonb`` refuses (NUL, surrogates);
        ``permanent``: a retry would call the step's function again for a value of the
        same kind, which could never be stored either (a card charged on every attempt).
    """
    try:
        text = _encoder(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise StepError(
            f"{what} is a {type(value).__qualname__}, which is not JSON ({exc}): a step "
            "returns JSON (a dict, a list, a string, a number), or a reference to what it made",
            permanent=True,
        ) from None
    if len(text) > RESULT_MAX_BYTES // 4 and len(text.encode()) > RESULT_MAX_BYTES:
        raise StepError(
            f"{what} is {len(text.encode()):,} bytes of JSON, more than a step keeps "
            f"({RESULT_MAX_BYTES:,}): store the data elsewhere and return its key",
            permanent=True,
        )
    if not text.isascii() or "\\u0000" in text or "{" in text:
        problem = json_problem(value, what)
        if problem is not None:
            raise StepError(problem, permanent=True)
    problem = long_int_problem(value, what, text)
    if problem is not None:
        raise StepError(problem, permanent=True)
    return text


def _takes_session(fn: Callable[..., Any]) -> bool | None:
    """Whether ``fn`` takes a ``session``: ``True`` as its first parameter (as a
    transactional task's handler does: ``reserve(session, sku)``), ``False`` elsewhere (it
    is given by keyword), None not at all. Cached by ``fn``, except for a callable that
    cannot be hashed (an instance of a dataclass with ``__call__``), looked at each time."""
    try:
        return _takes_session_cached(fn)
    except TypeError:  # unhashable: the cache's key; the look itself raises none
        return _session_parameter(fn)


def _session_parameter(fn: Callable[..., Any]) -> bool | None:
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    names = [p.name for p in parameters]
    if "session" not in names:
        return None
    first = parameters[0]
    return first.name == "session" and first.kind is not inspect.Parameter.KEYWORD_ONLY


_takes_session_cached = functools.lru_cache(maxsize=1024)(_session_parameter)


def _call(fn: Callable[..., Any], session: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
    if _takes_session(fn):
        return fn(session, *args, **kwargs)
    return fn(*args, session=session, **kwargs)


def _seconds(value: float | timedelta | None, what: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or seconds < 0
        or seconds > 100 * 365.25 * 86400
    ):
        raise StepError(f"{what} must be a number of seconds >= 0 (or a timedelta), got {value!r}")
    return float(seconds)


# -- what one run knows -------------------------------------------------------------------


class _Ledger:
    """The records of one job as this run knows them, and the names it used: no I/O."""

    __slots__ = ("claim", "records", "used")

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.records: dict[str, Record] | None = None
        self.used: set[str] = set()

    def loaded(self, rows: Sequence[Any]) -> None:
        self.records = {row.name: Record(*row) for row in rows}

    def use(self, name: str, kind: str) -> Record | None:
        """The stored record of step ``name`` (None: a new step), which this run takes.

        :raises StepError: the name was used already in this run, or a record of that
            name is of another kind.
        """
        _check_name(name)
        if name in self.used:
            raise StepError(
                f"job {self.claim.id}: step {name!r} is used twice in one run; each step "
                "of a job needs a name of its own (add the item's id, or a counter)"
            )
        self.used.add(name)
        assert self.records is not None
        record = self.records.get(name)
        if record is not None and record.kind != kind:
            raise StepError(self.clash(name, kind, record.kind))
        return record

    def clash(self, name: str, kind: str, stored: str) -> str:
        what = "a signal was sent" if stored == Kind.WAIT else f"a {stored} step is stored"
        return f"job {self.claim.id}: step {name!r} is a {kind} step, but {what} under that name"

    def done(self, name: str, kind: str, result: Any, state: str = State.DONE) -> None:
        assert self.records is not None
        self.records[name] = Record(name, kind, state, result, self.claim.attempts, None)

    def guard(self, **more: Any) -> dict[str, Any]:
        return {"job_id": self.claim.id, "attempt": self.claim.attempts, **more}

    def lost(self, name: str) -> StepError:
        return StepError(
            f"job {self.claim.id}: step {name!r} was not recorded: this claim is no longer "
            "this worker's (its lease passed, or it was cancelled)"
        )

    @property
    def count(self) -> int:
        """How many steps are done (for progress)."""
        records = self.records or {}
        return sum(1 for r in records.values() if r.state == State.DONE)


#: What a suspension plan yields before the statement that suspends the job: the driver
#: settles the claim and sends back whether it could.
_SETTLE = object()

Plan = Generator[Any, Any, tuple[str, Any]]


def _suspension(
    q: StepQueries, ledger: _Ledger, name: str, kind: str, after: float | None, at: datetime | None
) -> Plan:
    """A sleep (``kind`` sleep) or a wait, in one transaction; yields ``(statement,
    params)`` and gets each result back (or :data:`_SETTLE`, and whether the claim was
    settled). Returns ``("done", value)``, ``("timed_out", None)``, ``("suspended",
    until)`` (COMMIT, then end the attempt) or ``("lost", None)``."""
    job_id = ledger.claim.id
    fresh = (
        yield (
            q.take_step,
            {
                "job_id": job_id,
                "name": name,
                "kind": kind,
                "state": State.SLEEPING if kind == Kind.SLEEP else State.WAITING,
                "attempt": ledger.claim.attempts,
                "after": None if after is None else timedelta(seconds=after),
                "at": at,
            },
        )
    ).first()
    row = (
        None if fresh is not None else (yield q.lock_step, {"job_id": job_id, "name": name}).first()
    )
    if (yield q.lock_claim, ledger.guard()).first() is None:
        return "lost", None
    if fresh is not None:
        until, due = fresh.until, fresh.due
    elif row is None:  # gone meanwhile (the job pruned): nothing to wait on
        return "lost", None
    elif row.kind != kind:
        raise StepError(ledger.clash(name, kind, row.kind))
    elif row.state in (State.DONE, State.SIGNALLED):
        if row.state == State.SIGNALLED:
            yield q.set_state, _state(ledger, name, State.DONE)
        return "done", row.result
    elif row.state == State.TIMED_OUT:
        return "timed_out", None
    else:  # sleeping or waiting: woken by its time, or early (an operator's "run now")
        until, due = row.until, row.due
    if due:
        state = State.DONE if kind == Kind.SLEEP else State.TIMED_OUT
        yield q.set_state, _state(ledger, name, state)
        return ("done", None) if kind == Kind.SLEEP else ("timed_out", None)
    if not (yield _SETTLE):
        return "lost", None
    yield q.suspend, ledger.guard(until=until)
    return "suspended", until


def _state(ledger: _Ledger, name: str, state: str) -> dict[str, Any]:
    return {"of_job": ledger.claim.id, "of_step": name, "to_state": state}


def _signal_plan(q: StepQueries, job_id: int, name: str, payload: str) -> Plan:
    """:func:`signal`'s statements, in the caller's transaction."""
    status = (yield q.job_status, {"job_id": job_id}).scalar()
    if status is None:
        raise SignalError(
            job_id, name, "unknown", "no such job (never enqueued, or finished and deleted)"
        )
    if status not in ("scheduled", "ready", "running"):
        raise SignalError(job_id, name, "finished", f"the job is {status}")
    key = {"job_id": job_id, "name": name}
    if (yield q.keep_signal, {**key, "result": payload}).first() is not None:
        return "kept", None  # before the wait: it takes it when it gets there
    row = (yield q.lock_step, key).first()
    if row is None:  # the job's records pruned meanwhile (it finished)
        raise SignalError(job_id, name, "unknown", "the job finished meanwhile")
    if row.kind != Kind.WAIT:
        raise SignalError(job_id, name, "not_a_wait", f"the job's step {name!r} is no wait")
    if row.state == State.TIMED_OUT:
        raise SignalError(job_id, name, "timed_out", "the wait timed out before it came")
    if row.state != State.WAITING:
        raise SignalError(job_id, name, "resolved", "that wait has its signal already")
    yield q.deliver, {"of_job": job_id, "of_step": name, "payload": payload}
    woken = (yield q.wake, {"job_id": job_id}).first()
    return ("woken" if woken is not None else "kept"), None


def _signal_args(
    connection: Any, jobs: Any, job_id: Any, name: Any, payload: Any
) -> tuple[StepQueries, str]:
    if isinstance(job_id, bool) or not isinstance(job_id, int):
        raise TypeError(f"jobs.signal: job_id must be an int, got {job_id!r}")
    if isinstance(getattr(connection, "sync_session", connection), ShardedSession):
        # Each shard numbers its jobs itself: an id names a job only within its shard,
        # and the session's choosers would send the statements wherever they send a
        # statement that names no object (the first shard, all of them, or an error).
        raise TypeError(
            f"jobs.signal: a sharded session cannot tell which shard holds job {job_id} "
            "(each shard numbers its own jobs); pass that shard's connection, "
            "session.connection(bind_arguments={'shard_id': ...})"
        )
    if not 0 < job_id <= BIGINT_MAX:  # PostgreSQL would refuse to compare it with an id
        raise SignalError(job_id, name, "unknown", "no such job (not a job id)")
    _check_name(name)
    return jobs.step_queries, encode(payload, f"signal {name!r}'s payload")


def signal(
    connection: sa.Connection | Session, jobs: Any, job_id: int, name: str, payload: Any = None
) -> str:
    """Send signal ``name`` to job ``job_id``, in the caller's transaction (see
    :meth:`Jobs.signal <sqla_jobs.Jobs.signal>`)."""
    q, text = _signal_args(connection, jobs, job_id, name, payload)
    plan = _signal_plan(q, job_id, name, text)
    request = next(plan)
    try:
        while True:
            request = plan.send(connection.execute(*request))
    except StopIteration as stop:
        return str(stop.value[0])


async def signal_async(
    connection: AsyncConnection | AsyncSession,
    jobs: Any,
    job_id: int,
    name: str,
    payload: Any = None,
) -> str:
    """:func:`signal`, awaited, on an ``AsyncConnection`` or an ``AsyncSession``."""
    q, text = _signal_args(connection, jobs, job_id, name, payload)
    plan = _signal_plan(q, job_id, name, text)
    request = next(plan)
    try:
        while True:
            request = plan.send(await connection.execute(*request))
    except StopIteration as stop:
        return str(stop.value[0])


# -- batches of an iteration --------------------------------------------------------------


class Batch(Sequence[Any]):
    """One batch of ``steps.iterate``: its rows (ORM objects for a select of one entity,
    else rows), and the session they were read in. Writes made in that session (changes
    to the objects, ``session.add``) commit together with the cursor moving past the batch
    when the loop asks for the next one."""

    __slots__ = ("rows", "session")

    def __init__(self, rows: list[Any], session: Any) -> None:
        self.rows = rows
        self.session = session

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"<Batch of {len(self.rows)}>"


def _one_entity(statement: sa.Select[Any]) -> bool:
    described = statement.column_descriptions
    return (
        len(described) == 1
        and described[0].get("entity") is not None
        and (described[0].get("expr") is described[0].get("entity"))
    )


def _key_name(key: Any) -> str:
    name = getattr(key, "key", None)
    if not isinstance(name, str):
        raise StepError(f"iterate: key must be a mapped attribute or a column, got {key!r}")
    return name


def _key_of(row: Any, key: Any, name: str) -> Any:
    if isinstance(row, sa.Row):
        return row._mapping[key]
    return getattr(row, name)


def _page(statement: sa.Select[Any], key: Any, after: Any, size: int) -> sa.Select[Any]:
    page = statement if after is None else statement.where(key > after)
    return page.limit(size)


def _check_iterate(name: str, statement: Any, key: Any, size: Any) -> tuple[sa.Select[Any], str]:
    """The statement to page (ordered by ``key`` if it was not ordered) and the key's
    attribute name.

    :raises StepError: not a select, one with a LIMIT or OFFSET of its own, one ordered by
        something else first (the cursor's ``key > last`` would skip or repeat rows), a
        bad size or key.
    """
    if not isinstance(statement, sa.Select):
        raise StepError(f"iterate {name!r}: give a select() ordered by its key, got {statement!r}")
    if statement._limit_clause is not None or statement._offset_clause is not None:
        raise StepError(
            f"iterate {name!r}: the select has a LIMIT or OFFSET of its own; "
            "the cursor pages it by its key"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise StepError(f"iterate {name!r}: size must be an int >= 1, got {size!r}")
    key_name = _key_name(key)
    column = key.__clause_element__() if hasattr(key, "__clause_element__") else key
    order = statement._order_by_clauses
    if not order:
        return statement.order_by(column), key_name
    if not order[0].compare(column):
        raise StepError(
            f"iterate {name!r}: the select must be ordered by its key ({key_name}) first, "
            "ascending: the cursor resumes after the last key it committed"
        )
    return statement, key_name


def _cursor(after: Any, rows: int, name: str) -> str:
    """A cursor's stored position. Its key must read back as the same value: an int or a
    str (a primary key, typically), checked before the batch is handed out, so that a
    batch's writes never roll back for a key that cannot be stored."""
    if after is not None and (isinstance(after, bool) or not isinstance(after, int | str)):
        raise StepError(
            f"iterate {name!r}: its key's value {after!r} is a {type(after).__qualname__}; "
            "a cursor stores its key as JSON, so the key must be an int or a str column "
            "(a primary key, or another unique one)"
        )
    return encode({"after": after, "rows": rows}, f"iterate {name!r}'s key value")


# -- the runners --------------------------------------------------------------------------


class _Base:
    """What both runners share: the ledger, the statements, the host."""

    def __init__(self, q: StepQueries, claim: Claim, host: Host) -> None:
        self._q = q
        self._ledger = _Ledger(claim)
        self._host = host

    @property
    def job_id(self) -> int:
        return self._ledger.claim.id

    @property
    def done(self) -> int:
        """How many of the job's steps are done (stored), across attempts."""
        return self._ledger.count

    def _checkpoint(self, name: str, kind: str, state: str, text: str | None) -> dict[str, Any]:
        return self._ledger.guard(name=name, kind=kind, state=state, result=text)

    def _go_on(self, name: str) -> None:
        """Refuse to start a step once this run was told to stop (a timeout, a cancel, a
        lease lost to another worker): its checkpoint would be refused, and the next
        attempt would call the step's function again. Checked between steps, where a
        stop that came while the handler's own code ran is seen."""
        claim = self._ledger.claim
        if claim.is_cancelled:
            why = claim.cancel_reason or "it was told to stop"
            raise StepError(
                f"job {claim.id}: step {name!r} was not started: this run is over ({why})"
            )

    def _refused(self, name: str, kind: str, stored: str | None, what: str = "step") -> StepError:
        """A checkpoint that wrote nothing: a row of another kind under the step's name
        (a signal sent under it: the application's mistake, a failure like any other),
        or the claim is no longer this worker's."""
        if stored is not None and stored != kind:
            return StepError(self._ledger.clash(name, kind, stored))
        self._host.lost(f"{what} {name!r}: claim lost")
        return self._ledger.lost(name)

    def _after_suspension(self, name: str, kind: str, outcome: tuple[str, Any]) -> Any:
        what, value = outcome
        if what == "lost":
            self._host.lost(f"step {name!r}: claim lost")
            raise self._ledger.lost(name)
        if what == "timed_out":
            self._ledger.done(name, kind, None, State.TIMED_OUT)
            raise WaitTimedOut(self.job_id, name)
        if what == "suspended":
            raise Suspended(name, kind, value)
        self._ledger.done(name, kind, value)
        return value

    @staticmethod
    def _times(
        name: str, seconds: float | timedelta | None, until: datetime | None
    ) -> tuple[float | None, datetime | None]:
        if (seconds is None) == (until is None):
            raise StepError(f"sleep {name!r}: give seconds (or a timedelta), or until=, not both")
        if until is not None:
            if not isinstance(until, datetime) or until.utcoffset() is None:
                raise StepError(f"sleep {name!r}: until must be an aware datetime, got {until!r}")
            # The range of run_at, which it becomes: past it, the step failed on every
            # attempt when read back, or (datetime.max) no job list could be read in a
            # session whose time zone is east of UTC.
            if not _EARLIEST <= until <= _LATEST:
                raise StepError(
                    f"sleep {name!r}: until {until.isoformat()} is out of range: it must lie "
                    f"between {_EARLIEST.date()} and {_LATEST.date()} UTC"
                )
        return _seconds(seconds, f"sleep {name!r}"), until


class Steps(_Base):
    """The step runner a durable handler gets as ``steps`` on the threaded worker.

    Not thread-safe: one run's steps happen one after another.
    """

    def __init__(
        self,
        engine: sa.Engine,
        q: StepQueries,
        claim: Claim,
        host: Host,
        session: Callable[[Any], Session],
    ) -> None:
        super().__init__(q, claim, host)
        self._engine = engine
        self._make_session = session
        self._conn: sa.Connection | None = None

    # A connection kept in autocommit between checkpoints (one round trip each: the pool's
    # pre-ping is paid once per run), given back before a step opens a session of its own,
    # so a run never holds two.
    def _held(self) -> sa.Connection:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self._engine.connect().execution_options(
                isolation_level="AUTOCOMMIT"
            )
        return conn

    def close(self) -> None:
        """Give the held connection back (the worker calls this when the run ends)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a dead connection: the pool drops it
                conn.close()

    def _execute(self, statement: Any, params: dict[str, Any]) -> Any:
        """Run a statement on the held connection. Once more on a fresh one if that
        connection was lost meanwhile (an idle reaper, a failover, while a step's function
        ran): every statement sent here is a read or a fenced upsert that may be sent
        twice, and failing the attempt would call a step's function again for a result
        already in hand."""
        try:
            return self._held().execute(statement, params)
        except sa.exc.DBAPIError as exc:
            self.close()
            if not exc.connection_invalidated:
                raise
        except BaseException:
            self.close()
            raise
        try:
            return self._held().execute(statement, params)
        except BaseException:
            self.close()
            raise

    def _kind_of(self, name: str, bind: Any) -> str | None:
        found = bind.execute(self._q.kind_of, {"job_id": self.job_id, "name": name}).scalar()
        return cast("str | None", found)

    def _load(self) -> None:
        if self._ledger.records is None:
            self._ledger.loaded(self._execute(self._q.load, {"job_id": self.job_id}).all())

    def run(self, name: str, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once across the job's attempts, and return its
        result as stored (JSON read back). A later attempt returns the stored result
        without calling ``fn``. An ``fn`` that takes ``session`` is called with a session
        of its own, whose writes commit with the checkpoint (exactly once)."""
        self._load()
        record = self._ledger.use(name, Kind.RUN)
        if record is not None and record.state == State.DONE:
            return record.result
        self._go_on(name)
        if _takes_session(fn) is not None:
            self.close()
            with self._make_session(self._engine) as session:
                value = _call(fn, session, args, kwargs)
                text = encode(value, f"step {name!r}'s result")
                params = self._checkpoint(name, Kind.RUN, State.DONE, text)
                row = session.execute(self._q.checkpoint_locked, params).first()
                if row is None:
                    session.rollback()
                    stored = self._kind_of(name, session)
                    session.rollback()
                    raise self._refused(name, Kind.RUN, stored)
                session.commit()
        else:
            value = fn(*args, **kwargs)
            text = encode(value, f"step {name!r}'s result")
            params = self._checkpoint(name, Kind.RUN, State.DONE, text)
            row = self._execute(self._q.checkpoint, params).first()
            if row is None:
                stored = self._execute(self._q.kind_of, {"job_id": self.job_id, "name": name})
                raise self._refused(name, Kind.RUN, stored.scalar())
        # What jsonb stored, as a replay reads it (not json.loads of the text sent).
        self._ledger.done(name, Kind.RUN, row.result)
        return row.result

    def sleep(
        self, name: str, seconds: float | timedelta | None = None, *, until: datetime | None = None
    ) -> None:
        """Sleep ``seconds`` (or ``until`` a time) without holding a worker: the attempt
        ends here, uncounted, and the job runs again at that time, the steps before this
        one skipped. Returns at once on an attempt that finds the sleep over."""
        self._load()
        record = self._ledger.use(name, Kind.SLEEP)
        if record is not None and record.state == State.DONE:
            return
        after, at = self._times(name, seconds, until)
        self._go_on(name)
        self._suspend(name, Kind.SLEEP, after, at)

    def wait(self, name: str, *, timeout: float | timedelta | None = None) -> Any:
        """Wait for the signal ``name`` (:meth:`Jobs.signal <sqla_jobs.Jobs.signal>`) and
        return its payload. Without a signal yet, the attempt ends here, uncounted, and
        the job is suspended (no slot held) until the signal commits or ``timeout``
        passes. A signal sent before the wait is kept and returned at once.

        :raises WaitTimedOut: the timeout passed first (on this and every later attempt).
        """
        self._load()
        record = self._ledger.use(name, Kind.WAIT)
        if record is not None and record.state == State.DONE:
            return record.result
        if record is not None and record.state == State.TIMED_OUT:
            raise WaitTimedOut(self.job_id, name)
        after = _seconds(timeout, f"wait {name!r}'s timeout")
        self._go_on(name)
        return self._suspend(name, Kind.WAIT, after, None)

    def _suspend(self, name: str, kind: str, after: float | None, at: datetime | None) -> Any:
        self.close()
        plan = _suspension(self._q, self._ledger, name, kind, after, at)
        settled = False
        with self._engine.connect() as conn:
            trans = conn.begin()
            try:
                request = next(plan)
                while True:
                    if request is _SETTLE:
                        settled = self._host.settle()
                        answer: Any = settled
                    else:
                        answer = conn.execute(*request)
                    request = plan.send(answer)
            except StopIteration as stop:
                outcome = stop.value
            except BaseException:
                # Settled, then failed before the COMMIT (the suspending UPDATE lost its
                # connection): the claim is open again, so that the failure is recorded
                # and the heartbeat renews the lease meanwhile.
                if settled:
                    self._host.unsettle()
                trans.rollback()
                raise
            try:
                if outcome[0] == "lost":  # nothing of a lost claim's may commit
                    trans.rollback()
                else:
                    trans.commit()
            except BaseException:
                if settled:
                    self._host.unsettle()
                raise
        return self._after_suspension(name, kind, outcome)

    def iterate(
        self, name: str, statement: sa.Select[Any], *, key: Any, size: int = 500
    ) -> Iterator[Batch]:
        """Page through ``statement`` (ordered by ``key``, ascending) in batches of
        ``size``, resuming after the last batch a previous attempt finished. The loop has
        one session, with a transaction per batch: the writes made in it commit with the
        cursor when the loop moves on to the next batch, so a batch's writes happen once.
        A loop left early (``break``, an error) does not move the cursor past its batch."""
        self._load()
        statement, key_name = _check_iterate(name, statement, key, size)
        record = self._ledger.use(name, Kind.CURSOR)
        return self._pages(name, statement, key, key_name, size, record)

    def _pages(
        self,
        name: str,
        statement: sa.Select[Any],
        key: Any,
        key_name: str,
        size: int,
        record: Record | None,
    ) -> Iterator[Batch]:
        if record is not None and record.state == State.DONE:
            return
        position: dict[str, Any] = {"after": None, "rows": 0}
        if record is not None:
            position = record.result
        after: Any = position["after"]
        count: int = position["rows"]
        entities = _one_entity(statement)
        self.close()
        # One connection and session for the whole loop, one transaction per batch: the
        # batch read, the loop's writes, the cursor moved past it, COMMIT. (A session on
        # the engine gives its connection back at each COMMIT, and would pay the pool's
        # pre-ping at every batch.)
        with self._engine.connect() as conn, self._make_session(conn) as session:
            while True:
                self._go_on(name)
                result = session.execute(_page(statement, key, after, size))
                rows = list(result.scalars().all() if entities else result.all())
                if rows:
                    after, count = _key_of(rows[-1], key, key_name), count + len(rows)
                text = _cursor(after, count, name)  # before the batch: its key must store
                if rows:
                    yield Batch(rows, session)
                end = len(rows) < size
                state = State.DONE if end else State.OPEN
                params = self._checkpoint(name, Kind.CURSOR, state, text)
                if session.execute(self._q.checkpoint_locked, params).first() is None:
                    session.rollback()
                    stored = self._kind_of(name, session)
                    session.rollback()
                    raise self._refused(name, Kind.CURSOR, stored, "iterate")
                session.commit()
                self._ledger.done(name, Kind.CURSOR, json.loads(text), state)
                if end:
                    return


class AsyncSteps(_Base):
    """The step runner a durable ``async def`` handler gets on the asyncio worker: the
    same steps as :class:`Steps`, awaited (``await steps.run(...)``, ``async for batch in
    steps.iterate(...)``). ``fn`` may be a coroutine function, or a plain one (run in a
    thread, so that it may block); one that takes ``session`` gets an ``AsyncSession``, and
    is a coroutine function.

    ``in_thread(fn, *args, **kwargs)`` runs a plain step in a thread and awaits it: the
    asyncio worker gives its own handler threads, one per slot. ``asyncio.to_thread``
    (the default) uses the loop's default executor, of ``min(32, cores + 4)`` threads
    shared with the application: on 2 cores no more than 6 plain steps ran at once
    whatever ``concurrency`` said, and 6 stuck steps held up every other one."""

    def __init__(
        self,
        engine: AsyncEngine,
        q: StepQueries,
        claim: Claim,
        host: Host,
        session: Callable[[Any], AsyncSession],
        in_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    ) -> None:
        super().__init__(q, claim, host)
        self._engine = engine
        self._make_session = session
        self._in_thread = in_thread
        self._conn: AsyncConnection | None = None

    async def _held(self) -> AsyncConnection:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = await self._engine.connect()
            self._conn = conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        return conn

    async def close(self) -> None:
        """Give the held connection back (the worker calls this when the run ends)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a dead connection: the pool drops it
                await conn.close()

    async def _execute(self, statement: Any, params: dict[str, Any]) -> Any:
        """:meth:`Steps._execute`: once more on a fresh connection if the held one was
        lost meanwhile."""
        try:
            return await (await self._held()).execute(statement, params)
        except sa.exc.DBAPIError as exc:
            await self.close()
            if not exc.connection_invalidated:
                raise
        except BaseException:
            await self.close()
            raise
        try:
            return await (await self._held()).execute(statement, params)
        except BaseException:
            await self.close()
            raise

    async def _kind_of(self, name: str, session: AsyncSession) -> str | None:
        found = await session.execute(self._q.kind_of, {"job_id": self.job_id, "name": name})
        return cast("str | None", found.scalar())

    async def _load(self) -> None:
        if self._ledger.records is None:
            result = await self._execute(self._q.load, {"job_id": self.job_id})
            self._ledger.loaded(result.all())

    async def run(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`Steps.run`, awaited."""
        await self._load()
        record = self._ledger.use(name, Kind.RUN)
        if record is not None and record.state == State.DONE:
            return record.result
        self._go_on(name)
        if _takes_session(fn) is not None:
            await self.close()
            async with self._make_session(self._engine) as session:
                value = await _value(_call(fn, session, args, kwargs))
                text = encode(value, f"step {name!r}'s result")
                params = self._checkpoint(name, Kind.RUN, State.DONE, text)
                row = (await session.execute(self._q.checkpoint_locked, params)).first()
                if row is None:
                    await session.rollback()
                    stored = await self._kind_of(name, session)
                    await session.rollback()
                    raise self._refused(name, Kind.RUN, stored)
                await session.commit()
        else:
            # A plain function may block: it runs in a thread, as the asyncio worker runs
            # a plain handler, so the event loop goes on with the other jobs.
            if inspect.iscoroutinefunction(fn):
                value = await fn(*args, **kwargs)
            else:
                value = await _value(await self._in_thread(fn, *args, **kwargs))
            text = encode(value, f"step {name!r}'s result")
            params = self._checkpoint(name, Kind.RUN, State.DONE, text)
            row = (await self._execute(self._q.checkpoint, params)).first()
            if row is None:
                stored = await self._execute(self._q.kind_of, {"job_id": self.job_id, "name": name})
                raise self._refused(name, Kind.RUN, stored.scalar())
        self._ledger.done(name, Kind.RUN, row.result)  # see Steps.run
        return row.result

    async def sleep(
        self, name: str, seconds: float | timedelta | None = None, *, until: datetime | None = None
    ) -> None:
        """:meth:`Steps.sleep`, awaited."""
        await self._load()
        record = self._ledger.use(name, Kind.SLEEP)
        if record is not None and record.state == State.DONE:
            return
        after, at = self._times(name, seconds, until)
        self._go_on(name)
        await self._suspend(name, Kind.SLEEP, after, at)

    async def wait(self, name: str, *, timeout: float | timedelta | None = None) -> Any:
        """:meth:`Steps.wait`, awaited."""
        await self._load()
        record = self._ledger.use(name, Kind.WAIT)
        if record is not None and record.state == State.DONE:
            return record.result
        if record is not None and record.state == State.TIMED_OUT:
            raise WaitTimedOut(self.job_id, name)
        after = _seconds(timeout, f"wait {name!r}'s timeout")
        self._go_on(name)
        return await self._suspend(name, Kind.WAIT, after, None)

    async def _suspend(self, name: str, kind: str, after: float | None, at: datetime | None) -> Any:
        await self.close()
        plan = _suspension(self._q, self._ledger, name, kind, after, at)
        settled = False
        async with self._engine.connect() as conn:
            trans = await conn.begin()
            try:
                request = next(plan)
                while True:
                    if request is _SETTLE:
                        settled = self._host.settle()
                        answer: Any = settled
                    else:
                        answer = await conn.execute(*request)
                    request = plan.send(answer)
            except StopIteration as stop:
                outcome = stop.value
            except BaseException:
                if settled:  # see Steps._suspend
                    self._host.unsettle()
                await trans.rollback()
                raise
            try:
                if outcome[0] == "lost":  # nothing of a lost claim's may commit
                    await trans.rollback()
                else:
                    await trans.commit()
            except BaseException:
                if settled:
                    self._host.unsettle()
                raise
        return self._after_suspension(name, kind, outcome)

    async def iterate(
        self, name: str, statement: sa.Select[Any], *, key: Any, size: int = 500
    ) -> AsyncIterator[Batch]:
        """:meth:`Steps.iterate`, as an async iterator (``async for batch in ...``); each
        batch's ``session`` is an ``AsyncSession``."""
        await self._load()
        statement, key_name = _check_iterate(name, statement, key, size)
        record = self._ledger.use(name, Kind.CURSOR)
        if record is not None and record.state == State.DONE:
            return
        position: dict[str, Any] = {"after": None, "rows": 0}
        if record is not None:
            position = record.result
        after: Any = position["after"]
        count: int = position["rows"]
        entities = _one_entity(statement)
        await self.close()
        # One connection and session, a transaction a batch (see Steps.iterate).
        async with self._engine.connect() as conn, self._make_session(conn) as session:
            while True:
                self._go_on(name)
                result = await session.execute(_page(statement, key, after, size))
                rows = list(result.scalars().all() if entities else result.all())
                if rows:
                    after, count = _key_of(rows[-1], key, key_name), count + len(rows)
                text = _cursor(after, count, name)  # before the batch: its key must store
                if rows:
                    yield Batch(rows, session)
                end = len(rows) < size
                state = State.DONE if end else State.OPEN
                params = self._checkpoint(name, Kind.CURSOR, state, text)
                if (await session.execute(self._q.checkpoint_locked, params)).first() is None:
                    await session.rollback()
                    stored = await self._kind_of(name, session)
                    await session.rollback()
                    raise self._refused(name, Kind.CURSOR, stored, "iterate")
                await session.commit()
                self._ledger.done(name, Kind.CURSOR, json.loads(text), state)
                if end:
                    return


async def _value(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value

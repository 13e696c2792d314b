"""One claimed job, and how a run of it ends.

A worker claims rows; each becomes a :class:`ClaimedJob`. Running it yields an
:class:`Outcome`, which the worker's completer turns into statements
(:func:`outcome_statements`). The names of the outcomes are those of the events
(:mod:`sqla_jobs.events`) and of :class:`sqla_jobs.testing.JobRun`: a run *succeeded*,
*failed* (and was then *retried* or is *dead*), was *snoozed*, or was *cancelled*.
"""

from __future__ import annotations

import contextvars
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .._queries import Queries, batch_params, fail_params, snooze_params
from .._settle import format_error
from .._storable import (
    DURATION_MAX_SECONDS,
    JSONB_SAFE_CHARS,
    PROGRESS_MAX_BYTES,
    jsonb_problem,
)
from .._tasks import json_problem, long_int_problem
from ..errors import PermanentError, ResultError, Snooze, StepError, print_unlogged
from ..model import CHILDREN_KEY, KEEP_KEY, TextEnum

if TYPE_CHECKING:
    from .._tasks import RetryPolicy, Task
    from ..tasks import Jobs

__all__ = ["CANCEL_PAYLOAD", "ClaimedJob", "Outcome", "OutcomeKind", "current_job"]

log = logging.getLogger("sqla_jobs.worker")


#: Payload of a NOTIFY that asks workers to heartbeat now: a running job was cancelled.
CANCEL_PAYLOAD = "!cancel"


class OutcomeKind(TextEnum):
    """How a run ended, as the completer records it."""

    #: The handler returned: the job is done.
    SUCCEEDED = "succeeded"
    #: The handler raised (or ran out of time): retried later, or dead.
    FAILED = "failed"
    #: The handler raised :class:`~sqla_jobs.Snooze`: again later, the attempt not counted.
    SNOOZED = "snoozed"
    #: Nothing left to write: a transactional run committed (or rolled back) its own
    #: completion, or the run was cancelled and its row is no longer this worker's.
    SETTLED = "settled"


@dataclass(eq=False, slots=True)
class ClaimedJob:
    """A job as its worker holds it while it runs; handlers get it from :func:`current_job`."""

    id: int
    queue: str
    task: str
    args: dict[str, Any]
    attempts: int
    max_attempts: int
    priority: int
    run_at: datetime
    created_at: datetime
    #: The job's ``meta`` as enqueued (a JSON object), or None.
    meta: dict[str, Any] | None = None
    worker: str = ""
    #: Why the run was told to stop (see :attr:`cancelled`), or None.
    cancel_reason: str | None = field(default=None, repr=False)
    #: ``time.monotonic()`` when the handler started (0 until then).
    started: float = field(default=0.0, repr=False)
    #: ``time.monotonic()`` when the worker sent the claim (0: not claimed by a worker).
    claimed_at: float = field(default=0.0, repr=False)
    #: ``time.monotonic()`` when the worker sent the last statement that extended this
    #: claim's lease (the claim, or a heartbeat that kept it): the lease holds at least a
    #: lease past this, by the worker's own clock (0: not claimed by a worker).
    renewed: float = field(default=0.0, repr=False)
    #: Held back from starting until a heartbeat says the claim is still this worker's
    #: (see ``WorkerCore.start``).
    confirming: bool = field(default=False, repr=False)
    #: Set by the worker once this claim's fate is decided (its outcome recorded, handed
    #: back, or committed by a transactional run): no later event may decide it again.
    settled: bool = field(default=False, repr=False)
    #: The run started for this claim and not yet ended (a ``worker._core.Run``), so that a
    #: failure of the worker's own code around it can still close it (reset
    #: :func:`current_job`, exit the run hooks) in the executor's context.
    run: Any = field(default=None, repr=False)
    _event: threading.Event | None = field(default=None, repr=False)
    #: The latest progress note (JSON text), and the one the heartbeat last wrote: two
    #: fields, each written by one side only (the handler, the heartbeat), so no lock.
    _progress: str | None = field(default=None, repr=False)
    _progress_written: str | None = field(default=None, repr=False)
    #: ``(id, attempts)``: this claim of this job, as the guard names it. The worker keeps
    #: its running jobs by it, never by ``id`` alone.
    key: tuple[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.key = (self.id, self.attempts)

    @property
    def cancelled(self) -> threading.Event:
        """Set when this run should stop: the job was cancelled, its lease was lost to
        another worker, it ran out of time, or the worker is stopping and the grace period
        is over. A long handler checks it between steps (or waits on it) and returns
        early; whatever it returns afterwards is ignored.

        Made on first use: the fetch loop builds a ClaimedJob per claimed row, and a
        ``threading.Event`` (a Condition and a Lock) per row cost a fifth of the drain's
        throughput, for an event almost never used.
        """
        event = self._event
        if event is None:
            with _EVENT_LOCK:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
        return event

    @property
    def is_cancelled(self) -> bool:
        """``cancelled.is_set()``, without making the event."""
        event = self._event
        return event is not None and event.is_set()

    @property
    def is_last_attempt(self) -> bool:
        """True when a failure now would make the job dead."""
        return self.attempts >= self.max_attempts

    def cancel(self, reason: str) -> None:
        if not self.is_cancelled:
            self.cancel_reason = reason
            self.cancelled.set()

    def set_progress(self, value: Any = None, *, note: str | None = None) -> None:
        """Say how far the run has got: ``value`` a number (``0.4``, ``120``) or a small
        JSON value (``{"done": 3, "of": 7}``), ``note`` a short sentence.

        Cheap: it only keeps the latest note in memory. The worker writes it to the job's
        ``progress`` column with its next heartbeat, which comes within about a second
        when a note is waiting (never more often), together with the notes of every other
        running job; a failure or a snooze writes the latest one with the outcome. Stored
        as ``{"value": ..., "note": ..., "at": "<ISO 8601 UTC>"}``.

        :raises ValueError: not JSON, text PostgreSQL cannot store, or over 4 KiB.
        """
        if note is not None and not isinstance(note, str):
            raise ValueError(f"progress note must be a string, got {note!r}")
        entry = {"value": value, "note": note, "at": datetime.now(timezone.utc).isoformat()}
        try:
            text = _progress_json(entry)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"progress is not JSON-serialisable ({exc})") from None
        # The entry is a dict itself: only a dict within it is a reason to look at keys.
        problem = _storage_problem(text, entry, value, ("progress", "progress"), start=1)
        if problem is not None:
            raise ValueError(problem)
        if len(text.encode()) > PROGRESS_MAX_BYTES:
            raise ValueError(
                f"progress is {len(text.encode())} bytes of JSON; at most "
                f"{PROGRESS_MAX_BYTES} are allowed"
            )
        self._progress = text

    @property
    def progress(self) -> dict[str, Any] | None:
        """The latest note given to :meth:`set_progress` in this run, or None."""
        text = self._progress
        return None if text is None else json.loads(text)

    def unwritten_progress(self) -> str | None:
        """The latest progress note if the heartbeat has not written it yet (JSON text)."""
        text = self._progress
        return None if text is None or text is self._progress_written else text

    def progress_written(self, text: str) -> None:
        """The heartbeat wrote ``text`` (what :meth:`unwritten_progress` gave it)."""
        self._progress_written = text


#: Progress notes keep their text as given (``ensure_ascii=False``): the size limit is in
#: bytes of UTF-8, as stored.
_progress_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


_EVENT_LOCK = threading.Lock()

_current: contextvars.ContextVar[ClaimedJob] = contextvars.ContextVar("sqla_jobs_current_job")


def current_job() -> ClaimedJob:
    """The job the calling handler is running. Raises ``LookupError`` outside a handler."""
    return _current.get()


def set_current(job: ClaimedJob) -> contextvars.Token[ClaimedJob]:
    return _current.set(job)


def reset_current(token: contextvars.Token[ClaimedJob]) -> None:
    _current.reset(token)


@dataclass(slots=True)
class Outcome:
    """The result of one run, as the completer writes it."""

    kind: OutcomeKind
    job: ClaimedJob
    error: str | None = None
    delay: float = 0.0
    permanent: bool = False
    #: A result-keeping job's return value, as JSON text (see :func:`keeps`).
    result: str | None = None

    @property
    def dead(self) -> bool:
        """A failure that leaves no attempt (or was permanent)."""
        return self.kind is OutcomeKind.FAILED and (self.permanent or self.job.is_last_attempt)


def job_log(level: int, job: ClaimedJob, message: str, *args: Any, **fields: Any) -> None:
    """Log about one job: the message is prefixed with its id, task, queue and attempt,
    which are also passed as ``extra`` fields (``job_id``, ``task``, ``queue``,
    ``attempt``, ``worker``, and any ``fields`` given) for structured log handlers
    (``sqla-jobs worker --log-format json`` prints them)."""
    if not log.isEnabledFor(level):
        return
    log.log(
        level,
        "job %s (%s, queue %s, attempt %s/%s): " + message,
        job.id,
        job.task,
        job.queue,
        job.attempts,
        job.max_attempts,
        *args,
        extra={
            "job_id": job.id,
            "task": job.task,
            "queue": job.queue,
            "attempt": job.attempts,
            "worker": job.worker,
            **fields,
        },
    )


def outcome_name(outcome: Outcome) -> str:
    """The name of how a run ended, as the events and :class:`~sqla_jobs.testing.JobRun`
    name it: ``succeeded``, ``retried``, ``dead``, ``snoozed``, or ``cancelled`` (the run
    was told to stop, or its claim was settled elsewhere: timed out, handed back)."""
    if outcome.job.is_cancelled:
        return "cancelled"
    kind = outcome.kind
    if kind is OutcomeKind.SUCCEEDED:
        return "succeeded"
    if kind is OutcomeKind.FAILED:
        return "dead" if outcome.dead else "retried"
    if kind is OutcomeKind.SNOOZED:
        return "snoozed"
    return "cancelled"


def retry_delay(policy: RetryPolicy, job: ClaimedJob, name: str) -> float:
    """Seconds before the next attempt; a broken retry policy must not lose the job."""
    try:
        delay = float(policy(job.attempts))
    except Exception:
        log.exception("task %s: retry policy failed; retrying in 60s", name)
        return 60.0
    if delay != delay:  # NaN
        log.error("task %s: retry policy returned NaN; retrying in 60s", name)
        return 60.0
    return bounded_delay(delay)


def bounded_delay(seconds: float) -> float:
    """A retry or snooze delay the completer can write: at least 0, at most
    :data:`~sqla_jobs._storable.DURATION_MAX_SECONDS`. A longer one (``Snooze(1e300)``, a
    policy returning ``inf``) made the statement that records it fail, for its whole
    batch, until the worker gave up; a NaN waits a minute."""
    if not seconds <= DURATION_MAX_SECONDS:
        return 60.0 if seconds != seconds else DURATION_MAX_SECONDS
    return max(0.0, seconds)


#: How long after its enqueue a job whose task a worker does not know is left for a
#: worker that does (snoozed, its attempt not counted) before it fails as any other.
UNKNOWN_TASK_GRACE = timedelta(days=1)


def unknown_task(jobs: Jobs, job: ClaimedJob, worker: str) -> Outcome:
    """A job whose task this worker does not know, most likely enqueued by newer code
    during a rolling deploy: snoozed by the registry's retry policy, its attempt not
    counted, so that a worker that knows the task takes it. Counted as a failure, an
    older worker spent the job's attempts, and one of ``max_attempts=1`` died unrun.

    Up to :data:`UNKNOWN_TASK_GRACE` after its enqueue: a task that no worker will ever
    know (a misspelt name, a removed task) then fails by the default policy and ends dead,
    where an operator sees it, rather than wait for ever."""
    error = f"unknown task {job.task!r}: no handler of that name is registered in worker {worker}"
    delay = retry_delay(jobs.retry, job, job.task)
    created = job.created_at
    if created is not None and datetime.now(timezone.utc) - created < UNKNOWN_TASK_GRACE:
        outcome = Outcome(OutcomeKind.SNOOZED, job, error=error, delay=delay)
        said = "unknown task, left for a worker that knows it"
    else:
        outcome = Outcome(OutcomeKind.FAILED, job, error=error, delay=delay)
        said = "unknown task, failing it"
    try:
        job_log(logging.ERROR, job, said, outcome=outcome_name(outcome))
    except Exception:  # a log handler that fails changes no outcome (see _core.quietly)
        print_unlogged("the log line about an unknown task failed")
    return outcome


#: Decodes ``args`` and ``meta``, which the claim returns as JSON text (see
#: :func:`sqla_jobs._queries.claimed_columns`).
_decode_json = json.JSONDecoder().decode

#: What an undecodable row's job shows for a time that could not be read.
_NO_TIME = datetime.min.replace(tzinfo=timezone.utc)


def decode_rows(
    rows: Iterable[Sequence[Any]], worker: str
) -> tuple[list[ClaimedJob], list[Outcome]]:
    """Claimed rows (:data:`~sqla_jobs._queries.CLAIMED_COLUMNS`, JSON as text) as the jobs
    to run, and the failures of those that cannot be run.

    A row the worker cannot read (JSON that Python cannot decode, ``args`` that are not an
    object, a ``meta`` that is not an object or holds a retention that is not a duration,
    a time Python cannot hold) is failed on its own, dead, with an error naming the
    column and why: it must end as that row's failure, never as the worker's or its
    batch's. The common row costs what psycopg's JSON loader cost: a decode per column.
    """
    ok: list[ClaimedJob] = []
    bad: list[Outcome] = []
    decode = _decode_json
    for row in rows:
        try:
            args = decode(row[3])
            meta = None if row[9] is None else decode(row[9])
        except (ValueError, RecursionError, TypeError):
            bad.append(_unreadable(row, worker))
            continue
        if (
            type(args) is not dict
            or row[7] is None
            or row[8] is None
            or (meta is not None and (type(meta) is not dict or KEEP_KEY in meta))
        ):
            # The unusual rows, a result-keeping job's among them: looked at closely.
            problem = _row_problem(args, meta, row)
            if problem is not None:
                bad.append(_unreadable(row, worker, problem, args, meta))
                continue
        ok.append(
            ClaimedJob(
                row[0], row[1], row[2], args, row[4], row[5], row[6], row[7], row[8], meta, worker
            )
        )
    return ok, bad


def _row_problem(args: Any, meta: Any, row: Sequence[Any]) -> str | None:
    if type(args) is not dict:
        return f"args is {_json_kind(args)}, not a JSON object"
    for index, name in ((7, "run_at"), (8, "created_at")):
        if row[index] is None:
            return (
                f"{name} is infinite, before the year 1 or after the year 9999, which "
                "Python's datetime cannot hold"
            )
    if meta is None:
        return None
    if type(meta) is not dict:
        return f"meta is {_json_kind(meta)}, not a JSON object"
    if KEEP_KEY in meta:
        keep = meta[KEEP_KEY]
        if (
            not isinstance(keep, (int, float))
            or isinstance(keep, bool)
            or not 0 <= keep <= DURATION_MAX_SECONDS
        ):
            return (
                f"meta[{KEEP_KEY!r}] is {json.dumps(keep)[:60]}, not a number of seconds "
                f"from 0 to {DURATION_MAX_SECONDS:.0f} (how long to keep the result)"
            )
    return None


def _unreadable(
    row: Sequence[Any], worker: str, problem: str | None = None, args: Any = None, meta: Any = None
) -> Outcome:
    """The failure of a claimed row that cannot be run: dead at once (the next claim would
    read the same row), its job made of what could be read (a ``meta`` that was read
    still settles the job's children and wakes who waits for its result)."""
    if problem is None:
        problem, args, meta = _decode_problem(row)
    job = ClaimedJob(
        row[0],
        row[1],
        row[2],
        args if type(args) is dict else {},
        row[4],
        row[5],
        row[6],
        row[7] or _NO_TIME,
        row[8] or _NO_TIME,
        meta if type(meta) is dict else None,
        worker,
    )
    return Outcome(OutcomeKind.FAILED, job, error=f"{UNREADABLE}: {problem}", permanent=True)


def _decode_problem(row: Sequence[Any]) -> tuple[str, Any, Any]:
    """Which of ``args`` and ``meta`` Python cannot decode, and why; what did decode."""
    values: list[Any] = [None, None]
    for i, (index, name) in enumerate(((3, "args"), (9, "meta"))):
        if row[index] is None:
            if index == 3:
                return "args is NULL, not a JSON object", *values
            continue
        try:
            values[i] = _decode_json(row[index])
        except RecursionError as exc:
            return f"{name} is nested too deeply for Python to decode ({exc})", *values
        except ValueError as exc:
            return f"{name} cannot be decoded by Python ({type(exc).__name__}: {exc})", *values
    return "args or meta cannot be decoded by Python", *values


#: How ``last_error`` starts for a claimed row the worker cannot run.
UNREADABLE = "unreadable job row"


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, bool):
        return "a JSON boolean"
    if value is None:
        return "JSON null"
    return "a JSON number"


def outcome_of(task: Task[Any, Any], job: ClaimedJob, exc: BaseException | None) -> Outcome:
    """Map how a handler ended to an outcome."""
    if exc is None:
        return Outcome(OutcomeKind.SUCCEEDED, job)
    if isinstance(exc, Snooze):
        return Outcome(OutcomeKind.SNOOZED, job, delay=bounded_delay(exc.delay))
    if isinstance(exc, PermanentError) or (isinstance(exc, StepError) and exc.permanent):
        return Outcome(OutcomeKind.FAILED, job, error=format_error(exc), permanent=True)
    return Outcome(
        OutcomeKind.FAILED,
        job,
        error=format_error(exc),
        delay=retry_delay(task.retry, job, task.name),
    )


def timed_out(task: Task[Any, Any], job: ClaimedJob) -> Outcome:
    return Outcome(
        OutcomeKind.FAILED,
        job,
        error=f"TimeoutError: task {task.name!r} ran longer than its timeout of {task.timeout}s",
        delay=retry_delay(task.retry, job, task.name),
    )


def keeps(job: ClaimedJob) -> float | None:
    """Seconds this job's result is to be kept, or None (its ``meta``, as claimed)."""
    meta = job.meta
    if meta is None:
        return None
    keep = meta.get(KEEP_KEY)
    return None if keep is None else float(keep)


def is_flow(job: ClaimedJob) -> bool:
    """A job that keeps its result or has dependent jobs: its outcome is written by the
    flow statements, in a transaction with the release (or cancellation) of its children.
    Decided from the claimed ``meta``; most jobs have none, and pay one ``is None``."""
    meta = job.meta
    return meta is not None and (KEEP_KEY in meta or CHILDREN_KEY in meta)


def result_json(value: Any) -> str:
    """A handler's return value as stored JSON text.

    :raises ResultError: not JSON (naming its type), or text PostgreSQL cannot store.
    """
    try:
        text = _result_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ResultError(
            f"the handler returned a {type(value).__qualname__}, which is not "
            f"JSON-serialisable ({exc}); a task that keeps its result must return JSON"
        ) from None
    # A result is read back by Jobs.result and by the jobs that wait for it (a group's
    # callback gets it in its arguments): it must decode, long ints included.
    problem = _storage_problem(text, value, value, ("result", "the result"), start=0)
    if problem is not None:
        raise ResultError(problem)
    return text


def _storage_problem(
    text: str, whole: Any, value: Any, names: tuple[str, str], *, start: int
) -> str | None:
    """Why ``text`` (``whole`` as JSON) cannot be stored and read back, or None: what JSON
    takes and PostgreSQL does not (NUL, surrogates, non-string keys), looked for only when
    the text shows a reason to (escapes, or a dict from ``start`` on), then an int in
    ``value`` too long for a reader to decode. ``names`` begin the two messages. Text
    past :data:`JSONB_SAFE_CHARS` is always measured: it may be more than ``jsonb`` holds
    (an array of two 140 MB strings), which PostgreSQL refused only at the completion,
    a program limit the completer retried for as long as the worker ran."""
    if not text.isascii() or "\\u0000" in text or "{" in text[start:]:
        problem = json_problem(whole, names[0])  # the size too, for a long text
        if problem is not None:
            return problem
    elif len(text) > JSONB_SAFE_CHARS:
        problem = jsonb_problem(whole)
        if problem is not None:
            return f"{names[0]} {problem}"
    return long_int_problem(value, names[1], text)


_result_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def outcome_statements(
    queries: Queries, batch: Iterable[Outcome]
) -> list[tuple[sa.Executable, dict[str, Any]]]:
    """The statements that record a batch: one for all successes, one per failure or
    snooze. Each is guarded, so running them again after a partial failure is harmless.
    Flow jobs (:func:`is_flow`) get :attr:`Queries.complete_flow` and
    :attr:`Queries.fail_flow`; the caller writes those in one transaction with the
    statements that release or cancel their children."""
    statements: list[tuple[sa.Executable, dict[str, Any]]] = []
    done: list[ClaimedJob] = []
    flow: list[Outcome] = []
    for o in batch:
        if o.kind is OutcomeKind.SUCCEEDED:
            # Inline is_flow: this loop sees every success of every batch.
            meta = o.job.meta
            if meta is not None and (KEEP_KEY in meta or CHILDREN_KEY in meta):
                flow.append(o)
            else:
                done.append(o.job)
    if done:
        statements.append((queries.complete, dict(batch_params(done))))
    if flow:
        flow.sort(key=_job_id)  # batch_params puts the ids in order: the lists follow it
        params_f = dict(batch_params(o.job for o in flow))
        params_f["result_list"] = [o.result for o in flow]
        params_f["keep_list"] = [keeps(o.job) or 0.0 for o in flow]
        statements.append((queries.complete_flow, params_f))
    for o in sorted(batch, key=_job_id):  # rows locked in id order (see batch_params)
        if o.kind is OutcomeKind.FAILED:
            params = fail_params(
                o.job,
                o.error or "",
                o.delay,
                permanent=o.permanent,
                progress=o.job.unwritten_progress(),
            )
            fail = queries.fail_flow if is_flow(o.job) else queries.fail
            statements.append((fail, dict(params)))
        elif o.kind is OutcomeKind.SNOOZED:
            params_ = snooze_params(o.job, o.delay, o.job.unwritten_progress(), o.error)
            statements.append((queries.snooze, dict(params_)))
    return statements


def _job_id(outcome: Outcome) -> int:
    return outcome.job.id

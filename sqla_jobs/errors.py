"""Exceptions: those raised to the caller, and those a handler raises to steer its job;
and how any error is told in one line (:func:`describe`, :func:`unreachable`), which the
worker, the CLI, the dashboard, metrics and tracing share."""

from __future__ import annotations

import logging
import sys
import traceback

import psycopg
import sqlalchemy as sa

__all__ = [
    "EnqueueError",
    "JobFailedError",
    "JobsError",
    "PermanentError",
    "ResultError",
    "SignalError",
    "Snooze",
    "StepError",
    "UnknownTaskError",
    "WaitTimedOut",
    "WorkerError",
    "answered",
    "describe",
    "unreachable",
]


class JobsError(Exception):
    """Base class of every error sqla-jobs raises to its caller."""


class EnqueueError(JobsError, ValueError):
    """A job could not be enqueued: bad arguments, options or task. Nothing was added."""


class UnknownTaskError(EnqueueError, LookupError):
    """No task of that name is registered."""


class WorkerError(JobsError):
    """A worker stopped because one of its duties kept failing (see the log for why).

    Raised by ``Worker.run()`` after the graceful shutdown; ``sqla-jobs worker`` exits
    with code 1, so that a supervisor (systemd, Kubernetes, ``--processes``) starts a fresh
    process instead of leaving one whose heartbeat or completer is dead.
    """


class Snooze(Exception):
    """Raise from a handler to say "not yet": run the job again after ``delay`` seconds.

    The attempt does not count against ``max_attempts``. (``attempts`` still grows, since it
    identifies each claim for the completion guard; ``max_attempts`` grows with it.)
    """

    def __init__(self, delay: float) -> None:
        if delay < 0:
            raise ValueError(f"Snooze delay must be >= 0 seconds, got {delay!r}")
        super().__init__(f"snoozed for {delay} s")
        self.delay = float(delay)


class PermanentError(Exception):
    """Raise from a handler (or raise ``from`` a cause) to fail the job at once, with no retry."""


class ResultError(PermanentError):
    """A result-keeping handler returned a value that is not JSON: the job fails at once
    (dead, no retry: the next run would return the same kind of value), with this error
    naming the value's type, rather than finishing with its result silently dropped."""


class JobFailedError(JobsError):
    """:meth:`Jobs.result <sqla_jobs.Jobs.result>` waited for a job that ended dead or
    cancelled: ``status`` says which, ``last_error`` why (its traceback, for a dead job)."""

    def __init__(self, job_id: int, status: str, last_error: str | None) -> None:
        last = (last_error or "").strip().splitlines()
        super().__init__(f"job {job_id} ended {status}" + (f": {last[-1]}" if last else ""))
        self.job_id = job_id
        self.status = status
        self.last_error = last_error


class StepError(JobsError):
    """A durable step was misused or could not be stored (:mod:`sqla_jobs.steps`): a name
    used twice in one run, a result that is not JSON or too large, a name that clashes
    with another kind of step. Raised at the step, before anything is written, so the
    handler fails there (and is retried by its task's policy) rather than at a COMMIT.

    ``permanent`` (a step's result that cannot be stored): the job fails at once, dead,
    as for a :class:`PermanentError`, since a retry would call the step's function again
    (its side effect repeated) for a value of the same kind."""

    #: Fail the job at once, with no retry.
    permanent: bool = False

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        if permanent:
            self.permanent = True


class SignalError(JobsError):
    """:meth:`Jobs.signal <sqla_jobs.Jobs.signal>` could not deliver: ``reason`` is
    ``"unknown"`` (no such job: never enqueued, or finished and deleted), ``"finished"``
    (done, dead or cancelled), ``"resolved"`` (that wait already has its signal),
    ``"timed_out"`` (the wait gave up first) or ``"not_a_wait"`` (the job has a step of
    that name that is no wait). Nothing was written; the caller's transaction is intact."""

    def __init__(self, job_id: int, name: str, reason: str, detail: str) -> None:
        super().__init__(f"signal {name!r} for job {job_id}: {detail}")
        self.job_id = job_id
        self.name = name
        self.reason = reason


class WaitTimedOut(JobsError):
    """Raised by ``steps.wait(name, timeout=...)`` when the timeout passed before a signal
    of that name committed. The outcome is stored: every later attempt of the job raises
    it again at the same wait, so a handler that catches it takes the same branch each
    time."""

    def __init__(self, job_id: int, name: str) -> None:
        super().__init__(f"job {job_id}: the wait {name!r} timed out before its signal came")
        self.job_id = job_id
        self.name = name


def missing_extra(what: str, needs: str, extra: str) -> str:
    """What to say when ``what`` (a module, a flag) is used without the optional dependency
    it ``needs``: the one wording of the hint, which names the extra that installs it."""
    return f"{what} needs {needs}: pip install 'sqla-jobs[{extra}]'"


def print_unlogged(what: str) -> None:
    """Print ``what`` went wrong, and the error being handled (a log line's, a listener's),
    to stderr, as :mod:`logging` prints its own handlers' errors (``logging.raiseExceptions``):
    the logging that would report it is what failed, and what a job's log lines and events
    say must never change what happens to the job, nor raise into an application's
    commit. Never raises itself (stderr closed, or the error unprintable too)."""
    if not logging.raiseExceptions:
        return
    try:
        sys.stderr.write(f"--- sqla_jobs: {what}\n")
        traceback.print_exc(file=sys.stderr)
    except Exception:
        pass


def describe(exc: BaseException) -> str:
    """One line about an error, without the SQL statement SQLAlchemy puts in its message.

    Never raises: it is called while a failure is being reported (a log line, a run's
    span), where raising would lose the report, so an exception whose ``str()`` fails (a
    handler's own class, or a built-in one holding such an object) is
    ``<unprintable ValueError>``."""
    if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
        exc = exc.orig
    try:
        lines = str(exc).strip().splitlines()
    except Exception:
        return f"<unprintable {type(exc).__name__}>"
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


#: SQLSTATE classes of errors about the connection or the server as a whole, not about
#: the statement that met them: connection exceptions, insufficient resources (too many
#: connections), system errors, internal errors; and of operator intervention (57), all
#: but a statement cancelled by its timeout (57014).
_SERVER_CLASSES = ("08", "53", "57", "58", "XX")


#: A prepared statement that is not there, or already is: a pooler in transaction mode
#: lent the statement another server connection. The connection's trouble, not the
#: statement's (the worker says so once, and retries at once).
_POOLER_STATES = frozenset({"26000", "42P05"})


def answered(exc: BaseException) -> bool:
    """The server answered a statement with an error about that statement (an
    application's trigger, a constraint, a statement timeout, a missing table), on a
    connection that still works: the next statement, another queue's claim, may well
    succeed. Not an outage, which :func:`unreachable` tells."""
    if not isinstance(exc, sa.exc.DBAPIError) or exc.connection_invalidated:
        return False
    state = getattr(exc.orig, "sqlstate", None)
    if not isinstance(state, str) or state in _POOLER_STATES:
        return False
    return state == "57014" or state[:2] not in _SERVER_CLASSES


#: SQLSTATEs of an error that trying the same statement again may well not meet: a
#: serialization failure, a deadlock, a lock not available in time (``lock_timeout``), a
#: statement cancelled by its timeout (a migration held the table for a while).
_PASSING_STATES = frozenset({"40001", "40P01", "55P03", "57014"})


def passing(exc: BaseException) -> bool:
    """The server answered a statement with an error of the moment (see
    :data:`_PASSING_STATES`): the statement itself is fine, and the next try may pass."""
    if not answered(exc):
        return False
    state: object = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return state in _PASSING_STATES


#: SQLSTATEs of a transaction the database undid so that another could go on: a
#: serialization failure, a deadlock. Nothing of it was kept, and the same work run again
#: in a new transaction reads past the one it met.
CONFLICT_STATES = frozenset({"40001", "40P01"})


def conflicted(exc: BaseException) -> bool:
    """The database undid the transaction for another's sake (:data:`CONFLICT_STATES`):
    the worker runs such a transactional run again uncounted, and the dashboard and
    ``sqla-jobs`` such an action's transaction."""
    state = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return isinstance(exc, sa.exc.DBAPIError) and state in CONFLICT_STATES


def unreachable(exc: BaseException) -> bool:
    """The server could not be reached (or dropped the connection), as opposed to an error
    it answered with (a missing table, a constraint)."""
    return isinstance(
        exc,
        (
            sa.exc.OperationalError,
            sa.exc.InterfaceError,
            sa.exc.TimeoutError,
            psycopg.OperationalError,
            psycopg.InterfaceError,
        ),
    )

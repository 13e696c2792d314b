"""Exceptions: those raised to the caller, and those a handler raises to steer its job."""

from __future__ import annotations

__all__ = [
    "EnqueueError",
    "JobsError",
    "PermanentError",
    "Snooze",
    "UnknownTaskError",
    "WorkerError",
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

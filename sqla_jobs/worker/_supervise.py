"""Supervision of the fetch loop and the side duties.

A duty is a ``run_once`` run again and again until it says it is done. When it raises,
the supervisor decides (:func:`supervise`): database errors are waited out for ever;
anything else (a bug, an exhausted resource) is logged with its traceback and retried
with backoff, and after :data:`~._outage.MAX_DUTY_FAILURES` in a row the worker stops
loudly (:class:`~sqla_jobs.errors.WorkerError`), since a side duty that is dead for good
would let leases lapse and jobs run twice. :func:`watched` notes which step each loop
waits on, for the health report (:mod:`._vitals`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import WorkerError, describe
from ._outage import MAX_DUTY_FAILURES, is_database_error, retry_pause
from ._steps import Pause, Step, Steps, Unlisten

if TYPE_CHECKING:
    from ._core import WorkerCore

__all__ = ["DutyState", "supervise", "supervised", "watched"]

log = logging.getLogger("sqla_jobs.worker")

#: The duties that outlive the stop: outcomes must be written, and leases kept while
#: handlers finish. They end by themselves, once nothing is left.
OUTLIVE_STOP = frozenset({"completer", "heartbeat"})


def watched(waiting: dict[str, tuple[float, Step | None]], name: str, steps: Steps) -> Steps:
    """``yield from steps``, noting in ``waiting`` which step the loop ``name`` waits on,
    and since when. One clock reading per step."""
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                step = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                return stop.value
            waiting[name] = (time.monotonic(), step)
            try:
                value, error = (yield step), None
            except GeneratorExit:
                raise
            except BaseException as exc:
                value, error = None, exc
    finally:
        waiting[name] = (time.monotonic(), None)
        steps.close()


def supervised(core: WorkerCore, name: str, run_once: Callable[[], Steps]) -> Steps:
    """Run a duty (``run_once`` again and again) until it says it is done; when it raises,
    run it again after the pause :func:`supervise` decides, or stop the worker."""
    outlives_stop = name in OUTLIVE_STOP
    # Whether a round of the listener got as far as its LISTEN (a connection dropped after
    # it is no failure in a row). The listener's own loop resets the mark: the other
    # duties' loops, running beside it, cleared it between its LISTEN and its failure,
    # and its pauses grew to half a second each time the server ended its connection.
    listener = core.listener if name == "listener" else None
    state = DutyState(core, name)
    generation = core.generation  # this run's: a duty ends with its run
    while core.generation == generation:
        if listener is not None:
            listener.listened = False
        error: Exception | None = None
        try:
            more = yield from run_once()
        except Exception as exc:
            error = exc
        if name == "listener":
            yield Unlisten()
        if error is None:
            if more is not True:
                return
            state.succeeded()
            continue
        if listener is not None and listener.listened:
            state.succeeded()
        try:
            pause = state.failed(error)
        except WorkerError as fatal:
            core.fatal = fatal
            core.driver.stop()
            return
        yield Pause(pause, stoppable=not outlives_stop)
        if core.stopping and not outlives_stop:
            return


def supervise(core: WorkerCore, name: str, failures: int, exc: BaseException) -> float:
    """A duty raised: log it, and say how long to wait before running it again.

    Database errors are waited out for ever (with the pause of :func:`~._outage.retry_pause`);
    anything else is logged with its traceback and retried with backoff, and after
    :data:`~._outage.MAX_DUTY_FAILURES` in a row raises :class:`~sqla_jobs.errors.WorkerError`.
    """
    if is_database_error(exc):
        pause = retry_pause(failures, exc)
        core.db_warning(
            exc,
            "worker %s: %s: database error, again in %.2fs: %s",
            core.name,
            name,
            pause,
            describe(exc),
        )
        return pause
    if failures >= MAX_DUTY_FAILURES:
        log.critical(
            "worker %s: %s failed %d times in a row; stopping the worker",
            core.name,
            name,
            failures,
            exc_info=exc,
        )
        raise WorkerError(f"worker {core.name}: {name} kept failing: {describe(exc)}") from exc
    pause = min(5.0, 0.1 * 2.0 ** (failures - 1)) * random.uniform(0.8, 1.2)
    log.error(
        "worker %s: %s failed unexpectedly; restarting it in %.2fs",
        core.name,
        name,
        pause,
        exc_info=exc,
    )
    return pause


class DutyState:
    """A supervisor's memory of one duty: how often it failed in a row.

    A round that ends normally resets it. So does a listener round that got as far as its
    LISTEN: that round holds its connection for hours, and one connection dropped a day is
    not "failing repeatedly".
    """

    def __init__(self, core: WorkerCore, name: str) -> None:
        self.core, self.name = core, name
        self.failures = 0

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self, exc: BaseException) -> float:
        """Seconds to wait before the next run; raises WorkerError to stop the worker."""
        self.failures += 1
        return self.core.supervise(self.name, self.failures, exc)

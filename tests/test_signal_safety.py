"""Stop signals handled without taking a lock in the handler, and an asyncio worker whose
stuck plain handler does not keep its process alive after the grace period.

A Python signal handler runs in the main thread between two bytecodes of whatever it was
doing, maybe inside ``threading.Event.wait`` holding the event's (non-reentrant) lock. The
tests here hold that lock in the main thread themselves, in a child process, and send the
signal there: a handler that sets the event waits for ever, and the child never ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_jobs import Jobs, current_job

from . import app
from .helpers import count, rows, wait_for
from .test_cli_worker import ROOT, enqueue_slow, start_worker


def run_script(script: str, database_url: str, timeout: float = 30) -> str:
    """Run ``script`` in a fresh interpreter; its output. Fails (and kills it) when it
    has not ended within ``timeout`` seconds: a deadlocked signal handler."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": database_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"still running {timeout}s after the signal (deadlocked):\n{out}")
    assert proc.returncode == 0, out
    return out


#: The signal lands while the main thread holds the lock of the event that ``stop()``
#: sets (as the fetch loop does inside ``wake.wait``): the handler must return, the worker
#: count as stopping at once, and the event be set once the lock is released.
HELD_LOCK = """
    import os, signal, time
    from sqla_jobs import Worker
    from sqla_jobs.sharding import ShardedWorker
    from sqla_jobs.worker._signals import EarlyStop
    from tests import app

    url = os.environ["DATABASE_URL"]
    how = {how!r}
    if how == "sharded":
        worker = ShardedWorker(app.jobs, {{"a": url}}, queues=["records"])
        event, stopping = worker._stopping, lambda: worker.workers["a"].stopping
    else:
        worker = Worker(app.jobs, url, queues=["records"])
        event, stopping = worker._wakeups.wake, lambda: worker.stopping
    if how == "early":
        early = EarlyStop()
        installed = early.installed()
        early.attach(worker)
    elif how == "application":
        # The application's own handler, around run(install_signal_handlers=False).
        signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop())
        installed = open(os.devnull)
    else:
        installed = worker._signals(True)
    with installed:
        with event._cond:  # as the fetch loop does, inside event.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not stopping() and time.monotonic() < deadline:
                time.sleep(0.01)  # where the handler runs
        print("stopping", stopping(), "set", event.wait(10), flush=True)
"""


@pytest.mark.parametrize("how", ["own", "early", "application", "sharded"])
def test_a_stop_signal_that_lands_inside_the_wait_on_the_event_it_sets_stops_the_worker(
    database_url: str, how: str
) -> None:
    """``own``: the worker's handlers (``stopped_by_signals``); ``early``: the CLI's
    handler before the worker installs its own (``EarlyStop``); ``application``: a handler
    of the application's that calls ``Worker.stop()``; ``sharded``: ``ShardedWorker``."""
    out = run_script(HELD_LOCK.format(how=how), database_url)
    assert "stopping True set True" in out, out


#: ``supervise()`` with the first wait of its loop on its event made to hold the event's
#: lock for a while (the real interleaving "the signal lands inside Event.wait", a few
#: microseconds wide at each wait, widened), and saying so in the file ``mark``.
SUPERVISOR = """
    import logging, sys, threading, time, types
    from sqla_jobs.worker import supervisor

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")

    armed = [True]

    class Event(threading.Event):
        def wait(self, timeout=None):
            if armed[0] and threading.current_thread() is threading.main_thread():
                armed[0] = False
                with self._cond:
                    open({mark!r}, "w").close()
                    time.sleep(5)  # the test's SIGTERM lands here
            return super().wait(timeout)

    supervisor.threading = types.SimpleNamespace(**{{**vars(threading), "Event": Event}})
    argv = ["worker", "tests.app:jobs", "--queues", "records", "--grace-period", "1"]
    sys.exit(supervisor.supervise(argv, 1, grace_period=1))
"""


def test_the_supervisor_stops_on_a_sigterm_that_lands_inside_its_wait(
    db: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    mark = tmp_path / "in-wait"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SUPERVISOR.format(mark=str(mark)))],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DATABASE_URL": database_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(mark.exists, timeout=30)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"the supervisor did not stop within 30 s of SIGTERM:\n{out}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert "supervisor: received SIGTERM, stopping 1 workers" in out, out
    assert "supervisor: all worker processes stopped" in out, out


def test_an_asyncio_worker_stops_after_its_grace_period_despite_a_stuck_plain_handler(
    db: sa.Engine,
) -> None:
    """Its plain handler (``time.sleep(120)``) is cut off by the grace period and its job
    handed back; the process then exits at once (it waited for the handler's thread, a
    ``ThreadPoolExecutor``'s, which the interpreter joins at exit)."""
    enqueue_slow(db, 1, 120.0)
    proc = start_worker(
        "--queues", "records", "--concurrency", "1", "--grace-period", "1", "--asyncio"
    )
    try:
        wait_for(lambda: count(db, app.Run) == 1, timeout=30)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"the asyncio worker outlived its grace period:\n{out}")
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert count(db, status="ready") == 1  # handed back


def test_asyncio_plain_handlers_run_in_daemon_threads_at_most_concurrency_at_once(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """The asyncio worker's own handler threads: daemon threads (not joined at exit), no
    more than ``concurrency`` at once, each handler in its job's context."""
    from sqla_jobs.aio import AsyncWorker

    lock = threading.Lock()
    running = [0]
    most = [0]
    seen: list[tuple[int, bool]] = []

    @jobs.task(queue="q", name="plain")
    def plain(n: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            seen.append((current_job().args["n"], threading.current_thread().daemon))
        time.sleep(0.1)
        with lock:
            running[0] -= 1

    from sqla_jobs import JobSession

    with JobSession(db, jobs=jobs) as session:
        session.enqueue_many(plain, [{"n": n} for n in range(6)])
        session.commit()
    worker = AsyncWorker(jobs, database_url, queues=["q"], concurrency=2, listen=False)

    async def main() -> int:
        try:
            return await worker.run_until_empty(timeout=30)
        finally:
            await worker.engine.dispose()

    assert asyncio.run(main()) == 6
    assert sorted(seen) == [(n, True) for n in range(6)]
    assert most[0] == 2


def _stuck_then_free(jobs: Jobs) -> Any:
    release = threading.Event()

    @jobs.task(queue="q", name="stuck", timeout=0.2, max_attempts=1)
    def stuck() -> None:
        release.wait(10)  # ignores its cancellation

    @jobs.task(queue="q", name="free")
    def free() -> None:
        pass

    return release, stuck, free


def test_asyncio_a_stuck_plain_handler_leaves_its_slot_to_the_next(
    db: sa.Engine, jobs: Jobs, database_url: str
) -> None:
    """With ``concurrency=1``, a plain handler stuck past its timeout runs on in a thread
    of its own, out of the pool: the next job runs meanwhile."""
    from sqla_jobs import JobSession
    from sqla_jobs.aio import AsyncWorker

    release, stuck, free = _stuck_then_free(jobs)
    with JobSession(db, jobs=jobs) as session:
        session.enqueue(stuck)
        session.commit()
    with JobSession(db, jobs=jobs) as session:
        session.enqueue(free)
        session.commit()
    worker = AsyncWorker(jobs, database_url, queues=["q"], concurrency=1, listen=False)

    async def main() -> int:
        try:
            return await worker.run_until_empty(timeout=20)
        finally:
            await worker.engine.dispose()

    try:
        assert asyncio.run(main()) == 2
    finally:
        release.set()
    statuses = sorted(r.status for r in rows(db))
    assert statuses == ["dead", "succeeded"] or statuses == ["dead"], statuses

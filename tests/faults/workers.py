"""Worker processes for the fault tests: started through the real command line, killed,
restarted, and always reaped.

Each worker is ``python -m sqla_jobs.cli --database-url URL worker faults_app:jobs ...``,
run from this folder (so ``faults_app`` imports), in a session of its own (so a test can
kill it, and a supervisor with its children, by process group), with its output in a log
file. Its URL carries ``application_name=<app>-<n>`` (by default ``faults-worker-<n>``), so
:meth:`CrashablePostgres.terminate_backends <tests.faults.pg.CrashablePostgres.terminate_backends>`
finds its connections; the handlers record their runs through a URL of their own
(``faults-recorder``), so cutting a worker's connections never cuts the test's
instrumentation.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .faults_app import RECORD_URL_ENV
from .pg import CrashablePostgres

HERE = Path(__file__).resolve().parent

#: application_name of the handlers' own recording connections.
RECORDER_APP = "faults-recorder"


class WorkerProcess:
    """One ``sqla-jobs worker`` process (or a supervisor, with ``--processes``)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                argv,
                cwd=HERE,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.started_at = time.monotonic()
        self.killed_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def starts(self) -> int:
        """How many workers logged their start in this log (a supervisor's children share
        its log)."""
        return self.log().count("started: queues")

    def kill(self) -> None:
        """SIGKILL the process (and, for a supervisor, its whole process group)."""
        self.killed_at = time.monotonic()
        # Until it is reaped, the pid (and so the group id) cannot be reused.
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait for a graceful exit, then SIGKILL the process group."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # Not reaped yet, so its group id is still its own: the group (a
                # supervisor's children with it) goes.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=30)
        return self.popen.returncode


class WorkerGroup:
    """Worker processes sharing one command line; killed ones can be replaced.

    ``killed`` holds the pid of every process this group SIGKILLed, for explaining
    duplicate runs.
    """

    def __init__(
        self,
        pg: CrashablePostgres,
        log_dir: Path,
        *,
        queues: Sequence[str],
        concurrency: int,
        lease: float,
        poll_interval: float,
        extra: Sequence[str] = (),
        app: str = "faults-worker",
        registry: str = "faults_app:jobs",
        database: Callable[[str], tuple[list[str], dict[str, str]]] | None = None,
    ) -> None:
        self.pg = pg
        self.log_dir = log_dir
        self.app = app
        #: For an application_name: the command line arguments (after ``worker``) and the
        #: environment that give a process its database. By default ``--database-url``,
        #: straight to the suite's PostgreSQL.
        self.database = database
        self.args = [
            "worker",
            registry,
            "--queues",
            ",".join(queues),
            "--concurrency",
            str(concurrency),
            "--lease",
            str(lease),
            "--poll-interval",
            str(poll_interval),
            *extra,
        ]
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
        env[RECORD_URL_ENV] = pg.url_for(RECORDER_APP)
        self.env = env
        #: The live process in each slot.
        self.slots: list[WorkerProcess] = []
        #: Every process ever started, in order.
        self.all: list[WorkerProcess] = []
        self.killed: set[int] = set()
        self._lock = threading.Lock()
        # A worker outliving the test run would retry its database forever.
        atexit.register(self.close)

    def _spawn(self, slot: int) -> WorkerProcess:
        name = f"{self.app}-{slot}"
        env = self.env
        if self.database is None:
            argv = [sys.executable, "-m", "sqla_jobs.cli", "--database-url", self.pg.url_for(name)]
            argv += self.args
        else:
            own, extra_env = self.database(name)
            argv = [sys.executable, "-m", "sqla_jobs.cli", *self.args, *own]
            env = {**env, **extra_env}
        n = len(self.all)
        proc = WorkerProcess(argv, env, self.log_dir / f"{self.app}-{slot}-{n}.log")
        self.all.append(proc)
        return proc

    def start(self, n: int) -> list[WorkerProcess]:
        with self._lock:
            self.slots = [self._spawn(i) for i in range(n)]
            return list(self.slots)

    def wait_started(self, timeout: float = 30.0, per_process: int = 1) -> None:
        """Wait until every live process has logged its start (``per_process`` starts for
        a supervisor of that many children)."""
        deadline = time.monotonic() + timeout
        while not all(p.starts() >= per_process for p in self.slots):
            dead = [p for p in self.slots if not p.alive]
            if dead:
                raise AssertionError(f"worker exited at start:\n{dead[0].log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not started within {timeout}s")
            time.sleep(0.05)

    def kill_and_replace(self, slot: int) -> tuple[int, int]:
        """SIGKILL the process in ``slot`` and start a new one there: (old pid, new pid)."""
        with self._lock:
            old = self.slots[slot]
            old.kill()
            self.killed.add(old.pid)
            new = self.slots[slot] = self._spawn(slot)
            return old.pid, new.pid

    def exited(self) -> list[WorkerProcess]:
        """Processes that exited without being killed by the group."""
        return [p for p in self.all if p.killed_at is None and not p.alive]

    def stop(self, timeout: float = 20.0) -> None:
        for proc in self.all:
            if proc.alive:
                proc.stop(timeout)

    def close(self) -> None:
        """Whatever happened: nothing this group started is left running."""
        for proc in self.all:
            with contextlib.suppress(Exception):
                if proc.alive:
                    proc.kill()


class KillStorm:
    """SIGKILL a random worker of a group every ``every`` seconds (a uniform range), and
    start a replacement at once, until :meth:`stop`."""

    def __init__(self, group: WorkerGroup, every: tuple[float, float] = (0.5, 1.0)) -> None:
        self.group = group
        self.every = every
        self.kills: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kill-storm", daemon=True)
        self._rng = random.Random(20240611)

    def _run(self) -> None:
        while not self._stop.wait(self._rng.uniform(*self.every)):
            slot = self._rng.randrange(len(self.group.slots))
            old, new = self.group.kill_and_replace(slot)
            self.kills.append((time.monotonic(), old, new))

    def __enter__(self) -> KillStorm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)


class PauseStorm:
    """SIGSTOP a random running worker of a group for ``pause`` seconds, then SIGCONT it,
    a new pause every ``every`` seconds (a uniform range), at most ``at_once`` paused at a
    time, until ``count`` pauses have ended (or :meth:`stop`).

    ``pauses`` lists ``(pid, stopped, continued)`` in ``time.monotonic()``, the clock the
    worker processes read too (CLOCK_MONOTONIC is one clock for the whole machine).
    """

    def __init__(
        self,
        group: WorkerGroup,
        *,
        pause: float,
        count: int,
        every: tuple[float, float] = (0.3, 0.8),
        at_once: int = 1,
    ) -> None:
        self.group = group
        self.pause = pause
        self.count = count
        self.every = every
        self.at_once = at_once
        self.pauses: list[tuple[int, float, float]] = []
        self.done = threading.Event()
        self._paused: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pause-storm", daemon=True)
        self._rng = random.Random(20240612)

    def _run(self) -> None:
        next_at = time.monotonic() + self._rng.uniform(*self.every)
        started = 0
        try:
            while not self._stop.wait(0.01):
                now = time.monotonic()
                for pid, since in list(self._paused.items()):
                    if now - since >= self.pause:
                        # Read before the signal is sent: the process runs on from no
                        # earlier than this (see explains()).
                        continued = time.monotonic()
                        self._cont(pid)
                        self.pauses.append((pid, since, continued))
                if len(self.pauses) >= self.count:
                    return
                if started < self.count and now >= next_at and len(self._paused) < self.at_once:
                    free = [p for p in self.group.slots if p.alive and p.pid not in self._paused]
                    if free:
                        proc = self._rng.choice(free)
                        # Read before the signal is sent: the process is stopped no
                        # earlier than this, and runs on for a moment after kill()
                        # returns (a run it started then was read at -0.0004 s of a
                        # clock read after the kill, and looked unexplained).
                        self._paused[proc.pid] = time.monotonic()
                        os.kill(proc.pid, signal.SIGSTOP)
                        started += 1
                    next_at = now + self._rng.uniform(*self.every)
        finally:
            for pid in list(self._paused):
                self._cont(pid)
            self.done.set()

    def _cont(self, pid: int) -> None:
        self._paused.pop(pid, None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def explains(self, pid: int, start: float, end: float) -> bool:
        """``pid`` was frozen at some moment within ``[start, end]``, ``start`` being a
        time that process read itself: what it did in between may have happened on either
        side of the pause.

        A pause is known only within the storm's own clock reads: taken before SIGSTOP is
        sent (the process stops a moment later, once the signal lands) and before SIGCONT
        is. So the test is that the pause overlaps ``[start, end]``: a process that read
        ``start`` before the recorded end of a pause read it while it still ran, before it
        stopped; and a pause recorded as beginning after ``end`` began after it."""
        return any(
            p == pid and stopped <= end and start <= continued
            for p, stopped, continued in self.pauses
        )

    def __enter__(self) -> PauseStorm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

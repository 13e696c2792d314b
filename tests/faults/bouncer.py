"""A PgBouncer in transaction pooling mode in front of the suite's PostgreSQL.

It runs the system's ``pgbouncer`` (Debian's package: ``apt-get install -y pgbouncer``,
which ``.ci/run`` does), listening on 127.0.0.1 on a free port, with a configuration of its
own in a temporary directory: ``pool_mode = transaction``, trust authentication for the
``postgres`` user, and a small pool (``default_pool_size``), so that client connections
really do share server connections. As root it runs as the PostgreSQL server's system
user (PgBouncer refuses to run as root).

Debian's PgBouncer is 1.18: it knows nothing of prepared statements
(``max_prepared_statements`` came in 1.21), so whatever goes through it must not prepare
any (``prepare_threshold=None``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from .pg import CrashablePostgres, free_port

EXECUTABLE = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def available() -> bool:
    return os.access(EXECUTABLE, os.X_OK)


class Bouncer:
    """One PgBouncer process: :meth:`start`, :meth:`stop`, :meth:`cleanup`."""

    def __init__(self, pg: CrashablePostgres, *, pool_size: int = 8) -> None:
        self.pg = pg
        self.dir = Path(tempfile.mkdtemp(prefix="sqla-jobs-faults-pgbouncer-"))
        self.dir.chmod(0o777)  # PgBouncer, as the server's system user, writes its log here
        self.port = free_port()
        self.log_path = self.dir / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={pg.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 500\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.log_path}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
        )
        atexit.register(self.cleanup)

    def url_for(self, application_name: str) -> str:
        """A SQLAlchemy URL (psycopg 3) through PgBouncer, with an ``application_name``."""
        return (
            f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
            f"?application_name={application_name}"
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        argv = [EXECUTABLE]
        if os.geteuid() == 0:
            argv += ["-u", self.pg.system_user or "embedded_postgres"]
        argv.append(str(self.dir / "pgbouncer.ini"))
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(
                    host="127.0.0.1",
                    port=self.port,
                    user="postgres",
                    dbname="postgres",
                    connect_timeout=2,
                    prepare_threshold=None,
                ) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"pgbouncer exited with {self.process.returncode}:\n{self.log_tail()}"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"pgbouncer did not accept connections within {timeout}s:\n"
                        f"{self.log_tail()}"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # "safe shutdown"... and SIGTERM: at once
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

"""The recipes' READMEs work when followed: their shell steps are run here as written.

Each ```` ```sh ```` block of ``examples/*/README.md`` is run line by line, as a reader would
type it, from the repository root, with three substitutions only: the database URL that
``export DATABASE_URL=...`` names becomes a scratch database of this test's, the port a
server is told to use (5000, 8000) becomes a free one, and a block that installs the
package (``pip install``: the suite runs installed) is left out. ``cd`` and ``export``
change the state of the session, a line ending in ``&`` keeps running in the background
(stopped, and required to exit cleanly, at the end), and every other line must exit 0.
A trailing ``# -> TEXT`` says what its output shows: the line is run again, within a
deadline, until it does (a server starting, a worker running a job). Nothing else is
checked here beyond what the README promises.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import sqlalchemy as sa

from sqla_jobs import create_engine
from sqla_jobs.db import normalize_url

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMENT = re.compile(r"\s+#(?:\s(?P<comment>.*))?$")
EXPECT = re.compile(r"^->\s*(?P<text>.+)$")
DEADLINE = 60.0


def shell_lines(readme: Path) -> list[str]:
    """The lines of the README's ``sh`` blocks, in order, without the install blocks."""
    lines: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", readme.read_text(), re.DOTALL):
        if "pip install" in block:
            continue
        lines += [line for line in block.splitlines() if line.strip()]
    return lines


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Shell:
    """A reader's terminal: a working directory, exported variables, background jobs."""

    def __init__(
        self, env: dict[str, str], database_url: str, ports: dict[str, str], root: Path = ROOT
    ) -> None:
        self.cwd = root
        self.env = env
        self.database_url = database_url
        self.ports = ports
        self.background: list[tuple[str, subprocess.Popen[str], IO[str]]] = []

    def run(self, line: str) -> None:
        found = COMMENT.search(line)
        command = line[: found.start()] if found else line
        comment = (found["comment"] or "") if found else ""
        for port, free in self.ports.items():
            command = re.sub(rf"\b{port}\b", free, command)
        words = shlex.split(command)
        if words[0] == "export":
            name = words[1].partition("=")[0]
            assert name == "DATABASE_URL", line  # the one variable a recipe sets
            self.env[name] = self.database_url
        elif words[0] == "cd":
            self.cwd = (self.cwd / words[1]).resolve()
            assert self.cwd.is_dir(), line
        elif command.rstrip().endswith("&"):
            # Its output goes to a file: a pipe nobody reads would stall a chatty server.
            output = tempfile.TemporaryFile("w+")  # noqa: SIM115  closed by stop()
            process = subprocess.Popen(
                ["bash", "-c", "exec " + command.rstrip().removesuffix("&")],
                cwd=self.cwd,
                env=self.env,
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self.background.append((line, process, output))
        else:
            expect = EXPECT.match(comment)
            self._until(line, command, expect["text"] if expect else None)

    def _until(self, line: str, command: str, expect: str | None) -> None:
        deadline = time.monotonic() + DEADLINE
        while True:
            result = subprocess.run(
                ["bash", "-c", command],
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            ok = result.returncode == 0 and (expect is None or expect in result.stdout)
            # Only a line that talks to a server may wait for it to answer.
            if ok or not command.startswith("curl") or time.monotonic() > deadline:
                break
            self._alive()
            time.sleep(0.2)
        assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
        if expect is not None:
            assert expect in result.stdout, f"{line}\n{result.stdout}"

    def _alive(self) -> None:
        for line, process, output in self.background:
            if process.poll() is not None:
                raise AssertionError(f"{line}\nexited with {process.returncode}:\n{_read(output)}")

    def stop(self) -> None:
        """Stop the background jobs (as Ctrl-C would); each must end cleanly."""
        try:
            self._alive()
        finally:
            for _, process, _ in self.background:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGTERM)
        for line, process, output in self.background:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            # A server stopped by SIGTERM may say so with -15; a worker exits 0.
            assert process.returncode in (0, -signal.SIGTERM), f"{line}\n{_read(output)}"
            output.close()


def _read(output: IO[str]) -> str:
    output.seek(0)
    return output.read()


@pytest.fixture
def scratch(database_url: str) -> Iterator[str]:
    """A database of its own, dropped afterwards."""
    server = normalize_url(database_url)
    name = f"recipe_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """What an install puts on the path: the packages, not ``examples`` (which imports
    from the repository root only, where the READMEs say to run the commands). The suite
    may run from a checkout other than the installed one: these are its own packages."""
    site = tmp_path / "site"
    site.mkdir()
    for package in ("sqla_jobs", "alembic_ext"):
        (site / package).symlink_to(ROOT / package)
    return site


def follow(
    readme: Path, database: str, site: Path, ports: tuple[str, ...] = (), root: Path = ROOT
) -> Shell:
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(site),
    }
    env.pop("DATABASE_URL", None)  # the README's export sets it
    shell = Shell(env, database, {port: str(free_port()) for port in ports}, root)
    try:
        for line in shell_lines(readme):
            shell.run(line)
    except BaseException:
        shell.stop()
        raise
    return shell


def test_the_flask_recipe(scratch: str, installed: Path) -> None:
    readme = ROOT / "examples" / "flask_app" / "README.md"
    assert "create-tables" in readme.read_text()
    follow(readme, scratch, installed, ports=("5000",)).stop()


def test_the_fastapi_recipe(scratch: str, installed: Path) -> None:
    readme = ROOT / "examples" / "fastapi_app" / "README.md"
    follow(readme, scratch, installed, ports=("8000",)).stop()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the repository's ``examples/``, as the root to follow a README from: the
    revision that a recipe's ``alembic revision`` writes lands there, never in the
    migrations that other tests (test_upgrade, the shortener's own) read meanwhile."""
    root = tmp_path / "checkout"
    shutil.copytree(
        ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def test_the_shortener_recipe(scratch: str, installed: Path, checkout: Path) -> None:
    versions = checkout / "examples" / "shortener" / "migrations" / "versions"
    before = set(versions.iterdir())
    try:
        readme = checkout / "examples" / "shortener" / "README.md"
        shell = follow(readme, scratch, installed, root=checkout)
        made = [p for p in set(versions.iterdir()) - before if p.suffix == ".py"]
        assert len(made) == 1  # "empty if nothing changed": the models and migrations agree
        body = made[0].read_text()
        assert re.search(r"def upgrade\(\) -> None:\n(\s+#.*\n)*\s+pass\b", body), body
        try:
            # The worker started from where the README has you: it is serving the queues.
            engine = create_engine(scratch)
            deadline = time.monotonic() + DEADLINE
            with engine.connect() as conn:
                while not conn.execute(sa.text("SELECT count(*) FROM jobs_workers")).scalar():
                    shell._alive()
                    assert time.monotonic() < deadline, "the worker never showed up"
                    time.sleep(0.1)
                    conn.rollback()
            engine.dispose()
        finally:
            shell.stop()
    finally:
        for path in set(versions.iterdir()) - before:
            if path.is_file():
                path.unlink()
                for compiled in (versions / "__pycache__").glob(f"{path.stem}.*.pyc"):
                    compiled.unlink()

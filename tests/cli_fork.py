"""Run ``sqla-jobs`` commands in forks of a process that has already imported the CLI.

A command line run to completion (``sqla-jobs jobs list ...``, a usage error, ``--help``)
spends most of its CPU starting Python and importing SQLAlchemy and psycopg (about 0.7 s
here), and the suite runs a few hundred of them. :func:`run` gives the same result as
``subprocess.run([sys.executable, "-m", "sqla_jobs.cli", *args], ...)``, in a fresh process
with the given argv, environment, working directory and standard streams, but that process
is a fork of a *zygote*: one single-threaded Python per test worker that imported
``sqla_jobs.cli`` once and does nothing but fork. The child sets its environment and
directory, points fds 0-2 at what the caller passed, calls ``sqla_jobs.cli.main`` and
exits with its code. Nothing the tests look at is shared: each run is its own process, and
the application module a command names (``tests.app:jobs``) is imported in the child.

What a fork cannot reproduce runs as a real subprocess instead (:func:`run` falls back by
itself): an environment that changes how the interpreter starts (``PYTHON*`` variables
other than the zygote's own ``PYTHONPATH``, the locale), and, by their own helpers, the
tests of signals, supervisors and the ``python -m`` entry point itself.

The client sends its pipes to the zygote over a Unix socket (``socket.send_fds``), so
concurrent callers (``in_parallel``) each get their own child without a broker.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Variables read while the interpreter starts: a run that sets them differently from the
#: zygote's environment must start an interpreter of its own.
_STARTUP = ("PYTHON", "LANG", "LC_")

_lock = threading.Lock()
#: The zygote of this process: its process, its socket, and the start-up variables it was
#: started with (what a run must match to be forked from it).
_zygote: tuple[subprocess.Popen[bytes], str, dict[str, str]] | None = None


def _zygote_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _startup(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP)}


def _ensure_zygote() -> tuple[str, dict[str, str]]:
    """This process's zygote (started on first use, or again if it died): its socket path
    and the start-up variables it runs with."""
    global _zygote
    with _lock:
        if _zygote is not None and _zygote[0].poll() is None:
            return _zygote[1], _zygote[2]
        path = os.path.join(tempfile.mkdtemp(prefix="sqla-jobs-cli-"), "zygote.sock")
        env = _zygote_env()
        proc = subprocess.Popen(
            [sys.executable, __file__, path],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"the CLI zygote did not start: {ready!r}")
        _zygote = (proc, path, _startup(env))
        atexit.register(_stop, proc, path)
        return path, _zygote[2]


def _stop(proc: subprocess.Popen[bytes], path: str) -> None:
    """End the zygote, and remove its socket's directory (one per test process per run
    was left in the temporary directory)."""
    proc.kill()
    proc.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def run(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] = ROOT,
    timeout: float = 60,
    stdin_devnull: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``sqla-jobs *args`` as ``subprocess.run(..., capture_output=True, text=True)`` would
    run it (stdin from ``/dev/null``), and raise :class:`subprocess.TimeoutExpired` the
    same way."""
    command = [sys.executable, "-m", "sqla_jobs.cli", *args]
    path, startup = _ensure_zygote()
    if _startup(env) != startup:
        return subprocess.run(
            command,
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL if stdin_devnull else None,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    request = pickle.dumps(
        (
            [os.fsencode(a) for a in args],
            {os.fsencode(k): os.fsencode(v) for k, v in env.items()},
            os.fsencode(os.fspath(cwd)),
        )
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [out_w, err_w, status_w])
        for fd in (out_w, err_w, status_w):
            os.close(fd)
        pid = struct.unpack("!i", _recv_exactly(conn, 4))[0]
    return _collect(command, pid, out_r, err_r, status_r, timeout)


def _collect(
    command: list[str], pid: int, out_r: int, err_r: int, status_r: int, timeout: float
) -> subprocess.CompletedProcess[str]:
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: [], status_r: []}

    def drain(fd: int) -> None:
        while data := os.read(fd, 65536):
            chunks[fd].append(data)

    readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in chunks]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(reader.is_alive() for reader in readers)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for reader in readers:
            reader.join(5)
    for fd in chunks:
        os.close(fd)
    out = b"".join(chunks[out_r]).decode(errors="replace")
    err = b"".join(chunks[err_r]).decode(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
    status = b"".join(chunks[status_r])
    # No status: the child died before it could say (a signal): as subprocess reports it.
    code = int(status) if status else -signal.SIGKILL
    return subprocess.CompletedProcess(command, code, out, err)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise RuntimeError("the CLI zygote closed the connection")
        data += more
    return data


# -- the zygote --------------------------------------------------------------------------


def _serve(path: str) -> None:
    import sqla_jobs.cli  # noqa: F401  (what every fork starts from)

    # Children are reaped by the kernel: the client learns the exit code from the status
    # pipe, and a zombie would outlive nothing.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(64)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:
            conn, _ = server.accept()
            with conn:
                head, fds, _, _ = socket.recv_fds(conn, 4 + 65536, 3)
                (size,) = struct.unpack("!I", head[:4])
                body = head[4:]
                while len(body) < size:
                    body += conn.recv(size - len(body))
                pid = os.fork()
                if pid == 0:
                    server.close()
                    conn.close()
                    _child(pickle.loads(body), fds)
                conn.sendall(struct.pack("!i", pid))
            for fd in fds:
                os.close(fd)


def _child(request: tuple[list[bytes], dict[bytes, bytes], bytes], fds: list[int]) -> None:
    import traceback

    args, env, cwd = request
    out_w, err_w, status_w = fds
    code = 1
    try:
        # Only this process reports its code: a worker process it starts must not hold the
        # pipe open (stdout and stderr are inherited, as from any parent).
        os.set_inheritable(status_w, False)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (devnull, out_w, err_w):
            os.close(fd)
        sys.argv = [str(ROOT / "sqla_jobs" / "cli.py"), *map(os.fsdecode, args)]
        from sqla_jobs.cli import main

        try:
            main(sys.argv[1:])
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.write(status_w, str(code).encode())
            os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])

"""Typed enqueue: mypy and pyright hold enqueue calls to the handler's signature.

``tests/typecheck/calls.py`` holds right and wrong calls; each wrong line ends with
``# E: <mypy error codes>``. The test runs each checker on that file alone and compares
what it reports, line by line, with the marks: a wrong call that passes fails the test,
and so does an error on a right call.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALLS = ROOT / "tests" / "typecheck" / "calls.py"
MARK = re.compile(r"#\s*E:\s*(?P<codes>[\w\- ]+)$")
MYPY_LINE = re.compile(r"^calls\.py:(?P<line>\d+): error: (?P<message>.*?)\s+\[(?P<code>[\w-]+)\]$")


def expected() -> dict[int, set[str]]:
    """Line number -> the mypy error codes it must report."""
    marks: dict[int, set[str]] = {}
    for number, text in enumerate(CALLS.read_text().splitlines(), start=1):
        found = MARK.search(text)
        if found:
            marks[number] = set(found["codes"].split())
    return marks


#: mypy's incremental cache, kept between runs: checking ``calls.py`` is mostly checking
#: SQLAlchemy and sqla-jobs, which a warm cache skips (about 20 s of CPU). mypy's cache is
#: safe to keep: it rechecks any module whose source or options changed. Its own
#: directory, because the options here (``--strict``, no config) are not the project's.
MYPY_CACHE = ROOT / ".mypy_cache" / "test-typing"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The file alone in a directory, with the repository on the import path."""
    shutil.copy(CALLS, tmp_path / "calls.py")
    return tmp_path


def test_the_file_has_right_and_wrong_calls() -> None:
    marks = expected()
    assert len(marks) >= 15
    text = CALLS.read_text()
    assert "def right(" in text and "def wrong(" in text


def test_mypy_reports_exactly_the_wrong_calls(workdir: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--hide-error-context",
            "--cache-dir",
            str(MYPY_CACHE),
            "calls.py",
        ],
        cwd=workdir,
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    reported: dict[int, set[str]] = {}
    messages: dict[int, list[str]] = {}
    for line in result.stdout.splitlines():
        found = MYPY_LINE.match(line)
        if found:
            number = int(found["line"])
            reported.setdefault(number, set()).add(found["code"])
            messages.setdefault(number, []).append(found["message"])
        else:
            assert ": note:" in line, f"unexpected mypy output: {line}\n{result.stderr}"
    assert reported == expected(), result.stdout
    # The messages name what is wrong, not only that something is.
    text = "\n".join(m for ms in messages.values() for m in ms)
    for needle in ('"queue" for "enqueue"', '"queu" for "with_options"', '"too" for "args"'):
        assert needle in text, text


def test_pyright_reports_exactly_the_wrong_calls(workdir: Path) -> None:
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent))
    assert pyright is not None, "pyright is part of the dev extra: pip install -e '.[dev]'"
    (workdir / "pyrightconfig.json").write_text(
        json.dumps({"extraPaths": [str(ROOT)], "typeCheckingMode": "strict"})
    )
    result = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, "calls.py"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(result.stdout)
    lines = {
        d["range"]["start"]["line"] + 1
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    }
    assert lines == set(expected()), json.dumps(report["generalDiagnostics"], indent=1)

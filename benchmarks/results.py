"""What a benchmark run printed, kept as a result file that the docs' performance pages show.

Every benchmark here prints its findings as Markdown tables. Wrapped in
:func:`recorded`, a run's standard output still goes to the terminal, and when the run
ends with exit code 0 the tables are also written to ``benchmarks/results/<name>.json``:
the command, the time (UTC), the machine, and each table with the line that introduced it
and the context lines (``- PostgreSQL: ...``) printed before it. ``docs/_ext/bench_results.py``
renders those files, so a page shows the last run that was recorded, not a hand-kept copy
of one.

The name says what was run: the script's, then its arguments (``curves.py --rows bulk`` is
``curves_rows-bulk``), so runs of different rows do not overwrite each other. A smoke run
(``--quick``) writes nothing: its figures mean nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import platform
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

RESULTS = Path(__file__).resolve().parent / "results"


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def name_of(script: str, argv: list[str]) -> str:
    """``bench``, ``curves_rows-bulk``, ``bench_only-3_repeat-5``: the script and its args."""
    parts: list[str] = []
    for arg in argv:
        word = re.sub(r"[^A-Za-z0-9.,]+", "-", arg).strip("-")
        if parts and not arg.startswith("-"):
            parts[-1] += "-" + word  # an option's value joins the option
        else:
            parts.append(word)
    return "_".join([Path(script).stem, *[p for p in parts if p]])


def tables(text: str) -> list[dict[str, Any]]:
    """Each Markdown table of ``text``, with the line before it and the context lines."""
    found: list[dict[str, Any]] = []
    context: list[str] = []
    title = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        underline = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.startswith("|") and re.match(r"^\|[-:| ]+\|$", underline):
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            found.append(
                {"title": title, "context": list(context), "header": _cells(line), "rows": rows}
            )
            continue
        if line.startswith("- "):
            context.append(line[2:])
        elif line:
            title = line.lstrip("#").strip()
        i += 1
    return found


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@contextlib.contextmanager
def recorded(script: str, argv: list[str] | None = None) -> Iterator[None]:
    """Tee standard output; on success, write the run's tables as its result file."""
    argv = sys.argv[1:] if argv is None else argv
    tee = _Tee(sys.stdout)
    before = sys.stdout
    sys.stdout = tee
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        _write(script, argv, tee.kept.getvalue())
        raise
    finally:
        sys.stdout = before
    _write(script, argv, tee.kept.getvalue())


def _write(script: str, argv: list[str], text: str) -> None:
    found = tables(text)
    if "--quick" in argv or not found:
        return
    name = name_of(script, argv)
    RESULTS.mkdir(exist_ok=True)
    result = {
        "name": name,
        "command": " ".join(["python", f"benchmarks/{Path(script).name}", *argv]),
        "measured_at": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "database": "DATABASE_URL" if os.environ.get("DATABASE_URL") else "embedded PostgreSQL",
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}",
        "tables": found,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"results: {path}", file=sys.stderr)

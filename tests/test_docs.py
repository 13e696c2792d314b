"""The documentation site builds cleanly and documents the whole public API.

The docs are built once per run, from scratch, with warnings as errors (a broken link,
cross-reference or directive fails here, as in ``.ci/run``). Then the built pages are
read: every name of ``sqla_jobs.__all__`` and of each public module's ``__all__`` has an
entry in the reference, every ``WorkerSettings`` field a row, every subcommand of the
parser a section. The Python files the pages include (``docs/examples``) run here too,
each on a database of its own, so an example cannot rot, and every other Python block of
the pages must at least parse.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import PUBLIC_MODULES
from .test_recipes import scratch  # noqa: F401  (the fixture: a database of its own)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: From scratch (-E), warnings as errors (-W), all of them reported (--keep-going).
BUILD = ("-E", "-W", "--keep-going", "-q", "-b", "html")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once per run even when its tests land on several xdist workers.

    The build takes half a minute of CPU, and worksteal spreads this module's tests over
    the workers. The first worker to get here builds into the run's shared temporary
    directory under a file lock; the others wait for the lock and read what it built (or
    its failure, reported by each test that needed the pages)."""
    pytest.importorskip("sphinx")
    import fcntl

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's directory, above each worker's own
    out = shared / "docs-html"
    report = shared / "docs-build.txt"
    with open(shared / "docs-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not report.exists():
            result = subprocess.run(
                [sys.executable, "-m", "sphinx", *BUILD, str(DOCS), str(out)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            report.write_text(f"{result.returncode}\n{result.stdout}{result.stderr}")
            (shared / "docs-build.stderr").write_text(result.stderr)
    code, _, output = report.read_text().partition("\n")
    assert code == "0", output
    stderr = (shared / "docs-build.stderr").read_text()
    assert not stderr.strip(), stderr  # -q: only warnings would print
    return out


def anchors(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text()))


def test_every_public_name_is_in_the_reference(built: Path) -> None:
    import sqla_jobs

    found = anchors(built / "reference" / "api.html")
    missing = [name for name in sqla_jobs.__all__ if f"sqla_jobs.{name}" not in found]
    assert not missing, f"not in docs/reference/api.md: {missing}"


def test_every_public_module_is_in_the_reference(built: Path) -> None:
    import sqla_jobs

    page = anchors(built / "reference" / "modules.html") | anchors(built / "reference" / "api.html")
    missing = []
    for module in PUBLIC_MODULES:
        names = importlib.import_module(f"sqla_jobs.{module}").__all__
        assert f"module-sqla_jobs.{module}" in page, module
        for name in names:
            # A name the package itself exports is documented once, under the package.
            here = f"sqla_jobs.{module}.{name}" in page
            if not here and not (name in sqla_jobs.__all__ or _same_as_documented(module, name)):
                missing.append(f"sqla_jobs.{module}.{name}")
    assert not missing, f"not in docs/reference/modules.md: {missing}"


def _same_as_documented(module: str, name: str) -> bool:
    """``sqla_jobs.worker.AsyncWorker`` is ``sqla_jobs.aio.AsyncWorker``: shown once."""
    obj = getattr(importlib.import_module(f"sqla_jobs.{module}"), name)
    for other in PUBLIC_MODULES:
        if (
            other != module
            and getattr(importlib.import_module(f"sqla_jobs.{other}"), name, None) is obj
        ):
            return True
    return False


def test_every_worker_setting_has_a_row(built: Path) -> None:
    from sqla_jobs import WorkerSettings

    text = (built / "reference" / "worker-settings.html").read_text()
    for f in dataclasses.fields(WorkerSettings):
        assert f'<span class="pre">{f.name}</span>' in text, f.name
        help_start = f.metadata["help"].split()[0]
        assert help_start in text, f.name


def test_every_command_has_a_section(built: Path) -> None:
    from sqla_jobs.cli import build_parser

    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from cli_reference import walk
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    text = (built / "operating" / "cli.html").read_text()
    parser = build_parser()
    commands = [prog for prog, _ in walk(parser, parser.prog)]
    assert len(commands) > 6, commands
    for prog in commands:
        assert f">{prog}<" in text, prog


def test_the_pages_need_no_network(built: Path) -> None:
    """Self-contained: no script, style sheet, font or image is fetched from elsewhere."""
    for page in built.rglob("*.html"):
        text = page.read_text()
        remote = re.findall(r'<(?:script|link|img)\b[^>]*(?:src|href)="(?:https?:)?//', text)
        assert not remote, page


# -- the pages' examples -------------------------------------------------------------------

EXAMPLES = sorted((DOCS / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_example_runs(example: Path, scratch: str) -> None:  # noqa: F811
    """Each file the pages include runs as a reader would run it, on an empty database."""
    result = subprocess.run(
        [sys.executable, str(example)],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": scratch, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_example_is_on_a_page() -> None:
    """An example no page shows would be tested and never read."""
    pages = "\n".join(p.read_text() for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    shown = set(re.findall(r"literalinclude\}\s+\S*examples/(\S+\.py)", pages))
    assert shown == {p.name for p in EXAMPLES}


def test_every_python_block_of_the_pages_is_python() -> None:
    """The fragments the pages show (``...`` for what is left out) at least parse, so a
    renamed keyword or a broken edit shows here; whole examples run above."""
    failures = []
    blocks = 0
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" in page.parts:
            continue
        for found in re.finditer(r"^( *)```python\n(.*?)^\1```", page.read_text(), re.M | re.S):
            blocks += 1
            code = textwrap.dedent(found.group(2))
            try:
                compile(code, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            except SyntaxError as exc:
                failures.append(f"{page.relative_to(ROOT)}: {exc}")
    assert blocks > 30, blocks
    assert not failures, failures

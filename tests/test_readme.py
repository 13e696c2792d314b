"""The README's and the docs pages' examples say what the code does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from . import app

ROOT = Path(__file__).resolve().parents[1]


DOCS = ROOT / "docs"


def readme_block(after: str, page: Path = ROOT / "README.md") -> str:
    """The first fenced code block of ``page`` after the line that starts with ``after``."""
    text = page.read_text()
    start = text.index(after)
    found = re.search(r"```\w*\n(.*?)```", text[start:], re.DOTALL)
    assert found is not None, after
    return found.group(1)


def shape(value: Any) -> Any:
    """Keys in order and value types, not the values themselves."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def test_stats_json_example_matches_the_command(db: sa.Engine) -> None:
    example = json.loads(readme_block("`stats --json`:", DOCS / "reference" / "json-output.md"))
    with db.begin() as conn:  # what the example shows: a queue with a lag and a dead job
        t = app.Job.__table__
        conn.execute(
            sa.insert(t).values(
                task="t", queue="webhooks", run_at=sa.func.now() - sa.text("interval '2 s'")
            )
        )
        conn.execute(
            sa.insert(t).values(
                task="t", queue="webhooks", status="dead", finished_at=sa.func.now()
            )
        )
    result = subprocess.run(
        [sys.executable, "-m", "sqla_jobs.cli", "stats", "tests.app:jobs", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    # The name as declared: the test model names a schema, the example's does not.
    assert printed["table"] == app.Job.__table__.fullname == f"{app.SCHEMA}.jobs"
    assert example["table"] == "jobs"
    example["table"] = printed["table"]
    # Every queue the registry knows is listed; the example shows one.
    printed["queues"] = [q for q in printed["queues"] if q["queue"] == "webhooks"]
    assert shape(printed) == shape(example)
    assert len(result.stdout.strip().splitlines()) == 1  # one document, one line


def test_the_companion_tables_are_all_named() -> None:
    """Every companion table the model declares is in the docs' two lists of them."""
    companions = sorted(
        t.name.removeprefix("jobs")
        for t in app.Base.metadata.tables.values()
        if t.name.startswith("jobs_")
    )
    assert len(companions) == 7, companions
    for page, heading in (
        ("concepts.md", "Seven small companion tables sit beside it"),
        ("migrations/autogenerate.md", "The seven small companion tables"),
    ):
        text = (DOCS / page).read_text()
        start = text.index(heading)
        passage = text[start : text.index("\n\n", start)]
        for suffix in companions:
            assert f"`<table>{suffix}`" in passage, (heading, suffix)


def test_no_docstring_example_uses_a_deprecated_name() -> None:
    import sqla_jobs.testing

    assert "summary.done" not in (sqla_jobs.testing.__doc__ or "")


def test_the_readme_example_is_the_tested_one() -> None:
    """The README's example is docs/examples/first_job.py, which tests/test_docs.py runs."""
    example = (DOCS / "examples" / "first_job.py").read_text()
    assert readme_block("## A first job") == example


def test_the_readme_fits_on_a_few_screens() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


#: Where the README's links into the repository point: the README is also the package
#: index's project page, where a relative link resolves under the index's own URL.
BLOB = "https://github.com/sqla-jobs/sqla-jobs/blob/main/"


def test_the_readme_links_resolve() -> None:
    """Each link into the repository is absolute (a relative one is a 404 on the package
    index's page) and names a file that is there, and a heading of it."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"([a-z]+://|#)", link)]
    assert relative == [], "the package index's page cannot follow these"
    local = [link.removeprefix(BLOB) for link in links if link.startswith(BLOB)]
    assert len(local) > 20, local
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, link

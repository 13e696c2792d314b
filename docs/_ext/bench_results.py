"""``.. bench-results:: NAME``: a benchmark's last recorded run, as tables.

``benchmarks/results.py`` writes ``benchmarks/results/NAME.json`` at the end of each
benchmark run (the command, when, where, and every Markdown table the run printed). This
directive renders that file, so a performance page shows what the benchmark measured last,
not a copy kept by hand. Options:

``:table:``
    which tables, by the start of their title (the line printed before them), comma
    separated; all of them by default.
``:exclude-columns:``
    columns left out, by header, comma separated (the pass/fail columns a run prints for
    its own tracking, say).

A missing file is not an error: the page says so, and the text around the directive
says which command writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from tables import table

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def markdown_cell(text: str) -> list[nodes.Node]:
    """A cell of the benchmark's Markdown: ``code`` spans as literals, bold as plain text."""
    found: list[nodes.Node] = []
    for k, part in enumerate(text.replace("**", "").split("`")):
        if part:
            found.append(nodes.literal(text=part) if k % 2 else nodes.Text(part))
    return found


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


class BenchResults(SphinxDirective):
    required_arguments = 1
    option_spec = {
        "table": directives.unchanged,
        "exclude-columns": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        path = RESULTS / f"{name}.json"
        self.env.note_dependency(str(path))
        if not path.is_file():
            note = nodes.note()
            note += nodes.paragraph(
                text=f"No recorded run yet: benchmarks/results/{name}.json is written by "
                "running the benchmark (see above)."
            )
            return [note]
        return self._tables(json.loads(path.read_text()))

    def _tables(self, result: dict[str, Any]) -> list[nodes.Node]:
        wanted = _csv(self.options.get("table"))
        dropped = set(_csv(self.options.get("exclude-columns")))
        about = nodes.paragraph()
        about += nodes.Text(f"Recorded {result['measured_at']}: ")
        about += nodes.literal(text=result["command"])
        about += nodes.Text(f", {result['database']}, {result['machine']}.")
        if result.get("source"):
            about += nodes.Text(f" ({result['source']}.)")
        found: list[nodes.Node] = [about]
        shown = [
            t
            for t in result["tables"]
            if not wanted or any(t["title"].startswith(w) for w in wanted)
        ]
        context = shown[0]["context"] if shown else []
        if context:
            items = nodes.bullet_list()
            for line in context:
                item = nodes.list_item()
                paragraph = nodes.paragraph()
                paragraph += markdown_cell(line)
                item += paragraph
                items += item
            found.append(items)
        for t in shown:
            keep = [i for i, h in enumerate(t["header"]) if h not in dropped]
            header = [t["header"][i] for i in keep]
            rows = [[row[i] if i < len(row) else "" for i in keep] for row in t["rows"]]
            found.append(table(header, rows, markdown_cell, title=t["title"]))
        return found


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("bench-results", BenchResults)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

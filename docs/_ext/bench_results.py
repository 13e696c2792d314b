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

A missing file is not an error: the page says which command writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _cell(text: str) -> str:
    # The cells are Markdown from the benchmark's output; ``code`` becomes a literal.
    return text.replace("**", "").replace("`", "``").replace("|", "\\|") or "\\"


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


class BenchResults(SphinxDirective):
    required_arguments = 1
    option_spec = {  # noqa: RUF012  (docutils' own shape)
        "table": directives.unchanged,
        "exclude-columns": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        path = RESULTS / f"{name}.json"
        self.env.note_dependency(str(path))
        if not path.is_file():
            lines = [
                ".. note::",
                "",
                f"   No recorded run yet: ``benchmarks/results/{name}.json`` is written by",
                "   running the benchmark (see above).",
            ]
        else:
            lines = self._tables(json.loads(path.read_text()))
        container = nodes.container(classes=["bench-results"])
        self.state.nested_parse(StringList(lines, source=str(path)), 0, container)
        return [container]

    def _tables(self, result: dict[str, Any]) -> list[str]:
        wanted = _csv(self.options.get("table"))
        dropped = set(_csv(self.options.get("exclude-columns")))
        lines = [
            f"Recorded {result['measured_at']}: ``{result['command']}``, "
            f"{result['database']}, {result['machine']}.",
            "",
        ]
        context = result["tables"][0]["context"] if result["tables"] else []
        for item in context:
            lines += [f"- {_cell(item)}"]
        lines += [""]
        for table in result["tables"]:
            if wanted and not any(table["title"].startswith(w) for w in wanted):
                continue
            keep = [i for i, h in enumerate(table["header"]) if h not in dropped]
            lines += [".. list-table:: " + _cell(table["title"]), "   :header-rows: 1", ""]
            for row in [table["header"], *table["rows"]]:
                cells = [row[i] if i < len(row) else "" for i in keep]
                lines += [f"   * - {_cell(cells[0])}"]
                lines += [f"     - {_cell(c)}" for c in cells[1:]]
            lines += [""]
        return lines


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("bench-results", BenchResults)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""``.. worker-settings::``: the table of :class:`~sqla_jobs.WorkerSettings` fields.

Each row comes from the dataclass field itself (its name, default and the ``help`` of its
metadata, the same text ``sqla-jobs worker --help`` prints), so the page cannot drift from
the code: a new field is a new row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _flag(f: dataclasses.Field[Any]) -> str:
    return "--" + (f.metadata.get("cli") or f.name.replace("_", "-"))


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING:
        return "(required)"
    return f"``{f.default!r}``"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "\\<")


class WorkerSettingsTable(SphinxDirective):
    """A list-table of every field, rendered from the field metadata."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from sqla_jobs import WorkerSettings

        lines = [
            ".. list-table::",
            "   :header-rows: 1",
            "   :widths: 18 12 18 52",
            "",
            "   * - field",
            "     - default",
            "     - ``sqla-jobs worker`` flag",
            "     - what it does",
        ]
        for f in dataclasses.fields(WorkerSettings):
            help_text = f.metadata.get("help", "")
            off = f.metadata.get("off")
            if off:
                help_text += f". The flag: {off}"
            lines += [
                f"   * - ``{f.name}``",
                f"     - {_default(f)}",
                f"     - ``{_flag(f)}``",
                f"     - {_cell(help_text)}",
            ]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="worker-settings"), 0, container)
        return container.children


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("worker-settings", WorkerSettingsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

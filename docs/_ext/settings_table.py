"""``.. worker-settings::``: the table of :class:`~sqla_jobs.WorkerSettings` fields.

Each row comes from the dataclass field itself (its name, default and the ``help`` of its
metadata, the same text ``sqla-jobs worker --help`` prints), so the page cannot drift from
the code: a new field is a new row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from tables import literal_cell, table, text_cell


def _flag(f: dataclasses.Field[Any]) -> str:
    return "--" + (f.metadata.get("cli") or f.name.replace("_", "-"))


def _default(f: dataclasses.Field[Any]) -> str:
    return "(required)" if f.default is dataclasses.MISSING else repr(f.default)


class WorkerSettingsTable(SphinxDirective):
    """A table of every field, built from the field metadata."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from sqla_jobs import WorkerSettings

        rows = []
        for f in dataclasses.fields(WorkerSettings):
            help_text = f.metadata.get("help", "")
            off = f.metadata.get("off")
            if off:
                help_text += f". The flag: {off}"
            rows.append([f.name, _default(f), _flag(f), help_text])
        header = ["field", "default", "sqla-jobs worker flag", "what it does"]
        cells = [literal_cell, literal_cell, literal_cell, text_cell]
        return [table(header, rows, cells)]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("worker-settings", WorkerSettingsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

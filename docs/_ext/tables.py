"""Docutils tables built node by node, for the local extensions.

A directive's content parsed with ``nested_parse`` is read with the page's own parser
(MyST on a ``.md`` page, reStructuredText on a ``.rst`` one), so generated reST markup
would show as text on a Markdown page. Building the nodes works on both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from docutils import nodes

Cell = Callable[[str], list[nodes.Node]]


def text_cell(text: str) -> list[nodes.Node]:
    return [nodes.Text(text)]


def literal_cell(text: str) -> list[nodes.Node]:
    return [nodes.literal(text=text)] if text else []


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    cells: Sequence[Cell] | Cell = text_cell,
    title: str = "",
) -> nodes.table:
    """One header row, then ``rows``; ``cells`` renders a column (one for all, or one each)."""
    width = len(header)
    render = list(cells) if isinstance(cells, Sequence) else [cells] * width
    node = nodes.table()
    if title:
        node += nodes.title(text=title)
    group = nodes.tgroup(cols=width)
    node += group
    for _ in range(width):
        group += nodes.colspec(colwidth=1)

    def row(values: Sequence[str], make: Sequence[Cell]) -> nodes.row:
        line = nodes.row()
        for k in range(width):
            value = values[k] if k < len(values) else ""
            entry = nodes.entry()
            paragraph = nodes.paragraph()
            paragraph += make[k](value)
            entry += paragraph
            line += entry
        return line

    thead = nodes.thead()
    thead += row(header, [text_cell] * width)
    group += thead
    body = nodes.tbody()
    for values in rows:
        body += row(values, render)
    group += body
    return node

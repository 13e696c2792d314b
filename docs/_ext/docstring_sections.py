"""Section titles in docstrings become rubrics when autodoc renders them.

A module docstring is a guide and may have titled parts (``How it is built`` under a line
of dashes). Rendered inside a reference page, a title there would be a section inside a
directive, which docutils refuses, or clash with another docstring's title of the same
name. A rubric reads the same and is neither.
"""

from __future__ import annotations

import re
from typing import Any

from sphinx.application import Sphinx

UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")


def rubrics(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    i = 0
    while i + 1 < len(lines):
        title, under = lines[i], lines[i + 1]
        if (
            title.strip()
            and not title.startswith(" ")
            and UNDERLINE.match(under)
            and len(under.strip()) >= len(title.strip())
        ):
            lines[i : i + 2] = [f".. rubric:: {title.strip()}", ""]
        i += 1


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", rubrics)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

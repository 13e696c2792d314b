"""Sphinx configuration of the sqla-jobs documentation.

Built with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (warnings are
errors, so a broken link or reference fails the build). Nothing here reaches the network:
no intersphinx, no CDN, so the built HTML is readable offline as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The checkout's own package, before any installed copy, and the local extensions.
sys.path[:0] = [str(HERE.parent), str(HERE / "_ext")]

import sqla_jobs  # noqa: E402  (after the path is set)

project = "sqla-jobs"
author = "sqla-jobs developers"
copyright = "sqla-jobs developers"
release = sqla_jobs.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "settings_table",
    "cli_reference",
    "docstring_sections",
    "bench_results",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# MyST: heading anchors so that `[text](page.md#a-heading)` links resolve (and are checked).
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]

# The reference documents what the code says is public: `__all__`, in source order.
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# A method that overrides SQLAlchemy's (get_bind) would otherwise show SQLAlchemy's text,
# with references into SQLAlchemy's own docs that do not exist here.
autodoc_inherit_docstrings = False
# Optional packages the documented modules import lazily or at the top.
autodoc_mock_imports: list[str] = []

html_theme = "furo"
html_title = f"sqla-jobs {release}"
html_static_path: list[str] = []
html_show_sourcelink = False

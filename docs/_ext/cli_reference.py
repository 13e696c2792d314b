"""``.. cli-reference::``: the ``sqla-jobs`` command's help, generated from its parser.

The page shows what ``sqla-jobs COMMAND --help`` prints, for the command and every
subcommand (nested ones included), taken from :func:`sqla_jobs.cli.build_parser` when the
docs are built, so the reference cannot drift from the command. The help is shown as
literal text: help strings are plain text, not reStructuredText, so nothing in them (an
asterisk, a glob) can be misread or break the build.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Iterator
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

#: The width the help is wrapped to, so the page is the same on every machine.
WIDTH = "100"


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:  # argparse has no public walk of its subcommands
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def walk(
    parser: argparse.ArgumentParser, prog: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The parser and its subparsers, depth first, each with its full command."""
    yield prog, parser
    for name, sub in _subparsers(parser):
        yield from walk(sub, f"{prog} {name}")


def help_of(parser: argparse.ArgumentParser) -> str:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse reads it for the width of its help
    try:
        return parser.format_help()
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


class CliReference(SphinxDirective):
    """One section per command: its full name as the title, its help as literal text."""

    required_arguments = 1  # module:function that returns the parser

    def run(self) -> list[nodes.Node]:
        module, _, func = self.arguments[0].partition(":")
        parser = getattr(importlib.import_module(module), func)()
        found: list[nodes.Node] = []
        for prog, sub in walk(parser, parser.prog):
            section = nodes.section(
                ids=[nodes.make_id(prog)], names=[nodes.fully_normalize_name(prog)]
            )
            section += nodes.title(text=prog)
            section += nodes.literal_block(text=help_of(sub).rstrip(), language="text")
            self.state.document.note_implicit_target(section)
            found.append(section)
        return found


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("cli-reference", CliReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

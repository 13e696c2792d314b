"""How deeply a JSON text from outside nests, told before Python's decoder reads it.

The decoder's only limit is the interpreter's recursion, which moved between versions
(3.11 stops near 1,000 levels, 3.13 reads 5,000): the CLI's ``--meta`` and the admin
search refuse a text past their depth the same way on every Python.
"""

from __future__ import annotations

import pytest

from sqla_jobs import admin
from sqla_jobs._storable import json_text_depth


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("plain words", 0),
        ("42", 0),
        ("[1]", 1),
        ('{"a": [1, {"b": 2}]}', 3),
        ('"[[[["', 0),  # brackets inside a string do not nest
        ('{"a": "x\\"[[["}', 1),  # nor after an escaped quote inside it
        ("[" * 5000, 5000),  # unclosed: counted as far as it goes
        ("]]][", 1),  # a stray closer does not go below zero
    ],
)
def test_the_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_text_depth(text) == depth


@pytest.mark.parametrize(
    "text",
    ['{"n": ' + "[" * 40 + "1" + "]" * 40 + "}", "n=" + "[" * 3000, "n=" + "[" * 33],
)
def test_a_search_past_its_depth_is_refused_whether_or_not_python_could_read_it(
    text: str,
) -> None:
    with pytest.raises(ValueError, match="nested more than 32 levels"):
        admin.parse_search(text)


def test_a_search_within_its_depth_still_reads_as_json_or_text() -> None:
    assert admin.parse_search("n=" + "[" * 3) == ("contains", {"n": "[[["})
    assert admin.parse_search("n=[[1]]") == ("contains", {"n": [[1]]})

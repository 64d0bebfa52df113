"""A griffe extension for the API reference: ``Example:`` sections render as examples.

The package's docstrings head their doctests ``Example:`` (tests/test_docstring_examples.py
reads that heading); griffe's Google parser knows only ``Examples:`` and would render the
doctests as Markdown paragraphs. Renaming the heading before griffe parses the docstring
gives each doctest its code block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Read each ``Example:`` heading as ``Examples:``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)

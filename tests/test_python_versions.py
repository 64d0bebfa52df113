"""The package runs on the oldest Python that ``setup.cfg`` promises (``python_requires``).

The suite runs on one Python, so nothing here imports the package on an older one: each module
is parsed with the oldest version's grammar, and its imports are checked against the standard
library names that came later. ``.ci/torch-free`` under that Python is the real install.
"""

from __future__ import annotations

import ast
import configparser
import re

from tests.helpers import ROOT

# Standard library names newer than 3.10 that a module could reach for: (module, name) ->
# the first Python that has it; name None is the module itself.
NEWER: dict[tuple[str, str | None], tuple[int, int]] = {
    ("typing", "Self"): (3, 11),
    ("typing", "Never"): (3, 11),
    ("typing", "LiteralString"): (3, 11),
    ("typing", "assert_never"): (3, 11),
    ("typing", "assert_type"): (3, 11),
    ("typing", "reveal_type"): (3, 11),
    ("typing", "Required"): (3, 11),
    ("typing", "NotRequired"): (3, 11),
    ("typing", "Unpack"): (3, 11),
    ("typing", "TypeVarTuple"): (3, 11),
    ("typing", "dataclass_transform"): (3, 11),
    ("typing", "override"): (3, 12),
    ("typing", "TypeAliasType"): (3, 12),
    ("enum", "StrEnum"): (3, 11),
    ("datetime", "UTC"): (3, 11),
    ("hashlib", "file_digest"): (3, 11),
    ("asyncio", "TaskGroup"): (3, 11),
    ("asyncio", "timeout"): (3, 11),
    ("itertools", "batched"): (3, 12),
    ("tomllib", None): (3, 11),
}


def oldest_python() -> tuple[int, int]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)", config["options"]["python_requires"].strip())
    assert found, config["options"]["python_requires"]
    return int(found[1]), int(found[2])


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def too_new(source: str, oldest: tuple[int, int]) -> list[str]:
    """What in ``source`` needs a Python newer than ``oldest``; annotations-only imports
    (under ``if TYPE_CHECKING:``) are never run, so they count for nothing."""
    try:
        tree = ast.parse(source, feature_version=oldest)
    except SyntaxError as e:
        return [f"line {e.lineno}: syntax of a newer Python ({e.msg})"]
    found = []
    skip = {id(n) for top in ast.walk(tree) if _type_checking_only(top) for n in ast.walk(top)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        uses: list[tuple[str, str | None]] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            uses = [(node.module, None)] + [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            uses = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            uses = [(node.value.id, node.attr)]
        for use in uses:
            if NEWER.get(use, (0, 0)) > oldest:
                found.append(f"line {node.lineno}: {'.'.join(filter(None, use))}")
    return found


def test_the_checker_finds_what_an_older_python_lacks() -> None:
    oldest = (3, 10)
    assert too_new("from typing import Any, Self\n", oldest) == ["line 1: typing.Self"]
    assert too_new("import enum\nclass A(enum.StrEnum): pass\n", oldest) == ["line 2: enum.StrEnum"]
    syntax = too_new("try:\n    pass\nexcept* ValueError:\n    pass\n", oldest)
    assert len(syntax) == 1 and "syntax of a newer Python" in syntax[0]
    assert (
        too_new(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from typing import Self\n",
            oldest,
        )
        == []
    )
    assert too_new("from typing import Self\n", (3, 11)) == []


def test_every_module_runs_on_the_oldest_python_promised() -> None:
    oldest = oldest_python()
    found = {
        str(path.relative_to(ROOT)): too_new(path.read_text(encoding="utf-8"), oldest)
        for path in sorted((ROOT / "ckpt_tools").rglob("*.py"))
    }
    assert {path: lines for path, lines in found.items() if lines} == {}

"""The house rules that a file listing cannot show: rooms, the one-way import order, and who may
import torch, torch.distributed, click and tabulate.

Every ``import`` statement in the package is read with ``ast`` (function-level imports too, since
lazy imports are still dependencies), so a violation fails here, before anyone has to spot it.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import modules_loaded_by

PACKAGE = Path(__file__).resolve().parent.parent / "ckpt_tools"

#: Rooms from the bottom up. A module may import its own room and rooms below it, never above.
ROOMS: tuple[tuple[str, ...], ...] = (
    ("errors", "_remedies", "_escape", "dtypes", "_version", "_types"),
    ("descriptors",),
    ("structure",),
    ("formats",),
    ("io",),
    ("loading",),
    ("diffing",),
    ("ops",),
    ("harness",),
    ("cli",),
)
RANK = {room: rank for rank, rooms in enumerate(ROOMS) for room in rooms}

#: Rooms that may import torch (only when called: see test_torch_free_rooms).
TORCH_ROOMS = {"loading", "diffing", "harness", "cli"}
#: The CLI libraries stay in the CLI.
CLI_ONLY = {"click", "tabulate"}
#: Longest module a room should hold; "small modules with one job each".
MAX_LINES = 420


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, dotted name, at module level)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, id(node) in top))
            if node.module == "ckpt_tools":  # `from ckpt_tools import formats`
                found += [
                    (node.lineno, f"ckpt_tools.{a.name}", id(node) in top) for a in node.names
                ]
    return found


MODULES = [
    p for p in _modules() if p.name not in {"__init__.py", "__main__.py"} or p.parent != PACKAGE
]


def test_every_module_is_in_a_room() -> None:
    strays = [str(p.relative_to(PACKAGE)) for p in MODULES if _room(p) not in RANK]
    assert not strays, f"modules outside the rooms of tests/test_architecture.py: {strays}"


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _drawn_tree() -> set[str]:
    """The paths docs/architecture.md draws under ``ckpt_tools/`` (``formats/zip/directory.py``)."""
    text = ARCHITECTURE.read_text()
    block = text.split("\n## The tree\n", 1)[1].split("```", 2)[1]
    lines = block.strip("\n").splitlines()
    assert lines[0] == "ckpt_tools/", lines[0]
    drawn: set[str] = set()
    stack: list[str] = []
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 2 == 0 and indent >= 2, f"odd indentation in the tree: {line!r}"
        depth = indent // 2 - 1
        name = line.split()[0]
        del stack[depth:]
        assert len(stack) == depth, f"{line!r} is indented below no package"
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            drawn.add("/".join(stack) + "/")
        else:
            drawn.add("/".join([*stack, name]))
    return drawn


def _on_disk() -> set[str]:
    found: set[str] = set()
    for p in _modules():
        rel = p.relative_to(PACKAGE)
        if p.name != "__init__.py" or p.parent == PACKAGE:
            found.add(rel.as_posix())
        if p.parent != PACKAGE:
            found.add(rel.parent.as_posix() + "/")
    return found


def test_the_architecture_page_draws_the_tree() -> None:
    """docs/architecture.md names every module and package on disk, and nothing else."""
    drawn, disk = _drawn_tree(), _on_disk()
    assert not disk - drawn, f"on disk, missing from docs/architecture.md: {sorted(disk - drawn)}"
    assert not drawn - disk, f"named in docs/architecture.md, not on disk: {sorted(drawn - disk)}"


def test_the_readme_picture_shows_every_room() -> None:
    """README's short picture names each room once and links to the full page."""
    text = (PACKAGE.parent / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    assert "docs/architecture.md" in section.split("\n## ", 1)[0]
    picture = section.split("```", 2)[1].strip("\n").splitlines()
    assert picture[0] == "ckpt_tools/" and len(picture) <= 14, picture
    rooms = {line.split()[0].rstrip("/") for line in picture[1:] if line.startswith("  ")}
    on_disk = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms >= on_disk, f"rooms missing from README's picture: {sorted(on_disk - rooms)}"


def test_the_tree_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module dropped from the page, and a module the page invents, are both reported."""
    page = tmp_path / "architecture.md"
    text = ARCHITECTURE.read_text()
    page.write_text(text.replace("      records.py ", "      recordz.py ", 1))
    true_drawn, disk = _drawn_tree(), _on_disk()
    monkeypatch.setattr(sys.modules[__name__], "ARCHITECTURE", page)
    drawn = _drawn_tree()
    assert (disk - drawn) - (disk - true_drawn) == {"formats/zip/records.py"}
    assert (drawn - disk) - (true_drawn - disk) == {"formats/zip/recordz.py"}


def _upward(path: Path, room: str) -> list[str]:
    """The imports of ``path`` (a module of ``room``) that reach a room above it."""
    upward = []
    for line, name, _ in _imports(path):
        parts = name.split(".")
        if parts[0] != "ckpt_tools" or len(parts) < 2:
            continue
        target = parts[1]
        if target not in RANK:
            continue
        # harness/__main__.py is the harness's command-line entry point: it runs the CLI group.
        if path.name == "__main__.py" and room == "harness" and target == "cli":
            continue
        if RANK[target] > RANK[room]:
            upward.append(f"line {line}: {name} ({room} -> {target})")
    return upward


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path: Path) -> None:
    upward = _upward(path, _room(path))
    assert not upward, f"{path.relative_to(PACKAGE)} imports upward: {upward}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_torch_free_rooms(path: Path) -> None:
    room = _room(path)
    names = [(line, name, top) for line, name, top in _imports(path)]
    torch = [f"line {ln}: {n}" for ln, n, _ in names if n.split(".")[0] == "torch"]
    if room not in TORCH_ROOMS:
        assert not torch, f"{room}/ must not import torch: {torch}"
    dist = [f"line {ln}: {n}" for ln, n, _ in names if n.startswith("torch.distributed")]
    if room != "harness":
        assert not dist, f"only harness/ may import torch.distributed: {dist}"
    cli_libs = [f"line {ln}: {n}" for ln, n, _ in names if n.split(".")[0] in CLI_ONLY]
    if room != "cli":
        assert not cli_libs, f"only cli/ may import click or tabulate: {cli_libs}"


def test_package_root_imports_nothing_heavy() -> None:
    heavy = {"torch", "numpy", "click", "tabulate", "safetensors"}
    found = [n for _, n, top in _imports(PACKAGE / "__init__.py") if n.split(".")[0] in heavy]
    assert not found


def test_the_public_names_are_one_table() -> None:
    import ckpt_tools

    assert sorted(ckpt_tools.__all__) == sorted({"__version__", *ckpt_tools._PUBLIC})
    for name in ckpt_tools.__all__:  # each resolves to the object its module defines
        module = ckpt_tools._PUBLIC.get(name, "ckpt_tools._version")
        assert getattr(ckpt_tools, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = ckpt_tools.nope


def test_importing_the_package_loads_only_its_version() -> None:
    # `ckpt --version` and `import ckpt_tools` pay for nothing they do not use.
    loaded = modules_loaded_by("import ckpt_tools", ["ckpt_tools"])
    assert loaded == ["ckpt_tools", "ckpt_tools._version"]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by job"


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself can fail: an upward import in a synthetic module is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from ckpt_tools.errors import CheckpointError\n"
        "def f():\n    from ckpt_tools.ops.rewrite.rewriting import rewrite\n"
    )
    assert _upward(bad, "formats") == ["line 3: ckpt_tools.ops.rewrite.rewriting (formats -> ops)"]
    assert _upward(bad, "cli") == []


#: Longest function body (its docstring aside): a function longer than this is several steps.
MAX_BODY_LINES = 60


def _long_functions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if body and body[-1].end_lineno - body[0].lineno + 1 > MAX_BODY_LINES:
            found.append(f"{node.name} (line {node.lineno})")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_stay_short(path: Path) -> None:
    long = _long_functions(path)
    assert not long, f"{path.relative_to(PACKAGE)}: split into named steps: {long}"


#: What a tracker outside the repository would have to explain: issue and review references.
TRACKER = re.compile(r"\b(issue|review)s? #?\d+|\bfound in review\b|\bhelper-\d+\b", re.IGNORECASE)


def _tracker_references(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TRACKER.search(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


@pytest.mark.parametrize("room", ["ckpt_tools", "tests", "benchmarks", "fixtures"])
def test_code_does_not_cite_the_tracker(room: str) -> None:
    found = _tracker_references(PACKAGE.parent / room)
    assert not found, "\n".join(found)


def test_the_length_and_tracker_checks_can_fail(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    '''doc'''\n" + "    x = 1\n" * 61 + "# see {} 13\n".format("issue")
    )
    assert _long_functions(module) == ["f (line 1)"]
    assert len(_tracker_references(tmp_path)) == 1

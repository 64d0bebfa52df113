"""The committed fixtures (``fixtures/``), their manifest, and what their own libraries load.

The fixture writers live in ``fixtures/make_fixtures.py``, a script rather than a package:
:func:`tools` loads it once by path.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
import sys
import warnings
from collections.abc import Collection, Mapping, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
REAL_DIR = ROOT.parent / "shared" / "realckpt"
# Files in fixtures/ that are not fixtures, and folders that belong to other tests.
NOT_FIXTURES = frozenset(
    {"make_fixtures.py", "manifest.json", "README.md", "harness", "__pycache__"}
)


@cache
def tools() -> ModuleType:
    """``fixtures/make_fixtures.py`` as a module: its writers (tar, legacy, zip rewrites)."""
    path = FIXTURES / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up in sys.modules while the class is built.
    sys.modules.setdefault("make_fixtures", module)
    spec.loader.exec_module(module)
    return module


@cache
def manifest() -> tuple[dict[str, Any], ...]:
    """The fixture table ``make_fixtures.py`` wrote beside the files."""
    data = json.loads((FIXTURES / "manifest.json").read_text())
    return tuple(data["fixtures"])


def fixtures_where(**conditions: Any) -> list[dict[str, Any]]:
    """Manifest entries matching every ``field=value`` (a value may be a tuple of choices)."""

    def matches(entry: dict[str, Any]) -> bool:
        for key, wanted in conditions.items():
            choices = wanted if isinstance(wanted, tuple) else (wanted,)
            if entry[key] not in choices:
                return False
        return True

    return [e for e in manifest() if matches(e)]


def by_name(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``pytest.mark.parametrize("entry", **by_name(entries))``: one case per fixture, by name."""
    return {"argvalues": list(entries), "ids": [e["name"] for e in entries]}


def fixture_path(name: str) -> Path:
    """Where committed fixture ``name`` lives."""
    return FIXTURES / name


def fixture_files(exclude: Collection[str] = ()) -> list[Path]:
    """The committed fixture files (not the scripts, manifest, notes or folders), sorted, less
    the names in ``exclude``."""
    return sorted(
        p
        for p in FIXTURES.iterdir()
        if p.is_file() and p.suffix not in (".py", ".md", ".json") and p.name not in exclude
    )


def entry(name: str) -> dict[str, Any]:
    """The manifest entry of fixture ``name``."""
    return next(e for e in manifest() if e["name"] == name)


def copy_fixture(name: str, dst_dir: Path, as_name: str | None = None) -> Path:
    """Copy fixture ``name`` (a file or a folder) into ``dst_dir``, as ``as_name`` if given."""
    src = fixture_path(name)
    dst = dst_dir / (as_name or name)
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


def load_truth(entry: Mapping[str, Any]) -> Any:
    """The fixture's object tree as its own library loads it (see ``Fixture.oracle``)."""
    path = fixture_path(entry["name"])
    oracle = entry["oracle"]
    if oracle == "torch":
        return torch.load(path, weights_only=True)
    if oracle == "torch-unsafe":
        # Only for files make_fixtures.py wrote itself (torch refuses weights_only for tar).
        return torch.load(path, weights_only=False)
    if oracle == "jit":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated
            return torch.jit.load(path).state_dict()
    if oracle == "pickle":
        with open(path, "rb") as f:
            return pickle.load(f)
    if oracle == "safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    if oracle == "sharded":
        from safetensors.torch import load_file

        index = json.loads((path / "model.safetensors.index.json").read_text())
        shards = {s: load_file(path / s) for s in dict.fromkeys(index["weight_map"].values())}
        return {name: shards[shard][name] for name, shard in index["weight_map"].items()}
    raise ValueError(f"no oracle for {entry['name']}")

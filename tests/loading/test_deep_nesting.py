"""Containers nested far deeper than a state dict: read as torch.load reads them (any depth),
and refused cleanly only by a rewrite, which (like torch.save) cannot write them back."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools import load_state_dict, strip_module
from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.ops.rewrite.plan import MAX_REWRITE_NESTING


def _deep(depth: int, kind: str) -> Any:
    node: Any = torch.arange(3.0)
    for _ in range(depth):
        node = {"a": node} if kind == "dict" else [node]
    return node


def save_deep(path: Path, depth: int, kind: str) -> Path:
    """torch.save of ``{"module.w": ..., "deep": <depth levels>}``, past torch.save's own
    recursion limit: saved in a thread with a large stack and a raised limit."""
    obj = {"module.w": torch.ones(2), "deep": _deep(depth, kind)}
    failed: list[BaseException] = []

    def save() -> None:
        try:
            torch.save(obj, path)
        except BaseException as e:  # re-raised in the test's thread
            failed.append(e)

    limit, stack = sys.getrecursionlimit(), threading.stack_size(256 << 20)
    sys.setrecursionlimit(max(limit, 4 * depth + 1000))
    try:
        thread = threading.Thread(target=save)
        thread.start()
        thread.join()
    finally:
        sys.setrecursionlimit(limit)
        threading.stack_size(stack)
    if failed:
        raise failed[0]
    return path


def _bottom(node: Any, depth: int, kind: str) -> Any:
    for _ in range(depth):
        assert isinstance(node, dict if kind == "dict" else list)
        node = node["a"] if kind == "dict" else node[0]
    return node


@pytest.mark.parametrize("kind", ["dict", "list"])
@pytest.mark.parametrize("depth", [300, 1000, 5000])
def test_deep_containers_load_as_torch_loads_them(tmp_path: Path, depth: int, kind: str) -> None:
    path = save_deep(tmp_path / "deep.pt", depth, kind)
    want = torch.load(path, weights_only=True)
    got = load_state_dict(path, select=[])
    assert list(got) == list(want)
    assert torch.equal(_bottom(got["deep"], depth, kind), _bottom(want["deep"], depth, kind))
    info = ckpt_tools.inspect(path)
    assert [t.name for t in info] == ["module.w"] and "deep" in info.entries


def test_a_rewrite_writes_what_torch_save_writes(tmp_path: Path) -> None:
    depth = MAX_REWRITE_NESTING - 8  # the root, and the tensor (its call, arguments, hooks)
    src = save_deep(tmp_path / "deep.pt", depth, "dict")
    strip_module(src, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == ["w", "deep"]
    assert torch.equal(_bottom(out["deep"], depth, "dict"), torch.arange(3.0))


@pytest.mark.parametrize("depth", [MAX_REWRITE_NESTING, 1000])
def test_a_rewrite_refuses_a_tree_deeper_than_it_writes(tmp_path: Path, depth: int) -> None:
    src = save_deep(tmp_path / "deep.pt", depth, "dict")
    with pytest.raises(ResourceLimitError, match="levels deep"):
        strip_module(src, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()

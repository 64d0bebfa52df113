"""``ckpt sanitize`` on deep trees: every depth a rewrite allows is walked, every deeper one is
refused with one line and exit 5, never a RecursionError.

The inputs are written by torch.save from classes of a module written to ``tmp_path`` (gone
when the file is read, as a training script's classes are): OmegaConf-shaped value nodes
chained through their state, objects inside lists inside dicts, and OrderedDicts chained
through the attributes a BUILD sets. The oracle is ``torch.load(weights_only=True)``: it reads
the deep source (so the refusal is ours, a rewrite's limit) and the sanitized output.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.pickle.limits import MAX_REWRITE_NESTING
from tests.helpers.cli import run_ckpt
from tests.helpers.files import module_from_source

# A value node as OmegaConf pickles one: its __dict__ holds ``_metadata`` and ``_val``.
NODES = """
class Node:
    def __init__(self, value):
        self._metadata = None
        self._val = value
"""


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[ModuleType]:
    """The module of the node class, importable while the test saves, gone when it reads."""
    with module_from_source(tmp_path / "classes", "deep_nodes", NODES) as module:
        yield module


def _node_chain(nodes: ModuleType, links: int) -> Any:
    # Each node is two levels: the object, then its state dict.
    value: Any = 7
    for _ in range(links):
        value = nodes.Node(value)
    return value


def _list_dict_chain(nodes: ModuleType, links: int) -> Any:
    # Dicts holding lists (two levels a link) around a node: the walk's deepest stack a level.
    value: Any = [nodes.Node({"w": torch.ones(1)})]
    for _ in range(links):
        value = {"k": [value]}
    return value


def _attribute_chain(links: int) -> Any:
    # OrderedDicts chained through an attribute: pickled as their BUILD state.
    value: Any = collections.OrderedDict(w=torch.ones(1))
    for _ in range(links):
        outer = collections.OrderedDict()
        outer.inner = value
        value = outer
    return value


def _save(obj: Any, path: Path) -> Path:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))  # torch.save's pickler recurses too
    try:
        torch.save(obj, path)
    finally:
        sys.setrecursionlimit(limit)
    return path


def _unwrap(value: Any) -> Any:
    """The innermost value of a chain as torch.load gives it back."""
    while True:
        if isinstance(value, dict) and "k" in value:
            value = value["k"][0]
        elif isinstance(value, list):
            value = value[0]
        elif "inner" in getattr(value, "__dict__", {}):
            value = value.inner
        else:
            return value


@pytest.mark.parametrize("how", ["in-process", "script"])
def test_a_node_chain_as_deep_as_a_rewrite_allows_is_sanitized(
    nodes: ModuleType, tmp_path: Path, how: str
) -> None:
    src = _save(_node_chain(nodes, MAX_REWRITE_NESTING // 2), tmp_path / "nodes.pt")
    sys.modules.pop("deep_nodes")
    dst = tmp_path / "plain.pt"
    run_ckpt("sanitize", src, dst, code=0, how=how)
    assert torch.load(dst, weights_only=True) == 7


def test_objects_in_lists_in_dicts_are_walked_to_the_limit(
    nodes: ModuleType, tmp_path: Path
) -> None:
    links = MAX_REWRITE_NESTING // 2 - 4
    src = _save(_list_dict_chain(nodes, links), tmp_path / "mixed.pt")
    sys.modules.pop("deep_nodes")
    dst = tmp_path / "plain.pt"
    run_ckpt("sanitize", src, dst, code=0)
    assert torch.equal(_unwrap(torch.load(dst, weights_only=True))["w"], torch.ones(1))


@pytest.mark.parametrize("links", [MAX_REWRITE_NESTING - 5, 2 * MAX_REWRITE_NESTING])
def test_attributes_a_build_sets_count_as_nesting(tmp_path: Path, links: int) -> None:
    src = _save(_attribute_chain(links), tmp_path / "attributes.pt")
    assert torch.equal(_unwrap(torch.load(src, weights_only=True))["w"], torch.ones(1))
    dst = tmp_path / "plain.pt"
    if links < MAX_REWRITE_NESTING:
        run_ckpt("sanitize", src, dst, code=0)
        assert torch.equal(_unwrap(torch.load(dst, weights_only=True))["w"], torch.ones(1))
        return
    with pytest.raises(ResourceLimitError, match="levels deep"):
        ct.sanitize(src, dst)
    res = run_ckpt("sanitize", src, dst, code=5, how="script")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert not dst.exists()


def test_deeper_chains_of_each_shape_are_refused_on_one_line(
    nodes: ModuleType, tmp_path: Path
) -> None:
    deep = {
        "nodes": _node_chain(nodes, MAX_REWRITE_NESTING),
        "mixed": _list_dict_chain(nodes, MAX_REWRITE_NESTING),
    }
    for name, tree in deep.items():
        src = _save(tree, tmp_path / f"{name}.pt")
        res = run_ckpt("sanitize", src, tmp_path / f"{name}-out.pt", code=5)
        assert res.stderr.count("\n") == 1 and "levels deep" in res.stderr, res.stderr

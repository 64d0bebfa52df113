"""``ckpt_tools.inspect`` against what torch (or safetensors, or pickle) loads from each fixture.

The manifest (written by fixtures/make_fixtures.py) says what torch cannot: the format
name, which entry is the state dict, which wrappers the keys carry. Everything else, names,
dtypes, shapes, strides, offsets, devices, sharing, bytes, is asked of torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.structure.tensor_walk import iter_tensors
from tests.helpers import (
    FIXTURES,
    NOT_FIXTURES,
    at_path,
    by_name,
    describe,
    fixture_path,
    fixtures_where,
    load_truth,
    manifest,
    partition,
    pickle_protocol,
    tensor_from_span,
    tensors_of,
    value_bytes,
    walk_tensors,
)

READABLE = fixtures_where(oracle=("torch", "torch-unsafe", "jit", "safetensors", "sharded"))
TREES = fixtures_where(oracle=("torch", "torch-unsafe"))  # whole object trees from torch.load
UNORDERED = ("safetensors", "sharded")  # safetensors sorts its header; compare by name


def truth_state_dict(entry: dict[str, Any]) -> dict[str, Any]:
    """The selected state dict's tensors, as torch loads them."""
    truth = load_truth(entry)
    if entry["oracle"] in ("jit", "safetensors", "sharded"):
        return dict(truth)
    return tensors_of(at_path(truth, entry["select"]))


def test_manifest_lists_every_fixture() -> None:
    on_disk = {p.name for p in FIXTURES.iterdir() if p.name not in NOT_FIXTURES}
    assert on_disk == {e["name"] for e in manifest()}


@pytest.mark.parametrize("entry", **by_name(fixtures_where(error=None)))
def test_format_and_selection(entry: dict[str, Any]) -> None:
    info = ckpt_tools.inspect(fixture_path(entry["name"]))
    assert info.format == entry["format"]
    assert list(info.selected) == entry["select"]
    if entry["format"] == "torchscript":
        # TorchScript classes are compiled from the archive's code, never imported from Python.
        assert all(g.startswith(("__torch__.", "torch.jit.")) for g in info.unsafe_globals)
    else:
        assert list(info.unsafe_globals) == entry["unsafe"]


@pytest.mark.parametrize("entry", **by_name(READABLE))
def test_tensors_match_torch(entry: dict[str, Any]) -> None:
    expected = truth_state_dict(entry)
    info = ckpt_tools.inspect(fixture_path(entry["name"]))
    ours = [(t.name, describe(t)) for t in info.tensors]
    theirs = [(name, describe(t)) for name, t in expected.items()]
    if entry["oracle"] in UNORDERED:
        ours, theirs = sorted(ours), sorted(theirs)
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (name, got), (_, want) in zip(ours, theirs):
        assert got == want, name
    assert info.total_params == sum(t.numel() for t in expected.values())
    assert info.total_bytes == sum(t.numel() * t.element_size() for t in expected.values())


@pytest.mark.parametrize("entry", **by_name(READABLE))
def test_storage_sharing_matches_torch(entry: dict[str, Any]) -> None:
    expected = truth_state_dict(entry)
    info = ckpt_tools.inspect(fixture_path(entry["name"]))
    ours = partition([(t.name, t.storage) for t in info.tensors])
    theirs = partition([(n, t.untyped_storage().data_ptr()) for n, t in expected.items()])
    assert ours == theirs
    for t in info.tensors:
        group = next(g for g in ours if t.name in g)
        assert set(t.shared_with) == group - {t.name}
    distinct = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in expected.values()
    }
    assert info.storage_bytes == sum(distinct.values())


@pytest.mark.parametrize("entry", **by_name(READABLE))
def test_wrappers_match_keys(entry: dict[str, Any]) -> None:
    keys = list(truth_state_dict(entry))
    expected, current = [], keys
    for prefix, inner in entry["wrappers"]:
        if inner:
            count = sum(f".{prefix}" in k for k in current)
        else:
            count = sum(k.startswith(prefix) for k in current)
            current = [k.removeprefix(prefix) for k in current]
        expected.append((prefix, inner, count, len(keys)))
    info = ckpt_tools.inspect(fixture_path(entry["name"]))
    assert [(w.prefix, w.inner, w.count, w.of) for w in info.wrappers] == expected
    assert all(w.count > 0 for w in info.wrappers)


@pytest.mark.parametrize("entry", **by_name(fixtures_where(oracle=("torch", "torch-unsafe"))))
def test_entries_beside_the_state_dict(entry: dict[str, Any]) -> None:
    truth = load_truth(entry)
    expected, node, prefix = [], truth, ""
    for part in entry["select"]:
        expected += [f"{prefix}{k}" for k in node if str(k) != part]
        node, prefix = node[part], f"{prefix}{part}."
    expected += [f"{prefix}{k}" for k, v in node.items() if not isinstance(v, torch.Tensor)]
    info = ckpt_tools.inspect(fixture_path(entry["name"]))
    assert list(info.entries) == expected


@pytest.mark.parametrize("entry", **by_name(TREES))
def test_every_tensor_in_the_tree_matches_torch(entry: dict[str, Any]) -> None:
    """Not only the state dict: optimizer state, EMA copies, metrics saved as tensors."""
    theirs = list(walk_tensors(load_truth(entry)))
    ours = iter_tensors(open_checkpoint(fixture_path(entry["name"])).root)
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (name, ref), (_, tensor) in zip(ours, theirs):
        assert describe(ref) == describe(tensor), name
    assert partition([(n, id(r.storage)) for n, r in ours]) == partition(
        [(n, t.untyped_storage().data_ptr()) for n, t in theirs]
    )


@pytest.mark.parametrize("entry", **by_name(READABLE))
def test_byte_locations_hold_the_tensors(entry: dict[str, Any]) -> None:
    """Reading each storage's bytes where our reader says they are gives torch's values."""
    expected = truth_state_dict(entry)
    ckpt = open_checkpoint(fixture_path(entry["name"]))
    selected = ckpt_tools.select_state_dict(ckpt.root, select=entry["select"] or None).state_dict
    if entry["format"] == "torchscript":
        from ckpt_tools.ops.inspect.inspection import script_module_tensors

        selected = script_module_tensors(ckpt.root)
    assert set(selected) >= set(expected)
    for name, tensor in expected.items():
        rebuilt = tensor_from_span(ckpt, selected[name])
        assert rebuilt.dtype == tensor.dtype and rebuilt.shape == tensor.shape, name
        assert value_bytes(rebuilt).equal(value_bytes(tensor)), name


@pytest.mark.parametrize("entry", **by_name(TREES))
def test_byte_locations_of_every_tensor_in_the_tree(entry: dict[str, Any]) -> None:
    ckpt = open_checkpoint(fixture_path(entry["name"]))
    theirs = dict(walk_tensors(load_truth(entry)))
    for name, ref in iter_tensors(ckpt.root):
        assert value_bytes(tensor_from_span(ckpt, ref)).equal(value_bytes(theirs[name])), name


@pytest.mark.parametrize("entry", **by_name(fixtures_where(oracle=("safetensors", "sharded"))))
def test_safetensors_metadata(entry: dict[str, Any]) -> None:
    import json

    from safetensors import safe_open

    path = fixture_path(entry["name"])
    if path.is_dir():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        expected, shard_names = index["metadata"], set(index["weight_map"].values())
    else:
        with safe_open(path, "pt") as f:
            expected = f.metadata()
        shard_names = set()
    info = ckpt_tools.inspect(path)
    assert dict(info.metadata or {}) == expected
    assert set(info.shards) == shard_names


@pytest.mark.parametrize("entry", **by_name(fixtures_where(oracle="pickle")))
def test_plain_pickle_of_numbers(entry: dict[str, Any]) -> None:
    path = fixture_path(entry["name"])
    truth = load_truth(entry)
    info = ckpt_tools.inspect(path)
    assert info.tensors == () and info.total_params == 0
    assert list(info.entries) == [str(k) for k in truth]
    for key, value in truth.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert info.entries[key] == f"{type(value).__name__} {value!r}"
    ckpt = open_checkpoint(path)
    assert ckpt.protocol == pickle_protocol(path.read_bytes())
    assert ckpt.root == truth

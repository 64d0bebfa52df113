"""``sanitize`` carries what ``torch.load(weights_only=True)`` already reads, as it reads it.

Every input here is written by ``torch.save`` and loads with ``weights_only=True``: the
allowlisted Python types (``Counter``, ``OrderedDict`` with attributes, sets, complex numbers,
``torch.Size``, dtypes, devices), tensors of every kind, and roots that are no dict (a tensor,
a list of views, None). The oracle is ``torch.load(weights_only=True)`` of the input against
the same of the output, types and attributes included; nothing may be reported converted or
dropped.
"""

from __future__ import annotations

import collections
import io
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.formats.pickle.unpickler import load_pickle
from ckpt_tools.ops.sanitize.tree import sanitize_tree

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _assert_same(got: Any, want: Any, where: str = "<root>") -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.requires_grad) == (
            want.dtype,
            want.shape,
            want.requires_grad,
        )
        assert got.__dict__ == want.__dict__, where
        if want.layout == torch.strided and not want.is_meta and not want.is_quantized:
            assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
            assert torch.equal(got, want), where
        return
    if isinstance(want, dict):
        assert list(got) == list(want), where
        if type(want) is not dict:  # an OrderedDict's or Counter's attributes
            _assert_same(vars(got), vars(want), f"{where}.__dict__")
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{where}.{i}")
    else:
        assert got == want, where


def _roundtrip(obj: Any, tmp_path: Path, verify: str = "full", **save: Any) -> ct.SanitizeResult:
    """Sanitize ``obj`` as torch.save wrote it; the output must load as the input does."""
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(obj, src, **save)
    want = torch.load(src, weights_only=True)
    report = ct.sanitize(src, dst, verify=verify, force=True)
    _assert_same(torch.load(dst, weights_only=True), want)
    return report


def _ordered_dict_with_attributes() -> collections.OrderedDict[str, Any]:
    sd = collections.OrderedDict(w=torch.ones(2))
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    sd.step = 7  # type: ignore[attr-defined]
    return sd


def _tensor_with_attribute() -> torch.Tensor:
    t = torch.ones(2)
    t.tag = "ema"  # type: ignore[attr-defined]
    return t


_VIEWS = torch.arange(6.0).reshape(2, 3)

ALLOWLISTED = {
    "counter": lambda: collections.Counter({"a": 2, "b": 1}),
    "empty counter": collections.Counter,
    "nested counter": lambda: [{"c": collections.Counter(x=1)}],
    "ordered dict with attributes": _ordered_dict_with_attributes,
    "set": lambda: {1, "x", (2, 3)},
    "complex and big ints": lambda: [1 + 2j, 2**70, float("inf")],
    "bytearray": lambda: bytearray(b"\x00\xff"),
    "torch.Size": lambda: torch.Size([2, 3]),
    "dtypes": lambda: [torch.float16, torch.bfloat16, torch.bool],
    "devices": lambda: [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
    "layouts and qschemes": lambda: [torch.sparse_coo, torch.strided, torch.per_tensor_affine],
    "odd keys": lambda: {(1, "a"): 1, 3: "x", None: 1, 1.5: 2},
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "requires grad": lambda: torch.ones(2, requires_grad=True),
    "tensor attribute": _tensor_with_attribute,
    "views": lambda: [_VIEWS, _VIEWS[:, 1], _VIEWS.T],
    "sparse": lambda: torch.eye(3).to_sparse(),
    "meta": lambda: torch.empty(2, 3, device="meta"),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    "mesh layouts": lambda: _mesh_layouts(),
}


def _mesh_layouts() -> list[Any]:
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

    flat = _FlatLayout((2,), (1,))
    return [flat, _MeshLayout([flat, _FlatLayout((2, 2), (2, 1))]), flat]


@pytest.mark.parametrize("name", list(ALLOWLISTED))
def test_allowlisted_values_are_carried_as_torch_loads_them(name, tmp_path):
    report = _roundtrip({"w": torch.ones(1), "value": ALLOWLISTED[name]()}, tmp_path)
    assert report.converted == () and report.dropped_values == ()


ROOTS = {
    "tensor": lambda: torch.arange(3.0),
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "list of views": lambda: [_VIEWS, _VIEWS[1], torch.zeros(2)],
    "tuple": lambda: (torch.ones(1), 3),
    "empty list": list,
    "None": lambda: None,
    "int": lambda: 5,
    "set": lambda: {1, 2},
    "counter": lambda: collections.Counter(a=1),
    "ordered dict": lambda: collections.OrderedDict(w=torch.ones(1)),
    "torch.Size": lambda: torch.Size([1]),
    "dtype": lambda: torch.float32,
}


@pytest.mark.parametrize("verify", ["sizes", "full"])
@pytest.mark.parametrize("name", list(ROOTS))
def test_a_root_that_is_no_dict_is_written_and_verified(name, verify, tmp_path):
    report = _roundtrip(ROOTS[name](), tmp_path, verify=verify)
    assert report.converted == () and report.dropped_values == ()
    assert report.verification.startswith("verified")


def test_every_tensor_of_a_list_root_is_verified(tmp_path):
    report = _roundtrip(ROOTS["list of views"](), tmp_path, verify="sizes")
    assert report.verification == "verified: 3 tensors, sizes and sharing"
    report = _roundtrip(ROOTS["list of views"](), tmp_path, _use_new_zipfile_serialization=False)
    assert report.verification == "verified: 3 tensors, keys, sizes and bytes"


def test_cli_sanitizes_a_root_tensor(tmp_path):
    src, dst = tmp_path / "t.pt", tmp_path / "out.pt"
    torch.save(torch.arange(3.0), src)
    done = subprocess.run([CKPT, "sanitize", str(src), str(dst)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 converted, 0 dropped" in done.stdout
    assert torch.equal(torch.load(dst, weights_only=True), torch.arange(3.0))


@pytest.mark.parametrize("root", ["dict", "list"])
def test_numpy_arrays_of_a_legacy_file_are_verified_in_full(root, tmp_path):
    # A legacy file's storages are numbered anew in the zip output, the numpy arrays' too.
    src, dst = tmp_path / "legacy.pt", tmp_path / "out.pt"
    values = [np.arange(3.0), torch.ones(2)]
    tree = {"a": values[0], "w": values[1]} if root == "dict" else values
    torch.save(tree, src, _use_new_zipfile_serialization=False)
    report = ct.sanitize(src, dst, verify="full")
    assert len(report.converted) == 1
    got = torch.load(dst, weights_only=True)
    got = list(got.values()) if root == "dict" else got
    assert torch.equal(got[0], torch.arange(3.0, dtype=torch.float64))
    assert torch.equal(got[1], torch.ones(2))


class _CounterWithState:
    """Pickles as a Counter that a BUILD gives an attribute: torch.load sets it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (collections.Counter, ({"a": 2},), {"note": 1})


def test_a_counter_attribute_which_pickling_cannot_keep_is_listed(tmp_path):
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"c": _CounterWithState()}, src)
    assert torch.load(src, weights_only=True)["c"].note == 1
    report = ct.sanitize(src, dst)
    assert [str(c) for c in report.dropped_values] == ["c.note: attribute of a Counter -> dropped"]
    got = torch.load(dst, weights_only=True)["c"]
    assert type(got) is collections.Counter and got == {"a": 2}
    with pytest.raises(ct.UnsafeContentError):
        ct.sanitize(src, tmp_path / "strict.pt", refuse_unsafe=True)


def test_a_set_member_that_becomes_a_dict_is_listed(monkeypatch):
    # An OmegaConf-like config (hashable) in a set becomes a dict, which a set cannot hold.
    module = types.ModuleType("gone_config")
    exec(
        "class Config:\n    def __init__(self):\n        self._metadata = None\n"
        "        self._content = {'lr': 0.1}\n",
        module.__dict__,
    )
    monkeypatch.setitem(sys.modules, "gone_config", module)
    data = pickle.dumps({"s": {module.Config()}}, protocol=2)
    monkeypatch.delitem(sys.modules, "gone_config")
    done = sanitize_tree(load_pickle(io.BytesIO(data)).root, set())
    assert done.root == {"s": set()}
    assert [str(c) for c in done.dropped] == ["s: a set member that became a dict -> dropped"]


def test_a_mapping_of_another_type_is_reported_as_converted():
    done = sanitize_tree({"m": types.MappingProxyType({"a": 1})}, set())
    assert done.root == {"m": {"a": 1}} and type(done.root["m"]) is dict
    assert [str(c) for c in done.converted] == ["m: builtins.mappingproxy -> dict"]


def test_a_mesh_layout_holding_another_object_is_dropped_whole(tmp_path):
    import argparse

    from torch.distributed._mesh_layout import _FlatLayout

    layout = _FlatLayout((2,), (1,))
    object.__setattr__(layout, "extra", argparse.Namespace(lr=0.1))
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"w": torch.ones(1), "layout": layout}, src)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)
    report = ct.sanitize(src, dst)
    assert [(c.path, c.became) for c in report.dropped_values] == [("layout", "dropped")]
    assert "_FlatLayout" in report.dropped_values[0].was
    assert list(torch.load(dst, weights_only=True)) == ["w"]

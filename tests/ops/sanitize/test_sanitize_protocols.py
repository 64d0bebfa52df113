"""sanitize of what newer pickle protocols write: numpy arrays through protocol 5's
``_frombuffer``, and frozensets, which ``torch.load(weights_only=True)`` never builds.

The oracle is ``torch.load(weights_only=False)`` of the input; the output must load with
``weights_only=True`` and hold the same values.
"""

from __future__ import annotations

import argparse
import collections
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_tools as ct

ARRAYS = {
    "c": np.arange(6, dtype=np.float32).reshape(2, 3),
    "f": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    "big": np.arange(5, dtype=">f8"),
    "bools": np.array([True, False, True]),
    "empty": np.zeros((0, 3), dtype=np.complex64),
    "scalar": np.array(2.5, dtype=np.float16),
    "strided": np.arange(10, dtype=np.int64)[::2],  # not contiguous: _reconstruct
    # Dense, neither C nor F: protocol 5 writes _frombuffer(..., "K", axis_order).
    "permuted": np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(1, 0, 2),
    "permuted big": np.arange(24, dtype=">i4").reshape(2, 3, 4).transpose(2, 0, 1),
}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_of_every_protocol_become_tensors(tmp_path: Path, protocol: int) -> None:
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"w": torch.ones(2), **ARRAYS}, src, pickle_protocol=protocol)
    theirs = torch.load(src, weights_only=False)
    report = ct.sanitize(src, dst, verify="full")
    ours = torch.load(dst, weights_only=True)
    assert not report.dropped_values
    for name in ARRAYS:
        array = theirs[name]
        want = torch.from_numpy(array.astype(array.dtype.newbyteorder("="), order="C"))
        assert ours[name].dtype == want.dtype and torch.equal(ours[name], want), name
    assert {c.path for c in report.converted} == set(ARRAYS)
    # A dense array keeps its memory order, as torch.from_numpy keeps it.
    assert ours["permuted"].stride() == torch.from_numpy(theirs["permuted"]).stride()


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_frozenset_becomes_a_set_and_is_listed(tmp_path: Path, protocol: int) -> None:
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(
        {"w": torch.ones(2), "fs": frozenset({1, 2}), "s": {3}}, src, pickle_protocol=protocol
    )
    theirs = torch.load(src, weights_only=False)
    with pytest.raises(pickle.UnpicklingError):  # weights_only builds no frozenset
        torch.load(src, weights_only=True)
    report = ct.sanitize(src, dst)
    ours = torch.load(dst, weights_only=True)
    assert ours["fs"] == set(theirs["fs"]) and ours["s"] == theirs["s"]
    assert [(c.path, c.was, c.became) for c in report.converted] == [("fs", "frozenset", "set")]


def test_empty_bytes_are_written_as_torch_loads_them(tmp_path: Path) -> None:
    # torch.save writes b"" as a call of bytes, which its own weights_only load refuses.
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"w": torch.ones(2), "sep": b"", "magic": b"\x00\xff"}, src)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)
    report = ct.sanitize(src, dst, verify="full")
    ours = torch.load(dst, weights_only=True)
    assert ours["sep"] == b"" and ours["magic"] == b"\x00\xff"
    assert [(c.path, c.became) for c in report.converted] == [("sep", "bytes")]


@pytest.mark.parametrize("protocol", [1, 2, 4])
def test_a_namespace_of_any_protocol_becomes_a_dict_even_holding_itself(
    tmp_path: Path, protocol: int
) -> None:
    args = argparse.Namespace(lr=0.1, name="run")
    args.parent = args
    table: collections.defaultdict = collections.defaultdict(list, {"a": [1]})
    table["me"] = table
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"w": torch.ones(2), "args": args, "table": table}, src, pickle_protocol=protocol)
    report = ct.sanitize(src, dst)
    ours = torch.load(dst, weights_only=True)
    assert ours["args"]["lr"] == 0.1 and ours["args"]["name"] == "run"
    assert ours["args"]["parent"] is ours["args"]
    assert ours["table"]["a"] == [1] and ours["table"]["me"] is ours["table"]
    assert not report.dropped_values


def test_an_ordered_dicts_numpy_attribute_passes_full_verification(tmp_path: Path) -> None:
    sd = collections.OrderedDict(w=torch.ones(2))
    sd.extra = np.arange(3.0)  # type: ignore[attr-defined]
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"sd": sd}, src)
    ct.sanitize(src, dst, verify="full")
    ours = torch.load(dst, weights_only=True)["sd"]
    assert torch.equal(ours.extra, torch.arange(3.0, dtype=torch.float64))

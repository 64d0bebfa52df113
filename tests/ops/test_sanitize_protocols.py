"""sanitize of what newer pickle protocols write: numpy arrays through protocol 5's
``_frombuffer``, and frozensets, which ``torch.load(weights_only=True)`` never builds.

The oracle is ``torch.load(weights_only=False)`` of the input; the output must load with
``weights_only=True`` and hold the same values.
"""

from __future__ import annotations

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

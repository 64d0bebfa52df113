"""safetensors headers as the safetensors crate reads them: JSON whitespace before the object is
accepted, and tensors come back in data offset order, as ``safetensors.torch.load_file`` gives
them. ``load_file`` is the oracle.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import CheckpointError

DATA = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
ENTRIES = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
    "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
}


def _file(path: Path, header: str) -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + DATA)
    return path


@pytest.mark.parametrize("name", ["w.safetensors", "w.bin"])
@pytest.mark.parametrize("lead", [" ", "\n", "\r\n\t  "])
def test_json_whitespace_before_the_header_is_read(tmp_path: Path, name: str, lead: str) -> None:
    path = _file(tmp_path / name, lead + json.dumps(ENTRIES))
    want = load_file(path)
    got = ct.load_state_dict(path, map_location="cpu")
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [t.name for t in ct.inspect(path)] == list(want)
    # What the crate does not take as whitespace stays refused, as it refuses it.
    bad = _file(tmp_path / f"bad-{name}", "\x0c" + json.dumps(ENTRIES))
    with pytest.raises(Exception):  # noqa: B017 (the crate's own error)
        load_file(bad)
    with pytest.raises(CheckpointError):
        ct.load_state_dict(bad, map_location="cpu")


def test_tensors_come_in_data_offset_order(tmp_path: Path) -> None:
    entries = {
        "z": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]},
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
        "m": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "__metadata__": {"format": "pt"},
    }
    path = _file(tmp_path / "o.safetensors", json.dumps(entries))
    want = load_file(path)
    got = ct.load_state_dict(path, map_location="cpu")
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)

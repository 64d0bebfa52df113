"""A legacy file's first pickle (the magic number) read as torch reads it, FRAME included.

The unpickler needs a protocol-4 FRAME's bytes to be there, even where the pickle's STOP
comes first inside it (the next pickle then starts right after the STOP, inside the frame).
Fuzz input ``c1-0d7445b984`` had such a frame running past the bytes we checked, so we
called the file a plain pickle while torch read it as a legacy checkpoint. The oracle is
``torch.load`` of files built here (plain tensors, so ``weights_only=False`` is safe; the
weights-only unpickler has no FRAME).
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
import torch

from ckpt_tools import load_state_dict
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.detect import detect_format

MAGIC = 0x1950A86A20F9469CFC6C


def _legacy_with_framed_magic(tmp_path: Path, reach: int) -> tuple[Path, dict]:
    """A legacy file whose magic number sits in a FRAME reaching ``reach`` bytes past it."""
    sd = {"w": torch.arange(600.0).reshape(20, 30), "b": torch.ones(3)}
    plain = tmp_path / "plain.pt"
    torch.save(sd, plain, _use_new_zipfile_serialization=False)
    data = plain.read_bytes()
    first = pickle.dumps(MAGIC, protocol=2)
    assert data.startswith(first) and len(data) > len(first) + reach
    body = first[2:]  # LONG1 magic, STOP
    frame = b"\x95" + struct.pack("<Q", len(body) + reach)
    path = tmp_path / f"framed{reach}.pt"
    path.write_bytes(b"\x80\x04" + frame + body + data[len(first) :])
    return path, sd


@pytest.mark.parametrize("reach", [0, 40, 2000])
def test_a_framed_magic_number_is_a_legacy_checkpoint(tmp_path: Path, reach: int) -> None:
    path, sd = _legacy_with_framed_magic(tmp_path, reach)
    torch_view = torch.load(path, weights_only=False)
    assert all(torch.equal(torch_view[k], sd[k]) for k in sd)
    assert detect_format(path) == "torch-legacy"
    assert len(open_checkpoint(path).storages) == 2
    ours = load_state_dict(path)
    assert list(ours) == list(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)


def test_a_frame_past_the_end_of_the_file_is_not_a_legacy_checkpoint(tmp_path: Path) -> None:
    # torch cannot read the frame either ("pickle data was truncated").
    path, _ = _legacy_with_framed_magic(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[3:11] = struct.pack("<Q", len(data) + 100)
    path.write_bytes(bytes(data))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=False)
    assert detect_format(path) != "torch-legacy"

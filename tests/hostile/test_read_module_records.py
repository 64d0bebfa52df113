"""Module records in legacy files, read as torch's legacy readers read them, or refused.

A legacy file saves a whole module's class as a persistent id ``(class, source file,
source)``. torch's readers call ``_check_container_source(*record)`` when the last two are
set, which takes exactly three values and a class, and return the first. A fuzzed tar file
(``tests/fuzz/regressions/c1-9182ed4ec1.pt``) held ``("5",)`` there: torch fails
(``TypeError``), we read it. ``torch.load`` is the oracle: what it refuses we refuse.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tools import load_state_dict
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests import helpers as h

FUZZED = h.ROOT / "tests" / "fuzz" / "regressions" / "c1-9182ed4ec1.pt"
# In the fuzzed file's pickle: the string "5", TUPLE1, BINPUT 10, BINPERSID.
RECORD = b"X\x01\x00\x00\x005\x85q\nQ"


def _with_record(tmp_path: Path, record: bytes) -> Path:
    """The fuzzed tar file with its ``("5",)`` record replaced by ``record``'s opcodes."""
    out = tmp_path / "changed.pt"
    with tarfile.open(FUZZED) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name == "pickle":
                assert data.count(RECORD) == 1
                data = data.replace(RECORD, record + b"q\nQ")
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    return out


def _read_by_torch(path: Path) -> bool:
    try:
        torch.load(path, weights_only=False)  # legacy module records need the full unpickler
    except (TypeError, AttributeError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize(
    "record",
    [
        b"X\x01\x00\x00\x005\x85",  # ("5",): the fuzzed file
        b"X\x01\x00\x00\x005X\x01\x00\x00\x00x\x86",  # ("5", "x")
        b"X\x01\x00\x00\x005X\x01\x00\x00\x00xX\x01\x00\x00\x00y\x87",  # ("5", "x", "y")
    ],
    ids=["one value", "two values", "three values, no class"],
)
def test_module_records_torch_cannot_check_are_refused(tmp_path: Path, record: bytes) -> None:
    path = _with_record(tmp_path, record)
    assert not _read_by_torch(path)
    with pytest.raises(CorruptCheckpointError, match="unexpected module record"):
        open_checkpoint(path)


def test_the_fuzzed_file_is_refused_as_torch_refuses_it() -> None:
    assert not _read_by_torch(FUZZED)
    with pytest.raises(CorruptCheckpointError, match=r"unexpected module record \('5',\)"):
        load_state_dict(FUZZED)


def test_a_whole_module_saved_the_legacy_way_is_still_read(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    path = tmp_path / "whole.pt"
    torch.save(model, path, _use_new_zipfile_serialization=False)
    theirs = torch.load(path, weights_only=False).state_dict()
    ckpt = open_checkpoint(path)  # its (class, file, source) records are taken
    assert sum(s.numel for s in ckpt.storages.values()) == sum(t.numel() for t in theirs.values())
    assert any("Sequential" in name for name in ckpt.unsafe_globals)

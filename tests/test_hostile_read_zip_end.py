"""Which end record of a zip torch reads, and that we read that one too or refuse.

torch's reader (miniz) scans back from the end of the file for the last end-record signature
with a whole record (22 bytes) after it, whatever that record's comment length says. A
comment that holds another end record therefore hides the real one from torch (a fuzz input,
``tests/fuzz/regressions/c1-d0065a3e1d.pt``, had one saying "0 records": torch found no
files, we read the archive). Each case below changes the end of a ``torch.save`` file, and
``torch.load`` is the oracle: what it refuses we refuse, what it reads we read the same or
refuse.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tools import load_state_dict
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests import helpers as h

EOCD = struct.Struct("<4s4H2LH")


def _with_comment(data: bytes, comment: bytes) -> bytes:
    """``data`` with its end record's comment set to ``comment``."""
    at = data.rfind(b"PK\x05\x06")
    record = list(EOCD.unpack_from(data, at))
    record[-1] = len(comment)
    return data[:at] + EOCD.pack(*record) + comment


def _hidden_end(counts: tuple[int, int, int, int], comment: int) -> Callable[[bytes], bytes]:
    """A comment holding a whole end record: (records, records, size, offset), comment length."""

    def change(data: bytes) -> bytes:
        return _with_comment(data, EOCD.pack(b"PK\x05\x06", 0, 0, *counts, comment))

    return change


def _copied_end(data: bytes) -> bytes:
    """A comment holding a copy of the real end record (the same counts)."""
    at = data.rfind(b"PK\x05\x06")
    return _with_comment(data, data[at : at + EOCD.size])


CASES: dict[str, Callable[[bytes], bytes]] = {
    # The fuzz input's shape: its comment length does not run to the end of the file.
    "a hidden end record of no records, its comment length wrong": _hidden_end((0,) * 4, 512),
    "a hidden end record of no records": _hidden_end((0, 0, 0, 0), 0),
    "a hidden copy of the end record": _copied_end,
    "a signature in the comment with less than a record after it": lambda d: _with_comment(
        d, b"note PK\x05\x06 short"
    ),
    "a plain comment": lambda d: _with_comment(d, b"trained on 8 GPUs, epoch 12"),
    "bytes after the end record": lambda d: d + b"\0" * 5,
    "a comment length past the end of the file": lambda d: (
        _with_comment(d, b"")[:-2] + struct.pack("<H", 40)
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_end_record_torch_reads_is_the_one_we_read(tmp_path: Path, case: str) -> None:
    sd = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}
    good = tmp_path / "good.pt"
    torch.save(sd, good)
    path = tmp_path / "changed.pt"
    path.write_bytes(CASES[case](good.read_bytes()))
    try:
        theirs = torch.load(path, weights_only=True)
    except RuntimeError:
        theirs = None
    try:
        ours = load_state_dict(path)
    except CorruptCheckpointError:
        ours = None
    if theirs is None:
        assert ours is None, f"torch refuses {case!r}; we read it"
    elif ours is not None:
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    if case.startswith(("a signature in the comment", "a plain comment")):
        assert theirs is not None and ours is not None  # both read these


def test_the_fuzz_input_is_refused_in_one_line(tmp_path: Path) -> None:
    path = h.ROOT / "tests" / "fuzz" / "regressions" / "c1-d0065a3e1d.pt"
    with pytest.raises(RuntimeError, match="does not contain any files"):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="its comment holds another end record"):
        open_checkpoint(path)

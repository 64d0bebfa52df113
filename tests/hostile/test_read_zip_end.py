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


def _saved(tmp_path: Path) -> bytes:
    """The bytes of a small ``torch.save`` file, the one every case changes."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}, good)
    return good.read_bytes()


def _both_read(path: Path) -> tuple[dict | None, dict | None]:
    """``(torch's state dict, ours)``, each ``None`` where that reader refuses the file."""
    try:
        theirs = torch.load(path, weights_only=True)
    except (RuntimeError, OSError):  # miniz's refusals; a failed read past byte 0 is OSError
        theirs = None
    try:
        ours = load_state_dict(path)
    except CorruptCheckpointError:
        ours = None
    return theirs, ours


def _long_comment(length: int) -> Callable[[bytes], bytes]:
    return lambda data: _with_comment(data, b"x" * length)


BOTH_READ, BOTH_REFUSE, WE_REFUSE = "both read", "both refuse", "torch reads, we refuse"
# change -> what torch does and what we do. We may refuse what torch reads (never the
# reverse); each such case is named, so that a reader refusing everything fails here.
CASES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    # The fuzz input's shape: its comment length does not run to the end of the file.
    "a hidden end record of no records, its comment length wrong": (
        _hidden_end((0,) * 4, 512),
        BOTH_REFUSE,
    ),
    "a hidden end record of no records": (_hidden_end((0, 0, 0, 0), 0), BOTH_REFUSE),
    "a hidden copy of the end record": (_copied_end, WE_REFUSE),
    "a signature in the comment with less than a record after it": (
        lambda d: _with_comment(d, b"note PK\x05\x06 short"),
        BOTH_READ,
    ),
    "a signature 21 bytes before the end": (
        lambda d: _with_comment(d, b"PK\x05\x06" + b"\0" * 17),
        BOTH_READ,
    ),
    "a plain comment": (lambda d: _with_comment(d, b"trained on 8 GPUs, epoch 12"), BOTH_READ),
    "bytes after the end record": (lambda d: d + b"\0" * 5, WE_REFUSE),
    "a comment length past the end of the file": (
        lambda d: _with_comment(d, b"")[:-2] + struct.pack("<H", 40),
        WE_REFUSE,
    ),
    # miniz looks back in 4 KiB blocks and fails on the one that would start before byte 0:
    # in a small archive a long comment puts the end record there.
    "a 4,107-byte comment in a small archive": (_long_comment(4107), BOTH_REFUSE),
    "a 65,535-byte comment in a small archive": (_long_comment(65535), BOTH_REFUSE),
    "a 2,000-byte comment in a small archive": (_long_comment(2000), BOTH_READ),
    "a 2,600-byte comment, the archive just over 4 KiB": (_long_comment(2600), BOTH_READ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_end_record_torch_reads_is_the_one_we_read(tmp_path: Path, case: str) -> None:
    change, expected = CASES[case]
    path = tmp_path / "changed.pt"
    path.write_bytes(change(_saved(tmp_path)))
    theirs, ours = _both_read(path)
    assert (theirs is not None) == (expected != BOTH_REFUSE), f"torch no longer: {expected}"
    assert (ours is not None) == (expected == BOTH_READ), f"{case}: expected {expected}"
    if ours is not None:
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_the_fuzz_input_is_refused_in_one_line(tmp_path: Path) -> None:
    path = h.ROOT / "tests" / "fuzz" / "regressions" / "c1-d0065a3e1d.pt"
    with pytest.raises(RuntimeError, match="does not contain any files"):
        torch.load(path, weights_only=True)
    with pytest.raises(
        CorruptCheckpointError, match="declares a 512-byte comment where 0 bytes follow"
    ):
        open_checkpoint(path)


def test_plain_comments_of_every_length_are_read_where_torch_reads_them(tmp_path: Path) -> None:
    # Where a plain comment pushes the end record before the first block torch's reader
    # looks at depends on the file's size modulo 4093: a sweep of lengths, torch the oracle.
    data = _saved(tmp_path)
    verdicts = {True: 0, False: 0}
    for length in range(1500, 65536, 197):
        path = tmp_path / "commented.pt"
        path.write_bytes(_with_comment(data, b"c" * length))
        theirs, ours = (result is not None for result in _both_read(path))
        assert ours == theirs, f"a {length}-byte comment: torch reads it: {theirs}"
        verdicts[theirs] += 1
    assert verdicts[True] and verdicts[False]  # the sweep crosses both sides

"""BUILD on an OrderedDict with a state that is no dict: read as torch.load reads it.

torch's weights-only unpickler runs ``inst.__dict__.update(state)`` on an OrderedDict, so an
empty list, or a list of (name, value) pairs, sets its attributes; the same state on a plain
dict is refused by both of torch's unpicklers. ``torch.load`` is the oracle.
"""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct

# Pickle opcodes for the state, inserted before the final STOP with a BUILD after them.
STATES = {
    "an empty list": b"]",
    "a list of pairs": b"]X\x03\x00\x00\x00fooK\x05\x86a",
}


def _with_build(src: Path, dst: Path, state: bytes) -> Path:
    """``src`` (a torch zip) with ``BUILD state`` applied to its root."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                assert data.endswith(b".")
                data = data[:-1] + state + b"b."
            zout.writestr(info, data)
    return dst


@pytest.mark.parametrize("name", sorted(STATES))
def test_ordereddict_build_state_as_torch_reads_it(tmp_path: Path, name: str) -> None:
    src = tmp_path / "src.pt"
    torch.save(collections.OrderedDict(w=torch.arange(3.0), b=torch.ones(2)), src)
    path = _with_build(src, tmp_path / "built.pt", STATES[name])
    want = torch.load(path, weights_only=True)
    got = ct.load_state_dict(path, map_location="cpu")
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert vars(got) == vars(want)
    # The same state on a plain dict: both of torch's unpicklers refuse it, and so do we.
    torch.save(dict(want), src)
    plain = _with_build(src, tmp_path / "plain.pt", STATES[name])
    for weights_only in (True, False):
        with pytest.raises(Exception):  # noqa: B017 (torch's own errors vary)
            torch.load(plain, weights_only=weights_only)
    with pytest.raises(ct.CheckpointError, match="state is not a dictionary"):
        ct.load_state_dict(plain, map_location="cpu")

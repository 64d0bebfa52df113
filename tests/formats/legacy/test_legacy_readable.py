"""Legacy (non-zip) torch files: read where torch.load reads them, refused where it cannot.

torch's legacy reader unpickles ``sys_info`` and never looks at it (its writer stores storage
bytes little-endian on every machine), and reads the storage bytes only after the whole
pickle, so a nested tensor's rebuild sees uninitialised sizes. ``torch.load`` is the oracle.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import UnsupportedFormatError
from ckpt_tools.formats import open_checkpoint


def _with_sys_info(src: Path, dst: Path, sys_info: dict[str, object]) -> Path:
    """``src`` (a legacy torch file) with its third pickle, ``sys_info``, replaced."""
    data = src.read_bytes()
    f = io.BytesIO(data)
    for _ in range(2):  # the magic number and the protocol version
        pickle.load(f)
    start = f.tell()
    pickle.load(f)
    dst.write_bytes(data[:start] + pickle.dumps(sys_info, protocol=2) + data[f.tell() :])
    return dst


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float16])
def test_sys_info_saying_big_endian_is_read_as_torch_reads_it(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6).to(dtype)}, src, _use_new_zipfile_serialization=False)
    info = {"protocol_version": 1001, "little_endian": False, "type_sizes": {"int": 4}}
    path = _with_sys_info(src, tmp_path / "be.pt", info)
    want = torch.load(path, weights_only=True)
    got = ct.load_state_dict(path, map_location="cpu")
    assert got.keys() == want.keys()
    assert got["w"].dtype == want["w"].dtype and torch.equal(got["w"], want["w"])


def test_a_nested_tensor_in_a_legacy_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nested.pt"
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    torch.save({"n": nested, "w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    for call in (
        lambda: open_checkpoint(str(path)),
        lambda: ct.inspect(path),
        lambda: ct.load_state_dict(path, map_location="cpu"),
    ):
        with pytest.raises(UnsupportedFormatError, match=r"nested tensor.*legacy"):
            call()
    # The same tensor in a zip file, whose bytes torch reads first, is read.
    torch.save({"n": nested, "w": torch.ones(2)}, tmp_path / "zip.pt")
    got = ct.load_state_dict(tmp_path / "zip.pt", map_location="cpu")
    want = torch.load(tmp_path / "zip.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(got["n"].unbind(), want["n"].unbind()))

"""Every torch output loads right where torch computes its storage offsets.

An archive stating ``.format_version`` 1 lets ``torch.load`` compute each storage's offset
from the one before instead of reading its header (``calculate_storage_offsets`` with
``mmap=True``, ``map_location="meta"``'s ``_checkpoint_offset``, lazy readers built on it).
Records a rewrite writes anew, or pads for fast copies, lie elsewhere: such outputs state
``0``, and layout-preserving ones keep ``1``. Oracle: torch's own debug check
(``TORCH_SERIALIZATION_DEBUG=1``), which compares every computed offset with the real one.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools.errors import VerificationError
from ckpt_tools.io.verify.zipcheck import check_torch_zip
from tests.helpers.cli import run_ckpt


def _format_version(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/.format_version")))


def _loads_with_computed_offsets(path: Path) -> None:
    from torch.utils.serialization import config

    want = torch.load(path, weights_only=True)
    _debug_load(path)  # every offset checked by torch
    with config.patch({"load.calculate_storage_offsets": True}):
        got = torch.load(path, weights_only=True, mmap=True)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    from torch.utils.serialization import config

    torch.manual_seed(0)
    sd = {
        "a": torch.randn(4),
        "b": torch.randn(300_000),  # a record of a megabyte and more: padded for copies
        "c": torch.arange(6.0),
        "e": torch.empty(0),
        "d": torch.randn(3, 3),
    }
    torch.save(sd, tmp_path / "in.pt")
    torch.save({f"module.{k}": v for k, v in sd.items()}, tmp_path / "ddp.pt")
    save_file({k: v for k, v in sd.items() if k != "e"}, tmp_path / "in.safetensors")
    with config.patch({"save.storage_alignment": 4096}):  # its records move: written anew
        torch.save(sd, tmp_path / "aligned.pt")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "kept"),
    [
        (["strip-module", "ddp.pt", "out.pt"], True),
        (["rename", "in.pt", "out.pt", "--sub", "a=z"], True),
        (["retag", "in.pt", "out.pt", "--map", "cpu=cuda:0"], True),
        (["rename", "aligned.pt", "out.pt", "--sub", "a=z"], False),  # a copied version record
        (["convert", "in.safetensors", "out.pt"], False),
        (["slim", "in.pt", "out.pt", "--dtype", "bf16"], False),
        (["slim", "in.pt", "out.pt", "--drop", "a"], False),
        (["average", "in.pt", "ddp.pt", "out.pt"], False),
        (["sanitize", "in.pt", "out.pt"], None),
        (["extract", "in.pt", "out.pt", "--prefix", "b"], None),
    ],
    ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else str(v),
)
def test_each_torch_output_states_only_the_layout_it_has(
    sources: Path, args: list[str], kept: bool | None
) -> None:
    out = sources / "out.pt"
    run_ckpt(*(str(sources / a) if a.endswith((".pt", ".safetensors")) else a for a in args))
    if args[0] == "retag":  # back to the CPU, to load here
        out = sources / "cpu.pt"
        run_ckpt("retag", sources / "out.pt", out, "--map", "cuda:0=cpu")
    _loads_with_computed_offsets(out)
    if kept is not None:  # a layout-preserving rewrite keeps torch's fast path
        assert _format_version(out) == (b"1" if kept else b"0")


def _state_version_one(path: Path) -> None:
    """Make an archive state ``.format_version`` 1 in place, its CRC-32s kept in step."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/.format_version"))
    name_length, extra = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + name_length + extra] = ord("1")
    crc = struct.pack("<I", zlib.crc32(b"1"))
    raw[info.header_offset + 14 : info.header_offset + 18] = crc  # (written without descriptor)
    entry = raw.index(b"PK\x01\x02" + raw[info.header_offset + 4 : info.header_offset + 6])
    while not raw[entry + 46 :].startswith(info.filename.encode()):
        entry = raw.index(b"PK\x01\x02", entry + 1)
    raw[entry + 16 : entry + 20] = crc
    path.write_bytes(bytes(raw))


def test_verification_refuses_a_layout_stated_as_torchs_that_is_not(sources: Path) -> None:
    out = sources / "out.pt"
    run_ckpt("convert", sources / "in.safetensors", out)
    assert _format_version(out) == b"0"
    _state_version_one(out)
    with pytest.raises(RuntimeError, match="Incorrect offset"):  # torch's own check agrees
        _debug_load(out)
    with pytest.raises(VerificationError, match="compute where storage '1' lies"):
        check_torch_zip(str(out))
    check_torch_zip(str(sources / "in.pt"))  # torch.save's own layout holds


def _debug_load(path: Path) -> None:
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"
    try:
        torch.load(path, weights_only=True)
    finally:
        del os.environ["TORCH_SERIALIZATION_DEBUG"]


def test_an_archive_whose_root_folder_is_not_ascii_is_laid_out_anew(sources: Path) -> None:
    # torch names the root folder after the file; re-zipped with deflate, its records are
    # written anew, and the layout torch would compute is stated as not holding.
    src = sources / "modèle.pt"
    with zipfile.ZipFile(sources / "in.pt") as z, zipfile.ZipFile(src, "w") as out:
        for info in z.infolist():
            name = "modèle/" + info.filename.partition("/")[2]
            out.writestr(name, z.read(info), zipfile.ZIP_DEFLATED)
    want = torch.load(src, weights_only=True)
    for args in (["convert"], ["rename", "--sub", "a=z"], ["convert", "--verify", "none"]):
        out = sources / "out.pt"
        run_ckpt(args[0], src, out, *args[1:], "--force")
        assert _format_version(out) == b"0", args
        _loads_with_computed_offsets(out)
        got = torch.load(out, weights_only=True)
        pairs = zip(got.values(), want.values(), strict=True)  # (rename changes a key only)
        assert all(torch.equal(a, b) for a, b in pairs), args
        with zipfile.ZipFile(out) as z:  # every name read as UTF-8: one root folder
            assert {n.partition("/")[0] for n in z.namelist()} == {"modèle"}

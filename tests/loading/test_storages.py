"""Where loaded tensors' bytes come from: read by default, as ``torch.load`` reads them, mapped
only with ``mmap=True``; deflated zip records inflated as torch's zip reader inflates them."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tools import load_into, load_state_dict, load_with_info
from ckpt_tools.errors import CorruptCheckpointError
from tests.helpers.files import break_crc


def _same_size_rewrite(path: Path, value: float) -> None:
    # The next epoch's checkpoint, written in place: same path, same inode, same size.
    torch.save({"w": torch.full((4096,), value)}, path)


def test_loaded_tensors_do_not_change_when_the_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    _same_size_rewrite(path, 0.0)
    sd, info = load_with_info(path, map_location="cpu")
    assert not info.mmap
    _same_size_rewrite(path, 1.0)
    assert sd["w"].sum().item() == 0.0  # as torch.load's result: a copy of its own


def test_mmap_true_maps_the_file_as_torch_load_mmap_does(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    _same_size_rewrite(path, 0.0)
    sd, info = load_with_info(path, map_location="cpu", mmap=True)
    theirs = torch.load(path, weights_only=True, mmap=True)
    assert info.mmap
    _same_size_rewrite(path, 1.0)
    # Both are views of the file's pages: the documented reason the file must not change.
    assert sd["w"].sum().item() == theirs["w"].sum().item() == 4096.0


_RESAVE = """
import sys, torch
from torch import nn
import ckpt_tools as ct
path, how = sys.argv[1], sys.argv[2]
if how == "state_dict":
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(3)}, path)
    sd = ct.load_state_dict(path, map_location="cpu")
    sd["b"] = torch.zeros(3)
    torch.save(sd, path)  # truncates the file first, then reads every tensor
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["w"], torch.arange(1 << 20, dtype=torch.float32)), "changed"
else:
    torch.save(nn.Linear(512, 512).state_dict(), path)
    with torch.device("meta"):
        model = nn.Linear(512, 512)
    ct.load_into(model, path)  # assigned: the model's tensors are the loaded ones
    torch.save(model.state_dict(), path)
    assert torch.load(path, weights_only=True)["weight"].shape == (512, 512)
"""


@pytest.mark.parametrize("how", ["state_dict", "meta_model"])
def test_saving_back_to_the_loaded_path_keeps_the_weights(tmp_path: Path, how: str) -> None:
    # In a child: a mapped file truncated under its reader kills the process with SIGBUS.
    path = tmp_path / "model.pt"
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RESAVE), str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert path.stat().st_size > 512 * 512 * 4


def test_a_meta_model_assigned_with_mmap_true_holds_the_mapped_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(nn.Linear(8, 8).state_dict(), path)
    with torch.device("meta"):
        mapped, read = nn.Linear(8, 8), nn.Linear(8, 8)
    assert load_into(mapped, path, mmap=True).info.mmap
    assert not load_into(read, path).info.mmap
    # Copied into a model's own tensors, the file is only a staging area: mapped anyway.
    assert load_into(nn.Linear(8, 8), path).info.mmap


def _deflated(src: bytes, path: Path) -> Path:
    with (
        zipfile.ZipFile(io.BytesIO(src)) as zin,
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zout,
    ):
        for name in zin.namelist():
            zout.writestr(name, zin.read(name))
    return path


def test_a_rezipped_deflated_archive_loads_as_torch_loads_it(tmp_path: Path) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    buf = io.BytesIO()
    torch.save({"w": base, "view": base[1:, 2:], "i": torch.arange(5), "e": torch.ones(0)}, buf)
    path = _deflated(buf.getvalue(), tmp_path / "deflated.pt")
    want = torch.load(path, weights_only=True, map_location="cpu")
    got = load_state_dict(path, map_location="cpu")
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert got[name].stride() == tensor.stride(), name
    assert got["view"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


def test_a_deflated_record_that_fails_its_crc_is_corrupt(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(64.0)}, buf)
    path = _deflated(buf.getvalue(), tmp_path / "deflated.pt")
    break_crc(path)
    # torch inflates it without a check; the loader refuses what it cannot vouch for.
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        load_state_dict(path, map_location="cpu")

"""A file's name decides how torch reads it in one case: a path ending in ``.safetensors``.

torch 2.13's ``torch.load(path)`` hands such a path to ``safetensors`` (no fallback), which
refuses anything but a safetensors file; safetensors' own loaders do the same. So a torch
checkpoint named ``.safetensors`` loads nowhere by its name, and we refuse it too, with the
rename that fixes it (the fuzz input ``tests/fuzz/regressions/c1-b92e67444b`` is one).
torch is the oracle here: every case is loaded by it first. An older torch (2.11, say)
unpickles any path, so there the torch oracle reads such a file by its content, and our
refusal follows torch 2.13 and safetensors.
"""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from ckpt_tools.errors import UnsupportedFormatError
from ckpt_tools.formats import open_checkpoint

CKPT = str(Path(sys.executable).with_name("ckpt"))
_SD = {"module.w": torch.arange(6.0).reshape(2, 3), "module.b": torch.ones(3)}


def _torch_zip(path: Path) -> None:
    torch.save(_SD, path)


def _legacy(path: Path) -> None:
    torch.save(_SD, path, _use_new_zipfile_serialization=False)


@pytest.fixture(scope="module")
def by_name(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether this torch's ``torch.load`` hands a ``.safetensors`` path to safetensors."""
    probe = tmp_path_factory.mktemp("probe") / "probe.safetensors"
    save_file({"x": torch.zeros(1)}, probe)
    try:
        torch.load(probe, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # it unpickled the file, as torch before 2.13 does
        return False
    return True


@pytest.mark.parametrize("write", [_torch_zip, _legacy])
def test_a_torch_file_named_safetensors_is_refused_as_torch_refuses_it(
    write, by_name: bool, tmp_path
) -> None:
    named = tmp_path / "model.safetensors"
    write(named)
    if by_name:
        with pytest.raises(SafetensorError):  # the oracle refuses it
            torch.load(named, weights_only=False, map_location="cpu")
    else:
        assert isinstance(torch.load(named, weights_only=False, map_location="cpu"), dict)
    with pytest.raises(UnsupportedFormatError, match=r"named \.safetensors but holds"):
        open_checkpoint(named)
    result = subprocess.run(
        [CKPT, "inspect", str(named)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 4
    assert "rename it" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    # The same bytes under a torch name: torch reads them, and so do we.
    renamed = named.rename(tmp_path / "model.pt")
    loaded = torch.load(renamed, weights_only=False, map_location="cpu")
    assert open_checkpoint(renamed).format != "safetensors"
    assert isinstance(loaded, dict)


def test_a_safetensors_file_reads_under_either_name(by_name: bool, tmp_path) -> None:
    # The name matters to torch only for ".safetensors"; safetensors itself reads by content.
    named = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in _SD.items()}, named)
    if by_name:
        assert set(torch.load(named, map_location="cpu")) == set(_SD)  # torch's safetensors path
    assert open_checkpoint(named).format == "safetensors"
    other = named.rename(tmp_path / "model.bin")
    assert open_checkpoint(other).format == "safetensors"


def test_a_file_object_is_read_by_content(tmp_path) -> None:
    # torch decides by name only for paths: a torch zip named .safetensors, opened and
    # handed over as a file, loads. Our readers take paths, so the name always counts.
    named = tmp_path / "model.safetensors"
    _torch_zip(named)
    with open(named, "rb") as f:
        assert set(torch.load(io.BytesIO(f.read()), map_location="cpu")) == set(_SD)

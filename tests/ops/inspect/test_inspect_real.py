"""Real checkpoints from public repositories (``../shared/realckpt``; skipped when absent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools import LfsPointerError
from ckpt_tools.cli.main import main
from ckpt_tools.errors import EXIT_CORRUPT
from tests.helpers import describe, tensors_of

pytestmark = pytest.mark.real

RETINAFACE = "biubug6_retinaface_model_best.pth.tar"
PEFT = "peft_gpt2_lora"
LFS = "lfs_pointer_adapter_model.safetensors"


def saved_locations(path: Path) -> set[str]:
    """The device tags torch reads from a file, asked through ``map_location``."""
    seen: set[str] = set()

    def record(storage: Any, location: str) -> Any:
        seen.add(location)
        return storage

    torch.load(path, map_location=record, weights_only=True)
    return seen


def test_retinaface_legacy_dataparallel(real_dir: Path) -> None:
    path = real_dir / RETINAFACE
    truth = torch.load(path, map_location="cpu", weights_only=True)
    expected = tensors_of(truth["state_dict"])
    info = ckpt_tools.inspect(path)

    assert info.format == "torch-legacy"
    assert info.selected == ("state_dict",)
    assert [t.name for t in info.tensors] == list(expected)
    for t in info.tensors:
        want = describe(expected[t.name])
        assert (t.dtype, t.shape, t.stride) == (want["dtype"], want["shape"], want["stride"])
    assert set(info.devices) == saved_locations(path)
    assert info.entries["epoch"] == f"int {truth['epoch']}"
    module = next(w for w in info.wrappers if w.prefix == "module.")
    assert (module.count, module.of) == (len(expected), len(expected))
    assert all(k.startswith("module.") for k in expected)


def test_peft_lora_folder(real_dir: Path) -> None:
    from safetensors.torch import load_file

    folder = real_dir / PEFT
    expected = load_file(folder / "adapter_model.safetensors")
    info = ckpt_tools.inspect(folder)
    assert info.format == "safetensors"
    assert sorted(t.name for t in info.tensors) == sorted(expected)
    for t in info.tensors:
        want = describe(expected[t.name])
        assert (t.dtype, t.shape, t.nbytes) == (want["dtype"], want["shape"], want["nbytes"])
    # Every key starts with PEFT's base_model.model., the names PEFT loads the adapter by: no
    # wrapper to strip (ckpt merge-lora merges it into its base).
    assert all(name.startswith("base_model.model.") for name in expected)
    assert info.wrappers == () and info.format_info.peft_type == "LORA"


def test_lfs_pointer(real_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = real_dir / LFS
    with pytest.raises(LfsPointerError, match="git lfs pull"):
        ckpt_tools.inspect(path)
    assert main(["inspect", str(path)]) == EXIT_CORRUPT
    assert "git-lfs pointer" in capsys.readouterr().err

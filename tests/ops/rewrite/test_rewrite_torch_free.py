"""Key rewrites and conversions never import torch: each command runs with a ``torch`` that
refuses to import, and its output is then checked with the real torch against the input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import fixture_path, run_ckpt, torch_free_env, value_bytes, walk_tensors

REWRITES = {
    "strip-module": ("dataparallel.pt", "out.pt", []),
    "add-module": ("plain.pt", "out.pt", []),
    "rename": ("plain.pt", "out.pt", ["--sub", "layers.=blocks."]),
    "convert": ("plain.pt", "out.safetensors", []),
    "convert-back": ("model.safetensors", "out.pt", []),
    "retag": ("plain.pt", "out.pt", ["--map", "cpu=cuda:1"]),
    "legacy": ("legacy.pt", "out.pt", []),
    "tar": ("tar_format.pt", "out.pt", []),
}


def _load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the file, by path, as torch reads it (the tar fixture is ours: trusted)."""
    if path.suffix == ".safetensors":
        return load_file(str(path))
    trusted = path.name == "tar_format.pt"
    return dict(walk_tensors(torch.load(path, map_location="cpu", weights_only=not trusted)))


@pytest.mark.parametrize("case", sorted(REWRITES))
def test_the_rewrite_runs_without_torch(case: str, tmp_path: Path) -> None:
    source, out_name, extra = REWRITES[case]
    command = {"convert-back": "convert", "legacy": "convert", "tar": "convert"}.get(case, case)
    out = tmp_path / out_name
    env = torch_free_env(tmp_path, "a rewrite must not import torch")
    run = run_ckpt(command, fixture_path(source), out, *extra, how="module", env=env, code=None)
    assert run.returncode == 0, run.stderr
    assert "must not import torch" not in run.stderr
    before, after = _load(fixture_path(source)), _load(out)
    assert len(after) == len(before)
    for (old_name, old), (new_name, new) in zip(before.items(), after.items(), strict=True):
        assert new.dtype == old.dtype and new.shape == old.shape, (old_name, new_name)
        assert torch.equal(value_bytes(new), value_bytes(old)), (old_name, new_name)


@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["strip-module", "--help"]])
def test_the_command_line_starts_without_torch(argv: list[str], tmp_path: Path) -> None:
    env = torch_free_env(tmp_path, "ckpt's start must not import torch")
    run = run_ckpt(*argv, how="module", env=env, code=None)
    assert run.returncode == 0, run.stderr
    assert "Usage:" in run.stdout

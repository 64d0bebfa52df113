"""A dry run says it is one, also where there is nothing to do; option errors give examples
of the option they name."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckpt_tools as ct
from tests.helpers import run_ckpt


def _plain(tmp_path: Path) -> Path:
    src = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, src)
    return src


def test_strip_module_dry_run_with_nothing_to_strip_is_a_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    run = run_ckpt("strip-module", _plain(tmp_path), out, "--dry-run", "--json")
    result = json.loads(run.stdout)
    assert result["dry_run"] is True and result["written"] == []
    assert result["planned_files"] == [] and result["planned_bytes"] == 0
    assert result["planned_removals"] == []
    assert not out.exists()


def test_strip_module_dry_run_says_nothing_would_be_written(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    result = ct.strip_module(_plain(tmp_path), out, dry_run=True)
    assert result.dry_run and not result.planned and not result.written
    assert "would not be written" in str(result)
    assert not ct.strip_module(_plain(tmp_path), out).dry_run and not out.exists()


def test_retag_map_error_gives_a_device_mapping_example(tmp_path: Path) -> None:
    run = run_ckpt("retag", _plain(tmp_path), tmp_path / "o.pt", "--map", "foo", code=2)
    example = run.stderr.rstrip("\n").rsplit("e.g. --map ", 1)[1]
    old, new = example.split("=")
    torch.device(old), torch.device(new)  # device tags, as --map takes them
    run = run_ckpt("rename", _plain(tmp_path), tmp_path / "o.pt", "--sub", "foo", code=2)
    assert "e.g. --sub backbone.=encoder." in run.stderr

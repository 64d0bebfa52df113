"""A dry run into an existing folder lists the weight files the real run removes.

``force`` replaces an output folder's weight files and keeps the rest: a shard plan that no
longer writes ``model.safetensors`` removes it. Every command with a folder output (convert
to a folder, reshard, consolidate to a folder, merge-lora) is checked against its real run.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckpt_tools.cli.main import cli, main
from tests.helpers.lora import write_tiny_adapter

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
OLD = ("model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _sources(tmp_path: Path) -> dict[str, list[str]]:
    """Each command's arguments before its output folder (an input made here)."""
    import torch.distributed.checkpoint as dcp

    torch.save({f"k{i}": torch.randn(300) for i in range(4)}, tmp_path / "m.pt")
    assert (
        main(
            [
                "convert",
                str(tmp_path / "m.pt"),
                str(tmp_path / "hf/"),
                "--max-shard-size",
                "2KB",
                "-q",
            ]
        )
        == 0
    )
    with warnings.catch_warnings():  # (saving without a process group warns)
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": torch.randn(300), "b": torch.randn(300)}},
            checkpoint_id=str(tmp_path / "dcp"),
        )
    adapter = write_tiny_adapter(tmp_path / "adapter")
    return {
        "convert": ["convert", str(tmp_path / "m.pt")],
        "reshard": ["reshard", str(tmp_path / "hf")],
        "consolidate": ["consolidate", str(tmp_path / "dcp")],
        "merge-lora": ["merge-lora", str(FIXTURES / "plain.pt"), str(adapter)],
    }


def _filled(folder: Path) -> None:
    """An output folder that already holds weight files the new output does not write."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"old": torch.ones(1)}, str(folder / "model.safetensors"))
    torch.save({"old": torch.ones(1)}, folder / "pytorch_model.bin")
    (folder / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')


@pytest.mark.parametrize("command", ["convert", "reshard", "consolidate", "merge-lora"])
def test_the_dry_run_lists_what_the_real_run_removes(tmp_path: Path, command: str) -> None:
    args = _sources(tmp_path)[command]
    dst = tmp_path / "dst"
    _filled(dst)
    run = [*args, f"{dst}/", "--max-shard-size", "2KB", "--force"]
    dry = CliRunner().invoke(cli, [*run, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)["planned_removals"]
    text = CliRunner().invoke(cli, [*run, "--dry-run"]).output
    assert all(f"{path}  removed" in text for path in planned), text
    before = {p.name for p in dst.iterdir()}
    assert main([*run, "-q"]) == 0
    removed = before - {p.name for p in dst.iterdir()}
    assert sorted(Path(p).name for p in planned) == sorted(removed) == sorted(OLD)
    assert (dst / "config.json").exists()


def test_a_new_folder_has_nothing_to_remove(tmp_path: Path) -> None:
    torch.save({"k": torch.randn(3)}, tmp_path / "m.pt")
    dry = CliRunner().invoke(
        cli, ["convert", str(tmp_path / "m.pt"), f"{tmp_path}/new/", "--dry-run", "--json"]
    )
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["planned_removals"] == []

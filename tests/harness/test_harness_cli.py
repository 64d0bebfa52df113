"""``ckpt harness train|parity`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli.commands.harness import harness
from ckpt_tools.errors import UsageError


def test_train_manual_writes_the_three_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "manual"
    args = ["train", "--strategy", "manual", "--steps", "2", "--world-size", "2"]
    result = CliRunner().invoke(harness, [*args, "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "manual on cpu,cpu" in result.output and "step" in result.output
    assert {p.name for p in out.iterdir()} >= {"wrapped.pt", "bare.pt", "trainer.pt"}
    assert all(k.startswith("module.") for k in torch.load(out / "wrapped.pt", weights_only=True))


def test_train_json_output(tmp_path: Path) -> None:
    args = ["train", "--strategy", "dp", "--steps", "1", "--device", "cpu", "--json"]
    result = CliRunner().invoke(harness, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["strategy"] == "dp" and "plain forward" in data["fallback"]


def test_train_rejects_unknown_strategy_and_bad_sizes(tmp_path: Path) -> None:
    bad = CliRunner().invoke(harness, ["train", "--strategy", "zero3", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "zero3" in bad.output
    args = ["train", "--strategy", "manual", "--world-size", "4", "--batch-size", "2"]
    result = CliRunner().invoke(harness, [*args, "--device", "cpu", "--out", str(tmp_path)])
    # UsageError reaches ckpt's error boundary (exit 2 there) unchanged
    assert isinstance(result.exception, UsageError)
    # The library's words name the argument; the command line's name the flag.
    assert "batch_size=2" in str(result.exception)
    assert "--batch-size 2" in result.exception.render(for_cli=True)


@pytest.mark.slow
def test_parity_resnet_table_checkpoints_plot_and_batchnorm_gap(tmp_path: Path) -> None:
    out, plot = tmp_path / "demo", tmp_path / "demo" / "parity.png"
    args = [
        "parity",
        "--arch",
        "resnet",
        "--world-size",
        "2",
        "--steps",
        "2",
        "--batch-size",
        "16",
        "--strategies",
        "single,dp,ddp,manual,fsdp",
    ]
    result = CliRunner().invoke(
        harness, [*args, "--device", "cpu", "--out", str(out), "--plot", str(plot)]
    )
    lines = result.output.splitlines()
    assert lines[0].split()[:2] == ["strategy", "devices"] and "(e) format" in lines[0]
    table = {line.split()[0]: line for line in lines[2:6]}
    assert list(table) == ["single", "dp", "ddp", "manual"]
    for strategy in table:
        for name in ("wrapped.pt", "bare.pt", "trainer.pt"):
            assert (out / strategy / name).is_file()
    # BatchNorm per rank/replica (SyncBatchNorm has no CPU kernel): a reported gap, not a failure
    assert "(not comparable)" in table["ddp"] and "(not comparable)" in table["manual"]
    assert "0 ok" in table["dp"]  # dp on the CPU is one plain forward: single's exact maths
    assert "BatchNorm statistics per replica" in result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.exit_code == 0 and "parity holds" in result.output, result.output


def test_parity_json_in_process_strategies(tmp_path: Path) -> None:
    args = ["parity", "--steps", "2", "--device", "cpu", "--json", "--strategies", "manual"]
    result = CliRunner().invoke(harness, [*args, "--out", str(tmp_path)])
    data = json.loads(result.output)
    assert result.exit_code == (0 if data["all_passed"] else 1), result.output
    assert [run["strategy"] for run in data["runs"]] == ["single", "manual"]
    assert data["world_size"] == 2 and data["steps"] == 2
    rows = {(r["strategy"], r["name"]): r for r in data["rows"]}
    assert rows[("manual", "vs_single")]["status"] == "pass"
    assert rows[("manual", "vs_single")]["max_abs_diff"] <= 1e-5
    gaps = data["weight_gaps"]["manual"]  # per step, ending at (c)'s difference
    assert len(gaps) == 2 and gaps[-1] == rows[("manual", "vs_single")]["max_abs_diff"]
    assert data["all_passed"] and result.exit_code == 0


def test_parity_unknown_strategy_is_a_usage_error() -> None:
    result = CliRunner().invoke(harness, ["parity", "--strategies", "single,zero3"])
    assert isinstance(result.exception, UsageError)
    assert str(result.exception).startswith(
        "strategies=('single', 'zero3'): unknown strategies zero3"
    )


def test_arch_chooses_the_model_and_model_is_a_deprecated_alias(tmp_path: Path) -> None:
    base = ["train", "--strategy", "single", "--steps", "1", "--device", "cpu", "--json"]
    runner = CliRunner()
    new = runner.invoke(harness, [*base, "--arch", "lenet", "--out", str(tmp_path / "a")])
    assert new.exit_code == 0 and new.stderr == "", new.output
    assert json.loads(new.stdout)["model"] == "lenet"
    old = runner.invoke(harness, [*base, "--model", "lenet", "--out", str(tmp_path / "b")])
    assert old.exit_code == 0, old.output
    assert json.loads(old.stdout)["model"] == "lenet"
    assert old.stderr == "warning: --model is deprecated in `ckpt harness`; use --arch\n"
    bad = runner.invoke(harness, [*base, "--arch", "mlp", "--model", "lenet"])
    assert bad.exit_code == 2 and "--arch mlp and --model lenet disagree" in bad.stderr
    help_text = runner.invoke(harness, ["train", "--help"]).stdout
    assert "--arch [mlp|lenet|resnet|resnet-syncbn]" in help_text and "--model" not in help_text


def test_ckpt_main_dispatches_harness_and_maps_errors_to_exit_codes(tmp_path: Path) -> None:
    from ckpt_tools.cli.main import main

    args = ["harness", "train", "--strategy", "single", "--steps", "1", "--device", "cpu"]
    assert main([*args, "--out", str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "bare.pt").is_file()
    bad = ["harness", "train", "--strategy", "manual", "--world-size", "4", "--batch-size", "2"]
    assert main([*bad, "--device", "cpu", "--out", str(tmp_path / "bad")]) == 2

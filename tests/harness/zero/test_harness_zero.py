"""The ``zero`` strategy (DeepSpeed ZeRO on CPU ranks over gloo): its parity row, torchrun,
and what happens without DeepSpeed.

The parity run is the shared one (``parity_mlp``, ZeRO-3); the torchrun run trains ZeRO-1.
The oracles are single-device training and DeepSpeed's own ``zero_to_fp32``, read with
``torch.load``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli.commands.harness import harness
from ckpt_tools.errors import MissingExtraError, UsageError
from ckpt_tools.harness import ParityReport, TrainConfig, run_parity, train
from ckpt_tools.harness.config import TrainResult
from ckpt_tools.harness.parity.dcp_check import check_zero_roundtrip
from ckpt_tools.harness.zero import strategy as zero_module

NEEDS_DEEPSPEED = pytest.mark.skipif(
    zero_module.zero_missing() is not None, reason="DeepSpeed is not installed"
)
NO_DEEPSPEED = "the zero strategy needs deepspeed: pip install 'ckpt_tools[deepspeed]'"


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@NEEDS_DEEPSPEED
@pytest.mark.slow
def test_zero3_parity_row_consolidates_to_single_and_to_zero_to_fp32(
    parity_mlp: ParityReport, parity_dir: Path
) -> None:
    run = next(r for r in parity_mlp.runs if r.strategy == "zero")
    assert (run.world_size, run.launcher, run.backend) == (2, "spawn", "gloo")
    assert run.fallback == "no GPU: 2 CPU processes over gloo, ZeRO-3"
    out = parity_dir / "zero"
    assert (out / "deepspeed" / "latest").read_text() == "global_step3"
    assert sorted(run.checkpoints) == ["bare", "deepspeed", "wrapped", "zero_to_fp32"]
    # ckpt consolidate's output (bare.pt) is DeepSpeed's own consolidation, bit for bit,
    # and the wrapped file is the same tensors under module.
    bare, reference = tensors(out / "bare.pt"), tensors(out / "zero_to_fp32.pt")
    assert_bitwise_equal(bare, reference)
    assert_bitwise_equal(tensors(out / "wrapped.pt"), {f"module.{k}": v for k, v in bare.items()})
    # Single-device training, within the tolerance every strategy meets.
    single = tensors(parity_dir / "single" / "bare.pt")
    assert list(bare) == list(single)
    for key, value in single.items():
        torch.testing.assert_close(bare[key], value, rtol=0, atol=1e-5)
    vs_single = parity_mlp.row("zero", "vs_single")
    assert vs_single.status == "pass" and 0 < vs_single.max_abs_diff <= 1e-5
    row = parity_mlp.row("zero", "zero_roundtrip")
    assert (row.status, row.max_abs_diff, row.tolerance) == ("pass", 0.0, 0.0), row.detail
    assert row.detail.endswith("bitwise equal to zero_to_fp32")
    gaps = parity_mlp.weight_gaps["zero"]
    assert len(gaps) == 3 and gaps[-1] == vs_single.max_abs_diff
    torch.testing.assert_close(run.losses, parity_mlp.losses["single"], rtol=0, atol=1e-5)


@NEEDS_DEEPSPEED
@pytest.mark.slow
@pytest.mark.usefixtures("parity_mlp")  # its zero run's files in parity_dir
def test_zero_roundtrip_fails_when_the_reference_differs(parity_dir: Path, tmp_path: Path) -> None:
    reference = tensors(parity_dir / "zero" / "zero_to_fp32.pt")
    first = next(iter(reference))
    reference[first] = reference[first].clone()
    reference[first].view(-1)[0] += 1e-3
    torch.save(reference, tmp_path / "off.pt")
    row = check_zero_roundtrip(
        parity_dir / "zero" / "deepspeed", tmp_path / "off.pt", work_dir=tmp_path
    )
    assert (row.passed, row.status) == (False, "fail")
    assert row.max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    assert f"{first}: bytes differ" in row.detail
    missing = check_zero_roundtrip(tmp_path / "none", tmp_path / "off.pt", work_dir=tmp_path)
    assert (missing.passed, missing.error) == (False, "CheckpointNotFoundError")


@NEEDS_DEEPSPEED
@pytest.mark.slow
def test_zero_matches_one_device_where_gradients_are_large(tmp_path: Path) -> None:
    # Batches of 4: gradient norms past 1.0, which DeepSpeed clips to unless told not to.
    report = run_parity(strategies=("zero",), batch_size=4, steps=2, out_dir=tmp_path, device="cpu")
    row = report.row("zero", "vs_single")
    assert row.passed, row.detail
    assert row.max_abs_diff is not None and row.max_abs_diff < 1e-6


@NEEDS_DEEPSPEED
@pytest.mark.slow
def test_torchrun_zero1_saves_a_deepspeed_folder_matching_single(
    tmp_path: Path, torchrun_train: Callable[..., object]
) -> None:
    out = tmp_path / "zero"
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    proc = torchrun_train(launcher, "zero", 2, out, timeout=300, extra=("--zero-stage", "1"))
    assert "fallback: no GPU: 2 CPU processes over gloo, ZeRO-1" in proc.stdout  # type: ignore[attr-defined]
    result = TrainResult.read_json(out)
    assert (result.launcher, result.strategy, result.world_size) == ("torchrun", "zero", 2)
    tag = (out / "deepspeed" / "latest").read_text()
    assert tag == "global_step2"
    # ZeRO-1 keeps the whole model in one file and partitions the optimizer states only.
    assert sorted(p.name for p in (out / "deepspeed" / tag).iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    bare = tensors(out / "bare.pt")
    assert_bitwise_equal(bare, tensors(out / "zero_to_fp32.pt"))
    single = train(
        TrainConfig(strategy="single", steps=2, device="cpu", out_dir=str(tmp_path / "s"))
    )
    torch.testing.assert_close(result.losses, single.losses, rtol=0, atol=1e-5)
    for key, value in tensors(tmp_path / "s" / "bare.pt").items():
        torch.testing.assert_close(bare[key], value, rtol=0, atol=1e-5)


def test_without_deepspeed_train_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(zero_module, "zero_missing", lambda: NO_DEEPSPEED)
    with pytest.raises(MissingExtraError) as info:
        train(TrainConfig(strategy="zero", device="cpu", out_dir=str(tmp_path)))
    assert str(info.value) == NO_DEEPSPEED and isinstance(info.value, UsageError)
    assert not any(tmp_path.iterdir())


def test_without_deepspeed_parity_skips_the_zero_row_and_runs_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(zero_module, "zero_missing", lambda: NO_DEEPSPEED)
    report = run_parity(steps=1, strategies=("manual", "zero"), device="cpu")
    assert report.strategies == ("single", "manual") and report.all_passed
    skipped = report.row("zero", "vs_single")
    assert (skipped.status, skipped.passed, skipped.detail) == ("skipped", True, NO_DEEPSPEED)
    assert math.isnan(skipped.max_abs_diff) and "zero" not in report.weight_gaps
    args = ["parity", "--steps", "1", "--device", "cpu", "--strategies", "zero"]
    result = CliRunner().invoke(harness, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"zero vs_single skipped: {NO_DEEPSPEED}\n" in result.output
    assert result.output.endswith("parity holds\n")


def test_zero_stage_is_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="zero_stage=4: expected one of: 1, 2, 3") as info:
        train(TrainConfig(strategy="zero", zero_stage=4, out_dir=str(tmp_path)))
    assert info.value.render(for_cli=True).startswith("--zero-stage 4: ")
    bad = CliRunner().invoke(harness, ["train", "--strategy", "zero", "--zero-stage", "0"])
    assert bad.exit_code == 2 and "'0' is not one of '1', '2', '3'" in bad.output
    help_text = CliRunner().invoke(harness, ["train", "--help"]).output
    assert "--zero-stage [1|2|3]" in help_text and "[default: 3]" in " ".join(help_text.split())


@NEEDS_DEEPSPEED
@pytest.mark.slow
@pytest.mark.usefixtures("parity_mlp")  # its zero run's files in parity_dir
def test_zero_to_fp32_reads_a_folder_whose_name_is_a_glob_pattern(
    parity_dir: Path, tmp_path: Path
) -> None:
    # DeepSpeed globs for the rank files: "run[lr=0.05]" would match nothing, and the run
    # would fail after a complete save, saying its own files are missing.
    import shutil

    from ckpt_tools.harness.zero.runs import zero_to_fp32

    odd = tmp_path / "run[lr=0.05]"
    shutil.copytree(parity_dir / "zero" / "deepspeed", odd)
    assert_bitwise_equal(zero_to_fp32(odd), tensors(parity_dir / "zero" / "zero_to_fp32.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run[lr=0.05]"]  # no link left

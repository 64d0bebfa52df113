"""A run into an --out that holds an earlier run replaces that strategy's outputs, only them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.cli.main import main
from ckpt_tools.errors import UsageError
from ckpt_tools.harness import TrainConfig, run_parity, train
from ckpt_tools.harness.config import DEEPSPEED_DIR, STEPS_DIR, STRATEGIES
from ckpt_tools.harness.outputs import STRATEGY_OUTPUTS, clear_outputs
from ckpt_tools.harness.zero.strategy import zero_missing
from tests.helpers import run_ckpt


def test_every_strategy_says_what_it_writes() -> None:
    assert set(STRATEGY_OUTPUTS) == set(STRATEGIES)


def test_clearing_removes_a_strategy_s_own_outputs_and_nothing_else(tmp_path: Path) -> None:
    stale = tmp_path / DEEPSPEED_DIR / "global_step5"
    stale.mkdir(parents=True)
    (stale / "zero_pp_rank_1_mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / DEEPSPEED_DIR / "latest").write_text("global_step5")
    (tmp_path / DEEPSPEED_DIR / "notes.txt").write_text("mine")
    for name in ("bare.pt", "trainer.pt", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    clear_outputs(tmp_path, "zero")
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    # trainer.pt is ddp's, dp's ... output, never zero's: it stays.
    assert left == [DEEPSPEED_DIR, f"{DEEPSPEED_DIR}/notes.txt", "notes.txt", "trainer.pt"]


def test_a_folder_where_a_run_writes_a_file_is_refused_not_removed(tmp_path: Path) -> None:
    (tmp_path / "bare.pt").mkdir()
    (tmp_path / "bare.pt" / "mine.txt").write_text("mine")
    (tmp_path / "wrapped.pt").write_bytes(b"earlier")
    with pytest.raises(UsageError, match="is a folder, where the run writes a file"):
        clear_outputs(tmp_path, "single")
    assert (tmp_path / "bare.pt" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "wrapped.pt").read_bytes() == b"earlier"  # nothing removed before
    # Refused before any rank starts: one usage line, no rank named.
    args = ["harness", "train", "--strategy", "ddp", "--steps", "1", "--device", "cpu"]
    result = run_ckpt(*args, "--out", tmp_path, code=2)
    assert result.stderr.startswith("ckpt: error: ") and "rank" not in result.stderr


def test_parity_into_the_folder_of_a_longer_run_reports_only_its_own_steps(
    tmp_path: Path,
) -> None:
    for strategy in ("single", "manual"):
        steps = tmp_path / strategy / STEPS_DIR
        steps.mkdir(parents=True)
        for step in (3, 4):  # what a 4-step parity run left behind
            torch.save([torch.full((2,), float(step))], steps / f"{step:05d}.pt")
    report = run_parity(2, steps=2, out_dir=tmp_path, strategies=("manual",), device="cpu")
    assert len(report.weight_gaps["manual"]) == 2 and report.all_passed
    assert sorted(p.name for p in (tmp_path / "manual" / STEPS_DIR).iterdir()) == [
        "00001.pt",
        "00002.pt",
    ]


@pytest.mark.slow
@pytest.mark.skipif(zero_missing() is not None, reason="needs deepspeed")
def test_zero_rerun_with_another_world_size_into_the_same_out(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    for world in (2, 1):
        config = TrainConfig(
            strategy="zero", world_size=world, steps=1, device="cpu", out_dir=str(tmp_path)
        )
        result = train(config)
    ranks = sorted(p.name for p in (tmp_path / DEEPSPEED_DIR / "global_step1").iterdir())
    assert ranks == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]
    assert result.world_size == 1 and (tmp_path / "notes.txt").read_text() == "mine"
    bare = torch.load(tmp_path / "bare.pt", weights_only=True)
    reference = torch.load(tmp_path / "zero_to_fp32.pt", weights_only=True)
    assert all(torch.equal(bare[k], reference[k]) for k in reference)


def test_a_seed_torch_refuses_is_one_line_before_training(
    capsys: pytest.CaptureFixture[str],
) -> None:
    too_big = ["harness", "train", "--strategy", "single", "--device", "cpu"]
    assert main([*too_big, "--steps", "1", "--seed", str(2**64)]) == 2
    assert capsys.readouterr().err == (
        f"ckpt: error: --seed {2**64}: must be between {-(2**63)} and {2**64 - 1} "
        "(the seeds torch accepts)\n"
    )
    # seed + 1 seeds the second epoch's order: refused up front, not at step 17.
    assert main([*too_big, "--steps", "17", "--seed", str(2**64 - 1)]) == 2
    assert "less the 1 epoch that 17 steps add" in capsys.readouterr().err
    lowest = TrainConfig(steps=17, seed=-(2**63), device="cpu")
    assert len(train(lowest).losses) == 17


def test_strategies_on_one_device_ignore_the_world_size(tmp_path: Path) -> None:
    for strategy in ("single", "dp"):  # dp on the CPU is one plain forward
        config = TrainConfig(strategy=strategy, steps=1, world_size=64, device="cpu")
        assert train(config).world_size == 1


def test_a_plot_format_matplotlib_does_not_save_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    args = ["harness", "parity", "--strategies", "single", "--steps", "1", "--device", "cpu"]
    assert main([*args, "--out", str(out), "--plot", str(tmp_path / "p.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ckpt: error: --plot {str(tmp_path / 'p.txt')!r}: not an image format")
    assert ".png" in err and ".svg" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_plot_under_a_file_is_refused_before_training_and_a_new_folder_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "afile").write_text("")
    out, plot = tmp_path / "out", tmp_path / "afile" / "sub" / "p.png"
    args = ["harness", "parity", "--strategies", "single", "--steps", "1", "--device", "cpu"]
    assert main([*args, "--out", str(out), "--plot", str(plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ckpt: error: --plot {str(plot)!r}: {str(tmp_path / 'afile')!r} is")
    assert not out.exists()
    assert main([*args, "--plot", str(tmp_path / "new" / "p.png")]) == 0
    assert (tmp_path / "new" / "p.png").is_file()


def test_a_plot_in_a_folder_nothing_can_be_written_to_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    if not Path("/proc/self").is_dir():
        pytest.skip("needs /proc, which refuses new files even to root")
    out, plot = tmp_path / "out", "/proc/self/parity.png"
    args = ["harness", "parity", "--strategies", "single", "--steps", "1", "--device", "cpu"]
    assert main([*args, "--out", str(out), "--plot", plot]) == 6
    err = capsys.readouterr().err
    assert err.startswith(
        f"ckpt: error: --plot {plot!r}: cannot create a temp file in '/proc/self'"
    )
    assert err.count("\n") == 1
    assert not out.exists()


def test_a_plot_that_fails_after_training_keeps_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    # The plot's folder would be made inside bare.pt, which the training itself writes.
    out = tmp_path / "out"
    plot = out / "single" / "bare.pt" / "p.png"
    args = ["harness", "parity", "--strategies", "single", "--steps", "1", "--device", "cpu"]
    assert main([*args, "--out", str(out), "--plot", str(plot)]) == 2
    captured = capsys.readouterr()
    assert "parity holds" in captured.out and "parity plot" not in captured.out
    assert captured.err.startswith(f"ckpt: error: --plot {str(plot)!r}: ")
    assert (out / "single" / "bare.pt").is_file()


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--strategy", "single", "--out", "https://me:secret@host.example/run"],
        ["parity", "--strategies", "single", "--out", "s3://bucket/run"],
        ["parity", "--strategies", "single", "--plot", "https://me:secret@host.example/p.png"],
    ],
    ids=["train-out", "parity-out", "parity-plot"],
)
def test_a_url_output_is_refused_before_training_without_its_password(
    args: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # where a URL taken for a path would be made
    assert main(["harness", *args, "--steps", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "is a URL; outputs are written to local paths only" in err and err.count("\n") == 1
    assert "secret" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("lr", ["1e39", "inf", "0"])
def test_a_learning_rate_float32_cannot_hold_is_refused(
    lr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # SGD applies the rate in float32: torch raises on one past its range.
    args = ["harness", "train", "--strategy", "single", "--steps", "1", "--device", "cpu"]
    assert main([*args, "--lr", lr]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ckpt: error: --lr {float(lr)!r}: must be a positive number")


def test_syncbn_on_the_cpu_names_the_strategy_and_parity_refuses_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["harness", "train", "--strategy", "fsdp", "--arch", "resnet-syncbn"]
    assert main([*args, "--device", "cpu"]) == 2
    assert "but this fsdp run is on the CPU" in capsys.readouterr().err
    args = ["harness", "parity", "--arch", "resnet-syncbn", "--strategies", "single,manual,ddp"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "ckpt: error: --arch 'resnet-syncbn': SyncBatchNorm needs GPUs (torch implements it "
        "for CUDA only), but ddp would run it on the CPU; pass --strategies single,manual, "
        "pass --arch resnet (BatchNorm per rank), or run on GPUs\n"
    )
    assert captured.out == "" and not any(tmp_path.iterdir())  # nothing trained


def test_a_nan_on_one_side_is_a_nan_gap_in_the_table(tmp_path: Path) -> None:
    single = train(TrainConfig(steps=1, device="cpu", out_dir=str(tmp_path / "single")))
    bare = torch.load(single.checkpoints["bare"], weights_only=True)
    key = next(iter(bare))
    bare[key] = bare[key].clone().fill_(float("nan"))
    torch.save(bare, tmp_path / "nan.pt")
    from ckpt_tools.cli.commands.harness import _cell
    from ckpt_tools.harness.parity.checks import check_vs_single

    row = check_vs_single(tmp_path / "nan.pt", single.checkpoints["bare"], 1e-5, "ddp")
    assert row.status == "fail" and str(row.max_abs_diff) == "nan"
    assert _cell(row) == "nan FAIL" and f"{key}: {bare[key].numel()} NaN, expected 0" in row.detail

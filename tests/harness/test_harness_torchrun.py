"""The same DDP worker under torchrun (env:// rendezvous), as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tools.harness import TrainConfig, train
from ckpt_tools.harness.__main__ import main
from ckpt_tools.harness.config import TrainResult


@pytest.mark.slow
def test_torchrun_two_ranks_write_one_checkpoint_matching_single(
    tmp_path: Path, torchrun_train: Callable[..., object]
) -> None:
    out = tmp_path / "ddp"
    torchrun_train([sys.executable, "-m", "torch.distributed.run"], "ddp", 3, out, timeout=120)
    result = TrainResult.read_json(out)
    assert (result.launcher, result.backend, result.world_size) == ("torchrun", "gloo", 2)

    wrapped = torch.load(out / "wrapped.pt", weights_only=True)
    bare = torch.load(out / "bare.pt", weights_only=True)
    assert list(wrapped) == [f"module.{k}" for k in bare]
    trainer = torch.load(out / "trainer.pt", weights_only=True)
    assert trainer["step"] == 3

    single = train(
        TrainConfig(strategy="single", steps=3, device="cpu", out_dir=str(tmp_path / "s"))
    )
    torch.testing.assert_close(result.losses, single.losses, rtol=0, atol=1e-5)
    reference = torch.load(tmp_path / "s" / "bare.pt", weights_only=True)
    for key, value in reference.items():
        torch.testing.assert_close(bare[key], value, rtol=0, atol=1e-5)


@pytest.fixture
def under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables torchrun sets for rank 0 of 2."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_under_torchrun_a_single_process_strategy_is_a_usage_error(
    tmp_path: Path, under_torchrun: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # The entry must refuse before joining any process group.
    code = main(["train", "--strategy", "single", "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == (
        "python -m ckpt_tools.harness: error: --strategy 'single': runs in one process, but "
        "torchrun started 2; use --strategy ddp, or run without torchrun\n"
    )
    assert not any(tmp_path.iterdir())


def test_under_torchrun_a_mismatched_world_size_is_a_usage_error(
    under_torchrun: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--strategy", "ddp", "--world-size", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ckpt_tools.harness: error: --world-size 3: torchrun started 2")
    assert "--nproc-per-node" in err


@pytest.mark.parametrize("strategies", ["single", "ddp"])
def test_under_torchrun_parity_is_a_usage_error_naming_no_option_of_train(
    strategies: str, under_torchrun: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """parity starts its runs' processes itself; it has --strategies, not train's --strategy."""
    assert main(["parity", "--strategies", strategies, "--steps", "1", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "python -m ckpt_tools.harness: error: parity starts every strategy's processes itself, "
        "but torchrun started 2; run it without torchrun\n"
    )


def test_the_process_entry_runs_the_click_group(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    command = [sys.executable, "-m", "ckpt_tools.harness", "train", "--strategy", "single"]
    args = ["--steps", "1", "--device", "cpu", "--json", "--out", str(tmp_path)]
    proc = subprocess.run(
        command + args, env=subprocess_env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["checkpoints"]["bare"] == str(tmp_path / "bare.pt")
    bad = subprocess.run(
        [*command, "--batch-size", "0"], env=subprocess_env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Invalid value for '--batch-size'" in bad.stderr

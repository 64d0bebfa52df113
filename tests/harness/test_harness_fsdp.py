"""The fsdp strategy: FSDP2 over gloo on 2 CPU processes, spawned and under torchrun; its DCP
folder against torch's own converter; the parity row."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import UsageError
from ckpt_tools.harness import ParityReport, TrainConfig, train
from ckpt_tools.harness.config import TorchrunEnv, TrainResult, check_torchrun_fit
from ckpt_tools.harness.parity.dcp_check import check_dcp_roundtrip, torch_dcp_to_pt


@pytest.mark.slow
def test_fsdp_spawned_on_two_cpu_ranks_saves_dcp_and_the_gathered_state(
    parity_mlp: ParityReport, parity_dir: Path
) -> None:
    run = next(r for r in parity_mlp.runs if r.strategy == "fsdp")
    assert (run.launcher, run.backend, run.world_size) == ("spawn", "gloo", 2)
    out = parity_dir / "fsdp"
    assert {p.name for p in (out / "dcp").iterdir()} >= {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    }
    assert run.checkpoints["dcp"] == str(out / "dcp")
    bare = torch.load(out / "bare.pt", weights_only=True)
    single = torch.load(parity_dir / "single" / "bare.pt", weights_only=True)
    assert list(bare) == list(single)
    for key, value in single.items():
        torch.testing.assert_close(bare[key], value, rtol=0, atol=1e-5)
    wrapped = torch.load(out / "wrapped.pt", weights_only=True)
    assert list(wrapped) == [f"module.{k}" for k in bare]
    trainer = torch.load(out / "trainer.pt", weights_only=True)
    assert trainer["step"] == 3 and set(trainer["optimizer"]["state"]) == set(bare)

    # The oracle: torch's own converter reads the DCP folder, model and optimizer.
    whole = out / "oracle.pt"
    torch_dcp_to_pt(out / "dcp", whole)
    saved = torch.load(whole, weights_only=True)
    assert set(saved) == {"model", "optim"}
    for key, value in bare.items():
        assert torch.equal(saved["model"][key], value), key
    momentum = saved["optim"]["state"]
    for key, value in trainer["optimizer"]["state"].items():
        assert torch.equal(momentum[key]["momentum_buffer"], value["momentum_buffer"]), key


@pytest.mark.slow
def test_fsdp_parity_row_and_dcp_roundtrip_row(parity_mlp: ParityReport) -> None:
    row = parity_mlp.row("fsdp", "vs_single")
    assert row.status == "pass" and 0 < row.max_abs_diff <= 1e-5, row.detail
    dcp = parity_mlp.row("fsdp", "dcp_roundtrip")
    assert dcp.status == "pass" and dcp.max_abs_diff == 0.0 and dcp.tolerance == 0.0
    assert "bitwise equal" in dcp.detail and "ckpt_consolidate" in dcp.detail  # ours, torch-free
    with pytest.raises(KeyError):
        parity_mlp.row("ddp", "dcp_roundtrip")  # only runs that saved DCP get the row


@pytest.mark.slow
@pytest.mark.usefixtures("parity_mlp")  # its fsdp run's files in parity_dir
def test_dcp_roundtrip_fails_on_a_mutated_reference_or_a_lossy_converter(
    parity_dir: Path, tmp_path: Path
) -> None:
    out = parity_dir / "fsdp"
    kw = {"model": "mlp", "work_dir": tmp_path}
    reference = torch.load(out / "bare.pt", weights_only=True)
    first = next(iter(reference))
    reference[first] = reference[first].clone()
    reference[first].view(-1)[0] += 1e-3
    mutated = tmp_path / "mutated.pt"
    torch.save(reference, mutated)
    row = check_dcp_roundtrip(out / "dcp", mutated, **kw)
    assert row.status == "fail" and row.max_abs_diff > 0 and first in row.detail

    def drops_a_key(dcp_dir: Path, out_file: Path) -> None:
        torch_dcp_to_pt(dcp_dir, out_file)
        data = torch.load(out_file, weights_only=True)
        del data["model"][first]
        torch.save(data, out_file)

    row = check_dcp_roundtrip(out / "dcp", out / "bare.pt", drops_a_key, **kw)
    assert (row.status, row.error) == ("fail", "StateDictMismatchError")
    assert check_dcp_roundtrip(out / "dcp", out / "bare.pt", **kw).passed  # ckpt consolidate
    assert check_dcp_roundtrip(out / "dcp", out / "bare.pt", torch_dcp_to_pt, **kw).passed


def test_torchrun_accepts_fsdp_and_still_refuses_single_process_strategies() -> None:
    env = TorchrunEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    check_torchrun_fit(TrainConfig(strategy="fsdp"), env)
    with pytest.raises(UsageError, match="runs in one process, but torchrun started 2"):
        check_torchrun_fit(TrainConfig(strategy="manual"), env)
    with pytest.raises(UsageError, match="torchrun started 2 processes"):
        check_torchrun_fit(TrainConfig(strategy="fsdp", world_size=4), env)


@pytest.mark.slow
def test_fsdp_under_torchrun_matches_single_and_round_trips(
    tmp_path: Path, torchrun_train: Callable[..., object]
) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "fsdp"
    launcher = str(torchrun) if torchrun.exists() else shutil.which("torchrun") or "torchrun"
    torchrun_train([launcher], "fsdp", 2, out, timeout=180)
    result = TrainResult.read_json(out)
    assert (result.strategy, result.launcher, result.world_size) == ("fsdp", "torchrun", 2)
    assert {p.name for p in (out / "dcp").iterdir()} >= {"__0_0.distcp", "__1_0.distcp"}

    single = train(TrainConfig(strategy="single", steps=2, device="cpu"))
    torch.testing.assert_close(result.losses, single.losses, rtol=0, atol=1e-5)
    row = check_dcp_roundtrip(out / "dcp", out / "bare.pt", work_dir=tmp_path)
    assert row.passed and row.max_abs_diff == 0.0, row.detail


def test_a_torch_older_than_fsdp_needs_is_named_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torch 2.4 to 2.8 cannot run FSDP2 on the CPU as one device: train says which torch it
    # needs, and parity skips the row.
    from ckpt_tools.harness import run_parity
    from ckpt_tools.harness.fsdp import fsdp_missing

    assert fsdp_missing() is None
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    why = fsdp_missing()
    assert why == (
        "the fsdp strategy needs torch 2.9 or newer (FSDP2), found torch 2.8.0+cu128: "
        "pip install 'torch>=2.9'"
    )
    with pytest.raises(UsageError) as info:
        train(TrainConfig(strategy="fsdp", device="cpu", out_dir=str(tmp_path / "run")))
    assert str(info.value) == why and not tmp_path.joinpath("run").exists()
    report = run_parity(steps=1, strategies=("fsdp",), device="cpu")
    assert report.strategies == ("single",) and report.all_passed
    skipped = report.row("fsdp", "vs_single")
    assert (skipped.status, skipped.passed, skipped.detail) == ("skipped", True, why)
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    assert fsdp_missing() is None

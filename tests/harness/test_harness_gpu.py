"""GPU runs: every strategy on one GPU (nccl with world size 1), DataParallel over 2 GPUs, DDP
and FSDP2 with nccl over 2, a real cuda save. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.harness import TrainConfig, run_parity, train
from ckpt_tools.harness.parity.checks import check_device_roundtrip
from ckpt_tools.harness.parity.reference import storage_tags

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

pytestmark = [pytest.mark.gpu, needs_cuda]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@needs_two
def test_dp_scatters_over_two_gpus_and_matches_single(tmp_path: Path) -> None:
    train(TrainConfig(strategy="single", steps=3, gpus="0", out_dir=str(tmp_path / "s")))
    dp = train(TrainConfig(strategy="dp", steps=3, gpus="0,1", out_dir=str(tmp_path / "dp")))
    assert dp.fallback is None and dp.devices == ("cuda:0", "cuda:1")
    assert all(k.startswith("module.") for k in _load(tmp_path / "dp" / "wrapped.pt"))
    a, b = _load(tmp_path / "s" / "bare.pt"), _load(tmp_path / "dp" / "bare.pt")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)


@needs_two
@pytest.mark.slow
def test_ddp_over_nccl_matches_single(tmp_path: Path) -> None:
    single = train(TrainConfig(strategy="single", steps=3, gpus="0", out_dir=str(tmp_path / "s")))
    ddp = train(
        TrainConfig(strategy="ddp", steps=3, world_size=2, gpus="0,1", out_dir=str(tmp_path / "d"))
    )
    assert ddp.backend == "nccl" and ddp.devices == ("cuda:0", "cuda:1")
    torch.testing.assert_close(ddp.losses, single.losses, rtol=0, atol=1e-5)


@needs_two
@pytest.mark.slow
def test_resnet_with_syncbn_over_two_gpus_is_comparable() -> None:
    report = run_parity(world_size=2, steps=2, model="resnet", gpus="0,1", strategies=("ddp",))
    row = report.row("ddp", "vs_single")
    assert row.status == "pass" and row.max_abs_diff <= 1e-5, row.detail
    assert next(r for r in report.runs if r.strategy == "ddp").sync_bn


@needs_two
@pytest.mark.slow
def test_fsdp_over_nccl_matches_single_and_its_dcp_round_trips(tmp_path: Path) -> None:
    report = run_parity(world_size=2, steps=3, gpus="0,1", strategies=("fsdp",), out_dir=tmp_path)
    run = next(r for r in report.runs if r.strategy == "fsdp")
    assert run.backend == "nccl" and run.devices == ("cuda:0", "cuda:1")
    row = report.row("fsdp", "vs_single")
    assert row.status == "pass" and row.max_abs_diff <= 1e-5, row.detail
    dcp = report.row("fsdp", "dcp_roundtrip")
    assert dcp.passed and dcp.max_abs_diff == 0.0, dcp.detail


def test_gpu_saved_checkpoint_loads_bitwise_with_map_location_auto(tmp_path: Path) -> None:
    result = train(TrainConfig(strategy="single", steps=2, out_dir=str(tmp_path / "run")))
    assert result.devices[0].startswith("cuda")
    wrapped = tmp_path / "run" / "wrapped.pt"
    assert all(tag.startswith("cuda") for tag in storage_tags(wrapped))
    row = check_device_roundtrip(wrapped, tmp_path / "work", "single")
    assert row.passed and row.max_abs_diff == 0.0, row.detail
    assert "saved on GPU" in row.detail


def test_every_strategy_on_one_gpu_matches_single_and_round_trips(tmp_path: Path) -> None:
    # What one GPU can run of each: DataParallel on one device, DDP and FSDP2 over nccl
    # with world size 1, the manual all-reduce loop with one replica.
    strategies = ("dp", "ddp", "manual", "fsdp")
    report = run_parity(world_size=1, steps=3, gpus="0", strategies=strategies, out_dir=tmp_path)
    failed = [(r.strategy, r.name, r.detail) for r in report.rows if not r.passed]
    assert report.all_passed, failed
    runs = {r.strategy: r for r in report.runs}
    assert runs["ddp"].backend == runs["fsdp"].backend == "nccl"
    assert all(runs[s].devices == ("cuda:0",) and runs[s].fallback is None for s in strategies)
    # FSDP's full state dict is gathered to the CPU (cpu_offload=True) before rank 0 saves
    # it; the others save the GPU's tensors as they are.
    saved_on = {
        s: {tag.partition(":")[0] for tag in storage_tags(tmp_path / s / "wrapped.pt")}
        for s in strategies
    }
    assert saved_on == {"dp": {"cuda"}, "ddp": {"cuda"}, "manual": {"cuda"}, "fsdp": {"cpu"}}
    for strategy in strategies:
        assert report.row(strategy, "vs_single").status == "pass"
        row = report.row(strategy, "device_roundtrip")
        assert row.max_abs_diff == 0.0, row.detail
        assert ("saved on GPU" in row.detail) == (saved_on[strategy] == {"cuda"}), row.detail
    dcp = report.row("fsdp", "dcp_roundtrip")
    assert dcp.passed and dcp.max_abs_diff == 0.0, dcp.detail

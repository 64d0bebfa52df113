"""Every strategy on the CPU with world size 2, and the checkpoints each one saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import UsageError
from ckpt_tools.harness import ParityReport, TrainConfig, train
from ckpt_tools.harness.config import RUN_JSON, TrainResult


def cpu(**kw: object) -> TrainConfig:
    """A config forced onto the CPU, so these tests mean the same on a GPU machine."""
    return TrainConfig(device="cpu", **kw)  # type: ignore[arg-type]


#: How a CPU fallback says why it fell back.
WHY_CPU = "device='cpu'" if torch.cuda.is_available() else "no GPU"


def _load(path: Path | str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_checkpoints(out: Path, steps: int) -> None:
    wrapped, bare, trainer = (_load(out / f"{n}.pt") for n in ("wrapped", "bare", "trainer"))
    assert list(wrapped) == [f"module.{k}" for k in bare]
    assert all(torch.equal(wrapped[f"module.{k}"], v) for k, v in bare.items())
    assert set(trainer) == {"model", "optimizer", "epoch", "step"}
    assert trainer["step"] == steps and trainer["epoch"] == 0
    assert all(torch.equal(trainer["model"][k], v) for k, v in bare.items())
    # momentum 0.9: the optimizer state holds a buffer per parameter
    assert len(trainer["optimizer"]["state"]) == len(bare)
    assert (out / RUN_JSON).is_file()


def test_single_is_deterministic_and_learns(tmp_path: Path) -> None:
    first = train(cpu(strategy="single", steps=6, out_dir=str(tmp_path / "a")))
    second = train(cpu(strategy="single", steps=6, out_dir=str(tmp_path / "b")))
    assert first.losses == second.losses and len(first.losses) == 6
    assert first.losses[-1] < first.losses[0]
    assert first.devices == ("cpu",) and first.fallback is None and first.world_size == 1
    a, b = _load(tmp_path / "a" / "bare.pt"), _load(tmp_path / "b" / "bare.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    _assert_checkpoints(tmp_path / "a", 6)
    assert TrainResult.read_json(tmp_path / "a").losses == first.losses


def test_dp_without_gpu_runs_a_plain_forward_and_keeps_module_keys(tmp_path: Path) -> None:
    single = train(cpu(strategy="single", steps=3, out_dir=str(tmp_path / "single")))
    dp = train(cpu(strategy="dp", steps=3, world_size=2, out_dir=str(tmp_path / "dp")))
    what = "DataParallel ran as a plain forward on the CPU (asked for 2 replicas)"
    assert dp.fallback == f"{WHY_CPU}: {what}" and dp.devices == ("cpu",)
    assert dp.losses == single.losses  # the very same computation
    _assert_checkpoints(tmp_path / "dp", 3)


def test_manual_loop_over_two_cpu_replicas_matches_single(tmp_path: Path) -> None:
    single = train(cpu(strategy="single", model="lenet", steps=3, out_dir=str(tmp_path / "s")))
    manual = train(
        cpu(strategy="manual", model="lenet", steps=3, world_size=2, out_dir=str(tmp_path / "m"))
    )
    assert manual.world_size == 2 and manual.devices == ("cpu", "cpu")
    assert manual.fallback == f"{WHY_CPU}: 2 replicas ran one after another on the CPU"
    torch.testing.assert_close(manual.losses, single.losses, rtol=0, atol=1e-5)
    a, b = _load(tmp_path / "s" / "bare.pt"), _load(tmp_path / "m" / "bare.pt")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    _assert_checkpoints(tmp_path / "m", 3)


def test_manual_with_an_uneven_split_still_matches_single() -> None:
    single = train(cpu(strategy="single", steps=2, batch_size=30))
    manual = train(cpu(strategy="manual", steps=2, batch_size=30, world_size=4))  # 8,8,7,7
    torch.testing.assert_close(manual.losses, single.losses, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_ddp_spawned_over_gloo_matches_single(parity_mlp: ParityReport, parity_dir: Path) -> None:
    # The shared parity run (conftest) spawned DDP with world size 2; reuse its output
    # rather than paying for another pair of processes.
    runs = {run.strategy: run for run in parity_mlp.runs}
    ddp, single = runs["ddp"], runs["single"]
    assert (ddp.backend, ddp.launcher, ddp.world_size) == ("gloo", "spawn", 2)
    assert ddp.devices == ("cpu", "cpu")
    assert ddp.fallback == f"{WHY_CPU}: 2 CPU processes over gloo"
    torch.testing.assert_close(ddp.losses, single.losses, rtol=0, atol=1e-5)
    _assert_checkpoints(parity_dir / "ddp", parity_mlp.steps)
    a, b = _load(parity_dir / "single" / "bare.pt"), _load(parity_dir / "ddp" / "bare.pt")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)


def test_ddp_refuses_syncbn_on_cpu_before_starting_processes(tmp_path: Path) -> None:
    config = cpu(strategy="ddp", model="resnet-syncbn", world_size=2, out_dir=str(tmp_path))
    with pytest.raises(UsageError, match="SyncBatchNorm needs GPUs") as info:
        train(config)
    assert "pass --arch resnet (BatchNorm per rank)" in info.value.render(for_cli=True)
    assert "pass model='resnet' (BatchNorm per rank)" in str(info.value)
    assert not any(tmp_path.iterdir())


def test_no_out_dir_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = train(cpu(strategy="manual", steps=1, world_size=2))
    assert result.checkpoints == {} and result.out_dir is None
    assert not any(tmp_path.iterdir())


def test_ddp_checks_model_arguments_before_starting_processes(tmp_path: Path) -> None:
    config = cpu(strategy="ddp", world_size=2, model_kwargs={"depth": 3}, out_dir=str(tmp_path))
    with pytest.raises(UsageError, match="does not take"):
        train(config)

"""The parity checks, one by one (passing and failing), and run_parity's report."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import UsageError
from ckpt_tools.harness import (
    CHECK_NAMES,
    STRATEGIES,
    CheckResult,
    ParityReport,
    TrainConfig,
    run_parity,
    train,
)
from ckpt_tools.harness.parity.checks import (
    check_add_prefix,
    check_device_roundtrip,
    check_format_roundtrip,
    check_strip_prefix,
    check_vs_single,
)
from ckpt_tools.harness.parity.reference import storage_tags
from ckpt_tools.harness.zero.strategy import zero_missing

#: The strategies the shared parity run trains: every one, zero only with DeepSpeed installed
#: (without it, zero has one skipped row instead).
RAN = tuple(s for s in STRATEGIES if s != "zero" or zero_missing() is None)
#: fsdp's dcp_roundtrip, and zero's zero_roundtrip or skipped row.
EXTRA_ROWS = {
    ("fsdp", "dcp_roundtrip"),
    ("zero", "zero_roundtrip" if "zero" in RAN else "vs_single"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of single and manual (world size 2) MLP runs, trained in-process."""
    root = tmp_path_factory.mktemp("runs")
    for strategy in ("single", "manual"):
        out = str(root / strategy)
        train(TrainConfig(strategy=strategy, steps=3, world_size=2, device="cpu", out_dir=out))
    return root


def test_a_strip_prefix_gives_bitwise_equal_outputs(runs: Path) -> None:
    row = check_strip_prefix(runs / "manual" / "wrapped.pt", "mlp", strategy="manual")
    assert (row.name, row.status, row.passed) == ("strip_prefix", "pass", True)
    assert row.max_abs_diff == 0.0 and row.tolerance == 0.0


def test_a_fails_when_the_wrapped_file_is_not_the_runs_bare_weights(
    runs: Path, tmp_path: Path
) -> None:
    # The run saved one state dict twice; a wrapped.pt whose values drifted from bare.pt's
    # loads and runs just the same, so only comparing the two files finds it.
    wrapped = torch.load(runs / "manual" / "wrapped.pt", weights_only=True)
    key = next(k for k, v in wrapped.items() if v.is_floating_point())
    wrapped[key] = wrapped[key] + 0.5
    torch.save(wrapped, tmp_path / "wrapped.pt")
    bare = runs / "manual" / "bare.pt"
    assert check_strip_prefix(runs / "manual" / "wrapped.pt", "mlp", bare_path=bare).passed
    row = check_strip_prefix(tmp_path / "wrapped.pt", "mlp", bare_path=bare)
    assert (row.passed, row.status) == (False, "fail") and "not bare.pt's weights" in row.detail
    assert row.max_abs_diff == pytest.approx(0.5)


def test_a_fails_when_the_checkpoint_does_not_fit_the_model(runs: Path) -> None:
    row = check_strip_prefix(runs / "manual" / "wrapped.pt", "lenet")
    assert (row.passed, row.status, row.error) == (False, "fail", "StateDictMismatchError")
    assert row.detail.startswith("StateDictMismatchError: DataParallel.load_state_dict refused")
    assert "Missing key(s)" in row.detail and row.max_abs_diff == math.inf


@pytest.mark.parametrize(
    "check",
    [
        lambda p, work: check_strip_prefix(p, "mlp"),
        lambda p, work: check_add_prefix(p, "mlp"),
        lambda p, work: check_vs_single(p, p, 1e-5),
        lambda p, work: check_device_roundtrip(p, work),
        lambda p, work: check_format_roundtrip(p, work),
    ],
    ids=CHECK_NAMES,
)
def test_every_check_reports_a_missing_file_as_checkpoint_not_found(
    check: Callable[[Path, Path], CheckResult], tmp_path: Path
) -> None:
    missing = tmp_path / "gone.pt"
    row = check(missing, tmp_path / "work")
    assert (row.passed, row.status, row.error) == (False, "fail", "CheckpointNotFoundError")
    assert row.detail.startswith(
        f"CheckpointNotFoundError: no such file or folder: {str(missing)!r}"
    )


def test_an_unknown_model_is_the_callers_error_not_a_finding(runs: Path) -> None:
    with pytest.raises(UsageError, match="name='vgg': expected one of: mlp, lenet") as info:
        check_strip_prefix(runs / "manual" / "wrapped.pt", "vgg")
    assert "resnet" in str(info.value)


def test_an_unexpected_error_propagates_instead_of_becoming_a_fail_row(tmp_path: Path) -> None:
    # A folder is no .pt file: torch.load raises IsADirectoryError, which no check expects.
    with pytest.raises(IsADirectoryError):
        check_vs_single(tmp_path, tmp_path, 1e-5)


def test_b_add_prefix_loads_into_data_parallel(runs: Path) -> None:
    row = check_add_prefix(runs / "single" / "bare.pt", "mlp", strategy="single")
    assert row.passed and row.max_abs_diff == 0.0


def test_b_fails_on_an_already_wrapped_checkpoint(runs: Path) -> None:
    # module.module.* keys cannot load strictly into DataParallel(model)
    row = check_add_prefix(runs / "single" / "wrapped.pt", "mlp")
    assert (row.passed, row.error) == (False, "StateDictMismatchError")
    assert "MLP.load_state_dict refused" in row.detail
    assert 'Unexpected key(s) in state_dict: "module.net.1.weight"' in row.detail


def test_c_manual_matches_single_within_tolerance(runs: Path) -> None:
    row = check_vs_single(runs / "manual" / "bare.pt", runs / "single" / "bare.pt", 1e-5)
    assert row.passed and row.status == "pass" and row.max_abs_diff <= 1e-5


def test_c_catches_a_perturbed_weight(runs: Path, tmp_path: Path) -> None:
    sd = torch.load(runs / "manual" / "bare.pt", weights_only=True)
    first = next(iter(sd))
    sd[first] = sd[first] + 1e-3
    torch.save(sd, tmp_path / "bad.pt")
    row = check_vs_single(tmp_path / "bad.pt", runs / "single" / "bare.pt", 1e-5)
    assert (row.passed, row.status, row.error) == (False, "fail", "")
    assert row.max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    assert row.detail.endswith(f": {first}: values differ by more than 1e-05")


def test_c_catches_an_extra_key(runs: Path, tmp_path: Path) -> None:
    sd = torch.load(runs / "manual" / "bare.pt", weights_only=True)
    torch.save({**sd, "extra": torch.zeros(1)}, tmp_path / "extra.pt")
    row = check_vs_single(tmp_path / "extra.pt", runs / "single" / "bare.pt", 1e-5)
    assert not row.passed and row.max_abs_diff == math.inf
    assert row.detail.endswith(": unexpected keys ['extra']")


def test_c_reports_a_not_comparable_gap_without_failing(runs: Path) -> None:
    row = check_vs_single(
        runs / "manual" / "bare.pt",
        runs / "single" / "bare.pt",
        1e-5,
        comparable=False,
        why_not="x",
    )
    assert row.passed and row.status == "not comparable" and row.tolerance is None


def test_d_device_roundtrip_through_a_cuda1_retag(runs: Path, tmp_path: Path) -> None:
    row = check_device_roundtrip(runs / "manual" / "wrapped.pt", tmp_path, "manual")
    assert row.passed, row.detail
    assert row.max_abs_diff == 0.0
    if not torch.cuda.is_available():
        assert storage_tags(tmp_path / "wrapped.cuda1.pt") == {"cuda:1"}
        assert "retagged cpu->cuda:1" in row.detail and "-> cpu" in row.detail


def test_e_format_roundtrip_through_safetensors(runs: Path, tmp_path: Path) -> None:
    row = check_format_roundtrip(runs / "manual" / "wrapped.pt", tmp_path, "manual")
    assert row.passed, row.detail
    assert (tmp_path / "wrapped.safetensors").read_bytes()[8:9] == b"{"  # safetensors header
    assert (tmp_path / "wrapped.roundtrip.pt").is_file()
    again = check_format_roundtrip(runs / "manual" / "wrapped.pt", tmp_path, "manual")
    assert again.passed, again.detail  # re-running over its own outputs is fine


def test_e_reports_what_safetensors_cannot_hold(runs: Path, tmp_path: Path) -> None:
    row = check_format_roundtrip(runs / "manual" / "trainer.pt", tmp_path, "manual")
    assert (row.passed, row.error) == (False, "NonTensorEntriesError")
    assert not (tmp_path / "trainer.safetensors").exists()


@pytest.mark.slow
def test_run_parity_mlp_all_strategies_hold(parity_mlp: ParityReport, parity_dir: Path) -> None:
    report = parity_mlp
    assert report.strategies == RAN
    # fsdp adds its dcp_roundtrip row, zero its zero_roundtrip (or its skipped) row.
    assert len(report.rows) == len(RAN) * len(CHECK_NAMES) + 2
    for strategy in RAN:
        assert (parity_dir / strategy / "wrapped.pt").is_file()
        for check in ("strip_prefix", "add_prefix", "format_roundtrip"):
            assert report.row(strategy, check).passed, report.row(strategy, check).detail
            assert report.row(strategy, check).max_abs_diff == 0.0
    assert report.row("single", "vs_single").status == "baseline"
    for strategy in ("dp", "ddp", "manual", "fsdp"):
        row = report.row(strategy, "vs_single")
        assert row.status == "pass" and row.max_abs_diff <= 1e-5, row.detail
    losses = report.losses
    assert set(losses) == set(RAN) and all(len(v) == 3 for v in losses.values())
    ddp_keys = torch.load(parity_dir / "ddp" / "wrapped.pt", weights_only=True)
    assert all(k.startswith("module.") for k in ddp_keys)


@pytest.mark.slow
def test_parity_report_json_and_all_passed(parity_mlp: ParityReport) -> None:
    data = parity_mlp.to_json()
    assert data["all_passed"] == parity_mlp.all_passed
    assert set(data["losses"]) == set(RAN)
    assert {(r["strategy"], r["name"]) for r in data["rows"]} == {
        (s, c) for s in RAN for c in CHECK_NAMES
    } | EXTRA_ROWS
    launchers = [run["launcher"] for run in data["runs"]]
    spawned = ["spawn"] * (len(RAN) - 4)  # fsdp, and zero where it ran
    assert launchers == ["in-process", "in-process", "spawn", "in-process", *spawned]
    assert parity_mlp.all_passed


@pytest.mark.slow
def test_run_parity_records_each_strategy_s_weight_gap_per_step(parity_mlp: ParityReport) -> None:
    gaps = parity_mlp.weight_gaps
    assert list(gaps) == [s for s in RAN if s != "single"]
    for strategy, values in gaps.items():
        assert len(values) == parity_mlp.steps and all(0 <= g <= 1e-5 for g in values)
        # The last step's gap is (c)'s: the same final weights (the MLP has no buffers).
        assert values[-1] == parity_mlp.row(strategy, "vs_single").max_abs_diff, strategy
    assert gaps["dp"] == (0.0,) * parity_mlp.steps  # dp on the CPU: single's very maths
    data = parity_mlp.to_json()
    assert data["weight_gaps"] == {k: list(v) for k, v in gaps.items()}


def test_run_parity_rejects_unknown_strategies() -> None:
    with pytest.raises(UsageError, match="unknown strategies zero3; expected some of single") as e:
        run_parity(strategies=("single", "zero3"))
    assert e.value.render(for_cli=True).startswith("--strategies ('single', 'zero3'): ")


def test_a_batch_too_small_for_a_strategy_is_refused_before_any_strategy_trains(
    tmp_path: Path,
) -> None:
    with pytest.raises(UsageError, match="leaves some of the 2 replicas without samples"):
        run_parity(2, steps=1, strategies=("single", "manual"), batch_size=1, out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # single trained nothing, wrote nothing


def test_a_folder_where_a_later_strategy_writes_a_file_is_refused_before_training(
    tmp_path: Path,
) -> None:
    (tmp_path / "manual" / "bare.pt").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"bare\.pt"):
        run_parity(2, steps=1, strategies=("single", "manual"), out_dir=tmp_path)
    assert not (tmp_path / "single").exists()


def test_a_file_where_a_later_strategy_writes_its_folder_is_refused_before_training(
    tmp_path: Path,
) -> None:
    (tmp_path / "manual").write_bytes(b"")
    with pytest.raises(UsageError, match=r"manual' is a file, where the run writes its folder"):
        run_parity(2, steps=1, strategies=("single", "manual"), out_dir=tmp_path)
    assert not (tmp_path / "single").exists()


def test_run_parity_without_a_world_size_counts_as_train_does() -> None:
    # One per selected GPU, else 2 on the CPU; a one-GPU machine runs world size 1.
    expected = torch.cuda.device_count() or 2
    report = run_parity(None, steps=1, strategies=("single", "manual"))
    assert report.world_size == expected and report.all_passed
    manual = next(r for r in report.runs if r.strategy == "manual")
    assert manual.world_size == expected


def test_failed_rows_with_nan_diffs_fail_the_report_and_json_stays_strict() -> None:
    failed = CheckResult("device_roundtrip", False, math.nan, None, "NaN in output", "ddp", "fail")
    report = ParityReport("mlp", 2, 1, 0, 1e-5, (), (failed,))
    assert not report.all_passed
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))  # NaN must not leak
    assert data["rows"][0]["max_abs_diff"] == "nan" and data["all_passed"] is False


def test_a_one_rank_run_matches_single_bit_for_bit_on_any_thread_count() -> None:
    # Every rank computes on one thread; single, computed in this process, did so on
    # torch's default count, and a BatchNorm's statistics on two threads differ in their
    # last bits: a correct one-rank DDP run failed (c) by 7e-5 after two steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report = run_parity(
            world_size=1,
            model="resnet",
            batch_size=4,
            steps=2,
            strategies=("single", "ddp"),
            device="cpu",
        )
        assert torch.get_num_threads() == 2  # (restored)
    finally:
        torch.set_num_threads(threads)
    row = report.row("ddp", "vs_single")
    assert row.status == "pass" and row.max_abs_diff == 0.0, row

"""The per-step weight differences behind the parity plot, and the plot telling strategies apart."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import UsageError
from ckpt_tools.harness import TrainConfig, train
from ckpt_tools.harness.config import STEPS_DIR
from ckpt_tools.harness.parity.checks import check_vs_single
from ckpt_tools.harness.parity.plot import parity_figure, plot_parity, zero_floor
from ckpt_tools.harness.parity.reference import step_gaps

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """single, dp and manual MLP runs of 3 steps that saved their parameters per step."""
    root = tmp_path_factory.mktemp("recorded")
    for strategy in ("single", "dp", "manual"):
        config = TrainConfig(
            strategy=strategy,
            steps=3,
            world_size=2,
            device="cpu",
            out_dir=str(root / strategy),
            record_steps=True,
        )
        train(config)
    return root


def test_every_step_s_parameters_are_saved(recorded: Path) -> None:
    files = sorted(p.name for p in (recorded / "manual" / STEPS_DIR).iterdir())
    assert files == ["00001.pt", "00002.pt", "00003.pt"]
    last = torch.load(recorded / "single" / STEPS_DIR / "00003.pt", weights_only=True)
    bare = torch.load(recorded / "single" / "bare.pt", weights_only=True)
    # The last step's parameters are the final weights the checkpoint holds, in model order.
    params = [v for k, v in bare.items() if k.endswith(("weight", "bias"))]
    assert len(last) == len(params) and all(torch.equal(a, b) for a, b in zip(last, params))


def test_no_steps_are_saved_unless_asked(tmp_path: Path) -> None:
    train(TrainConfig(strategy="single", steps=1, device="cpu", out_dir=str(tmp_path)))
    assert not (tmp_path / STEPS_DIR).exists()
    with pytest.raises(UsageError, match="record_steps=True: needs out_dir"):
        train(TrainConfig(strategy="single", steps=1, device="cpu", record_steps=True))


def test_step_gaps_end_at_the_vs_single_check(recorded: Path) -> None:
    single = recorded / "single"
    manual = step_gaps(recorded / "manual", single)
    assert len(manual) == 3 and all(0 <= g <= 1e-5 for g in manual)
    check = check_vs_single(recorded / "manual" / "bare.pt", single / "bare.pt", 1e-5)
    assert manual[-1] == check.max_abs_diff  # the MLP has no buffers: the same tensors
    assert step_gaps(recorded / "dp", single) == (0.0, 0.0, 0.0)  # dp on the CPU: the same maths
    assert step_gaps(single, single) == (0.0, 0.0, 0.0)


def test_a_perturbed_step_shows_as_its_own_gap(recorded: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy" / STEPS_DIR
    copy.mkdir(parents=True)
    for step in (1, 2, 3):
        params = torch.load(recorded / "single" / STEPS_DIR / f"{step:05d}.pt", weights_only=True)
        if step == 2:
            params[0][0, 0] += 0.5
        torch.save(params, copy / f"{step:05d}.pt")
    assert step_gaps(tmp_path / "copy", recorded / "single") == (0.0, 0.5, 0.0)
    torch.save([torch.zeros(1)], copy / "00003.pt")  # parameters that do not pair up
    assert step_gaps(tmp_path / "copy", recorded / "single")[2] == math.inf


GAPS = {"dp": [0.0, 0.0, 0.0], "ddp": [7e-9, 1.5e-8, 1.5e-8], "manual": [7e-9, 1.5e-8, 1.5e-8]}
LOSSES = {name: [2.3, 2.25, 2.2] for name in ("single", "dp", "ddp", "manual")}


def test_the_figure_tells_every_strategy_apart() -> None:
    fig = parity_figure(LOSSES, GAPS, tolerance=1e-5)
    loss_ax, gap_ax = fig.axes
    # Reference lines carry matplotlib's hidden labels ("_child3"): only strategies count.
    shown = [line for line in gap_ax.get_lines() if not line.get_label().startswith("_")]
    curves = {line.get_label().split()[0]: line for line in shown}
    assert set(curves) == set(GAPS)
    losses = [line for line in loss_ax.get_lines() if not line.get_label().startswith("_")]
    assert [line.get_label() for line in losses] == list(LOSSES)
    # One colour and one marker per strategy; at a step, each strategy's marker has its own x.
    lines = list(curves.values())
    assert len({line.get_color() for line in lines}) == len(lines)
    assert len({line.get_marker() for line in lines}) == len(lines)
    assert len({float(line.get_xdata()[0]) for line in lines}) == len(lines)
    assert len({float(line.get_xdata()[0]) for line in losses}) == len(losses)
    # The same strategy keeps its style in both panels.
    by_name = {line.get_label(): line for line in losses}
    assert curves["ddp"].get_color() == by_name["ddp"].get_color()


def test_zero_is_drawn_on_a_floor_below_every_real_gap_and_the_tolerance_is_a_line() -> None:
    fig = parity_figure(LOSSES, GAPS, tolerance=1e-5)
    gap_ax = fig.axes[1]
    assert gap_ax.get_yscale() == "log"
    floor = zero_floor(GAPS, 1e-5)
    assert 0 < floor < 7e-9
    dp = next(line for line in gap_ax.get_lines() if line.get_label().startswith("dp"))
    assert list(dp.get_ydata()) == [floor] * 3 and "equal to single" in dp.get_label()
    levels = {float(line.get_ydata()[0]) for line in gap_ax.get_lines() if len(line.get_ydata())}
    assert 1e-5 in levels  # the tolerance line
    low, high = gap_ax.get_ylim()
    assert low < floor and high > 1e-5
    texts = [t.get_text() for t in gap_ax.texts]
    assert any("tolerance" in t for t in texts) and any(t.startswith("0") for t in texts)


def test_the_png_is_written(tmp_path: Path) -> None:
    path = plot_parity(LOSSES, GAPS, tmp_path / "parity.png", tolerance=1e-5)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_floor_without_any_real_gap_sits_below_the_tolerance() -> None:
    assert zero_floor({"dp": [0.0, 0.0]}, 1e-5) == pytest.approx(1e-6)
    assert zero_floor({"x": [math.inf, 2e-7]}, 1e-5) == pytest.approx(2e-8)

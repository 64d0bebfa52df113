"""diff() on quantized tensors: bit-equal only where torch.equal says so (quantizer and
integers), values compared as torch.load's tensors dequantize."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ckpt_tools.diffing.engine import diff
from ckpt_tools.diffing.value_stats import compare_tensors
from tests.diffing.conftest import Save
from tests.helpers import run_ckpt

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.quantize:UserWarning", "ignore:TypedStorage is deprecated:UserWarning"
)


def loaded(path: str, key: str = "q") -> torch.Tensor:
    """The oracle's tensor: what torch.load gives."""
    return torch.load(path, weights_only=True)[key]


def per_tensor(values: list[float], scale: float, zero_point: int = 0) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.tensor(values), scale, zero_point, torch.qint8)


def quantized(ints: list[int], scale: float) -> torch.Tensor:
    return torch._make_per_tensor_quantized_tensor(torch.tensor(ints, dtype=torch.int8), scale, 0)


def per_channel(ints: torch.Tensor, scales: list[float], zero_points: list[int]) -> torch.Tensor:
    return torch._make_per_channel_quantized_tensor(
        ints, torch.tensor(scales, dtype=torch.float64), torch.tensor(zero_points), 0
    )


def test_same_integers_under_another_scale_differ(save: Save, capsys: Any) -> None:
    a_path = save({"q": per_tensor([1.0, 2.0], 0.1)}, "a.pt")
    b_path = save({"q": per_tensor([2.0, 4.0], 0.2)}, "b.pt")
    a, b = loaded(a_path), loaded(b_path)
    assert torch.equal(a.int_repr(), b.int_repr()) and not torch.equal(a, b)
    pair = diff(a_path, b_path).tensor("q")
    assert pair.status == "differ" and pair.bit_equal is False
    want = (a.dequantize() - b.dequantize()).abs().max().item()
    assert pair.max_abs == pytest.approx(want) and pair.mismatched == 2
    assert pair.note == "quantizers differ: scale 0.1 / 0.2"
    code, out, _ = run_ckpt(
        "diff", a_path, b_path, "--json", "--all", "--fail-on", "any", code=None
    )
    report = json.loads(out)
    assert code == 1 and report["identical"] is False and report["failed_on"] == ["value"]


@pytest.mark.parametrize(
    ("scales", "zero_points", "note"),
    [
        ([0.5, 0.7], [1, -1], "quantizers differ: scales [0.1, 0.2] / [0.5, 0.7]"),
        ([0.1, 0.2], [0, -1], "quantizers differ: zero_points [1, -1] / [0, -1]"),
    ],
    ids=["scales", "zero_points"],
)
def test_per_channel_scales_and_zero_points_count(
    save: Save, scales: list[float], zero_points: list[int], note: str
) -> None:
    ints = torch.tensor([[3, -4, 5], [6, 7, -8]], dtype=torch.int8)
    a_path = save({"q": per_channel(ints, [0.1, 0.2], [1, -1])}, "a.pt")
    b_path = save({"q": per_channel(ints, scales, zero_points)}, "b.pt")
    a, b = loaded(a_path), loaded(b_path)
    assert not torch.equal(a, b)
    # The files, and the tensors torch.load gives for them.
    for pair in (diff(a_path, b_path).tensor("q"), diff({"q": a}, {"q": b}).tensor("q")):
        assert pair.status == "differ" and pair.bit_equal is False and pair.note == note
        want = (a.dequantize() - b.dequantize()).abs().max().item()
        assert pair.max_abs == pytest.approx(want)


def test_bit_equal_is_what_torch_equal_says(save: Save) -> None:
    ints = torch.tensor([[3, -4, 5], [6, 7, -8]], dtype=torch.int8)
    sd = {"q": per_tensor([1.0, -2.5, 3.0], 0.5, 2), "c": per_channel(ints, [0.1, 0.2], [1, -1])}
    sd["t"] = per_channel(ints, [0.1, 0.2], [1, -1])[:, 1:]  # a view: strided, offset
    # 10 * 0.1 and 5 * 0.2 dequantize to the same numbers; torch.equal still says no.
    a_sd = {**sd, "s": quantized([10, 20], 0.1)}
    b_sd = {**{k: v.clone() for k, v in sd.items()}, "s": quantized([5, 10], 0.2)}
    a_path, b_path = save(a_sd, "a.pt"), save(b_sd, "b.pt")
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    assert torch.equal(a["s"].dequantize(), b["s"].dequantize())
    report = diff(a_path, b_path, rtol=0, atol=0)
    assert not report.identical and report.found() == frozenset()
    for key in a_sd:
        pair = report.tensor(key)
        assert pair.bit_equal is torch.equal(a[key], b[key]) is (key != "s"), key
        assert pair.max_abs == 0.0 and pair.status == ("close" if key == "s" else "equal")
    assert report.tensor("s").note == "quantizers differ: scale 0.1 / 0.2"


def test_a_quantized_tensor_against_a_float_one_compares_dequantized_values(save: Save) -> None:
    q = per_tensor([1.0, 2.0, 3.0], 0.5)
    a_path = save({"q": q}, "a.pt")
    b_path = save({"q": torch.tensor([1.0, 2.0, 3.25])}, "b.pt")
    pair = diff(a_path, b_path).tensor("q")
    assert pair.status == "dtype" and pair.dtype_a == "qint8" and pair.max_abs == 0.25
    stats = compare_tensors(loaded(a_path), loaded(b_path))
    assert stats.max_abs == 0.25 and not stats.bit_equal
    assert compare_tensors(q, per_tensor([2.0, 4.0, 6.0], 1.0)).bit_equal is False


def _qlinear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = torch.ao.nn.quantized.Linear(4, 4)
    module.set_weight_bias(per_tensor(torch.randn(16).tolist(), 0.1).reshape(4, 4), torch.randn(4))
    return module


def test_a_quantized_modules_packed_weights_are_never_called_identical(save: Save) -> None:
    # A quantized Linear keeps its weight and bias in a tuple (_packed_params): not passed over
    # as a value that is no tensor, nor vouched for when it is not compared.
    a, b = _qlinear(0), _qlinear(1)
    a_path, b_path = save(a.state_dict(), "a.pt"), save(b.state_dict(), "b.pt")
    key = "_packed_params._packed_params"
    weights = torch.load(a_path, weights_only=True)[key], torch.load(b_path, weights_only=True)[key]
    assert not torch.equal(weights[0][0], weights[1][0])  # the oracle: they differ
    for other in (b_path, b):  # a file, and the module itself
        report = diff(a_path, other)
        assert not report.identical and "kind" in report.found()
        assert "a tuple of 2 tensors on both sides" in report.tensor(key).note
    _, out, _ = run_ckpt("diff", a_path, b_path, "--fail-on", "any", code=1)
    assert "identical" not in out

"""diff() compares the values torch.load gives: a conjugate or negative view's bit applied,
in bit equality, statistics and sparse values alike."""

from __future__ import annotations

import pytest
import torch

from ckpt_tools.diffing.engine import diff
from ckpt_tools.diffing.value_stats import compare_tensors
from tests.diffing.conftest import Save


def with_bits() -> dict[str, torch.Tensor]:
    return {
        "c": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "n": torch.tensor([1.0, -2.0, 0.0])._neg_view(),
        "i": torch.tensor([[1, 2], [3, 4]])._neg_view().t(),  # strided, not contiguous
    }


def test_view_bits_count_where_torch_load_applies_them(save: Save) -> None:
    bits = with_bits()
    # The same bytes without the bit: other values.
    plain = {
        "c": torch.tensor([1 + 2j, 3 - 4j]),
        "n": torch.tensor([1.0, -2.0, 0.0]),
        "i": torch.tensor([[1, 2], [3, 4]]).t(),
    }
    a_path, b_path = save(bits, "a.pt"), save(plain, "b.pt")
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    for report in (diff(a_path, b_path), diff(a, b)):
        assert not report.identical and report.found() == {"value"}
        for key in bits:
            pair = report.tensor(key)
            assert pair.bit_equal is torch.equal(a[key], b[key]) is False, key
            want = (a[key].resolve_conj().resolve_neg() - b[key]).abs().max().item()
            assert pair.status == "differ" and pair.max_abs == pytest.approx(want), key


def test_a_view_bit_equals_the_values_it_shows(save: Save) -> None:
    """A tensor with its bit and the materialized values: equal, as torch.equal says."""
    bits = with_bits()
    shown = {k: v.resolve_conj().resolve_neg() for k, v in bits.items()}
    a_path, b_path = save(bits, "a.pt"), save(shown, "b.pt")
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    assert a["c"].is_conj() and a["n"].is_neg() and all(torch.equal(a[k], b[k]) for k in a)
    for report in (diff(a_path, b_path), diff(a, b), diff(a_path, a_path)):
        assert report.identical and all(t.max_abs == 0 for t in report)
    assert compare_tensors(bits["n"], shown["n"]).bit_equal


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's jagged layout is a prototype
def test_jagged_values_with_a_negative_bit(save: Save) -> None:
    """A jagged tensor keeps its values' bit in the file; its components are compared as
    torch.load's show them."""
    values, offsets = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 3])
    neg = torch.nested.nested_tensor_from_jagged(values._neg_view(), offsets)
    sides = {
        "plain": torch.nested.nested_tensor_from_jagged(values, offsets),
        "shown": torch.nested.nested_tensor_from_jagged(-values, offsets),
    }
    a_path = save({"j": neg}, "a.pt")
    a = torch.load(a_path, weights_only=True)["j"]
    assert a.values().is_neg()
    for name, other in sides.items():
        b_path = save({"j": other}, f"{name}.pt")
        b = torch.load(b_path, weights_only=True)["j"]
        same = all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
        assert same is (name == "shown")
        assert diff(a_path, b_path).tensor("j").bit_equal is same, name
        assert diff({"j": a}, {"j": b}).tensor("j").bit_equal is same, name

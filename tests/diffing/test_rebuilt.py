"""diff() on sparse (COO, CSR, CSC, BSR, BSC), meta and nested tensors: compared, never skipped,
and called equal only where torch finds them equal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.diffing.engine import diff
from ckpt_tools.errors import CorruptCheckpointError

Make = Callable[[torch.Tensor], torch.Tensor]

#: Each layout, made from a dense 4x4 tensor (nested: its rows split 1 + 3).
LAYOUTS: dict[str, Make] = {
    "sparse_coo": lambda d: d.to_sparse(),
    "sparse_csr": lambda d: d.to_sparse_csr(),
    "sparse_csc": lambda d: d.to_sparse_csc(),
    "sparse_bsr": lambda d: d.to_sparse_bsr((2, 2)),
    "sparse_bsc": lambda d: d.to_sparse_bsc((2, 2)),
    "nested": lambda d: torch.nested.nested_tensor([d[:1], d[1:]]),
}


def dense(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    d = torch.randn(4, 4)
    d[d.abs() < 0.5] = 0.0
    return d


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The oracle: torch's equality of the two tensors' values."""
    if a.is_nested:
        pairs = list(zip(a.unbind(), b.unbind()))
        return len(a.unbind()) == len(b.unbind()) and all(torch.equal(x, y) for x, y in pairs)
    return torch.equal(a.to_dense(), b.to_dense())


@pytest.fixture
def save(tmp_path: Path) -> Callable[[dict[str, Any], str], str]:
    def _save(sd: dict[str, Any], name: str) -> str:
        torch.save(sd, tmp_path / name)
        return str(tmp_path / name)

    return _save


def test_sparse_and_nested_tensors_that_differ_are_not_identical(save: Any) -> None:
    shared = torch.arange(2.0)
    a = {"dense": shared, "coo": dense(0).to_sparse(), "nested": LAYOUTS["nested"](dense(0))}
    b = {"dense": shared, "coo": dense(1).to_sparse(), "nested": LAYOUTS["nested"](dense(1))}
    assert not torch_equal(a["coo"], b["coo"]) and not torch_equal(a["nested"], b["nested"])
    report = diff(save(a, "a.pt"), save(b, "b.pt"))
    assert not report.identical and report.found() == {"value"}
    assert report.a.tensors == report.b.tensors == 3 and report.a.skipped == ()
    text = report.text()
    assert "identical" not in text and "non-tensor" not in text
    assert "compared 3 common tensors: 1 equal, 2 differ" in text
    out = json.loads(json.dumps(report.to_json()))
    assert out["identical"] is False and out["found"] == ["value"]
    assert out["tensors"][1]["layout"] == ["sparse_coo", "sparse_coo"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_equal_close_and_differing_as_torch_says(layout: str, save: Any) -> None:
    make = LAYOUTS[layout]
    a = make(dense())
    same = save({"t": make(dense())}, "same.pt")
    assert torch_equal(a, make(dense()))
    report = diff(save({"t": a}, "a.pt"), same)
    assert report.identical and report.tensor("t").status == "equal", report.text()
    assert report.tensor("t").layout_a == layout

    nudged = dense().clone()
    nudged[nudged != 0] += 1e-6
    assert not torch_equal(a, make(nudged))
    row = diff(save({"t": a}, "a.pt"), save({"t": make(nudged)}, "b.pt")).tensor("t")
    assert row.status == "close" and row.max_abs == pytest.approx(1e-6, rel=0.1)

    off = dense().clone()
    off[off != 0] += 1.0
    row = diff({"t": a}, save({"t": make(off)}, "c.pt"), atol=0.5).tensor("t")
    assert row.status == "differ" and row.bit_equal is False
    assert row.max_abs == pytest.approx(1.0)


def test_uncoalesced_coo_in_another_order_is_equal_as_torch_says(save: Any) -> None:
    indices = torch.tensor([[0, 1, 0], [1, 0, 1]])
    a = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]), (2, 2))
    b = torch.sparse_coo_tensor(indices[:, [1, 2, 0]], torch.tensor([2.0, 3.0, 1.0]), (2, 2))
    assert not a.is_coalesced() and torch_equal(a, b)
    assert diff(save({"s": a}, "a.pt"), save({"s": b}, "b.pt")).identical
    assert diff({"s": a}, {"s": b}).identical  # state dicts too


def test_other_stored_elements_differ_with_a_note_never_equal(save: Any) -> None:
    stored_zero = torch.sparse_coo_tensor([[0, 1]], [0.0, 2.0], (2,))
    without = torch.sparse_coo_tensor([[1]], [2.0], (2,))
    other = torch.sparse_coo_tensor([[0]], [2.0], (2,))
    assert torch_equal(stored_zero, without) and not torch_equal(without, other)
    for b in (stored_zero, other):
        report = diff(save({"s": without}, "a.pt"), save({"s": b}, "b.pt"))
        row = report.tensor("s")
        assert not report.identical and row.status == "differ" and "indices differ" in row.note
        assert f"s: {row.note}" in report.text()


def test_meta_tensors_are_equal_by_dtype_shape_and_strides(save: Any) -> None:
    meta = torch.empty(3, 4, device="meta")
    transposed = torch.empty(4, 3, device="meta").t()
    assert meta.shape == transposed.shape and meta.stride() != transposed.stride()
    a = save({"m": meta}, "a.pt")
    for values in (True, False):  # no values to read either way
        assert diff(
            a, save({"m": torch.empty(3, 4, device="meta")}, "b.pt"), values=values
        ).identical
    row = diff(a, save({"m": transposed}, "t.pt")).tensor("m")
    assert (
        row.status == "differ"
        and row.note == f"strides differ: {meta.stride()} / {transposed.stride()}"
    )
    real = diff(a, save({"m": torch.zeros(3, 4)}, "real.pt"))
    assert real.found() == {"layout"} and real.tensor("m").status == "layout"
    assert real.tensor("m").note == "layouts differ: meta / strided"


@pytest.mark.parametrize("values", [True, False])
def test_a_sparse_tensor_against_a_dense_one_is_a_layout_mismatch(values: bool, save: Any) -> None:
    report = diff(
        save({"w": dense().to_sparse()}, "a.pt"), save({"w": dense()}, "b.pt"), values=values
    )
    assert report.found() == {"layout"} and not report.identical
    assert report.tensor("w").status == "layout"
    assert "layouts differ: sparse_coo / strided" in report.text()


def test_a_file_against_a_state_dict_and_a_module(save: Any) -> None:
    sd = {k: make(dense()) for k, make in LAYOUTS.items()}
    assert diff(save(sd, "a.pt"), sd).identical
    model = torch.nn.Linear(2, 2, device="meta")
    assert diff(save(model.state_dict(), "m.pt"), model).identical


def test_a_sparse_tensor_torch_refuses_is_refused(save: Any) -> None:
    bad = torch.sparse_coo_tensor([[0, 7]], [1.0, 2.0], (2,), check_invariants=False)
    path = save({"s": bad}, "bad.pt")
    # torch.load checks a sparse tensor only when asked; diff always does (it operates on it).
    with torch.sparse.check_sparse_tensor_invariants(), pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=r"entry 's'.*sparse_coo"):
        diff(path, save({"s": torch.sparse_coo_tensor([[0]], [1.0], (2,))}, "ok.pt"))


def _jagged(d: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(d, torch.tensor([0, 1, 4]), lengths)


@pytest.mark.parametrize("lengths", [None, torch.tensor([1, 2])], ids=["offsets", "lengths"])
def test_jagged_tensors_equal_close_and_differing_as_torch_says(
    lengths: torch.Tensor | None, save: Any
) -> None:
    a = save({"t": _jagged(dense(), lengths)}, "a.pt")
    report = diff(a, save({"t": _jagged(dense(), lengths)}, "same.pt"))
    assert report.identical and report.tensor("t").layout_a == "jagged", report.text()
    off = dense().clone()
    off[3] += 1.0  # the last row: outside the second component where lengths cut it short
    row = diff(a, save({"t": _jagged(off, lengths)}, "b.pt")).tensor("t")
    equal = torch_equal(_jagged(dense(), lengths), _jagged(off, lengths))
    assert row.status == ("equal" if equal else "differ") and row.bit_equal is equal


def test_a_nested_tensor_past_its_buffer_is_refused_as_the_loader_refuses_it(
    tmp_path: Path, save: Any
) -> None:
    from ckpt_tools.formats import open_checkpoint
    from tests.helpers.committed import tools

    src = save({"nt": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])}, "a.pt")
    offsets = open_checkpoint(src).root["nt"].args[3].storage.key
    bad = tmp_path / "bad.pt"
    tools().rewrite_zip(
        src, bad, replace={f"data/{offsets}": torch.tensor([0, 7]).numpy().tobytes()}
    )
    with pytest.raises(CorruptCheckpointError, match="past the end of its 9-element buffer"):
        diff(src, str(bad))

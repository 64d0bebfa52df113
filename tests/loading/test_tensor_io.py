"""Tensors read piece by piece: every view walked in row-major order, as torch orders it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.loading.tensor_io import TensorReader, flat_pieces

VIEWS: dict[str, Callable[[], torch.Tensor]] = {
    "contiguous": lambda: torch.arange(24.0).reshape(2, 3, 4),
    "transposed": lambda: torch.arange(24.0).reshape(4, 6).t(),
    "expanded": lambda: torch.arange(5.0).expand(7, 5),
    "expanded inner": lambda: torch.arange(3.0).reshape(3, 1).expand(3, 9),
    "strided": lambda: torch.arange(60.0).reshape(6, 10)[::2, 1::3],
    "permuted 3-d": lambda: torch.arange(60.0).reshape(3, 4, 5).permute(2, 0, 1),
    "0-dim": lambda: torch.tensor(3.5),
    "empty": lambda: torch.zeros(0, 4).t(),
}


@pytest.mark.parametrize("step", [1, 2, 5, 7, 64])
@pytest.mark.parametrize("view", list(VIEWS))
def test_pieces_are_the_view_in_order_step_elements_each(view: str, step: int) -> None:
    t = VIEWS[view]()
    pieces = list(flat_pieces(t, step))
    assert all(p.numel() == step for p in pieces[:-1]) and all(p.dim() == 1 for p in pieces)
    # Each piece holds its own elements only (a view of the tensor's storage, or a copy of
    # under two steps of them), never the view made whole: an expanded one stands for more
    # elements than its storage holds.
    own, bound = t.untyped_storage().data_ptr(), 2 * step * t.element_size()
    for p in pieces:
        assert p.untyped_storage().data_ptr() == own or p.untyped_storage().nbytes() <= bound
    assert not pieces or 0 < pieces[-1].numel() <= step
    got = torch.cat(pieces) if pieces else torch.zeros(0)
    assert torch.equal(got, t.reshape(-1))


@pytest.mark.parametrize("view", ["transposed", "expanded", "strided", "permuted 3-d"])
def test_a_saved_view_reads_in_pieces_as_torch_load_gives_it(view: str, tmp_path: Path) -> None:
    torch.save({"w": VIEWS[view]()}, tmp_path / "v.pt")
    want = torch.load(tmp_path / "v.pt", weights_only=True)["w"].reshape(-1)
    ckpt = open_checkpoint(tmp_path / "v.pt")
    with TensorReader(ckpt) as reader:
        got = torch.cat(list(reader.chunks(ckpt.root["w"], chunk_bytes=12)))
    assert torch.equal(got, want)


def test_diff_of_expanded_views_counts_as_torch_compares(tmp_path: Path) -> None:
    # 2000 x 3000 elements on 3000 stored: walked in pieces, never made whole.
    row = torch.arange(3000.0)
    other = row.clone()
    other[7] = -1.0
    torch.save({"w": row.expand(2000, 3000)}, tmp_path / "a.pt")
    torch.save({"w": other.expand(2000, 3000)}, tmp_path / "b.pt")
    (pair,) = ct.diff(tmp_path / "a.pt", tmp_path / "b.pt").tensors
    a, b = row.expand(2000, 3000), other.expand(2000, 3000)
    assert pair.mismatched == int((~torch.isclose(a, b)).sum()) == 2000
    assert pair.max_abs == float((a - b).abs().max())

"""``inspect`` lists sparse, meta and nested tensors as tensors, as torch.load builds them."""

from __future__ import annotations

from pathlib import Path

import torch

import ckpt_tools
from tests.helpers.builders import rebuilt_tensors
from tests.helpers.cli import run_ckpt


def _layout(t: torch.Tensor) -> str:
    return "nested" if t.is_nested else str(t.layout).removeprefix("torch.")


def test_inspect_lists_them_as_torch_loads_them(tmp_path: Path) -> None:
    path = tmp_path / "rebuilt.pt"
    torch.save(rebuilt_tensors(), path)
    want = torch.load(path, weights_only=True)
    info = ckpt_tools.inspect(path)
    assert info.selected == () and info.entries == {}
    assert [t.name for t in info] == list(want)
    for t in info:
        loaded = want[t.name]
        assert (t.dtype, t.layout, t.device) == (
            str(loaded.dtype).removeprefix("torch."),
            _layout(loaded),
            str(loaded.device),
        ), t.name
        if loaded.is_nested:  # its components' sizes vary: their count, then -1 each
            assert t.shape == (loaded.size(0),) + (-1,) * (loaded.dim() - 1)
        else:
            assert t.shape == tuple(loaded.shape) and t.numel == loaded.numel(), t.name
        if loaded.layout == torch.strided and not loaded.is_nested:
            assert t.stride == loaded.stride(), t.name
    assert info.tensor("meta").nbytes == 0  # no bytes in the file
    values = want["coo"].coalesce()
    assert info.tensor("coo").nbytes == values.indices().nbytes + values.values().nbytes


def test_json_and_table_show_the_layout(tmp_path: Path) -> None:
    path = tmp_path / "rebuilt.pt"
    torch.save(rebuilt_tensors(), path)
    shown = {t["name"]: t for t in ckpt_tools.inspect(path).to_json()["tensors"]}
    assert shown["dense"]["layout"] == "strided" and shown["coo"]["layout"] == "sparse_coo"
    assert shown["csr"]["stride"] == [] and shown["meta"]["device"] == "meta"
    _, out, _ = run_ckpt("inspect", path)
    assert "float32 (sparse_csr)" in out and "float32 (nested)" in out

"""``inspect`` lists sparse, meta and nested tensors as tensors, as torch.load builds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


def _described(t: torch.Tensor) -> tuple[str, str, str, list[int]]:
    """dtype, layout, device and shape, as torch.load's tensor gives them."""
    shape = [t.size(0)] + [-1] * (t.dim() - 1) if t.is_nested else list(t.shape)
    return str(t.dtype).removeprefix("torch."), _layout(t), str(t.device), shape


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_or_tuple_root_lists_them_by_index(tmp_path: Path, container: type) -> None:
    path = tmp_path / "rebuilt.pt"
    torch.save(container(rebuilt_tensors().values()), path)
    want = torch.load(path, weights_only=True)
    assert isinstance(want, container)
    expected = {str(i): _described(t) for i, t in enumerate(want)}
    _, out, _ = run_ckpt("inspect", "--json", path)
    shown = json.loads(out)["tensors"]
    got = {t["name"]: (t["dtype"], t["layout"], t["device"], t["shape"]) for t in shown}
    assert got == expected
    assert [t.name for t in ckpt_tools.inspect(path)] == list(expected)
    _, table, _ = run_ckpt("inspect", path)
    assert "float32 (sparse_coo)" in table and "float32 (nested)" in table


def test_a_sparse_root_is_listed(tmp_path: Path) -> None:
    path = tmp_path / "sparse.pt"
    torch.save(torch.eye(3).to_sparse(), path)
    want = torch.load(path, weights_only=True)
    (t,) = ckpt_tools.inspect(path)
    assert (t.name, t.dtype, t.layout, list(t.shape)) == ("<root>", *_described(want)[:2], [3, 3])

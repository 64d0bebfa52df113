"""slim, extract and average on sparse, nested and meta tensors, checked with torch.load."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError, NonTensorEntriesError
from ckpt_tools.formats import open_checkpoint
from tests.helpers.builders import rebuilt_tensors


def _save(path: Path, **extra: Any) -> Path:
    tensors = rebuilt_tensors()
    tensors["coo_unc"] = torch.sparse_coo_tensor(
        torch.tensor([[1, 0, 1], [2, 2, 0]]), torch.tensor([1.5, -2.0, 3.25]), (2, 3)
    )
    tensors.update(extra)
    torch.save(tensors, path)
    return path


def _load(path: Path) -> dict[str, Any]:
    with warnings.catch_warnings():  # torch's "sparse CSR is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(path, weights_only=True)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal as torch holds them: layout, dtype, device, and every part's elements."""
    if (got.layout, got.dtype, got.device, got.is_nested) != (
        want.layout,
        want.dtype,
        want.device,
        want.is_nested,
    ):
        return False
    if want.device.type == "meta":
        return (got.shape, got.stride()) == (want.shape, want.stride())
    if want.is_nested:
        parts = ("values", "_nested_tensor_size", "_nested_tensor_strides")
        parts += ("_nested_tensor_storage_offsets",)
    elif want.layout == torch.sparse_coo:
        if got.is_coalesced() != want.is_coalesced():
            return False
        parts = ("_indices", "_values")
    elif want.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = ("ccol_indices", "row_indices", "values")
    elif want.layout != torch.strided:
        parts = ("crow_indices", "col_indices", "values")
    else:
        return torch.equal(got, want)
    same_shape = want.is_nested or got.shape == want.shape  # a nested tensor has none
    return same_shape and all(torch.equal(getattr(got, p)(), getattr(want, p)()) for p in parts)


def test_slim_copies_sparse_nested_and_meta_tensors(tmp_path: Path) -> None:
    src = _save(tmp_path / "in.pt")
    result = ct.slim(src, tmp_path / "out.pt", verify="full")
    got, want = _load(tmp_path / "out.pt"), _load(src)
    assert list(got) == list(want)
    assert all(_same(got[k], want[k]) for k in want)
    # Every part's storage is written: the output holds the input's storage bytes.
    assert result.bytes_written == sum(s.nbytes for s in open_checkpoint(src).storages.values())
    assert result.verification.startswith("verified")


@pytest.mark.parametrize(("flag", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_slim_cast_equals_torch_to(tmp_path: Path, flag: str, dtype: torch.dtype) -> None:
    meta_t = torch.empty(3, 2, device="meta").t()  # not contiguous: left uncast, with a note
    src = _save(tmp_path / "in.pt", meta32=torch.empty(2, 5, device="meta"), meta_t=meta_t)
    result = ct.slim(src, tmp_path / "out.pt", dtype=flag, verify="full")
    got, want = _load(tmp_path / "out.pt"), _load(src)
    for key, t in want.items():
        cast = key != "meta_t" and t.dtype in (torch.float32, torch.float16)
        assert _same(got[key], t.to(dtype) if cast else t), key
    assert got["coo"]._indices().dtype == torch.int64
    assert any("meta tensor 'meta_t' kept as float32" in n for n in result.notes)


def test_slim_keep_dtype_keeps_a_sparse_tensor(tmp_path: Path) -> None:
    src = _save(tmp_path / "in.pt")
    ct.slim(src, tmp_path / "out.pt", dtype="fp16", keep_dtype=["^csr$", "nested"])
    got, want = _load(tmp_path / "out.pt"), _load(src)
    assert _same(got["csr"], want["csr"]) and _same(got["nested"], want["nested"])
    assert _same(got["csc"], want["csc"].to(torch.float16))


@pytest.mark.parametrize("prefix", ["coo", "nested", "meta", "bsr"])
def test_extract_writes_the_selected_rebuilt_tensors(tmp_path: Path, prefix: str) -> None:
    src = _save(tmp_path / "in.pt")
    result = ct.extract(src, tmp_path / "out.pt", prefix=prefix, verify="full")
    got, want = _load(tmp_path / "out.pt"), _load(src)
    assert list(got) == [k for k in want if k == prefix or k.startswith(f"{prefix}.")]
    assert all(_same(got[k], want[k]) for k in got)
    assert result.tensors == len(got)


@pytest.mark.parametrize("command", ["slim", "extract"])
def test_safetensors_output_names_the_tensors_it_cannot_hold(tmp_path: Path, command: str) -> None:
    src = _save(tmp_path / "in.pt")
    run = ct.slim if command == "slim" else ct.extract
    options = {} if command == "slim" else {"prefix": "csr"}
    with pytest.raises(NonTensorEntriesError) as caught:
        run(src, tmp_path / "out.safetensors", **options)
    message = str(caught.value)
    assert "non-tensor" not in message
    assert "csr (sparse_csr layout)" in message
    assert ("coo (sparse_coo layout)" in message) == (command == "slim")
    assert "drop_extras=True" in message and "torch format" in message


def test_safetensors_output_drop_extras_leaves_them_out(tmp_path: Path) -> None:
    src = _save(tmp_path / "in.pt")
    result = ct.slim(src, tmp_path / "out.safetensors", drop_extras=True)
    assert set(result.dropped) == {"coo", "csr", "csc", "bsr", "meta", "nested", "coo_unc"}


def test_average_copies_rebuilt_tensors_equal_in_every_input(tmp_path: Path) -> None:
    a = _save(tmp_path / "a.pt")
    b = _save(tmp_path / "b.pt")
    ct.average([a, b], tmp_path / "avg.pt")
    got, want = _load(tmp_path / "avg.pt"), _load(a)
    assert all(_same(got[k], want[k]) for k in want)


@pytest.mark.parametrize("key", ["coo_unc", "meta"])
def test_average_refuses_rebuilt_tensors_that_differ(tmp_path: Path, key: str) -> None:
    a = _save(tmp_path / "a.pt")
    other = {
        "coo_unc": torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([9.0]), (2, 3)),
        # The same shape and dtype, other strides: a meta tensor's only content.
        "meta": torch.empty_strided((2, 3), (1, 2), dtype=torch.float16, device="meta"),
    }[key]
    b = _save(tmp_path / "b.pt", **{key: other})
    with pytest.raises(ConversionError, match=rf"not averaged.*{key}"):
        ct.average([a, b], tmp_path / "avg.pt")
    assert not (tmp_path / "avg.pt").exists()

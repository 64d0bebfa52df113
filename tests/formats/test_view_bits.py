"""Conjugate and negative views: torch.save writes the bytes plus a bit that torch.load applies.

Reads keep the bit (torch is the oracle for every value), torch outputs carry it, and any
output that would take the bytes as values (safetensors, a cast, a mean) is refused instead
of silently changing them. The rebuild's ``metadata`` argument is read as torch reads it, or
refused as torch refuses it (a dtype there, say).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError, CorruptCheckpointError
from tests import helpers as h


def _views() -> dict[str, torch.Tensor]:
    return {
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "neg": torch.tensor([1.0, -2.5])._neg_view(),
        "both": torch.tensor([1 + 1j])._neg_view().conj(),
        "plain": torch.tensor([7.0]),
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:  # values as torch materialises them, and the bits themselves
        assert torch.equal(a[k].resolve_conj().resolve_neg(), b[k].resolve_conj().resolve_neg())
        assert (a[k].is_conj(), a[k].is_neg()) == (b[k].is_conj(), b[k].is_neg())


@pytest.fixture
def views(tmp_path: Path) -> Path:
    return h.save(_views(), tmp_path / "views.pt")


def test_loading_keeps_the_bits_as_torch_does(views: Path) -> None:
    _same(ct.load_state_dict(views, map_location="cpu"), torch.load(views, weights_only=True))


@pytest.mark.parametrize(
    "run",
    [
        lambda src, out: ct.strip_module(src, out / "o.pt"),
        lambda src, out: ct.convert(src, out / "o.pt"),
        lambda src, out: ct.slim(src, out / "o.pt"),
        lambda src, out: ct.sanitize(src, out / "o.pt"),
    ],
    ids=["strip-module", "convert-pt", "slim", "sanitize"],
)
def test_torch_outputs_carry_the_bits(tmp_path: Path, run: Any) -> None:
    src = h.save({f"module.{k}": v for k, v in _views().items()}, tmp_path / "wrapped.pt")
    out = tmp_path / "out"
    out.mkdir()
    run(src, out)
    got = {k.removeprefix("module."): v for k, v in torch.load(out / "o.pt").items()}
    _same(got, _views())


@pytest.mark.parametrize(
    ("args", "doing"),
    [
        (["convert", "{src}", "{out}/o.safetensors"], "a safetensors file"),
        (["convert", "{src}", "{out}/hf/"], "a safetensors file"),
        (["slim", "{src}", "{out}/o.pt", "--dtype", "bf16"], "a cast to bfloat16"),
        (["average", "{src}", "{src2}", "{out}/o.pt"], "a mean"),
    ],
    ids=["safetensors", "hf-folder", "cast", "average"],
)
def test_outputs_that_would_drop_a_bit_are_refused(
    tmp_path: Path, args: list[str], doing: str
) -> None:
    # Real-valued views only where the command needs them (bf16 casts and means of floats).
    tensors = {"neg": _views()["neg"], "plain": torch.ones(2)}
    src = h.save(tensors, tmp_path / "in.pt")
    src2 = h.save(tensors, tmp_path / "in2.pt")
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.format(src=src, src2=src2, out=out) for a in args]
    code, _, err = h.run_ckpt(*argv, code=None)
    assert code == 7, err
    assert "'neg' is saved as a negative view" in err and doing in err and "resolve_neg()" in err
    assert h.listing(out) == []


def test_a_safetensors_refusal_names_the_conjugate_bit(views: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"tensor 'conj' is saved as a conjugate view"):
        ct.convert(views, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


# --- the metadata argument, with torch as the oracle --------------------------------------------


class _Rebuild:
    """Pickles as ``_rebuild_tensor_v2(storage, 0, size, stride, False, hooks, metadata)``."""

    def __init__(self, tensor: torch.Tensor, metadata: Any) -> None:
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        storage = tensor._typed_storage()
        self.args = (storage, 0, tuple(tensor.size()), tensor.stride(), False, hooks, metadata)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        return torch._utils._rebuild_tensor_v2, self.args


def _torch_reads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except (AssertionError, RuntimeError, TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize(
    ("dtype", "metadata", "torch_reads"),
    [
        (torch.float32, None, True),
        (torch.float32, {}, True),
        (torch.float32, {"neg": True}, True),  # what torch.save writes
        (torch.complex64, {"conj": True}, True),
        (torch.complex64, {"conj": True, "neg": True}, True),
        (torch.float32, torch.float16, False),  # the fuzzer's find: a dtype
        (torch.float32, [("neg", True)], False),
        (torch.float32, {"conj": True}, False),  # a real tensor has no conjugate bit
    ],
)
def test_metadata_is_read_as_torch_reads_it(
    tmp_path: Path, dtype: torch.dtype, metadata: Any, torch_reads: bool
) -> None:
    path = tmp_path / "meta.pt"
    torch.save({"w": _Rebuild(torch.ones(2, dtype=dtype), metadata)}, path)
    assert _torch_reads(path) is torch_reads
    if torch_reads:
        _same(ct.load_state_dict(path, map_location="cpu"), torch.load(path, weights_only=True))
        return
    with pytest.raises(CorruptCheckpointError, match=r"torch\.load fails on it too"):
        ct.inspect(str(path))


@pytest.mark.parametrize("metadata", [{"neg": False}, {"neg": 1}, {"bogus": True}])
def test_metadata_torch_save_never_writes_is_refused(tmp_path: Path, metadata: Any) -> None:
    # torch sets a bit for a key whatever its value ({"neg": False} makes a negative view)
    # and ignores unknown keys; rather than copy that, such files are refused, named.
    path = tmp_path / "odd.pt"
    torch.save({"w": _Rebuild(torch.ones(2), metadata)}, path)
    assert _torch_reads(path)
    with pytest.raises(CorruptCheckpointError, match=r"only the view bits torch\.save writes"):
        ct.inspect(str(path))

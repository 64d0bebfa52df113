"""``consolidate`` on DCP folders with values DCP saves whole, damaged chunks and dtypes no
output can hold, against torch's ``dcp_to_torch_save`` (and ``safetensors``' own loader).

The folders are saved by ``torch.distributed.checkpoint.save`` in this process; damage is
done to a saved folder's bytes, as a disk or a copy would.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from ckpt_tools import consolidate
from ckpt_tools.errors import (
    ConversionError,
    CorruptCheckpointError,
    UnsupportedFormatError,
    UsageError,
    VerificationError,
)
from ckpt_tools.ops.consolidate.write import _check
from tests.formats.dcp.test_dcp import save_dcp
from tests.helpers.cli import run_ckpt
from tests.helpers.dcp_save import reference
from tests.helpers.trees import assert_values_bitwise


def assert_same_tree(want: Any, got: Any, where: str = "") -> None:
    """Equal trees, tuples included: same containers, tensors equal bit for bit, views and
    shared storages as in ``want``."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.stride() == want.stride(), where
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes(), where
        assert_values_bitwise(want, got, where)
    elif isinstance(want, (dict, list, tuple)):
        assert type(got) is type(want), where
        keys = list(want) if isinstance(want, dict) else range(len(want))
        assert (list(got) if isinstance(got, dict) else len(got)) == (
            keys if isinstance(want, dict) else len(want)
        ), where
        for k in keys:
            assert_same_tree(want[k], got[k], f"{where}.{k}")
    else:
        assert got == want, where


def test_tensors_inside_tuples_are_their_own(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    state = {
        "model": {"w": torch.zeros(3)},
        "extra": (torch.tensor([5.0, 6.0, 7.0]), 1),
        "views": (base.view(3, 4).t(), base[2:5], torch.ones(2)),  # shared, strided
    }
    folder = save_dcp(tmp_path / "ckpt", state)
    want = reference(folder, tmp_path / "theirs.pt")
    consolidate(folder, tmp_path / "ours.pt", include_all=True, verify="full")
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert_same_tree(want, got)
    # the two views still share one storage, as torch.load gives them
    assert got["views"][0].data_ptr() == got["views"][1].data_ptr() - 2 * 4


def test_only_tuple_tensors_and_their_safetensors_names(tmp_path: Path) -> None:
    state = {"extra": (torch.tensor([5.0, 6.0]),), "model": {"sel": (torch.ones(3), 2)}}
    folder = save_dcp(tmp_path / "ckpt", state)
    want = reference(folder, tmp_path / "theirs.pt")
    consolidate(folder, tmp_path / "ours.pt", include_all=True)
    assert_same_tree(want, torch.load(tmp_path / "ours.pt", weights_only=True))
    consolidate(folder, tmp_path / "m.safetensors", include_all=True, drop_extras=True)
    got = load_file(tmp_path / "m.safetensors")
    assert list(got) == ["extra.0", "model.sel.0"]
    assert_values_bitwise(want["model"]["sel"][0], got["model.sel.0"])


def test_a_strided_value_is_refused_for_safetensors(tmp_path: Path) -> None:
    folder = save_dcp(tmp_path / "ckpt", {"model": {"t": (torch.arange(6.0).view(2, 3).t(),)}})
    with pytest.raises(ConversionError, match=r"'model.t.0' is a strided view .* \.pt"):
        consolidate(folder, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


_NEG = torch.tensor([1.0, 2.0])._neg_view()
_CONJ = torch.tensor([1 + 2j, 3 - 4j]).conj()


@pytest.mark.parametrize(
    ("saved", "at", "key", "dst"),
    [
        ({"model": {"w": _NEG}}, ("model", "w"), "w", "m.pt"),
        ({"model": {"c": _CONJ}}, ("model", "c"), "c", "m.pt"),
        ({"model": {"w": _NEG}}, ("model", "w"), "model.w", "m.safetensors"),
        ({"model": {}, "extra": (_NEG,)}, ("extra", 0), "extra.0", "m.safetensors"),
    ],
)
def test_a_chunk_saved_as_a_negative_or_conjugate_view_is_refused(
    tmp_path: Path, saved: dict[str, Any], at: tuple[Any, ...], key: str, dst: str
) -> None:
    # A chunk's bytes are the view's storage: torch.load negates (conjugates) them, as
    # dcp_to_torch_save does; copied as they are, every value would change sign.
    folder = save_dcp(tmp_path / "ckpt", saved)
    want, view = reference(folder, tmp_path / "ref.pt"), saved
    for part in at:
        want, view = want[part], view[part]
    assert torch.equal(want, view.resolve_neg().resolve_conj())
    options = {"include_all": True} if dst.endswith(".safetensors") else {}
    with pytest.raises(ConversionError, match=f"tensor '{key}' is saved as a .* view"):
        consolidate(folder, tmp_path / dst, **options)
    assert not (tmp_path / dst).exists()


def _flip(folder: Path, value: float) -> None:
    """One bit of ``value``'s bytes flipped in the folder's shard."""
    path = folder / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    at = data.find(torch.tensor([value]).numpy().tobytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("verify", ["none", "sizes", "full"])
def test_a_flipped_bit_reads_as_torch_reads_it_with_right_crcs(tmp_path: Path, verify: str) -> None:
    state = {"model": {"w": torch.arange(64.0), "t": torch.arange(12.0).view(3, 4).t()}}
    folder = save_dcp(tmp_path / "ckpt", state)
    _flip(folder, 33.0)
    want = reference(folder, tmp_path / "theirs.pt")  # torch reads the changed value
    consolidate(folder, tmp_path / "ours.pt", verify=verify)  # type: ignore[arg-type]
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert_values_bitwise(want["model"]["w"], got["w"])
    with zipfile.ZipFile(tmp_path / "ours.pt") as z:
        assert z.testzip() is None  # every record's CRC-32 is that of its bytes


def test_a_verification_failure_says_the_output_was_not_kept_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    data = bytearray(path.read_bytes())
    data[data.find(torch.tensor([2.0]).numpy().tobytes())] ^= 1  # its CRC-32 is now wrong
    path.write_bytes(bytes(data))
    with pytest.raises(VerificationError) as caught:
        _check([], [], "sizes", {}, {})(str(path))
    assert str(caught.value).count("the output was not kept") == 1, str(caught.value)


def test_complex128_is_refused_for_safetensors_as_safetensors_does(tmp_path: Path) -> None:
    z = torch.randn(2, dtype=torch.complex128)
    with pytest.raises((TypeError, ValueError, KeyError)):
        from safetensors.torch import save_file

        save_file({"z": z}, tmp_path / "theirs.safetensors")
    folder = save_dcp(tmp_path / "ckpt", {"model": {"z": z}})
    code, _, err = run_ckpt("consolidate", folder, tmp_path / "m.safetensors", code=None)
    assert code == ConversionError.exit_code and "z (complex128)" in err, err
    assert not (tmp_path / "m.safetensors").exists()
    consolidate(folder, tmp_path / "m.pt")  # a .pt holds it
    assert_values_bitwise(z, torch.load(tmp_path / "m.pt", weights_only=True)["z"])


def test_a_quantized_tensor_is_refused(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    folder = save_dcp(tmp_path / "ckpt", {"model": {"q": q}})
    with pytest.raises(CheckpointException, match="UnknownQuantizer"):  # the oracle fails too
        reference(folder, tmp_path / "theirs.pt")
    code, _, err = run_ckpt("consolidate", folder, tmp_path / "m.pt", code=None)
    assert code == UnsupportedFormatError.exit_code, err
    assert "'model.q' is a qint8 (quantized) tensor, whose scale and zero point" in err, err
    assert not (tmp_path / "m.pt").exists()


def test_a_truncated_shard_is_named(tmp_path: Path) -> None:
    folder = save_dcp(tmp_path / "ckpt", {"model": {"w": torch.arange(64.0)}})
    shard = folder / "__0_0.distcp"
    os.truncate(shard, 500)
    with pytest.raises(CorruptCheckpointError) as caught:
        consolidate(folder, tmp_path / "m.pt")
    assert f"{str(shard)!r} is truncated: it holds 500 bytes" in str(caught.value)


def test_missing_shards_are_named(tmp_path: Path) -> None:
    folder = save_dcp(tmp_path / "ckpt", {"model": {"w": torch.arange(8.0)}})
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointException, match=r"__0_0\.distcp"):  # the oracle names it
        reference(folder, tmp_path / "theirs.pt")
    with pytest.raises(CorruptCheckpointError, match=r"'__0_0\.distcp', which is missing"):
        consolidate(folder, tmp_path / "m.pt")


def test_one_shard_as_the_source_says_to_give_its_folder(tmp_path: Path) -> None:
    folder = save_dcp(tmp_path / "ckpt", {"model": {"w": torch.arange(8.0)}})
    with pytest.raises(UsageError) as caught:
        consolidate(folder / "__0_0.distcp", tmp_path / "m.pt")
    said = str(caught.value)
    assert "is one shard of a torch.distributed.checkpoint folder" in said
    assert f"give the folder, {str(folder)!r}" in said

"""Jagged nested tensors (``nested_tensor_from_jagged``) load as torch.load(weights_only=True)
loads them, and offsets that would make torch read past their values are refused."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_tools as ct
from ckpt_tools import load_into, load_state_dict, load_with_info
from ckpt_tools.errors import CorruptCheckpointError, StateDictMismatchError
from ckpt_tools.formats import open_checkpoint
from tests.formats.pickle.test_jagged import torch_outcomes
from tests.helpers.committed import tools


def _values() -> torch.Tensor:
    return torch.arange(16.0).reshape(8, 2)


def _njt(offsets: list[int], lengths: list[int] | None = None, **kw: Any) -> torch.Tensor:
    given = None if lengths is None else torch.tensor(lengths)
    return torch.nested.nested_tensor_from_jagged(_values(), torch.tensor(offsets), given, **kw)


def _state_dict() -> dict[str, torch.Tensor]:
    shared = _njt([0, 3, 8])
    grad = torch.nested.nested_tensor_from_jagged(_values(), torch.tensor([0, 2, 8]))
    return {
        "w": torch.ones(3, 2),
        "plain": shared,
        "again": shared,  # one tensor under two names
        "lengths": _njt([0, 3, 6], [2, 1]),
        "half": _njt([0, 5, 8]).to(torch.float16),
        "int32": torch.nested.nested_tensor_from_jagged(
            _values(), torch.tensor([0, 1, 8], dtype=torch.int32)
        ),
        "second dim": torch.nested.nested_tensor_from_jagged(
            torch.arange(24.0).reshape(2, 6, 2), torch.tensor([0, 2, 6]), jagged_dim=2
        ),
        "grad": grad.requires_grad_(),
        "b": torch.arange(4),
    }


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is type(want)
    assert (got.layout, got.dtype, got.device) == (want.layout, want.dtype, want.device)
    assert (got._ragged_idx, got.requires_grad, got.is_leaf) == (
        want._ragged_idx,
        want.requires_grad,
        want.is_leaf,
    )
    assert torch.equal(got.values(), want.values())
    assert torch.equal(got.offsets(), want.offsets())
    assert got.offsets().dtype == want.offsets().dtype
    if want.lengths() is None:
        assert got.lengths() is None
    else:
        assert torch.equal(got.lengths(), want.lengths())
    assert sorted(vars(got)) == sorted(vars(want))  # the attributes torch's state set
    assert vars(got.values()) == vars(want.values())
    assert got.values().requires_grad == want.values().requires_grad
    assert [c.tolist() for c in got.unbind()] == [c.tolist() for c in want.unbind()]


@pytest.mark.parametrize("map_location", ["cpu", "auto"])
def test_jagged_tensors_load_as_torch_loads_them(tmp_path: Path, map_location: str) -> None:
    path = tmp_path / "njt.pt"
    torch.save(_state_dict(), path)
    want = torch.load(path, weights_only=True, map_location="cpu")

    got = load_state_dict(path, map_location=map_location)
    assert list(got) == list(want)
    for name, tensor in want.items():
        if tensor.is_nested:
            _assert_same(got[name], tensor)
        else:
            assert torch.equal(got[name], tensor)
    assert got["plain"] is got["again"]
    _, info = load_with_info(path, map_location=map_location, mmap=True)
    assert info.mmap and not info.trusted


def test_a_jagged_tensor_shares_its_values_with_the_dense_entry_it_was_built_from(
    tmp_path: Path,
) -> None:
    path = tmp_path / "njt.pt"
    values = _values()
    offsets = torch.tensor([0, 3, 8])
    njt = torch.nested.nested_tensor_from_jagged(values, offsets)
    torch.save({"values": values, "offsets": offsets, "n": njt}, path)
    want = torch.load(path, weights_only=True)
    got = load_state_dict(path, map_location="cpu")
    assert want["n"].values().data_ptr() == want["values"].data_ptr()
    assert got["n"].values().data_ptr() == got["values"].data_ptr()
    assert got["n"].offsets().data_ptr() == got["offsets"].data_ptr()


class _WithJagged(nn.Module):
    def __init__(self, offsets: list[int]) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("n", _njt(offsets))


def test_load_into_refuses_a_jagged_buffer_as_torch_does(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(_WithJagged([0, 3, 8]).state_dict(), path)
    # Each jagged tensor's ragged size is its own symbol: torch calls it a size mismatch.
    with pytest.raises(RuntimeError, match="size mismatch for n"):
        _WithJagged([0, 3, 8]).load_state_dict(torch.load(path, weights_only=True))
    for map_location in ("cpu", "auto"):
        with pytest.raises(StateDictMismatchError, match=r"1 shape mismatch\(es\): n "):
            load_into(_WithJagged([0, 3, 8]), path, map_location=map_location)


def _source(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    src = tmp_path / "njt.pt"
    torch.save({"w": torch.ones(2), "n": _njt([0, 3, 8]), "l": _njt([0, 3, 6], [2, 1])}, src)
    root = open_checkpoint(src).root
    records = {
        "offsets": root["n"].args[2][0]["offsets"].storage.key,
        "lengths": root["l"].args[2][0]["lengths"].storage.key,
    }
    return src, records


_MUTATIONS = {
    "past the values": ("n", "offsets", [0, 3, 9], "ends at row 9 of its 8-row values"),
    "decreasing": ("n", "offsets", [0, 5, 3], "its offsets decrease"),
    "negative": ("n", "offsets", [-1, 3, 8], "is negative"),
    "far past": ("n", "offsets", [0, 3, 2**62], f"ends at row {2**62} of its 8-row values"),
    "lengths past": ("l", "lengths", [2, 6], "ends at row 9 of its 8-row values"),
}


def test_offsets_outside_the_values_are_refused_naming_the_entry(tmp_path: Path) -> None:
    src, records = _source(tmp_path)
    bad = {}
    for i, (_, part, numbers, _) in enumerate(_MUTATIONS.values()):
        bad[i] = tmp_path / f"bad{i}.pt"
        data = torch.tensor(numbers).numpy().tobytes()
        tools().rewrite_zip(src, bad[i], replace={f"data/{records[part]}": data})
    # torch loads each one; its kernels would then index the values past their storage.
    assert torch_outcomes(*bad.values()) == [{"error": "", "unsafe": []}] * len(bad)
    for i, (entry, _, _, why) in enumerate(_MUTATIONS.values()):
        for map_location in ("cpu", "auto"):
            with pytest.raises(CorruptCheckpointError, match=f"entry '{entry}' is a jagged") as e:
                load_state_dict(bad[i], map_location=map_location)
            assert why in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(CorruptCheckpointError, match=f"entry '{entry}' is a jagged"):
            load_into(_WithJagged([0, 3, 8]), bad[i])


def _retyped(src: Path, dst: Path, storage: bytes) -> Path:
    pickled = zipfile.ZipFile(src).read(f"{src.stem}/data.pkl")
    mutated = pickled.replace(b"LongStorage", storage)
    tools().rewrite_zip(src, dst, replace={"data.pkl": mutated})
    return dst


def test_offsets_of_another_dtype_are_refused(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)
    # Floats and bytes are not offsets; int32 offsets read 12 of the record's 24 bytes.
    for storage in (b"DoubleStorage", b"ByteStorage", b"IntStorage"):
        bad = _retyped(src, tmp_path / "bad.pt", storage)
        with pytest.raises(CorruptCheckpointError) as e:
            load_state_dict(bad, map_location="cpu")
        assert "\n" not in str(e.value)
    # The same file unchanged loads: the refusals are the mutations'.
    assert load_state_dict(src)["n"].is_nested


def test_a_jagged_tensor_mapped_to_meta_is_built_as_torch_builds_it(tmp_path: Path) -> None:
    path = tmp_path / "njt.pt"
    torch.save({"n": _njt([0, 3, 8]), "l": _njt([0, 3, 6], [2, 1])}, path)
    want = torch.load(path, weights_only=True, map_location="meta")
    got = load_state_dict(path, map_location="meta")
    for name, tensor in want.items():
        assert type(got[name]) is type(tensor) and got[name].device == tensor.device
        assert got[name].offsets().is_meta and got[name].values().shape == (8, 2)
        assert (got[name].lengths() is None) == (tensor.lengths() is None)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_jagged_tensor_wrapped_in_a_parameter_loads_as_one(
    tmp_path: Path, requires_grad: bool
) -> None:
    # nn.Parameter(njt) keeps the NestedTensor type and sets ``_is_param`` in its state.
    path = tmp_path / "param.pt"
    param = nn.Parameter(_njt([0, 3, 8]), requires_grad=requires_grad)
    torch.save({"p": param, "w": torch.ones(2)}, path)
    want = torch.load(path, weights_only=True)["p"]
    assert isinstance(want, nn.Parameter) and want.requires_grad is requires_grad

    got = load_state_dict(path, map_location="cpu")["p"]
    _assert_same(got, want)
    assert isinstance(got, nn.Parameter)
    assert [t.layout for t in ct.inspect(str(path)).tensors] == ["jagged", "strided"]
    # A rewrite re-emits the state as it was: the output still loads as a Parameter.
    out = tmp_path / "wrapped.pt"
    ct.add_module(path, out)
    again = torch.load(out, weights_only=True)["module.p"]
    assert isinstance(again, nn.Parameter) and again.requires_grad is requires_grad


def test_a_jagged_state_marking_anything_but_a_parameter_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.pt"
    njt = _njt([0, 3, 8])
    njt._is_param = 1  # not what nn.Parameter sets
    torch.save({"n": njt}, path)
    with pytest.raises(CorruptCheckpointError, match="sets '_is_param'"):
        open_checkpoint(path)

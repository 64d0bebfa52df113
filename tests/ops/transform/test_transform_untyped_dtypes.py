"""Dtypes without a typed storage class (float8, uint16/32/64) written by the transforms.

torch.save keeps them on an untyped storage of bytes, rebuilt with ``_rebuild_tensor_v3``,
which takes the dtype. A transform that gives such a tensor a new storage (one read from
safetensors, a mean, a module's plain state dict) must write the same, or torch.load gives
bytes: the oracles are safetensors' and torch's own loaders.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_tools

_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {"f32": torch.randn(5, generator=gen)}
    for dtype in _DTYPES:
        name = "enc." + str(dtype).removeprefix("torch.")
        if dtype.is_floating_point:
            out[name] = torch.randn(2, 3, generator=gen).to(dtype)
        else:
            out[name] = torch.randint(0, 1000, (2, 3), generator=gen).to(dtype)
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert got[k].contiguous().view(torch.uint8).equal(t.contiguous().view(torch.uint8)), k


@pytest.fixture()
def st_file(tmp_path):
    path = tmp_path / "in.safetensors"
    save_file(_tensors(), str(path))
    return path


def test_slim_of_safetensors_to_torch_keeps_each_dtype(st_file, tmp_path) -> None:
    out = tmp_path / "out.pt"
    ckpt_tools.slim(st_file, out)
    _same(torch.load(out, weights_only=True), load_file(str(st_file)))


def test_a_cast_beside_untyped_dtypes_leaves_them_as_they_are(st_file, tmp_path) -> None:
    out = tmp_path / "out.pt"
    ckpt_tools.slim(st_file, out, dtype="bfloat16")
    want = load_file(str(st_file))
    want["f32"] = want["f32"].to(torch.bfloat16)
    _same(torch.load(out, weights_only=True), want)


def test_extract_of_safetensors_to_torch_keeps_each_dtype(st_file, tmp_path) -> None:
    out = tmp_path / "out.pt"
    ckpt_tools.extract(st_file, out, prefix="enc")
    want = {k: v for k, v in load_file(str(st_file)).items() if k.startswith("enc.")}
    _same(torch.load(out, weights_only=True), want)


def test_average_of_safetensors_to_torch_keeps_each_dtype(tmp_path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first = _tensors()
    second = {
        k: (v.float() * 0.5).to(v.dtype) if v.is_floating_point() else v for k, v in first.items()
    }
    save_file(first, str(a))
    save_file(second, str(b))
    out = tmp_path / "out.pt"
    ckpt_tools.average([a, b], out)
    want = {
        k: ((v.double() + second[k].double()) / 2).to(v.dtype) if v.is_floating_point() else v
        for k, v in first.items()
    }
    _same(torch.load(out, weights_only=True), want)


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.uint16])
def test_a_modules_parameter_of_an_untyped_dtype_is_written_plain(tmp_path, dtype) -> None:
    module = torch.nn.Linear(2, 3)
    weight = module.weight.detach().mul(100).to(dtype)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    src, out = tmp_path / "m.pt", tmp_path / "out.pt"
    torch.save({"model": module}, src)
    ckpt_tools.slim(src, out)
    state = torch.load(src, weights_only=False)["model"].state_dict()
    _same(torch.load(out, weights_only=True), {k: v.detach() for k, v in state.items()})

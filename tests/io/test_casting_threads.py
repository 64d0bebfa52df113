"""Casts of tensors longer than torch's 32768-element grain: NaN bits are those of torch on one
thread; which elements are NaN, and every other value, match torch on any number of threads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.io.casting import CAST_SOURCES, CAST_TARGETS, cast_array, iter_cast

_UINT = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
_INT = {np.uint64: torch.int64, np.uint32: torch.int32, np.uint16: torch.int16}
_EXPONENT = {"float64": 0x7FF0000000000000, "float32": 0x7F800000, "float16": 0x7C00}
_EXPONENT["bfloat16"] = 0x7F80
_X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
_PAIRS = [(s, d) for s in CAST_SOURCES for d in CAST_TARGETS if s != d]
# Not whole numbers of vector blocks, so every piece torch's threads cast ends in a tail.
_LENGTHS = [200003, 100019, 70001]


@pytest.fixture
def threads() -> Iterator[None]:
    """Puts torch's thread count back after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _nan_heavy(src: str, n: int, seed: int) -> np.ndarray:
    """Random bit patterns, 70% of them with every exponent bit set (NaN or inf)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, np.iinfo(_UINT[src]).max, n, dtype=_UINT[src], endpoint=True)
    bits[rng.random(n) < 0.7] |= _UINT[src](_EXPONENT[src])
    return bits


def _torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    x = torch.from_numpy(bits.view(f"<i{bits.itemsize}")).view(getattr(torch, src))
    return x.to(getattr(torch, dst)).view(_INT[_UINT[dst]]).numpy().view(_UINT[dst])


def _nan(bits: np.ndarray, dst: str) -> np.ndarray:
    if dst == "bfloat16":
        return (bits & 0x7FFF) > 0x7F80
    return np.isnan(bits.view({"float16": np.float16, "float32": np.float32}[dst]))


@pytest.mark.skipif(not _X86, reason="NaN bits of torch's x86 kernels")
@pytest.mark.parametrize("n", _LENGTHS)
@pytest.mark.parametrize(("src", "dst"), _PAIRS)
def test_long_casts_are_bitwise_torchs_on_one_thread(
    threads: None, src: str, dst: str, n: int
) -> None:
    torch.set_num_threads(1)
    bits = _nan_heavy(src, n, n)
    want = _torch_cast(bits, src, dst)
    wrong = np.flatnonzero(cast_array(bits, src, dst) != want)
    assert wrong.size == 0, wrong[:5]


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize(("src", "dst"), [("float64", "bfloat16"), ("float16", "float32")])
def test_more_threads_change_only_nan_bits(threads: None, src: str, dst: str, count: int) -> None:
    torch.set_num_threads(count)
    bits = _nan_heavy(src, 200003, count)
    ours, want = cast_array(bits, src, dst), _torch_cast(bits, src, dst)
    nan = _nan(want, dst)
    assert np.array_equal(_nan(ours, dst), nan)
    assert np.array_equal(ours[~nan], want[~nan])


@pytest.mark.skipif(not _X86, reason="NaN bits of torch's x86 kernels")
@pytest.mark.parametrize(("src", "dst"), [("float64", "bfloat16"), ("float16", "float32")])
def test_chunked_file_cast_is_torchs_on_one_thread(
    threads: None, tmp_path: Path, src: str, dst: str
) -> None:
    torch.set_num_threads(1)
    bits = _nan_heavy(src, 100019, 5)
    (tmp_path / "raw").write_bytes(bits.tobytes())
    with open(tmp_path / "raw", "rb") as f:
        data = b"".join(iter_cast(f.fileno(), 0, len(bits), src, dst, chunk=32768))
    assert np.array_equal(np.frombuffer(data, _UINT[dst]), _torch_cast(bits, src, dst))


@pytest.mark.skipif(not _X86, reason="NaN bits of torch's x86 kernels")
def test_average_to_bf16_past_the_grain_is_torchs_on_one_thread(
    threads: None, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    n = 100003
    a = torch.full((n,), float("nan")).bfloat16()
    a[::3] = 1.0
    b = torch.ones(n).bfloat16()
    torch.save({"w": a}, tmp_path / "a.pt")
    torch.save({"w": b}, tmp_path / "b.pt")
    ct.average([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "avg.pt")
    ours = torch.load(tmp_path / "avg.pt", weights_only=True)["w"]
    want = ((a.double() + b.double()) / 2).bfloat16()
    assert torch.equal(ours.view(torch.int16), want.view(torch.int16))

"""``average``'s arithmetic against torch's own ``sum(w * x) / sum(w)``, bit for bit: complex
means and the NaN an element keeps where several inputs hold one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_tools as ct

# NaN bits come from torch's x86 CPU kernels on one thread (see ckpt_tools/io/casting.py).
_X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The exponent bits of each dtype: OR-ed into random bits they make a NaN or an infinity.
_EXPONENT = {
    torch.float64: 0x7FF0000000000000,
    torch.float32: 0x7F800000,
    torch.float16: 0x7C00,
    torch.bfloat16: 0x7F80,
    torch.float8_e4m3fn: 0x7F,
    torch.float8_e5m2: 0x7C,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _average(tmp_path: Path, inputs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    paths = []
    for i, x in enumerate(inputs):
        torch.save({"x": x}, tmp_path / f"in_{i}.pt")
        paths.append(tmp_path / f"in_{i}.pt")
    ct.average(paths, tmp_path / "avg.pt", weights=weights)
    return torch.load(tmp_path / "avg.pt", weights_only=True)["x"]


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(_INT[t.element_size()]).numpy().reshape(-1)


def _assert_same_bits(ours: torch.Tensor, want: torch.Tensor) -> None:
    assert ours.dtype == want.dtype
    a, b = _bits(ours), _bits(want)
    wrong = np.flatnonzero(a != b)
    assert wrong.size == 0, (wrong.size, [(int(i), hex(a[i]), hex(b[i])) for i in wrong[:4]])


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.3, 1.7, -0.45]])
def test_average_of_complex_is_torchs_complex_mean(
    tmp_path: Path, dtype: torch.dtype, weights: list[float]
) -> None:
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(1000, dtype=dtype, generator=g) for _ in weights]
    ours = _average(tmp_path, inputs, weights)
    acc = sum(w * x.to(torch.complex128) for w, x in zip(weights, inputs))
    assert isinstance(acc, torch.Tensor)
    _assert_same_bits(ours, (acc / sum(weights)).to(dtype))


def _nans_and_infs(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Finite values, with about half of them made NaN (random sign and payload) or inf."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(n) * 4).to(dtype)
    size = x.element_size()
    raw = rng.integers(0, 256, n * size, dtype=np.uint8).view(f"<u{size}")
    special = raw | np.array(_EXPONENT[dtype], dtype=raw.dtype)
    bits = np.where(rng.random(n) < 0.5, special, _bits(x).view(raw.dtype))
    return torch.from_numpy(bits.view(f"<i{size}") if size > 1 else bits).view(dtype)


@pytest.mark.skipif(not _X86, reason="NaN bits of torch's x86 kernels")
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.5, -2.0, 0.25]])
def test_average_keeps_the_nan_of_the_last_input_holding_one(
    tmp_path: Path, dtype: torch.dtype, weights: list[float]
) -> None:
    n = 40003  # past torch's 32768-element grain and not a whole number of vectors
    inputs = [_nans_and_infs(dtype, n, seed) for seed in range(len(weights))]
    ours = _average(tmp_path, inputs, weights)
    acc = sum(w * x.double() for w, x in zip(weights, inputs))
    assert isinstance(acc, torch.Tensor)
    _assert_same_bits(ours, (acc / sum(weights)).to(dtype))


@pytest.mark.skipif(not _X86, reason="NaN bits of torch's x86 kernels")
def test_average_nan_of_two_inputs_takes_the_second_ones_sign(tmp_path: Path) -> None:
    first = torch.tensor([0x7FC12345, 0x7F800001], dtype=torch.int32).view(torch.float32)
    second = torch.tensor([-0x00400000, -0x007FFFFF], dtype=torch.int32).view(torch.float32)
    ours = _average(tmp_path, [first, second], [1.0, 1.0])
    want = ((first.double() + second.double()) / 2).float()
    assert [hex(v & 0xFFFFFFFF) for v in _bits(want).tolist()] == ["0xffc00000", "0xffc00001"]
    _assert_same_bits(ours, want)


@pytest.mark.parametrize("weights", [[1.0, 1.0], [0.3, 2.5], [1e-300, 3.0]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_average_at_float64s_range_limits_is_torchs(
    tmp_path: Path, dtype: torch.dtype, weights: list[float]
) -> None:
    # Subnormals keep their bits and w * x overflows to inf exactly where torch's does:
    # the weights are used as given, never rescaled.
    x = torch.tensor(
        [5e-324, 1.5e-323, 1e-310, 1.0, 1e308, -1.7e308, 2.2e-308], dtype=torch.float64
    )
    if dtype.is_complex:
        x = torch.complex(x, x.flip(0))
    inputs = [x, x.flip(0)]
    ours = _average(tmp_path, inputs, weights)
    acc = sum(w * v.to(dtype) for w, v in zip(weights, inputs))
    assert isinstance(acc, torch.Tensor)
    _assert_same_bits(ours, (acc / sum(weights)).to(dtype))


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.3, 2.5, -0.7]])
@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
def test_average_of_complex_with_zeros_and_non_finite_parts_is_torchs(
    tmp_path: Path, dtype: torch.dtype, weights: list[float]
) -> None:
    # torch's complex kernels: signed zeros from re * 0.0, and an infinite part spreading NaN
    # to the other (in w * x, in a + b, in the division). Only a NaN part's bits may differ.
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.25, 1e308, 5e-324, 3e38])
    n = 4000

    def part() -> np.ndarray:
        return np.where(rng.random(n) < 0.6, rng.choice(special, n), rng.standard_normal(n))

    inputs = [torch.complex(torch.from_numpy(part()), torch.from_numpy(part())).to(dtype)]
    inputs += [torch.complex(torch.from_numpy(part()), torch.from_numpy(part())).to(dtype)]
    inputs += [inputs[0].flip(0)]
    ours = torch.view_as_real(_average(tmp_path, inputs, weights))
    acc = sum(w * x.to(torch.complex128) for w, x in zip(weights, inputs))
    assert isinstance(acc, torch.Tensor)
    want = torch.view_as_real((acc / sum(weights)).to(dtype))
    assert torch.equal(ours.isnan(), want.isnan())
    finite = ~want.isnan()
    _assert_same_bits(ours[finite], want[finite])

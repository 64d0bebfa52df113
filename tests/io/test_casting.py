"""The numpy casts against torch's own ``tensor.to(dtype)``, bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ckpt_tools.io.casting import (
    CAST_SOURCES,
    CAST_TARGETS,
    cast_array,
    cast_chunk,
    cast_runs,
    iter_cast,
)

_TORCH = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_UINT = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
_SIGNED = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
# The NaN bits torch makes come from its x86 vector kernels (see ckpt_tools/io/casting.py).
_X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    signed = torch.from_numpy(bits.view(np.dtype(_UINT[src]).str.replace("u", "i")).copy())
    out = signed.view(_TORCH[src]).to(_TORCH[dst]).view(_SIGNED[_TORCH[dst]]).numpy()
    return out.view(_UINT[dst])


def _check(bits: np.ndarray, src: str, dst: str, nan_bits: bool = _X86) -> None:
    ours = cast_array(bits, src, dst)
    theirs = _torch_cast(bits, src, dst)
    assert ours.dtype == theirs.dtype
    if not nan_bits:
        nan = np.isnan(
            theirs.view({np.uint16: np.float16, np.uint32: np.float32}[theirs.dtype.type])
        )
        if dst == "bfloat16":
            nan = (theirs & 0x7FFF) > 0x7F80
        assert np.array_equal(ours[~nan], theirs[~nan])
        return
    wrong = np.flatnonzero(ours != theirs)
    assert wrong.size == 0, [
        (hex(int(bits[i])), hex(int(ours[i])), hex(int(theirs[i]))) for i in wrong[:5]
    ]


@pytest.mark.parametrize("dst", CAST_TARGETS)
@pytest.mark.parametrize("src", ["float16", "bfloat16"])
def test_every_16_bit_pattern(src: str, dst: str) -> None:
    _check(np.arange(65536, dtype=np.uint16), src, dst)


@pytest.mark.parametrize("dst", CAST_TARGETS)
@pytest.mark.parametrize("src", ["float32", "float64"])
def test_dense_random_bit_patterns(src: str, dst: str) -> None:
    rng = np.random.default_rng(12)
    width = np.iinfo(_UINT[src]).max
    bits = rng.integers(0, width, 1 << 20, dtype=_UINT[src], endpoint=True)
    _check(bits, src, dst)


def _halfway_values() -> np.ndarray:
    """Values at and beside every rounding boundary of fp16 and bf16, in float64."""
    one = np.float64(1.0)
    values = []
    for mantissa_bits in (7, 10, 23):  # bf16, fp16, fp32 spacing at 1.0
        ulp = 2.0**-mantissa_bits
        for k in range(0, 4):
            base = one + k * ulp
            for d in (0.0, 2**-40, -(2**-40), 2**-60, 2**-30, -(2**-30)):
                values += [base + ulp / 2 + d, -(base + ulp / 2 + d)]
    # overflow edges of each target, subnormal edges, signed zeros, infinities
    values += [65504.0, 65519.99, 65520.0, 65520.01, 3.3895313892515355e38, 3.4e38, 3.5e38, 1e300]
    values += [
        2.0**-24,
        2.0**-25,
        2.0**-25 * 1.5,
        2.0**-14,
        2.0**-149,
        2.0**-150,
        2.0**-151,
        1.1754942e-38,
        9.2e-41,
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        5e-324,
        -5e-324,
    ]
    scaled = [v * s for v in values for s in (1.0, 2.0**-20, 2.0**20, 2.0**-120, 2.0**100)]
    return np.array(values + scaled + [-v for v in scaled], dtype=np.float64)


@pytest.mark.parametrize("dst", CAST_TARGETS)
@pytest.mark.parametrize("src", ["float32", "float64"])
def test_halfway_overflow_subnormal_and_zero(src: str, dst: str) -> None:
    with np.errstate(over="ignore"):
        values = _halfway_values().astype(np.float64 if src == "float64" else np.float32)
    _check(values.view(_UINT[src]), src, dst)


def test_float64_is_rounded_through_float32_as_torch_does() -> None:
    x = np.array([1 + 2**-8 + 2**-40], dtype=np.float64)
    ours = cast_array(x.view(np.uint64), "float64", "bfloat16")
    assert hex(int(ours[0])) == "0x3f80"  # the nearest bf16 is 0x3f81; torch double-rounds
    assert np.array_equal(ours, _torch_cast(x.view(np.uint64), "float64", "bfloat16"))


NAN_BITS = {
    "float64": [0x7FF0000000000001, 0xFFF8000000000123, 0x7FF8123456789ABC, 0x7FFFFFFFFFFFFFFF],
    "float32": [0x7F800001, 0xFFC00001, 0x7FBFFFFF, 0xFF812345, 0x7FC12345],
    "float16": [0x7C01, 0xFE01, 0x7D23, 0xFFFF],
    "bfloat16": [0x7F81, 0xFFC1, 0x7FA3, 0xFF80 | 0x7F],
}


ONE_AND_HALF = {
    "float64": 0x3FF8000000000000,
    "float32": 0x3FC00000,
    "float16": 0x3E00,
    "bfloat16": 0x3FC0,
}


@pytest.mark.skipif(not _X86, reason="NaN bits are those of torch's x86 CPU kernels")
@pytest.mark.parametrize("dst", CAST_TARGETS)
@pytest.mark.parametrize("src", CAST_SOURCES)
@pytest.mark.parametrize("n", [1, 3, 8, 9, 16, 17, 31, 40, 100])
def test_nan_bits_at_every_length(src: str, dst: str, n: int) -> None:
    """torch's NaN bits depend on where an element sits (vector body or scalar tail)."""
    bits = np.resize(np.array(NAN_BITS[src], dtype=_UINT[src]), n)
    bits[::3] = ONE_AND_HALF[src]  # numbers between the NaNs
    _check(bits, src, dst)


@pytest.mark.parametrize("dst", CAST_TARGETS)
@pytest.mark.parametrize("src", ["float64", "float16"])
def test_chunked_cast_equals_one_cast(tmp_path, src: str, dst: str) -> None:
    """Chunk borders do not change NaN bits: positions are counted over the whole tensor."""
    rng = np.random.default_rng(3)
    bits = rng.integers(0, np.iinfo(_UINT[src]).max, 1000 + 13, dtype=_UINT[src])
    bits[-20:] = NAN_BITS[src][0]
    path = tmp_path / "raw.bin"
    path.write_bytes(b"xyz" + bits.tobytes())
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        joined = b"".join(iter_cast(fd, 3, len(bits), src, dst, chunk=100))
    finally:
        os.close(fd)
    assert joined == cast_chunk(bits.tobytes(), src, dst, 0, len(bits))
    if _X86:
        assert joined == _torch_cast(bits, src, dst).tobytes()


@pytest.mark.skipif(not _X86, reason="NaN bits are those of torch's x86 CPU kernels")
@pytest.mark.parametrize(("src", "dst"), [("float64", "bfloat16"), ("float16", "float32")])
@pytest.mark.parametrize("chunk", [7, 40, 200])
def test_runs_cast_as_torch_casts_each_tensor(src: str, dst: str, chunk: int) -> None:
    """A storage's runs, cast chunk by chunk, each give the bits torch casts that tensor to."""
    bits = np.resize(np.array(NAN_BITS[src], dtype=_UINT[src]), 123)
    bits[::5] = ONE_AND_HALF[src]
    runs = [0, 9, 40, 41, 100, 123]
    torch_bits = np.concatenate(
        [_torch_cast(bits[a:b], src, dst) for a, b in itertools.pairwise(runs)]
    )
    ours = np.concatenate(
        [cast_runs(bits[at : at + chunk], src, dst, at, runs) for at in range(0, 123, chunk)]
    )
    assert ours.tobytes() == torch_bits.tobytes()
    assert ours.tobytes() != _torch_cast(bits, src, dst).tobytes()  # the runs matter here
    raw = cast_chunk(bits[40:].tobytes(), src, dst, 40, 123, runs=runs)
    assert raw == torch_bits[40:].tobytes()


def test_unknown_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot cast int64 to bfloat16"):
        cast_array(np.zeros(2, np.uint64), "int64", "bfloat16")

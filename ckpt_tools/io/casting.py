"""Floating-point casts with numpy, bitwise equal to torch's ``tensor.to(dtype)`` on the CPU.

torch is never imported (importing it alone costs hundreds of megabytes of memory). What
torch does, and so what this module does:

- every finite value is rounded to nearest, ties to even; overflow gives inf; subnormals are
  kept (fp16 subnormals, bf16 from fp32 subnormals), never flushed;
- a float64 source is rounded to float32 first, then to the target (torch's ``Half`` and
  ``BFloat16`` are built from a float): ``1 + 2**-8 + 2**-40`` becomes bf16 ``1.0``, not the
  nearest bf16. Double rounding is torch's result, so it is ours;
- NaN bits follow torch's x86 CPU kernels (AVX2 / AVX-512) run on one thread
  (``torch.set_num_threads(1)``), measured with torch 2.13:

  ====================  ====================================================================
  cast                   NaN becomes
  ====================  ====================================================================
  fp32 -> bf16           ``0xffff`` (the vectorised kernel's mask; sign and payload lost)
  fp64 -> bf16           ``0xffff``, except the last ``n % 16`` elements: ``0x7fc0``
  fp16 -> bf16           ``0x7fc0``
  fp16 -> fp32           quiet, sign and payload kept (``s|0x7fc00000|m<<13``), except the
                         last ``n % 8`` elements: ``0x7fffffff``
  bf16 -> fp32           the same bits shifted (payload kept, not quieted)
  fp64 -> fp32           quiet, sign kept, payload truncated (the hardware conversion)
  any -> fp16            through fp32 as above, then quiet, sign kept, payload truncated
  ====================  ====================================================================

  ``n`` is the number of elements of the contiguous tensor cast, and an element's place
  is counted from that tensor's first element, not its storage's: callers cast a storage
  holding views one run per tensor (``slim``'s casts and ``average``'s mean, cast back),
  and a storage of one tensor over all of it as one run. :func:`cast_array` and
  :func:`cast_chunk` take the place and the count, :func:`cast_runs` a storage's runs.

torch on more threads splits a cast of more than 32768 elements into one piece per thread
(``at::parallel_for``), each with its own scalar tail, so its fp64 -> bf16 and fp16 -> fp32
NaN bits then depend on ``torch.get_num_threads()``: a NaN near the end of a piece can come
out ``0x7fc0`` / ``0x7fffffff`` there and not here, or the other way round. Ours are always
the one-thread bits, whatever machine reads the file. Other torch builds (ARM, CUDA) make
other NaN bits too. Which elements are NaN, and every non-NaN value, are the same in all
these cases.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence

import numpy as np

from ckpt_tools.io.float8 import FLOAT8_DTYPES, float8_to_float32
from ckpt_tools.io.ranges import SourceEndedError

__all__ = [
    "CAST_SOURCES",
    "CAST_TARGETS",
    "cast_array",
    "cast_chunk",
    "cast_runs",
    "iter_cast",
]

#: Dtypes a cast reads; other dtypes (integers, bool, quantized, complex, float8) are not cast.
CAST_SOURCES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
#: Dtypes a cast writes.
CAST_TARGETS: tuple[str, ...] = ("bfloat16", "float16", "float32")

# float8 is only ever widened to float32 (a buffer's upcast), which is exact.
_BITS = {
    "float64": np.uint64,
    "float32": np.uint32,
    "float16": np.uint16,
    "bfloat16": np.uint16,
    **dict.fromkeys(FLOAT8_DTYPES, np.uint8),
}
_ITEMSIZE = {dtype: np.dtype(bits).itemsize for dtype, bits in _BITS.items()}
# Elements per vector block of the kernels whose last ``n % block`` elements take a scalar path.
_VECTOR_BLOCK = {("float64", "bfloat16"): 16, ("float16", "float32"): 8}
_CHUNK_ELEMENTS = 1 << 20


def _to_float32_bits(bits: np.ndarray, src: str) -> np.ndarray:
    """fp32 bit patterns of ``bits`` (of dtype ``src``); exact except float64 (rounded)."""
    if src == "float32":
        return bits
    if src == "bfloat16":
        return bits.astype(np.uint32) << np.uint32(16)
    if src == "float16":
        with np.errstate(invalid="ignore"):
            return bits.view(np.float16).astype(np.float32).view(np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        return bits.view(np.float64).astype(np.float32).view(np.uint32)


def _f32_to_bf16(b32: np.ndarray) -> np.ndarray:
    """Round fp32 bits to bf16 bits, nearest even (NaNs are fixed up by the caller)."""
    bias = ((b32 >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((b32 + bias) >> np.uint32(16)).astype(np.uint16)


def _f32_to_f16(b32: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return b32.view(np.float32).astype(np.float16).view(np.uint16)


def _nan_mask(bits: np.ndarray, src: str) -> np.ndarray:
    if src == "float64":
        return (bits & np.uint64(0x7FFFFFFFFFFFFFFF)) > np.uint64(0x7FF0000000000000)
    if src == "float32":
        return (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if src == "float16":
        return (bits & np.uint16(0x7FFF)) > np.uint16(0x7C00)
    return (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def _quiet_f32_nan(bits: np.ndarray, src: str) -> np.ndarray:
    """The fp32 NaN the hardware conversion makes from NaN ``bits`` (fp64 or fp32 or bf16)."""
    if src == "float64":
        sign = (bits >> np.uint64(32)).astype(np.uint32) & np.uint32(0x80000000)
        payload = ((bits >> np.uint64(29)) & np.uint64(0x7FFFFF)).astype(np.uint32)
        return sign | np.uint32(0x7FC00000) | payload
    if src == "bfloat16":
        return bits.astype(np.uint32) << np.uint32(16)
    if src == "float16":
        b = bits.astype(np.uint32)
        return (
            ((b & np.uint32(0x8000)) << np.uint32(16))
            | np.uint32(0x7FC00000)
            | ((b & np.uint32(0x3FF)) << np.uint32(13))
        )
    return bits | np.uint32(0x400000)


def _f16_nan_from_f32(b32: np.ndarray) -> np.ndarray:
    """The fp16 NaN the hardware conversion makes: quiet, sign kept, payload truncated."""
    sign = (b32 >> np.uint32(16)) & np.uint32(0x8000)
    payload = (b32 >> np.uint32(13)) & np.uint32(0x3FF)
    return (sign | np.uint32(0x7E00) | payload).astype(np.uint16)


def _tail_mask(count: int, first: int, total: int, block: int) -> np.ndarray | None:
    """Which of ``count`` elements, starting at ``first`` of ``total``, fall in the scalar tail
    (one tail at the end of the whole tensor, as torch casts it on one thread)."""
    tail_start = total - total % block
    if first + count <= tail_start:
        return None
    return np.arange(first, first + count) >= tail_start


def cast_array(
    bits: np.ndarray, src: str, dst: str, first: int = 0, total: int | None = None
) -> np.ndarray:
    """Cast an array of ``src`` bit patterns to ``dst`` bit patterns, as torch's ``.to`` does.

    Args:
        bits: the source values as unsigned integers of the source's width (``uint16`` for
            bf16 and fp16, ``uint32`` for fp32, ``uint64`` for fp64).
        src: ``float64``, ``float32``, ``float16`` or ``bfloat16`` (or a float8 format,
            widened to ``float32`` only: see :mod:`ckpt_tools.io.float8`).
        dst: ``bfloat16``, ``float16`` or ``float32``.
        first: the index of ``bits[0]`` in the tensor being cast (NaN bits depend on it).
        total: that tensor's element count; ``len(bits)`` when None.

    NaN bits are those of torch on one thread (see the module's notes); other values match
    torch at any thread count.

    Returns:
        The target's bit patterns (``uint16`` or ``uint32``), a new array.

    Raises:
        ValueError: a dtype outside :data:`CAST_SOURCES` / :data:`CAST_TARGETS`.

    Example:
        >>> import numpy as np
        >>> x = np.array([1.0, 1 + 2**-8, 65520.0, 1e-40], dtype=np.float32)
        >>> [hex(b) for b in cast_array(x.view(np.uint32), "float32", "bfloat16")]
        ['0x3f80', '0x3f80', '0x4780', '0x1']
        >>> [hex(b) for b in cast_array(x.view(np.uint32), "float32", "float16")]
        ['0x3c00', '0x3c04', '0x7c00', '0x0']
    """
    if src in FLOAT8_DTYPES and dst == "float32":
        return float8_to_float32(bits, src)
    if src not in CAST_SOURCES or dst not in CAST_TARGETS:
        raise ValueError(
            f"cannot cast {src} to {dst}: casts read {CAST_SOURCES}, write {CAST_TARGETS}"
        )
    bits = np.ascontiguousarray(bits, dtype=_BITS[src])
    total = len(bits) if total is None else total
    if src == dst:
        return bits.copy()
    b32 = _to_float32_bits(bits, src)
    nan = _nan_mask(bits, src)
    any_nan = bool(nan.any())
    if dst == "float32":
        out = b32.copy() if b32 is bits else b32
        if any_nan:
            out[nan] = _quiet_f32_nan(bits[nan], src)
    elif dst == "bfloat16":
        out = _f32_to_bf16(b32)
        if any_nan:
            out[nan] = np.uint16(0x7FC0 if src == "float16" else 0xFFFF)
    else:
        out = _f32_to_f16(b32)
        if any_nan:
            out[nan] = _f16_nan_from_f32(_quiet_f32_nan(bits[nan], src))
    block = _VECTOR_BLOCK.get((src, dst))
    if any_nan and block is not None:
        tail = _tail_mask(len(bits), first, total, block)
        if tail is not None:
            out[nan & tail] = 0x7FC0 if dst == "bfloat16" else 0x7FFFFFFF
    return out


def cast_runs(bits: np.ndarray, src: str, dst: str, first: int, runs: Sequence[int]) -> np.ndarray:
    """Cast ``bits`` (see :func:`cast_array`), elements ``first`` on of a storage whose runs
    are cast apart: each stretch between two of ``runs`` is cast as a tensor of its own.

    Args:
        bits: the source bit patterns, as :func:`cast_array` takes them.
        src: the source dtype.
        dst: the target dtype.
        first: the index of ``bits[0]`` in the storage.
        runs: the sorted run bounds, from 0 to the storage's element count (``[0, n]``: one
            tensor over all of it).

    Returns:
        The target's bit patterns, a new array.

    Example:
        >>> import numpy as np
        >>> nan = np.full(20, 0x7FF8000000000000, dtype=np.uint64)
        >>> [hex(b) for b in cast_runs(nan, "float64", "bfloat16", 0, [0, 10, 20])[[0, 19]]]
        ['0x7fc0', '0x7fc0']
        >>> [hex(b) for b in cast_runs(nan, "float64", "bfloat16", 0, [0, 20])[[0, 19]]]
        ['0xffff', '0x7fc0']
    """
    i, end, out = bisect.bisect_right(runs, first) - 1, first + len(bits), []
    at = first
    while at < end:  # one pass in the common case: a chunk of a single run
        start, stop = runs[i], runs[i + 1]
        part = bits[at - first : min(stop, end) - first]
        out.append(cast_array(part, src, dst, at - start, stop - start))
        at, i = min(stop, end), i + 1
    if len(out) == 1:
        return out[0]
    return np.concatenate(out) if out else cast_array(bits, src, dst)


def cast_chunk(
    data: bytes | memoryview,
    src: str,
    dst: str,
    first: int,
    total: int,
    *,
    runs: Sequence[int] | None = None,
) -> bytes:
    """Cast little-endian ``src`` bytes to ``dst`` bytes (see :func:`cast_array`), elements
    ``first`` on of ``total``; with ``runs``, each run cast apart (see :func:`cast_runs`).

    Example:
        >>> import numpy as np
        >>> raw = np.array([0.1, -2.5], dtype=np.float64).tobytes()
        >>> np.frombuffer(cast_chunk(raw, "float64", "float16", 0, 2), np.float16).tolist()
        [0.0999755859375, -2.5]
    """
    bits = np.frombuffer(data, dtype=np.dtype(_BITS[src]).newbyteorder("<"))
    bits = bits.astype(_BITS[src], copy=False)
    out = cast_runs(bits, src, dst, first, (0, total) if runs is None else runs)
    return out.astype(np.dtype(_BITS[dst]).newbyteorder("<"), copy=False).tobytes()


def iter_cast(
    fd: int, offset: int, numel: int, src: str, dst: str, chunk: int = _CHUNK_ELEMENTS
) -> Iterator[bytes]:
    """Read ``numel`` ``src`` elements at ``offset`` of ``fd`` and yield them cast, chunk by chunk.

    Memory stays bounded by ``chunk`` elements whatever ``numel`` is.

    Raises:
        OSError: the file ends early.
    """
    size = _ITEMSIZE[src]
    done = 0
    while done < numel:
        count = min(chunk, numel - done)
        data = os.pread(fd, count * size, offset + done * size)
        if len(data) != count * size:
            raise SourceEndedError(done * size + len(data), numel * size)
        yield cast_chunk(data, src, dst, done, numel)
        done += count


def itemsize_of(dtype: str) -> int:
    """Bytes per element of a cast dtype."""
    return _ITEMSIZE[dtype]

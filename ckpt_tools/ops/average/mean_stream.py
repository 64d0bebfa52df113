"""``average``'s arithmetic: the weighted mean of N inputs' bytes, streamed, torch-free.

Every averaged dtype is read into float64 exactly, accumulated as ``sum(w_i * x_i)`` in input
order, divided by ``sum(w_i)``, and cast back as torch's ``.to`` casts a float64 tensor
(:mod:`ckpt_tools.io.casting`). The result is the one a torch float64 computation on the CPU
(one thread) gives: ``(sum(w * x.double()) / sum(w)).to(dtype)``, NaN bits included:

- a NaN element comes out as the NaN of the *last* input that is NaN there (quieted, sign and
  payload kept), as torch's ``a + b`` keeps ``b``'s NaN; without one, ``inf - inf``'s NaN.
  The cast back keeps what it keeps of it (bf16: nothing).
- complex64 and complex128 (torch: ``(sum(w * x.to(torch.complex128)) / sum(w)).to(dtype)``):
  real and imaginary parts in float64, combined as torch's complex kernels combine them:
  ``w * x`` is a complex product with ``w + 0j``, torch's ``a + b`` is ``a + (1 + 0j) * b``,
  and the division is Smith's by ``sum(w) + 0j`` with its reciprocal multiplied. Every element
  matches torch's, overflows, signed zeros and NaN spread from an infinite part included;
  only the bits of a NaN part may differ.
- float8_e4m3fn and float8_e5m2: rounded back through float32 as torch rounds a float64 (its
  float8 constructors take a float): nearest even; e4m3fn saturates overflow and inf to
  +-448 and keeps NaN; e5m2 overflows to inf.

Other dtypes have no mean here: integers (``average``'s ``ints`` rule), bool (torch has no
mean of bool), complex32, quantized, float8 fnuz/e8m0 and packed types.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.io.casting import cast_array, cast_runs
from ckpt_tools.io.ranges import fd_pread, pread_chunks
from ckpt_tools.io.writers.records import Record, record_bytes
from ckpt_tools.ops.transform.view_casts import run_bounds

__all__ = ["INTEGER_DTYPES", "MEAN_DTYPES", "checked_weights", "mean_record"]

#: Averaged dtypes -> the float each element (or complex part) is read and written as.
MEAN_DTYPES: dict[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "complex128": "float64",
    "complex64": "float32",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}
#: Integer dtypes: never averaged, equal in every input or taken from one (``ints``).
INTEGER_DTYPES: tuple[str, ...] = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
)

_CHUNK = 1 << 20  # elements (complex parts) per step: memory is a few chunks per input
_NUMPY = {"float64": np.float64, "float32": np.float32, "float16": np.float16}


def _e4m3fn_values() -> np.ndarray:
    """Every float8_e4m3fn byte's value (exact in float64): bias 7, 3 mantissa bits, no inf."""
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    mag[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b & 0x80, -mag, mag)


_E4M3FN = _e4m3fn_values()
# float32 bits of the smallest normal, of the denormal rounding constant and of the first
# value that overflows; the mantissa shift; the exponent bias (c10's Float8 conversions).
_F8 = {
    "float8_e4m3fn": (121 << 23, 141 << 23, 1087 << 20, 20, 7),
    "float8_e5m2": (113 << 23, 134 << 23, 143 << 23, 21, 15),
}


def checked_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """One finite weight per input, as given: ``w * x`` overflows or loses a subnormal's bits
    exactly where torch's does, so no scaling is done here.

    Args:
        weights: as given (None: equal).
        count: the number of inputs.

    Returns:
        The weights to accumulate with.

    Raises:
        UsageError: the wrong count, a NaN or infinite weight, or a sum that is 0 or
            overflows float64.

    Example:
        >>> checked_weights([1, 3], 2)
        [1.0, 3.0]
    """
    w = [1.0] * count if weights is None else [float(x) for x in weights]
    problem, fix = "", f"give {count} finite weights with a non-zero sum, e.g. 1,1"
    if len(w) != count:
        problem = f"expected {count} weights, one per input, got {len(w)}"
    elif not all(math.isfinite(x) for x in w):
        bad = ", ".join(f"input {i + 1}'s is {x}" for i, x in enumerate(w) if not math.isfinite(x))
        problem = f"weights must be finite numbers: {bad}"
    elif not math.isfinite(sum(w)):
        problem = "the weights sum past float64's largest number"
        fix = "scale them down (the mean depends on their ratios), e.g. 1,1"
    elif sum(w) == 0:
        problem = "the weights sum to 0, so there is no mean to take"
    if problem:
        raise UsageError(
            problem,
            argument="weights",
            value=repr(w if weights is not None else []),  # (a numpy array has no truth)
            flag="--weights",
            remedies=(Remedy(text=fix),),
        )
    return w


def _to_f64(data: Any, lane: str) -> np.ndarray:
    """The float64 values of little-endian ``lane`` elements (exact)."""
    if lane == "bfloat16":
        bits = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)
    if lane == "float8_e5m2":  # the high byte of a float16
        bits = np.frombuffer(data, dtype=np.uint8).astype(np.uint16) << np.uint16(8)
        return bits.view(np.float16).astype(np.float64)
    if lane == "float8_e4m3fn":
        return _E4M3FN[np.frombuffer(data, dtype=np.uint8)]
    return np.frombuffer(data, dtype=_NUMPY[lane]).astype(np.float64)


def _from_f64(acc: np.ndarray, lane: str, first: int, runs: Sequence[int]) -> bytes:
    """``acc`` (elements from ``first`` on) cast to ``lane`` as torch's ``.to`` casts a float64
    tensor: each stretch between two of ``runs`` (sorted bounds) is cast as a tensor of its own.
    """
    if lane == "float64":
        return acc.tobytes()
    if lane in ("float8_e4m3fn", "float8_e5m2"):
        return _f32_to_f8(cast_array(acc.view(np.uint64), "float64", "float32"), lane).tobytes()
    return cast_runs(acc.view(np.uint64), "float64", lane, first, runs).tobytes()


def _f32_to_f8(bits: np.ndarray, lane: str) -> np.ndarray:
    """Round float32 bits to float8 bits as c10's ``fp8e4m3fn/fp8e5m2_from_fp32_value`` do."""
    normal, denorm, overflow, shift, exp_bias = _F8[lane]
    sign = bits & np.uint32(0x80000000)
    f = bits ^ sign
    with np.errstate(all="ignore"):  # every branch is computed, then the right one kept
        odd = (f >> np.uint32(shift)) & np.uint32(1)
        rebias = np.uint32(((exp_bias - 127) << 23) & 0xFFFFFFFF)
        out = (f + rebias + np.uint32((1 << (shift - 1)) - 1) + odd) >> np.uint32(shift)
        added = (f.view(np.float32) + np.uint32(denorm).view(np.float32)).view(np.uint32)
    out = np.where(f < np.uint32(normal), added - np.uint32(denorm), out)
    nan = f > np.uint32(0x7F800000)
    if lane == "float8_e4m3fn":  # saturating: finite overflow and inf become +-448
        out = np.where(f >= np.uint32(overflow), np.uint32(0x7E), np.minimum(out, np.uint32(0x7E)))
        out = np.where(nan, np.uint32(0x7F), out)
    else:
        out = np.where(f >= np.uint32(overflow), np.where(nan, 0x7F, 0x7C).astype(np.uint32), out)
    return ((out & np.uint32(0xFF)) | (sign >> np.uint32(24))).astype(np.uint8)


def _chunks_of(record: Record, size: int) -> Iterator[Any]:
    """``record``'s bytes in ``size``-byte chunks (the last may be shorter): a local span is
    read a chunk at a time, anything else (a computed, compressed or remote record) re-cut."""
    span = record.span
    if span is None:
        yield from _exact_chunks(record_bytes(record), size)
        return
    fd = os.open(span.path, os.O_RDONLY)
    try:
        yield from pread_chunks(fd_pread(fd), span.offset, span.nbytes, chunk=size)
    finally:
        os.close(fd)


def _exact_chunks(pieces: Iterable[bytes], size: int) -> Iterator[Any]:
    """``pieces`` re-cut into ``size``-byte chunks (the last may be shorter)."""
    pending = b""
    for piece in pieces:
        data = pending + bytes(piece) if pending else piece
        view, start = memoryview(data), 0
        while len(data) - start >= size:
            yield view[start : start + size]
            start += size
        pending = bytes(view[start:])
    if pending:
        yield pending


def _accumulate(
    streams: Sequence[Iterator[Any]],
    weights: Sequence[float],
    lane: str,
    count: int,
    total: float,
    complex_parts: bool = False,
) -> np.ndarray:
    """The next ``count`` elements' mean (``complex_parts``: complex parts, multiplied and
    divided as torch's complex kernels do): each input's chunk is kept until the mean is taken.

    Raises:
        OSError: an input ended early.
    """
    acc = np.zeros(count, np.float64)
    chunks = []
    for i, (stream, w) in enumerate(zip(streams, weights)):
        data = next(stream, b"")
        if len(data) != count * _size(lane):
            raise OSError(5, f"an input ended early: {len(data)} of {count * _size(lane)} bytes")
        chunks.append(data)
        with np.errstate(all="ignore"):
            acc += _term(data, lane, w, complex_parts and i > 0, complex_parts)
    with np.errstate(all="ignore"):
        # Any NaN term leaves a NaN in the sum, so a NaN-free sum (the common case) needs no
        # further look; a false alarm (inf - inf) only costs the look. bf16 keeps no NaN bits.
        if lane != "bfloat16" and np.isnan(np.add.reduce(acc)):
            _keep_last_nan(acc, chunks, weights, lane, complex_parts)
        if complex_parts:
            _divide_complex(acc, total)
        else:
            acc /= total
    return acc


def _term(
    data: Any, lane: str, w: float, added: bool = False, complex_parts: bool = False
) -> np.ndarray:
    """``w * x`` for one input's chunk, as torch's sum adds it.

    A complex element is multiplied by ``w + 0j`` as a complex product, as torch multiplies it
    by a Python float (``1.0 * (inf + 0j)`` is ``inf + nanj``; zeros' signs follow from
    ``re * 0.0``). Each term ``added`` to the sum is multiplied by ``1 + 0j`` once more, as
    torch's ``a + b`` computes ``a + alpha * b`` (an infinite part spreads NaN to the other).
    """
    x = _to_f64(data, lane)
    # Infinities of both signs give NaN and large values overflow to inf, as in torch;
    # numpy would also warn on stderr, which is not the place for it.
    with np.errstate(all="ignore"):
        if not complex_parts:
            return x * w
        out = _times_real(x, w)
        return _times_real(out, 1.0) if added else out


def _times_real(x: np.ndarray, w: float) -> np.ndarray:
    """Interleaved complex parts times ``w + 0j``, as a complex product."""
    re, im = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = re * w - im * 0.0
    out[1::2] = re * 0.0 + im * w
    return out


def _divide_complex(acc: np.ndarray, total: float) -> None:
    """Divide interleaved complex parts by the real ``total`` in place, as torch divides a
    complex tensor by a Python float: Smith's division by ``total + 0j``, its reciprocal
    multiplied rather than divided by."""
    ratio = 0.0 / total
    scale = 1.0 / (total + 0.0 * ratio)
    re, im = acc[0::2].copy(), acc[1::2].copy()
    with np.errstate(all="ignore"):
        acc[0::2] = (re + im * ratio) * scale
        acc[1::2] = (im - re * ratio) * scale


def _keep_last_nan(
    acc: np.ndarray,
    chunks: Sequence[Any],
    weights: Sequence[float],
    lane: str,
    complex_parts: bool = False,
) -> None:
    """Give each NaN of ``acc`` the bits of the last NaN term ``w * x`` there, as torch's sum
    does (its ``a + b`` keeps ``b``'s NaN; numpy's keeps either, depending on the loop)."""
    where = np.flatnonzero(np.isnan(acc))
    # Only the elements holding a NaN are read again (a complex one whole: both its parts
    # make each part's term); ``at`` is each NaN lane's place among the picked lanes.
    parts = 2 if complex_parts else 1
    elements = np.unique(where // parts)
    at = np.searchsorted(elements, where // parts) * parts + where % parts
    size = _size(lane) * parts
    for i, (data, w) in enumerate(zip(chunks, weights)):
        picked = np.frombuffer(data, np.uint8).reshape(-1, size)[elements].tobytes()
        term = _term(picked, lane, w, complex_parts and i > 0, complex_parts)[at]
        nan = np.isnan(term)
        acc[where[nan]] = term[nan]


def _size(lane: str) -> int:
    return itemsize(lane)


def mean_record(
    sources: Sequence[Record],
    weights: Sequence[float],
    dtype: str,
    nbytes: int,
    views: Sequence[TensorRef] = (),
) -> Record:
    """The record streaming the weighted mean of ``sources`` (each ``nbytes`` of ``dtype``).

    The mean is cast back as torch casts each tensor's mean: where ``sources`` are storages
    holding ``views``, each view's run of elements is cast on its own (NaN bits depend on
    where in the tensor cast an element lies), as
    :func:`~ckpt_tools.ops.transform.view_casts.storage_cast_record` casts a storage.

    Args:
        sources: one record per input: its elements, in the output's order.
        weights: from :func:`checked_weights`, one per source.
        dtype: a key of :data:`MEAN_DTYPES`.
        nbytes: the bytes each source holds, and the mean.
        views: the first input's tensors on the storage averaged, in the output's order;
            none for a tensor's own elements (one run).

    Returns:
        A :class:`Record` whose producer reads a chunk of every source at a time.

    Raises:
        OSError: (when produced) a source ends early.

    Example:
        >>> source = Record(4, pieces=())
        >>> mean_record([source, source], [1.0, 1.0], "float32", 4).action
        'mean of 2'
    """
    lane = MEAN_DTYPES[dtype]
    size = _size(lane)
    numel, total = nbytes // size, float(sum(weights))
    complex_parts = dtype.startswith("complex")
    parts = itemsize(dtype) // size  # lanes per element: a complex element is two floats
    same = [v for v in views if v.dtype == dtype]
    bounds = run_bounds(same, nbytes // itemsize(dtype)) if same else None
    runs = [0, numel] if bounds is None else [b * parts for b in bounds]

    def produce() -> Iterable[bytes]:
        streams = [_chunks_of(s, _CHUNK * size) for s in sources]
        try:
            for first in range(0, numel, _CHUNK):
                count = min(_CHUNK, numel - first)
                acc = _accumulate(streams, weights, lane, count, total, complex_parts)
                yield _from_f64(acc, lane, first, runs)
        finally:
            for stream in streams:
                stream.close()

    return Record(nbytes, produce=produce, action=f"mean of {len(sources)}")

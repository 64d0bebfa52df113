"""LoRA merges in numpy, in PEFT's order of operations on the CPU.

PEFT computes ``B @ A`` in float32 (16-bit adapters upcast first), transposes it for
``fan_in_fan_out``, multiplies by the scaling, rounds the delta back to the adapter's dtype,
and adds it to the weight in the dtype torch promotes the two to, rounding once to the
weight's dtype. Every rounding here is one torch makes, at the same place: a value held in
float32 is rounded to a 16-bit dtype exactly as ``tensor.to`` rounds it
(:func:`~ckpt_tools.io.casting.cast_array`).
"""

from __future__ import annotations

import numpy as np

from ckpt_tools.io.casting import cast_array

__all__ = [
    "dora_merge",
    "from_bits",
    "lora_delta",
    "matmul",
    "plain_merge",
    "promote",
    "rounded",
    "row_norm",
    "to_bits",
]

_NP = {"float64": np.float64, "float32": np.float32}
_TILE = 1 << 17  # elements of a matmul tile: 1 MiB of float64
_LANES = 8  # float32 lanes of torch's AVX2 reduction kernels


def promote(a: str, b: str) -> str:
    """The dtype torch computes ``a op b`` in, for floating dtypes (two 16-bit kinds: float32).

    Example:
        >>> promote("bfloat16", "float32"), promote("bfloat16", "bfloat16")
        ('float32', 'bfloat16')
    """
    if a == b:
        return a
    return "float64" if "float64" in (a, b) else "float32"


def _calc(dtype: str) -> type:
    return np.float64 if dtype == "float64" else np.float32


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (float32 or float64) rounded to ``dtype``'s values, held in its compute type.

    Example:
        >>> rounded(np.array([1 + 2**-9], np.float32), "bfloat16").tolist()
        [1.0]
    """
    if dtype in _NP:
        return x.astype(_NP[dtype], copy=False)
    src = "float64" if x.dtype == np.float64 else "float32"
    bits = cast_array(x.reshape(-1).view(_bits(src)), src, dtype)
    return from_bits(bits, dtype).reshape(x.shape)


def _bits(dtype: str) -> type:
    return {"float64": np.uint64, "float32": np.uint32}.get(dtype, np.uint16)


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Values of ``dtype`` from their bit patterns, as float32 (float64 stays float64)."""
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return bits.view(_NP[dtype])


def to_bits(x: np.ndarray, dtype: str) -> bytes:
    """``x`` (already rounded to ``dtype``'s values, or to be rounded) as ``dtype``'s bytes."""
    if dtype in _NP:
        return (
            np.ascontiguousarray(x, _NP[dtype]).astype("<" + np.dtype(_NP[dtype]).str[1:]).tobytes()
        )
    src = "float64" if x.dtype == np.float64 else "float32"
    flat = np.ascontiguousarray(x).reshape(-1).view(_bits(src))
    return cast_array(flat, src, dtype).astype("<u2").tobytes()


def matmul(b: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``b @ a`` in float32 as torch's CPU matmul (MKL's sgemm) computes it for a small inner
    dimension: for each element, one fused multiply-add per ``k``, in order.

    A fused multiply-add rounds once: the product of two float32 values is exact in float64,
    and so (but for a double rounding too rare to meet) is its sum with the accumulator,
    rounded to float32 at each step. numpy's own matmul sums in another order. float64
    inputs are multiplied by numpy.

    Example:
        >>> b = np.array([[1.0, 2**-24]], np.float32); a = np.array([[1.0], [1.0]], np.float32)
        >>> matmul(b, a).tolist()  # 1 + 2**-24 rounds to 1 in float32
        [[1.0]]
    """
    if np.float64 in (a.dtype.type, b.dtype.type):
        return b.astype(np.float64) @ a.astype(np.float64)
    b64, a64 = b.astype(np.float64), a.astype(np.float64)
    acc = np.zeros((b.shape[0], a.shape[1]), np.float32)
    # Tiles of rows that stay in the cache while every k passes over them.
    rows = max(1, _TILE // max(a.shape[1], 1))
    step = np.empty((rows, a.shape[1]), np.float64)
    for first in range(0, b.shape[0], rows):
        tile, out = b64[first : first + rows], acc[first : first + rows]
        buf = step[: len(tile)]
        for k in range(a.shape[0]):
            np.multiply(tile[:, k, None], a64[None, k, :], out=buf)
            buf += out
            out[...] = buf
    return acc


def lora_delta(
    a: np.ndarray, b: np.ndarray, scaling: float, transpose: bool, adapter_dtype: str
) -> np.ndarray:
    """``transpose(B @ A) * scaling`` as PEFT's ``get_delta_weight`` computes it on the CPU.

    Args:
        a, b: the adapter's A ``(r, in)`` and B ``(out, r)``, as float32 (float64 kept).
        scaling: the module's scaling.
        transpose: ``fan_in_fan_out`` (GPT-2 ``Conv1D``), and every embedding.
        adapter_dtype: the adapter's dtype; a 16-bit delta is rounded back to it.

    Returns:
        The delta, in the weight's layout, holding ``adapter_dtype``'s values.

    Example:
        >>> a = np.ones((2, 3), np.float32); b = np.ones((4, 2), np.float32)
        >>> lora_delta(a, b, 0.5, False, "float32").tolist()[0]
        [1.0, 1.0, 1.0]
    """
    delta = matmul(b, a)
    calc = delta.dtype.type
    if transpose:
        delta = delta.T
    # torch multiplies a float32 tensor by a Python float in float32.
    delta = delta * calc(scaling)
    return rounded(np.ascontiguousarray(delta), adapter_dtype)


def plain_merge(w: np.ndarray, w_dtype: str, delta: np.ndarray, delta_dtype: str) -> np.ndarray:
    """``W + delta`` in the dtype torch promotes them to (the weight's values as float32).

    Returns:
        The sum, to be rounded once to the weight's dtype (:func:`to_bits`).

    Example:
        >>> plain_merge(np.ones(2, np.float32), "float32", np.ones(2, np.float32), "float32")
        array([2., 2.], dtype=float32)
    """
    calc = _calc(promote(w_dtype, delta_dtype))
    return rounded(
        w.astype(calc, copy=False) + delta.astype(calc, copy=False), promote(w_dtype, delta_dtype)
    )


def row_norm(rows: np.ndarray) -> np.ndarray:
    """Each row's 2-norm, summed in the order torch's CPU kernel sums a contiguous float32
    or float64 row.

    That kernel (AVX2: 8 float32 or 4 float64 lanes) adds the squares of each 8 (4) elements
    into as many accumulators, adds the accumulators from the first to the last, then the
    squares of the last ``n % 8`` (``n % 4``) elements one by one. A row read with a stride
    (a ``Conv1D`` weight's column) takes another kernel, whose order this does not follow:
    there, and on machines whose torch uses other vector widths, the norm may differ in its
    last place.

    Example:
        >>> row_norm(np.array([[3.0, 4.0]], np.float32)).tolist()
        [5.0]
    """
    if rows.dtype not in (np.float32, np.float64) or not rows.flags.c_contiguous:
        return np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=rows.dtype))
    width = _LANES * 4 // rows.dtype.itemsize  # one 256-bit register's elements
    full = rows.shape[1] - rows.shape[1] % width
    lanes = np.zeros((rows.shape[0], width), rows.dtype)
    for first in range(0, full, width):
        block = rows[:, first : first + width]
        lanes += block * block
    total = lanes[:, 0].copy()
    for lane in range(1, width):
        total += lanes[:, lane]
    for column in range(full, rows.shape[1]):
        total += rows[:, column] * rows[:, column]
    return np.sqrt(total)


def dora_merge(
    w: np.ndarray,
    w_dtype: str,
    delta: np.ndarray,
    delta_dtype: str,
    magnitude: np.ndarray,
    magnitude_dtype: str,
    transpose: bool,
) -> np.ndarray:
    """DoRA's merge: ``(m / ||W + delta||_row) * (W + delta)``, in PEFT's order.

    The norm is taken per output row (over the input dimension), after undoing
    ``fan_in_fan_out``; each output row of ``W + delta`` is then scaled by its factor.

    Returns:
        The merged weight, to be rounded once to the weight's dtype.

    Example:
        >>> w = np.array([[3.0, 0.0]], np.float32); d = np.array([[0.0, 4.0]], np.float32)
        >>> dora_merge(w, "float32", d, "float32", np.array([10.0], np.float32), "float32", False)
        array([[6., 8.]], dtype=float32)
    """
    summed = promote(w_dtype, delta_dtype)
    total = plain_merge(w, w_dtype, delta, delta_dtype)
    rows = total.T if transpose else total
    calc = _calc(summed)
    norm = rounded(row_norm(rows).astype(calc), summed)
    factor_dtype = promote(magnitude_dtype, summed)
    factor = rounded(
        magnitude.astype(_calc(factor_dtype)) / norm.astype(_calc(factor_dtype)), factor_dtype
    )
    out_dtype = promote(factor_dtype, summed)
    factor = factor.reshape(1, -1) if transpose else factor.reshape(-1, 1)
    return rounded(factor.astype(_calc(out_dtype)) * total.astype(_calc(out_dtype)), out_dtype)

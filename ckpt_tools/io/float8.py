"""float8 values widened to float32, bitwise equal to torch's ``tensor.float()`` on the CPU.

Every float8 value is exactly a float32 value, so the widening is a table of 256 entries per
format, built here from the format's layout (sign, exponent bits, mantissa bits, bias). What
the layout leaves to torch is how NaNs come out, measured with torch 2.13 (the same on every
thread count and for every element, as torch converts float8 one element at a time):

=====================  ====================================================================
format                 NaN becomes
=====================  ====================================================================
``float8_e4m3fn``      ``0x7ff00000``, with its sign (its NaNs are ``0x7f`` and ``0xff``)
``float8_e5m2``        as fp16 -> fp32: quiet, sign and payload kept (it is fp16's top byte)
``*fnuz``, ``e8m0fnu`` ``0x7f800001`` (their one NaN, ``0x80``; ``0xff`` for ``e8m0fnu``)
=====================  ====================================================================
"""

from __future__ import annotations

import functools

import numpy as np

from ckpt_tools.dtypes import FLOATING

__all__ = ["FLOAT8_DTYPES", "float8_to_float32"]

#: (exponent bits, mantissa bits, exponent bias) of each float8 format with a sign bit.
_LAYOUTS: dict[str, tuple[int, int, int]] = {
    "float8_e4m3fn": (4, 3, 7),
    "float8_e5m2": (5, 2, 15),
    "float8_e4m3fnuz": (4, 3, 8),
    "float8_e5m2fnuz": (5, 2, 16),
}
#: The float8 formats :func:`float8_to_float32` widens.
FLOAT8_DTYPES: tuple[str, ...] = tuple(d for d in FLOATING if d.startswith("float8_"))


def float8_to_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Widen float8 bit patterns to float32 bit patterns, as torch's ``.float()`` does.

    Args:
        bits: the float8 values as ``uint8``.
        dtype: one of :data:`FLOAT8_DTYPES`.

    Returns:
        The float32 bit patterns, a new ``uint32`` array.

    Raises:
        ValueError: ``dtype`` is not a float8 format.

    Example:
        >>> import numpy as np
        >>> raw = np.array([0x38, 0x7E, 0x01, 0xFF], dtype=np.uint8)
        >>> float8_to_float32(raw, "float8_e4m3fn").view(np.float32)[:3].tolist()
        [1.0, 448.0, 0.001953125]
        >>> hex(float8_to_float32(raw, "float8_e4m3fn")[3])
        '0xfff00000'
    """
    if dtype not in FLOAT8_DTYPES:
        raise ValueError(f"{dtype} is not a float8 format: expected one of {FLOAT8_DTYPES}")
    return _table(dtype)[np.asarray(bits, dtype=np.uint8)]


@functools.cache
def _table(dtype: str) -> np.ndarray:
    b = np.arange(256, dtype=np.int64)
    if dtype == "float8_e8m0fnu":  # an exponent alone: 2 ** (b - 127); 0xff is NaN
        with np.errstate(over="ignore"):  # 2 ** 128, 0xff's, is past float32: NaN below
            out = np.ldexp(1.0, b - 127).astype(np.float32).view(np.uint32)
        out[0xFF] = 0x7F800001
        return out
    ebits, mbits, bias = _LAYOUTS[dtype]
    sign, exponent, mantissa = b >> 7, (b >> mbits) & ((1 << ebits) - 1), b & ((1 << mbits) - 1)
    subnormal = np.ldexp(mantissa.astype(np.float64), 1 - bias - mbits)
    normal = np.ldexp(1.0 + mantissa / (1 << mbits), exponent - bias)
    magnitude = np.where(exponent == 0, subnormal, normal)
    out = np.where(sign == 1, -magnitude, magnitude).astype(np.float32).view(np.uint32)
    sign_bit = (sign << 31).astype(np.uint32)
    if dtype == "float8_e5m2":  # fp16's top byte: its top exponent is inf and NaN
        top = exponent == (1 << ebits) - 1
        quiet_nan = sign_bit | np.uint32(0x7FC00000) | (mantissa << 21).astype(np.uint32)
        inf = sign_bit | np.uint32(0x7F800000)
        out = np.where(top, np.where(mantissa == 0, inf, quiet_nan), out)
    elif dtype == "float8_e4m3fn":  # no inf; all ones is NaN
        out = np.where((b & 0x7F) == 0x7F, sign_bit | np.uint32(0x7FF00000), out)
    else:  # fnuz: no inf, no negative zero; the negative zero's pattern is the one NaN
        out[0x80] = 0x7F800001
    return out.astype(np.uint32)

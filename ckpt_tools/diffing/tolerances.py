"""The tolerances of a value diff, checked before anything is read.

``rtol`` and ``atol`` reach ``torch.isclose`` and the streamed comparison as floats; anything
that is not a finite real number >= 0 is refused here, as a :class:`UsageError` naming the
argument, rather than as whatever torch or ``float()`` would raise halfway through a diff.
"""

from __future__ import annotations

import math
import numbers

from ckpt_tools._escape import short_repr
from ckpt_tools.errors import UsageError

__all__ = ["check_tolerances"]

#: What a tolerance must be, as every refusal words it.
EXPECTED = "tolerances must be finite numbers >= 0"


def _tolerance(name: str, value: object) -> float:
    """``value`` as a float, or the :class:`UsageError` that names ``name``."""
    got = ""
    # bool is an int to Python, but True as a tolerance is a mistake, not 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = f", got {type(value).__name__}"
    else:
        try:
            number = float(value)
        except OverflowError:  # an int past float's range: not finite either
            got = ", got an int too large for a float"
        else:
            if math.isfinite(number) and number >= 0:
                return number
    raise UsageError(
        EXPECTED + got,
        argument=name,
        value=short_repr(value),
        flag="--rtol" if name == "rtol" else "--atol",  # literals, which tests match to options
    )


def check_tolerances(rtol: object, atol: object) -> tuple[float, float]:
    """Refuse a tolerance that is not a finite real number >= 0; return both as floats.

    NaN makes ``|a - b| <= atol + rtol * |b|`` false everywhere yet was counted close; an
    infinite one accepts every finite difference (and ``inf * 0`` is NaN where ``b`` is 0).
    A string, None or a bool is a mistake, refused rather than converted.

    Args:
        rtol: relative tolerance: an int, a float or another ``numbers.Real`` (numpy's).
        atol: absolute tolerance, likewise.

    Returns:
        ``(rtol, atol)`` as floats.

    Raises:
        UsageError: naming the first bad one (``rtol``, then ``atol``) and its value.

    Example:
        >>> check_tolerances(0, 1e-8)
        (0.0, 1e-08)
        >>> check_tolerances(1e-5, float("nan"))
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: atol=nan: tolerances must be finite numbers >= 0
        >>> check_tolerances("1e-3", 0.0)
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: rtol='1e-3': tolerances must be finite numbers >= 0, got str
    """
    return _tolerance("rtol", rtol), _tolerance("atol", atol)

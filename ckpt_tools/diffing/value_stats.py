"""Streamed value statistics of two tensors: bit equality, max abs/rel diff, allclose, NaN/Inf.

Fed chunk by chunk (:meth:`ValueStats.add`), so two large tensors compare in bounded memory.
This is the one value comparison of ckpt_tools: :func:`ckpt_tools.diffing.engine.diff`
streams file tensors through it, and the harness's parity checks compare model outputs
with :func:`compare_tensors`.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace

import torch

from ckpt_tools.diffing.parts import TensorDiff
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import UsageError
from ckpt_tools.loading.tensor_io import dtype_name

__all__ = [
    "ValueStats",
    "compare_tensors",
    "compute_dtype",
    "flat_cpu",
    "tensor_stats",
    "with_stats",
    "with_view_bits",
]

# Dtypes whose values are compared in float32, float64 or complex; any other dtype is
# compared by its bits only. (A quantized tensor's values are its dequantized float32 ones.)
# Every value of these (powers of two for e8m0, its NaN too) is exact in float32.
_FLOAT32_OK = {"float32", "float16", "bfloat16", "float8_e5m2", "float8_e4m3fn"}
_FLOAT32_OK |= {"float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu"}
_FLOAT64 = {"float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
_FLOAT64 |= {"bool", "qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
_COMPLEX = {"complex32", "complex64", "complex128"}


def compute_dtype(a: str, b: str) -> torch.dtype | None:
    """The dtype two tensors' values are compared in.

    Args:
        a: one side's dtype name (``"float16"``, ``"int64"``, ...).
        b: the other side's.

    Returns:
        ``float32`` when both fit it exactly, ``float64`` for wider or integer dtypes,
        a complex dtype when either side is complex, or ``None`` when the values cannot
        be compared as numbers (only their bits can).

    Example:
        >>> compute_dtype("bfloat16", "float16"), compute_dtype("float32", "int64")
        (torch.float32, torch.float64)
    """
    names = {a, b}
    if names <= _COMPLEX | _FLOAT32_OK | _FLOAT64 and names & _COMPLEX:
        narrow = {"complex32", "complex64"} | _FLOAT32_OK
        return torch.complex64 if names <= narrow else torch.complex128
    if names <= _FLOAT32_OK:
        return torch.float32
    if names <= _FLOAT32_OK | _FLOAT64:
        return torch.float64
    return None


# Integer views of each element size: comparing them is comparing bits (-0.0 != 0.0).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_INTEGRAL = _FLOAT64 - {"float64"}


class ValueStats:
    """Running comparison of one tensor pair, fed chunk by chunk.

    Args:
        dtype_a: dtype name of side A.
        dtype_b: dtype name of side B (the reference: relative differences divide by it).
        rtol: relative tolerance, as in ``torch.isclose``.
        atol: absolute tolerance, as in ``torch.isclose``.

    Attributes:
        bit_equal: same dtype and the same bytes so far (``-0.0`` differs from ``0.0``).
        compute: the dtype values are compared in, or ``None`` (bits only).
        max_abs: largest ``|a - b|`` where neither side is NaN.
        max_rel: largest ``|a - b| / |b|`` (``inf`` where ``b`` is 0 and ``a`` is not).
        mismatched: elements not within ``atol + rtol * |b|`` (NaN in the same place is close).
        nan_a, nan_b, inf_a, inf_b: NaN and infinity counts of each side.
        numel: elements fed so far.

    Example:
        >>> stats = ValueStats("float32", "float32", rtol=0.0, atol=0.0)
        >>> stats.add(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        >>> stats.bit_equal, stats.max_abs, stats.allclose
        (False, 0.5, False)
    """

    def __init__(self, dtype_a: str, dtype_b: str, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.same_dtype = dtype_a == dtype_b
        self.bits = _BITS.get(itemsize(dtype_a)) if self.same_dtype else None
        self.bit_equal = self.same_dtype
        self.compute = compute_dtype(dtype_a, dtype_b)
        self.may_be_nonfinite = not {dtype_a, dtype_b} <= _INTEGRAL
        self.max_abs = self.max_rel = 0.0
        self.mismatched = self.nan_a = self.nan_b = self.inf_a = self.inf_b = self.numel = 0

    @property
    def allclose(self) -> bool:
        """Every element so far is within tolerance (``torch.isclose(equal_nan=True)``)."""
        return self.mismatched == 0

    def repeat(self, times: int) -> None:
        """Count every element compared so far ``times`` over (a dim repeated, compared once)."""
        for name in ("mismatched", "nan_a", "nan_b", "inf_a", "inf_b", "numel"):
            setattr(self, name, getattr(self, name) * times)

    def add(self, ca: torch.Tensor, cb: torch.Tensor) -> None:
        """Compare the next chunk of each side.

        Args:
            ca: a flat, contiguous CPU chunk of side A.
            cb: the chunk of side B at the same positions, as many elements.
        """
        self.numel += ca.numel()
        if ca.numel() == 0:  # nothing to compare, and max() of nothing raises
            return
        equal = False
        if self.bits is not None:
            equal = torch.equal(ca.view(self.bits), cb.view(self.bits))
            self.bit_equal = self.bit_equal and equal
        if self.compute is None:
            return
        x, y = ca.to(self.compute), cb.to(self.compute)
        # A finite sum means every element is finite (NaN and inf propagate): one cheap
        # reduction instead of isnan/isinf/isclose over the whole chunk.
        if self.may_be_nonfinite and not (
            bool(torch.isfinite(x.sum())) and (equal or bool(torch.isfinite(y.sum())))
        ):
            self._add_nonfinite(x, y)
            return
        if equal:
            return
        if _is_integer(ca) and _is_integer(cb):
            d = _integer_distance(ca, cb, x, y)
        else:
            d = _gap(x, y)
            if d.dtype in _WIDER and math.isinf(float(d.max())):
                d = _gap(_widened(x), _widened(y))
        y_abs = y.abs()
        tolerance = torch.mul(y_abs, self.rtol).add_(self.atol)
        self.mismatched += int(torch.gt(d, tolerance).sum())
        del tolerance
        self.max_abs = max(self.max_abs, float(d.max()))
        # 0/0 -> 0; d/0 -> inf (b is 0 and a is not), kept inf, not the largest float.
        rel = d.div_(y_abs).nan_to_num_(nan=0.0, posinf=math.inf)
        self.max_rel = max(self.max_rel, float(rel.max()))

    def _add_nonfinite(self, x: torch.Tensor, y: torch.Tensor) -> None:
        nan_x, nan_y = torch.isnan(x), torch.isnan(y)
        self.nan_a += int(nan_x.sum())
        self.nan_b += int(nan_y.sum())
        self.inf_a += int(torch.isinf(x).sum())
        self.inf_b += int(torch.isinf(y).sum())
        close = torch.isclose(x, y, rtol=self.rtol, atol=self.atol, equal_nan=True)
        self.mismatched += int((~close).sum())
        same = (x == y) | nan_x | nan_y  # NaN places are counted apart, not as distances
        d = torch.where(same, 0.0, _nonfinite_gap(_widened(x), _widened(y)))
        self.max_abs = max(self.max_abs, float(d.max()))
        # d/0 (b is 0) is inf, and inf/inf (b infinite) NaN: both stay inf, where
        # nan_to_num's default would make the first the largest float.
        r = torch.where(d == 0, 0.0, d / y.abs()).nan_to_num(nan=math.inf, posinf=math.inf)
        self.max_rel = max(self.max_rel, float(r.max()))


# Two finite values of opposite sign past half of float32's range differ by more than
# float32 holds: their gap is taken again one width up rather than shown as inf.
_WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.to(_WIDER.get(t.dtype, t.dtype))


def _gap(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|x - y|`` in the dtype of ``x`` and ``y`` (real for complex)."""
    return torch.abs(x - y) if x.is_complex() else torch.sub(x, y).abs_()


def _nonfinite_gap(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|x - y|`` where a complex part equal on both sides adds nothing: ``inf+0j`` against
    ``inf+1j`` is 1 apart, not NaN (``inf - inf``), which would hide it from ``max_abs``."""
    if not x.is_complex():
        return _gap(x, y)
    real = torch.where(x.real == y.real, 0.0, x.real - y.real)
    imag = torch.where(x.imag == y.imag, 0.0, x.imag - y.imag)
    return torch.hypot(real, imag)


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _integer_distance(
    a: torch.Tensor, b: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor
) -> torch.Tensor:
    """``|a - b|`` of two integer chunks as float64, never 0 where they differ.

    float64 holds integers exactly only up to 2**53: two int64 values past it that differ
    may be equal as float64. The difference is taken in int64 (float64 where it overflows),
    and rounds to a nonzero float64. uint64 values past 2**63 do not fit int64: two uint64
    sides take float64's distance, 1 where it is 0 but the bits differ.
    """
    if torch.uint64 in (a.dtype, b.dtype):
        d = torch.sub(a64, b64).abs_()
        if a.dtype != b.dtype:  # uint64 beside another integer dtype: float64's distance
            return d
        differ = a.view(torch.int64) != b.view(torch.int64)
        return torch.where(differ & (d == 0), 1.0, d)
    a, b = a.to(torch.int64), b.to(torch.int64)
    d = a - b
    overflowed = ((a ^ b) & (a ^ d)) < 0  # signs of a and b differ, and d's is not a's
    return torch.where(overflowed, torch.sub(a64, b64), d.to(torch.float64)).abs_()


def with_view_bits(tensor: torch.Tensor, bits: Collection[str] = ()) -> torch.Tensor:
    """``tensor`` with the view bits ``bits`` (``conj``, ``neg``) set, as torch.load sets a
    file tensor's, then resolved: the values torch shows for it, in memory of their own.

    Args:
        tensor: values read from a file (or an in-memory tensor, whose own bits count too).
        bits: the bits torch.load sets on it (:attr:`~ckpt_tools.descriptors.TensorRef.view_bits`).

    Returns:
        A tensor without view bits; ``tensor`` itself where it has none.

    Example:
        >>> with_view_bits(torch.tensor([1.0, -2.0]), {"neg"}).tolist()
        [-1.0, 2.0]
    """
    if bits:  # the call torch._utils._set_tensor_metadata makes on loading
        torch._C._set_tensor_metadata(tensor, dict.fromkeys(bits, True))
    return tensor.resolve_conj().resolve_neg()


def flat_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The values of ``tensor`` as one contiguous CPU row: conjugate and negative views
    resolved, a quantized tensor dequantized (its integers mean what its quantizer says).

    Example:
        >>> flat_cpu(torch.eye(2)).tolist()
        [1.0, 0.0, 0.0, 1.0]
    """
    tensor = tensor.detach()
    if tensor.is_quantized:
        tensor = tensor.to("cpu").dequantize()
    return with_view_bits(tensor.reshape(-1).to("cpu")).contiguous()


def _values_dtype(tensor: torch.Tensor) -> str:
    return "float32" if tensor.is_quantized else dtype_name(tensor.dtype)


def tensor_stats(
    a: torch.Tensor, b: torch.Tensor, *, rtol: float, atol: float, elements: int | None = None
) -> ValueStats:
    """Two whole tensors of one shape compared, ``elements`` values at a time.

    Values are what torch shows: view bits resolved, quantized tensors dequantized. Bit
    equality is ``torch.equal``'s where a side is quantized (same dtype, quantizer and
    integers): integers under another scale or zero point are other numbers.

    Args:
        a: a tensor on any device.
        b: the reference, of ``a``'s shape.
        rtol: relative tolerance for :attr:`ValueStats.allclose`.
        atol: absolute tolerance.
        elements: values compared at a time (None: all at once).

    Returns:
        The statistics of the pair.

    Example:
        >>> q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.qint8)
        >>> stats = tensor_stats(q, torch.tensor([1.0, 2.5]), rtol=0.0, atol=0.0)
        >>> stats.bit_equal, stats.max_abs
        (False, 0.5)
    """
    stats = ValueStats(_values_dtype(a), _values_dtype(b), rtol, atol)
    flat_a, flat_b = flat_cpu(a), flat_cpu(b)
    step = max(1, elements or flat_a.numel())
    for start in range(0, flat_a.numel(), step):
        stats.add(flat_a[start : start + step], flat_b[start : start + step])
    if a.is_quantized or b.is_quantized:  # the dequantized bits do not say it
        stats.bit_equal = a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    return stats


def compare_tensors(
    a: torch.Tensor, b: torch.Tensor, *, rtol: float = 0.0, atol: float = 0.0
) -> ValueStats:
    """Compare two whole in-memory tensors of the same shape.

    Args:
        a: a tensor on any device, of any layout.
        b: the reference (relative differences divide by it).
        rtol: relative tolerance for :attr:`ValueStats.allclose`.
        atol: absolute tolerance for :attr:`ValueStats.allclose`.

    Returns:
        The statistics of the pair (:func:`tensor_stats`): ``bit_equal`` (same dtype and
        bytes; a quantized pair's also the same quantizer), ``max_abs``, ``allclose`` and the
        NaN/Inf counts.

    Raises:
        UsageError: the shapes differ (there is no elementwise pairing).

    Example:
        >>> stats = compare_tensors(torch.tensor([0.0]), torch.tensor([-0.0]))
        >>> stats.bit_equal, stats.max_abs
        (False, 0.0)
    """
    if a.shape != b.shape:
        raise UsageError(
            f"compare_tensors needs tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return tensor_stats(a, b, rtol=rtol, atol=atol)


def with_stats(base: TensorDiff, stats: ValueStats) -> TensorDiff:
    """``base`` with the values ``stats`` compared (bits only where they are not numbers).

    Args:
        base: the pair's keys, dtypes, shapes and layouts.
        stats: its values, compared.

    Returns:
        The filled-in :class:`~ckpt_tools.diffing.parts.TensorDiff`.
    """
    if stats.compute is None:
        return replace(base, bit_equal=stats.bit_equal, numel=stats.numel)
    return replace(
        base,
        bit_equal=stats.bit_equal,
        max_abs=stats.max_abs,
        max_rel=stats.max_rel,
        allclose=stats.mismatched == 0,
        mismatched=stats.mismatched,
        nan_a=stats.nan_a,
        nan_b=stats.nan_b,
        inf_a=stats.inf_a,
        inf_b=stats.inf_b,
        numel=stats.numel,
    )

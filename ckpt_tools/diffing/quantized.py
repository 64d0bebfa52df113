"""Quantized tensors compared as torch sees them: bit-equal where ``torch.equal`` says so (the
same quantizer and the same integers), their values the dequantized ones.

A quantized tensor's integers mean nothing without its quantizer: the same integers under scale
0.1 and 0.2 are other numbers. So the integers are never compared alone. A file's tensor is
rebuilt with torch's own ``_rebuild_qtensor`` from its integers and its quantizer parameters (a
scheme and numbers, or per-channel tensors of scales and zero points), both read through the
:class:`~ckpt_tools.loading.tensor_io.TensorReader`, so it works for a URL's too. Each tensor is
read whole (a per-channel quantizer varies along an axis), then compared in chunks.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.diffing.parts import TensorDiff
from ckpt_tools.diffing.value_stats import tensor_stats, with_stats
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.pickle.standins import ConstantRef
from ckpt_tools.loading.tensor_io import TensorReader

__all__ = ["QUANTIZED_DTYPES", "compare_quantized", "file_qtensor", "quantizer_note"]

#: The dtype names of quantized tensors.
QUANTIZED_DTYPES = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})

# The parts of a quantizer, in the order a note names them.
_PER_TENSOR = ("qscheme", "scale", "zero_point")
_PER_CHANNEL = ("qscheme", "axis", "scales", "zero_points")


def file_qtensor(reader: TensorReader, ref: TensorRef, where: str) -> torch.Tensor:
    """A file's quantized tensor, as ``torch.load`` rebuilds it.

    Args:
        reader: reads the checkpoint's bytes.
        ref: the tensor (saved by ``torch._utils._rebuild_qtensor``).
        where: the side and key, for messages.

    Returns:
        The quantized CPU tensor, with its quantizer.

    Raises:
        CorruptCheckpointError: the tensor has no quantizer, or torch refuses the one saved.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> saved = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, torch.qint8)
        >>> torch.save({"q": saved}, "q.pt")
        >>> ckpt = open_checkpoint("q.pt")
        >>> with TensorReader(ckpt) as reader:
        ...     q = file_qtensor(reader, ckpt.root["q"], "q.pt: entry 'q'")
        >>> q.q_scale(), q.dequantize().tolist()
        (0.5, [1.0, 2.0])
    """
    saved = ref.func is not None and ref.func.name == "_rebuild_qtensor" and len(ref.args) > 4
    if not saved or not isinstance(ref.args[4], tuple):
        raise CorruptCheckpointError(f"{where}: a {ref.dtype} tensor saved without its quantizer")
    params = tuple(_parameter(reader, p, where) for p in ref.args[4])
    ints = reader.read(ref)  # the integers, strided as saved (or compacted)
    typed = torch.storage.TypedStorage(
        wrap_storage=ints.untyped_storage(), dtype=getattr(torch, ref.dtype), _internal=True
    )
    try:
        with warnings.catch_warnings():  # torch's own deprecations say nothing of the file
            warnings.simplefilter("ignore", UserWarning)
            return torch._utils._rebuild_qtensor(
                typed, ints.storage_offset(), ref.shape, ints.stride(), params, False, OrderedDict()
            )
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{where}: torch cannot rebuild this quantized tensor ({e})", path=where
        ) from e


def _parameter(reader: TensorReader, value: Any, where: str) -> Any:
    """One quantizer parameter built: a qscheme, a number, or a tensor of scales or zero points."""
    if isinstance(value, TensorRef):
        return reader.read(value)
    if isinstance(value, ConstantRef):
        scheme = getattr(torch, value.name, None) if value.module == "torch" else None
        if isinstance(scheme, torch.qscheme):
            return scheme
    elif isinstance(value, (int, float)):
        return value
    raise CorruptCheckpointError(f"{where}: its quantizer holds {value!r}", path=where)


def _quantizer(tensor: torch.Tensor) -> dict[str, Any]:
    if not tensor.is_quantized:
        return {}
    scheme = tensor.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        values = (scheme, tensor.q_scale(), tensor.q_zero_point())
        return dict(zip(_PER_TENSOR, values))
    values = (
        scheme,
        tensor.q_per_channel_axis(),
        tensor.q_per_channel_scales(),
        tensor.q_per_channel_zero_points(),
    )
    return dict(zip(_PER_CHANNEL, values))


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and torch.equal(x.double(), y.double())
    return type(x) is type(y) and x == y


def _shown(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return str(value).removeprefix("torch.")
    if value.numel() > 4:
        return f"({value.numel()} values)"
    # Scales saved as float32 read back as float64: 0.1, not 0.10000000149011612.
    return f"[{', '.join(f'{v:.8g}' for v in value.tolist())}]"


def quantizer_note(a: torch.Tensor, b: torch.Tensor) -> str:
    """What differs between the quantizers of two quantized tensors; empty where nothing does
    (or where a side is not quantized: its dtype says that).

    Example:
        >>> qa = torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.qint8)
        >>> qb = torch.quantize_per_tensor(torch.tensor([1.0]), 0.2, 0, torch.qint8)
        >>> quantizer_note(qa, qb)
        'quantizers differ: scale 0.1 / 0.2'
    """
    qa, qb = _quantizer(a), _quantizer(b)
    if not (qa and qb):
        return ""
    if qa["qscheme"] != qb["qscheme"]:
        names: tuple[str, ...] = ("qscheme",)
    else:
        names = tuple(n for n in qa if not _same(qa[n], qb[n]))
    shown = [f"{n} {_shown(qa[n])} / {_shown(qb[n])}" for n in names]
    return f"quantizers differ: {', '.join(shown)}" if shown else ""


def compare_quantized(
    base: TensorDiff, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, elements: int
) -> TensorDiff:
    """``base`` (same layout and shape on both sides, a side quantized) with its values compared.

    Args:
        base: the pair's keys, dtypes, shapes and layouts.
        a: side A's tensor, whole (quantized, or not where only B is).
        b: side B's.
        rtol: relative tolerance, as in ``torch.isclose``.
        atol: absolute tolerance.
        elements: values compared at a time.

    Returns:
        The comparison: ``bit_equal`` as ``torch.equal`` says, the statistics of the
        dequantized values, and a note naming the quantizer parameters that differ.
    """
    stats = tensor_stats(a, b, rtol=rtol, atol=atol, elements=elements)
    return replace(with_stats(base, stats), note=quantizer_note(a, b))

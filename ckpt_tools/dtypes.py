"""Dtype tables shared by every format, torch-free.

Names are torch's without the ``torch.`` prefix (``float32``, ``bfloat16``, ``int64``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BY_NAME_STORAGE_TYPES",
    "DTYPE_ITEMSIZE",
    "DTYPE_STORAGE_TYPE",
    "FLOATING",
    "SAFETENSORS_BITS",
    "SAFETENSORS_PACKED",
    "SAFETENSORS_TO_TORCH",
    "STORAGE_TYPE_DTYPE",
    "TORCH_TO_SAFETENSORS",
    "itemsize",
    "safetensors_nbytes",
    "safetensors_torch_shape",
]

# itemsize in bytes of each dtype name. Sub-byte packed types count their packed byte.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "float8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}
#: The dtypes torch's ``is_floating_point()`` holds for, float8 included, but the packed
#: ``float4_e2m1fn_x2`` (which torch has no cast for).
FLOATING: tuple[str, ...] = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

# torch's legacy typed storage classes (torch.FloatStorage, ...) as pickled by torch.save.
STORAGE_TYPE_DTYPE: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
    # Untyped storages count bytes.
    "UntypedStorage": "uint8",
}
#: The storage class names torch.load's unpickler takes by name from any module (its
#: ``StorageType`` table): the typed ones; ``x.UntypedStorage`` it imports from ``x``.
BY_NAME_STORAGE_TYPES: frozenset[str] = frozenset(STORAGE_TYPE_DTYPE) - {"UntypedStorage"}
# The typed storage class torch.save names for a tensor of each dtype (torch's own
# ``_dtype_to_storage_type_map``). Newer dtypes (float8, uint16, ...) have none: torch saves
# them on an ``UntypedStorage`` with ``_rebuild_tensor_v3``.
DTYPE_STORAGE_TYPE: dict[str, str] = {
    dtype: name for name, dtype in STORAGE_TYPE_DTYPE.items() if name != "UntypedStorage"
}

SAFETENSORS_TO_TORCH: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    # No "C128": safetensors (0.8) has no complex128 dtype; it refuses to save one and
    # fails to load a header naming it, so neither is written nor read here.
    "C64": "complex64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    # Two 4-bit elements a byte; the header counts elements (SAFETENSORS_PACKED).
    "F4": "float4_e2m1fn_x2",
}
# Bits per element of every dtype safetensors (0.8) knows, as its crate's ``Dtype::bitsize``:
# a header entry's byte count is its element count times this, over 8, and must be whole.
# F6_E2M3 and F6_E3M2 have no torch dtype, so they are in no other table: a file holding
# them is valid, but ``load_file`` cannot make their tensors, and neither can we.
SAFETENSORS_BITS: dict[str, int] = {
    **{tag: 8 * DTYPE_ITEMSIZE[name] for tag, name in SAFETENSORS_TO_TORCH.items()},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# Torch dtypes packing several safetensors elements in one: ``float4_e2m1fn_x2`` holds two
# F4 elements, so the header's last dimension is twice torch's (safetensors.torch halves it
# when loading, and doubles it when saving).
SAFETENSORS_PACKED: dict[str, int] = {"float4_e2m1fn_x2": 2}
TORCH_TO_SAFETENSORS: dict[str, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype name without ``torch.``).

    Raises:
        KeyError: for a dtype name this table does not know.
    """
    return DTYPE_ITEMSIZE[dtype]


# serde reads a safetensors shape as usize (u64): past it, the crate's checked products fail.
_USIZE_MAX = 2**64 - 1
# torch keeps sizes and strides as int64.
_INT64_MAX = 2**63 - 1


def safetensors_nbytes(tag: str, shape: Sequence[int]) -> int | None:
    """Bytes of a safetensors entry, as the crate's header check computes them.

    Its checked multiplication runs over the dimensions in order, so a later 0 does not
    save a product already past 64 bits; the bit count must fit too, and be whole bytes.

    Args:
        tag: the header's dtype (a key of :data:`SAFETENSORS_BITS`).
        shape: the header's shape, in elements.

    Returns:
        The byte count, or None where safetensors refuses the entry.

    Example:
        >>> safetensors_nbytes("F32", [2, 3]), safetensors_nbytes("F4", [2, 6])
        (24, 6)
        >>> safetensors_nbytes("F32", [2**32, 2**32, 0]), safetensors_nbytes("F4", [3])
        (None, None)
    """
    numel = 1
    for n in shape:
        numel *= n
        if numel > _USIZE_MAX:
            return None
    bits = numel * SAFETENSORS_BITS[tag]
    return bits // 8 if bits <= _USIZE_MAX and bits % 8 == 0 else None


def safetensors_torch_shape(dtype: str, shape: Sequence[int]) -> tuple[int, ...] | None:
    """The shape ``safetensors.torch`` gives a tensor of torch ``dtype`` stored with ``shape``.

    A packed dtype's last dimension holds :data:`SAFETENSORS_PACKED` elements in one.

    Returns:
        The torch shape, or None where torch can make no such tensor: the last dimension
        does not divide, or a size or contiguous stride is past int64, which torch keeps
        them in (a shape with a 0 has no bytes, so the file alone does not bound it).

    Example:
        >>> safetensors_torch_shape("float4_e2m1fn_x2", [2, 6])
        (2, 3)
        >>> safetensors_torch_shape("float4_e2m1fn_x2", [2, 3]) is None
        True
        >>> safetensors_torch_shape("float32", [0, 2**62, 2]) is None
        True
    """
    pack = SAFETENSORS_PACKED.get(dtype, 1)
    if pack > 1 and (not shape or shape[-1] % pack):
        return None
    view = (*shape[:-1], shape[-1] // pack) if pack > 1 else tuple(shape)
    stride = 1
    for n in reversed(view):
        if n > _INT64_MAX or stride > _INT64_MAX:
            return None
        stride *= max(n, 1)
    return view

"""Dtype tables shared by every format, torch-free.

Names are torch's without the ``torch.`` prefix (``float32``, ``bfloat16``, ``int64``).
"""

from __future__ import annotations

__all__ = [
    "DTYPE_ITEMSIZE",
    "DTYPE_STORAGE_TYPE",
    "SAFETENSORS_TO_TORCH",
    "STORAGE_TYPE_DTYPE",
    "TORCH_TO_SAFETENSORS",
    "itemsize",
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
}
TORCH_TO_SAFETENSORS: dict[str, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype name without ``torch.``).

    Raises:
        KeyError: for a dtype name this table does not know.
    """
    return DTYPE_ITEMSIZE[dtype]

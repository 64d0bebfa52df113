"""DCP chunks saved with ``SerializationFormat.SAFETENSORS``: a raw range in a safetensors blob.

With that serialization a rank's ``.distcp`` file holds its ``BYTE_IO`` archives, then one
safetensors file (header and data) whose tensors are keyed by fqn; every chunk's
``_StorageInfo`` points at the start of that blob, and ``__metadata__["DCP_SHARDING_INFO"]``
gives each tensor's ``saved_offsets`` in the global tensor. (torch 2.13's own
``FileSystemReader`` and ``dcp_to_torch_save`` fail on such folders: they ``torch.load`` the
raw range.) The header is parsed with the limits of the safetensors reader.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef
from ckpt_tools.dtypes import SAFETENSORS_TO_TORCH, itemsize
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.dcp.metadata import DcpChunk, DcpTensor
from ckpt_tools.formats.pickle.standins import storage_type_ref

__all__ = ["safetensors_chunk"]

# safetensors refuses longer headers (ckpt_tools.formats.safetensors.MAX_HEADER_BYTES).
_MAX_HEADER = 100_000_000
_SHARDING_KEY = "DCP_SHARDING_INFO"


def _header(path: str, fd: int, offset: int, size: int) -> dict[str, Any]:
    raw = os.pread(fd, 8, offset)
    if len(raw) != 8:
        raise CorruptCheckpointError(f"{path!r}: no safetensors header at byte {offset}")
    (length,) = struct.unpack("<Q", raw)
    if length > _MAX_HEADER or offset + 8 + length > size:
        raise CorruptCheckpointError(
            f"{path!r}: the item at byte {offset} is neither a torch archive nor a safetensors "
            f"header that fits in the file ({length} header bytes declared)"
        )
    try:
        header = json.loads(os.pread(fd, length, offset + 8))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path!r}: bad safetensors header at {offset} ({e})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path!r}: the safetensors header at {offset} is not a map")
    return {"__length__": length, **header}


def safetensors_chunk(
    path: str, fd: int, item: DcpTensor, chunk: DcpChunk
) -> tuple[TensorRef, ByteSpan]:
    """The tensor of ``item`` in the safetensors blob at ``chunk.offset``, located.

    Raises:
        CorruptCheckpointError: no such entry, or its dtype, shape, offsets or byte range
            disagree with the metadata or the file.
    """
    size = os.fstat(fd).st_size
    header = _header(path, fd, chunk.offset, size)
    entry = header.get(item.fqn)
    what = f"{path!r}: the chunk of {item.fqn!r} at {list(chunk.offsets)}"
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(
            f"{what} is missing from the safetensors blob at {chunk.offset}"
        )
    dtype = SAFETENSORS_TO_TORCH.get(entry.get("dtype"))  # type: ignore[arg-type]
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype != item.dtype or not isinstance(shape, list) or tuple(shape) != chunk.sizes:
        raise CorruptCheckpointError(
            f"{what} is stored as {entry.get('dtype')} {shape}, the metadata says "
            f"{item.dtype} {list(chunk.sizes)}"
        )
    start = chunk.offset + 8 + header["__length__"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(v, int) and v >= 0 for v in offsets)
        or offsets[1] - offsets[0] != _nbytes(dtype, chunk.sizes)
        or start + offsets[1] > size
    ):
        raise CorruptCheckpointError(f"{what} has data_offsets {offsets!r} that do not fit")
    sharding = (header.get("__metadata__") or {}).get(_SHARDING_KEY)
    if sharding is not None:
        try:
            saved = json.loads(sharding)[item.fqn]["saved_offsets"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{what}: bad {_SHARDING_KEY} metadata") from e
        if tuple(saved) != chunk.offsets:
            raise CorruptCheckpointError(f"{what} was saved at offsets {saved}")
    numel = _nbytes(dtype, chunk.sizes) // _nbytes(dtype, ())
    stride, step = [], 1
    for n in reversed(chunk.sizes):
        stride.append(step)
        step *= max(n, 1)
    storage = StorageRef("0", dtype, numel, "cpu", storage_type_ref(dtype))
    tensor = TensorRef(storage, 0, chunk.sizes, tuple(reversed(stride)), dtype)
    return tensor, ByteSpan(path, start + offsets[0], offsets[1] - offsets[0])


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    total = itemsize(dtype)
    for n in shape:
        total *= n
    return total

"""Reading safetensors headers: 8-byte little-endian length, a JSON header, then the bytes.

Each tensor owns its byte range, so each becomes its own :class:`StorageRef` keyed by name.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef
from ckpt_tools.dtypes import SAFETENSORS_TO_TORCH, itemsize
from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats.base import Checkpoint

__all__ = ["MAX_HEADER_BYTES", "open_safetensors", "read_header"]

# safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000


def read_header(path: str) -> tuple[int, dict[str, Any]]:
    """Read and parse a safetensors header.

    Returns:
        ``(data_start, header)``: the file offset where tensor bytes begin, and the header
        dict (tensor name -> entry, plus ``__metadata__``), in file order.

    Raises:
        CorruptCheckpointError: the header is malformed or does not fit the file.
        ResourceLimitError: the header is over :data:`MAX_HEADER_BYTES`.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptCheckpointError(f"{path!r} is too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise ResourceLimitError(
                f"{path!r}: safetensors header of {header_len} bytes is over the "
                f"{MAX_HEADER_BYTES} byte limit"
            )
        if 8 + header_len > size:
            raise CorruptCheckpointError(
                f"{path!r}: the header claims {header_len} bytes but the file has {size - 8}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path!r}: the safetensors header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path!r}: the safetensors header is not a JSON object")
    return 8 + header_len, header


def open_safetensors(path: str) -> Checkpoint:
    """Open a ``.safetensors`` file, reading its header only.

    Args:
        path: the file.

    Returns:
        A :class:`Checkpoint` whose root is a dict of name -> :class:`TensorRef`.

    Raises:
        CorruptCheckpointError: bad dtype, shape, or offsets outside the data section.
    """
    data_start, header = read_header(path)
    data_len = os.path.getsize(path) - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CorruptCheckpointError(f"{path!r}: __metadata__ must map strings to strings")
    root: dict[str, TensorRef] = {}
    storages: dict[str, StorageRef] = {}
    spans: dict[str, ByteSpan] = {}
    for name, entry in header.items():
        try:
            dtype = SAFETENSORS_TO_TORCH[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{path!r}: header entry {name!r} is malformed or has an unknown dtype: {entry!r}"
            ) from e
        numel = 1
        for n in shape:
            numel *= n
        if (
            any(n < 0 for n in shape)
            or not 0 <= begin <= end <= data_len
            or end - begin != numel * itemsize(dtype)
        ):
            raise CorruptCheckpointError(
                f"{path!r}: tensor {name!r} ({dtype}, shape {list(shape)}) has byte range "
                f"[{begin}, {end}) that does not fit its size or the {data_len}-byte data section"
            )
        storage = StorageRef(key=name, dtype=dtype, numel=numel, device="cpu")
        stride = _contiguous_stride(shape)
        storages[name] = storage
        spans[name] = ByteSpan(path, data_start + begin, end - begin)
        root[name] = TensorRef(storage=storage, offset=0, shape=shape, stride=stride, dtype=dtype)

    return Checkpoint(
        path=path,
        format="safetensors",
        root=root,
        storages=storages,
        metadata=metadata,
        locate=lambda storage: spans[storage.key],
    )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride: list[int] = []
    running = 1
    for n in reversed(shape):
        stride.append(running)
        running *= max(n, 1)
    return tuple(reversed(stride))

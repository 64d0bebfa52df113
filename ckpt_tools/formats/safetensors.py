"""Reading safetensors headers: 8-byte little-endian length, a JSON header, then the bytes.

Each tensor owns its byte range, so each becomes its own :class:`StorageRef` keyed by name.
A tied name that the writer left out (safetensors' ``save_model``, our writers) comes back
from the metadata over its kept tensor's storage (:func:`tied_aliases`), as ``torch.load``
of the original gives both names over one storage.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef, short_repr
from ckpt_tools.dtypes import SAFETENSORS_TO_TORCH, itemsize
from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError, quote_foreign
from ckpt_tools.formats.base import Checkpoint, RangeSource

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_NESTING",
    "check_nesting",
    "open_safetensors",
    "read_header",
    "tied_aliases",
]

# safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000
# serde_json, the crate's parser, refuses arrays and objects nested deeper than this (its
# recursion limit of 128 counts the header's own object). Python's json has no such limit
# of its own: how deep it goes depends on the interpreter's stack and version.
MAX_NESTING = 127


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {twice!r} appears twice")
    return result


def check_nesting(path: str, header: dict[str, Any]) -> None:
    """Refuse a parsed header whose arrays and objects nest deeper than safetensors reads.

    Args:
        path: the file, for the message.
        header: the parsed header.

    Raises:
        CorruptCheckpointError: something in it is nested more than :data:`MAX_NESTING` deep.

    Example:
        >>> check_nesting("m.safetensors", {"w": {"shape": [2, 3]}})
        >>> deep: list = []
        >>> for _ in range(MAX_NESTING):
        ...     deep = [deep]
        >>> check_nesting("m.safetensors", {"w": deep})
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.CorruptCheckpointError: 'm.safetensors': ... (over 127 levels, ...)
    """
    level: list[Any] = [header]
    for _ in range(MAX_NESTING):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return
    raise CorruptCheckpointError(
        f"{path!r}: the safetensors header nests too deeply to be a header "
        f"(over {MAX_NESTING} levels, which safetensors refuses)"
    )


def read_header(path: str, *, source: RangeSource | None = None) -> tuple[int, dict[str, Any]]:
    """Read and parse a safetensors header, as strictly as the safetensors crate.

    Args:
        path: the file (its URL where ``source`` is given).
        source: the file read by ranges (a remote file); None reads ``path``.

    Returns:
        ``(data_start, header)``: the file offset where tensor bytes begin, and the header
        dict (tensor name -> entry, plus ``__metadata__``), in file order.

    Raises:
        CorruptCheckpointError: the header is malformed or does not fit the file.
        ResourceLimitError: the header is over :data:`MAX_HEADER_BYTES`.
    """
    if source is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return _parse_header(path, os.fstat(fd).st_size, lambda n, at: os.pread(fd, n, at))
        finally:
            os.close(fd)
    return _parse_header(path, source.size, source.pread)


def _parse_header(
    path: str, size: int, pread: Callable[[int, int], bytes]
) -> tuple[int, dict[str, Any]]:
    prefix = pread(8, 0)
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
    raw = pread(header_len, 8)
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("it does not start with '{'")
        # The crate's JSON parser: no NaN/Infinity, no repeated keys, strings valid UTF-8.
        header = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_duplicates)
        json.dumps(header, ensure_ascii=False).encode("utf-8")  # lone surrogates (\ud800)
    except RecursionError as e:
        raise CorruptCheckpointError(
            f"{path!r}: the safetensors header nests too deeply to be a header"
        ) from e
    except (UnicodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(
            f"{path!r}: the safetensors header is not JSON ({quote_foreign(e)})"
        ) from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path!r}: the safetensors header is not a JSON object")
    check_nesting(path, header)
    return 8 + header_len, header


def _is_index(value: Any) -> bool:
    # serde's usize: a JSON integer >= 0; not 1.0, true or "1".
    return type(value) is int and value >= 0


def _entry(path: str, name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of one header entry, or refused."""
    fields = entry if isinstance(entry, dict) else {}
    shape, offsets = fields.get("shape"), fields.get("data_offsets")
    tag = fields.get("dtype")
    dtype = SAFETENSORS_TO_TORCH.get(tag) if isinstance(tag, str) else None
    if (
        dtype is None
        or not isinstance(shape, list)
        or not all(_is_index(n) for n in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_index(v) for v in offsets)
    ):
        raise CorruptCheckpointError(
            f"{path!r}: header entry {name!r} is malformed or has an unknown dtype: "
            f"{short_repr(entry)} (expected dtype, shape of non-negative integers, and "
            "data_offsets [begin, end] of two non-negative integers)"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_layout(path: str, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Tensors tile the data section: in offset order, each begins where the last ended.

    ``spans`` holds ``(begin, nbytes, name)`` with ``begin`` inside the data section.
    """
    at = 0
    for begin, nbytes, name in sorted(spans):
        end = begin + nbytes
        if begin != at:
            what = "overlaps the previous one" if begin < at else f"leaves a gap at {at}"
            raise CorruptCheckpointError(
                f"{path!r}: tensor {name!r} at bytes [{begin}, {end}) {what}; safetensors "
                "tensors must cover the data section contiguously"
            )
        at = end
    if at != data_len:
        raise CorruptCheckpointError(
            f"{path!r}: the tensors cover {at} bytes of the {data_len}-byte data section; "
            "safetensors refuses a file whose data section does not match its header"
        )


def open_safetensors(path: str, *, source: RangeSource | None = None) -> Checkpoint:
    """Open a ``.safetensors`` file, reading its header only.

    The header is checked as the safetensors crate checks it: known dtypes, integer shapes
    and offsets, each tensor's byte count equal to its dtype size times its element count,
    and the tensors covering the data section exactly, without gaps or overlaps.

    Args:
        path: the file (its URL where ``source`` is given).
        source: the file read by ranges (a remote file); None reads ``path``.

    Returns:
        A :class:`Checkpoint` whose root is a dict of name -> :class:`TensorRef`.

    Raises:
        CorruptCheckpointError: bad dtype, shape or offsets, or a layout safetensors refuses.
    """
    data_start, header = read_header(path, source=source)
    size = os.path.getsize(path) if source is None else source.size
    data_len = size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CorruptCheckpointError(f"{path!r}: __metadata__ must map strings to strings")
    root: dict[str, TensorRef] = {}
    storages: dict[str, StorageRef] = {}
    spans: dict[str, ByteSpan] = {}
    for name, entry in header.items():
        dtype, shape, begin, end = _entry(path, name, entry)
        numel = math.prod(shape)
        if not begin <= end <= data_len or end - begin != numel * itemsize(dtype):
            raise CorruptCheckpointError(
                f"{path!r}: tensor {name!r} ({dtype}, shape {list(shape)}) has byte range "
                f"[{begin}, {end}) that does not fit its size or the {data_len}-byte data section"
            )
        storage = StorageRef(key=name, dtype=dtype, numel=numel, device="cpu")
        stride = _contiguous_stride(shape)
        storages[name] = storage
        spans[name] = ByteSpan(path, data_start + begin, end - begin)
        root[name] = TensorRef(storage=storage, offset=0, shape=shape, stride=stride, dtype=dtype)
    _check_layout(path, [(s.offset - data_start, s.nbytes, n) for n, s in spans.items()], data_len)
    aliases = tied_aliases(root, metadata)
    root.update((alias, root[kept]) for alias, kept in aliases.items())
    return Checkpoint(
        path=path,
        format="safetensors",
        root=root,
        storages=storages,
        metadata=_without(metadata, aliases),
        locate=lambda storage: spans[storage.key],
    )


def tied_aliases(stored: Mapping[str, Any], metadata: Mapping[str, Any] | None) -> dict[str, str]:
    """The tied names a writer left out, each with the stored name it shares memory with.

    ``safetensors.torch.save_model`` (and our writers, in a file's ``__metadata__`` or an HF
    index's ``metadata``) store tied tensors once and record ``{dropped name: kept name}``.
    Only that exact form is an alias: a metadata key that is not a stored tensor name, whose
    value is one; ``format`` is the writer's own key. Anything else stays plain metadata.
    The readers add each alias to the root over its kept tensor and take it out of the
    checkpoint's metadata; this is the one place that decides what an alias is.

    Args:
        stored: the tensors the file (or index) holds, by name.
        metadata: the file's ``__metadata__`` or the index's ``metadata`` (None when absent).

    Returns:
        ``{alias: stored name}``, in metadata order.

    Example:
        >>> tied_aliases({"emb.weight": 0}, {"format": "pt", "head.weight": "emb.weight"})
        {'head.weight': 'emb.weight'}
        >>> tied_aliases({"emb.weight": 0}, {"note": "head.weight", "emb.weight": "x"})
        {}
    """
    return {
        key: value
        for key, value in (metadata or {}).items()
        if key != "format" and key not in stored and isinstance(value, str) and value in stored
    }


def _without(metadata: dict[str, Any] | None, aliases: Mapping[str, str]) -> Any:
    """The metadata less its alias notes: those are names in the root now, and a writer
    records them again from the tensors (under the names they have then)."""
    if metadata is None or not aliases:
        return metadata
    return {k: v for k, v in metadata.items() if k not in aliases}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride: list[int] = []
    running = 1
    for n in reversed(shape):
        stride.append(running)
        running *= max(n, 1)
    return tuple(reversed(stride))

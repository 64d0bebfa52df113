"""Reading safetensors headers: 8-byte little-endian length, a JSON header, then the bytes.

Each tensor owns its byte range, so each becomes its own :class:`StorageRef` keyed by name.
The file reads as ``safetensors.torch.load_file`` reads it: its stored tensors, nothing more.
One exception, ours: a tied name our writers left out comes back over its kept tensor's
storage, from the reserved entry :data:`TIES_KEY` they write (:func:`tied_aliases`). The
``{dropped: kept}`` notes huggingface_hub and ``save_model`` write are plain metadata, as
every reference loader treats them: nothing in a file tells such a note from a description.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef, contiguous_stride
from ckpt_tools.dtypes import (
    SAFETENSORS_BITS,
    SAFETENSORS_TO_TORCH,
    safetensors_nbytes,
    safetensors_torch_shape,
)
from ckpt_tools.errors import (
    CorruptCheckpointError,
    ResourceLimitError,
    UnsupportedFormatError,
    quote_foreign,
)
from ckpt_tools.formats.base import Checkpoint, RangeSource
from ckpt_tools.formats.safetensors_json import loads_header

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_NESTING",
    "TIES_KEY",
    "check_nesting",
    "open_safetensors",
    "read_header",
    "read_metadata",
    "tie_metadata",
    "tied_aliases",
]

# safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000
# serde_json, the crate's parser, refuses arrays and objects nested deeper than this (its
# recursion limit of 128 counts the header's own object). Python's json has no such limit
# of its own: how deep it goes depends on the interpreter's stack and version.
MAX_NESTING = 127
#: The metadata entry our writers record tied names in: a JSON object ``{dropped: kept}``.
TIES_KEY = "ckpt_tools.tied"


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
        # The crate's JSON parser: JSON whitespace around the object, no NaN/Infinity, no
        # repeated keys, strings valid UTF-8.
        header = loads_header(text)
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
    # serde's usize (u64): a JSON integer in [0, 2**64), as a larger one is a float to serde;
    # not 1.0, true or "1".
    return type(value) is int and 0 <= value < 2**64


def _entry(path: str, name: str, entry: Any) -> tuple[str, tuple[int, ...], int, int]:
    """``(safetensors dtype, header shape, begin, end)`` of one header entry, or refused."""
    fields = entry if isinstance(entry, dict) else {}
    shape, offsets = fields.get("shape"), fields.get("data_offsets")
    tag = fields.get("dtype")
    if (
        not (isinstance(tag, str) and tag in SAFETENSORS_BITS)
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
    return tag, tuple(shape), offsets[0], offsets[1]


def _torch_view(
    path: str, name: str, tag: str, shape: tuple[int, ...]
) -> tuple[str, tuple[int, ...]]:
    """``(dtype, shape)`` of the tensor ``load_file`` makes of an entry (F4 ``[2, 6]`` loads
    as ``float4_e2m1fn_x2`` ``(2, 3)``), or refused where it can make none."""
    dtype = SAFETENSORS_TO_TORCH.get(tag)
    view = None if dtype is None else safetensors_torch_shape(dtype, shape)
    if dtype is None or view is None:
        lacks = "a dtype torch lacks" if dtype is None else "a shape no torch tensor has"
        raise UnsupportedFormatError(
            f"{path!r}: tensor {name!r} ({tag}, shape {list(shape)}) has {lacks}: neither "
            "safetensors.torch nor ckpt_tools can load it"
        )
    return dtype, view


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
        A :class:`Checkpoint` whose root is name -> :class:`TensorRef` by data offsets.

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
    entries = {name: _entry(path, name, entry) for name, entry in header.items()}
    # load_file's order; it leaves empty tensors at one offset unordered (here: the header's).
    for name in sorted(entries, key=lambda n: entries[n][2:]):
        tag, header_shape, begin, end = entries[name]
        nbytes = safetensors_nbytes(tag, header_shape)
        if nbytes is None or not begin <= end <= data_len or end - begin != nbytes:
            what = f"{path!r}: tensor {name!r} ({tag}, shape {list(header_shape)})"
            raise CorruptCheckpointError(
                f"{what} has a size past 64 bits or of no whole bytes, which safetensors refuses"
                if nbytes is None
                else f"{what} has byte range [{begin}, {end}) that does not fit its size or "
                f"the {data_len}-byte data section"
            )
        dtype, shape = _torch_view(path, name, tag, header_shape)
        storage = StorageRef(key=name, dtype=dtype, numel=math.prod(shape), device="cpu")
        stride = contiguous_stride(shape)
        storages[name] = storage
        spans[name] = ByteSpan(path, data_start + begin, end - begin)
        root[name] = TensorRef(storage=storage, offset=0, shape=shape, stride=stride, dtype=dtype)
    _check_layout(path, [(s.offset - data_start, s.nbytes, n) for n, s in spans.items()], data_len)
    aliases = tied_aliases(root, metadata, path)
    root.update((alias, root[kept]) for alias, kept in aliases.items())
    return Checkpoint(
        path=path,
        format="safetensors",
        root=root,
        storages=storages,
        metadata=read_metadata(metadata, aliases),
        locate=lambda storage: spans[storage.key],
    )


def tied_aliases(
    stored: Mapping[str, Any], metadata: Mapping[str, Any] | None, path: str = ""
) -> dict[str, str]:
    """The tied names our writers left out, each with the stored name it shares memory with.

    Only the reserved entry :data:`TIES_KEY` (a JSON object ``{dropped: kept}``) names them:
    the hub-style notes beside it (``{dropped: kept}`` as plain entries) are what
    huggingface_hub and ``save_model`` write too, and no reference loader rebuilds names from
    those, so a file without the entry reads as ``load_file`` reads it. The readers add each
    alias to the root over its kept tensor; this is the one place that decides what one is.

    Args:
        stored: the tensors the file (or index) holds, by name.
        metadata: the file's ``__metadata__`` or the index's ``metadata`` (None when absent).
        path: the file, for the message.

    Returns:
        ``{alias: stored name}``, in the entry's order; empty without the entry.

    Raises:
        CorruptCheckpointError: the entry is not a JSON object of names, a kept name is not
            a stored tensor, or a dropped name is one.

    Example:
        >>> meta = {"head.weight": "emb.weight", TIES_KEY: '{"head.weight": "emb.weight"}'}
        >>> tied_aliases({"emb.weight": 0}, meta)
        {'head.weight': 'emb.weight'}
        >>> tied_aliases({"emb.weight": 0}, {"head.weight": "emb.weight"})
        {}
    """
    raw = (metadata or {}).get(TIES_KEY)
    if raw is None:
        return {}
    try:
        ties = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:  # JSONDecodeError is a ValueError
        ties = None
    if not isinstance(ties, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in ties.items()
    ):
        raise CorruptCheckpointError(
            f"{path!r}: metadata entry {TIES_KEY!r} is not a JSON object of tensor names: "
            f"{short_repr(raw)}"
        )
    wrong = [f"{k!r} -> {v!r}" for k, v in ties.items() if k in stored or v not in stored]
    if wrong:
        raise CorruptCheckpointError(
            f"{path!r}: metadata entry {TIES_KEY!r} maps names that are not a left-out name "
            f"and a stored tensor: {', '.join(wrong[:5])}"
        )
    return ties


def read_metadata(metadata: Mapping[str, Any] | None, aliases: Mapping[str, str]) -> Any:
    """The metadata a reader keeps: all but the ties it restored.

    The reserved entry and the notes of the ties restored from it are names in the root now,
    and a writer records them again from the tensors (under the names they have then).

    Args:
        metadata: the file's ``__metadata__`` or the index's ``metadata`` (None when absent).
        aliases: the ties restored, from :func:`tied_aliases`.

    Returns:
        The metadata to keep (None when absent); values other than strings as they are.

    Example:
        >>> read_metadata({"format": "pt", "h": "e", TIES_KEY: '{"h": "e"}'}, {"h": "e"})
        {'format': 'pt'}
    """
    if metadata is None:
        return None
    return {
        k: v
        for k, v in metadata.items()
        if k != TIES_KEY and not (k in aliases and v == aliases[k])
    }


def tie_metadata(
    ties: Mapping[str, str], beside: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The metadata entries that record the tied names an output leaves out.

    The hub-style notes (``{dropped: kept}`` as plain entries, which huggingface_hub writes
    and other tools read) and the same ties in :data:`TIES_KEY`, the entry
    :func:`tied_aliases` restores them from. Every writer of ties calls this: the notes a
    file carries in are plain metadata, never taken for ties.

    Args:
        ties: ``{dropped name: kept name}``.
        beside: the output's other metadata: a note never replaces one of its entries (as
            safetensors' ``save_model`` never overrides user data); :data:`TIES_KEY` has it.

    Returns:
        The entries to add to the output's metadata; empty without ties.

    Example:
        >>> tie_metadata({"head": "emb"})
        {'head': 'emb', 'ckpt_tools.tied': '{"head":"emb"}'}
    """
    if not ties:
        return {}
    notes = {name: kept for name, kept in ties.items() if name not in (beside or {})}
    return {**notes, TIES_KEY: json.dumps(dict(ties), separators=(",", ":"))}

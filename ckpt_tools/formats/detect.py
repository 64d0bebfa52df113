"""Which format a file is, from its first bytes. The suffix is only a hint."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ckpt_tools.errors import (
    CheckpointNotFoundError,
    LfsPointerError,
    Remedy,
    UnsupportedFormatError,
)

__all__ = ["FORMATS", "SHARD_INDEX_SUFFIX", "detect_format"]

FORMATS = (
    "torch-zip",
    "torch-legacy",
    "torch-tar",
    "safetensors",
    "torchscript",
    "pickle",
    "hf-sharded",
    "lfs-pointer",
)

LFS_SIGNATURE = b"version https://git-lfs.github.com/spec/"
ZIP_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06")
# torch's legacy MAGIC_NUMBER 0x1950A86A20F9469CFC6C, pickled as LONG1 (10 bytes, little end).
LEGACY_MAGIC_LONG1 = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
# A sharded checkpoint's index (``model.safetensors.index.json``) is JSON text; its suffix
# tells it from other JSON, its first byte from a file that only borrowed the name.
SHARD_INDEX_SUFFIX = ".index.json"
# Protocol-0/1 pickles start with one of these opcodes; torch never writes them, users might.
_PICKLE_FIRST_OPCODES = frozenset(b"(}]lcdNIFLSVX")
# safetensors refuses longer headers (ckpt_tools.formats.safetensors.MAX_HEADER_BYTES).
_MAX_SAFETENSORS_HEADER = 100_000_000


def detect_format(path: str | os.PathLike[str]) -> str:
    """Detect a checkpoint's format by content.

    Args:
        path: a file, a folder, or a shard index (``*.index.json``).

    Returns:
        One of :data:`FORMATS`. ``torch-zip`` and ``torchscript`` are both zip archives: this
        returns ``torch-zip`` for any zip, and the zip reader tells them apart. A folder and
        a shard index are both ``hf-sharded``.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        LfsPointerError: a git-lfs pointer file.
        UnsupportedFormatError: not a format ckpt_tools reads.

    Example:
        >>> detect_format("model.safetensors")  # doctest: +SKIP
        'safetensors'
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(
            f"no such file or folder: {str(p)!r}; check the path (relative paths start at "
            f"{os.getcwd()!r})",
            path=p,
        )
    if p.is_dir():
        return "hf-sharded"
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(512)
    if size == 0:
        raise UnsupportedFormatError(
            f"{str(p)!r} is empty (0 bytes); expected a checkpoint", path=p
        )
    if head.startswith(LFS_SIGNATURE):
        raise LfsPointerError(
            f"{str(p)!r} is a git-lfs pointer ({size} bytes of text), not the checkpoint itself",
            path=p,
            remedies=(
                Remedy(command="git lfs pull", text="in its repository to fetch the real file"),
            ),
        )
    if head.startswith(ZIP_SIGNATURES):
        return "torch-zip"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "torch-tar"
    if head[:1] == b"\x80" and head[2:14] == LEGACY_MAGIC_LONG1:
        return "torch-legacy"
    if p.name.endswith(SHARD_INDEX_SUFFIX) and head.lstrip()[:1] == b"{":
        return "hf-sharded"  # the index itself: it opens with the shards it names
    if _looks_like_safetensors(head, size):
        return "safetensors"
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "pickle"
    if head[:1] and head[0] in _PICKLE_FIRST_OPCODES and p.suffix in (".pkl", ".pickle", ".pt"):
        return "pickle"
    raise UnsupportedFormatError(
        f"{str(p)!r} is not a checkpoint ckpt_tools can read: its first bytes {head[:16]!r} "
        "match no torch zip, legacy torch pickle, tar, pickle or safetensors header",
        path=p,
    )


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    # A header longer than the file is a truncated safetensors file: the reader says so.
    return 2 <= header_len <= _MAX_SAFETENSORS_HEADER and head[8:9] == b"{"

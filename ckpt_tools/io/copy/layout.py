"""Layout-preserving output: a key-only rewrite keeps every tensor byte where it was, modulo 4096.

A rewrite that renames keys or retags devices changes a few kilobytes of metadata and none of
the tensor bytes. Copying those bytes to the same offset modulo the block size lets the
kernel copy whole pages (and a reflink file system share whole blocks, see
:mod:`ckpt_tools.io.copy.clone`); copying a whole run of records in one call avoids a call per
tensor.

- torch zips: consecutive records that are copied unchanged and lie back to back in the
  source form a *run*, copied in one range with their local headers as they are (the headers
  are checked first: stored, no flags, the name the output's directory gives, a CRC and sizes
  that agree with the central directory, only zip64 and padding extra fields). The record
  written before a run pads its local header's extra field (as torch's writer pads for
  alignment) so that the run starts at its source offset modulo :data:`LAYOUT_BLOCK`. Only
  the central directory is new after the last run.
- safetensors: when the output holds exactly the source's tensors, each at its source
  offset, the JSON header is padded with spaces (which the format allows) so that the data
  section starts where it started in the source, or at the same offset modulo
  :data:`LAYOUT_BLOCK` when the new header is longer; the data section is then one copy.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.io.writers.zipfile import PARSED_RECORDS

__all__ = [
    "LAYOUT_BLOCK",
    "CappedProgress",
    "Run",
    "ZipLayout",
    "kept_layout",
    "plan_zip_layout",
    "safetensors_data_start",
    "safetensors_offsets",
    "zip_actions",
]

LAYOUT_BLOCK = 4096
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_U32 = 0xFFFFFFFF
_ZIP64_ID, _PAD_ID = 0x0001, 0x4246
_DESCRIPTOR_SIG = 0x08074B50
_FLAG_DESCRIPTOR, _FLAG_UTF8 = 0x8, 0x800


class Run(NamedTuple):
    """Records copied as one range of the source, local headers included.

    Attributes:
        start: where the first record's local header starts in the source.
        end: where the last record's bytes end.
        records: ``(name, local header offset, data offset, size, crc32, flags)`` of each
            record; ``flags`` are its local header's (torch's writer sets the UTF-8 and
            data descriptor bits), which the output's central directory repeats.
    """

    start: int
    end: int
    records: tuple[tuple[str, int, int, int, int, int], ...]

    @property
    def tensor_bytes(self) -> int:
        """The bytes of its storage records (what progress counts)."""
        return sum(r[3] for r in self.records if r[0].startswith("data/"))


class CappedProgress:
    """Report a run's copy as tensor bytes: at most ``total``, all of it by :meth:`finish`.

    A run also copies headers and bookkeeping records, which progress does not count.
    """

    def __init__(self, progress: Callable[[int], None] | None, total: int) -> None:
        self._progress, self._left = progress, total

    def __call__(self, n: int) -> None:
        step = min(n, self._left)
        if step > 0 and self._progress is not None:
            self._left -= step
            self._progress(step)

    def finish(self) -> None:
        """Report what the copied bytes did not cover yet."""
        self(self._left)


class ZipLayout(NamedTuple):
    """How a zip source's records are written.

    Attributes:
        runs: the first record's name -> its run.
        members: every record name inside a run (written by its run).
        end_before: a record written before a run -> the residue modulo
            :data:`LAYOUT_BLOCK` its bytes should end at.
    """

    runs: Mapping[str, Run]
    members: frozenset[str]
    end_before: Mapping[str, int]


def zip_actions(
    ckpt: Checkpoint, fd: int, as_saved: Mapping[str, bytes], wanted: set[str]
) -> list[tuple[str, str]]:
    """What a zip rewrite does with each source record, for :func:`plan_zip_layout`.

    Args:
        ckpt: the zip source.
        fd: its open file.
        as_saved: the records torch parses, with the values ``torch.save`` writes.
        wanted: the storage records the output keeps.

    Returns:
        ``(name, action)`` in the source's order: ``copy`` (bytes and header may be copied
        as they are), ``write`` (written anew: data.pkl, compressed records, records
        without a CRC-32, parsed records holding other values than torch.save's) or
        ``skip``.
    """
    out = []
    for name, record in ckpt.records.items():
        if name == "data.pkl" or record.compressed or record.crc32 == 0:
            action = "write"  # (a CRC of 0: torch computed none; the output's is computed)
        elif name in as_saved:  # torch.save's own value: copied when the source holds it
            value = as_saved[name]
            same = record.size == len(value) and os.pread(fd, len(value), record.data_offset)
            action = "copy" if same == value else "write"
        elif name in PARSED_RECORDS or (name.startswith("data/") and name not in wanted):
            action = "skip"
        else:
            action = "copy"
        out.append((name, action))
    return out


def plan_zip_layout(ckpt: Checkpoint, fd: int, actions: Sequence[tuple[str, str]]) -> ZipLayout:
    """Group the records a zip rewrite copies unchanged into runs of the source.

    Args:
        ckpt: the zip source.
        fd: its open file.
        actions: every source record, in the order the writer goes through them, with
            ``"copy"`` (its bytes and header may be copied as they are), ``"write"`` (the
            writer writes it anew) or ``"skip"`` (left out of the output).

    Returns:
        The :class:`ZipLayout`. Runs of a single record are runs too: the record keeps its
        header and its offset modulo :data:`LAYOUT_BLOCK`.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> fd = os.open("model.pt", os.O_RDONLY)
        >>> acts = [(n, "write" if n == "data.pkl" else "copy") for n in ckpt.records]
        >>> layout = plan_zip_layout(ckpt, fd, acts)
        >>> len(layout.runs), sorted(layout.end_before) == ["data.pkl"]
        (1, True)
        >>> os.close(fd)
    """
    root = ckpt.archive_root
    groups: list[list[tuple[ZipRecord, int, int]]] = []
    last_written: str | None = None
    end_before: dict[str, int] = {}
    previous_end = -1
    for name, action in actions:
        record = ckpt.records[name]
        if action == "skip":
            previous_end = -1
            continue
        found = _copyable(fd, root, record) if action == "copy" else None
        if found is None:
            last_written, previous_end = name, -1
            continue
        flags, trailer = found
        if record.header_offset == previous_end:
            groups[-1].append((record, flags, trailer))
        else:
            groups.append([(record, flags, trailer)])
            if last_written is not None:
                end_before.setdefault(last_written, record.header_offset % LAYOUT_BLOCK)
        previous_end = record.data_offset + record.size + trailer
        last_written = None
    runs = {}
    for group in groups:
        first, (last, _, trailer) = group[0][0], group[-1]
        runs[first.name] = Run(
            start=first.header_offset,
            end=last.data_offset + last.size + trailer,  # its data descriptor, checked
            records=tuple(
                (r.name, r.header_offset, r.data_offset, r.size, r.crc32, flags)
                for r, flags, _ in group
            ),
        )
    members = frozenset(r.name for group in groups for r, _, _ in group)
    return ZipLayout(runs, members, end_before)


def _copyable(fd: int, root: str, record: ZipRecord) -> tuple[int, int] | None:
    """``(flags, data descriptor length)`` when the record can be copied with its header.

    The local header must be one the output's central directory can stand beside: stored,
    no flags but UTF-8 names and a data descriptor (torch's writer sets both), the name the
    writer gives, a CRC and sizes that agree with the record (or zeros, with a data
    descriptor after the bytes that states them), and only zip64 and padding extra fields.
    """
    if record.compressed or record.header_offset < 0:
        return None
    name = f"{root}/{record.name}".encode()
    length = record.data_offset - record.header_offset
    if not _LOCAL.size + len(name) <= length <= _LOCAL.size + len(name) + 0xFFFF:
        return None
    header = os.pread(fd, length, record.header_offset)
    if len(header) != length:
        return None
    sig, version, flags, method, _, _, crc, csize, usize, name_len, extra_len = _LOCAL.unpack_from(
        header
    )
    if (
        sig != _LOCAL_SIG
        or version > 45
        or flags & ~(_FLAG_DESCRIPTOR | _FLAG_UTF8)
        or method != 0
        or name_len != len(name)
        or _LOCAL.size + name_len + extra_len != length
        or header[_LOCAL.size : _LOCAL.size + name_len] != name
    ):
        return None
    stated = (crc, csize, usize)
    if flags & _FLAG_DESCRIPTOR and stated == (0, 0, 0):
        sizes = (0, 0)
    elif crc != record.crc32:
        return None
    elif (csize, usize) == (_U32, _U32):
        sizes = (-1, -1)
    elif (csize, usize) == (record.size, record.size):
        sizes = (record.size, record.size)
    else:
        return None
    if not _extra_copyable(header[_LOCAL.size + name_len :], sizes, record.size):
        return None
    if not flags & _FLAG_DESCRIPTOR:
        return flags, 0
    # The data descriptor torch's writer puts after the bytes: 32-bit sizes, or 64-bit ones
    # (in a zip64 archive). It is copied only when it states exactly this record.
    raw = os.pread(fd, 24, record.data_offset + record.size)
    for size_format in ("II", "QQ"):
        sizes_format = f"<II{size_format}"
        stated = struct.pack(sizes_format, _DESCRIPTOR_SIG, record.crc32, record.size, record.size)
        if raw[: len(stated)] == stated:
            return flags, len(stated)
    return None


def _extra_copyable(extra: bytes, sizes: tuple[int, int], size: int) -> bool:
    """Only zip64 sizes (agreeing with the record) and padding, well formed."""
    at, zip64 = 0, False
    while at < len(extra):
        if at + 4 > len(extra):
            return False
        kind, length = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + length]
        if len(body) != length:
            return False
        if kind == _ZIP64_ID:
            values = struct.unpack_from("<QQ", body) if length >= 16 else None
            if zip64 or values not in ((size, size), sizes):
                return False
            zip64 = True
        elif kind != _PAD_ID or (body.strip(b"Z") and body.strip(b"\0")):
            # Padding as torch writes it ("Z"s) or as a hole reads (zeros): nothing else is
            # carried over unread into the output.
            return False
        at += 4 + length
    return zip64 or sizes != (-1, -1)


def kept_layout(tensors: Sequence[TensorRef], source: Checkpoint) -> tuple[int, list[int]] | None:
    """:func:`safetensors_offsets` for tensors of ``source``; None if one is not contiguous."""
    spans = []
    for t in tensors:
        if not t.is_contiguous():
            return None
        span = source.span(t.storage)
        spans.append((span.path, span.offset + t.byte_span[0], t.nbytes))
    return safetensors_offsets(spans)


def safetensors_offsets(spans: Sequence[tuple[str, int, int]]) -> tuple[int, list[int]] | None:
    """Where to keep the output's tensors: ``(source start, offsets)``, or None to pack anew.

    Args:
        spans: ``(file, first byte, byte count)`` of each tensor in the source, in the
            output's order (contiguous tensors only).

    Returns:
        When the tensors lie in one file and, in offset order, tile one 8-aligned range of
        it without gap or overlap (every tensor of a safetensors source, renamed), that
        range's start and each tensor's offset from it: the data section is then one copy.
        Else None.

    Example:
        >>> safetensors_offsets([("a", 112, 4), ("a", 104, 8)])
        (104, [8, 0])
        >>> safetensors_offsets([("a", 104, 4), ("a", 112, 4)]) is None
        True
    """
    if not spans or len({path for path, _, _ in spans}) != 1:
        return None
    low = min(start for _, start, _ in spans)
    if low % 8:
        return None  # safetensors keeps its data 8-aligned; a legacy storage may not be
    at = low
    for _, start, size in sorted(spans, key=lambda s: (s[1], s[2])):
        if start != at:
            return None
        at = start + size
    return low, [start - low for _, start, _ in spans]


def safetensors_data_start(header_len: int, source_start: int) -> int:
    """Where the output's data section starts, for a header of ``header_len`` bytes.

    Args:
        header_len: the 8-byte length prefix plus the unpadded JSON.
        source_start: where the tensors' bytes start in the source.

    Returns:
        The first offset at or past the header at ``source_start``'s residue modulo
        :data:`LAYOUT_BLOCK`: what block-aligned copies and reflinks need, and never more
        than a block of padding (a shard's data may start deep in its source).

    Example:
        >>> safetensors_data_start(100, 4104), safetensors_data_start(5000, 4104)
        (4104, 8200)
        >>> safetensors_data_start(100, 107_000_000)  # a later shard's range
        192
    """
    return header_len + (source_start - header_len) % LAYOUT_BLOCK

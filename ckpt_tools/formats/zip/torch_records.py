"""The records torch's reader looks up by name in a torch zip, checked as torch checks them.

The version (``.data/version`` or ``version``), ``.format_version``, ``byteorder``,
``.storage_alignment`` and ``.data/serialization_id`` are read whole and parsed as torch
parses them; each storage the pickle names must have its record, of the size it needs. A
name is found as torch's reader finds it, case ignored, and refused where that is ambiguous.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckpt_tools.descriptors import StorageRef
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.zip.directory import ZipEntry, ZipSource
from ckpt_tools.formats.zip.records import check_inflates, read_entry

__all__ = [
    "RecordLookup",
    "check_load_records",
    "check_reader_records",
    "check_serialization_id",
    "check_storage_records",
    "refuse_big_endian",
    "stoull_int64",
]

# torch's reader (caffe2 PyTorchStreamReader) reads ``.data/version`` if present, else
# ``version``, parses it with std::stoull into an int64 and accepts only this range
# (kMinSupportedFileFormatVersion .. kMaxSupportedFileFormatVersion).
_VERSION_RECORDS = (".data/version", "version")
_MIN_VERSION, _MAX_VERSION = 1, 10
_C_SPACE = b" \t\n\v\f\r"
# The small bookkeeping records torch reads whole; torch.save writes at most 40 bytes.
_SMALL_RECORD = 1 << 16


class RecordLookup:
    """The records of an archive found by name as torch's reader finds them.

    torch's reader (miniz's ``mz_zip_reader_locate_file``, a binary search over the names
    sorted without regard to ASCII case) finds ``root/name`` in any case: an archive with
    ``data.pkl`` and ``DATA.PKL`` gives torch one of the two, by the order of the sort.
    So a name torch looks up must match exactly one record, spelled exactly as torch.save
    spells it; anything else is refused, naming the records (torch.save never writes them).
    """

    def __init__(self, path: str, entries: list[ZipEntry], root: str) -> None:
        self._path = path
        self._prefix = f"{root}/"
        self._by_folded: dict[bytes, list[ZipEntry]] = {}
        for entry in entries:
            self._by_folded.setdefault(entry.raw_name.lower(), []).append(entry)

    def find(self, name: str) -> ZipEntry | None:
        """The record torch reads as ``name`` (inside the root folder); None without one.

        Raises:
            CorruptCheckpointError: several records answer to ``name``, or one that is
                spelled otherwise.
        """
        wanted = (self._prefix + name).encode("utf-8", "surrogatepass")
        found = self._by_folded.get(wanted.lower())
        if not found:
            return None
        if len(found) > 1:
            raise CorruptCheckpointError(
                f"{self._path!r}: records {' and '.join(repr(e.name) for e in found[:2])} both "
                f"answer torch's lookup of {name!r} (it ignores case), and torch reads one of "
                "them by the order of its sort: the archive is ambiguous",
                path=self._path,
            )
        if found[0].raw_name != wanted:
            raise CorruptCheckpointError(
                f"{self._path!r}: record {found[0].name!r} is the one torch reads as {name!r} "
                "(its lookup ignores case); torch.save never spells a record so, and a "
                "reader that does not ignore case reads another archive",
                path=self._path,
            )
        return found[0]

    def listing(self) -> str:
        """The first few record names, for messages."""
        names = [e.name for entries in self._by_folded.values() for e in entries]
        return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")

    def __contains__(self, name: str) -> bool:
        return self.find(name) is not None

    def __getitem__(self, name: str) -> ZipEntry:
        found = self.find(name)
        if found is None:
            raise KeyError(name)
        return found


def stoull_int64(text: bytes) -> int | None:
    """``(int64_t) std::stoull(text)``: None where stoull finds no number (torch's message).

    Leading C whitespace, an optional sign, then decimal digits up to the first other
    character (or NUL); a minus negates modulo 2**64, as strtoull does.

    Example:
        >>> [stoull_int64(t) for t in (b" +3abc", b"-1", b"abc", b"18446744073709551615")]
        [3, -1, None, -1]
    """
    text = text.split(b"\0", 1)[0].lstrip(_C_SPACE)
    sign = -1 if text[:1] == b"-" else 1
    text = text[1:] if text[:1] in (b"-", b"+") else text
    digits = len(text) - len(text.lstrip(b"0123456789"))
    if not digits:
        return None
    value = int(text[:digits])
    if value >= 1 << 64:
        raise OverflowError("stoull")
    value = (sign * value) % (1 << 64)
    return value - (1 << 64) if value >= 1 << 63 else value


def check_reader_records(path: str, fd: ZipSource, entries: RecordLookup) -> bytes | None:
    """What torch's reader checks when it opens any torch zip, TorchScript or not.

    Returns the serialization id record's bytes (None without one).
    """
    id_entry = entries.find(".data/serialization_id")
    serialization_id = None if id_entry is None else _read_small(path, fd, id_entry)
    name = next((n for n in _VERSION_RECORDS if n in entries), None)
    if name is None:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a version record, so it is not a torch "
            f"archive torch.load reads (records: {entries.listing()})",
            path=path,
        )
    text = _read_small(path, fd, entries[name])
    try:
        version = stoull_int64(text)
    except OverflowError as e:
        raise CorruptCheckpointError(
            f"{path!r}: its {name} record {text[:24]!r} is out of range (torch refuses it)",
            path=path,
        ) from e
    if version is None or not _MIN_VERSION <= version <= _MAX_VERSION:
        raise CorruptCheckpointError(
            f"{path!r}: its {name} record {text[:24]!r} is not a file format version torch "
            f"reads ({_MIN_VERSION} to {_MAX_VERSION}); torch refuses the archive",
            path=path,
        )
    return serialization_id


def check_serialization_id(path: str, serialization_id: bytes | None) -> None:
    """torch.load ends by handing the serialization id to Python as str: it must be UTF-8."""
    if serialization_id is None:
        return
    try:
        serialization_id.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{path!r}: its .data/serialization_id record is not UTF-8 text ({e.reason} at "
            f"byte {e.start}); torch.load fails on it after unpickling",
            path=path,
        ) from e


def check_load_records(path: str, fd: ZipSource, entries: RecordLookup) -> str | None:
    """What ``torch.serialization._load`` reads and parses before data.pkl, parsed as it does.

    Args:
        path: the file, for messages.
        fd: the archive.
        entries: its records by name.

    Returns:
        What its byteorder record says (``little`` or ``big``: torch byte-swaps each storage
        by its dtype as it loads it where that is not the host's order), or None without the
        record: torch then uses its default load endianness (``little`` unless set).

    Raises:
        CorruptCheckpointError: a record torch parses and refuses.
    """
    if "data.pkl" not in entries:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a data.pkl record, so it is not a torch "
            f"archive torch.load reads (records: {entries.listing()})",
            path=path,
        )
    if ".format_version" in entries:
        _read_small(path, fd, entries[".format_version"])  # compared as bytes: any value
    byteorder = None
    order = entries.find("byteorder")
    if order is not None:
        value = _read_small(path, fd, order)
        if value not in (b"little", b"big"):
            raise CorruptCheckpointError(
                f"{path!r}: its byteorder record is {value[:16]!r}, not little or big", path=path
            )
        byteorder = value.decode()
    alignment = entries.find(".storage_alignment")
    if alignment is not None:
        value = _read_small(path, fd, alignment)
        try:
            int(value)  # exactly torch's parse: int(zip_file.get_record(".storage_alignment"))
        except ValueError as e:
            raise CorruptCheckpointError(
                f"{path!r}: its .storage_alignment record {value[:24]!r} is not an integer "
                "(torch refuses the archive)",
                path=path,
            ) from e
    return byteorder


def refuse_big_endian(path: str, byteorder: str, what: str) -> None:
    """Refuse a big-endian archive where a reader copies its storage bytes as they lie.

    Args:
        path: the file, for messages.
        byteorder: the archive's byte order (:func:`check_load_records`' answer, ``little``
            for None).
        what: what the archive is (``a DeepSpeed rank file``), for the message.

    Raises:
        UnsupportedFormatError: ``byteorder`` is ``big``.

    Example:
        >>> refuse_big_endian("a.pt", "little", "a DCP chunk")
    """
    if byteorder == "big":
        raise UnsupportedFormatError(
            f"{path!r}: {what} was saved big-endian (torch.load byte-swaps it as it loads "
            "it); this reader copies its bytes as little-endian, so it refuses it: load it "
            "with torch.load and save it again",
            path=path,
        )


def _read_small(path: str, fd: ZipSource, entry: ZipEntry) -> bytes:
    return read_entry(path, fd, entry, _SMALL_RECORD)


def check_storage_records(
    path: str,
    fd: ZipSource,
    storages: Mapping[str, StorageRef],
    entries: RecordLookup,
    *,
    inflate: bool = True,
) -> None:
    """Every storage record torch.load would read exists, has the size it needs, and reads.

    A stored record is only located (its headers were checked with the directory); a
    compressed one is inflated, in bounded pieces, as torch inflates it when it loads.
    """
    for storage in storages.values():
        if storage.view is not None:
            # torch.load's zip reader unpacks exactly five fields and fails on a view's sixth;
            # reading on would place the view's tensors in its root storage's bytes.
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} is a legacy storage view, which a zip "
                "archive cannot hold (torch.load refuses it too)"
            )
        record = entries.find(f"data/{storage.key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{path!r}: the pickle refers to storage {storage.key!r} but the archive has no "
                f"record data/{storage.key}"
            )
        if record.file_size != storage.nbytes:
            # torch.load refuses both ways ("record size does not match expected size").
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} needs {storage.nbytes} bytes, its record "
                f"holds {record.file_size}",
                path=path,
            )
        if record.compressed and inflate:
            check_inflates(path, fd, record)

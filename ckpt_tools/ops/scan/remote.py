"""Scanning checkpoints at URLs: which files a URL names, and what a remote read left unchecked.

A file URL is scanned as that file. A folder URL (``hf://ORG/REPO``, a path ending in ``/``)
cannot be listed, so it is scanned as the weight files a loader takes from it: every file
that transformers' names find there (``model.safetensors``, ``pytorch_model.bin``) and every
shard their indexes name, as a local folder scan finds them among its files.

A remote file is opened the way ``inspect`` opens it, which trusts the zip directory and
leaves each record's local header, a compressed storage's inflation and a legacy storage's
element count unread. A scan is the security verdict: it reads them all as torch would, a
request each, before it gives one. Formats read member by member (tar) and folder formats
(DCP, DeepSpeed) are refused with the fix: download them.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from ckpt_tools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ResourceLimitError,
    UnsupportedFormatError,
)
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.detect import is_index_name
from ckpt_tools.formats.zip.directory import read_zip_directory
from ckpt_tools.formats.zip.records import check_inflates
from ckpt_tools.io.remote.checkpoint import open_file
from ckpt_tools.io.remote.rangefile import RemoteFile, TransferStats
from ckpt_tools.io.remote.session import RemoteSession, explicit_missing
from ckpt_tools.io.remote.urls import file_name, folder_candidates, is_folder_url, sibling

__all__ = ["Found", "Remote", "open_remote", "refuse_local_only", "url_targets"]

# Folder formats told by one file: DCP's metadata, DeepSpeed's tag pointer.
_FOLDER_MARKERS = ((".metadata", "DCP"), ("latest", "DeepSpeed"))


class Found(NamedTuple):
    """A file a URL leads to: its URL and, where a folder's search opened it already, the
    open file and what opening it cost (its first request, a redirect before it)."""

    url: str
    file: RemoteFile | None = None
    opened: TransferStats | None = None


class Remote(NamedTuple):
    """A remote file being scanned, and the session its reads go through and are counted."""

    file: RemoteFile
    session: RemoteSession


def url_targets(url: str, session: RemoteSession) -> tuple[list[Found], list[str]]:
    """The files to scan for ``url``, and the files skipped (a folder's shard indexes).

    Args:
        url: a file or folder URL.
        session: where the folder's look-ups go.

    Returns:
        ``(targets, skipped)``: each target (:class:`Found`), in name order as a local
        folder is walked; the index URLs.

    Raises:
        CheckpointNotFoundError: a folder holds none of the files looked for.
        UnsupportedFormatError: a folder is a DCP or DeepSpeed checkpoint.
        CorruptCheckpointError: an index that names no shards.

    Example:
        >>> url_targets("https://host.example/model.pt", RemoteSession())
        ([Found(url='https://host.example/model.pt', file=None, opened=None)], [])
    """
    url = session.named(url)  # shown without its password; the session sends it
    if not is_folder_url(url):
        return [Found(url)], []
    found: dict[str, Found] = {}  # by name
    indexes: list[str] = []
    stats = session.stats
    candidates = folder_candidates(url)
    # from_pretrained loads the file config.json names, whatever else the folder holds.
    explicit = session.explicit_weights(url)
    if explicit is not None:
        (named,) = folder_candidates(url, [explicit])
        candidates += [named] if named not in candidates else []
    for candidate in candidates:
        before = TransferStats(stats.requests, stats.bytes_received)
        file = _opened_or_none(candidate, session)
        if file is None:
            continue
        if is_index_name(file_name(candidate)):
            indexes.append(candidate)
            for name in _shard_names(candidate, file):
                found.setdefault(name, Found(sibling(candidate, name)))
        else:
            opened = TransferStats(
                stats.requests - before.requests, stats.bytes_received - before.bytes_received
            )
            found[file_name(candidate)] = Found(candidate, file, opened)
    if explicit is not None and named not in indexes + [f.url for f in found.values()]:
        raise explicit_missing(url, explicit)
    if not found and not indexes:
        _refuse_folder_format(url, session)
        tried = ", ".join(file_name(c) for c in folder_candidates(url))
        raise CheckpointNotFoundError(
            f"{url}: no checkpoint in this folder (tried {tried})", path=url
        )
    return [found[name] for name in sorted(found)], sorted(indexes)


def _opened_or_none(url: str, session: RemoteSession) -> RemoteFile | None:
    try:
        return session.open(url)
    except CheckpointNotFoundError:
        session.stats.add(0)  # the miss was a request too
        return None


def _shard_names(url: str, file: RemoteFile) -> list[str]:
    """The shard files an index names (its ``weight_map``'s values), in name order."""
    from ckpt_tools.formats.hf_choice import MAX_INDEX_BYTES

    if file.size > MAX_INDEX_BYTES:
        raise ResourceLimitError(
            f"{url}: a shard index of {file.size} bytes is over the "
            f"{MAX_INDEX_BYTES >> 20} MiB limit",
            path=url,
        )
    try:
        weight_map = json.loads(file.pread(file.size, 0))["weight_map"]
        names = sorted(set(weight_map.values()))
        if not all(isinstance(name, str) for name in names):
            raise TypeError("a shard name is not a string")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{url}: not a shard index, so its shards are not known ({type(e).__name__}: "
            f"{str(e)[:200]})",
            path=url,
        ) from e
    return names


def _refuse_folder_format(url: str, session: RemoteSession) -> None:
    """Refuse a folder that is a DCP or DeepSpeed checkpoint (told by one file each)."""
    first = folder_candidates(url)[0]
    for name, fmt in _FOLDER_MARKERS:
        if _opened_or_none(sibling(first, name), session) is not None:
            raise UnsupportedFormatError(
                f"{url} is a {fmt} checkpoint folder, which ckpt_tools reads from local "
                "folders only (a file per rank, read member by member); download the folder "
                "and pass its path",
                path=url,
            )


def refuse_local_only(url: str, fmt: str) -> None:
    """Refuse a remote file of a format read member by member (tar): a request each.

    Raises:
        UnsupportedFormatError: ``fmt`` is one of them.

    Example:
        >>> refuse_local_only("hf://org/model/model.pt", "torch-zip")  # read by ranges
    """
    if fmt in ("torch-tar", "dcp", "deepspeed"):
        raise UnsupportedFormatError(
            f"{url!r} is a {fmt} checkpoint, which ckpt_tools reads from local files only "
            "(it is read member by member: a request each); download it and pass its path",
            path=url,
        )


def open_remote(url: str, remote: Remote) -> Checkpoint:
    """Open the remote checkpoint, checked as our reader checks a local file: with every
    check a remote metadata read leaves for later made now.

    Raises:
        CheckpointError: the file is refused, as the local file would be.

    Example:
        >>> class InMemory:  # a transport serving a local file's bytes
        ...     url = "https://host.example/model.pt"
        ...     data = open("model.pt", "rb").read()
        ...     def get(self, start, end): return self.data[start:end], len(self.data)
        ...     def close(self): pass
        >>> remote = Remote(RemoteFile(InMemory()), RemoteSession())
        >>> open_remote(InMemory.url, remote).format
        'torch-zip'
    """
    ckpt = open_file(url, remote.file, remote.session)
    if ckpt.format in ("torch-zip", "torchscript"):
        _inflate_compressed_storages(url, ckpt, remote.file)
    elif ckpt.format == "torch-legacy":
        for storage in ckpt.storages.values():
            ckpt.span(storage)  # checks its element count, as the local reader does
    return ckpt


def _inflate_compressed_storages(url: str, ckpt: Checkpoint, file: RemoteFile) -> None:
    """Inflate each deflated storage record, as our reader does when it opens a local zip
    (torch inflates them when it loads): only re-zipped archives have one."""
    offsets = {
        record.header_offset
        for storage in ckpt.storages.values()
        if (record := ckpt.records.get(f"data/{storage.key}")) is not None and record.compressed
    }
    if not offsets:
        return
    for entry in read_zip_directory(url, file, file.size, defer_local=True):
        if entry.header_offset in offsets:
            check_inflates(url, file, entry)

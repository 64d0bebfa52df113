"""``scan``: can loading this file run code? A verdict per checkpoint, files and folders.

Each file is looked at twice, and nothing in it is ever run:

1. read as torch reads it (:func:`~ckpt_tools.formats.open_checkpoint`, the restricted
   unpickler): a file our reader refuses is ``unreadable``, and the globals it met that
   are off the allowlist are findings;
2. every pickle it holds is walked for its imports
   (:func:`~ckpt_tools.ops.scan.sources.walk_pickles`), including the pickles torch.load
   never reads but other loaders do, each import judged by the severity table.

A URL is scanned as its downloaded file would be, from the bytes that scan reads
(:mod:`~ckpt_tools.ops.scan.remote`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import NamedTuple

from ckpt_tools._types import StrPath, checked_paths
from ckpt_tools.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    RemoteError,
    UnsafeContentError,
)
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.base import RangeSource
from ckpt_tools.formats.missing import missing
from ckpt_tools.formats.pickle.imports import python3_qualname
from ckpt_tools.formats.zip.directory import ZipEntry
from ckpt_tools.io.remote import RemoteFile, RemoteSession, TransferStats
from ckpt_tools.io.remote.urls import is_folder_url, is_url
from ckpt_tools.ops.scan.content import content_format, not_a_checkpoint
from ckpt_tools.ops.scan.remote import Remote, open_remote, refuse_local_only, url_targets
from ckpt_tools.ops.scan.report import FileScan, Finding, ScanReport, Verdict
from ckpt_tools.ops.scan.severity import Context, classify, storage_class_rule
from ckpt_tools.ops.scan.sources import Walked, storage_records, walk_pickles
from ckpt_tools.ops.scan.torchscript_code import CODE_READ_BYTES, code_files

__all__ = ["scan", "scan_file"]

#: Told before each file: (files done, files in all, the file now). Not a
#: :data:`~ckpt_tools._types.Progress`, which counts the bytes an operation writes.
OnFile = Callable[[int, int, str], None]


def scan(
    paths: StrPath | Iterable[StrPath],
    *,
    on_file: OnFile | None = None,
) -> ScanReport:
    """Give each checkpoint under ``paths`` a security verdict, running nothing in it.

    Args:
        paths: files, folders and URLs. Folders are walked recursively and every file in
            them that is a checkpoint by content (whatever its name) is scanned; a DCP folder
            is scanned as one checkpoint; other files are listed as skipped. A URL
            (``https://``, ``hf://ORG/REPO[@REV][/PATH]``, ``s3://BUCKET/KEY``) gets the
            verdict of its downloaded file, from ranged reads of the bytes a scan reads (each
            zip record's header and first bytes: a request each); a folder URL is scanned as
            the weight files a loader takes from it (``model.safetensors``,
            ``pytorch_model.bin``, and each shard their indexes name).
        on_file: called before each file with (files done, files in all, the file).

    Returns:
        A :class:`~ckpt_tools.ops.scan.report.ScanReport`: a verdict per file
        (``clean``, ``nonstandard``, ``unreadable``, ``dangerous``) with its findings;
        where URLs were read, its ``transfer`` (and each remote file's) says what it cost.

    Raises:
        CheckpointNotFoundError: a path does not exist, or nothing is at a URL.
        RemoteError: a URL could not be read (refused credentials, a timeout, a refused
            connection, a server that ignores byte ranges).
        UnsupportedFormatError: a URL of a format read member by member (tar) or of a DCP
            or DeepSpeed folder: those are scanned from a local copy.

    Example:
        >>> report = scan(["model.pt"])
        >>> [(f.path, f.verdict) for f in report.files]
        [('model.pt', 'clean')]
    """
    given = checked_paths(paths, "paths")
    if not any(is_url(p) for p in given):
        return _scan_all(given, on_file, None)
    with RemoteSession() as session:
        report = _scan_all(given, on_file, session)
    return replace(report, transfer=session.stats)


class _Target(NamedTuple):
    path: str
    named: bool  # by the caller, not found in a folder
    remote: bool
    file: RemoteFile | None = None  # a remote file opened already (found in a folder)
    opened: TransferStats | None = None  # what opening it cost then


def _scan_all(
    given: Sequence[str], on_file: OnFile | None, session: RemoteSession | None
) -> ScanReport:
    targets: list[_Target] = []
    skipped: list[str] = []
    for path in given:  # every URL named before any is read: the session refuses clashes
        if session is not None and is_url(path):
            session.named(path)
    for path in given:
        if session is not None and is_url(path):
            found, indexes = url_targets(path, session)
            named = not is_folder_url(path)
            targets += [_Target(f.url, named, True, f.file, f.opened) for f in found]
            skipped += indexes
        elif not os.path.lexists(path):  # (a dangling link is scanned: unreadable)
            raise missing(path) or CheckpointNotFoundError(repr(path), path=path)
        elif os.path.isdir(path):
            for found_path, followed in _files_under(path):
                if followed:
                    targets.append(_Target(found_path, False, False))
                else:
                    skipped.append(found_path)
        else:
            targets.append(_Target(path, True, False))
    files: list[FileScan] = []
    for done, target in enumerate(targets):
        if on_file is not None:
            on_file(done, len(targets), target.path)
        if session is not None and target.remote:
            result = _scan_url(target, session)
        else:
            result = scan_file(target.path)
            if result is None and target.named:
                result = _unreadable(target.path, None, not_a_checkpoint(target.path))
        (skipped.append(target.path) if result is None else files.append(result))
    return ScanReport(tuple(files), tuple(skipped))


def _scan_url(target: _Target, session: RemoteSession) -> FileScan | None:
    """:func:`scan_file` of a remote file, with what its reads cost."""
    # A file a folder's search opened: its first request is its own, made before this one.
    opened = target.opened or TransferStats()
    stats = session.stats
    before = TransferStats(
        stats.requests - opened.requests, stats.bytes_received - opened.bytes_received
    )
    file = target.file if target.file is not None else session.open(target.path)
    result = _scan(target.path, Remote(file, session))
    if result is None and target.named:
        result = _unreadable(target.path, None, not_a_checkpoint(target.path, file))
    if result is None:
        return None
    cost = TransferStats(
        stats.requests - before.requests, stats.bytes_received - before.bytes_received
    )
    return replace(result, transfer=cost)


def _files_under(folder: str) -> Iterator[tuple[str, bool]]:
    """``(path, to scan)`` for everything under ``folder``, in a stable order: each file, and
    each DCP folder as one checkpoint (its other files and folders are walked too). Links
    are followed, as a file's are, since a verdict must cover what the folder reaches; a
    folder reached again (a link that loops) or through a link into /proc or /sys is listed
    as not scanned, as is anything that is not a file (a FIFO, a dangling link), never
    opened."""
    from ckpt_tools.formats.dcp.layout import DATA_SUFFIX, METADATA_FILE

    walked: set[tuple[int, int]] = set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs.sort()
        try:
            stat = os.stat(root)
        except OSError:
            continue  # gone since it was listed
        # Reached again (a loop), or a link into the kernel's own files: listed, not walked.
        kernels = _kernel_folder(root) and not _kernel_folder(folder)
        if (stat.st_dev, stat.st_ino) in walked or kernels:
            dirs.clear()
            yield root, False
            continue
        walked.add((stat.st_dev, stat.st_ino))
        dcp = _is_dcp(root)
        if dcp:
            yield root, True
        for name in sorted(names):
            path = os.path.join(root, name)
            if dcp and (name == METADATA_FILE or name.endswith(DATA_SUFFIX)):
                continue  # read as the DCP checkpoint's
            yield path, os.path.isfile(path)


def _kernel_folder(path: str) -> bool:
    """Whether ``path`` leads into /proc or /sys, whose files are the kernel's (a link to
    ``/`` in a scanned folder must not walk them)."""
    real = os.path.realpath(path)
    return any(real == top or real.startswith(top + "/") for top in ("/proc", "/sys"))


def _is_dcp(path: str) -> bool:
    from ckpt_tools.formats.dcp.layout import is_dcp_folder

    return os.path.isdir(path) and is_dcp_folder(path)


def scan_file(path: str) -> FileScan | None:
    """The verdict on one file or DCP folder; None where it is not a checkpoint by content
    (an empty file, text, a git-lfs pointer, an image).

    Example:
        >>> scan_file("model.pt").verdict
        'clean'
    """
    return _scan(path, None)


def _scan(path: str, remote: Remote | None) -> FileScan | None:
    """:func:`scan_file` of ``path``, or of the remote file at the URL ``path``."""
    source = None if remote is None else remote.file
    try:
        content, walked_already = content_format(path, source)
    except (CheckpointError, OSError) as e:  # not a regular file, or unreadable
        _raise_remote(e, source)
        return _unreadable(path, None, str(e))
    if content is None:
        return None
    if remote is not None:
        refuse_local_only(path, content)
    # numpy.load reads an .npy, not torch: there is no torch reading to compare with.
    numpy = content == "numpy"
    reading = _Reading(None, (), "", frozenset()) if numpy else _read_as_torch(path, remote)
    error, fmt = reading.error, reading.format or content
    walked: list[Walked] = []
    skip = reading.read | reading.storages  # (torch reads storage records as raw bytes)
    try:
        if fmt == "pickle" and walked_already is not None:
            walked.extend(walked_already)  # walked whole by content_format, without an error
        else:
            entries = reading.entries
            walked.extend(walk_pickles(path, fmt, skip=skip, entries=entries, source=source))
        if fmt == "safetensors" and not path.endswith(".safetensors"):
            # torch.load takes it for a legacy file (it is no zip) and unpickles it.
            legacy = walk_pickles(path, "torch-legacy", source=source)
            walked.extend(w for w in legacy if w.scan.imports or w.scan.end is not None)
    except (CheckpointError, OSError, EOFError) as e:
        _raise_remote(e, source)
        if source is not None and error is None:
            # A remote record's local header, checked only as the walk reached it: the
            # archive is one our reader refuses, walked the lenient way.
            reading, fmt = _Reading(str(e), (), "", frozenset()), content
        error = error or str(e)
    if fmt == "torch-zip" and any(w.context == "torchscript" for w in walked):
        fmt = "torchscript"  # (the reader refused it: the walk still tells)
    context: Context = "torchscript" if fmt == "torchscript" else "pickle"
    findings = _findings(walked, reading, context)
    if fmt in _FORMATS_BEYOND_WEIGHTS_ONLY:
        findings += (Finding(None, fmt, "nonstandard", _FORMATS_BEYOND_WEIGHTS_ONLY[fmt]),)
    code: tuple[str, ...] = ()
    if fmt == "torchscript":
        try:
            files = code_files(path, source)
        except (CheckpointError, OSError) as e:
            _raise_remote(e, source)
            error, files = error or str(e), ()
        code = tuple(map(str, files))
        findings += tuple(
            Finding("__setstate__", f.record, "dangerous", _RUNS_ON_LOAD)
            for f in files
            if f.runs_on_load
        ) + tuple(
            Finding("<bytes not read>", f.record, "dangerous", _CODE_READ_IN_PART)
            for f in files
            if f.read_in_part and not f.runs_on_load
        )
    verdict = _verdict(findings, error, bool(code))
    return FileScan(path, fmt, verdict, findings, error, len(walked) + len(reading.read), code)


_RUNS_ON_LOAD = (
    "torch.jit.load runs a TorchScript __setstate__ while it loads the archive (torch.load "
    "hands it one), and TorchScript can read and write files"
)
_CODE_READ_IN_PART = (
    f"a code file read in part (its first {CODE_READ_BYTES >> 20} MiB): a __setstate__ past "
    "that, which "
    "torch.jit.load would run, is not looked for"
)
# Formats torch.load(weights_only=True) refuses whatever their pickles hold.
_FORMATS_BEYOND_WEIGHTS_ONLY = {
    "torch-tar": "torch.load(weights_only=True) refuses the tar format (torch < 0.4); "
    "loading it needs weights_only=False, which runs its pickles",
}


def _raise_remote(error: BaseException, source: RangeSource | None) -> None:
    """Raise what failed reading a URL (no answer, refused credentials, nothing there): a
    failure of the scan, not a verdict on the file."""
    if source is not None and isinstance(error, (RemoteError, CheckpointNotFoundError)):
        raise error


class _Reading(NamedTuple):
    """What our reader (the way torch reads the file) made of it."""

    error: str | None  # why it refuses the file; None where it reads it
    globals: tuple[str, ...]  # the globals off the allowlist it met, as written
    record: str  # where it met them
    read: frozenset[str]  # records it read whole, which need no walk of their own
    format: str | None = None
    entries: tuple[ZipEntry, ...] | None = None  # a zip's records, as it listed them
    storages: frozenset[str] = frozenset()  # records it read as raw bytes: no pickle's


def _read_as_torch(path: str, remote: Remote | None = None) -> _Reading:
    try:
        ckpt = open_checkpoint(path) if remote is None else open_remote(path, remote)
    except UnsafeContentError as e:  # refused for what it imports: the findings say it
        return _Reading(None, e.globals, "", frozenset())
    except (CheckpointError, OSError) as e:
        _raise_remote(e, None if remote is None else remote.file)
        return _Reading(str(e), (), "", frozenset())
    if ckpt.format in ("torch-zip", "torchscript"):
        # The C unpickler read data.pkl to its STOP and asked for every global in it (the
        # same unpickler torch.load runs with weights_only=False): where all were on the
        # allowlist, a walk would add nothing.
        record = f"{ckpt.archive_root}/data.pkl"
        # (A remote zip's are read again from its cached directory, headers unread.)
        entries = (
            None
            if remote is not None
            else tuple(
                ZipEntry(
                    f"{ckpt.archive_root}/{r.name}",
                    r.data_offset,
                    r.compress_size,
                    r.size,
                    r.crc32,
                    r.compressed,
                    r.header_offset,
                )
                for r in ckpt.records.values()
            )
        )
        # Where it met globals off the allowlist, the walk still names their modules apart
        # from their attribute paths (the reader joins the two).
        read = frozenset() if ckpt.unsafe_globals else frozenset({record})
        raw = storage_records(ckpt)
        return _Reading(None, ckpt.unsafe_globals, record, read, ckpt.format, entries, raw)
    return _Reading(None, ckpt.unsafe_globals, "", frozenset(), ckpt.format)


def _findings(walked: Sequence[Walked], reading: _Reading, context: Context) -> tuple[Finding, ...]:
    """The imports off the allowlist, once per (global, record)."""
    found: dict[tuple[str, str], Finding] = {}
    for w in walked:
        for imp in w.scan.imports:
            rule = storage_class_rule(imp.qualname, imp.name, w.record) or classify(
                imp.qualname, w.context, exact="." in (imp.name or "")
            )
            if rule.severity != "allowed":
                found.setdefault(
                    (imp.qualname, w.record),
                    Finding(imp.qualname, w.record, rule.severity, rule.reason, imp.position),
                )
        for imp in w.scan.mutated:
            why = f"{_CHANGED}; and {classify(imp.qualname, w.context).reason}"
            found[(imp.qualname, w.record)] = Finding(
                imp.qualname, w.record, "dangerous", why, imp.position
            )
    seen = {name for name, _ in found}
    # Non-zip pickles are all walked: a global only the reader names was computed in one.
    unnamed = (w.record for w in walked if any(i.module is None for i in w.scan.imports))
    record = reading.record or next(unnamed, "")
    for name in map(python3_qualname, reading.globals):
        if name not in seen:
            rule = classify(name, context, exact=True)  # its module and name are not known
            if rule.severity != "allowed":
                found[(name, "")] = Finding(name, record, rule.severity, rule.reason)
    return tuple(found.values())


_CHANGED = (
    "the pickle changes this global in place (a BUILD or SETITEM on the module's attribute "
    "itself): it sets attributes of a module or class, or fills its dicts, for all code to meet"
)


def _verdict(findings: Sequence[Finding], error: str | None, code: bool) -> Verdict:
    if any(f.severity == "dangerous" for f in findings):
        return "dangerous"
    return "unreadable" if error is not None else "nonstandard" if findings or code else "clean"


def _unreadable(path: str, fmt: str | None, why: str) -> FileScan:
    return FileScan(path, fmt, "unreadable", error=why)

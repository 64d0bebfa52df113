"""``scan``: can loading this file run code? A verdict per checkpoint, files and folders.

Each file is looked at twice, and nothing in it is ever run:

1. read as torch reads it (:func:`~ckpt_tools.formats.open_checkpoint`, the restricted
   unpickler): a file our reader refuses is ``unreadable``, and the globals it met that
   are off the allowlist are findings;
2. every pickle it holds is walked for its imports
   (:func:`~ckpt_tools.ops.scan.sources.walk_pickles`), including the pickles torch.load
   never reads but other loaders do, each import judged by the severity table.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from ckpt_tools._types import StrPath
from ckpt_tools.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    UnsafeContentError,
    UnsupportedFormatError,
)
from ckpt_tools.formats import detect_format, open_checkpoint
from ckpt_tools.formats.pickle.imports import (
    find_imports,
    npy_pickle_offset,
    python3_qualname,
    starts_like_pickle,
)
from ckpt_tools.formats.zip.directory import ZipEntry
from ckpt_tools.ops.scan.report import FileScan, Finding, ScanReport, Verdict
from ckpt_tools.ops.scan.severity import Context, classify
from ckpt_tools.ops.scan.sources import Walked, code_files, is_npz, walk_pickles

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
        paths: files and folders. Folders are walked recursively and every file in them
            that is a checkpoint by content (whatever its name) is scanned; a DCP folder is
            scanned as one checkpoint; other files are listed as skipped.
        on_file: called before each file with (files done, files in all, the file).

    Returns:
        A :class:`~ckpt_tools.ops.scan.report.ScanReport`: a verdict per file
        (``clean``, ``nonstandard``, ``unreadable``, ``dangerous``) with its findings.

    Raises:
        CheckpointNotFoundError: a path does not exist.

    Example:
        >>> report = scan(["model.pt"])
        >>> [(f.path, f.verdict) for f in report.files]
        [('model.pt', 'clean')]
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    targets: list[tuple[str, bool]] = []  # (path, named by the caller)
    skipped: list[str] = []
    for given in map(os.fspath, paths):
        if not os.path.lexists(given):
            raise CheckpointNotFoundError(f"no such file or folder: {given!r}", path=given)
        if os.path.isdir(given):
            for found, followed in _files_under(given):
                (targets.append((found, False)) if followed else skipped.append(found))
        else:
            targets.append((given, True))
    files: list[FileScan] = []
    for done, (path, named) in enumerate(targets):
        if on_file is not None:
            on_file(done, len(targets), path)
        result = scan_file(path)
        if result is None and named:
            files.append(_unreadable(path, None, _not_a_checkpoint(path)))
        elif result is None:
            skipped.append(path)
        else:
            files.append(result)
    return ScanReport(tuple(files), tuple(skipped))


def _files_under(folder: str) -> Iterator[tuple[str, bool]]:
    """``(path, to scan)`` for everything under ``folder``, in a stable order: each file, and
    each DCP folder as one checkpoint (its other files and folders are walked too);
    symlinked folders are listed, never followed (a link can loop), as not scanned."""
    from ckpt_tools.formats.dcp.reader import DATA_SUFFIX, METADATA_FILE

    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            dirs.remove(name)
            yield os.path.join(root, name), False
        dcp = _is_dcp(root)
        if dcp:
            yield root, True
        for name in sorted(names):
            path = os.path.join(root, name)
            if dcp and (name == METADATA_FILE or name.endswith(DATA_SUFFIX)):
                continue  # read as the DCP checkpoint's
            if os.path.isfile(path):
                yield path, True


def _is_dcp(path: str) -> bool:
    from ckpt_tools.formats.dcp.reader import is_dcp_folder

    return os.path.isdir(path) and is_dcp_folder(path)


def scan_file(path: str) -> FileScan | None:
    """The verdict on one file or DCP folder; None where it is not a checkpoint by content
    (an empty file, text, a git-lfs pointer, an image).

    Example:
        >>> scan_file("model.pt").verdict
        'clean'
    """
    try:
        fmt = _content_format(path)
    except (CheckpointError, OSError) as e:  # not a regular file, or unreadable
        return _unreadable(path, None, str(e))
    if fmt is None:
        return None
    # numpy.load reads an .npy, not torch: there is no torch reading to compare with.
    reading = _Reading(None, (), "", frozenset()) if fmt == "numpy" else _read_as_torch(path)
    error, fmt = reading.error, reading.format or fmt
    walked: list[Walked] = []
    try:
        walked.extend(walk_pickles(path, fmt, skip=reading.read, entries=reading.entries))
    except (CheckpointError, OSError, EOFError) as e:
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
            files = code_files(path)
        except (CheckpointError, OSError) as e:
            error, files = error or str(e), ()
        code = tuple(map(str, files))
        findings += tuple(
            Finding("__setstate__", f.record, "dangerous", _RUNS_ON_LOAD)
            for f in files
            if f.runs_on_load
        )
    verdict = _verdict(findings, error, bool(code))
    pickles = len(walked) + len(reading.read)
    return FileScan(path, fmt, verdict, findings, error, pickles, code)


_RUNS_ON_LOAD = (
    "torch.jit.load runs a TorchScript __setstate__ while it loads the archive (torch.load "
    "hands it one), and TorchScript can read and write files"
)
# Formats torch.load(weights_only=True) refuses whatever their pickles hold.
_FORMATS_BEYOND_WEIGHTS_ONLY = {
    "torch-tar": "torch.load(weights_only=True) refuses the tar format (torch < 0.4); "
    "loading it needs weights_only=False, which runs its pickles",
}


def _content_format(path: str) -> str | None:
    """The format by content; ``pickle`` for any file that parses as one; None for others."""
    try:
        fmt = detect_format(path, content_only=True)
    except UnsupportedFormatError:
        if not os.path.isfile(path):
            raise
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        if npy_pickle_offset(head) is not None:
            return "numpy"
        if starts_like_pickle(head):
            scan = find_imports(head)
            return "pickle" if scan.end is not None or (scan.truncated and scan.imports) else None
        # Any opcode can start a pickle (a damaged legacy file's magic number is one long
        # integer): whole pickles that import something are worth a verdict.
        walks = list(walk_pickles(path, "pickle"))
        whole = walks and walks[0].scan.end is not None
        return "pickle" if whole and any(w.scan.imports for w in walks) else None
    if fmt == "torch-zip" and is_npz(path):
        return "numpy"
    return None if fmt == "hf-sharded" else fmt  # an index: its shards are scanned


def _not_a_checkpoint(path: str) -> str:
    """Why ``path`` is no checkpoint, in the format detector's words (a git-lfs pointer
    says how to fetch the file)."""
    try:
        detect_format(path, content_only=True)
    except CheckpointError as e:
        return str(e)
    return f"{path!r} is not a checkpoint (by content)"


class _Reading(NamedTuple):
    """What our reader (the way torch reads the file) made of it."""

    error: str | None  # why it refuses the file; None where it reads it
    globals: tuple[str, ...]  # the globals off the allowlist it met, as written
    record: str  # where it met them
    read: frozenset[str]  # records it read whole, which need no walk of their own
    format: str | None = None
    entries: tuple[ZipEntry, ...] | None = None  # a zip's records, as it listed them


def _read_as_torch(path: str) -> _Reading:
    try:
        ckpt = open_checkpoint(path)
    except UnsafeContentError as e:  # refused for what it imports: the findings say it
        return _Reading(None, e.globals, "main pickle", frozenset())
    except (CheckpointError, OSError) as e:
        return _Reading(str(e), (), "", frozenset())
    if ckpt.format in ("torch-zip", "torchscript"):
        # The C unpickler read data.pkl to its STOP and asked for every global in it (the
        # same unpickler torch.load runs with weights_only=False): where all were on the
        # allowlist, a walk would add nothing.
        record = f"{ckpt.archive_root}/data.pkl"
        entries = tuple(
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
        # Where it met globals off the allowlist, the walk still names their modules apart
        # from their attribute paths (the reader joins the two).
        read = frozenset() if ckpt.unsafe_globals else frozenset({record})
        return _Reading(None, ckpt.unsafe_globals, record, read, ckpt.format, entries)
    return _Reading(None, ckpt.unsafe_globals, "main pickle", frozenset(), ckpt.format)


def _findings(walked: Sequence[Walked], reading: _Reading, context: Context) -> tuple[Finding, ...]:
    """The imports off the allowlist, once per (global, record)."""
    found: dict[tuple[str, str], Finding] = {}
    for w in walked:
        for imp in w.scan.imports:
            rule = classify(imp.qualname, w.context, exact="." in (imp.name or ""))
            if rule.severity != "allowed":
                found.setdefault(
                    (imp.qualname, w.record),
                    Finding(imp.qualname, w.record, rule.severity, rule.reason, imp.position),
                )
    seen = {name for name, _ in found}
    for name in map(python3_qualname, reading.globals):
        # Where the walk did not read the pickle, or could not name a computed global.
        if name not in seen:
            rule = classify(name, context, exact=True)  # its module and name are not known
            if rule.severity != "allowed":
                found[(name, "")] = Finding(name, reading.record, rule.severity, rule.reason)
    return tuple(found.values())


def _verdict(findings: Sequence[Finding], error: str | None, code: bool) -> Verdict:
    if any(f.severity == "dangerous" for f in findings):
        return "dangerous"
    if error is not None:
        return "unreadable"
    return "nonstandard" if findings or code else "clean"


def _unreadable(path: str, fmt: str | None, why: str) -> FileScan:
    return FileScan(path, fmt, "unreadable", error=why)

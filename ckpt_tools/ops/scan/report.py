"""What ``scan`` found: a verdict per file, its findings, and the report over them all.

Verdicts, from best to worst: ``clean`` (every import is on torch's ``weights_only``
allowlist), ``nonstandard`` (known data types outside it, or TorchScript code),
``unreadable`` (not read the way torch reads it: a finding too) and ``dangerous`` (an import
that can run code, or one the table does not know). A file that is both unreadable and
dangerous is dangerous.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from ckpt_tools._version import __version__
from ckpt_tools.errors import EXIT_CORRUPT, EXIT_DIFFERENCES, EXIT_OK, shown
from ckpt_tools.ops.scan.severity import Severity
from ckpt_tools.structure.text import Readable

__all__ = ["VERDICTS", "FileScan", "Finding", "ScanReport", "Verdict"]

Verdict = Literal["clean", "nonstandard", "unreadable", "dangerous"]
#: Best to worst.
VERDICTS: tuple[Verdict, ...] = ("clean", "nonstandard", "unreadable", "dangerous")
_SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_SARIF_RULES = {
    "dangerous-global": ("error", "A pickle imports a global that can run code"),
    "nonstandard-global": ("warning", "A pickle imports a data type outside weights_only"),
    "unreadable": ("error", "The file cannot be read the way torch reads it"),
    "torchscript-code": ("note", "A TorchScript archive holds code (by design)"),
}


@dataclass(frozen=True)
class Finding(Readable):
    """One import of a pickle that is not on the allowlist.

    Attributes:
        global_name: the qualified name (``posix.system``), or ``<computed global>``; None
            for a finding about the file's format itself (the record names the format).
        record: where the pickle lies in the file (``archive/data.pkl``, ``main pickle``).
        severity: ``nonstandard`` or ``dangerous``.
        reason: why, from the severity table.
        position: the byte offset of the importing opcode in that pickle (None when only
            the reader saw it).
    """

    global_name: str | None
    record: str
    severity: Severity
    reason: str
    position: int | None = None

    def text(self) -> str:
        """``severity: global in record: reason``, as ``ckpt scan`` lists it under its file."""
        what = (
            f"{self.global_name} in {self.record}"
            if self.global_name
            else f"the {self.record} format"
        )
        return shown(f"{self.severity}: {what}: {self.reason}")

    def to_json(self) -> dict[str, Any]:
        """This finding as JSON-ready data."""
        return {
            "global": self.global_name,
            "record": self.record,
            "severity": self.severity,
            "reason": self.reason,
            "position": self.position,
        }


@dataclass(frozen=True)
class FileScan(Readable):
    """The verdict on one file (or DCP folder).

    Attributes:
        path: the file.
        format: its format by content (None where it has none we read).
        verdict: see :data:`VERDICTS`.
        findings: the imports off the allowlist, each once per record.
        error: why the file is unreadable (None otherwise).
        pickles: how many pickles were read or walked.
        code: TorchScript code files and the classes they define.
        transfer: for a file read from a URL, the requests its scan made and the bytes it
            received (:class:`~ckpt_tools.io.remote.TransferStats`); None for a local file.
    """

    path: str
    format: str | None
    verdict: Verdict
    findings: tuple[Finding, ...] = ()
    error: str | None = None
    pickles: int = 0
    code: tuple[str, ...] = ()
    # Not part of to_json() or of equality: a file's verdict is the same wherever it lies.
    transfer: Any = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        """This file's verdict as JSON-ready data."""
        return {
            "path": self.path,
            "format": self.format,
            "verdict": self.verdict,
            "error": self.error,
            "pickles": self.pickles,
            "findings": [f.to_json() for f in self.findings],
            "code": list(self.code),
        }

    def text(self) -> str:
        """One line for the file, then one per finding, indented.

        Each line is :func:`~ckpt_tools.errors.shown`: a path, global or record name holding a
        line break cannot start a line of its own (and forge a verdict)."""
        head = f"{self.verdict:<12} {self.path}" + (f" ({self.format})" if self.format else "")
        lines = [head]
        if self.error:
            lines.append(f"    {self.error}")
        records: dict[tuple[str, str | None, str], list[str]] = {}
        for f in self.findings:  # a global imported by many records is one line
            records.setdefault((f.severity, f.global_name, f.reason), []).append(f.record)
        for (severity, name, reason), where in records.items():
            more = f" and {len(where) - 1} more" if len(where) > 1 else ""
            what = f"{name} in {where[0]}{more}" if name else f"the {where[0]} format"
            lines.append(f"    {severity}: {what}: {reason}")
        lines.extend(f"    code: {c}" for c in self.code)
        return "\n".join(map(shown, lines))


@dataclass(frozen=True)
class ScanReport(Readable):
    """The verdicts on every file scanned.

    Attributes:
        files: one :class:`FileScan` per checkpoint, in the order found.
        skipped: files inside scanned folders that are not checkpoints (by content), and
            the shard indexes of folder URLs.
        transfer: where URLs were scanned, what reading them cost in all (requests, bytes
            received, a folder's look-ups included); None where every path was local.

    Example:
        >>> from ckpt_tools import scan
        >>> report = scan(["model.pt"])
        >>> report.verdict, report.exit_code()
        ('clean', 0)
    """

    files: tuple[FileScan, ...]
    skipped: tuple[str, ...] = field(default=())
    transfer: Any = field(default=None, compare=False)

    @property
    def verdict(self) -> Verdict:
        """The worst verdict of any file (``clean`` when there are none)."""
        return max((f.verdict for f in self.files), key=VERDICTS.index, default="clean")

    def exit_code(self, *, fail_on: Literal["dangerous", "nonstandard"] = "dangerous") -> int:
        """The ``ckpt scan`` exit code: 1 for something dangerous (or nonstandard, with
        ``fail_on="nonstandard"``), 4 for an unreadable file, else 0 (the worst decides)."""
        verdict = self.verdict
        if verdict == "dangerous" or (verdict == "nonstandard" and fail_on == "nonstandard"):
            return EXIT_DIFFERENCES
        return EXIT_CORRUPT if verdict == "unreadable" else EXIT_OK

    def summary(self) -> str:
        """``3 files: 1 dangerous, 2 clean`` (and the files skipped)."""
        counts = Counter(f.verdict for f in self.files)
        parts = [f"{counts[v]} {v}" for v in reversed(VERDICTS) if counts[v]]
        noun = "file" if len(self.files) == 1 else "files"
        line = f"{len(self.files)} {noun}: {', '.join(parts) or 'none'}"
        if self.skipped:
            line += f"; {len(self.skipped)} skipped (not checkpoints)"
        return line

    def text(self) -> str:
        """Each file's lines, then the summary."""
        return "\n".join([*(f.text() for f in self.files), self.summary()])

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {
            "verdict": self.verdict,
            "files": [f.to_json() for f in self.files],
            "skipped": list(self.skipped),
        }

    def to_sarif(self) -> dict[str, Any]:
        """The report as a SARIF 2.1.0 log (for code-scanning tools): one result per finding,
        per unreadable file and per TorchScript code file."""
        results = []
        for file in self.files:
            location = [{"physicalLocation": {"artifactLocation": {"uri": _uri(file.path)}}}]
            for f in file.findings:
                rule = f"{f.severity}-global"
                what = f"{f.global_name} in {f.record}" if f.global_name else f"{f.record} format"
                text = f"{what}: {f.reason}"
                results.append(_result(rule, text, location, {"record": f.record}))
            if file.error:
                results.append(_result("unreadable", file.error, location, {}))
            for code in file.code:
                results.append(_result("torchscript-code", code, location, {}))
        rules = [
            {"id": rule, "shortDescription": {"text": text}, "defaultConfiguration": {"level": lv}}
            for rule, (lv, text) in _SARIF_RULES.items()
        ]
        driver = {"name": "ckpt scan", "version": __version__, "rules": rules}
        return {
            "$schema": _SARIF_SCHEMA,
            "version": "2.1.0",
            "runs": [{"tool": {"driver": driver}, "results": results}],
        }


def _result(rule: str, text: str, location: list[Any], properties: dict[str, Any]) -> Any:
    return {
        "ruleId": rule,
        "level": _SARIF_RULES[rule][0],
        "message": {"text": text},
        "locations": location,
        **({"properties": properties} if properties else {}),
    }


def _uri(path: str) -> str:
    from pathlib import PurePath
    from urllib.parse import quote

    from ckpt_tools.io.remote.httpurls import shown_url
    from ckpt_tools.io.remote.urls import is_url

    if is_url(path):  # a URI already (PurePath would fold its '//'), shown without credentials
        return shown_url(path)
    # A URI reference: '#', '?', '%', spaces and a ':' that would read as a scheme escaped;
    # a name's bytes as the file system holds them (one that is no UTF-8: %FF).
    return quote(os.fsencode(PurePath(path).as_posix()), safe="/")

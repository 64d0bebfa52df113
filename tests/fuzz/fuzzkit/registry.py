"""The regression corpus: files under ``tests/fuzz/regressions/`` and their manifest.

``EXPECTED_FAILURES.json`` maps a regression file name to the finding class it shows, the
signature of the finding, what goes wrong, and which run shows it (``via``: ``ct.inspect``,
or a ``ckpt`` command with its arguments). A file listed there is a known open bug: its
regression test is ``xfail(strict=True)``, so a fix flips it to XPASS and the entry must be
removed. A file not listed must pass every invariant.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checks import Finding

HERE = Path(__file__).resolve().parents[1]
REGRESSIONS = HERE / "regressions"
EXPECTED_FILE = REGRESSIONS / "EXPECTED_FAILURES.json"
FINDINGS_DIR = HERE / "findings"  # ignored by git: the campaign's log
MAX_REGRESSION_BYTES = 64 * 1024
PER_SIGNATURE = 2  # regression files kept per new signature in one run


def load_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class Registry:
    """Where findings go: known signatures are counted, new ones become regression files."""

    def __init__(self, write: bool = True, log_name: str = "findings.jsonl") -> None:
        self.expected = expected()
        self.known = set()
        for entry in self.expected.values():
            self.known.add(entry["signature"])
            self.known.update(entry.get("also", []))
        for sig in list(self.known):  # inspect shows the same bug in the library and the command
            self.known.add(sig.replace(":ct.inspect:", ":inspect:"))
            self.known.add(sig.replace(":inspect:", ":ct.inspect:"))
        self.write = write
        self.seen: Counter[str] = Counter()
        self.new: list[tuple[Finding, str | None]] = []
        self.examples: dict[str, str] = {}
        self.log_file = FINDINGS_DIR / log_name

    def report(
        self, findings: Sequence[Finding], data: bytes, ext: str, mutations: Sequence[str]
    ) -> None:
        for f in findings:
            self.seen[f.signature] += 1
            if f.signature in self.known or self.seen[f.signature] > PER_SIGNATURE:
                continue
            name = f"c{f.klass}-{hashlib.sha256(data).hexdigest()[:10]}{ext}"
            if self.write and len(data) <= MAX_REGRESSION_BYTES:
                REGRESSIONS.mkdir(parents=True, exist_ok=True)
                target = REGRESSIONS / name
                if not target.exists():
                    target.write_bytes(data)
                self.log(f, name, mutations)
            elif self.write:
                self.log(f, None, mutations)
                name = f"(too large: {len(data)} bytes)"
            self.examples.setdefault(f.signature, name)
            self.new.append((f, name))

    def log(self, f: Finding, name: str | None, mutations: Sequence[str]) -> None:
        FINDINGS_DIR.mkdir(exist_ok=True)
        record = {
            "file": name,
            "signature": f.signature,
            "class": f.klass,
            "message": f.message,
            "mutations": list(mutations),
            "context": f.context,
        }
        with self.log_file.open("a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def summary(self) -> str:
        lines = [f"{n:6d}  {sig}" for sig, n in sorted(self.seen.items())]
        return "\n".join(lines) or "(no findings)"

    def new_summary(self) -> str:
        return "\n".join(f"{f}  -> regressions/{name}" for f, name in self.new)


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def assert_no_new(registry: Registry) -> None:
    """Fail on findings no manifest entry knows (their inputs are already filed)."""
    assert not registry.new, (
        "new invariant violations (files written to tests/fuzz/regressions/; add each to "
        "EXPECTED_FAILURES.json if it is a known open bug):\n" + registry.new_summary()
    )


def regression_files() -> list[Path]:
    return sorted(
        p for p in REGRESSIONS.iterdir() if p.is_file() and p.suffix in (".pt", ".safetensors")
    )


def expected() -> dict[str, Any]:
    """The manifest, without its ``_comment``."""
    return {k: v for k, v in load_json(EXPECTED_FILE).items() if not k.startswith("_")}

"""The fenced examples of README.md and docs/*.md, and the markers that say how each runs.

A block is marked by HTML comments on the lines above its opening fence (blank lines may sit
between them), which Markdown renders as nothing:

- ``<!-- needs: gpu -->``: runs only where torch sees a CUDA device; skipped elsewhere.
- ``<!-- needs: cluster -->``: several processes or machines (torchrun, spawned ranks); always
  skipped here, with that reason.
- ``<!-- needs: network -->``: reads a remote file (the Hub, a bucket, a web server); always
  skipped here, with that reason: the suite's own servers test the same commands.
- ``<!-- file: NAME -->``: the block is a file the page's other examples use: it is written
  as ``NAME`` into the folder every example of the page runs in.
- ``<!-- schema: NAME -->``: a ``--json`` schema (see ``tests/docs/schemas.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import ROOT

SHELL = frozenset({"bash", "sh", "shell", "console"})
PYTHON = frozenset({"python", "py"})
# Blocks that show text, not something to run; a command in one of them is an error.
SHOWN = frozenset({"", "text", "json", "toml", "ini", "yaml"})
NEEDS = {
    "gpu": "needs a CUDA device",
    "cluster": "needs several processes or machines (torchrun, spawned ranks)",
    "network": "reads a remote file over the network (tests/io/remote/ runs local servers)",
}

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<key>[\w-]+)\s*:\s*(?P<value>.*?)\s*-->\s*$")
# A line in a block that is not run, which reads as a command or Python code.
_LOOKS_RUNNABLE = re.compile(r"^\s*(\$ |ckpt |>>> |import ckpt_tools|from ckpt_tools )")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and the markers above it."""

    page: str  # "README.md" or "docs/cookbook.md"
    line: int  # the opening fence's line number, from 1
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in SHELL or self.lang in PYTHON


def pages() -> list[Path]:
    """README.md and every page of docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(text: str, page: str) -> list[Block]:
    """Every fenced block of one Markdown page, with the markers just above each.

    Raises:
        ValueError: a fence is never closed, or a marker is unknown.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = _closing(lines, i, opening["fence"])
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a fence that is never closed")
        indent = len(opening["indent"])
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        markers = _markers(lines, i, page)
        blocks.append(Block(page, i + 1, opening["lang"].lower(), body, markers))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    """The blocks of every page."""
    return [
        block
        for path in pages()
        for block in parse(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    ]


def misfiled(block: Block) -> list[str]:
    """Lines of a block that is not run which read as commands or code (tag the block)."""
    if block.runnable or block.lang not in SHOWN or "schema" in block.markers:
        return []
    return [line for line in block.text.splitlines() if _LOOKS_RUNNABLE.match(line)]


def _closing(lines: list[str], start: int, fence: str) -> int | None:
    for j in range(start + 1, len(lines)):
        stripped = lines[j].strip()
        if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
            return j
    return None


def _markers(lines: list[str], fence: int, page: str) -> dict[str, str]:
    markers: dict[str, str] = {}
    j = fence - 1
    while j >= 0 and (not lines[j].strip() or _MARKER.match(lines[j])):
        found = _MARKER.match(lines[j])
        if found:
            key, value = found["key"], found["value"]
            if key not in ("needs", "file", "schema"):
                raise ValueError(f"{page}:{j + 1}: unknown marker {key!r}")
            if key == "needs" and value not in NEEDS:
                raise ValueError(f"{page}:{j + 1}: needs {value!r}: one of {sorted(NEEDS)}")
            markers[key] = value
        j -= 1
    return markers

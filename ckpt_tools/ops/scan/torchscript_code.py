"""A TorchScript archive's code files, for ``scan``: the classes each defines, and whether
one defines ``__setstate__``, which ``torch.jit.load`` runs while it loads the archive."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from ckpt_tools.formats.base import RangeSource
from ckpt_tools.formats.zip.directory import located, read_zip_directory
from ckpt_tools.formats.zip.records import read_head
from ckpt_tools.formats.zip.source import ZipSource

__all__ = ["CODE_READ_BYTES", "CodeFile", "code_files"]

# A code file is read up to this many bytes (a model's code is a few hundred KB).
CODE_READ_BYTES = 64 << 20
_CLASS = re.compile(rb"^class\s+([A-Za-z_]\w*)", re.MULTILINE)
# The name anywhere in a code file: TorchScript's lexer joins backslash-continued lines (and
# no regex is its parser), and the serialized code holds no comments to mention it in.
_SETSTATE = b"__setstate__"


class CodeFile(NamedTuple):
    """A TorchScript archive's code file: the classes it defines, whether one of them has a
    ``__setstate__`` (which ``torch.jit.load`` runs while it loads the archive), and whether
    it is longer than what is read of it (where one could lie unseen)."""

    record: str
    classes: tuple[str, ...]
    runs_on_load: bool
    read_in_part: bool = False

    def __str__(self) -> str:
        return f"{self.record}: " + (f"class {', '.join(self.classes)}" if self.classes else "code")


def code_files(path: str, source: RangeSource | None = None) -> tuple[CodeFile, ...]:
    """A TorchScript archive's code files (``archive/code/__torch__.py: class TinyNet``);
    ``source`` is the file read by ranges where ``path`` is its URL."""
    if source is not None:
        return _code_files(path, source, source.size)
    fd = os.open(path, os.O_RDONLY)
    try:
        return _code_files(path, fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _code_files(path: str, fd: ZipSource, size: int) -> tuple[CodeFile, ...]:
    found = []
    remote = not isinstance(fd, int)
    for entry in read_zip_directory(path, fd, size, defer_local=remote):
        folded = entry.name.lower()  # torch's lookup of a record ignores ASCII case
        if "/code/" not in folded or not folded.endswith(".py"):
            continue
        text = read_head(fd, located(path, fd, entry), CODE_READ_BYTES + 1)
        in_part, text = len(text) > CODE_READ_BYTES, text[:CODE_READ_BYTES]
        classes = tuple(m.decode("ascii") for m in _CLASS.findall(text))
        found.append(CodeFile(entry.name, classes, _SETSTATE in text, in_part))
    return tuple(found)

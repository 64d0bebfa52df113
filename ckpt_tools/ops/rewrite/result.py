"""What a rewrite returns: :class:`RewriteResult`, and its text for people.

``str(result)`` is what ``ckpt strip-module`` / ``rename`` / ``convert`` / ``retag`` print.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.structure.keys import WrapperMatch
from ckpt_tools.structure.text import Readable, human_bytes

__all__ = ["RewriteResult"]

# Names left out of the output shown in the text; ``--json`` has them all.
_DROPPED_SHOWN = 8


@dataclass(frozen=True)
class RewriteResult(Readable):
    """What a rewrite did.

    Attributes:
        src: the input.
        dst: the output; None when nothing was written.
        written: whether the output was written.
        input_format: format of the input.
        output_format: ``torch-zip`` or ``safetensors``.
        selected: path of the state dict that was rewritten.
        rules: the key rules applied, in words.
        renamed: how many keys changed.
        total_keys: keys in the state dict.
        examples: a few ``(old, new)`` pairs.
        wrappers: wrappers stripped (for ``strip-module`` without ``--prefix``).
        bytes_copied: tensor bytes copied.
        verification: what was verified.
        dropped: names left out (deduplicated tied tensors, non-tensor entries).
        device_map: saved device tag -> new tag, for retags.
        message: a one-line summary for people; ``str(result)`` adds the details.
    """

    src: str
    dst: str | None
    written: bool
    input_format: str
    output_format: str
    selected: tuple[str, ...]
    rules: tuple[str, ...]
    renamed: int
    total_keys: int
    examples: tuple[tuple[str, str], ...] = ()
    wrappers: tuple[WrapperMatch, ...] = ()
    bytes_copied: int = 0
    verification: str = ""
    dropped: tuple[str, ...] = ()
    device_map: Mapping[str, str] = field(default_factory=dict)
    message: str = ""

    def text(self) -> str:
        """What the ``ckpt`` rewrite commands print: the message, a few renames, the totals.

        Example:
            >>> from ckpt_tools import strip_module_file
            >>> print(strip_module_file("ddp.pt", "plain.pt"))
            stripped 'module.': wrote plain.pt (17 of 17 keys renamed)
              module.conv.weight -> conv.weight
            ...
        """
        if not self.written:
            return self.message
        lines = [self.message]
        lines += [f"  {old} -> {new}" for old, new in self.examples]
        if self.renamed > len(self.examples):
            lines.append(f"  ... and {self.renamed - len(self.examples)} more")
        if self.dropped:
            lines.append(f"left out: {', '.join(self.dropped[:_DROPPED_SHOWN])}")
        if self.device_map:
            moved = ", ".join(f"{a} -> {b}" for a, b in self.device_map.items())
            lines.append(f"device tags: {moved}")
        lines.append(
            f"{self.output_format}, {human_bytes(self.bytes_copied)} of tensors copied; "
            f"{self.verification}"
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"RewriteResult(src={self.src!r}, dst={self.dst!r}, written={self.written}, "
            f"output_format={self.output_format!r}, renamed={self.renamed}/{self.total_keys})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "written": self.written,
            "input_format": self.input_format,
            "output_format": self.output_format,
            "selected": list(self.selected),
            "rules": list(self.rules),
            "renamed": self.renamed,
            "total_keys": self.total_keys,
            "examples": [list(e) for e in self.examples],
            "wrappers": [w.to_json() for w in self.wrappers],
            "bytes_copied": self.bytes_copied,
            "verification": self.verification,
            "dropped": list(self.dropped),
            "device_map": dict(self.device_map),
            "message": self.message,
        }

"""What ``sanitize`` returns: :class:`SanitizeReport`, and its text for people.

``str(report)`` is what ``ckpt sanitize`` prints; ``report.to_json()`` is ``--json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tools.ops.output_plan import PlannedFile, plan_json, planned_text
from ckpt_tools.ops.sanitize.tree import Change
from ckpt_tools.structure.text import Readable, human_bytes

__all__ = ["Change", "SanitizeReport"]


@dataclass(frozen=True)
class SanitizeReport(Readable):
    """What :func:`~ckpt_tools.ops.sanitize.sanitizing.sanitize` did.

    Attributes:
        src: the input.
        dst: the output.
        input_format: format of the input.
        selected: path of the state dict in the output (as in the input).
        tensors: tensors in the output's selected state dict.
        converted: every object turned into plain values, with its path in the checkpoint.
        dropped: every value left out, with its path.
        bytes_copied: tensor bytes copied from the input.
        bytes_added: bytes of new tensor records (numpy arrays).
        verification: what was verified.
        message: a one-line summary.
        written: False for a dry run.
        planned: with ``dry_run``, the file it would write and the tensors in it.
    """

    src: str
    dst: str
    input_format: str
    selected: tuple[str, ...]
    tensors: int
    converted: tuple[Change, ...]
    dropped: tuple[Change, ...]
    bytes_copied: int
    bytes_added: int
    verification: str
    message: str
    written: bool = True
    planned: tuple[PlannedFile, ...] = ()

    def text(self) -> str:
        """The message, every conversion and drop, the totals.

        Example:
            >>> change = Change("args", "argparse.Namespace", "dict")
            >>> report = SanitizeReport(
            ...     "a.pt", "b.pt", "torch-zip", (), 2, (change,), (), 8, 0, "verified", "wrote"
            ... )
            >>> print(report)
            wrote
            converted:
              args: argparse.Namespace -> dict
            torch-zip, 8 B of tensors copied, 0 B added; verified
        """
        lines = [self.message]
        for title, changes in (("converted", self.converted), ("dropped", self.dropped)):
            if changes:
                lines.append(f"{title}:")
                lines += [f"  {c}" for c in changes]
        if not self.written:
            return "\n".join([*lines, *planned_text(self.planned)])
        lines.append(
            f"torch-zip, {human_bytes(self.bytes_copied)} of tensors copied, "
            f"{human_bytes(self.bytes_added)} added; {self.verification}"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "input_format": self.input_format,
            "selected": list(self.selected),
            "tensors": self.tensors,
            "converted": [c.to_json() for c in self.converted],
            "dropped": [c.to_json() for c in self.dropped],
            "bytes_copied": self.bytes_copied,
            "bytes_added": self.bytes_added,
            "verification": self.verification,
            "message": self.message,
            "written": self.written,
            "dry_run": not self.written,
            **(plan_json(self.planned) if not self.written else {}),
        }

"""What ``sanitize`` returns: :class:`SanitizeResult`, and its text for people.

``str(result)`` is what ``ckpt sanitize`` prints; ``result.to_json()`` is ``--json``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ckpt_tools.ops.output_plan import WriteResult

__all__ = ["Change", "SanitizeResult"]


@dataclass(frozen=True)
class Change:
    """One conversion or drop: where in the checkpoint, what it was, what it became."""

    path: str
    was: str
    became: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "was": self.was, "became": self.became}

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.was} -> {self.became}"

    def moved(self, first: str, path: str) -> Change:
        """This change, found under ``first``, as it stands under ``path`` (the same object
        held in a second place)."""
        rest = self.path[len(first) :]
        if first == "" and rest:
            rest = "." + rest
        return replace(self, path=(path + rest) if path else rest.removeprefix("."))


@dataclass(frozen=True, kw_only=True, repr=False)
class SanitizeResult(WriteResult):
    """What :func:`~ckpt_tools.ops.sanitize.sanitizing.sanitize` did: the fields of
    :class:`~ckpt_tools.ops.output_plan.WriteResult` (``dropped``: the path of every value
    left out; ``bytes_copied``: tensor bytes copied from the input, the rest being numpy
    arrays' new records; ``selected``: the state dict's path, in the output as in the input;
    ``tensors``: the tensors of the output's selected state dict), and

    Attributes:
        converted: every object turned into plain values, with its path in the checkpoint.
        dropped_values: every value left out: its path, and what it was.
    """

    converted: tuple[Change, ...] = ()
    dropped_values: tuple[Change, ...] = ()

    def details(self) -> list[str]:
        """Every conversion.

        Example:
            >>> change = Change("args", "argparse.Namespace", "dict")
            >>> result = SanitizeResult(src="a.pt", dst="b.pt", input_format="torch-zip",
            ...     output_format="torch-zip", written=("b.pt",), bytes_written=8,
            ...     bytes_copied=8, verification="verified", message="wrote", converted=(change,))
            >>> print(result)
            wrote
            converted:
              args: argparse.Namespace -> dict
            torch-zip, 8 B of tensors written, 8 B of them copied; verified
        """
        if not self.converted:
            return []
        return ["converted:", *(f"  {c}" for c in self.converted)]

    def left_out(self) -> list[str]:
        """Every value left out, with what it was."""
        if not self.dropped_values:
            return []
        return ["dropped:", *(f"  {c}" for c in self.dropped_values)]

    def to_json(self) -> dict[str, Any]:
        return {
            **super().to_json(),
            "converted": [c.to_json() for c in self.converted],
            "dropped_values": [c.to_json() for c in self.dropped_values],
        }

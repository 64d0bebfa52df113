"""What a rewrite returns: :class:`RewriteResult`, and its text for people.

``str(result)`` is what ``ckpt strip-module`` / ``add-module`` / ``rename`` / ``convert`` /
``retag`` / ``reshard`` print.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.ops.output_plan import WriteResult
from ckpt_tools.structure.wrappers import WrapperMatch

__all__ = ["RewriteResult"]

# Renames listed in the text; ``--json`` has those the result holds.
_EXAMPLES_SHOWN = 3


@dataclass(frozen=True, kw_only=True, repr=False)
class RewriteResult(WriteResult):
    """What a rewrite, a conversion or a reshard did: the fields of
    :class:`~ckpt_tools.ops.output_plan.WriteResult` (for a folder output, ``written`` is the
    shards then the index, and ``dropped`` the tied tensors stored once), and

    Attributes:
        rules: the key rules applied, in words.
        total_keys: keys in the state dict.
        examples: ``(old, new)`` pairs: a few, or every one for a dry run.
        wrappers: wrappers stripped (for ``strip_module`` without ``prefix``).
        device_map: saved device tag -> new tag, for retags.
        max_shard_size: for a Hugging Face sharded folder output, the shard limit in bytes;
            0 for a single file.
    """

    rules: tuple[str, ...] = ()
    total_keys: int = 0
    examples: tuple[tuple[str, str], ...] = ()
    wrappers: tuple[WrapperMatch, ...] = ()
    device_map: Mapping[str, str] = field(default_factory=dict)
    max_shard_size: int = 0

    def details(self) -> list[str]:
        """A few renames, and the device tags of a retag.

        Example:
            >>> from ckpt_tools import strip_module
            >>> print(strip_module("ddp.pt", "plain.pt"))
            stripped 'module.': wrote plain.pt (17 of 17 keys renamed)
              module.conv.weight -> conv.weight
            ...
        """
        shown = self.examples[:_EXAMPLES_SHOWN]
        lines = [f"  {old} -> {new}" for old, new in shown]
        if self.renamed > len(shown):
            lines.append(f"  ... and {self.renamed - len(shown)} more")
        if self.device_map:
            moved = ", ".join(f"{a} -> {b}" for a, b in self.device_map.items())
            lines.append(f"device tags: {moved}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            **super().to_json(),
            "rules": list(self.rules),
            "total_keys": self.total_keys,
            "examples": [list(e) for e in self.examples],
            "wrappers": [w.to_json() for w in self.wrappers],
            "device_map": dict(self.device_map),
            "max_shard_size": self.max_shard_size,
        }

"""What a transform (slim, extract, average) did, or with ``dry_run`` would do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tools.ops.transform.plan import TransformPlan
from ckpt_tools.structure.text import human_bytes

__all__ = ["TransformResult"]


@dataclass(frozen=True)
class TransformResult:
    """The outcome of ``slim``, ``extract`` or ``average``.

    Attributes:
        plan: the plan that was (or, for a dry run, would be) written.
        written: False for a dry run.
        verification: what was verified after writing ("" for a dry run).
        message: one line for people.
    """

    plan: TransformPlan
    written: bool
    verification: str
    message: str

    @property
    def cast(self) -> tuple[str, ...]:
        """Output keys whose tensors were cast."""
        return tuple(r.key for r in self.plan.rows if r.key and r.action.startswith("cast"))

    @property
    def kept(self) -> tuple[str, ...]:
        """Output keys whose tensors were copied as they are."""
        return tuple(r.key for r in self.plan.rows if r.key and not r.action.startswith("cast"))

    @property
    def dropped(self) -> tuple[str, ...]:
        """Top-level entries and state-dict keys left out."""
        gone = tuple(r.source_key for r in self.plan.rows if r.key is None)
        return self.plan.dropped_entries + gone

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data: the plan, whether it was written, and what was verified."""
        return {
            **self.plan.to_json(),
            "written": self.written,
            "dry_run": not self.written,
            "verification": self.verification,
            "message": self.message,
        }

    def text(self) -> str:
        """The message, sizes per category, and one line per tensor (first 40)."""
        before, after = self.plan.size_before, self.plan.size_after
        lines = [self.message]
        for category in before:
            lines.append(
                f"  {category:<10} {human_bytes(before[category]):>10} -> "
                f"{human_bytes(after.get(category, 0)):>10}"
            )
        lines += [f"  note: {n}" for n in self.plan.notes]
        if self.plan.dropped_entries:
            lines.append(f"  dropped entries: {', '.join(self.plan.dropped_entries)}")
        for row in self.plan.rows[:40]:
            name = (
                row.source_key
                if row.key in (None, row.source_key)
                else f"{row.source_key} -> {row.key}"
            )
            dtype = (
                row.dtype_before
                if row.dtype_after in (None, row.dtype_before)
                else f"{row.dtype_before} -> {row.dtype_after}"
            )
            lines.append(f"  {row.action:<26} {name}  {dtype}  {human_bytes(row.nbytes_after)}")
        if len(self.plan.rows) > 40:
            lines.append(f"  ... {len(self.plan.rows) - 40} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

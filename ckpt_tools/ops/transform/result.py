"""What a transform (slim, extract, average) did, or with ``dry_run`` would do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.ops.output_plan import WriteResult
from ckpt_tools.ops.transform.plan import PlanRow, TransformPlan
from ckpt_tools.structure.text import human_bytes

__all__ = ["TransformResult"]

# Tensor rows listed in the text; ``--json`` has them all.
_ROWS_SHOWN = 40
# An average's inputs listed in the text: all of them up to this many, else the first and
# last few (the last are the ones ``--last`` picked, the first say where the run starts).
_SOURCES_SHOWN = 8
_SOURCES_ENDS = 3


@dataclass(frozen=True, kw_only=True, repr=False)
class TransformResult(WriteResult):
    """The outcome of ``slim``, ``extract`` or ``average``: the fields of
    :class:`~ckpt_tools.ops.output_plan.WriteResult`, and

    Attributes:
        command: ``slim``, ``extract`` or ``average``.
        sources: the input files.
        rows: one row per tensor of the state dict acted on (kept, cast, averaged, dropped).
        size_before: tensor bytes per category (weights, optimizer, other) in the input.
        size_after: tensor bytes per category in the output.
        plan: the plan itself (its records), as :func:`~.plan.execute_plan` takes it.
    """

    command: str
    sources: tuple[str, ...]
    rows: tuple[PlanRow, ...] = ()
    size_before: Mapping[str, int] = field(default_factory=dict)
    size_after: Mapping[str, int] = field(default_factory=dict)
    plan: TransformPlan | None = field(default=None, compare=False)

    @property
    def cast(self) -> tuple[str, ...]:
        """Output keys whose tensors were cast."""
        return tuple(r.key for r in self.rows if r.action.startswith("cast"))

    @property
    def kept(self) -> tuple[str, ...]:
        """Output keys whose tensors were copied as they are."""
        return tuple(r.key for r in self.rows if not r.dropped and not r.action.startswith("cast"))

    def details(self) -> list[str]:
        """An average's inputs, sizes per category, and one line per tensor (the first 40)."""
        before, after = self.size_before, self.size_after
        lines = self._source_lines()
        lines += [
            f"  {category:<10} {human_bytes(before[category]):>10} -> "
            f"{human_bytes(after.get(category, 0)):>10}"
            for category in before
        ]
        for row in self.rows[:_ROWS_SHOWN]:
            name = (
                row.source_key
                if row.dropped or row.key == row.source_key
                else (f"{row.source_key} -> {row.key}")
            )
            dtype = (
                row.dtype_before
                if row.dtype_after in (None, row.dtype_before)
                else (f"{row.dtype_before} -> {row.dtype_after}")
            )
            lines.append(f"  {row.action:<26} {name}  {dtype}  {human_bytes(row.nbytes_after)}")
        if len(self.rows) > _ROWS_SHOWN:
            lines.append(f"  ... {len(self.rows) - _ROWS_SHOWN} more")
        return lines

    def _source_lines(self) -> list[str]:
        """The inputs of an average, one a line (the first and last few of many).

        Only ``average`` lists them: its inputs come from globs and ``--last``, so only the
        text can say which files were picked; the other transforms' inputs are the ones
        named on their command line.

        Example:
            >>> r = TransformResult(src="a.pt", dst="m.pt", input_format="torch-zip",
            ...     output_format="torch-zip", command="average", sources=("a.pt", "b.pt"))
            >>> r._source_lines()
            ['  mean of 2 inputs:', '    a.pt', '    b.pt']
        """
        if self.command != "average":
            return []
        names = list(self.sources)
        if len(names) > _SOURCES_SHOWN:
            hidden = len(names) - 2 * _SOURCES_ENDS
            names = [*names[:_SOURCES_ENDS], f"... {hidden} more", *names[-_SOURCES_ENDS:]]
        return [f"  mean of {len(self.sources)} inputs:", *(f"    {name}" for name in names)]

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data: the shared fields (``tensors``: how many the output holds), the
        sizes, and every tensor's row (``rows``)."""
        return {
            **super().to_json(),
            "command": self.command,
            "sources": list(self.sources),
            "size_before": dict(self.size_before),
            "size_after": dict(self.size_after),
            "rows": [row.to_json() for row in self.rows],
        }

"""The results of :func:`ckpt_tools.diffing.engine.diff`: frozen dataclasses, torch-free.

Convention: A is what you have, B is what it should match; *missing* keys are in B and not
in A, *unexpected* keys are in A and not in B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.diffing.parts import SideInfo, Suggestion, TensorDiff
from ckpt_tools.diffing.table import DIFF_COLUMNS, diff_rows
from ckpt_tools.errors import SelectError, shown
from ckpt_tools.structure.grouping import fold_names
from ckpt_tools.structure.text import (
    Readable,
    TableFormat,
    TensorsByName,
    close_matches,
    more_hint,
    text_table,
)

__all__ = ["FAIL_CATEGORIES", "DiffReport"]

#: What ``ckpt diff --fail-on`` can fail on.
FAIL_CATEGORIES = ("missing", "unexpected", "kind", "shape", "dtype", "layout", "value")
# Missing and unexpected keys shown (folded) in the text; ``--json`` has them all.
_KEYS_SHOWN = 12


@dataclass(frozen=True)
class DiffReport(Readable, TensorsByName[TensorDiff]):
    """The result of :func:`diff`.

    Attributes:
        a, b: the two sides.
        rtol, atol: the tolerances used.
        missing: keys of B absent from A, non-tensor entries included; where B is a module,
            the keys torch's strict ``load_state_dict`` would report missing (its modules'
            loading code taken into account, as ``load_into`` does).
        unexpected: keys of A absent from B, likewise; where B is a module, torch's.
        tensors: every key on both sides that holds a tensor on one of them, in A's order; a
            key that is a tensor on one side only (a string on the other ...), or a tensor
            diff does not read, is there too, as a ``kind`` pair (after the others where A's
            entry is not a tensor). Keys that are not tensors on either side are not compared.
        suggestions: key rewrites explaining the key mismatch, best first. After an
            alignment, only for the keys it left unmatched: a suggestion describes what
            remains to rewrite, and its commands include the alignment, so that they apply
            to the files as stored.
        aligned: the wrapper rewrite applied to A's keys before comparing (``diff(align=True)``),
            in words; missing, unexpected and tensors are after it.
        aligned_command: how to apply that rewrite to A for good (a ``ckpt`` command for a
            file, a Python call for a state dict); empty without an alignment or for a module.
        values_compared: whether values were compared (``diff(values=...)``; by default not
            when a side is a URL); where not, only keys, shapes and dtypes were.
        transfer: where a side is a URL, what reading it cost
            (:class:`~ckpt_tools.io.remote.TransferStats`); None otherwise.
        reconciled_missing: keys of module B without a namesake in A that torch's load
            would not call missing: its modules' loading code fills or renames them
            (BatchNorm's ``num_batches_tracked`` in an old state dict); not compared.
        reconciled_unexpected: keys of A without a namesake in module B that torch's load
            takes all the same (``weight_norm``'s old ``weight_g``); not compared.
        keys_by_name: where B is a module and torch's verdict could not be taken (the model
            does not copy onto the meta device ...), why; the keys were then compared by name.
    """

    a: SideInfo
    b: SideInfo
    rtol: float
    atol: float
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    tensors: tuple[TensorDiff, ...]
    suggestions: tuple[Suggestion, ...] = ()
    aligned: tuple[str, ...] = ()
    aligned_command: str = ""
    values_compared: bool = True
    reconciled_missing: tuple[str, ...] = ()
    reconciled_unexpected: tuple[str, ...] = ()
    keys_by_name: str = ""
    # Not part of to_json(): what a diff finds is the same wherever the files lie.
    transfer: Any = field(default=None, compare=False)

    @property
    def kind_mismatches(self) -> tuple[TensorDiff, ...]:
        """Keys that are a tensor on one side and another kind of entry on the other."""
        return tuple(t for t in self.tensors if t.status == "kind")

    @property
    def shape_mismatches(self) -> tuple[TensorDiff, ...]:
        """Pairs of different shapes that do not load (an uninitialized lazy parameter takes
        any; a module's 0-dim parameter takes a one-element vector)."""
        return tuple(
            t
            for t in self._pairs
            if t.shape_a != t.shape_b
            and t.shape_a is not None
            and t.shape_b is not None
            and not t.squeezed
        )

    @property
    def dtype_mismatches(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self._pairs if t.dtype_a != t.dtype_b)

    @property
    def layout_mismatches(self) -> tuple[TensorDiff, ...]:
        """Pairs of different layouts (sparse against dense, a meta tensor against a real one)."""
        return tuple(t for t in self._pairs if t.layout_a != t.layout_b)

    @property
    def _pairs(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.status != "kind")

    @property
    def value_mismatches(self) -> tuple[TensorDiff, ...]:
        """Same-shape pairs that are not allclose (or differ in bits, when not comparable),
        whatever their dtypes."""
        return tuple(t for t in self.tensors if t.values_differ)

    def found(self) -> frozenset[str]:
        """The :data:`FAIL_CATEGORIES` present."""
        present = {
            "missing": bool(self.missing),
            "unexpected": bool(self.unexpected),
            "kind": bool(self.kind_mismatches),
            "shape": bool(self.shape_mismatches),
            "dtype": bool(self.dtype_mismatches),
            "layout": bool(self.layout_mismatches),
            "value": bool(self.value_mismatches),
        }
        return frozenset(k for k, v in present.items() if v)

    @property
    def identical(self) -> bool:
        """Same keys, and every tensor bit-equal (sparse ones as torch sees them: after
        coalescing; meta ones: same dtype, shape and strides). Keys a module's loading code
        reconciles are not the same keys."""
        same_keys = not (
            self.missing or self.unexpected or self.reconciled_missing or self.reconciled_unexpected
        )
        return same_keys and all(t.bit_equal for t in self.tensors)

    # --- lookups ------------------------------------------------------------------------

    def tensor(self, name: str) -> TensorDiff:
        """The comparison of the tensor both sides hold under ``name``.

        Raises:
            SelectError: ``name`` is not on both sides (a ``KeyError``); the message says
                which side has it, or names close matches.

        Example:
            >>> from ckpt_tools import diff
            >>> report = diff("model.pt", "model.pt")
            >>> report.tensor("conv.weight").bit_equal, report.tensor("conv.weight").max_abs
            (True, 0.0)
        """
        found = self._by_name.get(name)
        if found is not None:
            return found
        if name in self.missing or name in self.unexpected:
            side = "B" if name in self.missing else "A"
            raise SelectError(f"{name!r} is only in {side}, so it was not compared")
        near = close_matches(name, self._by_name)
        hint = f"; did you mean: {shown(', '.join(near))}?" if near else ""
        raise SelectError(f"no tensor {name!r} on both sides{hint}")

    # --- text ---------------------------------------------------------------------------

    def text(
        self,
        show_all: bool = False,
        group: bool = True,
        model_spec: str | None = None,
        table: TableFormat = text_table,
        for_cli: bool = False,
    ) -> str:
        """What ``ckpt diff`` prints: both sides, the differing tensors, key lists, suggestions.

        Args:
            show_all: list bit-equal tensors too.
            group: fold repeated layers (``layers.{0..31}.weight ×32``).
            model_spec: for a module side B, the ``MODULE:FACTORY`` it was built from.
            table: formats the table (the ``ckpt`` command passes its tabulate table).
            for_cli: point at ``--json`` rather than ``to_json()`` for keys left out.
        """
        lines = [self.a.line("A"), self.b.line("B", model_spec), self._values_line(for_cli)]
        if self.aligned:
            line = f"aligned: A's keys compared after {', then '.join(self.aligned)}"
            how = f"; to make it permanent: {self.aligned_command}"
            lines.append(shown(line + (how if self.aligned_command else "")))
        lines.append("")
        listed = [t for t in self.tensors if show_all or t.status not in ("equal", "unchecked")]
        if listed:
            lines += [table(diff_rows(listed, group), DIFF_COLUMNS), ""]
            notes = [f"  {t.name}: {t.note}" for t in listed if t.note]
            lines += ["notes:", *(shown(n) for n in notes), ""] if notes else []
        statuses: dict[str, int] = {}
        for t in self._pairs:
            statuses[t.status] = statuses.get(t.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in statuses.items())
        kinds = len(self.kind_mismatches)
        if kinds:  # listed in the table, with what each side holds
            what = "a tensor on one side only"
            if self.a.unsupported or self.b.unsupported:
                what += ", or a tensor of a subclass diff does not read"
            held = f"{kinds} common {'key holds' if kinds == 1 else 'keys hold'} {what} (kind)"
            summary = f"{summary}; {held}" if summary else held
        summary = summary or "no common tensors"
        lines.append(f"compared {len(self._pairs)} common tensors: {summary}")
        if self.keys_by_name:
            lines.append(
                shown(f"keys compared by name, not as torch loads them: {self.keys_by_name}")
            )
        by = "reconciled by B's loading code, not compared"
        for title, keys in (
            ("missing (in B, not in A)", self.missing),
            ("unexpected (in A, not in B)", self.unexpected),
            (f"{by} (in B, not in A)", self.reconciled_missing),
            (f"{by} (in A, not in B)", self.reconciled_unexpected),
        ):
            if keys:
                labels, hidden = fold_names(keys, _KEYS_SHOWN, group=group)
                more = [more_hint(hidden, for_cli)] if hidden else []
                lines += [f"{title}: {len(keys)}", *(f"  {shown(k)}" for k in labels + more)]
        if self.suggestions:
            # After --align, what the alignment fixed is said above, never suggested again.
            lines.append(
                "suggestions for what the alignment left:" if self.aligned else "suggestions:"
            )
            lines += [f"  {s.text()}" for s in self.suggestions]
        if self.identical:
            over = sorted({*self.a.passed_over, *self.b.passed_over})
            passed = f" (not compared: {', '.join(map(repr, over))})" if over else ""
            lines.append(shown(f"identical: same keys, every tensor bit-equal{passed}"))
        elif not (self.values_compared or self.found() or self._not_plain):
            lines.append("same keys, shapes and dtypes (values not compared)")
        return "\n".join(lines)

    @property
    def _not_plain(self) -> bool:
        """Keys reconciled by a module's loading code, or a lazy parameter's shape unknown."""
        lazy = any(t.status == "uninitialized" for t in self.tensors)
        return bool(lazy or self.reconciled_missing or self.reconciled_unexpected)

    def _values_line(self, for_cli: bool) -> str:
        if self.values_compared:
            return f"tolerances: rtol={self.rtol:g} atol={self.atol:g}"
        from ckpt_tools.io.remote.urls import is_url

        urls = [n for n, side in (("A", self.a), ("B", self.b)) if is_url(side.label)]
        why = (
            f"{' and '.join(urls)} {'is a URL' if len(urls) == 1 else 'are URLs'}: " if urls else ""
        )
        how = "--values" if for_cli else "diff(..., values=True)"
        return f"values: not compared ({why}keys, shapes and dtypes only); {how} compares them" + (
            ", fetching only the compared tensors' bytes" if urls else ""
        )

    def __repr__(self) -> str:
        return (
            f"DiffReport(a={self.a.label!r}, b={self.b.label!r}, found={sorted(self.found())}, "
            f"missing={len(self.missing)}, unexpected={len(self.unexpected)}, "
            f"tensors={len(self.tensors)})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "rtol": self.rtol,
            "atol": self.atol,
            "found": sorted(self.found()),
            "identical": self.identical,
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "tensors": [t.to_json() for t in self.tensors],
            "suggestions": [s.to_json() for s in self.suggestions],
            "aligned": list(self.aligned),
            "aligned_command": self.aligned_command,
            "values_compared": self.values_compared,
            "reconciled_missing": list(self.reconciled_missing),
            "reconciled_unexpected": list(self.reconciled_unexpected),
            "keys_by_name": self.keys_by_name,
        }

"""The results of :func:`ckpt_tools.diffing.engine.diff`: frozen dataclasses, torch-free.

Convention: A is what you have, B is what it should match; *missing* keys are in B and not
in A, *unexpected* keys are in A and not in B.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ckpt_tools.diffing.table import DIFF_COLUMNS, diff_rows
from ckpt_tools.errors import SelectError, shown
from ckpt_tools.structure.grouping import fold_names
from ckpt_tools.structure.suggest import Step
from ckpt_tools.structure.text import (
    Readable,
    TableFormat,
    close_matches,
    more_hint,
    text_table,
)

__all__ = ["FAIL_CATEGORIES", "DiffReport", "SideInfo", "Suggestion", "TensorDiff"]

#: What ``ckpt diff --fail-on`` can fail on.
FAIL_CATEGORIES = ("missing", "unexpected", "shape", "dtype", "value")
# Missing and unexpected keys shown (folded) in the text; ``--json`` has them all.
_KEYS_SHOWN = 12


@dataclass(frozen=True)
class SideInfo:
    """One side of a diff.

    Attributes:
        label: the path, ``<state dict>`` or ``<module Net>``.
        kind: ``file``, ``state_dict`` or ``module``.
        path: the file, for file sides.
        format: the file's format, for file sides.
        selected: keys leading to the compared state dict.
        selection_reason: why it was chosen.
        tensors: tensors compared from this side.
        wrappers: wrapper prefixes of its keys, outermost first.
        skipped: non-tensor entries of the state dict (not compared).
    """

    label: str
    kind: str
    path: str | None = None
    format: str | None = None
    selected: tuple[str, ...] = ()
    selection_reason: str = ""
    tensors: int = 0
    wrappers: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    def line(self, name: str, model_spec: str | None = None) -> str:
        """``A: ddp.pt (torch-zip, state dict 'model', 17 tensors, wrappers module.)``.

        Args:
            name: ``A`` or ``B``.
            model_spec: for a module side, the ``MODULE:FACTORY`` it was built from.
        """
        label = f"{model_spec} {self.label}" if self.kind == "module" and model_spec else self.label
        bits = [self.format] if self.format else [self.kind.replace("_", " ")]
        if self.selected:
            bits.append(f"state dict {'.'.join(self.selected)!r}")
        bits.append(f"{self.tensors} tensors")
        if self.wrappers:
            bits.append("wrappers " + " ".join(self.wrappers))
        if self.skipped:
            bits.append(f"{len(self.skipped)} non-tensor entries not compared")
        return shown(f"{name}: {label} ({', '.join(bits)})")

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "path": self.path,
            "format": self.format,
            "selected": list(self.selected),
            "selection_reason": self.selection_reason,
            "tensors": self.tensors,
            "wrappers": list(self.wrappers),
            "skipped": list(self.skipped),
        }


@dataclass(frozen=True)
class TensorDiff:
    """One key present on both sides.

    Attributes:
        name: the key.
        dtype_a, dtype_b: dtypes (torch names without ``torch.``).
        shape_a, shape_b: shapes.
        bit_equal: same dtype, shape and bytes; None when the shapes differ.
        max_abs: largest ``|a - b|`` over elements where neither is NaN (``inf - inf`` of
            equal sign counts 0); None when not compared.
        max_rel: largest ``|a - b| / |b|`` (``inf`` where ``b`` is 0 and ``a`` is not).
        allclose: every element satisfies ``|a - b| <= atol + rtol * |b|``, NaNs in the same
            places count as close (``torch.isclose(equal_nan=True)``).
        mismatched: elements that are not close.
        nan_a, nan_b, inf_a, inf_b: NaN and infinity counts on each side.
        numel: elements compared.
        values_compared: whether values were read at all (``diff(values=...)``); where not,
            the status of a pair with the same shape and dtype is ``unchecked``.
    """

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    bit_equal: bool | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    allclose: bool | None = None
    mismatched: int | None = None
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    numel: int = 0
    values_compared: bool = True

    @property
    def status(self) -> str:
        """``shape``, ``equal`` (bit-equal), ``dtype``, ``close``, ``differ``, ``unknown``, or
        ``unchecked`` (same shape and dtype, values not compared)."""
        if self.shape_a != self.shape_b:
            return "shape"
        if not self.values_compared:
            return "dtype" if self.dtype_a != self.dtype_b else "unchecked"
        if self.bit_equal:
            return "equal"
        if self.dtype_a != self.dtype_b:
            return "dtype"
        if self.allclose is None:
            return "differ" if self.bit_equal is False else "unknown"
        return "close" if self.allclose else "differ"

    def to_json(self) -> dict[str, Any]:
        def number(x: float | None) -> float | str | None:
            return x if x is None or math.isfinite(x) else str(x)

        return {
            "name": self.name,
            "status": self.status,
            "dtype": [self.dtype_a, self.dtype_b],
            "shape": [list(self.shape_a), list(self.shape_b)],
            "bit_equal": self.bit_equal,
            "max_abs": number(self.max_abs),
            "max_rel": number(self.max_rel),
            "allclose": self.allclose,
            "mismatched": self.mismatched,
            "nan": [self.nan_a, self.nan_b],
            "inf": [self.inf_a, self.inf_b],
            "numel": self.numel,
        }


@dataclass(frozen=True)
class Suggestion:
    """A key rewrite that explains (part of) the key mismatch.

    Attributes:
        description: the rewrite of A's keys, in words (``stripping 'module.'``).
        steps: that rewrite.
        resolved: unexpected keys of A it makes match.
        of: unexpected keys of A.
        command: how to apply it to A (a ``ckpt`` command for a file, a Python call for a
            state dict); empty when A is a module.
        inverse_description: the same change made to B instead (``adding 'module.'``).
        inverse_command: how to apply that to B, when B is a file or a state dict.
        note: extra advice (``load_into`` applies wrapper rewrites by itself).
    """

    description: str
    steps: tuple[Step, ...]
    resolved: int
    of: int
    command: str = ""
    inverse_description: str = ""
    inverse_command: str = ""
    note: str = ""

    def text(self) -> str:
        """``stripping 'module.' resolves 62 of 62 unexpected keys: ckpt strip-module ...``."""
        line = f"{self.description} resolves {self.resolved} of {self.of} unexpected keys"
        other = f"{self.inverse_description} on B: {self.inverse_command}"
        if self.command:
            line += ": " + self.command
            if self.inverse_command:
                line += f" (or {other})"
        elif self.inverse_command:
            line += f"; that is {other}"
        return shown(line + (f"; {self.note}" if self.note else ""))

    def __str__(self) -> str:
        return self.text()

    def to_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "resolved": self.resolved,
            "of": self.of,
            "command": self.command,
            "inverse_description": self.inverse_description,
            "inverse_command": self.inverse_command,
            "note": self.note,
            "text": self.text(),
        }


@dataclass(frozen=True)
class DiffReport(Readable):
    """The result of :func:`diff`.

    Attributes:
        a, b: the two sides.
        rtol, atol: the tolerances used.
        missing: keys of B absent from A.
        unexpected: keys of A absent from B.
        tensors: every key on both sides, compared, in A's order.
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
    # Not part of to_json(): what a diff finds is the same wherever the files lie.
    transfer: Any = field(default=None, compare=False)

    @property
    def shape_mismatches(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.shape_a != t.shape_b)

    @property
    def dtype_mismatches(self) -> tuple[TensorDiff, ...]:
        return tuple(t for t in self.tensors if t.dtype_a != t.dtype_b)

    @property
    def value_mismatches(self) -> tuple[TensorDiff, ...]:
        """Same-shape pairs that are not allclose (or differ in bits, when not comparable)."""
        return tuple(t for t in self.tensors if t.status == "differ")

    def found(self) -> frozenset[str]:
        """The :data:`FAIL_CATEGORIES` present."""
        present = {
            "missing": bool(self.missing),
            "unexpected": bool(self.unexpected),
            "shape": bool(self.shape_mismatches),
            "dtype": bool(self.dtype_mismatches),
            "value": bool(self.value_mismatches),
        }
        return frozenset(k for k, v in present.items() if v)

    @property
    def identical(self) -> bool:
        """Same keys, and every tensor bit-equal."""
        return not self.missing and not self.unexpected and all(t.bit_equal for t in self.tensors)

    # --- lookups ------------------------------------------------------------------------

    @cached_property
    def _by_name(self) -> dict[str, TensorDiff]:
        return {t.name: t for t in self.tensors}

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

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._by_name

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[TensorDiff]:
        return iter(self.tensors)

    def __bool__(self) -> bool:
        # A result, not only a container: true even when no key is common.
        return True

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
        statuses: dict[str, int] = {}
        for t in self.tensors:
            statuses[t.status] = statuses.get(t.status, 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in statuses.items()) or "no common tensors"
        lines.append(f"compared {len(self.tensors)} common tensors: {summary}")
        for title, keys in (
            ("missing (in B, not in A)", self.missing),
            ("unexpected (in A, not in B)", self.unexpected),
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
            lines.append("identical: same keys, every tensor bit-equal")
        elif not self.values_compared and not self.found():
            lines.append("same keys, shapes and dtypes (values not compared)")
        return "\n".join(lines)

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
        }

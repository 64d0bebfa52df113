"""The results of :func:`ckpt_tools.diffing.engine.diff`: frozen dataclasses, torch-free.

Convention: A is what you have, B is what it should match; *missing* keys are in B and not
in A, *unexpected* keys are in A and not in B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckpt_tools.structure.suggest import Step

__all__ = ["FAIL_CATEGORIES", "DiffReport", "SideInfo", "Suggestion", "TensorDiff"]

#: What ``ckpt diff --fail-on`` can fail on.
FAIL_CATEGORIES = ("missing", "unexpected", "shape", "dtype", "value")


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

    @property
    def status(self) -> str:
        """``shape``, ``equal`` (bit-equal), ``dtype``, ``close``, ``differ`` or ``unknown``."""
        if self.shape_a != self.shape_b:
            return "shape"
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
        return line + (f"; {self.note}" if self.note else "")

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
class DiffReport:
    """The result of :func:`diff`.

    Attributes:
        a, b: the two sides.
        rtol, atol: the tolerances used.
        missing: keys of B absent from A.
        unexpected: keys of A absent from B.
        tensors: every key on both sides, compared, in A's order.
        suggestions: key rewrites explaining the mismatch of the keys as stored, best first.
        aligned: the wrapper rewrite applied to A's keys before comparing (``diff(align=True)``),
            in words; missing, unexpected and tensors are after it.
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
        }

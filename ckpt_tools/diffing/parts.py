"""The parts of a :class:`~ckpt_tools.diffing.report.DiffReport`: each side, each tensor
that differs, each key rewrite that explains a mismatch. Frozen dataclasses, torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckpt_tools.errors import shown
from ckpt_tools.structure.json_values import json_ready
from ckpt_tools.structure.suggest import Step

__all__ = ["SideInfo", "Suggestion", "TensorDiff", "is_file"]


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
        passed_over: the other tensor dicts beside the chosen one (not compared).
        tensors: tensors compared from this side.
        wrappers: wrapper prefixes of its keys, outermost first.
        skipped: non-tensor entries of the state dict (not compared); sparse, meta and
            nested tensors are tensors, compared.
        unsupported: tensors of a subclass the reader does not rebuild (a DTensor that
            ``torch.save`` wrote as it is): tensors, never compared (each is a ``kind`` pair
            where the other side has the key).
        unsafe_globals: the file's globals outside the allowlist (a rewrite names each).
        recovered: the state dict is a pickled module's, recovered (a rewrite writes it to
            safetensors).
    """

    label: str
    kind: str
    path: str | None = None
    format: str | None = None
    selected: tuple[str, ...] = ()
    selection_reason: str = ""
    passed_over: tuple[str, ...] = ()
    tensors: int = 0
    wrappers: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()
    unsafe_globals: tuple[str, ...] = ()
    recovered: bool = False

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
        if self.tensors or not self.unsupported:
            bits.append(f"{self.tensors} tensors")
        if self.unsupported:
            bits.append(f"{len(self.unsupported)} tensors of a subclass diff does not read")
        if self.wrappers:
            bits.append("wrappers " + " ".join(self.wrappers))
        if self.skipped:
            bits.append(f"{len(self.skipped)} non-tensor entries not compared")
        if self.passed_over:  # chosen as the largest: the others are not compared
            bits.append(f"also {', '.join(map(repr, self.passed_over))}, not compared")
        return shown(f"{name}: {label} ({', '.join(bits)})")

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "path": self.path,
            "format": self.format,
            "selected": list(self.selected),
            "selection_reason": self.selection_reason,
            "passed_over": list(self.passed_over),
            "tensors": self.tensors,
            "wrappers": list(self.wrappers),
            "skipped": list(self.skipped),
            "unsupported": list(self.unsupported),
        }


@dataclass(frozen=True)
class TensorDiff:
    """One key present on both sides: a tensor on each, or a tensor on one side and another
    kind of entry on the other, or a tensor of a subclass diff does not read on either
    (status ``kind``: not compared).

    Attributes:
        name: the key.
        dtype_a, dtype_b: dtypes (torch names without ``torch.``).
        shape_a, shape_b: shapes; None for a lazy module's uninitialized parameter or
            buffer, which takes the shape it is loaded with (status ``uninitialized``, not a
            shape difference; in ``to_json()``, ``[]`` and ``uninitialized`` true).
        bit_equal: same dtype, shape and bytes, as torch.load gives them (conjugate and
            negative bits applied; a quantized pair's also the same quantizer, as
            ``torch.equal`` says); None when not compared (values not read, a ``kind``,
            ``shape`` or ``layout`` pair).
        max_abs: largest ``|a - b|`` over elements where neither is NaN (``inf - inf`` of
            equal sign counts 0; a quantized tensor's values are its dequantized ones); None
            when not compared.
        max_rel: largest ``|a - b| / |b|`` (``inf`` where ``b`` is 0 and ``a`` is not).
        allclose: every element satisfies ``|a - b| <= atol + rtol * |b|``, NaNs in the same
            places count as close (``torch.isclose(equal_nan=True)``); None when values were
            not compared as numbers (not read, or compared by their bits alone).
        mismatched: elements that are not close; None where ``allclose`` is.
        nan_a, nan_b, inf_a, inf_b: NaN and infinity counts on each side.
        numel: elements compared.
        values_compared: whether values were read at all (``diff(values=...)``); where not,
            the status of a pair with the same shape and dtype is ``unchecked``.
        layout_a, layout_b: torch's layout names (``strided``, ``sparse_coo``,
            ``sparse_csr`` ..., ``nested``), or ``meta`` for a meta tensor (no values: equal
            where dtype, shape and strides are).
        note: why a sparse, nested, meta or quantized pair differs where the numbers do not
            say (``their indices differ ...``, ``strides differ ...``, ``quantizers differ:
            scale 0.1 / 0.2``), or what a ``kind`` pair holds.
        kind_a, kind_b: ``tensor``, or the type of the entry that is not one (``str``,
            ``dict`` ...; a class's qualified name), which then also stands for its dtype, or
            the class of a tensor diff does not read (``torch.distributed.tensor.DTensor``).
        squeezed: A's one-element vector against a 0-dim parameter or buffer of module B,
            which torch's load takes as its one element (checkpoints saved before torch
            0.4): the shapes differ, yet it loads, and the values are compared.
    """

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
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
    layout_a: str = "strided"
    layout_b: str = "strided"
    note: str = ""
    kind_a: str = "tensor"
    kind_b: str = "tensor"
    squeezed: bool = False

    @property
    def status(self) -> str:
        """``kind`` (a tensor against another kind of entry, or a tensor diff does not
        read), ``layout``, ``uninitialized`` (a lazy parameter: any shape loads, no values),
        ``shape``, ``equal`` (bit-equal), ``dtype``, ``close``, ``differ``, ``unknown``, or
        ``unchecked`` (same shape and dtype, values not compared)."""
        if self.kind_a != "tensor" or self.kind_b != "tensor":
            return "kind"
        if self.layout_a != self.layout_b:
            return "layout"
        if self.shape_a is None or self.shape_b is None:
            return "uninitialized"
        if self.shape_a != self.shape_b and not self.squeezed:
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

    @property
    def values_differ(self) -> bool:
        """Values read and not close: a ``differ`` pair, or a ``dtype`` pair whose values,
        compared as numbers, are not allclose (a cast that changed them past the tolerances;
        the bits of two dtypes always differ, and do not count), or were read and cannot be
        compared as numbers (a packed float4 against a float): not vouched for as close."""
        if self.status != "dtype":
            return self.status == "differ"
        return self.allclose is False or (self.values_compared and self.allclose is None)

    def to_json(self) -> dict[str, Any]:
        return json_ready(
            {
                "name": self.name,
                "status": self.status,
                "dtype": [self.dtype_a, self.dtype_b],
                "shape": [list(self.shape_a or ()), list(self.shape_b or ())],
                "bit_equal": self.bit_equal,
                "max_abs": self.max_abs,
                "max_rel": self.max_rel,
                "allclose": self.allclose,
                "mismatched": self.mismatched,
                "nan": [self.nan_a, self.nan_b],
                "inf": [self.inf_a, self.inf_b],
                "numel": self.numel,
                "layout": [self.layout_a, self.layout_b],
                "note": self.note,
                "uninitialized": [self.shape_a is None, self.shape_b is None],
                "squeezed": self.squeezed,
            }
        )


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
        missing: keys of B that A still lacks once rewritten (against a module, those its
            strict load would then call missing).
    """

    description: str
    steps: tuple[Step, ...]
    resolved: int
    of: int
    command: str = ""
    inverse_description: str = ""
    inverse_command: str = ""
    note: str = ""
    missing: tuple[str, ...] = ()

    def text(self) -> str:
        """``stripping 'module.' resolves 62 of 62 unexpected keys: ckpt strip-module ...``."""
        line = f"{self.description} resolves {self.resolved} of {self.of} unexpected keys"
        if self.missing:
            named = ", ".join(self.missing[:3]) + (", ..." if len(self.missing) > 3 else "")
            line += f" and leaves {len(self.missing)} missing ({named})"
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
            "missing": list(self.missing),
            "text": self.text(),
        }


def is_file(side: object) -> bool:
    """Whether ``side`` names a checkpoint file, folder or URL (not a state dict or module).

    Example:
        >>> is_file("hf://org/model"), is_file({"w": 1})
        (True, False)
    """
    return isinstance(side, (str, os.PathLike))

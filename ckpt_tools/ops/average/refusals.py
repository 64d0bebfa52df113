"""Why inputs cannot be averaged: the entries that differ where no mean is taken, by group,
each group with the remedies a next run accepts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpt_tools.errors import ConversionError, Remedy

__all__ = ["refuse_differing"]

_FIRST = Remedy("ints", "'first'", flag="--ints first", text="to take the first input's")
_LAST = Remedy("ints", "'last'", flag="--ints last", text="to take the last input's")
# What fixes each group of differing entries; an entry holding tensors only from the first.
_REMEDIES = {
    "integer": (_FIRST, _LAST),
    "non-tensor": (_FIRST, _LAST),
    "holding tensors": (_FIRST,),
    "other": (Remedy(text="leave the tensors with no mean out of the inputs (ckpt extract)"),),
    "sparse, nested or meta": (
        Remedy(
            text="leave the sparse, nested and meta tensors out of the inputs (ckpt extract), "
            "or make them dense"
        ),
    ),
    "shares": (Remedy(text="save those entries as tensors of their own (.clone())"),),
    "view bits": (Remedy(text="load them, call .resolve_neg().resolve_conj() and save that"),),
}


def refuse_differing(differing: Mapping[str, Sequence[str]]) -> None:
    """Refuse, naming every tensor that has no mean and differs across inputs, by group."""
    if not differing:
        return
    said = {
        "integer": "integer tensors differ across inputs",
        "other": "tensors with no mean (bool, complex32, quantized, other float8) differ across "
        "inputs",
        "sparse, nested or meta": "sparse, nested and meta tensors are not averaged, and these "
        "differ across inputs",
        "view bits": "tensors saved as a conjugate or negative view in some inputs only are not "
        "compared",
        "non-tensor": "non-tensor entries differ across inputs",
        "holding tensors": "non-tensor entries holding tensors differ across inputs (the "
        "output's tensors are the first input's, so only its entry can be taken)",
        "shares": "entries taken from one input share a storage with averaged tensors",
    }
    parts = []
    for group, keys in differing.items():
        parts.append(f"{said[group]}: {', '.join(keys[:8])}" + (" ..." if len(keys) > 8 else ""))
    remedies = dict.fromkeys(r for group in differing for r in _REMEDIES.get(group, ()))
    # Only remedies the next run accepts: ints takes no entry on an averaged storage.
    for group, refused in (("holding tensors", (_LAST,)), ("shares", (_FIRST, _LAST))):
        for remedy in refused if group in differing else ():
            remedies.pop(remedy, None)
    raise ConversionError("; ".join(parts), remedies=tuple(remedies))  # each once, in order

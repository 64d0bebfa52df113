"""Why inputs cannot be averaged: the entries that differ where no mean is taken, by group,
each group with the remedies a next run accepts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpt_tools._escape import shell_path
from ckpt_tools.errors import ConversionError, Remedy

__all__ = ["NO_MEAN", "refuse_differing"]

_FIRST = Remedy("ints", "'first'", flag="--ints first", text="to take the first input's")
_LAST = Remedy("ints", "'last'", flag="--ints last", text="to take the last input's")
# What fixes each group of differing entries; an entry holding tensors only from the first.
_REMEDIES = {
    "integer": (_FIRST, _LAST),
    "non-tensor": (_FIRST, _LAST),
    "holding tensors": (_FIRST,),
    "other": (Remedy(text="leave the tensors with no mean out of each input's state dict"),),
    "sparse, nested or meta": (
        Remedy(
            text="leave the sparse, nested and meta tensors out of each input's state dict, "
            "or make them dense"
        ),
    ),
    "shares": (Remedy(text="save those entries as tensors of their own (.clone())"),),
    "view bits": (Remedy(text="load them, call .resolve_neg().resolve_conj() and save that"),),
}


#: The groups of tensors with no mean, which leaving them out of the inputs fixes.
NO_MEAN = ("other", "sparse, nested or meta")


def refuse_differing(
    differing: Mapping[str, Sequence[str]], droppable: Sequence[str] | None = None
) -> None:
    """Refuse, naming every tensor that has no mean and differs across inputs, by group;
    ``droppable``: their keys, where ``slim --drop`` can leave them out of each input."""
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
    if droppable:  # the command that leaves them out, in place of the words
        for group in NO_MEAN:
            for remedy in _REMEDIES[group] if group in differing else ():
                remedies.pop(remedy, None)
        drop = Remedy(
            command=f"ckpt slim IN OUT --drop {shell_path(','.join(droppable))}",
            text="on each input, then average those",
        )
        remedies = {drop: None, **remedies}
    # Only remedies the next run accepts: ints takes no entry on an averaged storage.
    for group, refused in (("holding tensors", (_LAST,)), ("shares", (_FIRST, _LAST))):
        for remedy in refused if group in differing else ():
            remedies.pop(remedy, None)
    raise ConversionError("; ".join(parts), remedies=tuple(remedies))  # each once, in order

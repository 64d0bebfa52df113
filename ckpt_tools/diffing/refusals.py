"""A file side that holds no state dict, refused with what it holds instead: objects of a class
the reader never builds, or tensors that all lie deeper (an optimizer's state)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_tools._escape import shell_path, shell_word, shown
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.structure.selection import unbuilt_holders
from ckpt_tools.structure.tensor_walk import iter_listed_tensors

__all__ = ["refuse_deeper_tensors", "refuse_unbuilt"]


def refuse_unbuilt(path: str, root: Mapping[Any, Any]) -> None:
    """Refuse a root where no state dict was found but entries of classes the reader never
    builds (a dict subclass of the training script's) hold tensors and may be it: compared
    as it is, the root would miss them, and every key of the other side would be missing."""
    unbuilt = [(k, root[k]) for k in unbuilt_holders(root)]
    if not unbuilt:
        return
    names = ", ".join(f"{shown(str(k))!r} ({type(v).global_ref.qualname})" for k, v in unbuilt[:8])
    sanitize = Remedy(
        command=f"ckpt sanitize {shell_path(path)} OUT.pt",
        text="to write its objects as plain dicts (nothing is imported or run)",
    )
    raise UsageError(
        f"{path!r}: no entry looks like a state dict (a mapping of names to tensors), and "
        f"{names} {'is an object' if len(unbuilt) == 1 else 'are objects'} of a class the "
        "reader never builds; diff compares state dicts",
        remedies=() if "://" in path else (sanitize,),  # sanitize reads local files
    )


def refuse_deeper_tensors(path: str, root: Mapping[Any, Any], entries: Mapping[str, Any]) -> None:
    """Refuse a root where no state dict was found whose tensors all lie deeper (an
    optimizer's ``state.0.exp_avg``): compared as it is, it would compare none of them and
    call two different files identical."""
    deeper = iter_listed_tensors(root) if not entries else []  # (sparse ones too)
    if not deeper:
        return
    first = deeper[0][0].rpartition(".")[0]
    raise UsageError(
        f"{path!r}: no entry looks like a state dict (a mapping of names to tensors), and its "
        f"{len(deeper)} tensor(s) lie deeper ({', '.join(p for p, _ in deeper[:3])}"
        f"{', ...' if len(deeper) > 3 else ''}); diff compares state dicts",
        remedies=(Remedy("select", repr(first), flag=f"--select {shell_word(first)}"),),
    )

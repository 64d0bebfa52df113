"""Tied tensors in a Hugging Face folder: which names are stored and which are dropped.

huggingface_hub stores memory-sharing tensors once (``_remove_duplicate_names``); this is
its grouping, on descriptors, with the name transformers keeps. Used by
:mod:`ckpt_tools.ops.transform.reshard`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import ConversionError, Remedy
from ckpt_tools.io.writers.safetensors_checks import kept_name

__all__ = ["hf_shared_names", "same_view"]


def same_view(a: TensorRef, b: TensorRef) -> bool:
    """Whether two tensors over one storage are the very same view of it."""
    return (a.offset, a.shape, a.stride, a.dtype) == (b.offset, b.shape, b.stride, b.dtype)


def _areas(names: Sequence[str], sd: Mapping[str, TensorRef]) -> list[set[str]]:
    """Split names over one storage into groups of overlapping byte ranges (safetensors'
    ``_filter_shared_not_shared``: sorted by start, a new group where one starts past the
    previous end)."""
    spans = sorted((*sd[n].byte_span, n) for n in names)
    groups = [{spans[0][2]}]
    last_stop = spans[0][1]
    for start, stop, name in spans[1:]:
        if start >= last_stop:
            groups.append({name})
        else:
            groups[-1].add(name)
        last_stop = stop
    return groups


def hf_shared_names(sd: Mapping[str, TensorRef]) -> dict[str, str]:
    """Which names of tied (memory-sharing) tensors to leave out, and the name each keeps.

    Tensors over one storage whose bytes overlap form a group (huggingface_hub's
    ``_remove_duplicate_names``); the kept name is, of those that cover the whole storage, the
    one :func:`~ckpt_tools.io.writers.safetensors_checks.kept_name` picks, as transformers'
    ``save_pretrained`` keeps it (the input embedding, not the head tied to it), or the first
    where they are all one view of part of it (a tied weight carved from a flat buffer); the
    others are dropped, and the index maps kept names only.

    Args:
        sd: name -> tensor.

    Returns:
        ``{dropped name: kept name}``, in sorted order of the dropped names.

    Raises:
        ConversionError: a group of different views where none covers its whole storage
            (huggingface_hub refuses those too), every such group named.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> s = StorageRef("0", "float32", 4, "cpu")
        >>> t = TensorRef(s, 0, (2, 2), (2, 1), "float32")
        >>> hf_shared_names({"embed.weight": t, "lm_head.weight": t})
        {'lm_head.weight': 'embed.weight'}
    """
    by_storage: dict[int, list[str]] = {}
    for name, t in sd.items():
        if t.storage.nbytes and t.nbytes:
            by_storage.setdefault(id(t.storage), []).append(name)
    dropped: dict[str, str] = {}
    incomplete: list[str] = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        for group in _areas(names, sd):
            if len(group) < 2:
                continue
            # in key order: the module that owns the weight comes before those tied to it
            ordered = [n for n in names if n in group]
            complete = [
                n
                for n in ordered
                if sd[n].byte_offset == 0 and sd[n].nbytes == sd[n].storage.nbytes
            ]
            if not complete and all(same_view(sd[n], sd[ordered[0]]) for n in ordered):
                complete = ordered[:1]  # one view of part of a buffer: any name is all of it
            if not complete:
                incomplete.append("{" + ", ".join(sorted(group)) + "}")
                continue
            keep = kept_name(complete)
            dropped.update((n, keep) for n in sorted(group) if n != keep)
    if incomplete:
        raise ConversionError(
            f"{len(incomplete)} group(s) of tensors share memory and none of them covers the "
            f"whole storage, so no one name can be kept: {'; '.join(incomplete[:5])}",
            remedies=(Remedy(text="keep the torch format, which stores shared views as they are"),),
        )
    return dict(sorted(dropped.items()))

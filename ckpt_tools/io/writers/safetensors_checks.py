"""What a safetensors output cannot hold, refused while planning: the one check every plan takes.

safetensors holds dense tensors of its own dtypes, named by UTF-8 strings, as their bytes
and nothing else. So every operation writing it refuses, before a byte is written and naming
every offender at once:

- a dtype it lacks (quantized types, complex32 ...), or a 0-d tensor of a packed one
  (``float4_e2m1fn_x2``, whose last dimension it stores);
- a name that is no UTF-8 (a lone surrogate, which torch keeps), or the name
  ``__metadata__``, which its header reserves for the metadata;
- a conjugate or negative view, saved as its storage's bytes plus a bit torch applies on
  loading, which a safetensors file would take as they are, changing the values;
- entries that are no dense tensors, unless told to leave them out (:func:`leave_out_extras`).

The Python attributes a tensor carries (``t.note = ...``; a library's flags, such as
transformers' ``_is_hf_initialized``) are left out and listed (:func:`tensor_attributes`).

:func:`check_holdable` is called by every plan and again by
:func:`~ckpt_tools.io.writers.safetensors.safetensors_header`, the writer's guard, so no
operation writes what it refuses.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.dtypes import SAFETENSORS_PACKED, TORCH_TO_SAFETENSORS
from ckpt_tools.errors import ConversionError, NonTensorEntriesError, Remedy, shown

__all__ = [
    "RESERVED_NAME",
    "check_holdable",
    "is_output_head",
    "kept_name",
    "leave_out_extras",
    "tensor_attributes",
    "tied_names",
    "unholdable_kind",
]

#: The header key safetensors keeps for its string-to-string metadata: no tensor may have it.
RESERVED_NAME = "__metadata__"
_VIEW = {"conj": "conjugate", "neg": "negative"}


def check_holdable(
    tensors: Sequence[tuple[str, TensorRef]], path: str | None, remedies: Sequence[Remedy] = ()
) -> None:
    """Refuse every tensor a safetensors file cannot hold, naming them all in one message.

    Operations call it while planning (a dry run refuses too);
    :func:`~ckpt_tools.io.writers.safetensors.safetensors_header` calls it again, as a guard.

    Args:
        tensors: ``(output name, tensor)`` of every tensor of the planned output; the tensor's
            descriptor as read, so its view bits (:attr:`TensorRef.view_bits`) are seen.
        path: the input, for the message, if known.
        remedies: what to do instead; "keep the torch format" when none is given.

    Raises:
        ConversionError: a dtype safetensors lacks, a name it cannot hold (no UTF-8, or
            ``__metadata__``), or a conjugate or negative view (exit 7), naming the first
            eight offenders of each sort.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> def ref(dtype):
        ...     return TensorRef(StorageRef("0", dtype, 1, "cpu"), 0, (1,), (1,), dtype)
        >>> check_holdable([("w", ref("float32"))], "a.pt")
        >>> check_holdable([("w", ref("float32")), ("q", ref("qint8"))], "a.pt")
        Traceback (most recent call last):
        ckpt_tools.errors.ConversionError: safetensors cannot hold ... 'a.pt': q (qint8); ...
        >>> check_holdable([("__metadata__", ref("float32"))], "a.pt")
        Traceback (most recent call last):
        ckpt_tools.errors.ConversionError: safetensors reserves the name '__metadata__' ...
    """
    where = f" in {path!r}" if path else ""
    bad = [f"{name} ({t.dtype})" for name, t in tensors if t.dtype not in TORCH_TO_SAFETENSORS]
    # A packed dtype is stored as whole elements of its last dimension, which a 0-d one lacks
    # (safetensors refuses to save it too).
    bad += [
        f"{name} (0-d {t.dtype})"
        for name, t in tensors
        if t.dtype in SAFETENSORS_PACKED and not t.shape
    ]
    unnamed = [ascii(name) for name, _ in tensors if not _is_utf8(name)]
    problems = []
    if bad:
        problems.append(
            f"safetensors cannot hold the dtype of {len(bad)} tensor(s){where}: {_few(bad)}"
        )
    if unnamed:
        problems.append(
            f"safetensors names tensors in UTF-8, and {len(unnamed)} name(s){where} are not: "
            + _few(unnamed)
        )
    if any(name == RESERVED_NAME for name, _ in tensors):
        problems.append(
            f"safetensors reserves the name {RESERVED_NAME!r} for its header's metadata, "
            f"and a tensor{where} would be written under it"
        )
    views = _view_bit_problem(tensors)
    if views:
        problems.append(views)
    if not problems:
        return
    fixes = tuple(remedies) or (Remedy(text="keep the torch format"),)
    if unnamed or any(name == RESERVED_NAME for name, _ in tensors):
        fixes = (_rename_first(reserved=not unnamed), *fixes)
    if views:
        fixes = (*fixes, _resolve_first(tensors))
    raise ConversionError("; and ".join(problems), path=path, remedies=fixes)


def _view_bit_problem(tensors: Sequence[tuple[str, TensorRef]]) -> str:
    """The words for the conjugate and negative views among ``tensors``; ``""`` if none."""
    said = []
    for name, t in tensors:
        bits = sorted(getattr(t, "view_bits", ()))
        if bits:
            what = " and ".join(_VIEW[b] for b in bits)
            said.append(f"tensor {name!r} is saved as a {what} view")
    if not said:
        return ""
    more = f" (and {len(said) - 8} more)" if len(said) > 8 else ""
    return (
        ", ".join(said[:8])
        + more
        + ": torch.load applies the bit to the bytes, which a safetensors file would take "
        "as they are, changing the values"
    )


def _resolve_first(tensors: Sequence[tuple[str, TensorRef]]) -> Remedy:
    """Load, resolve the bits torch would apply, and save the plain tensors."""
    bits = sorted({b for _, t in tensors for b in getattr(t, "view_bits", ())})
    resolve = ".".join(f"resolve_{b}()" for b in bits)
    return Remedy(text=f"load it, call .{resolve} on those tensors and save that")


def _rename_first(reserved: bool) -> Remedy:
    """Renaming the tensor on the way: ``rename`` with a rule writes a safetensors output too.

    ``reserved``: the name to change is ``__metadata__``, matched exactly; else the rule is
    the caller's to write.
    """
    # Said of any command that writes safetensors: the rule is rename's, not theirs.
    verb, then = "run rename with", "(it writes the .safetensors output under the new names)"
    if reserved:
        return Remedy(
            "rules",
            "[regex_rule('^__metadata__$', 'NEW')]",
            "--regex '^__metadata__$=NEW'",
            text=then,
            verb=verb,
        )
    return Remedy(
        "rules", "[regex_rule(PATTERN, 'NEW')]", "--regex PATTERN=NEW", text=then, verb=verb
    )


def _few(items: Sequence[str]) -> str:
    # Names from the file: a line break or a control in one stays one escaped character.
    return ", ".join(map(shown, items[:8])) + (" ..." if len(items) > 8 else "")


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unholdable_kind(value: Any) -> str | None:
    """What keeps a tensor out of safetensors, which holds dense tensors with bytes only.

    Returns:
        ``sparse_coo layout`` (any sparse layout), ``nested layout``, ``meta device``,
        ``xla:0 device tensor`` (a backend's tensor saved as a CPU copy to be moved), or
        None for anything else (a dense tensor, or no tensor).

    Example:
        >>> unholdable_kind("epoch") is None
        True
    """
    if not isinstance(value, RebuiltTensor):
        return None
    if value.device == "meta":
        return "meta device"
    if value.func.name == "_rebuild_device_tensor_from_cpu_tensor":
        return f"{value.device} device tensor"
    return f"{value.layout} layout"


def tensor_attributes(named: Iterable[tuple[str, Any]]) -> list[str]:
    """``name.attribute`` for each Python attribute the tensors among ``named`` carry, which
    ``torch.load`` sets back (:attr:`~ckpt_tools.descriptors.TensorRef.attributes`) and a
    safetensors file cannot hold: left out and listed, never refused, as libraries set
    their own flags on every parameter (transformers' ``_is_hf_initialized``).

    Example:
        >>> from ckpt_tools.descriptors import GlobalRef, StorageRef
        >>> s = StorageRef("0", "float32", 2, "cpu")
        >>> rebuild = GlobalRef("torch._tensor", "_rebuild_from_type_v2")
        >>> t = TensorRef(s, 0, (2,), (1,), "float32", func=rebuild, args=(0, 0, (), {"note": 1}))
        >>> tensor_attributes([("w", t)])
        ['w.note']
    """
    return [f"{n}.{a}" for n, t in named if isinstance(t, TensorRef) for a in t.attributes]


def leave_out_extras(
    extras: Sequence[str],
    path: str | None,
    *,
    drop_extras: bool,
    remedies: Sequence[Remedy] = (),
    kinds: Mapping[str, str] | None = None,
    outside: Collection[str] = (),
    dicts: Collection[str] = (),
) -> tuple[str, ...]:
    """The entries a safetensors output leaves out, or the refusal to.

    safetensors holds dense tensors only, so every operation writing it refuses other entries
    (an epoch, an optimizer's ``param_groups``, a string in the state dict; a sparse, nested
    or meta tensor; a tensor beside the state dict) unless told to leave them out, and names
    them either way.

    Args:
        extras: the names of the entries it cannot hold, in order.
        path: the input, for the message, if known.
        drop_extras: leave them out instead of refusing (``--drop-extras``).
        remedies: fixes of the caller's own, said before ``--drop-extras``
            (``--weights-only``, where every entry is beside the state dict).
        kinds: the names among ``extras`` that are tensors, with what keeps each out
            (:func:`unholdable_kind`); the message tells them from non-tensor entries.
        outside: the names among ``extras`` that are tensors beside the selected state dict
            (a best accuracy saved as a 0-d tensor next to it), named as such.
        dicts: the names among ``extras`` that are tensor dicts beside the selected one (a
            GAN's discriminator beside its generator), named as such.

    Returns:
        The names left out: ``extras``, or ``()`` when there are none.

    Raises:
        NonTensorEntriesError: ``extras`` is not empty and ``drop_extras`` is false
            (exit 7), naming the first eight of each sort.

    Example:
        >>> leave_out_extras(["epoch"], "a.pt", drop_extras=True)
        ('epoch',)
        >>> leave_out_extras(["epoch"], "a.pt", drop_extras=False)
        Traceback (most recent call last):
        ckpt_tools.errors.NonTensorEntriesError: ... 1 non-tensor entry: epoch; pass drop_extras=...
        >>> leave_out_extras(["adj"], "a.pt", drop_extras=False, kinds={"adj": "meta device"})
        Traceback (most recent call last):
        ckpt_tools.errors.NonTensorEntriesError: ... 1 tensor it cannot hold: adj (meta device); ...
        >>> leave_out_extras(["acc"], "a.pt", drop_extras=False, outside={"acc"})
        Traceback (most recent call last):
        ckpt_tools.errors.NonTensorEntriesError: ... 1 tensor outside the state dict: acc; ...
    """
    if drop_extras or not extras:
        return tuple(extras)
    kinds = kinds or {}
    tensors = [f"{name} ({kinds[name]})" for name in extras if name in kinds]
    beside = [name for name in extras if name in outside and name not in kinds]
    held = [name for name in extras if name in dicts]
    others = [n for n in extras if n not in kinds and n not in outside and n not in dicts]
    said = []
    if tensors:
        said.append(f"{_count(len(tensors), 'tensor')} it cannot hold: {_few(tensors)}")
    if others:
        said.append(f"{_count(len(others), 'non-tensor entry')}: {_few(others)}")
    if beside:
        said.append(f"{_count(len(beside), 'tensor')} outside the state dict: {_few(beside)}")
    if held:
        said.append(f"{_count(len(held), 'tensor dict')} beside the chosen one: {_few(held)}")
    them = "it" if len(extras) == 1 else "them"
    if tensors:
        holds = "safetensors holds dense tensors only"
    elif beside or held:  # "tensors only" would not say why a tensor is refused
        holds = "a safetensors output holds the state dict's tensors only"
    else:
        holds = "safetensors holds tensors only"
    raise NonTensorEntriesError(
        holds
        + ", and "
        + (f"{path!r} also has " if path else "the output would also hold ")
        + "; and ".join(said),
        tuple(extras),
        path=path,
        remedies=(
            *remedies,
            Remedy("drop_extras", "True", flag="--drop-extras", text=f"to leave {them} out"),
            Remedy(text="keep the torch format" + (" (a .pt file holds them)" if tensors else "")),
        ),
    )


def _count(n: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``; ``2 non-tensor entries``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}s"


def tied_names(named: Iterable[tuple[str, TensorRef]]) -> dict[str, str]:
    """Tied tensors, which a safetensors file stores once: ``{dropped name: kept name}``.

    Tensors that are the same view of one storage (offset, shape, stride and dtype) are tied;
    each group keeps the name :func:`kept_name` picks (the input embedding, not the output
    head tied to it, as transformers' ``save_pretrained`` keeps it); safetensors'
    ``load_model`` takes either. Tensors without elements are never tied: they share no
    bytes, and safetensors keeps every name of them.

    Args:
        named: (output name, tensor) pairs.

    Returns:
        Each dropped name and the name it is stored under, in the order the names came.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> t = TensorRef(StorageRef("0", "float32", 4, "cpu"), 0, (2, 2), (2, 1), "float32")
        >>> tied_names([("embed.weight", t), ("lm_head.weight", t)])
        {'lm_head.weight': 'embed.weight'}
    """
    pairs = [(name, t) for name, t in named if t.nbytes]
    groups: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], list[str]] = {}
    for name, t in pairs:
        groups.setdefault((id(t.storage), t.offset, t.shape, t.stride, t.dtype), []).append(name)
    kept = {name: kept_name(names) for names in groups.values() for name in names}
    return {name: kept[name] for name, _ in pairs if kept[name] != name}


#: The modules transformers ties to an input embedding: the output heads (``lm_head``,
#: GPT-NeoX's ``embed_out``, Meta Llama's ``output``, Whisper's ``proj_out``, BERT's
#: ``cls.predictions.decoder`` and RoBERTa's ``lm_head.decoder``), none of which a base model
#: class has.
_TIED_HEADS = frozenset({"lm_head", "embed_out", "output", "head", "proj_out"})


def is_output_head(name: str) -> bool:
    """Whether the weight ``name`` is an output head's that transformers ties to the input
    embedding (a ``decoder`` at the top level is a model's own, not a head).

    Example:
        >>> is_output_head("lm_head.weight"), is_output_head("decoder.embed_tokens.weight")
        (True, False)
    """
    parts = name.split(".")[:-1]
    return bool(parts) and (
        parts[-1] in _TIED_HEADS
        or (parts[-1] == "decoder" and len(parts) > 1 and parts[-2] in ("lm_head", "predictions"))
    )


def kept_name(names: Sequence[str]) -> str:
    """The name a group of tied tensors is stored under: the first in key order (the module
    that owns a weight is registered first) that is no output head, so that a state dict in
    another order (sorted: ``lm_head.weight`` first) still keeps the input embedding, which
    the base model class loads too.

    Example:
        >>> kept_name(["lm_head.weight", "model.embed_tokens.weight"])
        'model.embed_tokens.weight'
    """
    return min(names, key=is_output_head)

"""Checks every rewrite runs before it looks for work, and before a byte is written.

The order is the promise: first "may this file be rewritten at all" (TorchScript, a pickled
``nn.Module``, globals outside the allowlist), then "can the planned output hold what it
must" (key types, output sizes). Only then may a rewrite say "nothing to do", so a file
that would be refused is never waved through with exit 0 because it has no work in it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ckpt_tools._escape import shell_path
from ckpt_tools.descriptors import Opaque, TensorRef
from ckpt_tools.errors import ConversionError, Remedy, UnsafeContentError
from ckpt_tools.formats import Checkpoint
from ckpt_tools.formats.pickle.limits import check_written_depth
from ckpt_tools.ops.rewrite.plan import check_source
from ckpt_tools.structure.keys import KeyRule
from ckpt_tools.structure.modules import is_pickled_module, module_globals
from ckpt_tools.structure.paths import walk_path

__all__ = ["check_key_types", "check_rewritable", "check_state_dict_output"]

_SAVE_STATE_DICT = Remedy(
    text="if you trust the file, load it with torch.load(path, weights_only=False) and "
    "save model.state_dict() with torch.save, then rewrite that",
)


def _module_on_path(root: Any, path: Sequence[str]) -> Opaque | None:
    """The pickled ``nn.Module`` at the root or on ``path``, if there is one.

    A pickled module is an object whose state holds ``_parameters`` and ``_modules``
    (what ``torch.save(model)`` writes, for any subclass).
    """
    nodes = walk_path(root, tuple(path)).nodes  # the root, then each node it reaches
    return next((n for n in nodes if isinstance(n, Opaque) and is_pickled_module(n)), None)


def check_rewritable(
    ckpt: Checkpoint,
    allow_globals: Sequence[str],
    path: Sequence[str] = (),
    output_format: str = "torch-zip",
    *,
    whole: bool = True,
) -> None:
    """Refuse a checkpoint no rewrite may touch, whether or not there is work to do.

    A torch output carries the whole object tree, so globals outside the allowlist are
    refused first (exit 3; where they are a pickled ``nn.Module``'s own classes, the fix
    offered is ``ckpt sanitize``, not allowing them), then a pickled ``nn.Module`` on the path
    (exit 7: its attributes cannot be rewritten without its code). A safetensors output
    holds the selected state dict's tensors only: a pickled module selected there gives up
    its recovered state dict, and the globals inside it (its classes, hooks) are never
    written.

    Args:
        ckpt: the opened input.
        allow_globals: globals outside the allowlist the caller allows through.
        path: the selection path of the state dict to rewrite.
        output_format: ``torch-zip`` or ``safetensors``.
        whole: a torch output pickles the whole tree, whose depth is checked; False: the
            state dict at ``path`` alone (``slim --weights-only``, ``extract``).

    Raises:
        ConversionError: a TorchScript archive, or a pickled ``nn.Module`` (exit 7).
        UnsafeContentError: globals outside the allowlist, not allowed (exit 3).
        ResourceLimitError: what a torch output pickles nests too deep (exit 5).

    Example:
        >>> check_rewritable(Checkpoint("a.pt", "torch-zip", {}, {}), ())
    """
    if output_format == "safetensors":
        node = walk_path(ckpt.root, tuple(path)).node
        unwritten = module_globals(node) if is_pickled_module(node) else set()
        check_source(ckpt, [*allow_globals, *sorted(unwritten)])
        return
    module = _module_on_path(ckpt.root, path)
    try:
        check_source(ckpt, allow_globals)
    except UnsafeContentError as e:
        if module is None or not set(e.globals) <= module_globals(module):
            raise
        # Allowing the module's classes only leads to the refusal below: say what works.
        raise UnsafeContentError(
            f"{e.message}: the classes of the pickled nn.Module it holds "
            f"({type(module).global_ref.qualname}), which a torch output would carry",
            e.globals,
            path=ckpt.path,
            remedies=_module_remedies(ckpt.path),
        ) from e
    if whole:  # (a state dict written alone is checked as it is pickled)
        check_written_depth(ckpt.root)
    if module is not None:
        raise ConversionError(
            f"{ckpt.path!r} is a pickled nn.Module ({type(module).global_ref.qualname}), not a "
            "state dict: its attributes cannot be rewritten without the class's code",
            path=ckpt.path,
            remedies=_module_remedies(ckpt.path),
        )


def _module_remedies(path: str) -> tuple[Remedy, ...]:
    """What writes a pickled module's state dict without its code."""
    sanitize = Remedy(
        command=f"ckpt sanitize {shell_path(path)} OUT.pt",
        text="to write its recovered state dict (nothing is imported or run)",
    )
    return (sanitize, _SAVE_STATE_DICT)


def _module_trees(node: Any, depth: int = 0) -> list[Any]:
    """The pickled ``nn.Module`` s at the root or in its containers (``{"ema": Model}``)."""
    if is_pickled_module(node):
        return [node]
    if depth > 3:
        return []
    values = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
    return [m for v in values for m in _module_trees(v, depth + 1)]


def check_state_dict_output(
    ckpt: Checkpoint, allow_globals: Sequence[str], state_dict: Mapping[Any, Any]
) -> tuple[str, ...]:
    """Refuse what an output holding ``state_dict`` alone may not be written from.

    Such an output (a plain state dict, a safetensors file) writes none of the checkpoint's
    pickled ``nn.Module`` objects: an Ultralytics ``{"model": DetectionModel, "ema":
    DetectionModel}`` gives up the recovered state dict of one and writes no class. Their
    globals are therefore allowed; any other global outside the allowlist, and any inside
    ``state_dict`` itself, is refused as :func:`check_rewritable` refuses it.

    Args:
        ckpt: the opened input.
        allow_globals: globals outside the allowlist the caller allows through.
        state_dict: the state dict the output holds (a recovered one included).

    Returns:
        The module globals allowed because they are not written, sorted.

    Raises:
        ConversionError: a TorchScript archive (exit 7).
        UnsafeContentError: other globals outside the allowlist, not allowed (exit 3).
        ResourceLimitError: ``state_dict`` nests too deep to be written (exit 5).

    Example:
        >>> check_state_dict_output(Checkpoint("a.pt", "torch-zip", {}, {}), (), {})
        ()
    """
    carried = module_globals(dict(state_dict))
    unwritten = {g for m in _module_trees(ckpt.root) for g in module_globals(m)} - carried
    check_source(ckpt, [*allow_globals, *sorted(unwritten)])
    check_written_depth(dict(state_dict))
    return tuple(sorted(unwritten & set(ckpt.unsafe_globals)))


def _shown(keys: Sequence[Hashable]) -> str:
    return ", ".join(repr(k) for k in keys[:8]) + (" ..." if len(keys) > 8 else "")


def check_key_types(
    sd: Mapping[Any, Any], rules: Sequence[KeyRule], output_format: str, path: str
) -> None:
    """Refuse, before writing, keys whose type the planned output cannot keep.

    Key rules apply to ``str`` keys only; other keys (``0``, ``(1, 2)``, ``None``, bytes)
    are carried through with their type. A rule that would rename one (it matches its
    ``str()``) is refused, and so is any such key for safetensors, which names tensors by
    strings only.

    Args:
        sd: the selected state dict.
        rules: the key rules of the rewrite.
        output_format: ``torch-zip`` or ``safetensors``.
        path: the input, for the message.

    Raises:
        ConversionError: every offending key is named (exit 7).

    Example:
        >>> check_key_types({0: 1, "w": 2}, [], "torch-zip", "a.pt")
    """
    others = [k for k in sd if not isinstance(k, str)]
    if not others:
        return
    if output_format == "safetensors":
        tensors = [k for k in others if isinstance(sd[k], TensorRef)]
        if tensors:
            raise ConversionError(
                f"safetensors names tensors by strings, and {path!r} has {len(tensors)} "
                f"tensor(s) under other keys: {_shown(tensors)}",
                path=path,
                remedies=(Remedy(text="keep the torch format, which keeps key types"),),
            )
    renamed = [k for k in others if any(r.apply(str(k)) != str(k) for r in rules)]
    if renamed:
        raise ConversionError(
            f"key rules rename string keys only, and would have to rename {len(renamed)} "
            f"key(s) of another type in {path!r}: {_shown(renamed)}",
            path=path,
            remedies=(Remedy(text="give the keys string names before rewriting"),),
        )

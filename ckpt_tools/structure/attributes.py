"""A state dict's attributes, which ``torch.load`` gives back as saved: ``_metadata`` (each
module's version, read by ``load_state_dict``) and any other, kept through a rewrite, the module
paths of ``_metadata`` renamed as the keys are.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_tools.structure.keys import KeyRule

__all__ = ["carry_attributes", "rename_metadata"]


def carry_attributes(src: Any, dst: Any, rules: Sequence[KeyRule] = ()) -> None:
    """Give ``dst`` the instance attributes of ``src``, a ``_metadata`` mapping's module
    paths renamed by ``rules``: an OrderedDict's attributes come back from ``torch.load`` as
    saved (``_metadata``, the module versions, and any other), so a rewritten state dict
    keeps every one.

    Example:
        >>> from collections import OrderedDict
        >>> from ckpt_tools.structure.keys import strip_rule
        >>> src, dst = OrderedDict(), OrderedDict()
        >>> src._metadata, src.note = {"": {"version": 1}, "m": {"version": 2}}, "kept"
        >>> carry_attributes(src, dst, [strip_rule("m.")])
        >>> dst.__dict__
        {'_metadata': {'': {'version': 2}}, 'note': 'kept'}
    """
    attributes = getattr(src, "__dict__", None)
    if not (attributes and hasattr(dst, "__dict__")):
        return
    dst.__dict__.update(attributes)
    metadata = attributes.get("_metadata")
    if isinstance(metadata, Mapping) and rules:
        dst._metadata = rename_metadata(metadata, rules)


def rename_metadata(metadata: Mapping[str, Any], rules: Sequence[KeyRule]) -> Any:
    """A state dict's ``_metadata`` with its module paths renamed as its keys are.

    As torch's ``consume_prefix_in_state_dict_if_present`` does for a stripped prefix: the
    module the prefix names becomes the root (its version replaces the root's), paths under
    it lose the prefix, other paths stay.

    Args:
        metadata: module path -> that module's metadata (``{"version": 2}``).
        rules: the :class:`KeyRule` s the keys were renamed by.

    Returns:
        A new mapping of ``metadata``'s type (its values shared).

    Example:
        >>> from ckpt_tools.structure.keys import strip_rule
        >>> rename_metadata({"": {"version": 1}, "1": {"version": 2}}, [strip_rule("1.")])
        {'': {'version': 2}}
    """
    renamed = type(metadata)()
    for path, value in metadata.items():
        if not isinstance(path, str):  # not a module path: no rule renames it
            renamed[path] = value
            continue
        new = f"{path}." if path else ""
        for rule in rules:
            new = rule.apply(new)
        new = new[:-1] if new.endswith(".") else new
        if not path and new:
            # The root moved under wrappers (add 'module.'): each wrapper, from the new
            # root down, gets an entry too, first, as a wrapped model's state_dict() has.
            parts = new.split(".")
            for depth in range(len(parts)):
                renamed[".".join(parts[:depth])] = copy.copy(value)
        if new != path or new not in renamed:
            # A renamed entry wins over one already there, as in torch's
            # consume_prefix_in_state_dict_if_present ('module' replaces DDP's own '').
            renamed[new] = value
    return renamed

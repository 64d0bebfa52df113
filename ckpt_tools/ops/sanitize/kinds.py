"""What an object read from a pickle is to ``sanitize``: a path, a namespace, a frozenset, an
enum member; and whether a value made plain can still be a key."""

from __future__ import annotations

import ntpath
import posixpath
from collections.abc import Mapping
from typing import Any

from ckpt_tools.descriptors import Opaque
from ckpt_tools.formats.pickle.standins import Reduced
from ckpt_tools.structure.selection import UNINITIALIZED

__all__ = [
    "FROZENSETS",
    "NAMESPACES",
    "dropped_object",
    "enum_like",
    "hashable",
    "path_text",
    "same_member",
    "unmirrored_state",
]

NAMESPACES = ("argparse.Namespace", "types.SimpleNamespace")
FROZENSETS = ("builtins.frozenset", "__builtin__.frozenset")
_RECONSTRUCTORS = ("copyreg._reconstructor", "copy_reg._reconstructor")
_DICTS = ("builtins.dict", "__builtin__.dict")
_PATHS = {"PosixPath": posixpath, "PurePosixPath": posixpath}
_PATHS.update({"WindowsPath": ntpath, "PureWindowsPath": ntpath})


def path_text(node: Opaque, module: str, short: str) -> str | None:
    """The string a pickled ``pathlib`` path stands for (its parts joined as its flavour
    joins them), or None where ``node`` is no such path.

    Example:
        >>> from types import SimpleNamespace  # stands for the node: its args alone are read
        >>> path_text(SimpleNamespace(args=("data", "a.txt")), "pathlib", "PurePosixPath")
        'data/a.txt'
    """
    if module not in ("pathlib", "pathlib._local") or short not in _PATHS:
        return None
    if not all(isinstance(a, str) for a in node.args):
        return None
    return _PATHS[short].join(*node.args) if node.args else "."


def hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def enum_like(node: Opaque, name: str) -> bool:
    # An Enum member pickles as its class called with its value. Functions (``posix.system``)
    # are named in lower case by convention: only a capitalised class called with one plain
    # value, and nothing else recorded, is read as an enum member (and never one the scan's
    # table knows as dangerous: subprocess.Popen("cmd") looks the same). A lazy module's
    # UninitializedParameter(True) looks the same too: its one value is requires_grad.
    short = name.rpartition(".")[2]
    return (
        name not in UNINITIALIZED
        and not node.newobj
        and len(node.args) == 1
        and isinstance(node.args[0], (bool, int, float, str))
        and short[:1].isupper()
        and not node.has_state
        and not node.listitems
        and not node.dictitems
    )


def dropped_object(name: str) -> str:
    """How a dropped object of the class ``name`` is listed."""
    if name in UNINITIALIZED:  # before the module's first forward: no values to keep
        kind = "parameter" if name.endswith("Parameter") else "buffer"
        return f"uninitialized {kind} of a lazy module"
    return f"{name} object"


def same_member(a: Any, b: Any) -> bool:
    """Whether two members of one pickled set, equal once made plain, were one member already
    (equal values, or two pickles of one kind: the same class or rebuild call, ``PosixPath``
    twice), as the set the unpickler builds holds them once."""
    try:
        if a is b or bool(a == b):
            return True
    except (TypeError, ValueError):  # a comparison that fails: told by the kind alone
        pass
    return _kind(a) == _kind(b)


def _kind(member: Any) -> Any:
    """What makes a member: its rebuild call, its stand-in's class, or its type."""
    if isinstance(member, Reduced):
        return member.func
    return getattr(type(member), "global_ref", None) or type(member)


def reconstructed_items(node: Opaque) -> list[tuple[Any, Any]] | None:
    r"""A dict subclass's items, as protocols 0 and 1 pickle one:
    ``copyreg._reconstructor(cls, dict, {items})``; None for any other object.

    Example:
        >>> import io
        >>> from ckpt_tools.formats.pickle.unpickler import load_pickle
        >>> cfg = b"ccopy_reg\n_reconstructor\n(cmypkg\nCfg\nc__builtin__\ndict\n(dVlr\nF0.1\nstR."
        >>> reconstructed_items(load_pickle(io.BytesIO(cfg)).root)  # mypkg.Cfg(lr=0.1)
        [('lr', 0.1)]
    """
    if type(node).global_ref.qualname not in _RECONSTRUCTORS or len(node.args) != 3:
        return None
    cls, base, items = node.args
    is_class = isinstance(cls, type) and issubclass(cls, Opaque)
    base_ref = getattr(base, "global_ref", None) if isinstance(base, type) else None
    if not is_class or base_ref is None or base_ref.qualname not in _DICTS:
        return None
    return list(items.items()) if type(items) is dict and not node.listitems else None


def unmirrored_state(node: Opaque, items: list[tuple[Any, Any]]) -> tuple[list[str], bool]:
    """A dict subclass's attributes that do not only mirror one of its items (an EasyDict's
    ``d.lr is d["lr"]``), and whether it has state other than attributes (slots).

    Example:
        >>> from types import SimpleNamespace  # stands for the node
        >>> unmirrored_state(SimpleNamespace(state={"lr": 0.1, "n": 2}), [("lr", 0.1)])
        (['n'], False)
    """
    state = node.state if node.state is not node else None  # ``self.__dict__ = self``
    if state is not None and not isinstance(state, Mapping):
        return [], True
    named = {key: value for key, value in items if isinstance(key, str)}
    return [a for a, v in (state or {}).items() if not (a in named and _same(named[a], v))], False


def _same(a: Any, b: Any) -> bool:
    """One object, or equal plain scalars (a pickle writes each number again)."""
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, str, bytes)) and a == b)

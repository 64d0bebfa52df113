"""Limits on what a pickle may make us hold or walk: its size, and how deep a tree nests."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, BinaryIO

from ckpt_tools.descriptors import Opaque, Sealed
from ckpt_tools.errors import ResourceLimitError

__all__ = [
    "MAX_REWRITE_NESTING",
    "MAX_ZIP_DIRECTORY_BYTES",
    "LimitedReader",
    "check_nesting",
    "check_written_depth",
    "numel_overflows",
    "stack_room",
    "tree_children",
]

# A zip's central directory takes about 100 bytes a record; torch archives hold one record a
# storage, so even a model with a million storages stays far below this.
MAX_ZIP_DIRECTORY_BYTES = 256 << 20


def tree_children(node: Any) -> Iterable[Any] | None:
    """What a node of an unpickled tree holds, or None for a leaf."""
    if isinstance(node, dict):
        # An OrderedDict's attributes (a BUILD sets them, as torch.load does) are held too.
        attributes = getattr(node, "__dict__", None) or {}
        return (*node.keys(), *node.values(), *attributes.values())
    if isinstance(node, (list, tuple, set, frozenset)):
        return node
    if isinstance(node, Sealed):
        return getattr(node, "args", None)  # rebuilt tensors and recorded calls
    if isinstance(node, Opaque):
        return (node.args, node.state, node.listitems, node.dictitems)
    return None


_SCALARS = frozenset({int, float, bool, complex, str, bytes, type(None)})


def check_nesting(root: Any, limit: int, why: str) -> None:
    """Refuse a tree whose containers nest deeper than ``limit`` (shared nodes and cycles ok).

    Iterative, so a pathological pickle cannot overflow the stack here; it computes each
    container's height once, so a tree of shared references (a memo bomb) costs its size.

    Args:
        root: a tree read by the restricted unpickler.
        limit: the most levels allowed.
        why: the end of the message: why a deeper tree is refused.

    Raises:
        ResourceLimitError: the tree is deeper than ``limit``.
    """
    height: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, list[Any] | None]] = [(root, None)]
    while stack:
        node, kids = stack.pop()
        key = id(node)
        if kids is None:
            if key in height or key in open_:
                continue  # done already, or a cycle back to an ancestor
            children = tree_children(node)
            if children is None:
                continue
            kids = [c for c in children if type(c) not in _SCALARS]
            if kids:
                open_.add(key)
                stack.append((node, kids))
                stack.extend((c, None) for c in kids if id(c) not in height)
                continue
            below = 0
        else:
            open_.discard(key)
            below = max(height.get(id(c), 0) for c in kids)
        if below >= limit:
            raise ResourceLimitError(
                f"the object tree nests containers more than {limit} levels deep; {why}"
            )
        height[key] = below + 1


class LimitedReader(io.RawIOBase):
    """Reads through to ``file`` and refuses to go past ``limit`` bytes.

    A pickle opcode declares the length of what follows (BINUNICODE8, BINBYTES8 ...) and the
    unpickler asks for that many bytes at once; a file object allocates what it is asked for
    before it reads. So a read never asks for more than the limit or the rest of the file.
    """

    def __init__(self, file: BinaryIO, limit: int) -> None:
        self._file, self._left, self._limit = file, limit, limit
        try:
            start = file.tell()
            self._in_file = file.seek(0, io.SEEK_END) - start
            file.seek(start)
        except (OSError, AttributeError, ValueError):
            self._in_file = limit  # not seekable: the limit alone bounds each read

    def readable(self) -> bool:
        return True

    def left_in_file(self) -> int:
        """The bytes the file holds past where this reader stands (the limit, where the file
        cannot tell)."""
        return max(self._in_file, 0)

    def tell(self) -> int:
        # How far it has read. pickletools.genops asks before every opcode; RawIOBase's own
        # tell would seek, which this reader cannot.
        return self._limit - self._left

    def _take(self, n: int) -> None:
        if n > self._left:
            raise ResourceLimitError(
                f"the pickle is larger than the {self._limit >> 20} MiB limit; "
                "a state dict's pickle is far smaller, so this is not one"
            )
        self._left -= n

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._left + 1
        elif n > self._left:
            self._take(n)  # a declared length past the limit: refused before any allocation
        # Past the end of the file the unpickler gets a short read and says "truncated".
        data = self._file.read(min(n, max(self._in_file, 0) + 1))
        self._take(len(data))
        self._in_file -= len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def peek(self, n: int = 0) -> bytes:
        # With peek, the C unpickler reads ahead in blocks and then consumes exactly what it
        # used (so the position still ends right after STOP); without it, one read per opcode.
        peek = getattr(self._file, "peek", None)
        return peek(n)[: self._left + 1] if peek is not None else b""

    def readline(self, size: int | None = -1) -> bytes:
        data = self._file.readline(self._left + 1 if size is None or size < 0 else size)
        self._take(len(data))
        self._in_file -= len(data)
        return data


# How deep a tree a rewrite pickles (torch.save itself stops near 480 levels of dicts under
# Python's default recursion limit). torch.load reads deeper trees: only an output that would
# hold one is refused, before anything is written.
MAX_REWRITE_NESTING = 300
# The Python calls a level of nesting costs a recursive walk or pickler (a dict: save,
# save_dict, _batch_setitems; sanitize's walk: value, _mapping, _entries).
_FRAMES_PER_LEVEL = 3


def check_written_depth(tree: Any) -> None:
    """Refuse an output whose object tree nests deeper than a rewrite writes.

    Args:
        tree: what the output pickles: the whole root, or the state dict alone.

    Raises:
        ResourceLimitError: ``tree`` nests more than :data:`MAX_REWRITE_NESTING` levels (exit 5).
    """
    check_nesting(
        tree,
        MAX_REWRITE_NESTING,
        "torch.load reads it, but a rewrite writes trees that deep at most: write its tensors "
        "alone (extract them, or write safetensors without the other entries)",
    )


_room_lock = threading.Lock()
_room_users = 0
_room_saved = 0


@contextlib.contextmanager
def stack_room(levels: int = MAX_REWRITE_NESTING) -> Iterator[None]:
    """Python's recursion limit raised while the body runs, to fit a recursive walk or
    pickler ``levels`` deep above the caller's frames (a caller deep in a test runner, a
    server, has fewer left). The limit is the interpreter's: the first thread in raises it,
    the last one out puts it back."""
    global _room_users, _room_saved
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    with _room_lock:
        if _room_users == 0:
            _room_saved = sys.getrecursionlimit()
        _room_users += 1
        sys.setrecursionlimit(
            max(sys.getrecursionlimit(), depth + _FRAMES_PER_LEVEL * levels + 100)
        )
    try:
        yield
    finally:
        with _room_lock:
            _room_users -= 1
            if _room_users == 0:
                sys.setrecursionlimit(_room_saved)


def numel_overflows(size: Sequence[int]) -> bool:
    """Whether torch refuses ``size`` ("numel: integer multiplication overflow"): it
    multiplies the sizes as unsigned 64-bit numbers, and an overflow on the way counts even
    when a later size is 0; the product must also fit a signed 64-bit number.

    Example:
        >>> numel_overflows([2**32, 2**32, 0]), numel_overflows([2**31, 2**31])
        (True, False)
    """
    numel, overflowed = 1, False
    for dim in size:
        numel *= dim
        overflowed |= numel >= 1 << 64
        numel &= (1 << 64) - 1
    return overflowed or numel >= 1 << 63

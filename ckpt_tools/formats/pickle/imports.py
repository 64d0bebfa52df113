"""Every global a pickle imports, found without running it.

A pickle has no branches: every opcode before its STOP runs when it is loaded, so every
``GLOBAL``, ``INST``, ``STACK_GLOBAL`` and extension code in that span is an import that
``pickle.load`` (and ``torch.load(weights_only=False)``) performs. This walk replays the
stack with the strings a pickle pushes (and memoizes) and nothing else, so a
``STACK_GLOBAL`` whose module and name were memoized long before is still named; one whose
operands are not plain strings (built by a call) is reported unresolved, never guessed.
Names are those pickle's ``find_class`` imports: strings decoded as pickle decodes them, and
Python 2 names mapped (``__builtin__.eval`` is ``builtins.eval``) where the protocol is below 3.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
from typing import Any, BinaryIO, NamedTuple

from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.pickle.limits import LimitedReader
from ckpt_tools.formats.pickle.opcode_reader import STRINGS, CutGlobal, FramedInput, read_opcodes

__all__ = [
    "UNREAD",
    "ImportScan",
    "PickleImport",
    "find_imports",
    "python3_name",
    "python3_qualname",
    "starts_like_pickle",
]


class PickleImport(NamedTuple):
    """One import a pickle performs.

    Attributes:
        module: the module, None where the pickle computes it (unresolved).
        name: the attribute (dotted for nested ones), None where computed.
        position: the byte offset of the opcode that imports it.
        opcode: ``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ`` or ``EXT1``/``EXT2``/``EXT4``;
            ``unread`` for bytes a loader unpickles that no walk could reach (their place).
    """

    module: str | None
    name: str | None
    position: int
    opcode: str

    @property
    def qualname(self) -> str:
        """``module.name``, or a description of what could not be resolved."""
        if self.module is None or self.name is None:
            if self.opcode.startswith("EXT"):
                return "<copyreg extension code>"
            if self.opcode == "unread":
                return "<bytes not read>"
            return "<computed global>"
        return f"{self.module}.{self.name}"


#: Bytes a loader unpickles that no walk reaches (its ``position`` where they start): sized
#: by a call a walk does not run, or compressed in a way it does not read.
UNREAD = PickleImport(None, None, 0, "unread")


class ImportScan(NamedTuple):
    """What one walk over a pickle found.

    Attributes:
        imports: the imports, in the order the pickle performs them.
        end: the offset just past the STOP opcode; None where there was none.
        malformed: why the bytes stop being a pickle (None when they are one); the imports
            above are those before that point, each of which a loader would perform.
        truncated: the bytes ran out before a STOP (more bytes may complete the pickle).
        after: where the file stands once ``pickle.load`` has read the pickle, and the next
            load starts: ``end``, or the end of a FRAME read whole that the STOP lies inside
            (:class:`~ckpt_tools.formats.pickle.opcode_reader.FramedInput`); None with ``end``.
        unsettled: the offsets of FRAMEs a buffered file may serve from its buffer instead,
            which changes what is read (empty where the file's buffer makes no difference).
        mutated: the imports the pickle changes in place (a BUILD, SETITEM or APPEND on the
            imported object itself, not on an object built from it): that sets attributes of
            a module or class, or fills a dict a module holds, for all code to meet.
        called: the imports the pickle calls (REDUCE, NEWOBJ, OBJ on the imported object, an
            INST above a mark): what a loader runs, not only imports, before any later break.
    """

    imports: tuple[PickleImport, ...]
    end: int | None
    malformed: str | None = None
    truncated: bool = False
    after: int | None = None
    unsettled: frozenset[int] = frozenset()
    mutated: tuple[PickleImport, ...] = ()
    called: tuple[PickleImport, ...] = ()


# Protocol 2+ pickles Python writes start with PROTO, but a loader takes any opcode that
# needs nothing below it: a mark, a container, a global, a value, a FRAME (not a PERSID,
# which needs the loader's own persistent_load: a zip starts with its P).
_FIRST_OPCODES = frozenset(b"(}]lcdNIFLSVXiJKMGTUBC)\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x95\x96")
_MARK = pickletools.markobject
# Opcodes that change the object below them in place, and how deep it lies (None: below
# the mark).
_MUTATES = {"BUILD": 2, "SETITEM": 3, "APPEND": 2, "SETITEMS": None, "APPENDS": None,
            "ADDITEMS": None}  # fmt: skip
# Where each calling opcode finds the callable: its depth from the top (OBJ: above the mark).
_CALLS = {"REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "OBJ": None}


class _Imported(NamedTuple):
    """On the replayed stack: the object an import pushed (a module's attribute itself)."""

    source: PickleImport


_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_EXTS = frozenset({"EXT1", "EXT2", "EXT4"})


def starts_like_pickle(head: bytes, *, any_protocol: bool = False) -> bool:
    """Whether ``head`` starts as the pickles Python writes do (PROTO 2-5, or a protocol 0/1
    opcode that begins a value); a cheap test before a walk.

    Args:
        head: the first bytes.
        any_protocol: take PROTO of any number, as torch's weights-only reader does (it
            reads past the number; Python's pickle refuses 6 and up).

    Example:
        >>> import pickle
        >>> starts_like_pickle(pickle.dumps([1])), starts_like_pickle(b"\\x00\\x00\\x80?")
        (True, False)
        >>> starts_like_pickle(b"\\x80B}"), starts_like_pickle(b"\\x80B}", any_protocol=True)
        (False, True)
    """
    if head[:1] == b"\x80":
        return any_protocol or (len(head) > 1 and 2 <= head[1] <= 5)
    return bool(head) and head[0] in _FIRST_OPCODES


def python3_qualname(qualname: str) -> str:
    """A global named as a Python 2 pickle names it (``__builtin__.long``), as Python 3
    resolves it (``builtins.int``); other names unchanged.

    Example:
        >>> python3_qualname("__builtin__.long"), python3_qualname("copy_reg._reconstructor")
        ('builtins.int', 'copyreg._reconstructor')
    """
    at = qualname.find(".")
    while at > 0:
        module, name = qualname[:at], qualname[at + 1 :]
        if (module, name) in _compat_pickle.NAME_MAPPING or module in _compat_pickle.IMPORT_MAPPING:
            return ".".join(python3_name(module, name))
        at = qualname.find(".", at + 1)
    return qualname


def python3_name(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` as Python's ``Unpickler.find_class`` maps a Python 2 name
    (``fix_imports``, torch's default) before it imports anything.

    Example:
        >>> python3_name("__builtin__", "set")
        ('builtins', 'set')
    """
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _imported(module: str, name: str, protocol: int) -> tuple[str, str]:
    """The global ``pickle.load`` imports for ``module`` and ``name``: its ``find_class`` maps
    Python 2 names only while the last PROTO read is below 3 (``fix_imports``)."""
    return python3_name(module, name) if protocol < 3 else (module, name)


def find_imports(
    data: bytes | BinaryIO,
    start: int = 0,
    limit: int = 1 << 30,
    *,
    cut_globals: bool = False,
    served: frozenset[int] = frozenset(),
) -> ImportScan:
    """Walk the pickle at ``start`` of ``data`` up to its STOP and list its imports.

    Its bytes are taken as the C unpickler takes them from a file without ``peek``
    (``io.BytesIO``, an unbuffered file), FRAMEs included; ``served`` names the frames a
    buffered file holds in its buffer instead (:class:`ImportScan`'s ``unsettled``).

    Args:
        data: the bytes holding the pickle (more may follow it), or a binary file.
        start: where it begins.
        limit: the most bytes the walk reads (a declared length past it ends the walk).
        cut_globals: for a pickle torch reads: where the data ends inside a GLOBAL's lines,
            list the global torch's weights-only reader names as it refuses it (each line
            less its last byte). Elsewhere such bytes are no pickle's.
        served: offsets of FRAMEs read as plain bytes, as a buffered file may serve them.

    Returns:
        The :class:`ImportScan`; a malformed or truncated pickle gives the imports before
        the point where it fails.

    Example:
        >>> import os, pickle
        >>> class Call:
        ...     def __reduce__(self):
        ...         return (os.system, ("true",))
        >>> scan = find_imports(pickle.dumps({"x": Call()}, protocol=4))
        >>> [i.qualname for i in scan.imports], scan.end is not None
        (['posix.system'], True)
    """
    if isinstance(data, bytes):  # in memory, its length bounds every read
        stream: BinaryIO | LimitedReader = io.BytesIO(data)
        stream.seek(start)
        base, size = 0, len(data)
    else:
        size = data.seek(0, io.SEEK_END)
        data.seek(start)
        stream, base = LimitedReader(data, limit), start
    framed = FramedInput(stream, served)
    imports: list[PickleImport] = []
    mutated: list[PickleImport] = []
    called: list[PickleImport] = []

    def scan(end: int | None, why: str | None, short: bool, after: int | None = None) -> ImportScan:
        unsettled = frozenset(framed.unsettled)
        found = (tuple(imports), end, why, short, after, unsettled, tuple(mutated))
        return ImportScan(*found, tuple(called))

    try:
        stopped = _walk(framed, imports, mutated, called)
    except ResourceLimitError as e:
        return scan(None, str(e), False)
    except CutGlobal as e:
        if cut_globals:
            imports.append(PickleImport(e.module, e.name, e.pos, e.opcode))
        return scan(None, str(e), True)
    except ValueError as e:
        # Truncated where the walk failed for want of bytes (it read to the end, and not
        # to an opcode that does not exist).
        return scan(None, str(e), base + framed.tell() >= size and "unknown" not in str(e))
    if not stopped:
        return scan(None, "no STOP opcode", True)
    return scan(base + framed.tell(), None, False, base + framed.after())


def _walk(
    framed: FramedInput,
    imports: list[PickleImport],
    mutated: list[PickleImport],
    called: list[PickleImport],
) -> bool:
    """Replay the pickle's opcodes up to its STOP, adding each import to ``imports``, each
    import changed in place to ``mutated`` and each called to ``called``; whether it met the
    STOP."""
    # The stack holds the strings the pickle pushed, the objects it imported, None for any
    # other object, and _MARK.
    stack: list[object] = []
    memo: dict[object, object] = {}
    # The last PROTO read decides whether find_class maps Python 2 names (below 3 it does).
    protocol = 0
    for op, arg, pos in read_opcodes(framed):
        name = op.name
        if name in STRINGS:
            stack.append(arg if isinstance(arg, str) else _python2_text(arg))
        elif name == "PROTO":
            protocol = arg
        elif name == "INST":  # (an instance of the class, not the class)
            imports.append(PickleImport(*_imported(*arg, protocol), pos, name))
            if _MARK in stack:  # (without one, the loader fails before the call)
                called.append(imports[-1])
            _apply(op, stack)
        elif name in ("GLOBAL", "STACK_GLOBAL") or name in _EXTS:
            imports.append(_import(name, arg, pos, stack, protocol))
            stack.append(_Imported(imports[-1]))
        else:
            if name in _MUTATES:
                _note_mutated(stack, _MUTATES[name], mutated)
            if name in _CALLS:
                _note_called(stack, _CALLS[name], called)
            _replay(op, arg, stack, memo)
        if name == "STOP":
            return True
    return False


def _import(name: str, arg: Any, pos: int, stack: list[object], protocol: int) -> PickleImport:
    """The import a GLOBAL, STACK_GLOBAL (its operands popped) or extension code performs."""
    if name == "GLOBAL":
        return PickleImport(*_imported(*arg, protocol), pos, name)
    if name in _EXTS:
        return PickleImport(None, None, pos, name)
    attr, module = (stack.pop() if stack else None), (stack.pop() if stack else None)
    if isinstance(module, str) and isinstance(attr, str):
        return PickleImport(*_imported(module, attr, protocol), pos, name)
    return PickleImport(None, None, pos, name)


def _note_mutated(stack: list[object], depth: int | None, mutated: list[PickleImport]) -> None:
    """Add to ``mutated`` the import an opcode changes in place, if the object it changes
    (``depth`` from the top, or just below the mark where None) is one."""
    if depth is None:
        at = max((i for i, item in enumerate(stack) if item is _MARK), default=0) - 1
    else:
        at = len(stack) - depth
    target = stack[at] if 0 <= at < len(stack) else None
    if isinstance(target, _Imported) and target.source not in mutated:
        mutated.append(target.source)


def _note_called(stack: list[object], depth: int | None, called: list[PickleImport]) -> None:
    """Add to ``called`` the import a calling opcode calls, if its callable (``depth`` from
    the top, or just above the mark where None) is one."""
    if depth is None:
        at = max((i for i, item in enumerate(stack) if item is _MARK), default=-2) + 1
    else:
        at = len(stack) - depth
    target = stack[at] if 0 <= at < len(stack) else None
    if isinstance(target, _Imported) and target.source not in called:
        called.append(target.source)


def _python2_text(value: object) -> object:
    """A Python 2 string (STRING, BINSTRING) as the text a loader hands find_class.

    torch.load decodes them as UTF-8, plain pickle.load as ASCII (and fails on other bytes),
    numpy.load and Python 2 ports often as latin-1: UTF-8 where the bytes are UTF-8, else
    latin-1, so a name any of them would import is named (ASCII, the only names a
    weights-only allowlist holds, reads alike in all three).
    """
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def _replay(
    op: pickletools.OpcodeInfo, arg: Any, stack: list[object], memo: dict[object, object]
) -> None:
    """An opcode that imports nothing: its effect on the stack and the memo."""
    name = op.name
    if name in _GETS:
        stack.append(memo.get(arg))
    elif name in _PUTS:
        memo[arg] = stack[-1] if stack else None
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1] if stack else None
    elif name == "DUP":
        stack.append(stack[-1] if stack else None)
    elif name == "MARK":
        stack.append(_MARK)
    else:
        _apply(op, stack)


def _apply(op: pickletools.OpcodeInfo, stack: list[object]) -> None:
    """Pop what ``op`` consumes (down to a mark where it takes one) and push its results."""
    before = op.stack_before
    if _MARK in before:
        while stack and stack[-1] is not _MARK:
            stack.pop()
        if stack:
            stack.pop()
        below = before.index(_MARK)  # what the opcode takes from under the mark
    else:
        below = len(before)
    del stack[max(0, len(stack) - below) :]
    stack.extend([None] * len(op.stack_after))

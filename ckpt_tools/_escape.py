"""Text read from a checkpoint, or quoted from another library, made safe to show.

One escaping for the whole package: a name that reaches a terminal, a table or an error
message can neither drive the terminal nor start a line of its own.
:mod:`ckpt_tools.errors` re-exports ``shown`` and ``quote_foreign``, where callers import
them; :func:`short_repr` bounds the repr of any unpickled value.
"""

from __future__ import annotations

import reprlib
import shlex
from typing import Any

__all__ = ["not_an_option", "quote_foreign", "shell_path", "shell_word", "short_repr", "shown"]


def quote_foreign(error: BaseException, limit: int = 200) -> str:
    """Another library's exception as one line: its type and its text, escaped and cut.

    A message that quotes foreign text (an exception from ``pickle``, ``json``, ``zlib``, or
    the file content such an exception quotes) must stay one line: it is :func:`shown`, and
    cut to about ``limit`` characters.

    Example:
        >>> quote_foreign(ValueError("could not convert string to float: 'x\\n'"))
        "ValueError: could not convert string to float: 'x\\\\n'"
    """
    escaped = shown(str(error))
    if len(escaped) > limit:
        escaped = escaped[: limit - 3] + "..."
    return f"{type(error).__name__}: {escaped}" if escaped else type(error).__name__


def shown(text: str, *, lines: bool = False) -> str:
    """``text`` safe to write to a terminal: what ``repr`` escapes is written as it escapes it.

    The one escaping of the package, for every name read from a checkpoint that reaches text
    for people (results, tables, error messages). Every character that ``str.isprintable``
    rejects (controls, line breaks, format characters such as bidi overrides, spaces other
    than ``" "``, unassigned code points, lone surrogates) becomes its ``repr`` escape
    (``\\x1b``, ``\\n``, ``\\u202e``): a name can neither drive the terminal nor start a line
    of its own, and stays recognisable. Printable text, accents and CJK included, is returned
    as it is.

    Args:
        text: the text to show.
        lines: keep ``\\n`` as a line break, for a whole output laid out in lines.

    Returns:
        ``text``, or its escaped form.

    Example:
        >>> print(shown("fc\\x1b[2J.weight\\u202e\\nclean"), shown("权重.ñ"))
        fc\\x1b[2J.weight\\u202e\\nclean 权重.ñ
    """
    if text.isprintable():
        return text
    if lines:
        return "\n".join(map(shown, text.split("\n")))
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _ShortRepr(reprlib.Repr):
    """``reprlib`` limits, also for container subclasses, huge ints and ``__repr__`` methods."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 8
        self.maxstring = self.maxother = self.maxlong = limit

    def repr1(self, x: Any, level: int) -> str:
        # reprlib picks repr_<type name>: a class a pickle named "int" or "dict" (a stand-in
        # for a global outside the allowlist) is no int or dict.
        if type(x).__module__ != "builtins":
            return self.repr_instance(x, level)
        return super().repr1(x, level)

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:  # past 4300 digits repr() raises; long before, it is noise
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_instance(self, x: Any, level: int) -> str:
        for base, method in (
            (dict, self.repr_dict),
            (list, self.repr_list),
            (tuple, self.repr_tuple),
            (set, self.repr_set),
            (frozenset, self.repr_frozenset),
        ):
            if isinstance(x, base):
                return f"{type(x).__name__}({method(x, level)})"
        if isinstance(x, int) and not isinstance(x, bool):
            return self.repr_int(x, level)
        if isinstance(x, (str, bytes)):
            return self.repr_str(x[: self.maxstring + 1], level)  # type: ignore[arg-type]
        try:
            text = super().repr_instance(x, level)
        except (ValueError, RecursionError):
            return f"<{type(x).__name__}>"
        return text


def short_repr(value: Any, limit: int = 80) -> str:
    """A repr of at most about ``limit`` characters that is safe on any unpickled value.

    Plain ``repr`` is not: shared references (``x = [x, x]`` thirty times) make it
    exponentially long, and ints past 4300 digits raise.
    """
    text = _ShortRepr(limit).repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def not_an_option(path: str) -> str:
    """``path`` as a command's argument: ``./``-prefixed where it starts with ``-``, which a
    command would read as an option (``./-x.pt`` is the same file).

    Example:
        >>> not_an_option("-x.pt"), not_an_option("runs/x.pt")
        ('./-x.pt', 'runs/x.pt')
    """
    return f"./{path}" if path.startswith("-") else path


def shell_word(text: str) -> str:
    """``text`` as one word of a suggested command, which :func:`shown` leaves as it is.

    Quoted as ``shlex.quote`` quotes it; text holding what a terminal must not be sent (a
    tab, a line break, a byte that is no UTF-8) is written ``$'...'`` instead, whose escapes
    bash, zsh and ksh read back as those characters (inside ``'...'`` they would stay
    backslashes once :func:`shown` escaped them).

    Example:
        >>> print(shell_word("my run.pt"), shell_word("run\\t1.pt"), shell_word("it's\\n"))
        'my run.pt' $'run\\x091.pt' $'it\\'s\\x0a'
    """
    if text.isprintable():
        return shlex.quote(text)
    return "$'" + "".join(map(_ansi_c, text)) + "'"


def _ansi_c(c: str) -> str:
    if c in "\\'":
        return "\\" + c
    if c.isprintable():
        return c
    code = ord(c)
    if code < 0x80 or 0xDC80 <= code <= 0xDCFF:  # a byte: one os.fsdecode kept as a surrogate
        return f"\\x{code & 0xFF:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def shell_path(path: str) -> str:
    """``path`` as one shell word in a suggested command: quoted where a shell would split or
    expand it (:func:`shell_word`), and never read as an option (:func:`not_an_option`).

    Example:
        >>> shell_path("-whole model.pt"), shell_path("model.pt")
        ("'./-whole model.pt'", 'model.pt')
    """
    return shell_word(not_an_option(path))

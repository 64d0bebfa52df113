"""Text read from a checkpoint, or quoted from another library, made safe to show.

One escaping for the whole package: a name that reaches a terminal, a table or an error
message can neither drive the terminal nor start a line of its own.
:mod:`ckpt_tools.errors` re-exports both functions, where callers import them.
"""

from __future__ import annotations

__all__ = ["quote_foreign", "shown"]


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

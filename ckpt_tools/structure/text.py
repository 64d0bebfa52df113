"""Results as text for people: sizes, counts and fixed-width tables, as plain strings.

The ``__str__`` of every result (``print(ckpt_tools.inspect(path))``) and the ``ckpt`` command
build their text with these, so the library and the command cannot drift apart. Nothing here
imports anything beyond the standard library and the package's bottom
(:func:`~ckpt_tools.errors.shown`, the one escaping of names, is re-exported): the command
may format tables with ``tabulate``, the library never does.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from typing import Any, Generic, Protocol, TypeVar

from ckpt_tools.errors import shown

__all__ = [
    "Readable",
    "TableFormat",
    "TensorsByName",
    "close_matches",
    "counts",
    "display_width",
    "human_bytes",
    "human_count",
    "more_hint",
    "shown",
    "text_table",
]

#: Formats ``rows`` under ``headers``: :func:`text_table`, or the command's tabulate table.
TableFormat = Callable[[Iterable[Sequence[Any]], Sequence[str]], str]

# Columns are at least this much wider than their header, and this far apart (as tabulate's
# "simple" format lays them out, so that both read the same).
_PADDING = 2
_GAP = "  "


#: Binary units :func:`human_bytes` steps through, each 1024 of the one before.
_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
#: Suffixes :func:`human_count` steps through, each 1000 of the one before (T: trillion).
_COUNT_SUFFIXES = ("K", "M", "B", "T")


def _scaled(n: int, base: int, units: Sequence[str], digits: int) -> tuple[str, str] | None:
    """``n`` in the first unit where it shows, rounded to ``digits`` decimals, under ``base``
    (1,048,575 B is 1.0 MiB, never 1024.0 KiB), as ``(number, unit)``; None below the first
    unit. The last unit takes every larger number."""
    if n < base:
        return None
    for i, unit in enumerate(units, start=1):
        # Rounded first, then compared: what shows is the rounded number.
        value = round(n / base**i, digits)
        if value < base or i == len(units):
            return f"{value:.{digits}f}", unit
    return None  # unreachable: the last unit returns


def human_bytes(n: int) -> str:
    """A byte count in binary units.

    Args:
        n: bytes.

    Returns:
        ``"512 B"``, ``"1.5 KiB"`` ... up to EiB; the unit is the one the rounded number
        reaches (1,048,575 B is ``"1.0 MiB"``).

    Example:
        >>> human_bytes(1536), human_bytes(1023), human_bytes(1048575)
        ('1.5 KiB', '1023 B', '1.0 MiB')
    """
    scaled = _scaled(n, 1024, _BYTE_UNITS, 1)
    return f"{n} B" if scaled is None else f"{scaled[0]} {scaled[1]}"


def human_count(n: int) -> str:
    """A count with a K, M, B (billion) or T (trillion) suffix.

    Args:
        n: a count.

    Returns:
        ``"999"``, ``"11.69M"`` ...; the suffix is the one the rounded number reaches
        (999,999 is ``"1.00M"``).

    Example:
        >>> human_count(11689512), human_count(999999)
        ('11.69M', '1.00M')
    """
    scaled = _scaled(n, 1000, _COUNT_SUFFIXES, 2)
    return str(n) if scaled is None else "".join(scaled)


def counts(mapping: Mapping[str, int]) -> str:
    """Counts by name on one line.

    Example:
        >>> counts({"float32": 3, "int64": 1})
        'float32 ×3, int64 ×1'
    """
    return ", ".join(f"{k} ×{v}" for k, v in mapping.items()) or "none"


def text_table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A fixed-width table: left-aligned columns under a header and a dashed rule.

    The layout is that of tabulate's ``simple`` format for one-line cells: each column as
    wide as its widest cell or its header plus two, columns two spaces apart, trailing spaces
    dropped. Cells are :func:`shown`: a name with a line break or an escape sequence stays
    one line of its column, and never reaches a terminal raw.

    Args:
        rows: the cells, one sequence per row (converted with ``str``).
        headers: the column names.

    Returns:
        The table, without a final newline.

    Example:
        >>> print(text_table([["w", "float32"]], ["name", "dtype"]))
        name    dtype
        ------  -------
        w       float32
    """
    # Escape, then strip: a name's trailing "\n" or "\t" shows instead of being stripped away.
    cells = [[shown(str(cell)).strip() for cell in row] for row in rows]
    widths = [
        max([display_width(header) + _PADDING, *(display_width(row[i]) for row in cells)])
        for i, header in enumerate(headers)
    ]

    def line(values: Sequence[str]) -> str:
        padded = (v + " " * (w - display_width(v)) for v, w in zip(values, widths))
        return _GAP.join(padded).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def display_width(text: str) -> int:
    """The columns ``text`` takes in a terminal: a wide (CJK) character two, a combining one
    none, so that a column of ``日本語.weight`` or ``é`` (e and an accent) stays aligned.

    Example:
        >>> display_width("w"), display_width("日本"), display_width("e\u0301")
        (1, 4, 1)
    """
    if text.isascii():  # the common case, one column per character, without a lookup each
        return len(text)
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def close_matches(name: str, names: Iterable[str], limit: int = 3) -> list[str]:
    """The names a mistyped ``name`` most likely meant, best first.

    A name that differs only by wrapper prefixes (``module.fc.weight`` for ``fc.weight``, or
    the other way round) comes first, then spelling neighbours.

    Args:
        name: the name that was not found.
        names: the names there are.
        limit: how many to return at most.

    Returns:
        Up to ``limit`` names.

    Example:
        >>> close_matches("fc.weight", ["module.fc.weight", "fc.bias", "head.weight"])
        ['module.fc.weight', 'head.weight']
    """
    if not isinstance(name, str):  # (a key asked for by another type: no close names)
        return []
    pool = list(names)
    wrapped = [n for n in pool if n.endswith("." + name) or name.endswith("." + n)]
    import difflib  # only error messages need it; `ckpt` starts faster without

    spelled = difflib.get_close_matches(name, pool, n=limit)
    return list(dict.fromkeys(wrapped + spelled))[:limit]


class Readable:
    """Mixin for results: ``str(result)`` is ``result.text()``, what the ``ckpt`` command prints."""

    def text(self) -> str:
        """The result in words; each result class says what it shows."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.text()


class _Named(Protocol):
    name: str


_T = TypeVar("_T", bound=_Named)


class TensorsByName(Generic[_T]):
    """Mixin for results holding ``tensors``: ``name in result`` asks by tensor name,
    ``len`` and iteration go over the tensors, and a result is true even when it holds none
    (a result, not only a container)."""

    tensors: tuple[_T, ...]

    @cached_property
    def _by_name(self) -> dict[str, _T]:
        return {t.name: t for t in self.tensors}

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._by_name

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[_T]:
        return iter(self.tensors)

    def __bool__(self) -> bool:
        return True


def more_hint(hidden: int, for_cli: bool, what: str = "more") -> str:
    """``... 3 more (see --json)`` for the command, ``... 3 more (see to_json())`` for Python.

    Example:
        >>> more_hint(3, for_cli=False)
        '... 3 more (see to_json())'
    """
    return f"... {hidden} {what} (see {'--json' if for_cli else 'to_json()'})"

"""The types the public signatures share: one name, one type, one meaning per option.

Every operation that takes one of these options spells it the same way and gives it the same
default (``tests/structure/test_public_api.py`` checks every name in ``ckpt_tools.__all__``):

- ``select: Select = None``: the state dict to act on, a dotted path (``"model.ema"``) or its
  parts (``("model", "ema")``); None picks it as ``ckpt inspect`` does.
- ``verify: VerifyLevel = "sizes"``: what is read back after writing.
- ``output_format: OutputFormat | None = None``: None takes it from ``dst``'s suffix (else the
  input's family); a format that contradicts the suffix is refused.
- ``progress: Progress | None = None``: told ``(done_bytes, total_bytes)`` as tensor bytes are
  written.
- ``map_location: MapLocation = "auto"``: where loaded storages go.

Nothing here imports torch: :data:`MapLocation` names ``torch.device`` as a forward reference.

The public operations check their sequence and mapping options here (:func:`items_of`,
:func:`str_mapping`): a single item where a sequence is expected is that one item (as
``select`` takes ``"model.ema"``), and a value of the wrong type is a
:class:`~ckpt_tools.errors.UsageError` naming the argument, never a Python error from deep
inside.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

from ckpt_tools.errors import UsageError

__all__ = [
    "MapLocation",
    "OutputFormat",
    "Progress",
    "Select",
    "StrPath",
    "VerifyLevel",
    "ascii_int",
    "checked_flags",
    "checked_path",
    "checked_paths",
    "count_of",
    "items_of",
    "one_of",
    "str_items",
    "str_mapping",
]

#: A path as ``open`` takes it: a string or an ``os.PathLike`` (``pathlib.Path``).
StrPath = str | os.PathLike[str]

#: A state dict's place in a checkpoint: ``"model.ema"``, ``("model", "ema")``, or None for the
#: automatic choice.
Select = str | Sequence[str] | None

#: After writing: ``"sizes"`` reads the output back (keys, dtypes, shapes, sizes), ``"full"`` also
#: compares every byte, ``"none"`` reads nothing back.
VerifyLevel = Literal["none", "sizes", "full"]

#: What to write: a torch zip (``torch.save``'s format) or a safetensors file.
OutputFormat = Literal["torch", "safetensors"]

#: ``progress(done_bytes, total_bytes)``: tensor bytes written so far, of the output's total.
Progress = Callable[[int, int], None]

#: Where loaded storages go: every form ``torch.load`` takes (a device string, a
#: ``torch.device``, a dict of saved tag -> tag, a callable ``(storage, tag) -> storage | None``,
#: None for the saved devices), plus ``"auto"``. ``torch.device`` is named, not imported: this
#: module stays torch-free.
MapLocation = Union[str, "torch.device", Mapping[str, str], Callable[[Any, str], Any], None]  # noqa: F821


_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])


def _shown(value: object) -> str:
    """``value`` as Python source, cut short: an error names it, not all of it."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def items_of(value: object, argument: str, item: type[_T], expected: str) -> tuple[_T, ...]:
    """A sequence option's items: one ``item`` alone is that one item.

    A ``str`` is an item when ``item`` is ``str``, never a sequence of characters; a
    mapping is not a sequence of its keys.

    Args:
        value: what the caller passed.
        argument: the option's name, for the error.
        item: the type every item must have.
        expected: the type in words, for the error (``"a str or a sequence of str"``).

    Returns:
        The items, in order.

    Raises:
        UsageError: ``value`` is not an ``item`` nor a sequence of them.

    Example:
        >>> items_of("optimizer", "drop", str, "a str or a sequence of str")
        ('optimizer',)
        >>> items_of(3, "drop", str, "a str or a sequence of str")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: drop=3: expected a str or a sequence of str, got int
    """
    if isinstance(value, item):
        return (value,)
    if isinstance(value, (Sequence, set, frozenset)) and not isinstance(value, (str, bytes)):
        items = tuple(value)
        wrong = [x for x in items if not isinstance(x, item)]
        if not wrong:
            return items  # type: ignore[return-value]
        got = f"a {type(value).__name__} holding {type(wrong[0]).__name__} {_shown(wrong[0])}"
    else:
        got = type(value).__name__
    raise UsageError(f"expected {expected}, got {got}", argument=argument, value=_shown(value))


def checked_path(path: object, argument: str = "path") -> str:
    """``path`` as a ``str``, refused unless it is a ``str`` or an ``os.PathLike`` of one: a
    file object, bytes or None is the caller's mistake, said so, not a ``TypeError`` from
    deep inside (the files are read by path, as ``mmap`` and ``O_DIRECT`` need).

    Raises:
        UsageError: ``path`` is no such path.

    Example:
        >>> import pathlib
        >>> checked_path(pathlib.Path("model.pt"))
        'model.pt'
        >>> checked_path(None, "src")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: src=None: expected a file path (a str or an os.PathLike), ...
    """
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if isinstance(text, str):
        return text
    got = type(path).__name__
    if hasattr(path, "read"):
        got += "; save it to a file and pass its path"
    raise UsageError(
        f"expected a file path (a str or an os.PathLike), got {got}",
        argument=argument,
        value=_shown(path),
    )


def checked_paths(value: object, argument: str) -> list[str]:
    """A paths option's items (``scan``'s ``paths``, ``average``'s ``srcs``), each
    :func:`checked_path`: one path alone is that one path.

    Example:
        >>> checked_paths("a.pt", "srcs"), checked_paths(["a.pt", "b.pt"], "srcs")
        (['a.pt'], ['a.pt', 'b.pt'])
    """
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, os.PathLike)):
        value = [value]  # (refused below, where it is no path either)
    return [checked_path(p, argument) for p in value]


def one_of(value: _T, choices: Sequence[_T], argument: str, *, flag: str | None = None,
           why: str = "") -> _T:  # fmt: skip
    """``value``, refused unless it is one of ``choices``: every option with a fixed set of
    values is checked here, so that each refusal reads the same.

    Args:
        value: what the caller passed.
        choices: the values the option takes, in the order the error lists them.
        argument: the option's name, for the error.
        flag: the command line's spelling of the option, where it has one.
        why: said after the list: what the values mean here.

    Returns:
        ``value``.

    Raises:
        UsageError: ``value`` is not one of ``choices``.

    Example:
        >>> one_of("full", ("sizes", "full", "none"), "verify")
        'full'
        >>> one_of("fast", ("sizes", "full", "none"), "verify")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: verify='fast': expected one of: sizes, full, none
    """
    if value in choices:
        return value
    listed = ", ".join(map(str, choices)) + (f" ({why})" if why else "")
    raise UsageError(f"expected one of: {listed}", argument=argument, value=repr(value), flag=flag)


def checked_flags(func: _F) -> _F:
    """``func``, refusing a value other than True or False for each of its ``bool`` options:
    ``dry_run="no"`` or ``trust="false"`` from a config file is truthy, and would write, or
    run the file's code, where the caller asked for the opposite.

    Example:
        >>> @checked_flags
        ... def save(*, dry_run: bool = False) -> bool:
        ...     return dry_run
        >>> save(dry_run=True)
        True
        >>> save(dry_run="no")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: dry_run='no': expected True or False, got str
    """
    import functools
    import inspect

    signature = inspect.signature(func)
    # name -> whether None is one of its values (``bool | None``: "not said")
    flags = {
        p.name: p.annotation != "bool"
        for p in signature.parameters.values()
        if p.annotation in ("bool", bool, "bool | None")
    }

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            given = signature.bind_partial(*args, **kwargs).arguments if args else kwargs
        except TypeError:
            return func(*args, **kwargs)  # (Python's own error for a wrong call)
        for name, none in flags.items():
            value = given.get(name, False)
            if not (_is_bool(value) or (none and value is None)):
                expected = "True, False or None" if none else "True or False"
                raise UsageError(
                    f"expected {expected}, got {type(value).__name__}",
                    argument=name,
                    value=_shown(value),
                )
        return func(*args, **kwargs)

    return checked  # type: ignore[return-value]


def _is_bool(value: object) -> bool:
    """True or False, Python's or numpy's (``numpy.bool``, which a mask's ``.any()`` gives)."""
    kind = type(value)
    return kind is bool or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def ascii_int(text: str) -> int | None:
    """The number ``text`` spells in ASCII digits, else None: ``str.isdigit`` also takes
    ``"²"``, which ``int`` refuses, and ``"٣"``, which it reads as 3.

    Example:
        >>> ascii_int("12"), ascii_int("²"), ascii_int("-1")
        (12, None, None)
    """
    return int(text) if text.isascii() and text.isdigit() else None


def count_of(value: object, argument: str, *, flag: str | None = None) -> int:
    """A count option (``jobs``, ``last``): an int of 1 or more; a bool, a float or a str is
    refused as the caller's error, not met later as a ``TypeError``.

    Example:
        >>> count_of(2, "jobs")
        2
        >>> count_of("2", "jobs")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: jobs='2': expected a count of 1 or more (an int)
    """
    import operator  # (an int, or numpy's: what operator.index takes)

    try:
        count = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = None
    if count is None or count < 1:
        from ckpt_tools.errors import UsageError

        raise UsageError(
            "expected a count of 1 or more (an int)",
            argument=argument,
            value=repr(value),
            flag=flag,
        )
    return count


def str_items(value: object, argument: str) -> tuple[str, ...]:
    """A ``Sequence[str]`` option's items (``drop``, ``allow_globals``): one str is one item.

    Example:
        >>> str_items("optimizer", "drop"), str_items(["a", "b"], "drop")
        (('optimizer',), ('a', 'b'))
    """
    return items_of(value, argument, str, "a str or a sequence of str")


def str_mapping(value: object, argument: str, expected: str) -> dict[str, str]:
    """A ``str -> str`` mapping option, checked.

    Args:
        value: what the caller passed.
        argument: the option's name, for the error.
        expected: the mapping in words, for the error (``"a dict of saved tag -> new tag"``).

    Returns:
        A plain dict of it, in order.

    Raises:
        UsageError: ``value`` is not a mapping of strings to strings.

    Example:
        >>> str_mapping({"cuda:1": "cpu"}, "mapping", "a dict of saved tag -> new tag")
        {'cuda:1': 'cpu'}
    """
    if isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        return dict(value)
    got = type(value).__name__
    if isinstance(value, Mapping):
        got = f"a {got} with a key or value that is not a str"
    raise UsageError(f"expected {expected}, got {got}", argument=argument, value=_shown(value))

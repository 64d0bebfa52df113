"""``ckpt strip-module`` and ``ckpt add-module`` parsed without click (issue 13's lean start).

A key rewrite of a large file takes little more than a copy, so start-up shows: importing
click costs about as long as Python's own start. The common command line (two paths, then
the rewrite options in their plain spellings) is parsed here, from a table that
``tests/cli/test_fastpath.py`` holds equal to the click commands' own parameters; the same
functions then do the work (:mod:`ckpt_tools.cli.commands.rewrite_actions`) behind the same boundary
(:func:`~ckpt_tools.cli.boundary.guarded`).

Anything else goes to click, which parses and reports it as always: ``--help``, an option
this table does not know, a value that is not one of its choices, a value that starts with
``-``, ``--``, a wrong number of paths, a path that exists but this user cannot read
(``click.Path`` refuses it), shell completion (``_CKPT_COMPLETE``), and any line on Windows
(where click expands wildcards).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckpt_tools.io.verify.levels import VERIFY_LEVELS

__all__ = ["COMMANDS", "OPTIONS", "parse", "run"]

# An option's kind: a flag stores its bool; VALUE and MULTIPLE take the next argument (or
# the text after "="), MULTIPLE collecting them in a tuple; a tuple of strings is a choice.
VALUE, MULTIPLE = "value", "multiple"

# Option string -> (parameter, kind): the options of rewrite_cmd's `_common` and `--prefix`.
OPTIONS: dict[str, tuple[str, bool | str | tuple[str, ...]]] = {
    "--select": ("select", VALUE),
    "--force": ("force", True),
    "--in-place": ("in_place", True),
    "--verify": ("verify", VERIFY_LEVELS),
    "--fsync": ("durable", True),
    "--no-fsync": ("durable", False),
    "--allow-global": ("allow_globals", MULTIPLE),
    "--quiet": ("quiet", True),
    "-q": ("quiet", True),
    "--json": ("as_json", True),
    "--dry-run": ("dry_run", True),
    "--prefix": ("prefix", VALUE),
}

_DEFAULTS = {
    "select": None,
    "force": False,
    "in_place": False,
    "verify": "sizes",
    "durable": True,
    "allow_globals": (),
    "quiet": False,
    "as_json": False,
    "dry_run": False,
}

# Command -> its parameters' defaults (the two paths aside).
COMMANDS: dict[str, dict[str, object]] = {
    "strip-module": {**_DEFAULTS, "prefix": None},
    "add-module": {**_DEFAULTS, "prefix": "module."},
}


def parse(argv: Sequence[str]) -> tuple[str, dict[str, object]] | None:
    """The command and the parameters click would pass it, or None to leave it to click.

    Args:
        argv: the command line after ``ckpt``.

    Returns:
        ``(command, params)`` with ``params`` as click's callback receives them (``src``,
        ``dst`` and every option), or None where click must parse (see the module's text).

    Example:
        >>> name, params = parse(["strip-module", "a.pt", "b.pt", "--no-fsync"])
        >>> name, params["src"], params["dst"], params["durable"], params["prefix"]
        ('strip-module', 'a.pt', 'b.pt', False, None)
        >>> parse(["strip-module", "a.pt", "b.pt", "--help"]) is None
        True
    """
    if not argv or argv[0] not in COMMANDS or "_CKPT_COMPLETE" in os.environ:
        return None
    if os.name == "nt":
        return None  # click expands wildcards in Windows command lines; this does not
    params = dict(COMMANDS[argv[0]])
    paths: list[str] = []
    collected: dict[str, list[str]] = {}
    rest = iter(argv[1:])
    for arg in rest:
        if not arg.startswith("-"):
            paths.append(arg)
            continue
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name not in OPTIONS:
            return None
        param, kind = OPTIONS[name]
        if isinstance(kind, bool):
            if eq:
                return None  # "--force=1": click says a flag takes no value
            params[param] = kind
            continue
        if not eq:
            following = next(rest, None)
            if following is None or following.startswith("-"):
                return None  # click decides what a value that looks like an option means
            value = following
        if isinstance(kind, tuple) and value not in kind:
            return None  # click names the choices
        if kind == MULTIPLE:
            collected.setdefault(param, []).append(value)
        else:
            params[param] = value
    if len(paths) != 2 or any(_unreadable(p) for p in paths):
        return None
    params.update((param, tuple(values)) for param, values in collected.items())
    params["src"], params["dst"] = paths
    return argv[0], params


def _unreadable(path: str) -> bool:
    """An existing path this user cannot read: ``click.Path()`` (readable) refuses it."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return not os.access(path, os.R_OK)


def run(argv: Sequence[str]) -> int | None:
    """Run ``ckpt ARGV`` without click when :func:`parse` takes it; None otherwise.

    Args:
        argv: the command line after ``ckpt``.

    Returns:
        The exit status, as click's way would end (see
        :func:`ckpt_tools.cli.main.run_command`), or None: the caller runs click.
    """
    parsed = parse(argv)
    if parsed is None:
        return None
    from ckpt_tools.cli.boundary import echo, guarded
    from ckpt_tools.cli.commands.rewrite_actions import add_module, strip_module

    name, params = parsed
    action = strip_module if name == "strip-module" else add_module
    try:
        return guarded(lambda: action(**params), "ckpt")  # type: ignore[arg-type]
    except (KeyboardInterrupt, EOFError):
        # click ends the line the terminal echoed ("^C"), then run_command says "aborted".
        echo("", err=True)
        echo("ckpt: aborted", err=True)
        return 130

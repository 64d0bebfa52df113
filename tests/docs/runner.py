"""How a documentation example runs, and what it must give.

Shell blocks (``bash``, ``sh``, ``console``): each command line runs in the example's folder.

- ``ckpt ...`` runs in this process through the real command-line boundary (fast), with
  ``NAME=value`` prefixes as environment variables, unquoted globs expanded as a shell does,
  and one ``> FILE`` redirection; a shell-completion request (``_CKPT_COMPLETE=...``) runs
  the installed console script, since click answers it by exiting.
- ``make TARGET`` and ``pip install ...`` are the set-up steps: they are checked, not run (the
  target is in the Makefile; each extra named is in setup.cfg). CI runs the set-up itself.
- Anything else runs under ``bash -c`` with the venv's ``bin`` first on ``PATH``.

A command must exit 0, or the code its comment starts with (``# exit 1: values differ``). In a
``console`` block, ``$ `` starts a command and the lines after it are its output: each must
appear in what the command printed, in order, with runs of spaces taken as one and ``...``
standing for any text.

Python blocks run with ``exec`` in a fresh namespace, the example's folder as the working
folder and first on ``sys.path``.
"""

from __future__ import annotations

import configparser
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.docs.blocks import Block
from tests.helpers import ROOT, run_ckpt

_EXIT = re.compile(r"^#\s*exit (\d+)\b")
_SHELL_SYNTAX = re.compile(r"[|;&`<]|\$\(|>>")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Command:
    """One command line of a shell block, with the exit code and output it must give."""

    line: int
    text: str
    code: int = 0
    output: list[str] = field(default_factory=list)


class ExampleFailed(AssertionError):
    """An example did not do what its page shows."""


def commands(block: Block) -> list[Command]:
    """The command lines of a shell block (comments, blank lines and continuations handled)."""
    found: list[Command] = []
    pending = ""
    console = block.lang == "console"
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        line = block.line + offset
        if console and not pending and not raw.startswith("$ "):
            if found and raw.strip():
                found[-1].output.append(raw)
            continue
        text = raw[2:] if console and not pending else raw.lstrip() if pending else raw
        if not pending and (not text.strip() or text.lstrip().startswith("#")):
            continue
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1].rstrip() + " "
            continue
        command, comment = split_comment(pending + text)
        pending = ""
        exit_code = _EXIT.match(comment)
        found.append(Command(line, command.strip(), int(exit_code[1]) if exit_code else 0))
    return found


def split_comment(line: str) -> tuple[str, str]:
    """``line`` cut at its first ``#`` that starts a shell comment (outside quotes)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def run_shell(block: Block, folder: Path) -> None:
    """Run every command of ``block`` in ``folder`` (the working folder already)."""
    for command in commands(block):
        code, printed = run_command(command.text, folder)
        where = f"{block.page}:{command.line}: `{command.text}`"
        if code != command.code:
            raise ExampleFailed(f"{where} exited {code}, expected {command.code}:\n{printed}")
        missing = unmatched(command.output, printed)
        if missing:
            raise ExampleFailed(f"{where}: shown output not printed: {missing!r}\n{printed}")


def run_command(text: str, folder: Path) -> tuple[int, str]:
    """Exit code and output (stdout, then stderr) of one command line."""
    if _SHELL_SYNTAX.search(text):
        return _bash(text, folder)
    words = shlex.split(text)
    env: dict[str, str] = {}
    while words and _ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    program = words[0] if words else ""
    if program == "ckpt":
        return _ckpt(words[1:], env, folder)
    if program == "make":
        return _make(words[1:])
    if program in ("pip", "pip3"):
        return _pip(words[1:])
    return _bash(text, folder)


def run_python(block: Block, folder: Path) -> None:
    """``exec`` a Python block with ``folder`` as working folder and first on sys.path."""
    code = compile(block.text, block.id, "exec")
    before = set(sys.modules)
    sys.path.insert(0, str(folder))
    try:
        exec(code, {"__name__": "__main__"})
    finally:
        sys.path.remove(str(folder))
        # Modules of the example's folder (mynet.py) must not leak into the next example.
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if origin.startswith(str(folder)):
                del sys.modules[name]


def unmatched(expected: list[str], printed: str) -> list[str]:
    """The expected lines not found, in order, among the printed ones."""
    lines = [_squeeze(line) for line in printed.splitlines()]
    missing: list[str] = []
    at = 0
    for want in expected:
        pattern = re.compile(".*".join(re.escape(part) for part in _squeeze(want).split("...")))
        hit = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        if hit is None:
            missing.append(want)
        else:
            at = hit + 1
    return missing


def _squeeze(line: str) -> str:
    return " ".join(line.split())


def _ckpt(args: list[str], env: dict[str, str], folder: Path) -> tuple[int, str]:
    target = None
    if ">" in args:
        at = args.index(">")
        target, args = args[at + 1], args[:at] + args[at + 2 :]
    expanded: list[str] = []
    for arg in args:
        matches = sorted(glob.glob(arg)) if any(c in arg for c in "*?[") else []
        expanded.extend(matches or [arg])
    if "_CKPT_COMPLETE" in env:
        # Completion answers and exits inside click, as the shell's child process does.
        result = run_ckpt(*expanded, code=None, env=env, how="script", cwd=folder)
    else:
        result = run_ckpt(*expanded, code=None, env=env)
    if target is not None:
        (folder / target).write_text(result.stdout)
        return result.returncode, result.stderr
    return result.returncode, result.stdout + result.stderr


def _bash(text: str, folder: Path) -> tuple[int, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.pop("CKPT_DEBUG", None)
    proc = subprocess.run(
        ["bash", "-c", text], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, proc.stdout + proc.stderr


def _make(args: list[str]) -> tuple[int, str]:
    """Set-up: each target named must be a rule of the Makefile."""
    makefile = (ROOT / "Makefile").read_text()
    targets = [a for a in args if not a.startswith("-") and "=" not in a]
    missing = [t for t in targets if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
    return (2, f"no rule for {missing} in the Makefile") if missing or not targets else (0, "")


def _pip(args: list[str]) -> tuple[int, str]:
    """Set-up: ``pip install NAME[EXTRAS]`` names this package and extras it declares."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    declared = set(config["options.extras_require"])
    if args[:1] != ["install"]:
        return 2, f"only `pip install` is checked, not {args}"
    problems = []
    words = iter(args[1:])
    for arg in words:
        if arg in ("-c", "--constraint", "-r", "--requirement"):
            next(words, None)  # a file of pins, not a package
            continue
        if arg.startswith("-"):
            continue
        name, _, extras = arg.partition("[")
        if name not in ("ckpt_tools", "ckpt-tools", "."):
            problems.append(f"{arg}: not this package")
        wanted = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
        problems += [f"{arg}: no extra {e!r} in setup.cfg" for e in sorted(wanted - declared)]
    return (2, "; ".join(problems)) if problems else (0, "")

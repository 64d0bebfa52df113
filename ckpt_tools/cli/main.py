"""The ``ckpt`` click group: its command table, loaded lazily, and click's side of the boundary.

``ckpt --version`` and ``ckpt --help`` import click, this module and the boundary only: each
command's module, the error tree and the readers load when a command runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from gettext import gettext
from typing import NamedTuple, NoReturn

import click

from ckpt_tools._version import __version__
from ckpt_tools.cli.boundary import guarded


class _Entry(NamedTuple):
    module: str
    attribute: str
    summary: str  # the command's first help paragraph (tests/cli/test_entry.py compares them)


_COMMANDS = {
    # Each command's module is imported on use, so `ckpt inspect` never imports torch and
    # `ckpt --help` imports none of them: it lists the summaries written here.
    "inspect": _Entry(
        "ckpt_tools.cli.commands.inspect",
        "inspect_cmd",
        "Describe a checkpoint from its structure: never runs its pickle, never imports torch.",
    ),
    "scan": _Entry(
        "ckpt_tools.cli.commands.scan",
        "scan_cmd",
        "Can loading these checkpoints run code? A verdict per file, running nothing in it.",
    ),
    "strip-module": _Entry(
        "ckpt_tools.cli.commands.rewrite",
        "strip_module_cmd",
        "Strip wrapper prefixes (DataParallel/DDP 'module.', torch.compile '_orig_mod.', ...).",
    ),
    "add-module": _Entry(
        "ckpt_tools.cli.commands.rewrite",
        "add_module_cmd",
        "Add a wrapper prefix to every key (to load into nn.DataParallel / DDP).",
    ),
    "rename": _Entry(
        "ckpt_tools.cli.commands.rewrite",
        "rename_cmd",
        "Rename keys: prefix maps (--sub) and regex substitutions (--regex), in the order given.",
    ),
    "convert": _Entry(
        "ckpt_tools.cli.commands.rewrite",
        "convert_cmd",
        "Convert between torch (.pt), safetensors and Hugging Face sharded folders.",
    ),
    "consolidate": _Entry(
        "ckpt_tools.cli.commands.consolidate",
        "consolidate_cmd",
        "Consolidate a DCP folder or a DeepSpeed ZeRO checkpoint into OUT, torch-free.",
    ),
    "merge-lora": _Entry(
        "ckpt_tools.cli.commands.merge",
        "merge_lora_cmd",
        "Merge a PEFT LoRA adapter folder into its base checkpoint, as PEFT merges, torch-free.",
    ),
    "retag": _Entry(
        "ckpt_tools.cli.commands.rewrite",
        "retag_cmd",
        "Rewrite saved device tags (cuda:1 -> cpu) so plain torch.load works anywhere.",
    ),
    "reshard": _Entry(
        "ckpt_tools.cli.commands.rewrite",
        "reshard_cmd",
        "Rewrite a Hugging Face sharded folder with another shard size (SRC is never touched).",
    ),
    "sanitize": _Entry(
        "ckpt_tools.cli.commands.sanitize",
        "sanitize_cmd",
        "Write SRC as DST that plain torch.load(weights_only=True) loads.",
    ),
    "slim": _Entry(
        "ckpt_tools.cli.commands.transform",
        "slim_cmd",
        "Make a checkpoint smaller: cast, drop entries, keep the (EMA) weights only.",
    ),
    "extract": _Entry(
        "ckpt_tools.cli.commands.transform",
        "extract_cmd",
        "The tensors under one prefix, as a plain state dict.",
    ),
    "average": _Entry(
        "ckpt_tools.cli.commands.transform",
        "average_cmd",
        "Element-wise (weighted) mean of checkpoints, streamed in float64.",
    ),
    "diff": _Entry(
        "ckpt_tools.cli.commands.diff",
        "diff_cmd",
        "Compare two checkpoints (or a checkpoint and a model): keys, shapes, dtypes, values.",
    ),
    "devices": _Entry(
        "ckpt_tools.cli.commands.devices",
        "devices_cmd",
        "List the CPU and the visible GPUs (freest first), with total and free memory.",
    ),
    "harness": _Entry(
        "ckpt_tools.cli.commands.harness",
        "harness",
        "Train small models single/dp/ddp/manual/fsdp/zero and check checkpoint parity.",
    ),
}


class LazyGroup(click.Group):
    """Imports each command's module only when that command runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        import importlib.util

        return [
            name
            for name, entry in _COMMANDS.items()
            if importlib.util.find_spec(entry.module) is not None
        ]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        import importlib

        entry = _COMMANDS[cmd_name]
        _warnings_to_stderr()
        try:
            command = getattr(importlib.import_module(entry.module), entry.attribute)
        except ModuleNotFoundError as e:
            # Only the command's own module missing means no such command. Anything it imports
            # that is missing (torch on the way to a torch-free command) must not pass for one.
            if e.name != entry.module:
                raise
            return None
        return _with_examples(command, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The ``Commands:`` section of ``ckpt --help``, from the table's summaries.

        click's own listing imports every command to read its help; a stand-in carrying the
        same first paragraph is shortened by click exactly as the command would be, and
        ``ckpt --help`` (a new user's first command) imports none of them.
        """
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = [
            (name, click.Command(name, help=_COMMANDS[name].summary).get_short_help_str(limit))
            for name in names
        ]
        with formatter.section(gettext("Commands")):  # click's heading, translated as it is
            formatter.write_dl(rows)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """``ckpt --help`` ends with examples too; read from the table only when help is shown."""
        from ckpt_tools.cli.examples import epilog

        self.epilog = epilog("")
        super().format_epilog(ctx, formatter)


def _warnings_to_stderr() -> None:
    """Print the library's warnings (its logger's, which has no handler of its own) to
    stderr, as lines of their own; once per process."""
    import logging

    from ckpt_tools.formats.log import logger

    class Stderr(logging.StreamHandler):  # type: ignore[type-arg]
        # The stderr of when a record is written (a test, or a caller, may have swapped it).
        stream = property(lambda self: sys.stderr, lambda self, value: None)  # type: ignore[assignment]

        def emit(self, record: logging.LogRecord) -> None:
            # Logging configured (a --model module's basicConfig) prints it: once, as before.
            if not logging.getLogger().handlers:
                super().emit(record)

    if not any(type(h).__name__ == "Stderr" for h in logger.handlers):
        handler = Stderr()
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)


def _with_examples(command: click.Command, path: str) -> click.Command:
    """Give ``command`` (and a group's subcommands) the examples of the one table.

    Every example lives in :mod:`ckpt_tools.cli.examples`, where a test runs each of them;
    a command gets its own as its help's epilog when it is loaded.
    """
    from ckpt_tools.cli.examples import epilog

    command.epilog = epilog(path)
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            _with_examples(sub, f"{path} {name}")
    return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckpt")
def cli() -> None:
    """Inspect, rewrite, convert, diff and load PyTorch checkpoints, safely, on any device.

    Set CKPT_DEBUG=1 to see tracebacks.
    """


# click 8.2+ raises this for a group called without a command; 8.1 printed the help to
# stdout and exited 0 itself (an Exit above), so there is nothing to catch there.
_NO_ARGS_IS_HELP: type[Exception] | tuple[()] = getattr(click.exceptions, "NoArgsIsHelpError", ())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckpt`` through click, behind :func:`~ckpt_tools.cli.boundary.guarded`."""
    return run_command(cli, argv, prog_name="ckpt")


def run_command(command: click.Command, argv: Sequence[str] | None, *, prog_name: str) -> int:
    """Run a click command behind the one boundary that turns errors into exit codes.

    ``ckpt`` runs through it, and so does ``python -m ckpt_tools.harness`` (the process
    entry ``torchrun`` starts), so both print the same lines and exit with the same codes.

    Args:
        command: the click command or group.
        argv: its arguments without the program name; ``sys.argv[1:]`` by default.
        prog_name: the name usage lines and error lines show.

    Returns:
        The exit status: 0, the command's own code, or the error's exit code.
    """

    def invoke() -> object:
        try:
            return command.main(
                args=list(argv) if argv is not None else None,
                prog_name=prog_name,
                standalone_mode=False,
            )
        except click.exceptions.Exit as e:
            return e.exit_code
        except _NO_ARGS_IS_HELP as e:
            # A group called without its command: its help, as click prints it (stderr,
            # exit 2), not squeezed into an error line.
            e.show()
            return e.exit_code
        except click.UsageError as e:
            from ckpt_tools.errors import EXIT_USAGE  # the error tree, on an error only

            # One line, as every other error (click's own is four, the usage among them).
            where = e.ctx.command_path if e.ctx is not None else prog_name
            message = " ".join(e.format_message().split())
            click.echo(f"{prog_name}: error: {message.rstrip('.')}; see '{where} --help'", err=True)
            return EXIT_USAGE
        except click.ClickException as e:
            e.show()
            return e.exit_code
        except click.exceptions.Abort:
            click.echo(f"{prog_name}: aborted", err=True)
            return 130

    return guarded(invoke, prog_name)


# Set by a command whose process must leave without the interpreter's own exit (leave()).
_LEAVE_AT_EXIT: list[bool] = []


def leave_at_exit() -> None:
    """Ask the process entry to end this process by :func:`leave` once the command is done.

    A torchrun rank ran gloo's (and DeepSpeed's) threads: the interpreter's own exit can
    abort on them (std::terminate, even after destroy_process_group), and torchrun would
    report SIGABRT instead of the rank's status, its error line printed or not.
    """
    _LEAVE_AT_EXIT.append(True)


def leave(status: int) -> NoReturn:
    """End the process with ``status`` at once, its standard streams flushed first."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None where it was closed before the start (>&-)
            with contextlib.suppress(OSError, ValueError):  # a pipe closed since
                stream.flush()
    os._exit(status)


def run() -> None:
    """Console-script entry: exit with :func:`main`'s code (by :func:`leave` where the
    command asked for it)."""
    status = main()
    if _LEAVE_AT_EXIT:
        leave(status)
    sys.exit(status)


if __name__ == "__main__":
    run()

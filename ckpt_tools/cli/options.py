"""Options shared by several commands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ckpt_tools.io.verify.levels import VERIFY_LEVELS

select_option = click.option(
    "--select",
    metavar="A.B",
    default=None,
    help="Dotted path to the state dict inside the checkpoint (default: chosen automatically).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")


def option_group(*options: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """One decorator that applies ``options`` (click options, arguments) in their order.

    Example:
        >>> writing = option_group(select_option, json_option)
        >>> @click.command()
        ... @writing
        ... def cmd(select, as_json):
        ...     pass
        >>> [p.name for p in cmd.params]
        ['select', 'as_json']
    """

    def apply(func: Any) -> Any:
        # The decorator nearest the function is applied first: reversed keeps --help's order.
        for option in reversed(options):
            func = option(func)
        return func

    return apply


def output_format_option(output: str):  # type: ignore[no-untyped-def]
    """``--format torch|safetensors`` as ``output_format``; ``output`` names the output."""
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(["torch", "safetensors"]),
        default=None,
        help=f"Output format (default: from {output}'s suffix).",
    )


def dry_run_option(func):  # type: ignore[no-untyped-def]
    """``--dry-run`` for every command that writes: one line to add it to a new command."""
    return click.option(
        "--dry-run",
        is_flag=True,
        help="Print the plan (keys, dtypes, sizes, what is kept and dropped); write nothing.",
    )(func)


def verify_option(help: str, levels: tuple[str, ...] = VERIFY_LEVELS):  # type: ignore[no-untyped-def]
    """``--verify LEVEL`` (default ``sizes``) for a command that writes; ``help`` says what."""
    return click.option(
        "--verify", type=click.Choice(levels), default="sizes", show_default=True, help=help
    )


allow_global_option = click.option(
    "--allow-global",
    "allow_globals",
    multiple=True,
    metavar="QUALNAME",
    help="Carry this global outside the allowlist through unchanged (never imported).",
)

# safetensors holds tensors only: every command that may write it refuses other entries
# unless told to leave them out.
drop_extras_option = click.option(
    "--drop-extras",
    is_flag=True,
    help="A .safetensors output leaves out non-tensor entries (an epoch, a step) instead of "
    "refusing them.",
)

durable_option = click.option(
    "--fsync/--no-fsync",
    "durable",
    default=True,
    show_default=True,
    help="fsync the output before naming it. --no-fsync skips it, as cp does: faster where "
    "syncing is slow, but a power loss soon after may leave the output incomplete.",
)


def max_shard_size_option(what: str, *, required: bool = False):  # type: ignore[no-untyped-def]
    """``--max-shard-size SIZE``, spelled and parsed alike by every command that shards;
    ``what`` says what the size does there."""
    # No explicit default (None when not given): click 8.5 takes default=None for a value
    # given, and would never say a required option is missing.
    return click.option(
        "--max-shard-size",
        required=required,
        metavar="SIZE",
        help=f"{what} SIZE: 5GB (5*10^9 bytes, as huggingface_hub), 2GiB, or bytes.",
    )


jobs_option = click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Hugging Face shards written at once (threads).",
)


def cast_dtype_option(what: str):  # type: ignore[no-untyped-def]
    """``--dtype DTYPE``: a float dtype in any spelling ``slim`` takes, checked by the library
    (so Python callers and the command line accept the same words); ``what`` is cast."""
    return click.option(
        "--dtype",
        default=None,
        metavar="DTYPE",
        help=f"Cast {what} floating tensors (bitwise as torch's .to): bf16/bfloat16, "
        "fp16/float16/half, fp32/float32/float.",
    )

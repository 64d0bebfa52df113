"""The examples that end each command's ``--help``: one table, attached when a command loads.

Kept apart from the commands so that every example lives in one place, where
``tests/cli/test_examples.py`` runs each of them against real files (the names are those of a
reader's own folder: ``model.pt``, ``ddp.pt``, ``last.ckpt``, ``step-1000/``). This module
imports nothing: ``ckpt --help`` reads it without loading any command.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["EXAMPLES", "Example", "epilog"]

# Help is read in 80 columns; click indents the epilog by 2, the examples add 2.
_COLUMNS = 78
_INDENT = 4


class Example(NamedTuple):
    """One command line and what it shows.

    Attributes:
        line: the command line, as typed in a shell (no pipes, no redirections).
        note: what it does, in a few words (printed after ``#``).
        code: the exit code it ends with on the example files (``scan`` of an unsafe file: 1).
    """

    line: str
    note: str
    code: int = 0


#: Command path (``"strip-module"``, ``"harness parity"``; ``""`` for ``ckpt`` itself) ->
#: its examples, shown in this order at the end of its ``--help``.
EXAMPLES: dict[str, tuple[Example, ...]] = {
    "": (
        Example("ckpt inspect model.pt", "what is inside, without running its pickle"),
        Example("ckpt strip-module ddp.pt model-bare.pt", "DataParallel/DDP keys, made plain"),
        Example("ckpt diff ddp.pt model.pt --align", "the same weights under a wrapper?"),
    ),
    "inspect": (
        Example("ckpt inspect model.pt", "tensors, dtypes, sizes, wrapper prefixes"),
        Example("ckpt inspect last.ckpt --group", "a Lightning checkpoint, layers folded"),
        Example("ckpt inspect model-hf --json", "a Hugging Face sharded folder, for scripts"),
    ),
    "scan": (
        Example("ckpt scan model.pt run/", "a verdict per file, folders searched by content"),
        Example("ckpt scan evil.pt", "exit 1: loading it would run code", code=1),
        Example("ckpt scan --format sarif model.pt run/", "SARIF 2.1.0 for code scanning"),
    ),
    "strip-module": (
        Example("ckpt strip-module ddp.pt model-bare.pt", "DataParallel/DDP 'module.'"),
        Example("ckpt strip-module compiled.pt eager.pt", "torch.compile's '_orig_mod.'"),
        Example(
            "ckpt strip-module last.ckpt bare.ckpt --prefix model.",
            "exactly this prefix (Lightning)",
        ),
    ),
    "add-module": (
        Example("ckpt add-module model.pt for-ddp.pt", "'module.' keys for nn.DataParallel/DDP"),
        Example(
            "ckpt add-module model.pt for-compiled.pt --prefix _orig_mod.",
            "for a torch.compile'd model",
        ),
    ),
    "rename": (
        Example("ckpt rename model.pt renamed.pt --sub layers.=blocks.", "a prefix map"),
        Example(
            r"ckpt rename model.pt renamed.pt --regex 'layers\.(\d+)\.=block\1.' --dry-run",
            "a regex; show the new keys, write nothing",
        ),
    ),
    "convert": (
        Example("ckpt convert model.pt model-out.safetensors", "torch to safetensors"),
        Example("ckpt convert model.safetensors model-out.pt", "safetensors to torch"),
        Example(
            "ckpt convert model.pt hf-model/ --max-shard-size 2GB",
            "a Hugging Face sharded folder",
        ),
    ),
    "consolidate": (
        Example("ckpt consolidate step-1000/ model-out.safetensors", "the model, one file"),
        Example("ckpt consolidate step-1000/ full.pt --all", "model, optimizer and the rest"),
        Example(
            "ckpt consolidate step-1000/ hf-model/ --max-shard-size 2GB --dry-run",
            "the plan only",
        ),
    ),
    "retag": (
        Example("ckpt retag gpu.pt cpu.pt --map cuda:1=cpu", "saved on GPU 1, loads anywhere"),
        Example("ckpt retag ddp.pt ddp-cpu.pt --map cuda:0=cpu --dry-run", "what would change"),
    ),
    "reshard": (
        Example("ckpt reshard model-hf/ model-hf-2gb/ --max-shard-size 2GB", "fewer shards"),
        Example(
            "ckpt reshard model-hf/ small-shards/ --max-shard-size 4KiB --jobs 4",
            "more, smaller shards, four at once",
        ),
    ),
    "sanitize": (
        Example("ckpt sanitize whole_model.pt plain.pt", "a pickled model: its state dict"),
        Example("ckpt sanitize old.pt plain.pt --json", "every conversion and drop, by path"),
        Example("ckpt sanitize best.pt best-plain.pt --dry-run", "what it would do; no write"),
    ),
    "slim": (
        Example(
            "ckpt slim trainer.pt weights.safetensors --dtype bf16 --weights-only",
            "bf16 weights, no optimizer",
        ),
        Example(
            "ckpt slim last.ckpt small.ckpt --drop optimizer_states,lr_schedulers",
            "leave entries out",
        ),
        Example("ckpt slim timm.pth ema.pt --ema --weights-only --dry-run", "the EMA copy alone"),
    ),
    "extract": (
        Example(
            "ckpt extract model.pt layers.pt --prefix layers. --strip-prefix",
            "one submodule's weights",
        ),
        Example("ckpt extract timm.pth head.safetensors --prefix head. --ema", "from the EMA"),
    ),
    "merge-lora": (
        Example("ckpt merge-lora model.pt lora merged.pt", "W += B @ A * scaling, as PEFT"),
        Example(
            "ckpt merge-lora model-hf lora merged.safetensors --dtype bf16",
            "an HF folder, cast after merging",
        ),
        Example("ckpt merge-lora ddp.pt lora merged.pt --dry-run", "each module's rank, scaling"),
    ),
    "average": (
        Example("ckpt average 'run/ckpt_*.pt' avg.pt --last 5", "the last five of a run"),
        Example("ckpt average a.pt b.pt soup.pt --weights 1,3", "a weighted mean (OUT last)"),
    ),
    "diff": (
        Example("ckpt diff a.pt b.pt", "keys, shapes, dtypes and values"),
        Example("ckpt diff ddp.pt model.pt --align --fail-on any", "exit 1 on any difference"),
        Example(
            "ckpt diff model.pt --model mynet.py:build_model --model-arg num_classes=3",
            "against a freshly built model",
        ),
    ),
    "devices": (
        Example("ckpt devices", "the CPU and every visible GPU, freest first"),
        Example("ckpt devices --json", "the same, for scripts"),
    ),
    "harness": (
        Example("ckpt harness parity --strategies single,manual --steps 3", "parity checks"),
        Example("ckpt harness train --strategy manual --out runs/manual", "train and save"),
    ),
    "harness train": (
        Example("ckpt harness train --strategy single --steps 3 --out runs/single", "one device"),
        Example(
            "ckpt harness train --strategy manual --world-size 2 --device cpu --json",
            "two replicas on the CPU",
        ),
    ),
    "harness parity": (
        Example(
            "ckpt harness parity --strategies single,manual --steps 3 --plot parity.png",
            "with the weight-gap plot",
        ),
        Example("ckpt harness parity --arch lenet --strategies single,dp --json", "as JSON"),
    ),
}


def epilog(path: str) -> str | None:
    r"""The ``Examples:`` section of one command's help, or None when it has none.

    The block starts with click's ``\b`` marker, so that click prints its lines as written
    instead of rewrapping them into one paragraph. The notes line up after ``#`` where every
    line fits in 80 columns; otherwise each note is a comment line above its command.

    Args:
        path: the command's path under ``ckpt`` (``"diff"``, ``"harness parity"``).

    Returns:
        The text for the command's ``epilog``.

    Example:
        >>> epilog("devices").splitlines()[:2]  # click's no-rewrap marker, the heading
        ['\x08', 'Examples:']
        >>> print("\n".join(epilog("devices").splitlines()[2:]))
          ckpt devices         # the CPU and every visible GPU, freest first
          ckpt devices --json  # the same, for scripts
    """
    examples = EXAMPLES.get(path)
    if not examples:
        return None
    width = max(len(e.line) for e in examples)
    if _INDENT + width + 4 + max(len(e.note) for e in examples) <= _COLUMNS:
        lines = [f"  {e.line:<{width}}  # {e.note}" for e in examples]
    else:  # too wide for one line each: the note above its command
        lines = [line for e in examples for line in (f"  # {e.note}", f"  {e.line}")]
    return "\n".join(["\b", "Examples:", *lines])

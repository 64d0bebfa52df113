"""What each strategy writes into its output folder, and clearing exactly that before a run.

A run into an ``out_dir`` that already holds an earlier run's files replaces them: each
strategy first removes the outputs it is about to write (:data:`STRATEGY_OUTPUTS`), and
nothing else in the folder. Files left by an earlier, different run would otherwise be read
as this run's: ZeRO rank files of another world size in ``deepspeed/global_stepN/``, DCP
shards of more ranks in ``dcp/``, per-step parameters of more steps in ``steps/``. Another
strategy's outputs (a ``zero`` run's ``deepspeed/`` under a later ``ddp`` run) and files of
the user's stay. Each file is written whole under a temporary name and renamed
(:func:`write_whole`). Torch-free, so the table can be read and tested without torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ckpt_tools.errors import UsageError
from ckpt_tools.harness.config import DEEPSPEED_DIR, RUN_JSON, STEPS_DIR
from ckpt_tools.io.atomic import keep_mode_and_owner

__all__ = ["STEP_OUTPUTS", "STRATEGY_OUTPUTS", "check_outputs", "clear_outputs", "write_whole"]

_COMMON = ("wrapped.pt", "bare.pt", RUN_JSON)
#: Per strategy, the glob patterns (relative to ``out_dir``; a folder's ends in ``/``) of
#: everything it writes there:
#: ``fsdp``'s DCP folder (``.metadata`` and one ``__{rank}_0.distcp`` per rank), ``zero``'s
#: DeepSpeed folder (``latest``, ``global_step{N}/`` and the recovery scripts DeepSpeed copies
#: beside them) and ``zero_to_fp32.pt``.
STRATEGY_OUTPUTS: dict[str, tuple[str, ...]] = {
    **{name: (*_COMMON, "trainer.pt") for name in ("single", "dp", "ddp", "manual")},
    "fsdp": (*_COMMON, "trainer.pt", "dcp/.metadata", "dcp/__*.distcp"),
    "zero": (
        *_COMMON,
        "zero_to_fp32.pt",
        f"{DEEPSPEED_DIR}/latest",
        f"{DEEPSPEED_DIR}/global_step*/",
        f"{DEEPSPEED_DIR}/zero_to_*.py",
    ),
}
#: What ``record_steps`` adds, whatever the strategy: one ``{step:05d}.pt`` per step.
STEP_OUTPUTS: tuple[str, ...] = (f"{STEPS_DIR}/[0-9]*.pt",)


def clear_outputs(out_dir: str | Path, strategy: str, record_steps: bool = False) -> list[Path]:
    """Remove what ``strategy`` writes into ``out_dir`` (see :data:`STRATEGY_OUTPUTS`).

    Args:
        out_dir: the run's output folder; one that does not exist has nothing to clear.
        strategy: one of :data:`~ckpt_tools.harness.config.STRATEGIES`.
        record_steps: also clear the per-step parameters (:data:`STEP_OUTPUTS`).

    Returns:
        The paths removed, in the order removed.

    Raises:
        UsageError: a folder stands where the run writes a file (``bare.pt/``): a folder is
            removed only where the run writes one.
        OSError: something there cannot be removed.

    Example:
        >>> Path("run/steps").mkdir(parents=True)
        >>> for name in ("bare.pt", "notes.txt", "steps/00001.pt", "steps/00002.pt"):
        ...     _ = Path("run", name).write_bytes(b"")
        >>> [p.as_posix() for p in clear_outputs("run", "single", record_steps=True)]
        ['run/bare.pt', 'run/steps/00001.pt', 'run/steps/00002.pt']
        >>> sorted(p.name for p in Path("run").iterdir())
        ['notes.txt', 'steps']
    """
    found = check_outputs(out_dir, strategy, record_steps)
    for path in found:
        # A link is removed as a link: what it points at is not this run's to delete.
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found


def check_outputs(out_dir: str | Path, strategy: str, record_steps: bool = False) -> list[Path]:
    """What :func:`clear_outputs` would remove, checked before anything is (or before the
    ranks start): a folder where the run writes a file is the user's, never removed.

    Returns:
        The paths found, in the order :func:`clear_outputs` removes them.

    Raises:
        UsageError: a folder stands where the run writes a file (``bare.pt/``), or a file
            where it writes its folder.
    """
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(
            f"{str(root)!r} is a file, where the run writes its folder; move it away or "
            "choose another output folder",
            path=str(root),
        )
    patterns = STRATEGY_OUTPUTS[strategy] + (STEP_OUTPUTS if record_steps else ())
    found: list[Path] = []
    for pattern in patterns:
        for path in sorted(root.glob(pattern.rstrip("/"))):
            if path.is_dir() and not path.is_symlink() and not pattern.endswith("/"):
                raise UsageError(
                    f"{str(path)!r} is a folder, where the run writes a file; move it away "
                    "or choose another output folder",
                    path=str(path),
                )
            found.append(path)
    return found


def write_whole(data: bytes | memoryview, path: Path) -> None:
    """``data`` written under a temporary name and renamed into place once whole: a failed
    write is an OSError with its errno and the file it was for, and no part of a file is left
    under the name. The file gets the mode a plain ``open`` gives it (a replaced one keeps
    its own), not ``mkstemp``'s owner-only one.

    Example:
        >>> write_whole(b"{}\\n", Path("run.json"))
        >>> Path("run.json").read_text()
        '{}\\n'
    """
    try:
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:  # (a read-only folder): said with the file it was for
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        keep_mode_and_owner(fd, path)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        if isinstance(e, OSError) and e.filename is None:  # said with the file it was for
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise

"""The one way an output file is written: temp file, records, verification, fsync, rename.

Every writing operation hands its plan to :func:`write_file` (one file) or, for a Hugging
Face folder, to :func:`~ckpt_tools.io.writers.hf_folder.write_folder`, which writes each of
its files with :func:`write_file`. What fills the file is the format's writer
(:mod:`~ckpt_tools.io.writers.torchzip`, :mod:`~ckpt_tools.io.writers.plan`,
:mod:`~ckpt_tools.io.writers.safetensors`); what checks it is the operation's verification
at the level its caller asked for. Durability is an argument, passed on to the writers
through :class:`~ckpt_tools.io.atomic.AtomicFile`, never read from hidden state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ckpt_tools.io.atomic import AtomicFile, atomic_output

__all__ = ["Check", "Fill", "write_file"]

#: Writes the output's bytes into the temp file (``AtomicFile.file``), passing
#: ``AtomicFile.durable`` on to the copy engine.
Fill = Callable[[AtomicFile], None]
#: Reads the written temp file back (its path) and says what was verified, in words; raises
#: :class:`~ckpt_tools.errors.VerificationError` when it does not hold what was meant.
Check = Callable[[str], str]


def write_file(
    target: str | os.PathLike[str],
    fill: Fill,
    check: Check,
    *,
    replace: bool = False,
    durable: bool = True,
    like: Path | None = None,
) -> str:
    """Write ``target`` atomically: ``fill`` a temp file beside it, ``check`` it, then name it.

    The temp file is fsynced before it gets ``target``'s name (unless ``durable`` is False
    and ``target`` does not exist yet), and removed on any error, the check's included: a
    file that does not verify is never named.

    Args:
        target: the output path, already accepted by
            :func:`~ckpt_tools.io.output_path.check_output_path` (or in a folder being built).
        fill: writes the file's bytes.
        check: verifies the written file; its words are returned.
        replace: replace a ``target`` that exists (the caller's ``force`` or in place);
            False refuses it, even one that appeared after the output path was checked.
        durable: fsync the file and its folder (see :func:`~ckpt_tools.io.atomic.atomic_output`).
        like: the file it stands for (``target`` by default): its mode and owner, and the
            name errors give (see :func:`~ckpt_tools.io.atomic.atomic_output`).

    Returns:
        What ``check`` verified, in words.

    Raises:
        OutputError: the temp file cannot be created or written.
        OutputExistsError: ``target`` exists and ``replace`` is False.
        VerificationError: ``check`` found the file wrong (nothing is named).

    Example:
        >>> def fill(out):
        ...     out.file.write(b"all or nothing")
        >>> write_file("notes.txt", fill, lambda path: "not verified", durable=False)
        'not verified'
        >>> open("notes.txt", "rb").read()
        b'all or nothing'
    """
    with atomic_output(target, replace=replace, durable=durable, like=like) as out:
        fill(out)
        out.file.flush()
        return check(str(out.path))

"""What a torch.distributed.checkpoint folder's files are named, told from a listing alone.

Light on purpose: format detection and the Hugging Face folder chooser ask it of every
folder, and reading a DCP folder (the metadata pickle) is :mod:`~ckpt_tools.formats.dcp.reader`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckpt_tools.errors import Remedy, UnsupportedFormatError

__all__ = ["DATA_SUFFIX", "METADATA_FILE", "is_dcp_folder", "refuse_without_metadata"]

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP folder: a ``.metadata`` file, as DCP's own loader decides
    (the ``*.distcp`` files it names may be missing: reading it then says which).

    Example:
        >>> is_dcp_folder(".")
        False
    """
    # Named, whatever it is: a ``.metadata`` that is no regular file (a FIFO) is refused when
    # read, not taken for a folder of other files.
    try:
        return METADATA_FILE in os.listdir(path)
    except OSError:
        return False


def refuse_without_metadata(names: Sequence[str], path: str) -> None:
    """Say what a DCP folder lacks, where it holds DCP files but no :data:`METADATA_FILE`:
    a save writes it last (one that did not finish), and one made with
    ``use_collectives=False`` leaves it out (each rank writes its own ``__N.metadata``).

    Args:
        names: the files the folder holds, sorted.
        path: the folder, as the error names it.

    Raises:
        UnsupportedFormatError: ``names`` holds ``*.distcp`` or ``__N.metadata`` files.
    """
    found = [n for n in names if n.endswith(DATA_SUFFIX)]
    found += [n for n in names if n.startswith("__") and n.endswith(METADATA_FILE)]
    if not found:
        return
    raise UnsupportedFormatError(
        f"{path!r} holds torch.distributed.checkpoint files ({', '.join(found[:3])}) "
        f"but no {METADATA_FILE}: a save that did not finish, or one made with "
        f"use_collectives=False (a {METADATA_FILE} per rank), which is not read",
        path=path,
        remedies=(Remedy(text="save again with dcp.save's default use_collectives=True"),),
    )

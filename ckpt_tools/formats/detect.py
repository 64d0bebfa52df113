"""Which format a file is, from its first bytes. The suffix is only a hint."""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
import struct
from collections.abc import Callable
from typing import Any

from ckpt_tools._types import StrPath, checked_flags, checked_path
from ckpt_tools.errors import (
    LfsPointerError,
    Remedy,
    ResourceLimitError,
    UnsupportedFormatError,
)
from ckpt_tools.formats.missing import missing
from ckpt_tools.formats.urls import refuse_url

__all__ = [
    "FORMATS",
    "check_regular",
    "detect_bytes",
    "detect_format",
    "is_index_name",
]

FORMATS = (
    "torch-zip",
    "torch-legacy",
    "torch-tar",
    "safetensors",
    "torchscript",
    "pickle",
    "hf-sharded",
    "dcp",
    "deepspeed",
    "lfs-pointer",
)

LFS_SIGNATURE = b"version https://git-lfs.github.com/spec/"
# torch.serialization._is_zipfile: a zip is a file whose first 4 bytes are a local header.
ZIP_SIGNATURE = b"PK\x03\x04"
# torch's legacy MAGIC_NUMBER: the first object its legacy reader unpickles must equal it.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# What unpickling arbitrary bytes can raise (no global is ever imported: see _NoGlobals).
_UNPICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    OverflowError,
    RecursionError,
)
# A sharded checkpoint's index (``model.safetensors.index.json``) is JSON text; its suffix
# tells it from other JSON, its first byte from a file that only borrowed the name.
# transformers' variant indexes (save_pretrained(variant="fp16")) put the variant before .json,
# a dotted variant whole (model.safetensors.index.ema.v2.json).
_INDEX_NAME = re.compile(r"\.index(?:\.[^/]+)?\.json$")


def is_index_name(name: str) -> bool:
    """Whether a file name is a shard index's: ``X.index.json``, or a variant's
    ``X.index.VARIANT.json`` (``model.safetensors.index.fp16.json``).

    Example:
        >>> [is_index_name(n) for n in ("model.safetensors.index.json",
        ...  "model.safetensors.index.fp16.json", "model.safetensors.index.ema.v2.json",
        ...  "index.json", "config.json")]
        [True, True, True, False, False]
    """
    return _INDEX_NAME.search(name) is not None


# Protocol-0/1 pickles start with one of these opcodes; torch never writes them, users might.
_PICKLE_FIRST_OPCODES = frozenset(b"(}]lcdNIFLSVX")
# ...and are read as pickles only under these names.
_PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt")
# safetensors refuses longer headers (ckpt_tools.formats.safetensors.MAX_HEADER_BYTES).
_MAX_SAFETENSORS_HEADER = 100_000_000
_JSON_WHITESPACE = b" \t\n\r"


@checked_flags
def detect_format(path: StrPath, *, content_only: bool = False) -> str:
    """Detect a checkpoint's format by content.

    Args:
        path: a file, a folder, or a shard index (``*.index.json``).
        content_only: tell the format from the content alone: a torch checkpoint named
            ``*.safetensors`` (which torch.load refuses by its name) is then ``torch-zip``.

    Returns:
        One of :data:`FORMATS`. ``torch-zip`` and ``torchscript`` are both zip archives: this
        returns ``torch-zip`` for any zip, and the zip reader tells them apart. A folder and
        a shard index are both ``hf-sharded`` (a folder with one weight file too, though it
        opens as that file); a folder with a
        ``.metadata`` file and ``*.distcp`` files is ``dcp`` (torch.distributed.checkpoint), and
        a DeepSpeed save folder (``latest``) or tag folder (``*_model_states.pt``) is
        ``deepspeed``.

    Raises:
        UsageError: ``path`` is a URL (:func:`~ckpt_tools.formats.refuse_url`).
        CheckpointNotFoundError: nothing at ``path``.
        LfsPointerError: a git-lfs pointer file.
        UnsupportedFormatError: not a format ckpt_tools reads.

    Example:
        >>> detect_format("model.safetensors"), detect_format("model.pt")
        ('safetensors', 'torch-zip')
    """
    # The path as given, through os: pathlib is a large import that reading needs nothing of.
    p = checked_path(path)
    refuse_url(p)  # every local reader comes here: a URL gets the one refusal
    nothing = missing(p)
    if nothing is not None:
        raise nothing
    if check_regular(p) == "folder":
        from ckpt_tools.formats.dcp.layout import is_dcp_folder
        from ckpt_tools.formats.deepspeed.layout import is_deepspeed_folder

        if is_dcp_folder(p):
            return "dcp"
        return "deepspeed" if is_deepspeed_folder(p) else "hf-sharded"
    # O_NONBLOCK: if the path became a FIFO since the check, opening it does not wait for a
    # writer, and fstat below sees what was opened.
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise _not_regular(p, opened.st_mode)
        head = os.pread(fd, 512, 0)
        find = _content_format if content_only else _format_of
        return find(p, opened.st_size, head, lambda n: os.pread(fd, n, 0))
    finally:
        os.close(fd)


def detect_bytes(
    name: str,
    size: int,
    head: bytes,
    read_to: Callable[[int], bytes],
    *,
    content_only: bool = False,
) -> str:
    """The format of a file known by its bytes (a remote file), decided as for a local one.

    Args:
        name: its name or URL: the suffix is a hint, as for a path; messages quote it.
        size: its size in bytes.
        head: its first 512 bytes (fewer if it is shorter).
        read_to: ``read_to(n)`` gives its first ``n`` bytes.
        content_only: as for :func:`detect_format`: the content alone decides.

    Returns:
        One of :data:`FORMATS` that a single file can be (not a folder format).

    Raises:
        LfsPointerError: a git-lfs pointer file.
        UnsupportedFormatError: not a format ckpt_tools reads.

    Example:
        >>> detect_bytes("x.bin", 30, b"PK\x03\x04" + bytes(26), lambda n: b"")
        'torch-zip'
    """
    find = _content_format if content_only else _format_of
    return find(name.split("?", 1)[0], size, head, read_to)


def _format_of(p: str, size: int, head: bytes, read_to: Callable[[int], bytes]) -> str:
    """The format of the regular file ``p`` from its first 512 bytes (``head``).

    ``read_to(n)`` reads its first ``n`` bytes from the same open file, for the one check
    that may need more (a legacy magic number inside a long FRAME).
    """
    named_safetensors = os.path.basename(p).endswith(".safetensors")
    if named_safetensors and _looks_like_safetensors(head, size, named=True):
        # torch.load and safetensors read such a name as safetensors whatever else its
        # first block could be (a tar header); the tar and pickle checks are not needed.
        return "safetensors"
    found = _content_format(p, size, head, read_to)
    if named_safetensors and found != "safetensors":
        # torch.load(path) reads a path ending in ".safetensors" with safetensors (torch
        # 2.13), which refuses anything else, as safetensors' own loaders do: read as what
        # it holds, such a file would load here and nowhere else.
        raise UnsupportedFormatError(
            f"{p!r} is named .safetensors but holds a {found} checkpoint; torch.load "
            "and safetensors read such a path as safetensors and refuse it",
            path=p,
            remedies=(
                Remedy(text="rename it to what it holds (a .pt name for a torch checkpoint)"),
            ),
        )
    return found


def _content_format(p: str, size: int, head: bytes, read_to: Callable[[int], bytes]) -> str:
    if size == 0:
        raise UnsupportedFormatError(f"{p!r} is empty (0 bytes); expected a checkpoint", path=p)
    if head.startswith(LFS_SIGNATURE):
        if "://" in p:  # served as it is: no repository here to pull into
            fix = Remedy(text="the server holds the pointer, not the file: upload it with git-lfs")
        else:
            fix = Remedy(command="git lfs pull", text="in its repository to fetch the real file")
        raise LfsPointerError(
            f"{p!r} is a git-lfs pointer ({size} bytes of text), not the checkpoint itself",
            path=p,
            remedies=(fix,),
        )
    if head.startswith(ZIP_SIGNATURE):
        return "torch-zip"
    if _is_tar_header(head):
        return "torch-tar"
    if _first_pickle_is_legacy_magic(head, read_to):
        return "torch-legacy"
    name = os.path.basename(p)
    if is_index_name(name) and head.lstrip()[:1] == b"{":
        return "hf-sharded"  # the index itself: it opens with the shards it names
    if _looks_like_safetensors(head, size):
        return "safetensors"
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return "pickle"
    if (
        head[:1]
        and head[0] in _PICKLE_FIRST_OPCODES
        and os.path.splitext(name)[1] in _PICKLE_SUFFIXES
    ):
        return "pickle"
    raise UnsupportedFormatError(
        f"{p!r} is not a checkpoint ckpt_tools can read: its first bytes {head[:16]!r} "
        "match no torch zip, legacy torch pickle, tar, pickle or safetensors header",
        path=p,
    )


class _NoGlobals(pickle.Unpickler):
    """An unpickler that builds only plain values: every global is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _first_pickle_is_legacy_magic(
    head: bytes, read_to: Callable[[int], bytes] | None = None
) -> bool:
    """Whether the first pickle in ``head`` is torch's legacy magic number.

    torch's legacy reader unpickles the file's first object, in whatever protocol it was
    written (a protocol-4 pickle adds a FRAME before the number), and checks its value; so
    does this, on the first bytes only, with an unpickler that imports nothing. The
    unpickler needs a FRAME's bytes whole, even past a STOP inside it: where they run past
    ``head``, ``read_to(n)`` gives the file's first ``n`` bytes (up to 1 MiB).

    Example:
        >>> _first_pickle_is_legacy_magic(pickle.dumps(_LEGACY_MAGIC, protocol=4))
        True
        >>> _first_pickle_is_legacy_magic(pickle.dumps({"a": 1}, protocol=2))
        False
    """
    if not head or not (head[0] == pickle.PROTO[0] or head[0] in _PICKLE_FIRST_OPCODES):
        return False
    import pickletools  # only files that may be pickles get here

    from ckpt_tools.formats.pickle.expansion import check_expansion

    try:
        # Walked first (pure Python, nothing allocated): every declared length then lies
        # within ``head``, so the C unpickler below never allocates what a header claims, and
        # a memo bomb (which hashing a dict key would walk forever) is never built.
        ops = list(pickletools.genops(io.BytesIO(head)))
        stop = ops[-1][2] + 1
        check_expansion(head[:stop])
        end = max([stop] + [pos + 9 + arg for op, arg, pos in ops if op.name == "FRAME"])
        if end > len(head):
            if read_to is None or end > _MAX_FIRST_FRAME:
                return False
            head = read_to(end)
        first = _NoGlobals(io.BytesIO(head[:end])).load()
    except (*_UNPICKLE_ERRORS, ResourceLimitError):
        return False
    return type(first) is int and first == _LEGACY_MAGIC


# A first pickle is a magic number (a dozen bytes); a frame around it is read up to this.
_MAX_FIRST_FRAME = 1 << 20


def check_regular(path: str | os.PathLike[str]) -> str:
    """Refuse, before any read, a path that is neither a regular file nor a folder.

    Reading a FIFO, a socket or a character device blocks or never ends; a symlink counts as
    what it points to. Every path ckpt_tools opens (shards named by an index too) comes here.

    Args:
        path: the path to check (it must exist).

    Returns:
        ``"file"`` or ``"folder"``.

    Raises:
        CheckpointNotFoundError: nothing at ``path`` (or a dangling symlink).
        UnsupportedFormatError: a FIFO, socket, device, or a symlink to one.

    Example:
        >>> check_regular(".")
        'folder'
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        nothing = missing(os.fspath(path))
        if nothing is None:
            raise
        raise nothing from e
    if stat.S_ISDIR(mode):
        return "folder"
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    return "file"


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_regular(path: str | os.PathLike[str], mode: int) -> UnsupportedFormatError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return UnsupportedFormatError(
        f"{os.fspath(path)!r} is {kind}, not a checkpoint file; ckpt_tools reads regular "
        "files and folders only",
        path=path,
    )


def _is_tar_header(head: bytes) -> bool:
    """Whether torch's legacy loader takes the file for a tar: its first block is a header.

    ``torch.load`` tries ``tarfile.open(mode="r:")`` on every non-zip file first, which
    accepts any first block whose checksum is right (with or without ``ustar``).
    """
    import tarfile  # only files that are not zips get here; `ckpt` starts faster without

    try:
        tarfile.TarInfo.frombuf(head[: tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _looks_like_safetensors(head: bytes, size: int, named: bool = False) -> bool:
    if len(head) < 9:
        return False
    (header_len,) = struct.unpack("<Q", head[:8])
    # A header longer than the file is a truncated safetensors file, and, in a file named
    # .safetensors, one over the size limit an implausible one: the reader says so.
    if header_len < 2:
        return False
    # The crate's JSON parser skips JSON whitespace before the header's object.
    start = head[8 : 8 + header_len].lstrip(_JSON_WHITESPACE)
    if header_len > _MAX_SAFETENSORS_HEADER:
        return named and start[:1] == b"{"
    return start[:1] == b"{" or (not start and len(head) < 8 + header_len)

"""A checkpoint at a URL, opened from the few byte ranges its structure needs.

The same readers as for local files, given the remote file instead of a path: the format is
told from the first bytes as torch.load tells it, every limit and refusal applies, nothing
fetched is executed. What a remote read leaves for later (each zip record's local header, a
legacy storage's element count) is checked when that record's bytes are read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ckpt_tools._types import StrPath
from ckpt_tools.errors import UnsupportedFormatError
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.io.remote.rangefile import RemoteFile
from ckpt_tools.io.remote.session import RemoteSession
from ckpt_tools.io.remote.urls import is_folder_url, is_url, sibling

__all__ = ["open_file", "open_path", "open_url", "opened"]


def open_path(path: StrPath, *, session: RemoteSession | None = None) -> Checkpoint:
    """Open a checkpoint at a local path or a URL (``https://``, ``hf://``, ``s3://``).

    Args:
        path: a local path (see :func:`~ckpt_tools.formats.open_checkpoint`) or a URL.
        session: where remote reads go and are counted; None makes one for a URL.

    Returns:
        The opened :class:`~ckpt_tools.formats.base.Checkpoint`.

    Raises:
        CheckpointError: as :func:`open_url` or ``open_checkpoint`` raise.

    Example:
        >>> open_path("model.pt").format
        'torch-zip'
    """
    if is_url(path):
        return open_url(str(path), session=session)
    from ckpt_tools.formats import open_checkpoint

    return open_checkpoint(path)


@contextlib.contextmanager
def opened(path: StrPath) -> Iterator[Checkpoint]:
    """The checkpoint at ``path`` (a local path or a URL), for as long as its bytes are read:
    a URL's connections are closed when the block ends.

    Args:
        path: as for :func:`open_path`.

    Yields:
        The opened :class:`~ckpt_tools.formats.base.Checkpoint`.

    Raises:
        CheckpointError: as :func:`open_path` raises.

    Example:
        >>> with opened("model.pt") as ckpt:
        ...     ckpt.format
        'torch-zip'
    """
    if not is_url(path):
        yield open_path(path)
        return
    with RemoteSession() as session:
        yield open_url(str(path), session=session)


def open_url(url: str, *, session: RemoteSession | None = None) -> Checkpoint:
    """Open the checkpoint at ``url``, reading only the ranges its structure needs.

    A folder URL (``hf://ORG/REPO``, or a URL ending in ``/``) opens the first of its weight
    files that exists, in the order transformers tries them: a sharded index with each
    shard's header, or one file.

    Args:
        url: an ``http(s)://``, ``hf://`` or ``s3://`` URL of a file or a folder.
        session: where the reads go and are counted; None makes one.

    Returns:
        The opened :class:`~ckpt_tools.formats.base.Checkpoint`; its ``path`` is ``url``
        (a sharded folder's is the folder's URL) and ``remote`` holds the files read.

    Raises:
        CheckpointNotFoundError: nothing at ``url`` (HTTP 404, no such key).
        RemoteError: the server refused, timed out, or ignores byte ranges.
        CheckpointError: the file is corrupt or unsafe, as for a local file.

    Example:
        >>> is_folder_url("hf://org/model")  # a repo: its weight files are looked for
        True
        >>> ckpt = open_url("hf://org/model")  # doctest: +SKIP
        >>> ckpt.format, len(ckpt.shards)  # doctest: +SKIP
        ('hf-sharded', 2)
    """
    session = session if session is not None else RemoteSession()
    url = session.named(url)  # shown without its password; the session sends it
    if is_folder_url(url):
        name, file = session.open_folder(url)
        url = sibling(url, name)
    else:
        file = session.open(url)
    return open_file(url, file, session)


def open_file(url: str, file: RemoteFile, session: RemoteSession) -> Checkpoint:
    """Open the checkpoint in ``file``, a remote file opened already (a scan has its bytes).

    Args:
        url: the file's URL (a shard index's shards are opened beside it).
        file: the open remote file, from ``session``.
        session: where further reads go and are counted.

    Returns:
        The opened :class:`~ckpt_tools.formats.base.Checkpoint`, as :func:`open_url` returns it.

    Raises:
        UnsupportedFormatError: a format read member by member (tar), or not a checkpoint.
        CheckpointError: as :func:`open_url` raises.

    Example:
        >>> class InMemory:  # a transport serving a local file's bytes
        ...     url = "https://host.example/model.pt"
        ...     data = open("model.pt", "rb").read()
        ...     def get(self, start, end): return self.data[start:end], len(self.data)
        ...     def close(self): pass
        >>> open_file(InMemory.url, RemoteFile(InMemory()), RemoteSession()).format
        'torch-zip'
    """
    from ckpt_tools.formats import naming
    from ckpt_tools.formats.detect import detect_bytes

    with naming(url):
        fmt = detect_bytes(url, file.size, file.pread(512, 0), lambda n: file.pread(n, 0))
        if fmt != "hf-sharded":
            return _with_remote(_open_one(url, fmt, file), {url: file})
    return _open_index(url, file, session)  # a shard's errors name the shard (open_file)


def _open_one(url: str, fmt: str, file: RemoteFile) -> Checkpoint:
    if fmt == "torch-zip":
        from ckpt_tools.formats.zip.torchzip import open_torch_zip

        return open_torch_zip(url, source=file)
    if fmt == "safetensors":
        from ckpt_tools.formats.safetensors import open_safetensors

        return open_safetensors(url, source=file)
    if fmt == "torch-legacy":
        from ckpt_tools.formats.legacy.reader import open_legacy

        return open_legacy(url, source=file)
    if fmt == "pickle":
        from ckpt_tools.formats.legacy.reader import open_pickle

        return open_pickle(url, source=file)
    raise UnsupportedFormatError(
        f"{url!r} is a {fmt} checkpoint, which ckpt_tools reads from local files only "
        "(it is read member by member: a request each); download it and pass its path",
        path=url,
    )


def _open_index(url: str, file: RemoteFile, session: RemoteSession) -> Checkpoint:
    from ckpt_tools.formats.hf import open_index

    files: dict[str, RemoteFile] = {url: file}

    def open_shard(name: str) -> Checkpoint:
        shard_url = sibling(url, name)
        file = session.open(shard_url)
        shard = open_file(shard_url, file, session)
        file.forget()  # its header is read; a cache per shard would grow with the shard count
        files.update(shard.remote)  # type: ignore[arg-type]
        return shard

    ckpt = open_index(url, source=file, open_shard=open_shard)
    return _with_remote(ckpt, files)


def _with_remote(ckpt: Checkpoint, files: dict[str, RemoteFile]) -> Checkpoint:
    import dataclasses

    return dataclasses.replace(ckpt, remote=files)

"""On-disk formats, torch-free: detect one, open it into a :class:`Checkpoint`."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from ckpt_tools._types import StrPath
from ckpt_tools.errors import CorruptCheckpointError, Remedy, ResourceLimitError, UsageError
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.formats.detect import FORMATS, detect_format

__all__ = [
    "FORMATS",
    "HIDDEN",
    "Checkpoint",
    "ZipRecord",
    "detect_format",
    "naming",
    "open_checkpoint",
    "refuse_url",
    "shown_url",
]


# The URLs io/remote reads (open_url); here they are refused with the commands that read them.
_URL_SCHEMES = ("http", "https", "hf", "s3")
#: What a shown URL holds in place of a credential (its userinfo, each query value).
HIDDEN = "***"
# scheme://, the authority (userinfo@host:port), path, query, fragment: read without urlsplit,
# so that credentials are hidden in a URL urlsplit refuses too.
_HTTP_URL = re.compile(r"(https?://)([^/?#]*)([^?#]*)(?:\?([^#]*))?(?:#(.*))?", re.I | re.S)
_HOST_PORT = re.compile(r"(?:\[[^\]]*\]|[^\[\]:]+)(?::\d*)?")


def open_checkpoint(path: StrPath) -> Checkpoint:
    """Open any supported checkpoint by content, reading only its structure.

    Args:
        path: a checkpoint file, a folder with ``*.index.json`` (HF sharded), or such an
            index itself (it opens with the shards it names).

    Returns:
        The opened :class:`Checkpoint`.

    Raises:
        UsageError: ``path`` is a URL (:func:`refuse_url`).
        CheckpointError: see :func:`detect_format` and the readers.

    Example:
        >>> ckpt = open_checkpoint("model.pt")
        >>> ckpt.format, sorted(ckpt.root)[:2]
        ('torch-zip', ['bn.bias', 'bn.num_batches_tracked'])
    """
    path = os.fspath(path)
    with naming(path):
        return _open(path, detect_format(path))  # (which refuses a URL first)


def refuse_url(path: StrPath) -> None:
    """Refuse a URL given to a reader of local files, naming the commands that read URLs.

    Every local reader passes here before it looks at the file system (:func:`detect_format`
    does), so each local-only command refuses a URL with the same words, never with "no such
    file". A local file or folder whose name merely looks like a URL is let through.

    Args:
        path: the path as given.

    Raises:
        UsageError: ``path`` is an ``http(s)://``, ``hf://`` or ``s3://`` URL; the message
            shows it without its credentials (:func:`shown_url`).

    Example:
        >>> refuse_url("model.pt")
        >>> refuse_url("https://me:secret@host.example/model.pt")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: 'https://***@host.example/model.pt' is a URL; ...
    """
    text = os.fspath(path)
    if text.partition("://")[0].lower() not in _URL_SCHEMES or os.path.exists(text):
        return
    shown = shown_url(text)
    raise UsageError(
        f"{shown!r} is a URL; inspect, scan, diff, extract and slim read URLs (only the "
        "bytes they need), other commands read local files",
        path=shown,
        remedies=(Remedy(text="download the file and pass its path"),),
    )


def shown_url(url: str, *, target: bool = False) -> str:
    """``url`` as messages, reports and ``--json`` show it: the one place URLs are redacted.

    An ``http(s)`` URL's userinfo (a password, or a token given as the user name) and each
    value of its query (a signed URL's ``Signature``, a ``token=``) are credentials: each is
    shown as :data:`HIDDEN`. A password holding an unescaped ``/``, ``?`` or ``#`` (which
    ends the host early, so the URL is refused) is hidden up to the URL's last ``@``.

    Args:
        url: a URL as the user gave it, or a URL a server redirected to.
        target: ``url`` is a redirect's target (a CDN's signed URL): show its scheme, host
            and path only.

    Returns:
        The URL so redacted; ``hf://``, ``s3://`` URLs and local paths as given.

    Example:
        >>> shown_url("https://me:secret@host.example/m.pt?token=abc&v=1")
        'https://***@host.example/m.pt?token=***&v=***'
        >>> shown_url("https://cdn.example/a/m.pt?Expires=1&Signature=x", target=True)
        'https://cdn.example/a/m.pt'
    """
    found = _HTTP_URL.fullmatch(url)
    if found is None:
        return url
    head, authority, path, query, fragment = found.groups()
    _, at, host = authority.rpartition("@")
    after = url[len(head) + len(authority) :]
    if not _HOST_PORT.fullmatch(host) and "@" in after:  # (a '/', '?' or '#' in a password)
        return shown_url(f"{head}{HIDDEN}@{url[len(head) :].rpartition('@')[2]}", target=target)
    if target:
        return head + host + path
    shown = head + (f"{HIDDEN}@" if at else "") + host + path
    if query is not None:
        shown += "?" + "&".join(_hidden_value(item) for item in query.split("&"))
    return shown if fragment is None else f"{shown}#{HIDDEN if fragment else ''}"


def _hidden_value(item: str) -> str:
    name, equals, _ = item.partition("=")
    return f"{name}={HIDDEN}" if equals else (HIDDEN if item else "")


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Make every corrupt-file or limit error raised in the block name ``path`` (a local
    path or a URL), as the one place that adds it.

    Low-level readers (pickle, tar) do not know the file name; every message names it.

    Args:
        path: the file being read, as the user gave it.

    Raises:
        CorruptCheckpointError, ResourceLimitError: the block's, prefixed with
            ``'path': `` unless the message names the file already.

    Example:
        >>> with naming("model.pt"):
        ...     raise CorruptCheckpointError("the pickle ends early")
        Traceback (most recent call last):
        ckpt_tools.errors.CorruptCheckpointError: 'model.pt': the pickle ends early
    """
    try:
        yield
    except (CorruptCheckpointError, ResourceLimitError) as e:
        if repr(path) in str(e) or path in str(e):
            raise
        raise type(e)(f"{path!r}: {e}") from e


def _open(path: str, fmt: str) -> Checkpoint:
    if fmt == "torch-zip":
        from ckpt_tools.formats.zip.torchzip import open_torch_zip

        return open_torch_zip(path)
    if fmt == "safetensors":
        from ckpt_tools.formats.safetensors import open_safetensors

        return open_safetensors(path)
    if fmt == "dcp":
        from ckpt_tools.formats.dcp.reader import open_dcp

        return open_dcp(path)
    if fmt == "deepspeed":
        from ckpt_tools.formats.deepspeed.reader import open_deepspeed

        return open_deepspeed(path)
    if fmt == "hf-sharded":
        from ckpt_tools.formats.hf import open_folder, open_index

        return open_folder(path) if os.path.isdir(path) else open_index(path)
    from ckpt_tools.formats.legacy import reader as legacy

    if fmt == "torch-legacy":
        return legacy.open_legacy(path)
    if fmt == "torch-tar":
        return legacy.open_tar(path)
    return legacy.open_pickle(path)

"""URLs given to readers of local files: the one refusal, and the one redaction.

Every message, report and ``--json`` that shows a URL shows :func:`shown_url` of it, so a
password, a token or a signed query never reaches a terminal or a log.
"""

from __future__ import annotations

import os
import re

from ckpt_tools._types import StrPath
from ckpt_tools.errors import Remedy, UsageError

__all__ = ["HIDDEN", "refuse_url", "shown_url"]

# The URLs io/remote reads (open_url); here they are refused with the commands that read them.
_URL_SCHEMES = ("http", "https", "hf", "s3")
#: What a shown URL holds in place of a credential (its userinfo, each query value).
HIDDEN = "***"
# scheme://, the authority (userinfo@host:port), path, query, fragment: read without urlsplit,
# so that credentials are hidden in a URL urlsplit refuses too.
_HTTP_URL = re.compile(r"(https?://)([^/?#]*)([^?#]*)(?:\?([^#]*))?(?:#(.*))?", re.I | re.S)
_HOST_PORT = re.compile(r"(?:\[[^\]]*\]|[^\[\]:]+)(?::\d*)?")


def refuse_url(path: StrPath, *, output: bool = False) -> None:
    """Refuse a URL given to a reader of local files, naming the commands that read URLs, or
    (``output``) given as an output: every output is a local path.

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
    if output:
        raise UsageError(
            f"output {shown!r} is a URL; outputs are written to local paths only",
            path=shown,
            remedies=(Remedy(text="write a local path, then upload it"),),
        )
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

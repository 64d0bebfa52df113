"""``http(s)://`` URLs: taken apart and checked, and shown without the credentials they carry.

A URL may hold a password (``https://user:password@host/...``) and a redirect's target a
signed query string (a CDN's ``Expires``/``Signature``): both are credentials, so every URL
a message or a report shows goes through :func:`shown_url`. The password stays with the
session that sends it (:meth:`~ckpt_tools.io.remote.session.RemoteSession.named`).
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from ckpt_tools.errors import UsageError

__all__ = ["credentials", "shown_url", "split_http", "with_userinfo"]

# scheme://, the authority (userinfo@host:port), the rest: read without urlsplit, so that a
# password is found and hidden in a URL urlsplit refuses too.
_AUTHORITY = re.compile(r"(https?://)([^/?#]*)(.*)", re.IGNORECASE | re.DOTALL)


def _authority(url: str) -> tuple[str, str | None, str, str] | None:
    """``(scheme://, userinfo or None, host[:port], rest)`` of an ``http(s)`` URL, else None."""
    found = _AUTHORITY.fullmatch(url)
    if found is None:
        return None
    userinfo, at, host = found[2].rpartition("@")
    return found[1], userinfo if at else None, host, found[3]


def shown_url(url: str, *, target: bool = False) -> str:
    """``url`` as messages and ``--json`` show it: the one place URLs are redacted.

    Args:
        url: a URL as the user gave it, or a URL a server redirected to.
        target: ``url`` is a redirect's target (a CDN's signed URL, whose query string is a
            short-lived credential): show its scheme, host and path only.

    Returns:
        ``url`` without the password of its userinfo (``https://user@host/x.pt``); a target
        also without its userinfo, query and fragment. Other URLs as given.

    Example:
        >>> shown_url("https://me:secret@host.example/m.pt?v=1")
        'https://me@host.example/m.pt?v=1'
        >>> shown_url("https://cdn.example/a/m.pt?Expires=1&Signature=x", target=True)
        'https://cdn.example/a/m.pt'
    """
    parts = _authority(url)
    if parts is None:
        return url
    head, userinfo, host, rest = parts
    if target:
        return head + host + re.split(r"[?#]", rest, maxsplit=1)[0]
    if userinfo is None or ":" not in userinfo:
        return url
    return f"{head}{userinfo.partition(':')[0]}@{host}{rest}"


def credentials(url: str) -> tuple[str, str | None]:
    """``(origin, userinfo)`` of an ``http(s)`` URL: ``scheme://host[:port]`` in lower case,
    and ``user:password`` where the URL holds a password (else None).

    Example:
        >>> credentials("https://me:secret@Host.example/m.pt")
        ('https://host.example', 'me:secret')
    """
    parts = _authority(url)
    if parts is None:
        return "", None
    head, userinfo, host, _ = parts
    return (head + host).lower(), userinfo if userinfo and ":" in userinfo else None


def with_userinfo(url: str, userinfo: str) -> str:
    """``url`` (``http(s)``) with ``userinfo`` in place of its own.

    Example:
        >>> with_userinfo("https://me@host.example/m.pt", "me:secret")
        'https://me:secret@host.example/m.pt'
    """
    parts = _authority(url)
    if parts is None:
        return url
    head, _, host, rest = parts
    return f"{head}{userinfo}@{host}{rest}"


def split_http(url: str) -> SplitResult:
    """An ``http(s)://`` URL taken apart (``urlsplit``), refused where it has no host or a
    malformed one (an unclosed ``[``, a bracketed host that is no IP address, a bad port).

    Raises:
        UsageError: the URL, what is wrong with it, and what to write.

    Example:
        >>> split_http("https://host.example/m.pt").netloc
        'host.example'
        >>> split_http("https:///m.pt")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: 'https:///m.pt' names no host: write http(s)://HOST/PATH
    """
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is no number or too large)
    except ValueError as e:
        shown = shown_url(url)
        raise UsageError(
            f"{shown!r} is not a URL that can be requested ({e}): write http(s)://HOST/PATH",
            path=shown,
        ) from e
    if not parts.hostname:
        shown = shown_url(url)
        raise UsageError(f"{shown!r} names no host: write http(s)://HOST/PATH", path=shown)
    return parts

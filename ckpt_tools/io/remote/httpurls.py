"""``http(s)://`` URLs: taken apart and checked, and shown without the credentials they carry.

A URL may hold a password or a token (``https://user:password@host/...``,
``https://TOKEN@host/...``) and a query that is one (``?token=...``, a presigned URL's
``X-Amz-Signature``); a redirect's target a CDN's signed query. Every URL a message or a report
shows goes through :func:`shown_url` (defined with the local readers' URL guard in
:mod:`ckpt_tools.formats`, the lowest room that shows a URL). The credentials stay with the
session that sends them (:meth:`~ckpt_tools.io.remote.session.RemoteSession.named`).
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from ckpt_tools.errors import UsageError, quote_foreign
from ckpt_tools.formats import HIDDEN, shown_url

__all__ = [
    "credentials",
    "host_problem",
    "http_problem",
    "shown_any",
    "shown_text",
    "shown_url",
    "split_http",
    "with_userinfo",
]

# scheme://, the authority (userinfo@host:port), the rest: read without urlsplit, so that
# credentials are found in a URL urlsplit refuses too.
_AUTHORITY = re.compile(r"(https?://)([^/?#]*)(.*)", re.IGNORECASE | re.DOTALL)
# A URL inside another library's message (botocore names its endpoint URL, whatever its
# scheme, between backticks).
_URL_IN_TEXT = re.compile(r"(?<![\w+.-])[a-z][\w+.-]*://[^\s'\"<>`]+", re.IGNORECASE)


def _authority(url: str) -> tuple[str, str | None, str, str] | None:
    """``(scheme://, userinfo or None, host[:port], rest)`` of an ``http(s)`` URL, else None."""
    found = _AUTHORITY.fullmatch(url)
    if found is None:
        return None
    userinfo, at, host = found[2].rpartition("@")
    return found[1], userinfo if at else None, host, found[3]


def shown_text(text: str) -> str:
    """``text`` (another library's message) with every URL in it :func:`shown_any`.

    Example:
        >>> shown_text('Could not connect to "http://u:pw@127.0.0.1:1/b/k"')
        'Could not connect to "http://***@127.0.0.1:1/b/k"'
        >>> shown_text("Custom endpoint `ftp://u:pw@host` was not a valid URI")
        'Custom endpoint `ftp://***@host` was not a valid URI'
    """
    return _URL_IN_TEXT.sub(lambda found: shown_any(found[0]), text)


def shown_any(url: str) -> str:
    """A URL of any scheme, or one written without a scheme (a setting's value), shown as
    :func:`shown_url` shows an ``http(s)`` one: its userinfo and query values hidden.

    Example:
        >>> shown_any("ftp://minio:secret@host/x"), shown_any("minio:secret@host:9000")
        ('ftp://***@host/x', '***@host:9000')
    """
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    return head + sep + shown_url("https://" + rest)[len("https://") :]


def credentials(url: str) -> tuple[str, str | None]:
    """``(origin, userinfo)`` of an ``http(s)`` URL: ``scheme://host[:port]`` in lower case,
    and the userinfo it holds (``user:password``, or a token as a lone user name), else None.

    The :data:`~ckpt_tools.formats.HIDDEN` a shown URL holds in its place is no credential.

    Example:
        >>> credentials("https://me:secret@Host.example/m.pt")
        ('https://host.example', 'me:secret')
        >>> credentials("https://TOKEN@host.example/m.pt")[1], credentials("https://***@h/m")[1]
        ('TOKEN', None)
    """
    parts = _authority(url)
    if parts is None:
        return "", None
    head, userinfo, host, _ = parts
    return (head + host).lower(), userinfo if userinfo and userinfo != HIDDEN else None


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


def host_problem(host: str) -> str:
    """What keeps ``host`` from being looked up, in words; ``""`` when nothing does.

    Checked as the request would encode it, so that a malformed host is refused by name
    rather than by a ``UnicodeError`` from deep in the connection: the socket's IDNA codec
    (an empty label, one over 63 characters) and, as httpx encodes it, the ``idna`` package
    for a host that is not ASCII or starts with ``xn--``.

    Example:
        >>> host_problem("host.example"), host_problem("example..com")
        ('', 'a part between its dots is empty or longer than 63 characters')
    """
    try:
        host.encode("idna")
    except UnicodeError:
        return "a part between its dots is empty or longer than 63 characters"
    if host.isascii() and not host.startswith("xn--"):
        return ""
    try:
        import idna  # (httpx's own dependency: without it no http request is made)
    except ImportError:
        return ""
    try:
        idna.decode(host) if host.isascii() else idna.encode(host)
    except idna.IDNAError as e:
        return f"not a valid international host name ({quote_foreign(e)})"
    return ""


def _problem(url: str) -> tuple[SplitResult | None, str]:
    """``url`` taken apart, and what keeps it from being requested (``""`` when nothing)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is no number or too large)
    except ValueError as e:  # (urlsplit's words may quote the netloc, userinfo and all)
        return None, "is not a URL that can be requested" + ("" if "@" in url else f" ({e})")
    host = parts.hostname
    if not host:
        return parts, "names no host"
    bracketed = parts.netloc.rpartition("@")[2].startswith("[")  # an IP address: no labels
    problem = "" if bracketed else host_problem(host)
    return parts, problem and f"has a malformed host {host!r}: {problem}"


def http_problem(url: str) -> str:
    """What keeps the ``http(s)://`` URL ``url`` from being requested, in words, after the
    URL (which it does not quote); ``""`` when nothing does.

    Example:
        >>> http_problem("https://host.example/m.pt"), http_problem("https:///m.pt")
        ('', 'names no host')
    """
    return _problem(url)[1]


def split_http(url: str) -> SplitResult:
    """An ``http(s)://`` URL taken apart (``urlsplit``), refused where it has no host or a
    malformed one (an unclosed ``[``, a bracketed host that is no IP address, a bad port, a
    host name the request could not encode: see :func:`host_problem`).

    Raises:
        UsageError: the URL (:func:`shown_url`), what is wrong with it, and what to write. A
            refused URL with an ``@`` after its host is taken for a password holding a ``/``,
            ``?`` or ``#``: the message says so and quotes nothing of it.

    Example:
        >>> split_http("https://host.example/m.pt").netloc
        'host.example'
        >>> split_http("https:///m.pt")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: 'https:///m.pt' names no host: write http(s)://HOST/PATH
    """
    parts, problem = _problem(url)
    if parts is not None and not problem:
        return parts
    shown = shown_url(url)
    found = _authority(url)
    if found is not None and "@" in found[3]:
        # Hidden up to the last '@' whatever the host looks like (a malformed one too).
        shown = shown_url(f"{found[0]}{HIDDEN}@{url[len(found[0]) :].rpartition('@')[2]}")
        raise UsageError(
            f"{shown!r} is not a URL that can be requested: its host ends at a '/', '?' or '#' "
            "before the '@' that ends a user name and password; write those characters "
            "percent-encoded (%2F, %3F, %23)",
            path=shown,
        )
    raise UsageError(f"{shown!r} {problem}: write http(s)://HOST/PATH", path=shown)

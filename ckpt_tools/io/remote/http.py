"""Ranged reads over HTTP (``https://``, ``http://`` and the Hub's ``hf://``), with httpx.

Each :meth:`HttpTransport.get` is one ``GET`` with ``Range: bytes=a-b``. The answer is
checked before its body is read: a ``206`` must cover exactly the bytes asked for, and a
``200`` (a server that ignores ``Range``) is refused unless the whole object is no larger
than what was asked, so a metadata read never turns into a download. Redirects are followed
(the Hub sends files from a CDN) without reading their bodies
(:func:`~ckpt_tools.io.remote.redirects.send_following`); httpx drops ``Authorization`` when
a redirect leaves the origin, so the Hub token never reaches the CDN.
"""

from __future__ import annotations

import os
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ckpt_tools._types import ascii_int
from ckpt_tools._version import __version__
from ckpt_tools.errors import (
    CheckpointNotFoundError,
    MissingExtraError,
    Remedy,
    RemoteAccessError,
    RemoteError,
    UsageError,
    quote_foreign,
)
from ckpt_tools.io.remote.httpurls import shown_url
from ckpt_tools.io.remote.rangefile import (
    DOWNLOAD_FIRST,
    SameObject,
    TransferStats,
    check_content_range,
    range_refused,
)
from ckpt_tools.io.remote.redirects import send_following
from ckpt_tools.io.remote.retries import RETRIES, busy_wait
from ckpt_tools.io.remote.urls import at_hub, scheme

if TYPE_CHECKING:
    import httpx

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_TIMEOUT",
    "TIMEOUT_ENV",
    "HttpTransport",
    "import_httpx",
    "make_client",
    "remote_timeout",
]

TIMEOUT_ENV = "CKPT_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT = 30.0
# The longest wait a setting may ask for: a day; a socket cannot wait for inf or 1e300 s.
MAX_TIMEOUT = 86400.0
_UNSATISFIED = re.compile(r"bytes \*/(\d+)")
# What a CDN's signed URL answers once it has expired: the Hub is asked for a new one.
_EXPIRED = (403, 404, 410)
_SLOW = Remedy(text=f"set {TIMEOUT_ENV} to more seconds if the server is slow")


def remote_timeout() -> float:
    """Seconds to wait for a connection or a read: ``CKPT_REMOTE_TIMEOUT``, else 30.

    Raises:
        UsageError: ``CKPT_REMOTE_TIMEOUT`` is not a number of seconds above 0 and at most
            :data:`MAX_TIMEOUT` (a day).

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict("os.environ", {"CKPT_REMOTE_TIMEOUT": "2.5"}):
        ...     remote_timeout()
        2.5
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_TIMEOUT:  # nan, inf, and what a socket cannot wait for
        raise UsageError(
            f"{TIMEOUT_ENV}={text!r} is not a number of seconds above 0 and at most "
            f"{MAX_TIMEOUT:g} (a day)"
        )
    return seconds


def import_httpx(url: str = "https://") -> Any:
    """The httpx module, or MissingExtraError naming the ``remote`` extra.

    Example:
        >>> import_httpx().__name__
        'httpx'
    """
    try:
        import httpx
    except ImportError as e:
        feature = f"reading {scheme(url) or 'https'}:// URLs"
        raise MissingExtraError(feature, "httpx", "remote") from e
    return httpx


def make_client(timeout: float, url: str = "https://") -> httpx.Client:
    """The one httpx client of a session: no compression, ``timeout`` seconds for each
    connect and each read; ``url``, the first URL it reads, names its scheme when httpx is
    missing. It does not follow redirects: httpx would read each one's body whole first
    (:func:`~ckpt_tools.io.remote.redirects.send_following` follows them).

    Example:
        >>> with make_client(5.0) as client:
        ...     client.follow_redirects, client.timeout.read
        (False, 5.0)
    """
    httpx = import_httpx(url)
    headers = {"Accept-Encoding": "identity", "User-Agent": f"ckpt_tools/{__version__}"}
    return httpx.Client(follow_redirects=False, timeout=timeout, headers=headers)


class HttpTransport:
    """One URL read by byte ranges over a shared httpx client.

    A URL that redirects (the Hub's resolve URL, to its CDN) is resolved once: later ranges
    are asked of the URL it redirected to, with the headers that reached it (no token where
    the redirect left the origin), until that URL answers 403, 404 or 410 (a signed URL
    expired), when the URL is resolved again, once.

    Args:
        client: the session's client (:func:`make_client`); closing is the session's job.
        url: the URL as the user gave it (``hf://...`` or ``https://...``): errors name it,
            without its password (:func:`~ckpt_tools.io.remote.urls.shown_url`).
        resolved: the ``http(s)`` URL requests go to; ``url`` when None.
        headers: sent with every request (the Hub token, see
            :func:`~ckpt_tools.io.remote.urls.auth_headers`).
        stats: where the requests a :meth:`get` makes besides its answer's are counted (a
            redirect, an expired URL); the caller counts the answer
            (:class:`~ckpt_tools.io.remote.rangefile.RemoteFile` does).

    Example:
        >>> import httpx
        >>> def server(request):
        ...     return httpx.Response(206, content=b"23", headers={"Content-Range": "bytes 2-3/10"})
        >>> client = httpx.Client(transport=httpx.MockTransport(server))
        >>> HttpTransport(client, "https://host.example/m.bin").get(2, 4)
        (b'23', 10)
    """

    def __init__(
        self,
        client: httpx.Client,
        url: str,
        *,
        resolved: str | None = None,
        headers: dict[str, str] | None = None,
        stats: TransferStats | None = None,
    ) -> None:
        self.url = shown_url(url)
        self.resolved = resolved or url
        self.headers = dict(headers or {})
        self.stats = stats if stats is not None else TransferStats()
        self._client = client
        self._same = SameObject(self.url)  # (the URL as shown: without its password)
        # Where the resolve URL redirected to, and the headers that reached it: a credential
        # (a signed query), kept here and never shown.
        self._final: tuple[str, dict[str, str]] | None = None

    def get(self, start: int, end: int) -> tuple[bytes, int]:
        """The bytes ``[start, min(end, size))`` and the object's size, in one request.

        Args:
            start, end: the range, ``0 <= start < end``.

        Returns:
            ``(data, size)``; ``data`` is empty when ``start`` is at or past the end.

        Raises:
            CheckpointNotFoundError: 404 or 410.
            RemoteAccessError: 401 or 403; the message says which credentials to set.
            RangeNotSupportedError: the server answered with the whole object, larger than
                the range asked for (its body is not read).
            RemoteError: another status, a wrong range, a compressed answer, a 416 that
                does not give the size, a timeout or a failed connection, or a size or
                ETag other than the first answer's (the file changed).
        """
        if not 0 <= start < end:
            raise ValueError(f"bad range [{start}, {end})")
        httpx = import_httpx(self.url)
        try:
            response = self._retried({"Range": f"bytes={start}-{end - 1}"})
            try:
                return self._answer(response, start, end)
            finally:  # unread, the body is dropped with the connection
                response.close()
        except httpx.InvalidURL as e:
            raise UsageError(f"{self.url}: not a URL httpx can request: {quote_foreign(e)}") from e
        except httpx.TimeoutException as e:
            raise self._network_error(e, "no answer", remedies=(_SLOW,)) from e
        except httpx.ConnectError as e:
            raise self._network_error(e, "could not connect to") from e
        except httpx.RequestError as e:
            raise self._network_error(e, "the request failed at") from e

    def close(self) -> None:
        """Nothing to release: the client belongs to the session."""

    def _retried(self, span: dict[str, str]) -> httpx.Response:
        """The answer to a range request, asked again (:data:`RETRIES` times at most) while
        it is a 429 or a 503 with a ``Retry-After``, after the wait that asks for."""
        for asked in range(RETRIES + 1):
            response = self._exchange(span)
            wait = busy_wait(response.status_code, response.headers.get("retry-after"))
            if wait is None:
                return response
            response.close()
            if asked == RETRIES:
                break
            self.stats.add(0)  # the busy answer, a request too
            time.sleep(wait)
        raise RemoteError(
            f"{self._status_error(response)}, asked again {RETRIES} times at the waits its "
            "Retry-After named",
            path=self.url,
        )

    def _exchange(self, span: dict[str, str]) -> httpx.Response:
        """The answer to one range request: asked of the URL a resolve redirected to, else
        (or once that URL has expired) of the resolve URL, its redirects followed."""
        if self._final is not None:
            url, headers = self._final
            response = self._send(url, {**headers, **span})
            if response.status_code not in _EXPIRED:
                return response
            response.close()
            self.stats.add(0)  # the expired URL's answer, a request too
            self._final = None
        response = self._send(self.resolved, {**self.headers, **span})
        if response.history and response.status_code in (200, 206):
            sent = response.request  # (httpx dropped the token if the redirect left the origin)
            token = sent.headers.get("authorization")
            self._final = (str(sent.url), {"Authorization": token} if token else {})
        return response

    def _send(self, url: str, headers: dict[str, str]) -> httpx.Response:
        request = self._client.build_request("GET", url, headers=headers)
        # (each redirect counted)
        return send_following(self._client, request, self.stats, name=self.url)

    def _answer(self, response: httpx.Response, start: int, end: int) -> tuple[bytes, int]:
        data, size = self._read_answer(response, start, end)
        headers = response.headers
        self._same.check(size, headers.get("etag"), headers.get("last-modified"))
        return data, size

    def _read_answer(self, response: httpx.Response, start: int, end: int) -> tuple[bytes, int]:
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if response.status_code in (200, 206) and encoding not in ("", "identity"):
            # A Content-Range counts encoded bytes, and inflating first may cost a
            # thousandfold: the answer is refused on its headers, as asked (identity).
            raise RemoteError(
                f"{self.url}: the server compressed a range answer (Content-Encoding: "
                f"{encoding!r}) though asked not to; its bytes are not the file's (refused "
                "before reading it)",
                path=self.url,
            )
        if response.status_code == 206:
            length, total = check_content_range(
                self.url, response.headers.get("content-range"), start, end
            )
            return self._body(response, length, exact=True), total
        if response.status_code == 200:
            size = _content_length(response)
            if size is not None and size > end - start:
                raise range_refused(self.url, size)
            whole = self._body(response, end - start, exact=False)
            return whole[start:end], len(whole)
        if response.status_code == 416:  # past the end: the size is in the Content-Range
            return b"", self._unsatisfiable(response, start)
        raise self._status_error(response)

    def _unsatisfiable(self, response: httpx.Response, start: int) -> int:
        """The size a 416 answer gives, once it is known to be at or before ``start``: a 416
        to a range inside the file is a refusal, not the file's end."""
        found = _UNSATISFIED.fullmatch(response.headers.get("content-range", "").strip())
        if found is None:  # (not an empty file: a size no answer gave)
            raise RemoteError(
                f"{self.url}: the server refused the range (HTTP 416) without saying the "
                "file's size (no Content-Range: bytes */SIZE)",
                path=self.url,
            )
        size = int(found[1])
        if size > start:
            raise RemoteError(
                f"{self.url}: the server refused a range inside the file (HTTP 416 for the "
                f"bytes from offset {start}, though it says the file is {size} bytes long)",
                path=self.url,
                remedies=(DOWNLOAD_FIRST,),
            )
        return size

    def _body(self, response: httpx.Response, limit: int, *, exact: bool) -> bytes:
        """The body, refused once it grows past ``limit`` bytes (a server that lied about
        its length); with ``exact``, it must be ``limit`` bytes."""
        chunks: list[bytes] = []
        received = 0
        for chunk in response.iter_bytes():  # (identity only: nothing is decoded)
            chunks.append(chunk)
            received += len(chunk)
            if received > limit:
                if exact:
                    raise RemoteError(
                        f"{self.url}: the server sent more than the range asked for", path=self.url
                    )
                raise range_refused(self.url, None)
        if exact and received != limit:
            raise RemoteError(
                f"{self.url}: the answer ended after {received} of {limit} bytes", path=self.url
            )
        return b"".join(chunks)

    def _status_error(self, response: httpx.Response) -> RemoteError | CheckpointNotFoundError:
        status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
        # Answered where a redirect led (a CDN), not where our credentials were sent: told by
        # the hops taken, as httpx normalises the URL it requested (case, %-escapes, dots).
        final = self._final is not None and str(response.request.url) == self._final[0]
        redirected = bool(response.history) or final
        # Where it was answered (a CDN's signed URL, the endpoint an hf:// URL resolves to),
        # without its query: a credential.
        where = f" from {shown_url(str(response.url), target=True)}"
        elsewhere = redirected or not self.url.lower().startswith(("http://", "https://"))
        if response.status_code in (404, 410):
            return CheckpointNotFoundError(
                f"{self.url}: not found ({status}{where if elsewhere else ''})", path=self.url
            )
        if response.status_code in (401, 403):
            return RemoteAccessError(
                f"{self.url}: access refused ({status}{where if redirected else ''})",
                path=self.url,
                remedies=(self._credentials(elsewhere=redirected),),
            )
        return RemoteError(f"{self.url}: {status}{where if elsewhere else ''}", path=self.url)

    def _credentials(self, *, elsewhere: bool = False) -> Remedy:
        if elsewhere:  # a redirect's target: no credentials of ours went there
            return Remedy(
                text="the server it was redirected to refused it (a signed URL there may have "
                "expired: try again), or " + DOWNLOAD_FIRST.text
            )
        if "Authorization" in self.headers:
            return Remedy(
                text="the token in HF_TOKEN (or the token file) cannot read this repo: "
                "a gated repo needs its terms accepted with that account"
            )
        if at_hub(self.url):
            return Remedy(text="set HF_TOKEN to a token that can read it (gated and private repos)")
        sent = urlsplit(self.resolved)  # the URL as given: what was sent
        if sent.username is not None:  # sent as Basic auth, and refused
            return Remedy(
                text="the server refused the credentials in the URL (its user name and "
                "password, or token): check them, or " + DOWNLOAD_FIRST.text
            )
        if sent.query:  # a presigned URL's signature, a token=: sent, and refused
            return Remedy(
                text="the server refused the URL's query (a token or signature in it, which "
                "may have expired): check it, or " + DOWNLOAD_FIRST.text
            )
        return Remedy(
            text="the server wants credentials ckpt_tools does not send: " + DOWNLOAD_FIRST.text
        )

    def _network_error(
        self, error: Exception, what: str, remedies: tuple[Remedy, ...] = ()
    ) -> RemoteError:
        try:  # the redirect that failed, when it was one
            host = str(error.request.url.netloc, "ascii", "replace")  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            host = urlsplit(shown_url(self.resolved, target=True)).netloc
        if remedies:
            what = f"{what} from {host} within {self._client.timeout.read:g} s"
        else:
            what = f"{what} {host}"
        return RemoteError(
            f"{self.url}: {what}: {quote_foreign(error)}", path=self.url, remedies=remedies
        )


def _content_length(response: httpx.Response) -> int | None:
    text = response.headers.get("content-length", "")
    return ascii_int(text)

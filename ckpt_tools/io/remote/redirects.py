"""Redirects followed without reading their bodies into memory.

httpx, left to follow redirects itself, reads each redirect's body whole before it follows
it, and a server may send gigabytes there, or a chunked body that never ends. So the client
does not follow them: httpx still builds each redirect's request
(``Response.next_request``: a relative ``Location`` joined, ``Authorization`` dropped where
the redirect leaves the origin, except an ``http`` to ``https`` upgrade of the same host),
and :func:`send_following` sends it, once it has read at most :data:`REDIRECT_BODY` bytes of
the redirect's body and closed it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_tools.errors import RemoteError, quote_foreign
from ckpt_tools.io.remote.httpurls import host_problem, shown_url
from ckpt_tools.io.remote.rangefile import TransferStats

if TYPE_CHECKING:
    import httpx

__all__ = ["REDIRECT_BODY", "send_following"]

# The most of a redirect's body read: a short one (a line of HTML) is read to its end, which
# leaves the connection open for the next request; a longer one is cut off with it.
REDIRECT_BODY = 64 << 10
_DISCARD_PIECE = 8 << 10


def send_following(
    client: httpx.Client, request: httpx.Request, stats: TransferStats, *, name: str
) -> httpx.Response:
    """The answer to ``request``, its redirects followed as httpx follows them, and as many
    (``client.max_redirects``); each redirect is counted in ``stats`` as a request.

    Args:
        client: the client to send with.
        request: the first request (``client.build_request``).
        stats: where each redirect, and the bytes read of its body, are counted; the final
            answer is the caller's to count.
        name: the URL as errors name it (:func:`shown_url` of the URL given).

    Returns:
        The final answer, its body not read yet (a stream); its ``history`` holds the
        redirects, closed.

    Raises:
        RemoteError: a redirect to something that cannot be requested (a ``mailto:``
            ``Location``, a malformed host): the server's fault, as its ``Location`` is.
        httpx.TooManyRedirects: more redirects than ``client.max_redirects`` (a loop).
        httpx.RequestError: as ``client.send`` raises it.

    Example:
        >>> import httpx
        >>> def server(request):
        ...     if request.url.path == "/old":
        ...         return httpx.Response(302, headers={"Location": "/new"}, content=b"moved")
        ...     return httpx.Response(200, content=b"weights")
        >>> client = httpx.Client(transport=httpx.MockTransport(server))
        >>> stats = TransferStats()
        >>> request = client.build_request("GET", "https://h.example/old")
        >>> answer = send_following(client, request, stats, name="https://h.example/old")
        >>> str(answer.url), answer.read(), len(answer.history), stats.requests
        ('https://h.example/new', b'weights', 1, 1)
    """
    import httpx  # (the caller has it: the remote extra)

    hops: list[httpx.Response] = []
    response = _send(client, request, name)
    while response.next_request is not None:
        following = response.next_request
        stats.add(_discard(response))
        hops.append(response)
        if len(hops) > client.max_redirects:
            raise httpx.TooManyRedirects(
                f"more than {client.max_redirects} redirects", request=following
            )
        _check_target(following, name)
        # The headers httpx chose for the redirect go as they are: no auth added again.
        response = _send(client, following, name, auth=httpx.Auth())
    response.history = hops
    return response


def _send(
    client: httpx.Client, request: httpx.Request, name: str, **options: Any
) -> httpx.Response:
    import httpx

    try:
        return client.send(request, stream=True, follow_redirects=False, **options)
    except (httpx.InvalidURL, UnicodeError) as e:
        # The URL sent was checked (split_http, _check_target): the Location answered is not.
        raise RemoteError(
            f"{name}: the server redirected to something that cannot be requested "
            f"({quote_foreign(e)})",
            path=name,
        ) from e


def _check_target(following: httpx.Request, name: str) -> None:
    """Refuse a redirect to a host that cannot be looked up (``example..com``), naming it,
    before the socket fails on it with a ``UnicodeError``."""
    host = following.url.host
    problem = host_problem(host) if host and ":" not in host else ""  # (an IPv6 address)
    if problem:
        target = shown_url(str(following.url), target=True)
        raise RemoteError(
            f"{name}: the server redirected to {target}, whose host {host!r} cannot be "
            f"requested: {problem}",
            path=name,
        )


def _discard(response: httpx.Response) -> int:
    """Read at most :data:`REDIRECT_BODY` bytes of a redirect's body, then close it;
    returns the bytes read."""
    received = 0
    try:
        if not response.is_stream_consumed:  # (an answer made in memory is read already)
            # raw: a compressed body is not inflated; in pieces that end at the limit
            for chunk in response.iter_raw(chunk_size=_DISCARD_PIECE):
                received += len(chunk)
                if received >= REDIRECT_BODY:
                    break
    finally:
        response.close()
    return received

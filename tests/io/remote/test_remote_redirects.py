"""Redirects answered by a scripted server the suite starts (a plain ``http.server`` that
writes its own answers): a redirect with a huge body, framed by its length or chunked, is
followed without reading that body; a relative ``Location``; a redirect loop; a redirect
to something that cannot be requested.

The server counts the body bytes the kernel took from it before the client hung up: a
client that reads a redirect's body whole makes it write all of it.
"""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_tools.errors import EXIT_REMOTE, RemoteError
from ckpt_tools.io.remote import RemoteSession
from ckpt_tools.io.remote.redirects import REDIRECT_BODY
from tests.helpers.cli import run_ckpt
from tests.helpers.servers import LOCAL, Hit, HubServer, RequestLog

HUGE = 64 << 20  # a redirect's body; far more than any socket buffer holds
SIZE = (3 << 20) + 12345  # the file redirected to: its start and its end are two requests
_CHUNK = 1 << 20


class _Redirecting(BaseHTTPRequestHandler):
    """Answers every GET with a ``302`` to ``server.routes[path]`` (else ``server.location``)
    and ``server.body`` bytes of body, framed by a ``Content-Length`` or chunked
    (``server.chunked``)."""

    protocol_version = "HTTP/1.1"  # (chunked framing)
    server: _RedirectServer

    def do_GET(self) -> None:
        log = self.server.log
        hit = log.add(
            "GET", self.path, self.headers.get("Range"), self.headers.get("Authorization")
        )
        hit.status = 302
        try:
            self.send_response(302)
            self.send_header("Location", self.server.routes.get(self.path, self.server.location))
            if self.server.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(self.server.body))
            self.end_headers()
            self._write_body(hit)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up: what the kernel took is counted
        finally:
            hit.done.set()

    def _write_body(self, hit: Hit) -> None:
        piece = bytes(_CHUNK)
        for _ in range(self.server.body // _CHUNK):
            if self.server.chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            else:
                self.wfile.write(piece)
            hit.sent += len(piece)  # (a write returns once the kernel has taken it all)
        if self.server.chunked:
            self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


class _RedirectServer(ThreadingHTTPServer):
    daemon_threads = True
    log: RequestLog
    location: str
    routes: dict[str, str]
    body: int
    chunked: bool


@pytest.fixture
def redirecting() -> Iterator[_RedirectServer]:
    """A server that redirects every request (set ``location`` or ``routes``, ``body``,
    ``chunked``)."""
    server = _RedirectServer((LOCAL, 0), _Redirecting)
    server.log, server.location, server.routes = RequestLog(), "/", {}
    server.body, server.chunked = 0, False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


def _url(server: _RedirectServer, path: str = "/model.bin") -> str:
    return f"http://{LOCAL}:{server.server_address[1]}{path}"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_redirect_s_body_is_not_read(
    hub: HubServer, redirecting: _RedirectServer, chunked: bool
) -> None:
    """A redirect with 64 MiB of body (its length given, or chunked) is followed: the file
    it names is read, and of that body at most ``REDIRECT_BODY`` bytes are read before hanging
    up, so memory stays bounded and the server could write no more than the sockets' buffers."""
    data = np.random.default_rng(0).bytes(SIZE)
    redirecting.location = hub.put_file("model.bin", data)  # another origin (port)
    redirecting.body, redirecting.chunked = HUGE, chunked
    tracemalloc.start()
    try:
        with RemoteSession() as remote:
            f = remote.open(_url(redirecting))
            assert f.size == SIZE and f.pread(10, SIZE - 10) == data[-10:]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    [hop] = redirecting.log.for_path("/model.bin")
    assert hop.sent < HUGE
    # Once resolved, later ranges go to where it redirected: one redirect in all.
    assert [h.status for h in hub.log.for_path()] == [206, 206]
    assert remote.stats.requests == 3
    redirect_bytes = remote.stats.bytes_received - hub.log.sent()
    assert 0 < redirect_bytes <= REDIRECT_BODY


def test_inspect_verbose_counts_a_redirect_with_a_huge_body_as_one_request(
    hub: HubServer, redirecting: _RedirectServer, tmp_path: Path
) -> None:
    save_file({"w": np.ones((4, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    redirecting.location = hub.put_file("m.safetensors", tmp_path / "m.safetensors")
    redirecting.body, redirecting.chunked = HUGE, True
    code, out, err = run_ckpt("inspect", "--verbose", _url(redirecting, "/m.safetensors"))
    assert code == 0 and "safetensors" in out, err
    assert "remote: 2 requests" in err, err
    assert redirecting.log.sent() < HUGE


def test_a_relative_location_is_joined_to_the_url(
    hub: HubServer, redirecting: _RedirectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Location: /b.bin`` names a path on the server that sent it; the token goes with a
    redirect within the Hub's origin (here the redirecting server), not past it."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_ENDPOINT", _url(redirecting, ""))
    target = hub.put_file("x.bin", b"weights")
    redirecting.routes = {"/a.bin": "/b.bin", "/b.bin": target}
    with RemoteSession() as remote:
        assert remote.open(_url(redirecting, "/a.bin")).read() == b"weights"
    hops = redirecting.log.for_path()
    assert [(h.path, h.authorization) for h in hops] == [
        ("/a.bin", "Bearer hf_secret"), ("/b.bin", "Bearer hf_secret")
    ]  # fmt: skip
    assert [h.authorization for h in hub.log.for_path()] == [None]
    assert remote.stats.requests == 3


def test_a_redirect_loop_is_refused_after_httpx_s_number_of_hops(
    redirecting: _RedirectServer, hub: HubServer
) -> None:
    """A URL that redirects to itself is followed as httpx follows (20 hops), then refused
    with exit 8, every request counted."""
    url = _url(redirecting)
    redirecting.location = url
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    message = str(info.value)
    host = f"{LOCAL}:{redirecting.server_address[1]}"
    assert message.startswith(f"{url}: the request failed at {host}: TooManyRedirects"), message
    assert info.value.exit_code == EXIT_REMOTE and "\n" not in message
    assert redirecting.log.requests() == 21


@pytest.mark.parametrize(
    ("location", "words"),
    [
        ("http://example..com/model.bin", "http://example..com/model.bin, whose host"),
        ("http://xn--/model.bin", "something that cannot be requested"),
        ("mailto:x@y", "something that cannot be requested"),
    ],
)
def test_a_redirect_to_what_cannot_be_requested_is_the_server_s_fault(
    redirecting: _RedirectServer, remote_env: Path, location: str, words: str
) -> None:
    """The URL given is fine; the server's ``Location`` is not: exit 8 (a RemoteError), one
    line naming the URL given and where the server sent it."""
    url = _url(redirecting)
    redirecting.location = location
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    assert str(info.value).startswith(f"{url}: the server redirected to {words}"), info.value
    _, out, err = run_ckpt("inspect", url, code=EXIT_REMOTE)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{url}: the server redirected to {words}" in err, err

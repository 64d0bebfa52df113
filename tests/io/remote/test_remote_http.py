"""Ranged reads over HTTP against real servers started by the suite (tests/helpers/servers.py):
exact bytes at every offset, the requests and bytes each read costs (counted on the server's
side), redirects, tokens, statuses, a server that ignores Range, timeouts and refusals.
"""

from __future__ import annotations

import http.server
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_tools.errors import (
    EXIT_REMOTE,
    EXIT_USAGE,
    CheckpointNotFoundError,
    RangeNotSupportedError,
    RemoteAccessError,
    RemoteError,
    UsageError,
)
from ckpt_tools.io.ranges import pread_chunks
from ckpt_tools.io.remote import RemoteSession
from ckpt_tools.io.remote.http import HttpTransport, make_client
from ckpt_tools.io.remote.rangefile import STREAM_CHUNK
from tests.helpers.servers import DeadEnds, Hit, HubServer, NoRangeServer

SIZE = (3 << 20) + 12345  # several cache blocks, an odd tail
# Offsets and counts around every block size a cache might use, and the file's ends.
EDGES = [0, 1, 4095, 4096, (64 << 10) - 1, 64 << 10, (256 << 10) + 1, (512 << 10) - 1]
OFFSETS = [*EDGES, 1 << 20, 2_345_678, SIZE - 4096, SIZE - 1, SIZE, SIZE + 9]
COUNTS = [*EDGES, (1 << 20) + 3, SIZE]


def _bytes(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _fetched(hit: Hit) -> range:
    """The bytes a request asked for, from its Range header."""
    first, last = hit.range.removeprefix("bytes=").split("-")  # type: ignore[union-attr]
    return range(int(first), int(last) + 1)


@pytest.fixture
def data() -> bytes:
    return _bytes(SIZE)


def test_ranged_reads_return_the_files_bytes(hub: HubServer, data: bytes) -> None:
    url = hub.put("org/m", "model.bin", data)
    rng = random.Random(1)
    pairs = [(o, c) for o in OFFSETS for c in COUNTS]
    pairs += [(rng.randrange(SIZE), rng.randrange(1 << 20)) for _ in range(50)]
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.size == SIZE and f.url == url
        for offset, count in pairs:
            assert f.pread(count, offset) == data[offset : offset + count], (offset, count)
        f.seek(SIZE - 100)
        assert f.read(1000) == data[-100:] and f.read(10) == b""
        f.seek(5)
        assert f.read() == data[5:]
        assert b"".join(pread_chunks(f.pread, 7, SIZE - 7, chunk=STREAM_CHUNK)) == data[7:]
    # What the client counted is what the server counted.
    path = hub.path("org/m", "model.bin")
    assert remote.stats.requests == hub.log.requests(path) == hub.log.requests()
    assert remote.stats.bytes_received == hub.log.sent(path)
    assert all(h.status == 206 and h.sent == len(_fetched(h)) for h in hub.log.hits)


def test_the_first_request_learns_the_size_and_the_cache_saves_requests(
    hub: HubServer, data: bytes
) -> None:
    url = hub.put("org/m", "model.bin", data)
    path = hub.path("org/m", "model.bin")
    with RemoteSession() as remote:
        f = remote.open(url)
        [first] = hub.log.for_path(path)
        head = _fetched(first)
        assert first.status == 206 and head.start == 0 and f.size == SIZE
        assert first.sent == len(head) == remote.stats.bytes_received < SIZE
        # Small reads inside the first block: no request, zero-length reads neither.
        assert f.pread(100, head.stop - 100) == data[head.stop - 100 : head.stop]
        assert f.pread(8, 0) == data[:8] and f.pread(0, 12345) == b""
        assert hub.log.requests(path) == 1
        # A read at the end makes one request...
        assert f.pread(10, SIZE - 5) == data[-5:]
        tail = _fetched(hub.log.for_path(path)[-1])
        assert hub.log.requests(path) == 2 and tail.stop == SIZE
        # ...and a second small read in the block it fetched makes none.
        assert f.pread(3, tail.start) == data[tail.start : tail.start + 3]
        assert f.pread(300, SIZE - 1000) == data[-1000:-700]
        assert hub.log.requests(path) == 2
    assert remote.stats.requests == 2
    assert remote.stats.bytes_received == hub.log.sent() == len(head) + len(tail)


def test_a_read_just_before_the_fetched_tail_fetches_no_byte_twice(
    hub: HubServer, data: bytes
) -> None:
    url = hub.put("org/m", "model.bin", data)
    path = hub.path("org/m", "model.bin")
    with RemoteSession() as remote:
        f = remote.open(url)
        f.pread(10, SIZE - 10)  # the tail block: a zip's end records and directory
        tail = _fetched(hub.log.for_path(path)[-1])
        at = tail.start - 1000  # a last record's local header, just before the tail
        assert f.pread(2000, at) == data[at : at + 2000]
        assert f.pread(50, at + 10) == data[at + 10 : at + 60]
        fetched = [_fetched(h) for h in hub.log.for_path(path)]
    assert fetched[-1] == range(at, tail.start)  # read ahead only up to the cached tail
    assert sum(len(r) for r in fetched) == len(set().union(*fetched))  # no byte twice


def test_a_stream_is_read_in_bounded_chunks(hub: HubServer) -> None:
    data = _bytes(2 * STREAM_CHUNK + 3)
    url = hub.put("org/m", "big.bin", data)
    with RemoteSession() as remote:
        f = remote.open(url)
        pieces = list(pread_chunks(f.pread, 1, len(data) - 1, chunk=STREAM_CHUNK))
    assert b"".join(pieces) == data[1:]
    assert max(len(p) for p in pieces) <= STREAM_CHUNK
    assert max(h.sent for h in hub.log.hits) <= STREAM_CHUNK + 3
    assert remote.stats.requests == hub.log.requests()
    assert remote.stats.bytes_received == hub.log.sent()


@pytest.mark.parametrize("size", [0, 1, 1000, 60_000])
def test_small_and_empty_files_cost_one_request(hub: HubServer, size: int) -> None:
    data = _bytes(size)
    url = hub.put("org/m", "small.bin", data)
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.size == size
        assert f.pread(size + 10, 0) == data and f.pread(5, max(0, size - 3)) == data[-3:]
        assert f.read() == data
    assert hub.log.requests() == 1 == remote.stats.requests
    assert [h.status for h in hub.log.hits] == [416 if size == 0 else 206]


def test_plain_https_urls_and_a_shared_count(hub: HubServer, data: bytes) -> None:
    first = hub.put_file("runs/a.pt", data)
    second = hub.put_file("runs/b c.pt", b"tiny")
    with RemoteSession() as remote:
        assert remote.open(first).pread(5, SIZE - 5) == data[-5:]
        assert remote.open(second).pread(10, 0) == b"tiny"
    assert hub.log.requests("/files/runs/b%20c.pt") == 1
    assert hub.log.sent("/files/runs/b%20c.pt") == 4
    assert remote.stats.requests == hub.log.requests() >= 2
    assert remote.stats.bytes_received == hub.log.sent()


# --- hf:// --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("revision", "kind", "written"),
    [
        ("main", "models", "hf://org/m/sub/w.bin"),
        ("v1.0", "models", "hf://org/m@v1.0/sub/w.bin"),
        ("refs/pr/1", "models", "hf://org/m@refs/pr/1/sub/w.bin"),
        ("refs/pr/1", "models", "hf://org/m@refs%2Fpr%2F1/sub/w.bin"),
        ("main", "datasets", "hf://datasets/org/m/sub/w.bin"),
        ("dev", "datasets", "hf://datasets/org/m@dev/sub/w.bin"),
    ],
)
def test_hf_urls_resolve_at_hf_endpoint(
    hub: HubServer, revision: str, kind: str, written: str
) -> None:
    hub.put("org/m", "sub/w.bin", b"weights", revision=revision, kind=kind)
    with RemoteSession() as remote:
        f = remote.open(written)
        assert f.read() == b"weights" and f.url == written
    [hit] = hub.log.hits
    assert hit.path == hub.path("org/m", "sub/w.bin", revision=revision, kind=kind)
    assert hit.authorization is None  # no token set, none sent


def test_redirects_are_followed_and_the_token_stays_at_the_hub(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub answers resolve URLs with a redirect to its CDN, another origin: the file is
    resolved once, its later ranges asked of the CDN URL it redirected to, the token sent to
    the Hub and never to the CDN, and every request counted, the redirect too."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    url = hub.put("org/m", "model.bin", data)
    hub.redirect = True
    hub.signature = "?Expires=1&Signature=SIGSECRET"
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.pread(10, SIZE - 10) == data[-10:]
        assert f.pread(10, SIZE // 2) == data[SIZE // 2 : SIZE // 2 + 10]
    resolve, cdn, *cdn_again = hub.log.hits
    assert resolve.path == hub.path("org/m", "model.bin") and len(cdn_again) == 2
    assert resolve.status == 302 and resolve.sent == 0
    assert all(h.path == "/cdn/models/org/m/main/model.bin" for h in [cdn, *cdn_again])
    assert cdn.status == 206 and cdn.range == resolve.range and cdn.sent == len(_fetched(cdn))
    assert all(h.status == 206 and h.sent == len(_fetched(h)) for h in cdn_again)
    assert resolve.authorization == "Bearer hf_secret"
    assert all(h.authorization is None for h in [cdn, *cdn_again])
    assert remote.stats.requests == 4 == hub.log.requests()
    assert remote.stats.bytes_received == hub.log.sent()


def test_a_missing_file_is_not_found(hub: HubServer) -> None:
    with RemoteSession() as remote, pytest.raises(CheckpointNotFoundError) as info:
        remote.open("hf://org/m/nope.bin")
    err = info.value
    assert err.path == "hf://org/m/nope.bin" and err.exit_code == EXIT_USAGE
    assert isinstance(err, FileNotFoundError)
    assert "hf://org/m/nope.bin: not found (HTTP 404 Not Found from http://" in str(err)
    assert "\n" not in str(err)


def test_a_gated_repo_needs_hf_token(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    url = hub.put("org/gated", "model.bin", b"gated weights")
    hub.gated["org/gated"] = "hf_granted"
    with RemoteSession() as remote, pytest.raises(RemoteAccessError) as info:
        remote.open(url)
    err = info.value
    assert isinstance(err, PermissionError) and err.exit_code == EXIT_REMOTE
    assert "HTTP 401" in str(err) and "set HF_TOKEN" in str(err) and "gated" in str(err)

    monkeypatch.setenv("HF_TOKEN", "hf_other")
    with RemoteSession() as remote, pytest.raises(RemoteAccessError, match="HTTP 403") as info:
        remote.open(url)
    assert "HF_TOKEN" in str(info.value) and "hf_other" not in str(info.value)

    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    with RemoteSession() as remote:
        assert remote.open(url).read() == b"gated weights"
    assert hub.log.hits[-1].authorization == "Bearer hf_granted"


@pytest.mark.parametrize("where", ["HF_HOME", "HF_TOKEN_PATH"])
def test_the_token_file_is_read_when_hf_token_is_unset(
    hub: HubServer, remote_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    url = hub.put("org/gated", "model.bin", b"gated weights")
    hub.gated["org/gated"] = "hf_from_file"
    token_file = remote_env / "token"
    if where == "HF_TOKEN_PATH":
        token_file = tmp_path / "elsewhere" / "my-token"
        token_file.parent.mkdir()
        monkeypatch.setenv("HF_TOKEN_PATH", str(token_file))
    token_file.write_text("hf_from_file\n")
    with RemoteSession() as remote:
        assert remote.open(url).read() == b"gated weights"
    assert hub.log.hits[-1].authorization == "Bearer hf_from_file"


def test_no_token_for_other_hosts(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    at_hub = hub.put_file("x.pt", b"x")
    elsewhere = at_hub.replace("127.0.0.1", "localhost")  # same server, another origin
    with RemoteSession() as remote:
        remote.open(at_hub)
        remote.open(elsewhere)
    assert [h.authorization for h in hub.log.hits] == ["Bearer hf_secret", None]


def test_other_statuses_are_remote_errors(hub: HubServer) -> None:
    url = hub.put("org/m", "model.bin", b"x")
    hub.statuses[hub.path("org/m", "model.bin")] = 503
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    assert not isinstance(info.value, CheckpointNotFoundError)
    assert "HTTP 503 Service Unavailable" in str(info.value) and info.value.exit_code == 8


@pytest.mark.parametrize("redirect", [False, True])
@pytest.mark.parametrize("grown", [0, 100])
def test_a_file_replaced_while_read_is_refused(
    hub: HubServer, data: bytes, grown: int, redirect: bool
) -> None:
    """The file is overwritten between two reads (the same size, or larger): the second
    answer's ETag or size is not the first's, and its bytes are not returned; the same when
    the second is asked of the CDN URL the first was redirected to."""
    url = hub.put("org/m", "model.bin", data)
    hub.redirect = redirect
    with RemoteSession() as remote:
        f = remote.open(url)
        hub.put("org/m", "model.bin", _bytes(SIZE + grown, seed=1))
        with pytest.raises(RemoteError, match="the remote file changed while it was read") as info:
            f.pread(10, SIZE // 2)
    assert info.value.exit_code == EXIT_REMOTE and "\n" not in str(info.value)
    assert str(info.value).startswith(f"{url}: ") and "read it again" in str(info.value)


# --- a server that ignores Range ----------------------------------------------------------


def test_a_server_that_ignores_range_is_refused_before_its_body_is_read(
    no_range: NoRangeServer,
) -> None:
    """It answers 200 with the whole file: refused on its headers, no body byte taken.

    The server's own count is larger than what the client took (from 64 KiB to a few MB,
    as the kernel autotunes): it writes until the socket buffers of both ends are full,
    then the client's hang-up (a reset: it closed with unread data) stops it. httpx reads
    the socket in 64 KiB pieces, so at most one such piece of the body came with the
    headers, and none of it is used. The bound is the buffers, not the file: the file here
    is larger than both.
    """
    size = 64 << 20
    url = no_range.put("big.bin", _bytes(size))
    with RemoteSession() as remote, pytest.raises(RangeNotSupportedError) as info:
        remote.open(url)
    message = str(info.value)
    assert f"would send the whole {size}-byte file (refused before reading it)" in message
    assert "download the file and pass the local path" in message and "\n" not in message
    assert info.value.exit_code == EXIT_REMOTE and info.value.path == url
    assert remote.stats.bytes_received == 0
    [hit] = no_range.log.for_path("/big.bin")  # waits for the server to stop writing
    assert hit.status == 200 and hit.range.startswith("bytes=0-")  # type: ignore[union-attr]
    assert hit.sent < size


def test_a_whole_answer_no_larger_than_asked_is_accepted(no_range: NoRangeServer) -> None:
    """A small file answered whole is what was asked for, and more: it is read."""
    data = _bytes(1000)
    url = no_range.put("small.bin", data)
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.size == 1000 and f.pread(10, 990) == data[-10:] and f.read() == data
    assert no_range.log.requests() == 1 == remote.stats.requests
    with make_client(5.0) as client:
        assert HttpTransport(client, url).get(0, 1000) == (data, 1000)
        with pytest.raises(RangeNotSupportedError, match="whole 1000-byte file"):
            HttpTransport(client, url).get(0, 999)


def test_a_whole_answer_to_a_later_range_is_cut_to_it(no_range: NoRangeServer) -> None:
    data = _bytes(1000)
    url = no_range.put("small.bin", data)
    with make_client(5.0) as client:
        assert HttpTransport(client, url).get(990, 2000) == (data[990:], 1000)
        assert HttpTransport(client, url).get(100, 1200) == (data[100:1000], 1000)


# --- the network fails --------------------------------------------------------------------


def test_a_server_that_never_answers_times_out(
    remote_env: Path, dead_ends: DeadEnds, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "0.3")
    url = f"{dead_ends.stalled}/model.bin"
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    message = str(info.value)
    host = dead_ends.stalled.split("://")[1]
    assert message.startswith(f"{url}: no answer from {host} within 0.3 s")
    assert "set CKPT_REMOTE_TIMEOUT to more seconds" in message and "\n" not in message
    assert info.value.exit_code == EXIT_REMOTE and isinstance(info.value, OSError)


def test_a_refused_connection_is_one_line(remote_env: Path, dead_ends: DeadEnds) -> None:
    url = f"{dead_ends.refused}/model.bin"
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    message = str(info.value)
    host = dead_ends.refused.split("://")[1]
    assert message.startswith(f"{url}: could not connect to {host}: ConnectError: ")
    assert "refused" in message.lower() and "\n" not in message
    assert info.value.exit_code == EXIT_REMOTE


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_timeout_setting_is_a_usage_error(
    remote_env: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", value)
    with pytest.raises(UsageError, match="CKPT_REMOTE_TIMEOUT"):
        RemoteSession()


def test_a_file_replaced_while_read_never_shows_the_url_s_password(hub: HubServer) -> None:
    url = hub.put_file("plain.bin", _bytes(SIZE))
    secret = url.replace("://", "://me:s3cret@", 1)
    with RemoteSession() as remote:
        f = remote.open(secret)
        hub.put_file("plain.bin", _bytes(SIZE + 4096, seed=1))
        with pytest.raises(RemoteError, match="changed while it was read") as info:
            f.pread(10, SIZE // 2)
    assert "s3cret" not in str(info.value) and "***@" in str(info.value)


@pytest.fixture
def refuses_everyone(remote_env: Path) -> Iterator[str]:
    """A server that answers 401 to every request, credentials or not: its base URL."""

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="weights"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = _refuse

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("userinfo", ["", "user:wrong@"])
def test_refused_credentials_are_told_apart_from_none(refuses_everyone: str, userinfo: str) -> None:
    url = f"http://{userinfo}{refuses_everyone}/model.pt"
    with RemoteSession() as remote, pytest.raises(RemoteAccessError) as info:
        remote.open(url)
    message = str(info.value)
    assert "HTTP 401" in message and "wrong" not in message
    if userinfo:  # sent as Basic auth: they were refused, not left out
        assert "refused the credentials in the URL" in message
    else:
        assert "wants credentials ckpt_tools does not send" in message

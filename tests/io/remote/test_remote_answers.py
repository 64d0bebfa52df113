"""Answers a plain file server would not give, scripted at the suite's Hub look-alike
(tests/helpers/servers.py): a CDN URL that expires, a busy server (429, 503) with and
without Retry-After, a compressed answer to a range, a 416 that does not give the size.
"""

from __future__ import annotations

import gzip
import random

import pytest
from starlette.responses import Response

from ckpt_tools.errors import EXIT_REMOTE, CheckpointNotFoundError, RemoteAccessError, RemoteError
from ckpt_tools.io.remote import RemoteSession
from ckpt_tools.io.remote.retries import MAX_RETRY_WAIT, RETRIES, retry_after
from tests.helpers.servers import HubServer

SIZE = (3 << 20) + 12345  # several cache blocks: its start and its end are two requests


@pytest.fixture
def data() -> bytes:
    return random.Random(0).randbytes(SIZE)


def _answers_first(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, path: str, *responses: Response | None
) -> None:
    """The hub answers ``path``'s first requests with ``responses``, in order (None: as it
    always does); later ones, and every other path, as it always does."""
    queue, answer = list(responses), hub.answer

    def first(raw_path: str, authorization: str | None) -> Response:
        response = queue.pop(0) if raw_path == path and queue else None
        return answer(raw_path, authorization) if response is None else response

    monkeypatch.setattr(hub, "answer", first)


# --- a CDN URL that expires ------------------------------------------------------------


@pytest.mark.parametrize("status", [403, 404, 410])
def test_an_expired_cdn_url_is_resolved_again_once(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """A signed CDN URL that stops answering (expired: 403, or 404, 410) is resolved again
    at the Hub, with the token, and the read goes on at the new one; each request counted."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    url = hub.put("org/m", "model.bin", data)
    hub.redirect = True
    cdn = "/cdn/models/org/m/main/model.bin"
    _answers_first(hub, monkeypatch, cdn, None, Response(status_code=status))
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.pread(10, SIZE - 10) == data[-10:]
        assert f.pread(10, SIZE // 2) == data[SIZE // 2 : SIZE // 2 + 10]
    hits = hub.log.for_path()
    assert [(h.path == cdn, h.status) for h in hits] == [
        (False, 302), (True, 206), (True, status), (False, 302), (True, 206), (True, 206)
    ]  # fmt: skip
    assert [h.authorization for h in hits if h.path != cdn] == ["Bearer hf_secret"] * 2
    assert remote.stats.requests == 6 == hub.log.requests()
    assert remote.stats.bytes_received == hub.log.sent()


def test_a_cdn_url_failing_again_after_resolving_is_refused(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolved again once, not in a loop; the failure names the CDN without its signature."""
    url = hub.put("org/m", "model.bin", data)
    hub.redirect = True
    hub.signature = "?Expires=1&Signature=SIGSECRET"
    cdn = "/cdn/models/org/m/main/model.bin"
    gone = Response(status_code=404)
    _answers_first(hub, monkeypatch, cdn, None, gone, Response(status_code=404))
    with RemoteSession() as remote:
        f = remote.open(url)
        with pytest.raises(CheckpointNotFoundError) as info:
            f.pread(10, SIZE - 10)
    assert [h.status for h in hub.log.for_path()] == [302, 206, 404, 302, 404]
    message = str(info.value)
    assert f"not found (HTTP 404 Not Found from http://localhost:{hub.port}{cdn})" in message
    assert "SIGSECRET" not in message and "Expires" not in message


def test_a_cdn_refusing_after_resolving_is_named_not_blamed_on_the_token(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 403 from the CDN a Hub file redirects to: no token was sent there, so the refusal
    names the CDN (without its signature) and does not blame HF_TOKEN."""
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETTOKEN")
    url = hub.put("org/m", "model.bin", data)
    hub.redirect = True
    hub.signature = "?Expires=1&Signature=SIGSECRET"
    cdn = "/cdn/models/org/m/main/model.bin"
    refused = Response(status_code=403)
    _answers_first(hub, monkeypatch, cdn, None, refused, Response(status_code=403))
    with RemoteSession() as remote:
        f = remote.open(url)
        with pytest.raises(RemoteAccessError) as info:
            f.pread(10, SIZE - 10)
    message = str(info.value)
    assert f"access refused (HTTP 403 Forbidden from http://localhost:{hub.port}{cdn})" in message
    assert "redirected to refused it" in message and "HF_TOKEN" not in message
    assert "SIGSECRET" not in message and "SECRETTOKEN" not in message


# --- answers refused -------------------------------------------------------------------


def test_a_416_without_content_range_is_refused_not_taken_as_empty(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 416 says the range lies past the end only with ``Content-Range: bytes */SIZE``;
    without it the size is unknown, and the file is not an empty one (exit 4)."""
    url = hub.put("org/m", "model.bin", random.Random(1).randbytes(1000))
    _answers_first(hub, monkeypatch, hub.path("org/m", "model.bin"), Response(status_code=416))
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    message = str(info.value)
    assert message.startswith(f"{url}: the server refused the range (HTTP 416) without "), message
    assert "the file's size" in message and "\n" not in message
    assert info.value.exit_code == EXIT_REMOTE and info.value.path == url
    with RemoteSession() as remote:  # answered with its size, an empty file is read as one
        assert remote.open(hub.put("org/m", "empty.bin", b"")).size == 0


@pytest.mark.parametrize("first", [True, False])
def test_a_416_to_a_range_inside_the_file_is_refused_not_taken_as_its_end(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """``416`` with ``Content-Range: bytes */SIZE`` means the range starts at or past SIZE;
    to a range that starts inside the file it is a refusal (exit 8), not an end of file
    that would make the checkpoint look truncated (exit 4)."""
    url = hub.put("org/m", "model.bin", data)
    refusal = Response(status_code=416, headers={"Content-Range": f"bytes */{SIZE}"})
    answers = (refusal,) if first else (None, refusal)
    _answers_first(hub, monkeypatch, hub.path("org/m", "model.bin"), *answers)
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url).pread(10, SIZE // 2)
    message = str(info.value)
    offset = 0 if first else SIZE // 2
    assert message.startswith(f"{url}: the server refused a range inside the file (HTTP 416 ")
    assert f"from offset {offset}, though it says the file is {SIZE} bytes long" in message
    assert info.value.exit_code == EXIT_REMOTE and "download the file" in message


@pytest.mark.parametrize("bomb", [False, True])
def test_a_compressed_range_answer_is_refused_before_its_body_is_read(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, bomb: bool
) -> None:
    """A Content-Range counts the encoded bytes, so a gzip answer to a range is not the
    file's bytes, even where it inflates to as many: refused on its headers, never inflated
    (a small body may inflate a thousandfold)."""
    data = random.Random(1).randbytes(1000)
    url = hub.put("org/m", "model.bin", data)
    body = gzip.compress(bytes(16 << 20) if bomb else data)
    size = len(body) if bomb else len(data)  # what the encoded or the inflated bytes match
    headers = {"Content-Range": f"bytes 0-{size - 1}/{size}", "Content-Encoding": "gzip"}
    answer = Response(body, status_code=206, headers=headers)
    _answers_first(hub, monkeypatch, hub.path("org/m", "model.bin"), answer)
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    message = str(info.value)
    assert message.startswith(f"{url}: the server compressed a range answer "), message
    assert "'gzip'" in message and "\n" not in message and info.value.exit_code == EXIT_REMOTE
    assert remote.stats.bytes_received == 0


def _busy(status: int, wait: str | None = "0") -> Response:
    """A 429 or 503, with a Retry-After of ``wait`` (seconds or a date) where it is given."""
    return Response(status_code=status, headers={} if wait is None else {"Retry-After": wait})


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_server_is_asked_again_after_its_retry_after(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """A rate limit (429) or a busy server (503) that says when to come back is asked again
    then, as often as it takes up to the limit; each request counted."""
    url = hub.put("org/m", "model.bin", data)
    path = hub.path("org/m", "model.bin")
    past = "Thu, 01 Jan 2015 00:00:00 GMT"  # a date already past: no wait
    _answers_first(hub, monkeypatch, path, *[_busy(status), _busy(status, past), _busy(status)])
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.pread(10, SIZE - 10) == data[-10:]
    assert [h.status for h in hub.log.for_path()] == [status] * RETRIES + [206, 206]
    assert remote.stats.requests == RETRIES + 2 == hub.log.requests()
    assert remote.stats.bytes_received == hub.log.sent()


@pytest.mark.parametrize("status", [429, 503])
def test_a_server_busy_past_the_retries_is_a_remote_error(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    url = hub.put("org/m", "model.bin", data)
    path = hub.path("org/m", "model.bin")
    _answers_first(hub, monkeypatch, path, *[_busy(status)] * (RETRIES + 1))
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open(url)
    message = str(info.value)
    assert message.startswith(f"{url}: HTTP {status} "), message
    assert f"asked again {RETRIES} times" in message and "\n" not in message
    assert info.value.exit_code == EXIT_REMOTE and info.value.path == url
    assert hub.log.requests() == RETRIES + 1


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_server_without_retry_after_is_not_asked_again(
    hub: HubServer, data: bytes, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    url = hub.put("org/m", "model.bin", data)
    _answers_first(hub, monkeypatch, hub.path("org/m", "model.bin"), _busy(status, None))
    with RemoteSession() as remote, pytest.raises(RemoteError, match=f"HTTP {status} ") as info:
        remote.open(url)
    assert "asked again" not in str(info.value) and hub.log.requests() == 1


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("0", 0.0),
        ("2", 2.0),
        (" 7 ", 7.0),
        (str(int(MAX_RETRY_WAIT) + 1), MAX_RETRY_WAIT),
        ("9" * 400, MAX_RETRY_WAIT),
        ("Thu, 01 Jan 2015 00:00:00 GMT", 0.0),
        ("Fri, 31 Dec 9999 23:59:59 GMT", MAX_RETRY_WAIT),
        (None, None),
        ("", None),
        ("-1", None),
        ("1.5", None),
        ("soon", None),
        ("\u00b2", None),
    ],
)
def test_retry_after_is_read_as_seconds_or_a_date_and_capped(
    header: str | None, seconds: float | None
) -> None:
    assert retry_after(header) == seconds

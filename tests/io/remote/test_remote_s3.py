"""Ranged reads of s3:// URLs against moto's S3 server, started by the suite, with the AWS
environment set for each test only (tests/helpers/servers.py): exact bytes, the requests and
bytes counted on the server's side, missing objects, refused and missing credentials, an
endpoint that never answers or refuses; and a scripted endpoint whose 503s botocore retries
by itself, each attempt counted.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_tools.errors import (
    EXIT_REMOTE,
    EXIT_USAGE,
    CheckpointNotFoundError,
    RemoteAccessError,
    RemoteError,
    UsageError,
)
from ckpt_tools.io.remote import RemoteSession
from tests.helpers.cli import run_ckpt
from tests.helpers.servers import LOCAL, DeadEnds, Hit, RequestLog, S3Bucket

SIZE = (2 << 20) + 777


def _bytes(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def _asked(hit: Hit, size: int) -> range:
    """The bytes a ranged GET asked for, within the object."""
    first, last = hit.range.removeprefix("bytes=").split("-")  # type: ignore[union-attr]
    return range(int(first), min(int(last) + 1, size))


def test_ranged_reads_return_the_objects_bytes(s3: S3Bucket) -> None:
    data = _bytes(SIZE)
    url = s3.put("runs/exp 1/last.ckpt", data)
    rng = random.Random(2)
    offsets = [0, 1, 65535, 65536, 262144, 1 << 20, SIZE - 1, SIZE, SIZE + 5]
    counts = [0, 1, 100, 65536, 262145, SIZE]
    pairs = [(o, c) for o in offsets for c in counts]
    pairs += [(rng.randrange(SIZE), rng.randrange(300_000)) for _ in range(20)]
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.size == SIZE and f.url == url
        for offset, count in pairs:
            assert f.pread(count, offset) == data[offset : offset + count], (offset, count)
        f.seek(3)
        assert f.read() == data[3:]
    path = s3.path("runs/exp 1/last.ckpt")
    gets = s3.server.log.for_path(method="GET")
    assert {h.path for h in gets} == {path} and all(h.status == 206 for h in gets)
    assert [h.sent for h in gets] == [len(_asked(h, SIZE)) for h in gets]
    assert remote.stats.requests == len(gets)
    assert remote.stats.bytes_received == s3.server.log.sent(path, "GET")


def test_the_first_request_learns_the_size(s3: S3Bucket) -> None:
    url = s3.put("m.safetensors", _bytes(SIZE))
    with RemoteSession() as remote:
        f = remote.open(url)
        [first] = s3.server.log.for_path(method="GET")
        assert f.size == SIZE and first.range.startswith("bytes=0-")  # type: ignore[union-attr]
        assert first.sent == remote.stats.bytes_received < SIZE
        f.pread(16, 8)
        assert s3.server.log.requests(method="GET") == 1


@pytest.mark.parametrize("size", [0, 1, 1000])
def test_small_and_empty_objects(s3: S3Bucket, size: int) -> None:
    data = _bytes(size)
    url = s3.put("small.pt", data)
    with RemoteSession() as remote:
        f = remote.open(url)
        assert f.size == size and f.read() == data and f.pread(10, size) == b""
    assert remote.stats.requests == s3.server.log.requests(method="GET") == 1


@pytest.mark.parametrize("url", ["s3://ckpts/nope.pt", "s3://no-such-bucket/x.pt"])
def test_a_missing_object_is_not_found(s3: S3Bucket, url: str) -> None:
    with RemoteSession() as remote, pytest.raises(CheckpointNotFoundError) as info:
        remote.open(url)
    assert info.value.path == url and str(info.value).startswith(f"{url}: not found (S3 NoSuch")


def test_refused_credentials(s3: S3Bucket) -> None:
    """The server checks signatures against keys it issued: ours are refused."""
    url = s3.put("m.pt", b"weights")
    s3.server.check_credentials(True)
    with RemoteSession() as remote, pytest.raises(RemoteAccessError) as info:
        remote.open(url)
    message = str(info.value)
    assert "access refused (S3 InvalidAccessKeyId)" in message and "AWS_ACCESS_KEY_ID" in message
    assert isinstance(info.value, PermissionError) and info.value.exit_code == EXIT_REMOTE


def test_no_credentials(s3: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    url = s3.put("m.pt", b"weights")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with RemoteSession() as remote, pytest.raises(RemoteAccessError) as info:
        remote.open(url)
    assert "Unable to locate credentials" in str(info.value)
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(info.value)
    assert s3.server.log.requests(method="GET") == 0  # nothing was sent unsigned


# Credentials from the config file's credential_process only.
_NO_KEYS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}


@pytest.mark.parametrize(
    ("settings", "error", "says"),
    [
        ({"AWS_PROFILE": "no-such-profile"}, RemoteAccessError, "no-such-profile"),
        ({"AWS_SECRET_ACCESS_KEY": ""}, RemoteAccessError, "AWS_SECRET_ACCESS_KEY"),
        ({"AWS_DEFAULT_REGION": "us east"}, UsageError, "us east"),
        ({"AWS_CONFIG_FILE": "BROKEN"}, UsageError, "Unable to parse config file"),
        ({"AWS_CONFIG_FILE": "FALSE", **_NO_KEYS}, RemoteAccessError, "custom-process"),
        ({"AWS_CONFIG_FILE": "MISSING", **_NO_KEYS}, RemoteAccessError, "/nonexistent/cmd"),
    ],
    ids=["profile", "partial", "region", "config-file", "process-fails", "process-missing"],
)
def test_aws_settings_botocore_refuses_are_said_in_one_line(
    s3: S3Bucket,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    settings: dict[str, str],
    error: type[Exception],
    says: str,
) -> None:
    # Refused while the client is made, before a request: as a missing credential is.
    url = s3.put("m.pt", b"weights")
    configs = {
        "BROKEN": "[default\nbroken",
        "FALSE": "[default]\ncredential_process = /bin/false\n",
        "MISSING": "[default]\ncredential_process = /nonexistent/cmd\n",
    }
    for name, value in settings.items():
        if value in configs:
            (tmp_path / value).write_text(configs[value])
            value = str(tmp_path / value)
        monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name)
    with RemoteSession() as remote, pytest.raises(error) as info:
        remote.open(url)
    assert says in str(info.value) and "\n" not in str(info.value)
    assert s3.server.log.requests(method="GET") == 0


def test_an_endpoint_that_never_answers(
    s3: S3Bucket, dead_ends: DeadEnds, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead_ends.stalled)
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "0.2")
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open("s3://ckpts/m.pt")
    message = str(info.value)
    assert f"S3 endpoint {dead_ends.stalled}" in message and "CKPT_REMOTE_TIMEOUT" in message
    assert "\n" not in message


def test_an_endpoint_that_refuses(
    s3: S3Bucket, dead_ends: DeadEnds, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead_ends.refused)
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open("s3://ckpts/m.pt")
    assert f"S3 endpoint {dead_ends.refused}" in str(info.value)
    assert "Could not connect" in str(info.value) and "\n" not in str(info.value)


def test_an_endpoint_s_password_is_never_shown(
    s3: S3Bucket, dead_ends: DeadEnds, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_ENDPOINT_URL`` may hold a password: the error names the endpoint, and quotes
    botocore's words (which hold its URL), without it."""
    endpoint = dead_ends.refused.replace("://", "://u:EPSECRET@")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with RemoteSession() as remote, pytest.raises(RemoteError) as info:
        remote.open("s3://ckpts/m.pt")
    message = str(info.value)
    assert "EPSECRET" not in message and "Could not connect" in message
    assert f"S3 endpoint {dead_ends.refused.replace('://', '://***@')}: " in message


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("localhost:9000", "is not an http(s) URL: write {}=https://localhost:9000"),
        ("ftp://minio:EPSECRET@host", "is not an http(s) URL: write {}=https://***@host"),
        ("http://minio:EPSECRET@minio_1:9000", "is not an http(s) URL with a host botocore"),
    ],
)
def test_an_endpoint_variable_botocore_refuses_is_a_usage_error(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch, variable: str, endpoint: str, words: str
) -> None:
    """No scheme, another scheme, a host name with '_' (a docker-compose service's): one
    line naming the variable and what to write, exit 2 as for HF_ENDPOINT, its password
    unshown, nothing sent."""
    monkeypatch.setenv(variable, endpoint)
    shown = endpoint.replace("minio:EPSECRET@", "***@")
    for command in ("inspect", "scan"):
        _, out, err = run_ckpt(command, "s3://ckpts/m.pt", code=EXIT_USAGE)
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert f"{variable}={shown!r} {words.format(variable)}" in err, err
        assert "EPSECRET" not in err
    assert s3.server.log.requests() == 0


@pytest.mark.parametrize(
    ("endpoint", "code"),
    [
        ("http://minio:EPSECRET@minio_1:9000", EXIT_USAGE),
        ("ftp://minio:EPSECRET@host", EXIT_REMOTE),
    ],
)
def test_an_endpoint_of_the_aws_config_file_is_shown_without_its_password(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str, code: int
) -> None:
    """botocore reads ``endpoint_url`` from the AWS config file where no variable is set:
    one it refuses is one line too, whatever its scheme, its password shown as ``***``."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    config = tmp_path / "aws-config"
    config.write_text(f"[default]\nendpoint_url = {endpoint}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    _, out, err = run_ckpt("inspect", "s3://ckpts/m.pt", code=code)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert "EPSECRET" not in err and endpoint.replace("minio:EPSECRET@", "***@") in err, err


def test_a_local_path_is_never_read_as_s3(s3: S3Bucket, tmp_path: Path) -> None:
    with RemoteSession() as remote, pytest.raises(ValueError, match="not a URL"):
        remote.open(str(tmp_path / "s3:" / "x.pt"))


@pytest.mark.parametrize("grown", [0, 100])
def test_an_object_replaced_while_read_is_refused(s3: S3Bucket, grown: int) -> None:
    """Another upload to the key between two reads: the second answer's ETag (and size)
    are not the first's, and nothing of the new object is returned as the old one's."""
    url = s3.put("m.pt", _bytes(SIZE))
    with RemoteSession() as remote:
        f = remote.open(url)
        s3.put("m.pt", _bytes(SIZE + grown, seed=1))
        with pytest.raises(RemoteError, match="the remote file changed while it was read") as info:
            f.pread(10, SIZE // 2)
    assert info.value.exit_code == EXIT_REMOTE and "\n" not in str(info.value)


# --- botocore's own retries -----------------------------------------------------------------

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class _Scripted(BaseHTTPRequestHandler):
    """An S3 endpoint of one object, ``server.data`` at every key, that answers its first
    ``server.busy`` GETs with ``503 SlowDown`` (which botocore retries by itself), then each
    range as S3 does: ``206`` with ``Content-Range``, an ETag and a date."""

    protocol_version = "HTTP/1.1"
    server: _ScriptedS3

    def do_GET(self) -> None:
        hit = self.server.log.add("GET", self.path, self.headers.get("Range"), None)
        data = self.server.data
        if self.server.busy > 0:
            self.server.busy -= 1
            status, body, headers = 503, _SLOW_DOWN, {"Content-Type": "application/xml"}
        else:
            first, last = hit.range.removeprefix("bytes=").split("-")  # type: ignore[union-attr]
            start, stop = int(first), min(int(last) + 1, len(data))
            status, body = 206, data[start:stop]
            headers = {
                "Content-Range": f"bytes {start}-{stop - 1}/{len(data)}",
                "ETag": '"0123456789abcdef"',
                "Last-Modified": "Thu, 01 Jan 2026 00:00:00 GMT",
            }
        hit.status = status
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)
        hit.sent = len(body)
        hit.done.set()

    def log_message(self, format: str, *args: object) -> None:
        pass


class _ScriptedS3(ThreadingHTTPServer):
    daemon_threads = True
    log: RequestLog
    data: bytes
    busy: int


@pytest.fixture
def scripted_s3(s3: S3Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[_ScriptedS3]:
    """The scripted endpoint, with the AWS environment of :func:`s3` pointing at it."""
    server = _ScriptedS3((LOCAL, 0), _Scripted)
    server.log, server.data, server.busy = RequestLog(), b"", 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{LOCAL}:{server.server_address[1]}")
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


def test_inspect_verbose_counts_the_attempts_botocore_retried(
    scripted_s3: _ScriptedS3, tmp_path: Path
) -> None:
    """botocore asks again, by itself, after a 503 (SlowDown): --verbose counts both
    requests the endpoint answered, not only the answer that came back."""
    save_file({"w": np.ones((4, 4), np.float32)}, str(tmp_path / "m.safetensors"))
    scripted_s3.data, scripted_s3.busy = (tmp_path / "m.safetensors").read_bytes(), 1
    code, out, err = run_ckpt("inspect", "--verbose", "s3://ckpts/m.safetensors")
    assert code == 0 and "safetensors" in out, err
    assert [h.status for h in scripted_s3.log.for_path()] == [503, 206]
    assert "remote: 2 requests" in err, err
    assert f"({scripted_s3.log.sent() - len(_SLOW_DOWN):,} bytes)" in err, err


def test_every_attempt_is_counted_and_one_past_the_retries_fails(
    scripted_s3: _ScriptedS3,
) -> None:
    """botocore sends a request 4 times in all (3 retries) before it gives up: each is
    counted, and the last answer is the error (exit 8)."""
    scripted_s3.data, scripted_s3.busy = _bytes(SIZE), 2
    with RemoteSession() as remote:
        f = remote.open("s3://ckpts/m.pt")
        assert f.pread(10, SIZE - 10) == scripted_s3.data[-10:]
    assert [h.status for h in scripted_s3.log.for_path()] == [503, 503, 206, 206]
    assert remote.stats.requests == 4
    scripted_s3.log.clear()
    scripted_s3.busy = 4
    with RemoteSession() as remote, pytest.raises(RemoteError, match="SlowDown") as info:
        remote.open("s3://ckpts/m.pt")
    assert info.value.exit_code == EXIT_REMOTE and "\n" not in str(info.value)
    assert [h.status for h in scripted_s3.log.for_path()] == [503] * 4

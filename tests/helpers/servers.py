"""Real servers for the remote tests, started once a session on free localhost ports.

- :class:`HubServer`: uvicorn serving a Starlette app laid out as the Hugging Face Hub
  (``/[datasets/|spaces/]ORG/REPO/resolve/REV/FILE``, and plain files under ``/files/``);
  Starlette's ``FileResponse`` answers ``Range`` with ``206`` and ``Content-Range``. It can
  redirect resolve URLs to a CDN path on another origin, as the Hub does, gate a repo behind
  a token, and answer a path with a chosen status.
- :class:`NoRangeServer`: the standard library's ``SimpleHTTPRequestHandler``, which ignores
  ``Range`` and answers ``200`` with the whole file.
- :class:`S3Server`: moto's ``ThreadedMotoServer``, an S3-compatible endpoint.
- :class:`DeadEnds`: a socket that accepts connections and never answers, and a port that
  refuses them.

Each server counts, on its side, every request and the response body bytes it sent, per
path, in a :class:`RequestLog`. Nothing here reaches past 127.0.0.1 (the Hub's CDN is
``localhost``, another origin for the client). The pytest fixtures are at the end;
``tests/conftest.py`` imports them.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import pytest

LOCAL = "127.0.0.1"
#: The CDN's host name: another origin than 127.0.0.1 for the client, the same socket here.
CDN_HOST = "localhost"


@dataclass
class Hit:
    """One request as the server saw it."""

    method: str
    path: str  # as requested, percent-encoded, without the query
    range: str | None = None
    authorization: str | None = None
    status: int = 0
    sent: int = 0  # response body bytes handed to the socket
    done: threading.Event = field(default_factory=threading.Event, repr=False)


class RequestLog:
    """Every request a server answered, in order; counts per path or in all."""

    def __init__(self) -> None:
        self.hits: list[Hit] = []
        self._lock = threading.Lock()

    def add(self, method: str, path: str, range_: str | None, authorization: str | None) -> Hit:
        hit = Hit(method, path.split("?", 1)[0], range_, authorization)
        with self._lock:
            self.hits.append(hit)
        return hit

    def for_path(self, path: str | None = None, method: str | None = None) -> list[Hit]:
        """The requests for ``path`` (all paths when None) made with ``method`` (any when
        None), once the server has answered them."""
        self.settle()
        return [
            h
            for h in self.hits
            if (path is None or h.path == path) and (method is None or h.method == method)
        ]

    def requests(self, path: str | None = None, method: str | None = None) -> int:
        """How many requests :meth:`for_path` finds."""
        return len(self.for_path(path, method))

    def sent(self, path: str | None = None, method: str | None = None) -> int:
        """The body bytes sent in answer to them."""
        return sum(h.sent for h in self.for_path(path, method))

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every request so far is answered (or its client gone)."""
        deadline = time.monotonic() + timeout
        for hit in list(self.hits):
            if not hit.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the server is still answering {hit}")

    def clear(self) -> None:
        with self._lock:
            self.hits.clear()


class CountingMiddleware:
    """ASGI middleware: each request and the body bytes of its response, into a log."""

    def __init__(self, app: Any, log: RequestLog) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        raw = scope.get("raw_path") or scope["path"].encode()
        hit = self.log.add(
            scope["method"], raw.decode("ascii"), headers.get("range"), headers.get("authorization")
        )

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                hit.status = message["status"]
            elif message["type"] == "http.response.body":
                hit.sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            hit.done.set()


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOCAL, 0))
    return sock


class HubServer:
    """A Hub look-alike: uvicorn serving ``root`` in the Hub's URL layout.

    Attributes:
        url: ``http://127.0.0.1:PORT``; tests point ``HF_ENDPOINT`` at it.
        root: the served folder; :meth:`put` and :meth:`put_file` write into it.
        log: what was requested, counted on the server's side.
        redirect: resolve URLs answer ``302`` to ``http://localhost:PORT/cdn/...``.
        signature: a query string the CDN URL carries (``?Expires=...&Signature=...``), as
            the Hub's CDN URLs are signed; ignored by the CDN here.
        gated: repo id -> the token it needs (``401`` without one, ``403`` with another).
        statuses: request path -> the status to answer it with instead.
        query: a query string every ``/files/`` request must carry (``403`` without it), as
            a server that takes a token in the URL answers.
        replaced: request path -> (file, data): once the path's first request is answered,
            ``data`` overwrites the file (see :meth:`replace_later`).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.log = RequestLog()
        self.redirect = False
        self.signature = ""
        self.gated: dict[str, str] = {}
        self.statuses: dict[str, int] = {}
        self.query = ""
        self.replaced: dict[str, tuple[Path, bytes | Path]] = {}
        self.url = ""
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- the files -----------------------------------------------------------------------

    def path(self, repo: str, name: str, *, revision: str = "main", kind: str = "models") -> str:
        """The request path of a repo file, percent-encoded as the client sends it."""
        prefix = "" if kind == "models" else f"{kind}/"
        return f"/{prefix}{repo}/resolve/{quote(revision, safe='')}/{quote(name)}"

    def put(
        self,
        repo: str,
        name: str,
        data: bytes | Path,
        *,
        revision: str = "main",
        kind: str = "models",
    ) -> str:
        """Place ``data`` as ``name`` in ``repo`` at ``revision``; returns its ``hf://`` URL."""
        _write(self.root / kind / repo / revision / name, data)
        prefix = "" if kind == "models" else f"{kind}/"
        at = "" if revision == "main" else f"@{revision}"
        return f"hf://{prefix}{repo}{at}/{name}"

    def replace_later(
        self, repo: str, name: str, data: bytes | Path, *, revision: str = "main"
    ) -> None:
        """Overwrite a model repo's file with ``data`` once its first request is answered, as
        a re-upload or a moved branch replaces a file while a client reads it."""
        file = self.root / "models" / repo / revision / name
        self.replaced[self.path(repo, name, revision=revision)] = (file, data)

    def put_file(self, name: str, data: bytes | Path) -> str:
        """Place ``data`` at ``/files/NAME``; returns its ``http://`` URL."""
        _write(self.root / "files" / name, data)
        return f"{self.url}/files/{quote(name)}"

    def reset(self) -> None:
        """No files, no requests counted, no redirect, gate or forced status."""
        _empty(self.root)
        self.log.clear()
        self.redirect = False
        self.signature = ""
        self.gated.clear()
        self.statuses.clear()
        self.query = ""
        self.replaced.clear()

    # -- the answers ---------------------------------------------------------------------

    def answer(self, raw_path: str, authorization: str | None) -> Any:
        """The response to ``GET raw_path``: a file, a redirect, or an error status."""
        from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse

        if raw_path in self.statuses:
            return PlainTextResponse("forced", status_code=self.statuses[raw_path])
        if raw_path in self.replaced and sum(h.path == raw_path for h in self.log.hits) > 1:
            _write(*self.replaced.pop(raw_path))
        parts = [unquote(p) for p in raw_path.split("/")[1:]]
        if any(p in ("", ".", "..") for p in parts):
            return PlainTextResponse("bad path", status_code=400)
        if parts[0] in ("files", "cdn"):
            file = (
                self.root.joinpath(*parts[1:]) if parts[0] == "cdn" else self.root.joinpath(*parts)
            )
            return FileResponse(file) if file.is_file() else PlainTextResponse("", 404)
        kind = parts.pop(0) if parts[0] in ("datasets", "spaces") else "models"
        if len(parts) < 5 or parts[2] != "resolve":
            return PlainTextResponse("not a resolve URL", status_code=404)
        repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        refusal = self._gate(repo, authorization)
        if refusal is not None:
            return PlainTextResponse(refusal[1], status_code=refusal[0])
        file = self.root / kind / repo / revision / name
        if not file.is_file():
            return PlainTextResponse("Entry not found", 404, {"X-Error-Code": "EntryNotFound"})
        if self.redirect:
            cdn = f"http://{CDN_HOST}:{self.port}/cdn/{kind}/{repo}/{quote(revision)}/{quote(name)}"
            return RedirectResponse(cdn + self.signature, status_code=302)
        return FileResponse(file)

    def _gate(self, repo: str, authorization: str | None) -> tuple[int, str] | None:
        if repo not in self.gated:
            return None
        if authorization is None:
            return 401, "Access to this repo is restricted: you must be authenticated"
        if authorization != f"Bearer {self.gated[repo]}":
            return 403, "Access to this gated repo is not granted to this token"
        return None

    # -- running -------------------------------------------------------------------------

    def start(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        async def serve(request: Any) -> Any:
            raw = (request.scope.get("raw_path") or request.url.path.encode()).decode("ascii")
            if self.query and raw.startswith("/files/") and request.url.query != self.query:
                from starlette.responses import PlainTextResponse

                return PlainTextResponse("a token is needed", status_code=403)
            return self.answer(raw, request.headers.get("authorization"))

        app = Starlette(routes=[Route("/{path:path}", serve, methods=["GET", "HEAD"])])
        sock = _free_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://{LOCAL}:{self.port}"
        config = uvicorn.Config(
            CountingMiddleware(app, self.log),
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="asyncio",
            http="h11",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        _wait_until(lambda: self._server.started, "uvicorn did not start")

    def stop(self) -> None:
        self._server.should_exit = True
        assert self._thread is not None
        self._thread.join(timeout=30)


def _write(target: Path, data: bytes | Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Path):
        shutil.copyfile(data, target)
    else:
        target.write_bytes(data)


def _empty(folder: Path) -> None:
    for child in folder.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def _wait_until(ready: Any, message: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.01)


class _WholeFileHandler(SimpleHTTPRequestHandler):
    """The standard library's static handler (no ``Range``: always the whole file), counted."""

    server: _CountingHTTPServer
    hit: Hit

    def do_GET(self) -> None:
        self.hit = self.server.log.add(
            "GET", self.path, self.headers.get("Range"), self.headers.get("Authorization")
        )
        try:
            super().do_GET()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client read what it wanted and hung up
        finally:
            self.hit.done.set()

    def send_response(self, code: int, message: str | None = None) -> None:
        if getattr(self, "hit", None) is not None:
            self.hit.status = code
        super().send_response(code, message)

    def copyfile(self, source: Any, outputfile: Any) -> None:
        while chunk := source.read(64 << 10):
            outputfile.write(chunk)
            self.hit.sent += len(chunk)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _CountingHTTPServer(ThreadingHTTPServer):
    log: RequestLog


class NoRangeServer:
    """Serves ``root`` with ``http.server``: every GET is answered ``200`` with the whole file.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        root: the served folder (:meth:`put` writes into it).
        log: requests and the body bytes written to the socket, per path.
    """

    def __init__(self, root: Path) -> None:
        self.root, self.log, self.url = root, RequestLog(), ""
        self._server: _CountingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def put(self, name: str, data: bytes | Path) -> str:
        """Place ``data`` as ``name``; returns its URL."""
        _write(self.root / name, data)
        return f"{self.url}/{quote(name)}"

    def reset(self) -> None:
        _empty(self.root)
        self.log.clear()

    def start(self) -> None:
        handler = partial(_WholeFileHandler, directory=str(self.root))
        self._server = _CountingHTTPServer((LOCAL, 0), handler)
        self._server.log = self.log
        self.url = f"http://{LOCAL}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=30)


class _CountingWSGI:
    """WSGI middleware: each request and the body bytes of its response, into a log."""

    def __init__(self, app: Any, log: RequestLog) -> None:
        self.app, self.log = app, log

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        path = environ.get("RAW_URI") or quote(environ.get("PATH_INFO", ""))
        hit = self.log.add(
            environ["REQUEST_METHOD"],
            path,
            environ.get("HTTP_RANGE"),
            environ.get("HTTP_AUTHORIZATION"),
        )

        def start(status: str, headers: Any, exc_info: Any = None) -> Any:
            hit.status = int(status.split()[0])
            return start_response(status, headers, exc_info)

        try:
            for chunk in self.app(environ, start):
                hit.sent += len(chunk)
                yield chunk
        finally:
            hit.done.set()


class S3Server:
    """moto's S3-compatible server, its requests counted.

    Attributes:
        url: ``http://127.0.0.1:PORT``; tests set ``AWS_ENDPOINT_URL`` to it.
        log: requests and response body bytes, per path (``/BUCKET/KEY``).
    """

    def __init__(self) -> None:
        self.log, self.url = RequestLog(), ""
        self._server: Any = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        self._server = ThreadedMotoServer(ip_address=LOCAL, port=0, verbose=False)
        self._server.start()
        # Counted at the WSGI app the server was built with (set before any request).
        wsgi = self._server._server
        wsgi.app = _CountingWSGI(wsgi.app, self.log)
        host, port = self._server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    def _post(self, path: str, body: bytes = b"") -> None:
        # Not a form: moto reads the raw body, which a form content type would consume.
        headers = {"Content-Type": "text/plain"}
        request = urllib.request.Request(self.url + path, body, headers, method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()

    def reset(self) -> None:
        """No buckets, no objects, credentials not checked, no requests counted."""
        self._post("/moto-api/reset")
        self.check_credentials(False)
        self.log.clear()

    def check_credentials(self, on: bool) -> None:
        """Whether the server refuses requests signed with keys it never issued."""
        self._post("/moto-api/reset-auth", b"0" if on else b"inf")

    def stop(self) -> None:
        self._server.stop()


@dataclass
class DeadEnds:
    """Two URLs that fail: ``stalled`` accepts connections and never answers (the kernel
    completes them into a listen backlog nobody accepts from); ``refused`` is a bound port
    that does not listen, so connections are refused."""

    stalled: str
    refused: str
    sockets: tuple[socket.socket, ...]

    @classmethod
    def open(cls) -> DeadEnds:
        listening, bound = _free_socket(), _free_socket()
        listening.listen(64)
        return cls(
            f"http://{LOCAL}:{listening.getsockname()[1]}",
            f"http://{LOCAL}:{bound.getsockname()[1]}",
            (listening, bound),
        )

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


# -- fixtures (imported by tests/conftest.py) ---------------------------------------------

_UNSET = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HF_TOKEN_PATH",
    "HF_ENDPOINT",
    "CKPT_REMOTE_TIMEOUT",
    *(f"{name}_proxy" for name in ("http", "https", "all", "HTTP", "HTTPS", "ALL")),
    *(f"{name}_PROXY" for name in ("http", "https", "all")),
)


@pytest.fixture
def remote_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The environment of a remote test: no Hub token or endpoint of the user's, no proxy,
    the default timeout, ``HF_HOME`` in ``tmp_path`` (returned)."""
    for name in _UNSET:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "hf-home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    return home


_Served = TypeVar("_Served", HubServer, NoRangeServer, S3Server)


def _serving(server: _Served) -> Iterator[_Served]:
    """A session fixture's body: ``server`` started, yielded, stopped after the session."""
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """The session's :class:`HubServer`; tests use :func:`hub`."""
    yield from _serving(HubServer(tmp_path_factory.mktemp("hub")))


@pytest.fixture
def hub(hub_server: HubServer, remote_env: Path, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """The Hub look-alike, empty and uncounted, with ``HF_ENDPOINT`` pointing at it."""
    hub_server.reset()
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    return hub_server


@pytest.fixture(scope="session")
def no_range_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NoRangeServer]:
    """The session's :class:`NoRangeServer`; tests use :func:`no_range`."""
    yield from _serving(NoRangeServer(tmp_path_factory.mktemp("no-range")))


@pytest.fixture
def no_range(no_range_server: NoRangeServer, remote_env: Path) -> NoRangeServer:
    """A server that ignores ``Range``, empty and uncounted."""
    no_range_server.reset()
    return no_range_server


@pytest.fixture(scope="session")
def dead_ends() -> Iterator[DeadEnds]:
    """A URL that never answers and one that refuses connections."""
    ends = DeadEnds.open()
    yield ends
    ends.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's :class:`S3Server`; tests use :func:`s3`."""
    yield from _serving(S3Server())


@dataclass
class S3Bucket:
    """A fresh bucket on the S3 server, with the AWS environment pointing at it.

    Attributes:
        name: the bucket.
        server: the :class:`S3Server` (its ``log`` counts requests).
        client: a botocore client for putting objects in place.
    """

    name: str
    server: S3Server
    client: Any

    def put(self, key: str, data: bytes | Path) -> str:
        """Place ``data`` at ``key``; returns its ``s3://`` URL."""
        body = data.read_bytes() if isinstance(data, Path) else data
        self.client.put_object(Bucket=self.name, Key=key, Body=body)
        return f"s3://{self.name}/{key}"

    def path(self, key: str) -> str:
        """The request path of ``key`` as the server counts it (path-style addressing)."""
        return f"/{self.name}/{quote(key)}"


@pytest.fixture
def s3(
    s3_server: S3Server, remote_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> S3Bucket:
    """Bucket ``ckpts`` on the S3 server, empty; ``AWS_ENDPOINT_URL``, fake credentials and
    the region set for this test only, and no AWS file or instance metadata of the user's."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {
        "AWS_ENDPOINT_URL": s3_server.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)
    s3_server.reset()
    from ckpt_tools.io.remote.s3 import make_s3_client

    client = make_s3_client(30.0)
    client.create_bucket(Bucket="ckpts")
    s3_server.log.clear()
    return S3Bucket("ckpts", s3_server, client)

"""A remote read: one HTTP client and one S3 client, made when first needed, and one count of
what every file opened through them cost.
"""

from __future__ import annotations

import posixpath
from types import TracebackType
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ckpt_tools.errors import (
    CheckpointNotFoundError,
    Remedy,
    UnsupportedFormatError,
    UsageError,
)
from ckpt_tools.formats import HIDDEN
from ckpt_tools.formats.detect import is_index_name
from ckpt_tools.formats.hf_choice import MAX_CONFIG_BYTES, explicit_weights
from ckpt_tools.io.remote.http import HttpTransport, make_client, remote_timeout
from ckpt_tools.io.remote.httpurls import credentials, shown_url, split_http, with_userinfo
from ckpt_tools.io.remote.hub_token import hf_token
from ckpt_tools.io.remote.rangefile import RangeTransport, RemoteFile, TransferStats
from ckpt_tools.io.remote.s3 import S3Transport, make_s3_client
from ckpt_tools.io.remote.urls import (
    at_hub,
    auth_headers,
    file_name,
    folder_candidates,
    is_folder_url,
    is_url,
    resolve,
    scheme,
)

__all__ = ["RemoteSession", "explicit_missing"]


class RemoteSession:
    """Opens URLs as :class:`~ckpt_tools.io.remote.rangefile.RemoteFile` objects.

    Use it as a context manager: leaving it closes the clients and so every file opened
    through it.

    Args:
        timeout: seconds per connect and per read; ``CKPT_REMOTE_TIMEOUT`` (else 30) when
            None, read now.

    Attributes:
        stats: the requests made and body bytes received by every file of the session,
            and the misses of :meth:`open_folder`.
        timeout: as given or read.

    Example:
        >>> with RemoteSession(timeout=5) as remote:
        ...     remote.stats
        TransferStats(requests=0, bytes_received=0)
        >>> with RemoteSession() as remote:  # doctest: +SKIP
        ...     f = remote.open("hf://openai-community/gpt2/model.safetensors")
        ...     header_size = int.from_bytes(f.pread(8, 0), "little")
    """

    def __init__(self, *, timeout: float | None = None) -> None:
        self.timeout = remote_timeout() if timeout is None else float(timeout)
        self.stats = TransferStats()
        self._http: Any = None
        self._s3: Any = None
        # (origin, folder) -> userinfo, from a URL given: sent to the files in that folder
        # (and below it), never to another folder of the host, which may be another user's.
        self._userinfo: dict[tuple[str, str], str] = {}
        self._given: dict[str, str] = {}  # a URL as shown -> as given (its query's values)
        # (folder, query as shown) -> as given: a file beside a URL given is asked for with
        # that URL's query (its token), which reaches it shown, as its name was built.
        self._queries: dict[tuple[str, str], str] = {}
        self._deriving: set[tuple[str, str]] = set()  # ... of a folder or an index URL given

    def named(self, url: str) -> str:
        """``url`` as messages and reports show it (:func:`shown_url`: no userinfo, no query
        values), which this session opens as the URL given: it keeps the credentials and
        sends the userinfo to that host, for the files in the URL's folder (a shard beside
        the file) and below it; never to another folder of the host.

        Raises:
            UsageError: another URL given to this session is shown the same way (they differ
                only in credentials or query values): its reads would be taken for this one's;
                or another userinfo was given for the same folder.

        Example:
            >>> RemoteSession(timeout=5).named("https://me:secret@host.example/m.pt?sig=x")
            'https://***@host.example/m.pt?sig=***'
        """
        origin, userinfo = credentials(url)
        shown = shown_url(url)
        if userinfo is not None:
            split_http(url)  # a host that does not parse is refused before its folder is read
            where = (origin, _folder_path(shown))
            if self._userinfo.setdefault(where, userinfo) != userinfo:
                raise UsageError(
                    f"{_folder_query(shown)[0]} is given with two user names or passwords "
                    f"(shown as {HIDDEN}); read each in a command of its own",
                    path=shown,
                )
        if "?" in url and shown != url:  # (a file named as shown is one read beside)
            self._note_query(url, shown)
        if shown != url and self._given.setdefault(shown, url) != url:
            raise UsageError(
                f"{shown} is given twice, with other credentials or query values (shown as "
                f"{HIDDEN}); read each in a command of its own",
                path=shown,
            )
        return shown

    def _note_query(self, url: str, shown: str) -> None:
        """Keep ``url``'s query for the files read beside it; refuse a second query for its
        folder (shown the same) where a folder or an index URL takes part: the files it reads
        are named as shown, and would be asked for with the other URL's values."""
        try:  # (a URL that does not parse is refused with its reason where it is opened)
            where, query = _folder_query(shown), urlsplit(url).query
        except ValueError:
            return
        if is_folder_url(url) or is_index_name(file_name(url)):
            self._deriving.add(where)
        if self._queries.setdefault(where, query) != query and where in self._deriving:
            raise UsageError(
                f"{where[0]} is given with two queries (shown as {HIDDEN}), and the files read "
                "beside a folder or an index there would be asked for with either; read each "
                "in a command of its own",
                path=shown,
            )

    def open(self, url: str) -> RemoteFile:
        """The file at ``url``, its size learned and its first bytes read (one request).

        Args:
            url: an ``http(s)://``, ``hf://`` or ``s3://`` URL of a file.

        Returns:
            The open :class:`~ckpt_tools.io.remote.rangefile.RemoteFile`.

        Raises:
            UsageError: not a URL, or a folder URL (use :meth:`open_folder`).
            MissingExtraError: the remote extra is not installed.
            CheckpointNotFoundError: no such file.
            RemoteError: as :meth:`HttpTransport.get` and :meth:`S3Transport.get` say.
        """
        if not is_url(url):
            raise UsageError(f"not a URL ckpt_tools reads (http, https, hf, s3): {url!r}")
        shown = self.named(url)
        if is_folder_url(url):
            raise UsageError(f"{shown} is a folder: open_folder finds the checkpoint in it")
        return RemoteFile(self._transport(url), self.stats)

    def open_folder(self, url: str) -> tuple[str, RemoteFile]:
        """The file of the folder ``url`` transformers' ``from_pretrained`` would load.

        That is the file ``config.json`` names in ``transformers_weights``, where it names
        one; else the first of :data:`~ckpt_tools.io.remote.urls.FOLDER_FILES` that exists
        (``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
        ``pytorch_model.bin.index.json``). Each file tried, config.json included, is one
        request.

        Args:
            url: a folder URL (``hf://ORG/REPO[@REV]``, or a path ending in ``/``).

        Returns:
            ``(name, file)``: the file's name in the folder and the open file.

        Raises:
            CheckpointNotFoundError: none of them exists; the message names them.
            UnsupportedFormatError: ``transformers_weights`` names a file that
                ``from_pretrained`` refuses, or that the folder does not hold.
            RemoteError: anything but a missing file (a refused token stops the search).
        """
        url = self.named(url)
        explicit = self.explicit_weights(url)
        if explicit is not None:
            (candidate,) = folder_candidates(url, [explicit])
            try:
                return explicit, self.open(candidate)
            except CheckpointNotFoundError as e:
                raise explicit_missing(url, explicit) from e
        tried = []
        for candidate in folder_candidates(url):
            try:
                return file_name(candidate), self.open(candidate)
            except CheckpointNotFoundError:
                self.stats.add(0)
                tried.append(file_name(candidate))
        # A URL folder cannot be listed: a variant's or an adapter's weights are named.
        name = Remedy(
            text="name the weights file in the URL (…/model.fp16.safetensors, "
            "…/adapter_model.safetensors)"
        )
        raise CheckpointNotFoundError(
            f"{url}: no checkpoint in this folder (tried {', '.join(tried)})",
            path=url,
            remedies=(name,),
        )

    def explicit_weights(self, url: str) -> str | None:
        """The file the folder's config.json names in ``transformers_weights``, if any (one
        request: config.json's whole).

        Raises:
            UnsupportedFormatError: ``from_pretrained`` refuses the name it gives.
        """
        (config_url,) = folder_candidates(url, ["config.json"])
        try:
            config = self.open(config_url)
        except CheckpointNotFoundError:
            self.stats.add(0)
            return None
        if config.size > MAX_CONFIG_BYTES:
            return None
        name = explicit_weights(config.pread(config.size, 0), config_url, url)
        # The file the name reaches (./ema.safetensors is ema.safetensors): a path in a
        # folder URL or a repository takes no dot segments. A local folder's is taken as
        # given, as from_pretrained joins it (nosuch/../ema.safetensors is no file there).
        return None if name is None else posixpath.normpath(name)

    def _transport(self, url: str) -> RangeTransport:
        if scheme(url) == "s3":
            if self._s3 is None:
                self._s3 = make_s3_client(self.timeout)
            return S3Transport(self._s3, url, self.stats)
        if self._http is None:
            self._http = make_client(self.timeout, url)
        url = self._given.get(url) or self._with_query(url)  # a URL as shown: as given
        headers = auth_headers(url, hf_token()) if at_hub(url) else {}
        origin, userinfo = credentials(url)
        given = self._folder_userinfo(origin, url) if userinfo is None else None
        if given is not None:  # a URL named without its userinfo: a shard beside one given
            url = with_userinfo(url, given)
        return HttpTransport(
            self._http, url, resolved=resolve(url), headers=headers, stats=self.stats
        )

    def _folder_userinfo(self, origin: str, url: str) -> str | None:
        """The userinfo given for the deepest folder of ``origin`` that holds ``url``."""
        folder = _folder_path(url)
        held = [f for o, f in self._userinfo if o == origin and folder.startswith(f)]
        return self._userinfo[(origin, max(held, key=len))] if held else None

    def _with_query(self, url: str) -> str:
        """``url`` with the query given for its folder, where it carries that query shown."""
        given = self._queries.get(_folder_query(url))
        if given is None:
            return url
        parts = urlsplit(url)
        return urlunsplit((parts.scheme, parts.netloc, parts.path, given, parts.fragment))

    def close(self) -> None:
        """Close the clients (and with them every file of the session)."""
        if self._http is not None:
            self._http.close()
        if self._s3 is not None:
            self._s3.close()
        self._http = self._s3 = None

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def _folder_path(url: str) -> str:
    """The path of the folder ``url`` lies in (a folder URL's own), ending in ``/``, its dot
    segments removed as the request's path has them removed (RFC 3986, 5.2.4): a ``..``
    leaves the folder whatever came before it. A percent-encoded dot counts as one, as a
    server that decodes it would read it.

    Example:
        >>> _folder_path("https://h/alice/./x/../%2e%2E/bob/m.pt")
        '/bob/'
    """
    kept: list[str] = []
    for segment in urlsplit(url).path.split("/")[1:-1]:
        dots = unquote(segment)
        if dots == "..":
            if kept:
                kept.pop()
        elif dots != ".":
            kept.append(segment)
    return "/" + "".join(f"{segment}/" for segment in kept)


def _folder_query(url: str) -> tuple[str, str]:
    """The folder ``url`` lies in, and its query: the files beside it share both."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, _folder_path(url), "", "")), parts.query


def explicit_missing(url: str, explicit: str) -> UnsupportedFormatError:
    """The refusal of a folder whose config.json names a ``transformers_weights`` file it does
    not hold: ``from_pretrained`` loads that file and no other, so no other file stands in.

    Example:
        >>> str(explicit_missing("hf://org/repo", "ema.safetensors")).split(", which")[0]
        "hf://org/repo: config.json names transformers_weights 'ema.safetensors'"
    """
    return UnsupportedFormatError(
        f"{url}: config.json names transformers_weights {explicit!r}, which the folder does "
        "not hold; from_pretrained loads that file and no other",
        path=url,
    )

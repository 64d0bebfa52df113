"""Which strings are remote URLs, where each one points, and the names around it.

Three schemes are read: ``http(s)://``, ``hf://`` and ``s3://``. An ``hf://`` path is
resolved as huggingface_hub resolves it (``hf_hub_url``): ``HF_ENDPOINT``, the revision
URL-quoted, the token from ``HF_TOKEN`` or the token file, sent to the endpoint only. A
*folder URL* (``hf://ORG/REPO`` with no path, or any URL whose path ends with ``/``) is
looked into for the files transformers looks for, in its order: the file config.json names
in ``transformers_weights``, else the first of :data:`FOLDER_FILES` there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlunsplit

from ckpt_tools.errors import CorruptCheckpointError, UsageError
from ckpt_tools.formats.hf_choice import TRANSFORMERS_ORDER
from ckpt_tools.io.remote.httpurls import http_problem, shown_url, split_http

__all__ = [
    "DEFAULT_ENDPOINT",
    "FOLDER_FILES",
    "SCHEMES",
    "HubPath",
    "at_hub",
    "auth_headers",
    "file_name",
    "folder_candidates",
    "hf_endpoint",
    "is_folder_url",
    "is_url",
    "parse_hf",
    "resolve",
    "scheme",
    "sibling",
    "split_s3",
]

SCHEMES = ("http", "https", "hf", "s3")
DEFAULT_ENDPOINT = "https://huggingface.co"
# What a folder URL is looked into for, in the order transformers' from_pretrained tries
# (after a file config.json names in transformers_weights).
FOLDER_FILES = TRANSFORMERS_ORDER
# hf://TYPE/...: the URI's type prefix -> the prefix of the resolve URL's path.
_TYPE_PREFIX = {"models": "", "datasets": "datasets/", "spaces": "spaces/"}
# Revisions that hold a slash, as huggingface_hub's HfFileSystem recognizes them.
_SPECIAL_REF = re.compile(r"refs/(?:pr/\d+|convert/\w+)(?=/|$)")
_REPO_PART = re.compile(r"[\w][\w.-]*")


def scheme(url: str) -> str:
    """The URL's scheme in lower case (``""`` for a path)."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head.isalnum() else ""


def is_url(obj: object) -> bool:
    """Whether ``obj`` is a remote URL ckpt_tools reads (``http(s)://``, ``hf://``, ``s3://``).

    Args:
        obj: anything a path argument may be given as.

    Returns:
        True for a ``str`` whose scheme (in any case) is one of :data:`SCHEMES`.

    Example:
        >>> is_url("HF://org/model"), is_url("s3://bucket/key"), is_url("model.pt")
        (True, True, False)
    """
    return isinstance(obj, str) and scheme(obj) in SCHEMES


@dataclass(frozen=True)
class HubPath:
    """An ``hf://`` URI taken apart.

    Attributes:
        prefix: the resolve URL's path prefix for the repo type: ``""`` (model),
            ``"datasets/"``, ``"spaces/"``.
        repo_id: ``ORG/REPO``.
        revision: a branch, tag, commit or ``refs/pr/N`` (unquoted).
        path: the file in the repo, as given (``""`` for the repo itself).
        base: the URI up to the path (``hf://ORG/REPO@REV/``), for names beside it.
    """

    prefix: str
    repo_id: str
    revision: str
    path: str
    base: str

    def resolve(self, endpoint: str | None = None) -> str:
        """The HTTP URL the Hub serves this file at.

        Args:
            endpoint: the Hub's address; :func:`hf_endpoint` when None.

        Returns:
            ``{endpoint}/[datasets/|spaces/]ORG/REPO/resolve/{REV}/{PATH}``, the revision
            quoted whole (``refs%2Fpr%2F1``) and the path quoted as huggingface_hub does.

        Example:
            >>> parse_hf("hf://org/m@refs/pr/1/a b.bin").resolve("https://hub.example")
            'https://hub.example/org/m/resolve/refs%2Fpr%2F1/a%20b.bin'
        """
        endpoint = (endpoint or hf_endpoint()).rstrip("/")
        rev = quote(self.revision, safe="")
        return f"{endpoint}/{self.prefix}{self.repo_id}/resolve/{rev}/{quote(self.path)}"


def parse_hf(url: str) -> HubPath:
    """``hf://[TYPE/]ORG/REPO[@REV][/PATH]`` taken apart (TYPE: models, datasets, spaces).

    Args:
        url: an ``hf://`` URI. The revision defaults to ``main``; it may be URL-quoted, and
            ``refs/pr/N`` and ``refs/convert/NAME`` may be written with their slashes.

    Returns:
        The :class:`HubPath`.

    Raises:
        UsageError: not an ``hf://`` URI, no ``ORG/REPO`` (after a repo type too:
            ``hf://datasets/ORG`` is no repo), an empty revision, or a revision or a path
            with ``.`` or ``..`` segments (``%2e%2e`` too, once unquoted).

    Example:
        >>> hub = parse_hf("hf://datasets/org/data@v1.0/sub/model.pt")
        >>> hub.prefix, hub.repo_id, hub.revision, hub.path
        ('datasets/', 'org/data', 'v1.0', 'sub/model.pt')
    """
    if scheme(url) != "hf":
        raise UsageError(f"not an hf:// URL: {url!r}")
    rest = url.split("://", 1)[1]
    parts = rest.split("/")
    prefix = ""
    if parts[0] in _TYPE_PREFIX:  # (no model repo's owner is named models, datasets or spaces)
        kind = parts.pop(0)
        prefix = _TYPE_PREFIX[kind]
        if len(parts) < 2 or not parts[1] or "@" in parts[0]:
            raise UsageError(
                f"{url!r}: hf://{kind}/ORG/REPO needs a repo: write "
                f"hf://{kind}/ORG/REPO[@REV][/PATH]"
            )
    org, repo, revision = parts[0], parts[1] if len(parts) > 1 else "", "main"
    tail = "/".join(parts[2:])
    if "@" in repo:
        repo, _, after = "/".join(parts[1:]).partition("@")
        special = _SPECIAL_REF.match(after)
        revision = special.group() if special else after.split("/", 1)[0]
        tail = after[len(revision) + 1 :]
        revision = unquote(revision)
    _check_hf(url, org, repo, revision, tail)
    return HubPath(prefix, f"{org}/{repo}", revision, tail, url[: len(url) - len(tail)])


def _check_hf(url: str, org: str, repo: str, revision: str, path: str) -> None:
    if not (_REPO_PART.fullmatch(org) and _REPO_PART.fullmatch(repo)):
        raise UsageError(
            f"{url!r} names no repository: write hf://ORG/REPO[@REV][/PATH] "
            "(datasets/ or spaces/ before ORG for those repos)"
        )
    if not revision:
        raise UsageError(f"{url!r}: empty revision after '@'")
    if any(part in (".", "..") for part in revision.split("/")):  # the request's path would climb
        raise UsageError(
            f"{url!r}: a revision has no '.' or '..' parts: write a branch, tag or commit"
        )
    # The path is sent quoted (a literal %2e%2e is no climb), but it is refused as the
    # revision is: no name in a repository reads so.
    if any(unquote(part) in (".", "..") for part in path.split("/")):
        raise UsageError(f"{url!r}: a path in a repository has no '.' or '..' parts")


def hf_endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT``, else ``https://huggingface.co``.

    Raises:
        UsageError: ``HF_ENDPOINT`` is not an ``http(s)://HOST`` URL; the message shows it
            (without its credentials) and the value to write.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict("os.environ", {"HF_ENDPOINT": "hub.internal:8080"}):
        ...     hf_endpoint()
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: HF_ENDPOINT='hub.internal:8080' is not an http(s) URL...
    """
    value = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    endpoint = value.rstrip("/")
    problem = http_problem(endpoint) if scheme(endpoint) in ("http", "https") else ""
    if scheme(endpoint) in ("http", "https") and not problem:
        return endpoint
    # What to write, and what was found, each shown without credentials it may hold.
    given, sep, rest = value.partition("://")
    written = rest if sep else given
    found = (given + sep if sep else "") + shown_url("https://" + written)[len("https://") :]
    if problem:  # an http(s) URL already: its host (or port) is what to fix
        fix, problem = "https://HOST", problem.replace("is not a URL", "is not an http(s) URL", 1)
    else:
        fix = shown_url("https://" + written) if written.strip("/") else "https://HOST"
        problem = "is not an http(s) URL with a host"
    raise UsageError(
        f"HF_ENDPOINT={found!r} {problem}: write HF_ENDPOINT={fix} "
        "(or http:// for a Hub on your own network)"
    )


def at_hub(url: str) -> bool:
    """Whether ``url`` is the Hub's: ``hf://``, or an ``http(s)`` URL at ``HF_ENDPOINT``'s origin.

    Example:
        >>> at_hub("hf://org/model"), at_hub("https://elsewhere.example/x.bin")
        (True, False)
    """
    if scheme(url) == "hf":
        return True
    parts = split_http(url)
    try:
        hub = split_http(hf_endpoint())
    except UsageError:  # no URL is at an HF_ENDPOINT that is none (hf:// URLs are refused)
        return False
    return (parts.scheme.lower(), parts.netloc.lower()) == (hub.scheme.lower(), hub.netloc.lower())


def auth_headers(url: str, token: str | None) -> dict[str, str]:
    """The headers that carry the Hub token, for ``hf://`` URLs and URLs at ``HF_ENDPOINT``.

    Args:
        url: the URL as given.
        token: the token (:func:`hf_token`), or None.

    Returns:
        ``{"Authorization": "Bearer ..."}``, or ``{}`` when there is no token or the URL
        is elsewhere (a token is never sent to another host).

    Example:
        >>> auth_headers("https://elsewhere.example/x.bin", "hf_abc")
        {}
    """
    return {"Authorization": f"Bearer {token}"} if token is not None and at_hub(url) else {}


def resolve(url: str) -> str:
    """The URL a request goes to: ``hf://`` resolved (:meth:`HubPath.resolve`), others as given.

    Example:
        >>> resolve("https://host.example/m.bin")
        'https://host.example/m.bin'
    """
    return parse_hf(url).resolve() if scheme(url) == "hf" else url


_BUCKET = re.compile(r"[A-Za-z0-9.\-_]{1,255}")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://BUCKET/KEY`` -> ``(BUCKET, KEY)``; the key as given (``""`` for the bucket).

    Raises:
        UsageError: no bucket, or one botocore would refuse (``my bucket``, ``host:9000``).

    Example:
        >>> split_s3("s3://runs/exp1/last.ckpt")
        ('runs', 'exp1/last.ckpt')
    """
    bucket, _, key = url.split("://", 1)[1].partition("/")
    if not bucket:
        raise UsageError(f"{url!r} names no bucket: write s3://BUCKET/KEY")
    # botocore's own check, made here so that the URL is blamed, not the endpoint.
    if not _BUCKET.fullmatch(bucket) and not bucket.startswith("arn:"):
        hint = "; the endpoint goes in AWS_ENDPOINT_URL" if ":" in bucket else ""
        raise UsageError(
            f"{url!r}: {bucket!r} is not a bucket name (letters, digits, '.', '-' and '_')"
            f"{hint}: write s3://BUCKET/KEY"
        )
    return bucket, key


def _path(url: str) -> str:
    """The part of ``url`` that names a file in its repo, bucket or host."""
    kind = scheme(url)
    if kind == "hf":
        return parse_hf(url).path
    if kind == "s3":
        return split_s3(url)[1]
    return split_http(url).path


def is_folder_url(url: str) -> bool:
    """Whether ``url`` names a folder: ``hf://ORG/REPO[@REV]`` alone, or a path ending in ``/``.

    Example:
        >>> is_folder_url("hf://org/model@v2"), is_folder_url("hf://org/model/model.pt")
        (True, False)
    """
    path = _path(url)
    return path == "" or path.endswith("/")


def folder_candidates(url: str, names: Sequence[str] = FOLDER_FILES) -> list[str]:
    """The URLs tried for a folder URL, in order: ``names`` inside it.

    Args:
        url: the folder URL.
        names: file names inside it, checked already (:data:`FOLDER_FILES` by default).

    Example:
        >>> folder_candidates("hf://org/model@refs/pr/1")[0]
        'hf://org/model@refs/pr/1/model.safetensors'
        >>> folder_candidates("https://host.example/runs/")[-1]
        'https://host.example/runs/pytorch_model.bin.index.json'
    """
    return [_join(url, name) for name in names]


def file_name(url: str) -> str:
    """The name of the file at ``url``: its path's last part, without the query.

    Example:
        >>> file_name("https://host.example/run/model.safetensors.index.json?token=***")
        'model.safetensors.index.json'
    """
    return url.split("?", 1)[0].rpartition("/")[2]


def _join(folder: str, name: str) -> str:
    """``name`` (already checked) inside the folder URL ``folder``, with its query: a token
    in it (``?token=...``, a CDN policy for the folder) is what lets the server answer."""
    if scheme(folder) == "hf":
        return f"{folder.rstrip('/')}/{name}"
    if scheme(folder) == "s3":  # a key is a plain string: "exp1//" is a folder of its own
        return folder + name if folder.endswith("/") else f"{folder}/{name}"
    parts = split_http(folder)
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    return urlunsplit((parts.scheme, parts.netloc, path + quote(name), parts.query, ""))


def sibling(url: str, name: str) -> str:
    """The URL of ``name``, a file named in the file at ``url`` (an index's shard).

    Args:
        url: the naming file's URL; ``name`` is relative to its folder.
        name: a relative name, ``/``-separated.

    Returns:
        The file's URL, in the same scheme as ``url`` (an ``hf://`` URL stays one), with
        ``url``'s query.

    Raises:
        CorruptCheckpointError: ``name`` is empty, absolute, holds a backslash, or has an
            empty, ``.`` or ``..`` part: it would leave the folder. The name comes from a
            file (a shard index), so it is the file's fault, as for a local index.

    Example:
        >>> sibling("hf://org/m@v1/sub/model.safetensors.index.json", "model-00001.safetensors")
        'hf://org/m@v1/sub/model-00001.safetensors'
    """
    parts = name.split("/")
    if not name or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpointError(
            f"{url!r} names {name!r}, which is not a file beside it; shards must lie beside "
            "the index",
            path=url,
        )
    kind = scheme(url)
    if kind == "hf":
        hub = parse_hf(url)
        return _join(hub.base + hub.path.rpartition("/")[0], name)
    if kind == "s3":
        bucket, key = split_s3(url)
        return _join(f"s3://{bucket}/{key[: key.rfind('/') + 1]}", name)
    split = split_http(url)
    folder_path = split.path.rpartition("/")[0] + "/"
    return _join(urlunsplit((split.scheme, split.netloc, folder_path, split.query, "")), name)

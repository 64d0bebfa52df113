"""Ranged reads of ``s3://BUCKET/KEY`` with botocore, configured by the usual AWS environment.

botocore reads the endpoint (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``), the region
(``AWS_REGION``, ``AWS_DEFAULT_REGION``) and the credentials (``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, the shared files, an instance role) as every AWS
tool does. With a custom endpoint (MinIO, a local server) buckets are addressed by path,
since such endpoints rarely resolve ``BUCKET.host`` names.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from ckpt_tools._types import ascii_int
from ckpt_tools.errors import (
    CheckpointNotFoundError,
    MissingExtraError,
    Remedy,
    RemoteAccessError,
    RemoteError,
    UsageError,
    quote_foreign,
)
from ckpt_tools.io.remote.http import TIMEOUT_ENV
from ckpt_tools.io.remote.httpurls import shown_any, shown_text
from ckpt_tools.io.remote.rangefile import (
    SameObject,
    TransferStats,
    check_content_range,
    range_refused,
)
from ckpt_tools.io.remote.urls import split_s3

__all__ = ["S3Transport", "make_s3_client"]

_CREDENTIALS = Remedy(
    text="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials "
    "that can read it"
)
_MISSING = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_REFUSED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def _botocore(feature: str = "reading s3:// URLs") -> Any:
    try:
        import botocore.config
        import botocore.exceptions
        import botocore.loaders
        import botocore.session
        import botocore.utils
    except ImportError as e:
        raise MissingExtraError(feature, "botocore", "remote") from e
    return botocore


@functools.cache
def _models() -> Any:
    """botocore's loader of service models, shared by every client: a new session would
    parse the S3 model again (half a second). Credentials and endpoint stay per client."""
    return _botocore().loaders.create_loader()


def make_s3_client(timeout: float) -> Any:
    """An S3 client from the AWS environment, ``timeout`` seconds per connect and read; a
    request answered 500, 503 or a throttle, or whose connection failed, is sent again by
    botocore itself, 3 times at most (:class:`S3Transport` counts each attempt).

    Args:
        timeout: seconds (:func:`~ckpt_tools.io.remote.http.remote_timeout`).

    Returns:
        A botocore S3 client.

    Raises:
        MissingExtraError: botocore is not installed.
        UsageError: the endpoint (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, or
            ``endpoint_url`` in the AWS config file) is no ``http(s)`` URL with a host
            botocore accepts, the message showing it without its credentials; or botocore
            refuses the AWS config file or the region.
        RemoteAccessError: ``AWS_PROFILE`` names no profile, or the credentials in the
            environment are partial.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict("os.environ", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}):
        ...     client = make_s3_client(5.0)
        >>> client.meta.endpoint_url, client.meta.config.s3["addressing_style"]
        ('http://127.0.0.1:9', 'path')
    """
    botocore = _botocore()
    custom = _checked_endpoint(botocore)
    config = botocore.config.Config(
        connect_timeout=timeout,
        read_timeout=timeout,
        retries={"mode": "standard", "max_attempts": 3},
        s3={"addressing_style": "path"} if custom else None,
    )
    session = botocore.session.get_session()
    session.register_component("data_loader", _models())
    errors = botocore.exceptions
    try:
        return session.create_client("s3", config=config)
    # Credentials are read while the client is made: refused as a request's would be (a
    # credential_process that fails or is missing, an SSO token that expired, included).
    except (*_credential_errors(errors), OSError) as e:
        raise RemoteAccessError(
            f"S3: the AWS credentials could not be had: {quote_foreign(e)}",
            remedies=(_CREDENTIALS,),
        ) from e
    except errors.BotoCoreError as e:  # a config file or region botocore cannot take
        raise UsageError(
            f"S3: the AWS settings are refused: {quote_foreign(e)}",
            remedies=(Remedy(text="correct the AWS_* variable or the AWS config file named"),),
        ) from e
    except ValueError as e:  # (the variables are checked: an endpoint_url of the AWS config)
        words, sep, refused = str(e).partition(": ")
        if (words, sep) != ("Invalid endpoint", ": "):
            raise
        where = f"endpoint_url {shown_any(refused)!r} in the AWS config file"
        raise _not_accepted(where, "endpoint_url = https://HOST[:PORT] there") from e


def _credential_errors(errors: Any) -> tuple[type[Exception], ...]:
    """botocore's errors that say the credentials could not be had (those this botocore has)."""
    names = ("ProfileNotFound", "PartialCredentialsError", "CredentialRetrievalError")
    names += ("SSOTokenLoadError", "UnauthorizedSSOTokenError", "TokenRetrievalError")
    return tuple(getattr(errors, name) for name in names if hasattr(errors, name))


def _checked_endpoint(botocore: Any) -> bool:
    """Whether an endpoint variable is set (buckets are then addressed by path); one that
    botocore would refuse, with a bare ``ValueError`` quoting it whole, is refused here."""
    found = next(((n, os.environ[n]) for n in _ENDPOINT_VARIABLES if os.environ.get(n)), None)
    if found is None:
        return False
    name, value = found
    given, sep, rest = value.partition("://")
    if not sep or given.lower() not in ("http", "https"):
        written = rest if sep else value
        fix = shown_any("https://" + written) if written.strip("/") else "https://HOST"
        raise UsageError(
            f"{name}={shown_any(value)!r} is not an http(s) URL: write {name}={fix} "
            "(or http:// for a server on your own network)"
        )
    utils = botocore.utils
    try:
        accepted = utils.is_valid_endpoint_url(value) or utils.is_valid_ipv6_endpoint_url(value)
    except ValueError:  # (urlsplit's: an unclosed '[')
        accepted = False
    if not accepted:
        raise _not_accepted(
            f"{name}={shown_any(value)!r}", f"{name}=https://HOST[:PORT] (or http://)"
        )
    return True


def _not_accepted(where: str, fix: str) -> UsageError:
    """An endpoint setting botocore refuses, named by ``where``, with what to write."""
    return UsageError(
        f"{where} is not an http(s) URL with a host botocore accepts: write {fix}, the host "
        "name of letters, digits, '-' and '.' only (no '_'), or its IP address"
    )


@contextlib.contextmanager
def _counting(client: Any, sent: list[str]) -> Iterator[None]:
    """Each request ``client`` sends meanwhile, into ``sent``, botocore's own retries
    included (it emits ``before-send`` before each attempt)."""

    def count(event_name: str, **_: Any) -> None:
        sent.append(event_name)

    client.meta.events.register("before-send.s3", count)
    try:
        yield
    finally:
        client.meta.events.unregister("before-send.s3", count)


class S3Transport:
    """One S3 object read by byte ranges (``get_object`` with ``Range``).

    Args:
        client: the session's S3 client (:func:`make_s3_client`).
        url: ``s3://BUCKET/KEY``, as the user gave it.
        stats: where the requests a :meth:`get` makes besides its answer's are counted (the
            attempts botocore sent again); the caller counts the answer
            (:class:`~ckpt_tools.io.remote.rangefile.RemoteFile` does).

    Example:
        >>> import io
        >>> from botocore.stub import Stubber
        >>> client = make_s3_client(5.0)
        >>> stub = Stubber(client)
        >>> answer = {"ContentRange": "bytes 0-2/3", "Body": io.BytesIO(b"abc")}
        >>> stub.add_response("get_object", answer)
        >>> with stub:
        ...     S3Transport(client, "s3://runs/last.ckpt").get(0, 1024)
        (b'abc', 3)
    """

    def __init__(self, client: Any, url: str, stats: TransferStats | None = None) -> None:
        self.url = url
        self.bucket, self.key = split_s3(url)
        self.stats = stats if stats is not None else TransferStats()
        self._client = client
        self._same = SameObject(url)

    def get(self, start: int, end: int) -> tuple[bytes, int]:
        """The bytes ``[start, min(end, size))`` and the object's size, in one request.

        Args:
            start, end: the range, ``0 <= start < end``.

        Returns:
            ``(data, size)``; ``data`` is empty when ``start`` is at or past the end.

        Raises:
            CheckpointNotFoundError: no such key or bucket.
            RemoteAccessError: no credentials, or credentials refused.
            RangeNotSupportedError: the whole object came back, larger than asked for.
            RemoteError: the endpoint could not be reached, timed out or failed, or the
                object's size or ETag is not the first answer's (it was replaced).
        """
        if not 0 <= start < end:
            raise ValueError(f"bad range [{start}, {end})")
        botocore = _botocore()
        sent: list[str] = []
        try:
            with _counting(self._client, sent):
                answer = self._client.get_object(
                    Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end - 1}"
                )
        except botocore.exceptions.ClientError as e:
            return self._client_error(e, start)
        except (
            botocore.exceptions.NoCredentialsError,
            botocore.exceptions.PartialCredentialsError,
        ) as e:
            raise RemoteAccessError(
                f"{self.url}: {quote_foreign(e)}", path=self.url, remedies=(_CREDENTIALS,)
            ) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._endpoint_error(e) from e
        finally:
            for _ in sent[1:]:  # each attempt botocore sent again, a request too
                self.stats.add(0)
        try:
            data, size = self._body(answer, start, end)
        except botocore.exceptions.BotoCoreError as e:
            raise self._endpoint_error(e) from e
        finally:
            answer["Body"].close()
        modified = answer.get("LastModified")
        self._same.check(size, answer.get("ETag"), None if modified is None else str(modified))
        return data, size

    def close(self) -> None:
        """Nothing to release: the client belongs to the session."""

    def _body(self, answer: dict[str, Any], start: int, end: int) -> tuple[bytes, int]:
        if answer.get("ContentRange") is None:  # the whole object, not a range
            size = int(answer.get("ContentLength", 0))
            if size > end - start:
                raise range_refused(self.url, size)
            whole = answer["Body"].read(end - start + 1)
            return whole[start:end], len(whole)
        length, total = check_content_range(self.url, answer["ContentRange"], start, end)
        data = answer["Body"].read(length + 1)
        if len(data) != length:
            raise RemoteError(f"{self.url}: got {len(data)} bytes for a range of {length}")
        return data, total

    def _client_error(self, error: Any, start: int) -> tuple[bytes, int]:
        details = error.response.get("Error", {})
        code = str(details.get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "InvalidRange" or status == 416:
            size = str(details.get("ActualObjectSize", ""))
            if (length := ascii_int(size)) is not None:
                return b"", length
            if start == 0:  # an empty object has no byte 0
                return b"", 0
        if code in _MISSING or status == 404:
            raise CheckpointNotFoundError(
                f"{self.url}: not found (S3 {code or status})", path=self.url
            ) from error
        if code in _REFUSED or status in (401, 403):
            raise RemoteAccessError(
                f"{self.url}: access refused (S3 {code or status})",
                path=self.url,
                remedies=(_CREDENTIALS,),
            ) from error
        raise RemoteError(f"{self.url}: {quote_foreign(error)}", path=self.url) from error

    def _endpoint_error(self, error: Exception) -> RemoteError:
        endpoint = shown_any(self._client.meta.endpoint_url)  # (AWS_ENDPOINT_URL may hold one)
        remedies = ()
        if "Timeout" in type(error).__name__:
            remedies = (Remedy(text=f"set {TIMEOUT_ENV} to more seconds if the server is slow"),)
        return RemoteError(
            f"{self.url}: S3 endpoint {endpoint}: {shown_text(quote_foreign(error))}",
            path=self.url,
            remedies=remedies,
        )

"""Remote files read by byte ranges: ``https://``, ``hf://`` and ``s3://`` (the remote extra).

A :class:`RemoteSession` opens URLs as :class:`RemoteFile` objects, seekable files whose reads
are ranged requests through a small cache, and counts what they cost in one
:class:`TransferStats`. httpx (HTTP and the Hub) and botocore (S3) are imported only when a
URL of theirs is opened: ``pip install 'ckpt_tools[remote]'``.
"""

from ckpt_tools.io.remote.rangefile import RemoteFile, TransferStats
from ckpt_tools.io.remote.session import RemoteSession
from ckpt_tools.io.remote.urls import is_url

__all__ = ["RemoteFile", "RemoteSession", "TransferStats", "is_url"]

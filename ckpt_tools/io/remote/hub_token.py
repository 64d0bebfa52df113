"""The Hub token, found where huggingface_hub looks for it."""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_tools.errors import UsageError

__all__ = ["hf_token"]


def hf_token() -> str | None:
    """The Hub token huggingface_hub would send, or None.

    ``HF_TOKEN`` (or the older ``HUGGING_FACE_HUB_TOKEN``), else the file at
    ``HF_TOKEN_PATH``, else ``$HF_HOME/token`` (``HF_HOME`` defaults to
    ``$XDG_CACHE_HOME/huggingface``, that to ``~/.cache/huggingface``).

    Returns:
        The token, stripped of surrounding whitespace; None when none is set.

    Raises:
        UsageError: the token holds characters an HTTP header cannot carry (the message
            names where it came from, never the token).

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict("os.environ", {"HF_TOKEN": " hf_example\\n"}):
        ...     hf_token()
        'hf_example'
    """
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(name, "").strip():
            return _header_safe(os.environ[name].strip(), name)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token")
    try:
        token = Path(os.path.expandvars(path)).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, ValueError):
        return None
    return _header_safe(token, f"the token file {path}") if token else None


def _header_safe(token: str, source: str) -> str:
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise UsageError(f"the Hub token in {source} holds characters a header cannot carry")
    return token

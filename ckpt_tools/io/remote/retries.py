"""When a busy server is asked again: a 429 or 503 that names its wait (``Retry-After``).

Transport-free: the HTTP transport asks :func:`busy_wait` of each answer, and sleeps and
asks again while it gives a wait, :data:`RETRIES` times at most.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

__all__ = ["MAX_RETRY_WAIT", "RETRIES", "busy_wait", "retry_after"]

# A 429 or 503 that says when to come back is asked again, this many times, after the wait
# it names, cut to MAX_RETRY_WAIT seconds.
RETRIES = 3
MAX_RETRY_WAIT = 30.0
_BUSY = (429, 503)


def retry_after(value: str | None) -> float | None:
    """The seconds a ``Retry-After`` header asks a client to wait, at most
    :data:`MAX_RETRY_WAIT`: whole seconds, or an HTTP date (0 once past).

    Returns:
        The wait; None for no header or one that is neither.

    Example:
        >>> retry_after("2"), retry_after("3600"), retry_after("Thu, 01 Jan 2015 00:00:00 GMT")
        (2.0, 30.0, 0.0)
        >>> retry_after("soon") is None
        True
    """
    import email.utils  # only a busy server's answer needs it

    text = (value or "").strip()
    if re.fullmatch(r"[0-9]+", text):
        return min(float(text), MAX_RETRY_WAIT)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # (an HTTP date is in GMT)
        when = when.replace(tzinfo=timezone.utc)
    seconds = (when - datetime.now(timezone.utc)).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_WAIT)


def busy_wait(status: int, header: str | None) -> float | None:
    """How long to wait before asking again: for a 429 or 503 its ``Retry-After``, else None.

    Example:
        >>> busy_wait(429, "1"), busy_wait(503, None), busy_wait(500, "1")
        (1.0, None, None)
    """
    return retry_after(header) if status in _BUSY else None

"""How thoroughly a writing command re-reads its output, and the check of a caller's choice.

Apart from :mod:`ckpt_tools.io.verify.outputs` (which does the re-reading) so that a command can
check its arguments before reading anything, without loading the verification code first.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_tools._types import one_of

__all__ = ["NOT_VERIFIED", "VERIFY_LEVELS", "check_verify_level"]

# sizes: keys, dtypes, shapes and sizes read back; full: every byte compared too; none.
VERIFY_LEVELS = ("sizes", "full", "none")
#: A result's ``verification`` where the caller chose none: one wording for every command.
NOT_VERIFIED = "not verified (verify none)"


def check_verify_level(verify: str, levels: Sequence[str] = VERIFY_LEVELS, why: str = "") -> None:
    """Refuse a verification level the command does not offer.

    Args:
        verify: the caller's ``verify=`` argument.
        levels: the levels the command offers (consolidate offers no ``full``).
        why: said after the list: what the levels mean for this command.

    Raises:
        UsageError: ``verify`` is not one of ``levels``.

    Example:
        >>> check_verify_level("full")
        >>> check_verify_level("fast")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: verify='fast': expected one of: sizes, full, none
    """
    one_of(verify, levels, "verify", flag="--verify", why=why)

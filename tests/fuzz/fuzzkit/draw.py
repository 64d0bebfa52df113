"""Choices for the mutators, from hypothesis (``st.data()``) or from a seeded ``random.Random``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

INTERESTING_INTS = (
    0,
    1,
    -1,
    2,
    3,
    7,
    8,
    63,
    64,
    255,
    256,
    4095,
    65535,
    65536,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32 - 1,
    2**32,
    2**40,
    2**42,
    2**53 + 1,
    2**62,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64 - 1,
    2**64,
)


class Draw:
    """``int``, ``choice``, ``bool``, ``bytes`` from one source of choices."""

    def __init__(self, source: Any) -> None:
        # source: a hypothesis ``st.data()`` object, or a random.Random.
        self.source = source
        if not isinstance(source, random.Random):
            from hypothesis import strategies as st

            self._st = st

    def int(self, lo: int, hi: int) -> int:
        if isinstance(self.source, random.Random):
            return self.source.randint(lo, hi)
        return self.source.draw(self._st.integers(lo, hi))

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.int(0, len(seq) - 1)]

    def bool(self, percent: int = 50) -> bool:
        return self.int(0, 99) < percent

    def bytes(self, lo: int, hi: int) -> bytes:
        if isinstance(self.source, random.Random):
            return self.source.randbytes(self.source.randint(lo, hi))
        return self.source.draw(self._st.binary(min_size=lo, max_size=hi))

    def interesting_int(self, near: int | None = None) -> int:
        """A boundary value, or one close to ``near``."""
        if near is not None and self.bool(50):
            return self.choice(
                (near + 1, near - 1, near * 2, near // 2, -near, near + 8, near - 8, near + 4096)
            )
        return self.choice(INTERESTING_INTS)

    def index(self, seq: Sequence[Any]) -> int:
        return self.int(0, len(seq) - 1)

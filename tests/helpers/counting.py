"""Bounds on work that do not depend on the machine: count operations, not seconds.

A shared test machine can be slow at any moment, so "it took under 5 s" can fail on a good
day and, against exponential work, never returns to fail at all. A :class:`LookupBudget`
counts the lookups made in :class:`CountingDict` trees and fails the test the moment they
pass the allowance, long before exponential work would hang it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class OverBudget(AssertionError):
    """More lookups than allowed: the code under test does more work than it should."""


@dataclass
class LookupBudget:
    """How many dict lookups a piece of work may make.

    Attributes:
        allowed: the allowance.
        spent: lookups counted so far.
    """

    allowed: int
    spent: int = 0

    def spend(self) -> None:
        """Count one lookup; raise :class:`OverBudget` past the allowance."""
        self.spent += 1
        if self.spent > self.allowed:
            raise OverBudget(f"more than {self.allowed} lookups")


class CountingDict(dict):
    """A real ``dict`` that charges each lookup and each walk to a :class:`LookupBudget`.

    Example:
        >>> budget = LookupBudget(allowed=2)
        >>> d = CountingDict(budget, a=1)
        >>> d["a"], "b" in d
        (1, False)
        >>> budget.spent
        2
    """

    def __init__(self, budget: LookupBudget, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.budget = budget

    def __getitem__(self, key: Any) -> Any:
        self.budget.spend()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.budget.spend()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        self.budget.spend()
        return super().__iter__()

    def keys(self) -> Any:
        self.budget.spend()
        return super().keys()

    def values(self) -> Any:
        self.budget.spend()
        return super().values()

    def items(self) -> Any:
        self.budget.spend()
        return super().items()

    def get(self, key: Any, default: Any = None) -> Any:
        self.budget.spend()
        return super().get(key, default)

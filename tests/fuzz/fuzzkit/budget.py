"""Hypothesis settings for the short (make test) and long (make fuzz) budgets."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as fixed_seed

from .registry import env_int

LONG = os.environ.get("CKPT_FUZZ_LONG") == "1"


def fuzz_settings(env: str, default: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@given`` settings: ``env`` examples (``default`` in the normal test run).

    The short budget is derandomized, so every run tries the same inputs; the long budget
    draws new ones (``CKPT_FUZZ_SEED`` to repeat one). Nothing is shrunk or stored: a finding
    is recorded as a regression file and the run goes on.
    """
    chosen = settings(
        max_examples=env_int(env, default),
        derandomize=not LONG,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )

    def apply(test: Callable[..., Any]) -> Callable[..., Any]:
        test = chosen(test)
        if LONG and "CKPT_FUZZ_SEED" in os.environ:
            test = fixed_seed(env_int("CKPT_FUZZ_SEED", 0))(test)
        return test

    return apply

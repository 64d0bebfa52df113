"""Hypothesis settings for the short (``make test``) and long (``make fuzz``) budgets.

Short (the default): derandomized, a fixed number of inputs, the same inputs on every run.
Long (``CKPT_FUZZ_LONG=1``): random generation (``CKPT_FUZZ_SEED`` repeats a run), as many
inputs as fit in ``CKPT_FUZZ_SECONDS`` (split between the library and the command line by
``share``); ``CKPT_FUZZ_EXAMPLES`` / ``CKPT_FUZZ_CLI_EXAMPLES`` still cap the count.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as fixed_seed

from .registry import env_int

LONG = os.environ.get("CKPT_FUZZ_LONG") == "1"


class TimeUp(Exception):
    """Raised inside a long run's test body when its share of the time is spent."""


class Clock:
    """The long run's time budget for one test; never runs out in the short budget."""

    def __init__(self, share: float) -> None:
        seconds = env_int("CKPT_FUZZ_SECONDS", 0) * share if LONG else 0
        self.deadline = time.monotonic() + seconds if seconds else None

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeUp


def run_until_time_up(run: Callable[[], None]) -> None:
    with contextlib.suppress(TimeUp):
        run()


def fuzz_settings(env: str, default: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@given`` settings: ``env`` examples (``default`` in the normal test run).

    Nothing is shrunk or stored: a finding is recorded as a regression file and the run goes
    on.
    """
    cap = 10**7 if LONG and "CKPT_FUZZ_SECONDS" in os.environ else default
    chosen = settings(
        max_examples=env_int(env, cap),
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

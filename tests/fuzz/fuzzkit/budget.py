"""Hypothesis settings for the short (``make test``) and long (``make fuzz``) budgets.

Short (the default): derandomized, a fixed number of inputs, the same inputs on every run.
Long (``CKPT_FUZZ_LONG=1``): random generation from ``CKPT_FUZZ_SEED`` (a run repeats with the
same seed, up to the time it had), in rounds of a few inputs until this test's share of
``CKPT_FUZZ_SECONDS`` is spent; ``CKPT_FUZZ_EXAMPLES`` / ``CKPT_FUZZ_CLI_EXAMPLES`` cap the count.
Nothing is shrunk or stored: a finding is recorded as a regression file and the run goes on.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from .registry import env_int

LONG = os.environ.get("CKPT_FUZZ_LONG") == "1"


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def fuzz(env: str, default: int, share: float, rounds_of: int, body: Callable[[Any], None]) -> None:
    """Run ``body(data)`` (``data``: hypothesis ``st.data()``) over the budget.

    ``env`` / ``default``: the number of inputs (short budget), ``share``: this test's part of
    ``CKPT_FUZZ_SECONDS``, ``rounds_of``: inputs per round in the long budget.
    """
    seconds = env_int("CKPT_FUZZ_SECONDS", 0) * share if LONG else 0
    if not seconds:
        run = _settings(env_int(env, default))(given(st.data())(body))
        if LONG and "CKPT_FUZZ_SEED" in os.environ:
            run = fixed_seed(env_int("CKPT_FUZZ_SEED", 0))(run)
        run()
        return
    deadline = time.monotonic() + seconds
    base = env_int("CKPT_FUZZ_SEED", random.randrange(1 << 30))
    left = env_int(env, 1 << 30)
    round_ = 0
    while time.monotonic() < deadline and left > 0:
        examples = min(rounds_of, left)
        test = given(st.data())(body)  # settings apply once per wrapped test
        fixed_seed(base * 100_003 + round_)(_settings(examples)(test))()
        left -= examples
        round_ += 1

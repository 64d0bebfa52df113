"""Fixtures for the fuzzer: one sandboxed session (oracle + library workers) per test module.

Budgets come from the environment (``make fuzz`` sets the long ones):

- ``CKPT_FUZZ_EXAMPLES``: inputs through the library (``ct.inspect`` in the sandboxed worker)
  and the reference readers (default 300, derandomized);
- ``CKPT_FUZZ_CLI_EXAMPLES``: inputs through ``python -m ckpt_tools`` (inspect and one rewrite
  each; default 12, derandomized);
- ``CKPT_FUZZ_LONG=1``: random generation (``CKPT_FUZZ_SEED`` fixes it) for
  ``CKPT_FUZZ_SECONDS`` (``make fuzz FUZZ_SECONDS=600``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzzkit.campaign import Session
from fuzzkit.registry import Registry


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    s = Session(tmp_path_factory.mktemp("fuzz"))
    s.start()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def registry(request: pytest.FixtureRequest) -> Registry:
    return Registry(log_name=f"{request.node.name}.jsonl")

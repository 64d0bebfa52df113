"""Fixtures of the tests of ``ckpt_tools.ops``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.scan_corpus import CorpusEntry, build_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[CorpusEntry], Path]:
    """Every file of the scan corpus (``tests/helpers/scan_corpus.py``), built once a module,
    and the folder its payloads would leave a marker in if one ran."""
    folder = tmp_path_factory.mktemp("corpus")
    markers = tmp_path_factory.mktemp("markers")
    return build_corpus(folder, markers), markers

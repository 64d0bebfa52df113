"""The folder documentation examples run in: built once, copied fresh for each example."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.workspace import build


@pytest.fixture(scope="session")
def docs_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every file the pages name (see ``tests/docs/workspace.py``), made once per session."""
    return build(tmp_path_factory.mktemp("docs-template") / "files")

"""The folder the ``--help`` examples run in.

The examples name files as a reader's own folder holds them (``model.pt``, ``ddp.pt``,
``step-1000/``). The documentation examples' workspace (:mod:`tests.docs.workspace`) makes
those files, so one set of files backs every example, in the help and in the pages alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.workspace import build, fresh_copy


@pytest.fixture(scope="session")
def examples_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the examples name, made once per session (copied for each example)."""
    return build(tmp_path_factory.mktemp("help-examples") / "template")


@pytest.fixture
def examples_folder(
    examples_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A fresh copy of the example files, made the working folder: the examples use
    relative paths, as a reader types them in their own folder."""
    folder = fresh_copy(examples_template, tmp_path / "work")
    monkeypatch.chdir(folder)
    return folder

"""Docstring examples of ``ckpt_tools`` (``--doctest-modules``) each run in a fresh folder.

That folder holds the files the examples name (``model.pt``, ``ddp.pt``, ``out/ddp/...``;
see ``tests/helpers/doctests.py``), and whatever an example writes is thrown away with it.
"""

from __future__ import annotations

import pytest
from _pytest.doctest import DoctestItem

from tests.helpers.doctests import fill_example_folder


@pytest.fixture(autouse=True)
def _examples_folder(request: pytest.FixtureRequest) -> None:
    if not isinstance(request.node, DoctestItem):
        return
    folder = request.getfixturevalue("tmp_path")
    fill_example_folder(folder)
    request.getfixturevalue("monkeypatch").chdir(folder)

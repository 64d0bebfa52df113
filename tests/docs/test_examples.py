"""Every shell and Python example of README.md and docs/*.md runs, and does what it shows.

Each example runs in a fresh copy of one folder of example files (``workspace.py``) with the
page's ``file:`` blocks written into it; ``runner.py`` says how a block runs and what it must
give, ``blocks.py`` how a block is marked as needing a GPU or a cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import NEEDS, PYTHON, Block, all_blocks, misfiled
from tests.docs.runner import run_python, run_shell
from tests.docs.workspace import fresh_copy

BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.runnable]


def _skip_reason(block: Block) -> str | None:
    needs = block.markers.get("needs")
    if needs == "gpu":
        import torch

        return None if torch.cuda.is_available() else NEEDS["gpu"]
    return NEEDS[needs] if needs else None


def _files_of(page: str) -> list[Block]:
    return [b for b in BLOCKS if b.page == page and "file" in b.markers]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_example_runs(
    block: Block, docs_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example exits as shown, prints what is shown, and raises nothing."""
    reason = _skip_reason(block)
    if reason:
        pytest.skip(reason)
    folder = fresh_copy(docs_template, tmp_path / "work")
    for shown in _files_of(block.page):
        (folder / shown.markers["file"]).write_text(shown.text + "\n")
    monkeypatch.chdir(folder)
    if "file" in block.markers:
        if block.lang in PYTHON:
            compile(block.text, block.id, "exec")
        return
    if block.lang in PYTHON:
        run_python(block, folder)
    else:
        run_shell(block, folder)


def test_the_pages_have_examples() -> None:
    """The collection itself works: the README and the cookbook hold runnable examples."""
    pages = {b.page for b in RUNNABLE}
    assert {"README.md", "docs/cookbook.md"} <= pages, sorted(pages)
    assert len(RUNNABLE) >= 40, len(RUNNABLE)


def test_no_command_hides_in_a_block_that_is_not_run() -> None:
    """A command or Python code in a ``text`` or untagged block would escape the test."""
    hidden = {b.id: misfiled(b) for b in BLOCKS if misfiled(b)}
    assert hidden == {}, f"tag these blocks bash, console or python: {hidden}"

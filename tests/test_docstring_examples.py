"""Docstring examples are tests: every ``Example:`` section runs, and the suite runs them.

pytest's ``--doctest-modules`` runs each docstring's ``>>>`` lines (in a scratch folder of
known files, see ``conftest.py``) but passes a docstring whose examples are all ``+SKIP``
and one with no ``>>>`` at all. These tests close both holes.
"""

from __future__ import annotations

import configparser
import doctest
import importlib
import pkgutil

import pytest

import ckpt_tools
from tests.helpers import ROOT
from tests.helpers.doctests import example_sections, examples_that_run

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(ckpt_tools.__path__, "ckpt_tools.")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", ["ckpt_tools", *MODULES])
def test_every_example_section_runs_an_example(name: str) -> None:
    """A section may ``+SKIP`` a line (a multi-process run), never all of its lines."""
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=False).find(module)
    empty = [
        test.name
        for test in tests
        for section in example_sections(test.docstring or "")
        if not examples_that_run(section)
    ]
    assert empty == [], f"Example sections with no `>>>` line that runs: {empty}"
    all_skipped = [t.name for t in tests if t.examples and not examples_that_run(t.docstring or "")]
    assert all_skipped == [], f"docstrings whose every `>>>` line is +SKIP: {all_skipped}"


def test_collecting_the_library_starts_no_process_and_no_process_group() -> None:
    """Importing every module (as ``--doctest-modules`` does) runs no ``__main__`` and no DDP."""
    import torch.distributed as dist

    for name in MODULES:
        importlib.import_module(name)
    importlib.import_module("ckpt_tools.harness.__main__")  # guarded: importing it runs nothing
    assert not (dist.is_available() and dist.is_initialized())


def test_the_suite_runs_the_library_examples() -> None:
    """``make test`` (plain ``pytest``) collects the examples of every ckpt_tools module."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    pytest_config = config["tool:pytest"]
    assert "ckpt_tools" in pytest_config["testpaths"].split()
    assert "--doctest-modules" in pytest_config["addopts"].split()
    assert "SKIP" not in pytest_config.get("doctest_optionflags", "").split()


def test_a_section_of_skipped_lines_is_caught() -> None:
    docstring = """Do a thing.

    Example:
        >>> run_on_eight_gpus()  # doctest: +SKIP
        'done'

    Raises:
        ValueError: never.
    """
    (section,) = example_sections(docstring)
    assert "Raises" not in section
    assert examples_that_run(section) == []
    assert examples_that_run(section.replace("  # doctest: +SKIP", ""))
    assert [examples_that_run(s) for s in example_sections("Example:\n    prose only\n")] == [[]]

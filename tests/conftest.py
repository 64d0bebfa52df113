"""Fixtures shared by the test suite: factories that write real checkpoints into tmp_path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REAL_DIR, copy_fixture, save, tools, torch_free_env

# The remote tests' servers, started once a session when a test asks for one.
from tests.helpers.servers import (  # noqa: F401
    dead_ends,
    hub,
    hub_server,
    no_range,
    no_range_server,
    remote_env,
    s3,
    s3_server,
)
from tests.helpers.zero_runs import ZeroRuns, make_zero_runs

# `make test` runs the suite on two workers (pytest-xdist, ``--dist loadgroup``). Tests of one
# xdist_group run on one worker, one at a time:
# - "multi-process": the runs that start process groups of ranks (marked slow, or using the
#   session's ZeRO or MLP parity runs, so those are made once). Each keeps both cores busy on
#   its own, and the ranks of two runs at once could meet on one localhost port.
# - "loop-mounts": two loop mounts at once can race for a loop device, and a failed mount skips.
# - a test module with a module-scoped fixture of its own, whole, so the fixture is made once
#   (a test may ask for it by name); in the group of one of its tests where one has a group.
MULTI_PROCESS = "multi-process"
MULTI_PROCESS_FIXTURES = ("zero_runs", "parity_mlp")
LOOP_MOUNT_FIXTURES = ("xfs", "tiny_ext4")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers it too; this keeps ``-p no:xdist`` working with --strict-markers.
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each test its ``xdist_group`` (see above), unless it has one already."""
    own = {item.nodeid: _own_group(item) for item in items}
    modules = {_module_of(item): _module_of(item) for item in items if _own_module_fixture(item)}
    for item in sorted(items, key=lambda i: own[i.nodeid] != MULTI_PROCESS):
        module = _module_of(item)
        if own[item.nodeid] is not None and modules.get(module) == module:
            modules[module] = own[item.nodeid]
    for item in items:
        group = modules.get(_module_of(item), own[item.nodeid])
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


def _own_group(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    if item.get_closest_marker("slow") or any(n in names for n in MULTI_PROCESS_FIXTURES):
        return MULTI_PROCESS
    return "loop-mounts" if any(n in names for n in LOOP_MOUNT_FIXTURES) else None


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _own_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture defined in its own test module."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    return any(
        d.scope == "module" and d.baseid == _module_of(item) for defs in definitions for d in defs
    )


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``make_checkpoint(obj, name="ckpt.pt", **torch_save_kwargs) -> Path``: a real torch.save."""
    return lambda obj, name="ckpt.pt", **kwargs: save(obj, tmp_path / name, **kwargs)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """An empty folder ``tmp_path/out`` for outputs, apart from the inputs."""
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


@pytest.fixture
def make_tar(tmp_path: Path) -> Callable[..., Path]:
    """``make_tar(records, name="tar.pt") -> Path``: torch's tar format from ``TarRecords``."""

    def make(records: Any, name: str = "tar.pt") -> Path:
        path = tmp_path / name
        tools().write_torch_tar(path, records)
        return path

    return make


@pytest.fixture
def fixture_copy(tmp_path: Path) -> Callable[[str], Path]:
    """``fixture_copy(name) -> Path``: a committed fixture copied into tmp_path."""
    return lambda name: copy_fixture(name, tmp_path)


@pytest.fixture
def real_dir() -> Path:
    """``../shared/realckpt/github``; skips the test when it is absent (users' machines)."""
    folder = REAL_DIR / "github"
    if not folder.is_dir():
        pytest.skip(f"real checkpoints not found at {folder}")
    return folder


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> ZeroRuns:
    """DeepSpeed checkpoints of real ZeRO runs and their ``zero_to_fp32`` state dicts, made
    once a session (``tests/helpers/zero_runs.py``); skips without DeepSpeed."""
    return make_zero_runs(tmp_path_factory.mktemp("zero"))


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """A child-process environment in which ``import torch`` fails (see ``torch_free_env``)."""
    return torch_free_env(tmp_path, "this command must not import torch")


@pytest.fixture
def unimportable(tmp_path: Path) -> Iterator[Callable[[str, str], Any]]:
    """``load(name, source)`` imports ``source`` as module ``name``; afterwards it is gone."""
    made: list[str] = []
    folder = tmp_path / "src"
    folder.mkdir()

    def load(name: str, source: str) -> Any:
        (folder / f"{name}.py").write_text(source)
        sys.path.insert(0, str(folder))
        made.append(name)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(folder))

    yield load
    for name in made:
        sys.modules.pop(name, None)
        (folder / f"{name}.py").unlink(missing_ok=True)
        assert importlib.util.find_spec(name) is None

"""Fixtures shared by the test suite: factories that write real checkpoints into tmp_path."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
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

# `make test` runs the suite on two pytest-xdist workers (-n 2 --dist loadgroup); which tests
# share one, and why: tests/helpers/worker_groups.py. The workers write each test's group to a
# file that the controller's scheduler reads (imported here only where xdist runs).
GROUPS_FILE = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers it too; this keeps ``-p no:xdist`` working with --strict-markers.
    config.addinivalue_line("markers", "xdist_group(name): tests that run on one xdist worker")


def pytest_unconfigure(config: pytest.Config) -> None:
    if GROUPS_FILE in config.stash:
        shutil.rmtree(config.stash[GROUPS_FILE].parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller tells each worker where to write the groups."""
    if GROUPS_FILE not in node.config.stash:
        node.config.stash[GROUPS_FILE] = Path(tempfile.mkdtemp(prefix="ckpt-groups-")) / "g"
    node.workerinput["ckpt_groups_file"] = str(node.config.stash[GROUPS_FILE])


@pytest.hookimpl(trylast=True)  # the final list, after deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get("ckpt_groups_file")
    if path is not None:
        from tests.helpers.worker_groups import write_groups

        write_groups(items, Path(path), config.workerinput["workerid"])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup" or GROUPS_FILE not in config.stash:
        return None
    from tests.helpers.worker_groups import GroupScheduling

    return GroupScheduling(config, log, config.stash[GROUPS_FILE])


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The temporary folder of this process and its children, inside pytest's base temp.

    torchrun's log folders and torch's error files are left in the temporary folder once the
    ranks exit; here pytest removes them with its old base temps instead of /tmp filling up.
    """
    folder = tmp_path_factory.mktemp("tmpdir")
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # gettempdir() caches its first answer
    yield folder
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


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
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test, its count put back after: torch's NaN bits of a long
    cast depend on its thread count, and ours are one thread's."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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

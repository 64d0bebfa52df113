"""Which tests share a pytest-xdist worker under ``make test`` (``-n 2 --dist loadgroup``).

The tests of one group run on one worker, one after another:

- ``multi-process``: the runs that start process groups of ranks (marked ``slow``, or using
  the session's ZeRO or MLP parity runs, so those are made once). Each keeps both cores busy
  on its own, and the ranks of two runs at once could meet on one localhost port.
- ``loop-mounts``: two loop mounts at once can race for a loop device, and a failed mount
  skips its test.
- a test module with a module-scoped fixture of its own, whole, so that fixture is made once
  (a test may ask for it by name); in its tests' group where one of them has one.
- an ``xdist_group`` mark names a group too.

pytest-xdist's own loadgroup passes a test's group to its scheduler by rewriting the test's
node id, which pytest's structured node ids (9.2) no longer take: every test would be
scheduled alone. So the workers write the groups they collected to a file
(:func:`write_groups`) that :class:`GroupScheduling`, in the controller, reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling

MULTI_PROCESS = "multi-process"
MULTI_PROCESS_FIXTURES = ("zero_runs", "parity_mlp")
LOOP_MOUNT_FIXTURES = ("xfs", "tiny_ext4")


def groups_of(items: list[pytest.Item]) -> dict[str, str]:
    """``{node id: group}`` of the tests that belong to one (see the module's docstring)."""
    own = {item.nodeid: _own_group(item) for item in items}
    modules = {_module_of(item): _module_of(item) for item in items if _own_module_fixture(item)}
    for item in sorted(items, key=lambda i: own[i.nodeid] != MULTI_PROCESS):
        module = _module_of(item)
        if own[item.nodeid] is not None and modules.get(module) == module:
            modules[module] = own[item.nodeid]
    found = {}
    for item in items:
        marked = item.get_closest_marker("xdist_group")
        group = marked.args[0] if marked else modules.get(_module_of(item), own[item.nodeid])
        if group is not None:
            found[item.nodeid] = group
    return found


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


def write_groups(items: list[pytest.Item], path: Path, worker: str) -> None:
    """Write :func:`groups_of` ``items`` to ``path`` whole (each worker writes the same)."""
    partial = path.with_name(f"{path.name}.{worker}")
    partial.write_text(json.dumps(groups_of(items)))
    os.replace(partial, path)


class GroupScheduling(LoadGroupScheduling):
    """pytest-xdist's loadgroup scheduling, with each test's group read from ``path``.

    A test that is in no group is its own unit of work; groups are handed out first, the
    largest first, and each goes to one worker whole.
    """

    def __init__(self, config: pytest.Config, log: Any, path: Path) -> None:
        super().__init__(config, log)
        self.path = path
        self.groups: dict[str, str] | None = None

    def schedule(self) -> None:
        if self.groups is None:  # the workers wrote it before they reported their collection
            self.groups = json.loads(self.path.read_text()) if self.path.exists() else {}
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        group = (self.groups or {}).get(nodeid)
        return f"group:{group}" if group is not None else super()._split_scope(nodeid)

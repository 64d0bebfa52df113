"""Ranks the harness starts itself come from a forkserver that imported torch once, and see
the environment of the process that started them, as spawned ranks do."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from ckpt_tools.harness.spawning import adopt_environment, start_method

pytestmark = pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods() or not Path("/proc").is_dir(),
    reason="needs a forkserver, and /proc to look at it",
)


def _report(rank: int, out: str, environ: dict[str, str] | None) -> None:
    """A rank: adopt ``environ`` (when given), then write what it sees."""
    if environ is not None:
        adopt_environment(environ)
    server = os.getppid()
    seen = {
        "mark": os.environ.get("CKPT_SPAWNING_MARK"),
        "ppid": server,
        "torch": "libtorch" in Path(f"/proc/{server}/maps").read_text(),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def _start(tmp_path: Path, name: str, adopt: bool) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    environ = dict(os.environ) if adopt else None
    mp.start_processes(_report, args=(str(out), environ), nprocs=2, start_method=start_method())
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def test_ranks_are_forked_with_torch_imported_and_adopt_the_current_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert start_method() == "forkserver"
    monkeypatch.setenv("CKPT_SPAWNING_MARK", "first")
    first = _start(tmp_path, "first", adopt=True)
    # Forked from a server that has torch loaded: no rank imports it anew.
    assert all(r["ppid"] != os.getpid() and r["torch"] for r in first)
    assert {r["mark"] for r in first} == {"first"}

    monkeypatch.setenv("CKPT_SPAWNING_MARK", "second")
    adopted = _start(tmp_path, "adopted", adopt=True)
    assert {r["mark"] for r in adopted} == {"second"}
    # The server's environment is older; without adopting it, a rank would see it.
    stale = _start(tmp_path, "stale", adopt=False)
    assert {r["mark"] for r in stale} != {"second"}
    assert len({r["ppid"] for r in first + adopted + stale}) == 1  # one server for all

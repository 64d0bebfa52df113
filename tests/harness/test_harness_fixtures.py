"""make_fixtures: real runs of every strategy, small enough to commit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.harness.config import STRATEGIES
from ckpt_tools.harness.make_fixtures import FIXTURE_COMMAND, FIXTURE_STRATEGIES, make_fixtures

COMMITTED = Path(ckpt_tools.__file__).resolve().parent.parent / "fixtures" / "harness"


def test_make_fixtures_writes_checkpoints_and_a_readme(tmp_path: Path) -> None:
    # In-process strategies only, to stay fast; the committed set (all four) is checked below.
    paths = make_fixtures(tmp_path, steps=1, strategies=("single", "manual"))
    readme = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert FIXTURE_COMMAND in readme and paths[-1].name == "README.md"
    for strategy in ("single", "manual"):
        names = {p.name for p in (tmp_path / strategy).iterdir()}
        assert names == {"wrapped.pt", "bare.pt", "trainer.pt"}
        assert f"`{strategy}/wrapped.pt`" in readme


@pytest.mark.skipif(not COMMITTED.is_dir(), reason="fixtures/harness not generated")
def test_committed_fixtures_load_and_agree_across_strategies() -> None:
    total = sum(p.stat().st_size for p in COMMITTED.rglob("*") if p.is_file())
    assert total < 300_000
    assert FIXTURE_COMMAND in (COMMITTED / "README.md").read_text(encoding="utf-8")
    committed = [s for s in STRATEGIES if (COMMITTED / s).is_dir()]
    assert committed == list(FIXTURE_STRATEGIES) == ["single", "dp", "ddp", "manual"]
    bare = {s: torch.load(COMMITTED / s / "bare.pt", weights_only=True) for s in committed}
    for strategy in committed:
        wrapped = torch.load(COMMITTED / strategy / "wrapped.pt", weights_only=True)
        assert list(wrapped) == [f"module.{k}" for k in bare[strategy]]
        for key, value in bare["single"].items():
            torch.testing.assert_close(bare[strategy][key], value, rtol=0, atol=1e-5)

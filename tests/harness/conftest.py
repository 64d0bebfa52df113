"""Shared fixtures of the harness tests: one parity run reused by several tests."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import ckpt_tools
from ckpt_tools.harness import ParityReport, run_parity

REPO_ROOT = Path(ckpt_tools.__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for child interpreters that must import this checkout of ckpt_tools."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    # A torchrun started from inside a torchrun worker would see the outer rank's variables.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="session")
def parity_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared MLP parity run keeps its checkpoints."""
    return tmp_path_factory.mktemp("parity-mlp")


@pytest.fixture(scope="session")
def parity_mlp(parity_dir: Path) -> ParityReport:
    """Every strategy, MLP, world size 2, 3 steps, on the CPU (DDP, FSDP and ZeRO-3 spawned
    over gloo; ZeRO only where DeepSpeed is installed)."""
    return run_parity(world_size=2, steps=3, model="mlp", out_dir=parity_dir, device="cpu")


@pytest.fixture
def torchrun_train(
    subprocess_env: dict[str, str],
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``torchrun_train(launcher, strategy, steps, out, timeout, extra=())``:
    ``ckpt_tools.harness train`` as two CPU ranks under ``launcher`` (torchrun's argv), with
    the ``extra`` options, which must exit 0 with only rank 0 printing its line."""

    def run(
        launcher: Sequence[str],
        strategy: str,
        steps: int,
        out: Path,
        timeout: int,
        extra: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str]:
        command = [
            *launcher,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ckpt_tools.harness",
            "train",
            "--strategy",
            strategy,
            "--arch",
            "mlp",
            "--steps",
            str(steps),
            "--device",
            "cpu",
            "--out",
            str(out),
            *extra,
        ]
        proc = subprocess.run(
            command,
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("(world size 2, torchrun, gloo)") == 1, proc.stdout  # rank 0
        return proc

    return run

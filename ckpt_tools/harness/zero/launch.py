"""Launching the tests' DeepSpeed ZeRO runs: ``world_size`` ranks under ``torchrun``, each
running :func:`ckpt_tools.harness.zero.runs.main` over the runs it is given.

:func:`start_zero_runs` returns at once (the tests start several launches side by side);
:func:`make_zero_checkpoints` waits for one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ckpt_tools.errors import UsageError
from ckpt_tools.harness.zero.runs import ZeroRun

__all__ = ["ZeroLaunch", "make_zero_checkpoints", "start_zero_runs"]


@dataclass
class ZeroLaunch:
    """A started :func:`start_zero_runs`: wait for it with :meth:`wait`."""

    out: Path
    runs: tuple[ZeroRun, ...]
    process: subprocess.Popen[str]

    def wait(self, timeout: float = 600) -> dict[str, Path]:
        """Wait for the ranks to finish.

        Args:
            timeout: seconds to wait before killing them.

        Returns:
            Each run's name -> its save folder (``latest``, the tag folders, DeepSpeed's
            scripts).

        Raises:
            RuntimeError: the launch failed or left a run unsaved; the message carries the
                end of its output.
        """
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            output = self._stop()
        missing = [r.name for r in self.runs if not (self.out / r.name / "latest").is_file()]
        if self.process.returncode != 0 or missing:
            raise RuntimeError(
                f"DeepSpeed training exited {self.process.returncode} (runs not saved: "
                f"{missing}):\n{output[-6000:]}"
            )
        return {r.name: self.out / r.name for r in self.runs}

    def _stop(self, grace: float = 10) -> str:
        """End torchrun and its ranks; the output they wrote.

        torchrun stops its ranks on SIGTERM. Each rank runs in a session of its own, so a
        kill of torchrun alone (or of its group) would leave them training, holding the
        output pipe open: any still running after ``grace`` seconds are killed one by one.
        """
        ranks = _children(self.process.pid)
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        for pid in (self.process.pid, *ranks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return self.process.communicate()[0]


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's ``/proc``; none known elsewhere)."""
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in listed.split()]


def start_zero_runs(
    out: str | os.PathLike[str],
    runs: Sequence[ZeroRun],
    *,
    world_size: int = 2,
    references: bool = False,
    env: Mapping[str, str] | None = None,
) -> ZeroLaunch:
    """Start training and saving ``runs`` with DeepSpeed on ``world_size`` CPU ranks (gloo)
    under torchrun, one run after the other in the same ranks.

    Args:
        out: the folder that receives one save folder per run.
        runs: the runs.
        world_size: the number of ranks (the data-parallel world size).
        references: also save ``zero_to_fp32``'s state dict of every saved tag
            (:func:`reference_path`) of the runs it reads.
        env: the ranks' environment (default: this process's).

    Returns:
        The running launch.

    Raises:
        UsageError: a bad run, or two with one name.
    """
    for run in runs:
        run.validate()
    if len({r.name for r in runs}) != len(runs):
        raise UsageError("two runs have the same name", argument="runs")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("DS_ACCELERATOR", "cpu")
    child_env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        "-m",
        "ckpt_tools.harness.zero.runs",
        str(folder),
        json.dumps([asdict(r) for r in runs]),
        "1" if references else "0",
    ]
    process = subprocess.Popen(
        command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return ZeroLaunch(folder, tuple(runs), process)


def make_zero_checkpoints(
    out: str | os.PathLike[str],
    runs: Sequence[ZeroRun],
    *,
    world_size: int = 2,
    references: bool = False,
    timeout: float = 600,
) -> dict[str, Path]:
    """Train and save ``runs`` with DeepSpeed on ``world_size`` CPU ranks, and wait.

    Args:
        out, runs, world_size, references: as :func:`start_zero_runs` takes them.
        timeout: seconds the launch may take.

    Returns:
        Each run's name -> its save folder.

    Raises:
        UsageError: a bad run.
        RuntimeError: the launch failed; the message carries its output.

    Example:
        >>> make_zero_checkpoints("o", [ZeroRun("s2", stage=2)])  # doctest: +SKIP
        {'s2': PosixPath('o/s2')}
        >>> make_zero_checkpoints("o", [ZeroRun("s4", stage=4)])
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: stage=4: ZeRO has stages 0 to 3
    """
    launch = start_zero_runs(out, runs, world_size=world_size, references=references)
    return launch.wait(timeout)

"""DeepSpeed ZeRO checkpoints of real training runs, made once per test session.

:func:`make_zero_runs` starts two launches at once under torchrun on CPU ranks (gloo), one of
2 ranks and one of 3 (uneven partitions), each training and saving several runs in the same
processes (:mod:`ckpt_tools.harness.zero.runs`); rank 0 also saves DeepSpeed's own
``zero_to_fp32`` state dict of every saved tag, the oracle the tests compare with. Tests read
these folders and never change them: a test that damages one works on a copy.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import ckpt_env

#: ``(ranks, run name)`` of the runs ``zero_to_fp32`` reads, as test ids use them.
RUN_IDS: tuple[tuple[int, str], ...] = (
    (2, "z1"),
    (2, "z1a-bf16"),
    (2, "z2-bf16"),
    (2, "z2-fp16"),
    (2, "z3"),
    (2, "z3-bf16"),
    (3, "z1-bf16"),
    (3, "z2"),
    (3, "z3-bf16"),
)
#: The runs it refuses: ZeRO-0 (fp32, and fp16 let through on the CPU), and bf16 at stage 1
#: with fp32 gradients, which DeepSpeed trains with its separate bf16 optimizer.
REFUSED_IDS: tuple[tuple[int, str], ...] = ((2, "z0"), (2, "z0-fp16"), (2, "z1-bf16opt"))


def _runs(ranks: int) -> list[object]:
    from ckpt_tools.harness.zero.runs import ZeroRun

    if ranks == 2:
        return [
            ZeroRun("z1", stage=1),
            # alignment padding between parameters (param_alignment_paddings)
            ZeroRun("z1a-bf16", stage=1, dtype="bf16", parameter_alignment=True),
            # two tags: global_step1 beside the global_step2 that latest names
            ZeroRun("z2-bf16", stage=2, dtype="bf16", saves=2),
            ZeroRun("z2-fp16", stage=2, dtype="fp16"),
            # flat sub-groups of 50 elements: parameters straddle them
            ZeroRun("z3", stage=3, sub_group_size=50),
            ZeroRun("z3-bf16", stage=3, dtype="bf16"),
            ZeroRun("z0", stage=0),
            ZeroRun("z0-fp16", stage=0, dtype="fp16"),
            ZeroRun("z1-bf16opt", stage=1, dtype="bf16", fp32_grads=True),
        ]
    return [
        ZeroRun("z1-bf16", stage=1, dtype="bf16"),
        ZeroRun("z2", stage=2),
        ZeroRun("z3-bf16", stage=3, dtype="bf16", sub_group_size=40),
    ]


@dataclass(frozen=True)
class ZeroRuns:
    """Where the session's runs are.

    Attributes:
        root: ``root/ranks{N}/<run name>`` is a run's save folder.
    """

    root: Path

    def folder(self, ranks: int, name: str) -> Path:
        """A run's save folder (``latest``, the tag folders, DeepSpeed's scripts)."""
        return self.root / f"ranks{ranks}" / name

    def reference(self, ranks: int, name: str, tag: str = "global_step2") -> Path:
        """``zero_to_fp32``'s state dict of a run's tag, as ``torch.save`` wrote it."""
        from ckpt_tools.harness.zero.runs import reference_path

        return reference_path(self.root / f"ranks{ranks}", name, tag)

    def copy(self, ranks: int, name: str, dst: Path) -> Path:
        """A copy of a run's save folder at ``dst``, for a test that changes it."""
        return Path(shutil.copytree(self.folder(ranks, name), dst))


def make_zero_runs(root: Path) -> ZeroRuns:
    """Train and save every run of :data:`RUN_IDS` into ``root``; skip without DeepSpeed."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: pip install 'ckpt_tools[deepspeed]'")
    from ckpt_tools.harness.zero.launch import start_zero_runs

    launches = [
        start_zero_runs(
            root / f"ranks{ranks}",
            _runs(ranks),  # type: ignore[arg-type]
            world_size=ranks,
            references=True,
            env=ckpt_env(),
        )
        for ranks in (2, 3)
    ]
    try:
        for launch in launches:
            launch.wait(timeout=600)
    finally:
        for launch in launches:
            if launch.process.poll() is None:
                launch.process.kill()
                launch.process.wait()
    return ZeroRuns(root)

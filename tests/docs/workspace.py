"""The folder every documentation example runs in: the files the pages name, made once.

The pages name files as a reader's own folder would hold them (``ddp.pt``, ``last.ckpt``,
``step-1000/``), so each name maps to a committed fixture or to a file made here with torch,
from fixed seeds. :func:`build` writes the template once per test session; each example gets
a fresh copy of it (:func:`fresh_copy`), so no example sees another's outputs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tests.helpers import FIXTURES, run_ckpt
from tests.helpers.lora import write_tiny_adapter

# workspace name: committed fixture it copies.
COPIES = {
    "model.pt": "plain.pt",
    "compiled.pt": "compiled.pt",
    "fsdp.pt": "fsdp.pt",
    "peft.pt": "peft.pt",
    "lightning.ckpt": "lightning.ckpt",
    "last.ckpt": "lightning.ckpt",
    "trainer.pt": "trainer_adam.pt",
    "timm.pth": "state_dict_ema.pt",
    "model.safetensors": "model.safetensors",
    "model-hf": "sharded",
    "evil.pt": "evil.pt",
    "legacy.pt": "legacy.pt",
    "tied.pt": "tied_views.pt",
    "dtypes.pt": "dtypes.pt",
    "truncated.pt": "truncated.pt",
    "lfs.pt": "lfs_pointer.pt",
    "torchscript.pt": "torchscript.pt",
    "old-tar.pt": "tar_format.pt",
}

# The model the fixtures were saved from, as a reader's own module would define it.
MYNET = '''\
"""TinyNet: the model behind the example checkpoints."""
import torch
from torch import nn


class TinyNet(nn.Module):
    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build_model(num_classes: int = 3) -> TinyNet:
    return TinyNet(num_classes)
'''


def build(folder: Path) -> Path:
    """Write every file the pages name into ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in COPIES.items():
        src = FIXTURES / source
        if src.is_dir():
            shutil.copytree(src, folder / name, ignore=shutil.ignore_patterns(".*"))
        else:
            shutil.copyfile(src, folder / name)
    (folder / "mynet.py").write_text(MYNET)
    tinynet = _tinynet()
    _retagged(FIXTURES / "dataparallel.pt", folder / "ddp.pt", "cuda:0")
    _retagged(FIXTURES / "plain.pt", folder / "gpu.pt", "cuda:1")
    _pair(folder, tinynet)
    _runs(folder / "run", tinynet)
    _old_style(folder / "old.pt", tinynet)
    _whole_model(folder, tinynet)
    _dcp(folder / "step-1000", tinynet)
    write_tiny_adapter(folder / "lora")  # a PEFT LoRA adapter of model.pt
    return folder


def fresh_copy(template: Path, folder: Path) -> Path:
    """A copy of the template an example may change at will."""
    shutil.copytree(template, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _tinynet() -> type:
    """MYNET's TinyNet, as a class of module ``their_training_repo.models``.

    Pickled modules name that module, which no one can import: the file travels without its
    code, as it does between a training repository and its users.
    """
    module = types.ModuleType("their_training_repo.models")
    exec(compile(MYNET, "mynet.py", "exec"), module.__dict__)
    return module.TinyNet  # type: ignore[no-any-return]


def _retagged(src: Path, dst: Path, device: str) -> None:
    """``src`` with every storage tagged ``device``: as saved by a process on that GPU."""
    run_ckpt("retag", src, dst, "--map", f"cpu={device}")


def _model(tinynet: type, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return tinynet()


def _pair(folder: Path, tinynet: type) -> None:
    """``a.pt`` and ``b.pt``: one model, then the same with the head nudged."""
    sd = _model(tinynet, 0).state_dict()
    torch.save(sd, folder / "a.pt")
    nudged = {k: v.clone() for k, v in sd.items()}
    nudged["head.bias"] += 1e-3
    torch.save(nudged, folder / "b.pt")


def _runs(folder: Path, tinynet: type) -> None:
    """``run/ckpt_{100..600}.pt``: six checkpoints of one run, as a trainer saves them."""
    folder.mkdir()
    for step in range(100, 700, 100):
        model = _model(tinynet, step)
        torch.save({"model": model.state_dict(), "step": step}, folder / f"ckpt_{step}.pt")


def _old_style(path: Path, tinynet: type) -> None:
    """A checkpoint as older training scripts saved it: numpy values and the argparse args."""
    torch.save(
        {
            "state_dict": _model(tinynet, 1).state_dict(),
            "args": argparse.Namespace(lr=0.1, epochs=90, arch="tinynet"),
            "best_acc": np.float64(0.913),
            "epoch": 90,
        },
        path,
    )


def _whole_model(folder: Path, tinynet: type) -> None:
    """``torch.save(model)``, and Ultralytics' ``{"model", "ema"}`` of pickled modules."""
    # The pickler looks the class up by its module name while it saves.
    names = ("their_training_repo", "their_training_repo.models")
    sys.modules.update({name: types.ModuleType(name) for name in names})
    sys.modules[names[1]].TinyNet = tinynet  # type: ignore[attr-defined]
    try:
        torch.save(_model(tinynet, 2), folder / "whole_model.pt")
        models = {"model": _model(tinynet, 3), "ema": _model(tinynet, 4), "epoch": 300}
        torch.save(models, folder / "best.pt")
    finally:
        for name in names:
            del sys.modules[name]


def _dcp(folder: Path, tinynet: type) -> None:
    """A ``torch.distributed.checkpoint`` folder of model and optimizer (one process)."""
    import torch.distributed.checkpoint as dcp

    model = _model(tinynet, 5)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        # Saving without a process group is what one process does; torch says so.
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=folder)

"""Without torch: ``import ckpt_tools`` and every torch-free command work, the rest says which
extra to install.

``pip install ckpt_tools`` installs no torch (``.ci/torch-free`` checks a real install). Here
each run is a child process in which a ``sys.meta_path`` finder makes ``import torch`` and
``import safetensors`` raise ``ModuleNotFoundError``, as they do where neither is installed.
The inputs are made with torch in this process, and the outputs are read back with torch
here too.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, assert_bitwise_equal, ckpt_env, make_model, with_prefix

#: Prepended to every child's code: torch and safetensors are not installed, as far as it knows.
NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "safetensors"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
"""

#: The ``ckpt`` command, as its console script runs it.
CKPT = "from ckpt_tools.cli.main import run\nrun()\n"


def without_torch(
    code: str, *args: object, cwd: Path, package: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (after :data:`NO_TORCH`) in a child; ``package`` is a folder holding a
    ``ckpt_tools`` to use instead of this checkout's."""
    extra = {"PYTHONPATH": str(package)} if package is not None else {}
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code, *map(str, args)],
        capture_output=True,
        text=True,
        env=ckpt_env(**extra),
        cwd=cwd,
        timeout=120,
        check=False,
    )


def ckpt(*args: object, cwd: Path, code: int = 0, package: Path | None = None) -> str:
    """``ckpt ARGS`` without torch; its stdout, once the exit code is ``code``."""
    proc = without_torch(CKPT, *args, cwd=cwd, package=package)
    assert proc.returncode == code, (
        f"ckpt {' '.join(map(str, args))}: exit {proc.returncode}, expected {code}\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout if code == 0 else proc.stderr


def _model() -> dict[str, torch.Tensor]:
    """The test model's state dict, its tied weights untied (each tensor its own storage)."""
    return {k: v.clone() for k, v in make_model(0).state_dict().items()}


@pytest.fixture
def ddp(tmp_path: Path) -> Path:
    """A DDP checkpoint: the model's state dict under ``module.``."""
    path = tmp_path / "ddp.pt"
    torch.save(with_prefix(_model(), "module."), path)
    return path


def test_the_finder_hides_torch_and_safetensors(tmp_path: Path) -> None:
    code = (
        "for name in ('torch', 'safetensors.torch', 'torch.distributed'):\n"
        "    try:\n        __import__(name)\n    except ModuleNotFoundError as e:\n"
        "        print(e.name)\n"
    )
    proc = without_torch(code, cwd=tmp_path)
    assert proc.stdout.split() == ["torch", "safetensors", "torch"]


def test_the_package_and_every_public_name_import(tmp_path: Path) -> None:
    code = (
        "import ckpt_tools, ckpt_tools.harness\n"
        "for name in ckpt_tools.__all__:\n    getattr(ckpt_tools, name)\n"
        "from ckpt_tools.harness import STRATEGIES, TrainConfig\n"
        "print(len(ckpt_tools.__all__))\n"
    )
    proc = without_torch(code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 50


def test_inspect(ddp: Path, tmp_path: Path) -> None:
    info = json.loads(ckpt("inspect", ddp, "--json", cwd=tmp_path))
    want = with_prefix(_model(), "module.")
    assert [t["name"] for t in info["tensors"]] == list(want)
    assert [t["shape"] for t in info["tensors"]] == [list(t.shape) for t in want.values()]


def test_strip_module(ddp: Path, tmp_path: Path) -> None:
    ckpt("strip-module", ddp, tmp_path / "bare.pt", "--verify", "full", cwd=tmp_path)
    assert_bitwise_equal(dict(torch.load(tmp_path / "bare.pt", weights_only=True)), _model())


def test_convert_to_safetensors(ddp: Path, tmp_path: Path) -> None:
    ckpt("convert", ddp, tmp_path / "model.safetensors", "--verify", "full", cwd=tmp_path)
    got = load_file(tmp_path / "model.safetensors")
    want = with_prefix(_model(), "module.")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_bitwise_equal(got[name], tensor, name)


def test_slim_to_bf16_weights(tmp_path: Path) -> None:
    src = tmp_path / "trainer.pt"
    torch.save({"model": _model(), "optimizer": {"state": {}}, "epoch": 3}, src)
    ckpt("slim", src, tmp_path / "slim.pt", "--dtype", "bf16", "--weights-only", cwd=tmp_path)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _model().items()}
    assert_bitwise_equal(dict(torch.load(tmp_path / "slim.pt", weights_only=True)), want)


def test_consolidate_a_dcp_folder(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": _model(), "step": 5}, checkpoint_id=str(folder))
    dcp_to_torch_save(folder, tmp_path / "theirs.pt")
    want = torch.load(tmp_path / "theirs.pt", weights_only=True)["model"]
    ckpt("consolidate", folder, tmp_path / "model.pt", cwd=tmp_path)
    assert_bitwise_equal(dict(torch.load(tmp_path / "model.pt", weights_only=True)), want)


def test_sanitize(tmp_path: Path) -> None:
    src = tmp_path / "hparams.pt"
    torch.save({"state_dict": _model(), "args": argparse.Namespace(lr=0.1)}, src)
    with pytest.raises(pickle.UnpicklingError, match="argparse"):
        torch.load(src, weights_only=True)
    ckpt("sanitize", src, tmp_path / "clean.pt", cwd=tmp_path)
    clean = torch.load(tmp_path / "clean.pt", weights_only=True)
    assert_bitwise_equal(dict(clean["state_dict"]), _model())


def _extra_line(feature: str) -> str:
    return f"ckpt: error: {feature} needs torch: pip install 'ckpt_tools[torch]'\n"


@pytest.mark.parametrize(
    ("args", "feature"),
    [
        (("diff", "{ddp}", "{ddp}"), "ckpt diff"),
        (("diff", "{ddp}", "--model", "torch.nn:Linear"), "ckpt diff"),
        (("devices",), "ckpt devices"),
        (("harness", "train", "--strategy", "single"), "ckpt harness train"),
        (("harness", "parity", "--steps", "1"), "ckpt harness parity"),
    ],
    ids=["diff", "diff-model", "devices", "harness-train", "harness-parity"],
)
def test_torch_commands_name_the_extra(
    args: tuple[str, ...], feature: str, ddp: Path, tmp_path: Path
) -> None:
    err = ckpt(*(a.format(ddp=ddp) for a in args), cwd=tmp_path, code=2)
    assert err == _extra_line(feature)


@pytest.mark.parametrize(
    "command", ["diff", "devices", "harness", "harness train", "harness parity"]
)
def test_their_help_needs_no_torch(command: str, tmp_path: Path) -> None:
    assert ckpt(*command.split(), "--help", cwd=tmp_path).startswith(f"Usage: ckpt {command} ")


LIBRARY_CALLS = {
    "load_state_dict": "ckpt_tools.load_state_dict(PATH)",
    "load_with_info": "ckpt_tools.load_with_info(PATH)",
    "load_into": "ckpt_tools.load_into(object(), PATH)",
    "diff": "ckpt_tools.diff(PATH, PATH)",
    "list_devices": "ckpt_tools.list_devices()",
    "pick_devices": "ckpt_tools.pick_devices()",
    "ckpt_tools.harness.train": "ckpt_tools.harness.train",
}


@pytest.mark.parametrize("feature", LIBRARY_CALLS)
def test_library_calls_raise_missing_extra(feature: str, ddp: Path, tmp_path: Path) -> None:
    code = (
        "import ckpt_tools, ckpt_tools.harness\n"
        f"PATH = {str(ddp)!r}\n"
        "try:\n"
        f"    {LIBRARY_CALLS[feature]}\n"
        "except ckpt_tools.errors.MissingExtraError as e:\n"
        "    print(isinstance(e, ImportError), e.exit_code, e.name)\n"
        "    print(e)\n"
    )
    proc = without_torch(code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "True 2 torch",
        f"{feature} needs torch: pip install 'ckpt_tools[torch]'",
    ]


def _planted(tmp_path: Path, module: str) -> Path:
    """A copy of the package whose ``module`` (a path under ckpt_tools/) imports torch."""
    package = tmp_path / "planted"
    shutil.copytree(
        ROOT / "ckpt_tools", package / "ckpt_tools", ignore=shutil.ignore_patterns("__pycache__")
    )
    with open(package / "ckpt_tools" / module, "a") as f:
        f.write("\nimport torch  # planted\n")
    return package


@pytest.mark.parametrize(
    ("module", "command"),
    [
        ("ops/inspect/inspection.py", ("inspect", "{ddp}")),
        ("io/writers/output.py", ("strip-module", "{ddp}", "{tmp}/bare.pt")),
    ],
)
def test_a_planted_torch_import_fails_these_checks(
    module: str, command: tuple[str, ...], ddp: Path, tmp_path: Path
) -> None:
    """The checks above can fail: the same command, with torch imported on its way, exits 1."""
    package = _planted(tmp_path, module)
    args = [a.format(ddp=ddp, tmp=tmp_path) for a in command]
    err = ckpt(*args, cwd=tmp_path, code=1, package=package)
    assert "ModuleNotFoundError: No module named 'torch'" in err
    assert str(package / "ckpt_tools" / module) in err
    ckpt(*args, cwd=tmp_path)  # and without the planted line it works

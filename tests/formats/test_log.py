"""The library's warnings go to the ``ckpt_tools`` logger, which prints nothing unless the
program configures logging; the ``ckpt`` command prints them to stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _two_weight_files(folder: Path) -> Path:
    folder.mkdir()
    save_file({"a": torch.ones(1)}, folder / "model.safetensors")
    torch.save({"a": torch.ones(1)}, folder / "pytorch_model.bin")
    return folder


def test_a_warning_is_not_printed_by_the_library(tmp_path: Path) -> None:
    folder = _two_weight_files(tmp_path / "two")
    code = f"import ckpt_tools as ct; ct.inspect({str(folder)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout == done.stderr == ""
    configured = "import logging; logging.basicConfig(format='%(name)s: %(message)s'); " + code
    done = subprocess.run(
        [sys.executable, "-c", configured], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stderr.startswith("ckpt_tools: ") and "not read: pytorch_model.bin" in done.stderr


def test_the_command_prints_the_warning_on_stderr(tmp_path: Path) -> None:
    folder = _two_weight_files(tmp_path / "two")
    done = subprocess.run(
        [CKPT, "inspect", str(folder)], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stderr == (
        f"{str(folder)!r}: model.safetensors is read, as transformers' from_pretrained reads "
        "the folder; not read: pytorch_model.bin\n"
    )
    quiet = subprocess.run(
        [CKPT, "strip-module", str(folder), str(tmp_path / "out.pt"), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")


def test_the_command_leaves_a_warning_to_logging_a_module_configured(tmp_path: Path) -> None:
    # A --model module that calls basicConfig, as training scripts do: printed once, by it.
    folder = _two_weight_files(tmp_path / "two")
    module = tmp_path / "mm.py"
    module.write_text(
        "import logging, torch\n"
        "logging.basicConfig(format='LOGGED %(name)s: %(message)s')\n"
        "def make():\n"
        "    return torch.nn.Linear(1, 1)\n"
    )
    done = subprocess.run(
        [CKPT, "diff", str(folder), "--model", f"{module}:make"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if "not read: pytorch_model.bin" in line]
    assert len(lines) == 1 and lines[0].startswith("LOGGED ckpt_tools: "), done.stderr

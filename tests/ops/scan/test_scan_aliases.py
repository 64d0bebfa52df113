"""``scan`` judges a global by what its name can be, not by a family's spelling alone: a
module alias (``torch.nn.modules.linear.F`` is ``torch.nn.functional``), a special attribute
(``__builtins__``), a gadget re-exported through ``torch.nn``, and a BUILD that changes a
module in place are dangerous; the oracle is torch.load(weights_only=False) in a child."""

from __future__ import annotations

import importlib
import io
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools import scan
from ckpt_tools.ops.scan.severity import classify
from tests.helpers.child_oracle import run_script


def _torch_zip(path: Path, prefix: bytes) -> None:
    """A torch.save file whose data.pkl runs ``prefix`` right after its PROTO."""
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                data = data[:2] + prefix + data[2:]
            out.writestr(info.filename, data)


def _child(path: Path, check: str) -> str:
    """What ``check`` prints in a child that ran torch.load(path, weights_only=False)."""
    code = f"import torch, sys\ntorch.load({str(path)!r}, weights_only=False)\n{check}"
    return "".join(run_script(code, check=True)).strip()


def test_eval_reached_through_a_module_alias_is_dangerous(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    expr = f"open({str(marker)!r}, 'w').close()".encode()
    prefix = (
        b"ctorch.nn.modules.linear\nF\n"  # the torch.nn.functional module
        b"ctorch.nn.functional\n__builtins__\n"
        b"b0"  # BUILD: the builtins (eval among them) copied into torch.nn.functional
        b"ctorch.nn.functional\neval\n"
        b"X" + len(expr).to_bytes(4, "little") + expr + b"\x85R0"
    )
    path = tmp_path / "model.pt"
    _torch_zip(path, prefix)
    _child(path, "")
    assert marker.exists()  # the file runs code when torch loads it
    found = scan(path).files[0]
    assert found.verdict == "dangerous"
    dangerous = {f.global_name for f in found.findings if f.severity == "dangerous"}
    assert {
        "torch.nn.modules.linear.F",
        "torch.nn.functional.__builtins__",
        "torch.nn.functional.eval",
    } <= dangerous


def test_a_build_that_changes_a_module_is_dangerous(tmp_path: Path) -> None:
    # softmax replaced by log_softmax in torch.nn.functional, for every model loaded after.
    prefix = b"ctorch.nn.modules.linear\nF\n(Vsoftmax\nctorch.nn.functional\nlog_softmax\ndb0"
    path = tmp_path / "model.pt"
    _torch_zip(path, prefix)
    check = "import torch.nn.functional as F; print(F.softmax is F.log_softmax)"
    assert _child(path, check) == "True"
    found = scan(path).files[0]
    assert found.verdict == "dangerous"
    changed = [f for f in found.findings if f.global_name == "torch.nn.modules.linear.F"]
    assert changed and "in place" in changed[0].reason


@pytest.mark.parametrize(
    ("spelled", "gadget"),
    [
        ("torch.nn.attention._fa3.Library", "torch.library.Library"),
        ("torch.nn.modules.module.RemovableHandle", "torch.utils.hooks.RemovableHandle"),
        ("torch.nn.modules.linear.F", "torch.nn.functional"),
        ("torch.nn.functional.torch", "torch"),
        ("torch.optim.optimizer.RemovableHandle", "torch.utils.hooks.RemovableHandle"),
    ],
)
def test_a_gadget_spelled_through_a_family_is_dangerous(spelled: str, gadget: str) -> None:
    assert _resolve(spelled) is _resolve(gadget)  # what the unpickler imports by that name
    assert classify(spelled).severity == "dangerous"


def _resolve(dotted: str) -> object:
    """The object ``dotted`` names: a module, or an attribute of one."""
    try:
        return importlib.import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    "name",
    [
        "torch.nn.functional.__builtins__",
        "torch.nn.modules.linear.Linear.__dict__",
        "torch.optim.adam.Adam.__class__",
        "torch.nn.modules.linear.Linear.__init__.__globals__",
    ],
)
def test_special_attributes_are_dangerous(name: str) -> None:
    assert classify(name).severity == "dangerous"
    assert classify(name, exact=True).severity == "dangerous"


def test_a_name_judged_by_exact_names_gives_its_family_reason() -> None:
    # A global only our reader names (its split into module and name unknown) that a
    # dangerous family takes: the family says why, not the rule for attribute paths.
    rule = classify("posix.system", exact=True)
    assert rule.severity == "dangerous"
    assert rule.reason == classify("posix.system").reason

"""Suggestions for models whose children are compiled one by one (``blocks.1._orig_mod.``), on
either side or both: each printed command is run on the file, and its output must load into
the target model with torch's ``load_state_dict(strict=True)``, every tensor its own."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from ckpt_tools.diffing.engine import diff
from ckpt_tools.loading.into_module import load_into
from tests.helpers import run_ckpt

#: The models, as `ckpt diff --model nets.py:FACTORY` builds them. Under one seed every
#: factory holds the same numbers, whatever its wrappers.
NETS_PY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)


class Ema(nn.Module):  # an EMA helper: its copy is the attribute `module`
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 4)


class NetWithEma(Net):
    def __init__(self):
        super().__init__()
        self.ema = Ema()


class Wrapper(nn.Module):  # the keys DDP gives: module.<the model's>
    def __init__(self, inner):
        super().__init__()
        self.module = inner


def _compiled(model, *indices):
    for i in indices:
        model.blocks[i] = torch.compile(model.blocks[i])
    return model


def plain():
    return Net()

def child1():
    return _compiled(Net(), 1)

def children02():
    return _compiled(Net(), 0, 2)

def whole_and_child1():
    return torch.compile(_compiled(Net(), 1))

def ddp_child1():
    return Wrapper(_compiled(Net(), 1))

def ema_plain():
    return NetWithEma()

def ema_inner_compiled():
    model = NetWithEma()
    model.ema.module = torch.compile(model.ema.module)
    return model

def ddp_ema_child1():
    return Wrapper(_compiled(NetWithEma(), 1))
"""

CASES = [
    ("plain", "child1"),
    ("child1", "plain"),
    ("child1", "children02"),
    ("children02", "child1"),
    ("plain", "whole_and_child1"),
    ("whole_and_child1", "plain"),
    ("plain", "ddp_child1"),
    ("ddp_child1", "children02"),
    ("ema_plain", "ema_inner_compiled"),
    ("ddp_ema_child1", "ema_plain"),
    ("ema_plain", "ddp_ema_child1"),
]


@pytest.fixture
def nets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # the printed commands name the files as given: relative
    (tmp_path / "nets.py").write_text(NETS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def build(name: str, seed: int) -> torch.nn.Module:
    import nets  # written by the fixture

    torch.manual_seed(seed)
    return getattr(nets, name)()


def save(name: str) -> str:
    torch.save(build(name, 0).state_dict(), f"{name}.pt")
    return f"{name}.pt"


def run(command: str) -> str:
    args = shlex.split(command)
    assert args[0] == "ckpt"
    run_ckpt(*args[1:], "-q")
    return args[3]


def assert_loads(path: str, name: str) -> None:
    """torch's own check: the file loads strictly, and each tensor is the one it was."""
    model = build(name, 1)
    model.load_state_dict(torch.load(path), strict=True)
    want = list(build(name, 0).state_dict().values())
    got = list(model.state_dict().values())
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(("have", "want"), CASES)
def test_the_suggested_command_for_a_module_makes_a_file_that_loads(
    nets: Path, have: str, want: str
) -> None:
    path = save(have)
    out = run_ckpt("diff", path, "--model", f"nets.py:{want}", "--json", code=None).stdout
    suggestions = json.loads(out)["suggestions"]
    assert suggestions, out
    best = suggestions[0]
    assert best["resolved"] == best["of"], best["text"]
    assert_loads(run(best["command"]), want)
    # Every suggestion shown is one that works: none is a partial rename beside it.
    assert all(s["resolved"] == s["of"] for s in suggestions), [s["text"] for s in suggestions]


@pytest.mark.parametrize(("have", "want"), CASES)
def test_load_into_applies_the_same_rewrite(nets: Path, have: str, want: str) -> None:
    path = save(have)
    model = build(want, 1)
    report = load_into(model, path)
    assert report.ok and report.rewrites
    want_values = list(build(want, 0).state_dict().values())
    assert all(torch.equal(g, w) for g, w in zip(model.state_dict().values(), want_values))


def test_both_commands_of_a_file_diff_work(nets: Path) -> None:
    a, b = save("child1"), save("children02")
    best = diff(a, b).suggestions[0]
    assert best.text() == (
        "renaming 'blocks.0.' to 'blocks.0._orig_mod.', then renaming 'blocks.1._orig_mod.' "
        "to 'blocks.1.', then renaming 'blocks.2.' to 'blocks.2._orig_mod.' resolves 6 of 6 "
        "unexpected keys: ckpt rename child1.pt child1.renamed.pt "
        "--sub blocks.0.=blocks.0._orig_mod. --sub blocks.1._orig_mod.=blocks.1. "
        "--sub blocks.2.=blocks.2._orig_mod. (or renaming 'blocks.2._orig_mod.' to 'blocks.2.', "
        "then renaming 'blocks.1.' to 'blocks.1._orig_mod.', then renaming 'blocks.0._orig_mod.' "
        "to 'blocks.0.' on B: ckpt rename children02.pt children02.renamed.pt "
        "--sub blocks.2._orig_mod.=blocks.2. --sub blocks.1.=blocks.1._orig_mod. "
        "--sub blocks.0._orig_mod.=blocks.0.)"
    )
    assert_loads(run(best.command), "children02")
    assert_loads(run(best.inverse_command), "child1")


def test_no_rename_onto_another_childs_tensor(nets: Path) -> None:
    # blocks.0 of A is blocks.0._orig_mod of B: renaming it to blocks.1 matches a name and
    # would load the wrong tensor.
    texts = [s.text() for s in diff(save("child1"), save("children02")).suggestions]
    assert texts
    assert not any(
        "'blocks.0.' to 'blocks.1.'" in t or "'blocks.1.' to 'blocks.0.'" in t for t in texts
    )


def test_after_an_alignment_each_command_does_what_its_suggestion_says(nets: Path) -> None:
    # --align adds 'module.'; what it leaves is a prefix map found on the aligned keys
    # ('module.backbone.' -> 'module.blocks.'). On the stored file `ckpt rename` applies its
    # --sub maps before the '^=module.' regex, when no key carries 'module.' yet: the map is
    # written as it reads before the add.
    sd = build("plain", 0).state_dict()
    torch.save({k.replace("blocks.", "backbone.", 1): v for k, v in sd.items()}, "bb.pt")
    target = build("ddp_child1", 0)
    report = diff("bb.pt", target, align=True)
    assert report.aligned == ("adding 'module.'",)
    best = report.suggestions[0]
    assert best.text().startswith(
        "renaming 'module.backbone.' to 'module.blocks.' resolves 4 of 6 unexpected keys and "
        "leaves 2 missing (module.blocks.1._orig_mod.weight, module.blocks.1._orig_mod.bias): "
        "ckpt rename bb.pt bb.renamed.pt --sub backbone.=blocks. --regex '^=module.'"
    )
    for suggestion in report.suggestions:
        after = diff(run(suggestion.command), target)
        assert len(after.unexpected) == suggestion.of - suggestion.resolved, suggestion.text()
        assert after.missing == suggestion.missing, suggestion.text()

"""Pickled nn.Modules (``torch.save(model)``) give up their state dict.

Every model is an instance of a class defined in a module written to tmp_path, imported,
saved, then removed from the path and from ``sys.modules``: nothing can import it again.
The oracle is ``model.state_dict()`` taken before saving, compared through our reader, through
``ckpt convert`` read back by ``safetensors.torch.load_file``, and through ``diff``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import ckpt_tools as ct
from ckpt_tools.cli.main import cli
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle.unpickler import load_pickle
from ckpt_tools.structure.modules import is_pickled_module, recover_module

CKPT = str(Path(sys.executable).with_name("ckpt"))

NETS = """
import torch
from torch import nn


def hook(module, state_dict, prefix, local_metadata):
    return state_dict


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.lstm = nn.LSTM(4, 5, num_layers=2)
        self.blocks = nn.Sequential(
            nn.Linear(5, 5), nn.ReLU(), nn.ModuleList([nn.Linear(5, 3, bias=False), None])
        )
        self.heads = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
        self.heads["b"].weight = self.heads["a"].weight  # tied
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("cache", torch.ones(2), persistent=False)
        self.register_buffer("unset", None)
        self.register_parameter("gone", None)
        self.half = nn.Linear(2, 2).to(torch.bfloat16)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self._register_state_dict_hook(hook)
"""


def _forget(name: str, tmp_path: Path) -> None:
    sys.modules.pop(name, None)
    (tmp_path / "src" / f"{name}.py").unlink()
    assert importlib.util.find_spec(name) is None


def _saved_net(unimportable: Callable[[str, str], Any], tmp_path: Path, wrap: bool = False):
    torch.manual_seed(0)
    nets = unimportable("nets_i10", NETS)
    model = nets.Net()
    model.bn.running_mean.uniform_()  # buffers with values of their own
    model.bn.num_batches_tracked += 7
    expected = model.state_dict()
    path = tmp_path / ("wrapped.pt" if wrap else "net.pt")
    torch.save({"model": model, "epoch": 3} if wrap else model, path)
    _forget("nets_i10", tmp_path)
    return path, expected


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype and got.shape == want.shape and torch.equal(_raw(got), _raw(want))
    )


def test_recovered_keys_dtypes_shapes_and_bytes_match_state_dict(unimportable, tmp_path):
    path, expected = _saved_net(unimportable, tmp_path)
    with pytest.raises(ModuleNotFoundError):
        torch.load(path, weights_only=False)  # the class is really gone
    info = ct.inspect(path)
    assert [t.name for t in info.tensors] == list(expected)  # order too
    for t in info.tensors:
        want = expected[t.name]
        assert (t.dtype, t.shape) == (str(want.dtype).removeprefix("torch."), tuple(want.shape))
    assert "cache" not in info and "unset" not in info and "gone" not in info
    assert "bn.num_batches_tracked" in info and "lstm.weight_hh_l1" in info
    assert info.tensor("heads.a.weight").shared_with == ("heads.b.weight",)
    # Bytes: written by convert, read back by safetensors itself.
    out = tmp_path / "net.safetensors"
    ct.convert(path, out)
    loaded = safetensors.torch.load_file(out)
    with safetensors.safe_open(out, "pt") as f:
        aliases = f.metadata()
    assert aliases["heads.b.weight"] == "heads.a.weight"
    for name, want in expected.items():
        assert _same(loaded[aliases.get(name, name)], want), name


def test_tied_parameters_share_one_storage_and_lstm_flat_weights_add_nothing(
    unimportable, tmp_path
):
    path, expected = _saved_net(unimportable, tmp_path)
    found = recover_module(open_checkpoint(str(path)).root)
    assert found is not None and found.class_name == "nets_i10.Net"
    sd = found.state_dict
    assert sd["heads.a.weight"].storage is sd["heads.b.weight"].storage
    assert not sd["heads.a.weight"].is_parameter and not sd["heads.a.weight"].requires_grad
    assert len(sd) == len(expected) and not any("flat" in k for k in sd)
    # 13 modules: Net, conv, bn, lstm, blocks, 0, 1 (ReLU), 2 (ModuleList), its Linear,
    # heads, a, b, half.
    assert found.modules == 13 and found.caveats == ()


def test_dict_wrapped_model_is_selected_and_described(unimportable, tmp_path):
    path, expected = _saved_net(unimportable, tmp_path, wrap=True)
    info = ct.inspect(path)
    assert info.selected == ("model",)
    n = len(expected)
    assert f"pickled nn.Module `Net`: state dict recovered, {n} tensors" in info.selection_reason
    assert info.entries == {"epoch": "int 3"}
    assert [t.name for t in ct.inspect(path, select="model").tensors] == list(expected)
    result = CliRunner().invoke(cli, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["pickled_module"] == {
        "class": "nets_i10.Net",
        "modules": 13,
        "tensors": n,
        "caveats": [],
    }
    assert [t["name"] for t in data["tensors"]] == list(expected)


def test_diff_against_the_state_dict_saved_by_torch(unimportable, tmp_path):
    path, expected = _saved_net(unimportable, tmp_path, wrap=True)
    plain = tmp_path / "plain.pt"
    torch.save(expected, plain)
    report = ct.diff(path, plain)
    assert not report.missing and not report.unexpected
    assert len(report.tensors) == len(expected)
    assert all(t.bit_equal for t in report.tensors)
    # A mutated weight is found: the comparison reads the module's real bytes.
    expected["conv.weight"][0, 0, 0, 0] += 1
    torch.save(expected, plain)
    assert [t.name for t in ct.diff(path, plain).value_mismatches] == ["conv.weight"]


def test_pt_rewrites_still_refuse_the_module_objects(unimportable, tmp_path):
    path, _ = _saved_net(unimportable, tmp_path, wrap=True)
    out = tmp_path / "out.pt"
    result = subprocess.run(
        [CKPT, "strip-module", str(path), str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    assert "nets_i10.Net" in result.stderr and not out.exists()
    names = ct.inspect(path).unsafe_globals
    with pytest.raises(ct.ConversionError, match=r"pickled nn\.Module"):
        ct.rewrite(path, out, rules=[ct.sub_rule("conv.", "c.")], allow_globals=names)
    assert not out.exists()
    # To safetensors, nothing of the module objects is written: the classes need no allowing.
    result = subprocess.run(
        [CKPT, "convert", str(path), str(tmp_path / "w.safetensors"), "--drop-extras"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "left out: epoch, heads.b.weight" in result.stdout


def test_a_global_outside_the_module_is_still_refused_for_safetensors(unimportable, tmp_path):
    nets = unimportable("nets_i10", NETS)
    path = tmp_path / "both.pt"
    torch.save({"model": nets.Hooked(), "cfg": nets.Net}, path)  # a class beside the model
    _forget("nets_i10", tmp_path)
    with pytest.raises(ct.UnsafeContentError, match=r"nets_i10\.Net") as caught:
        ct.convert(path, tmp_path / "x.safetensors", drop_extras=True)
    assert "nets_i10.Hooked" not in str(caught.value)


def test_state_dict_hooks_are_named_as_a_caveat(unimportable, tmp_path):
    nets = unimportable("nets_i10", NETS)
    path = tmp_path / "hooked.pt"
    torch.save(nets.Hooked(), path)
    _forget("nets_i10", tmp_path)
    info = ct.inspect(path)
    assert [t.name for t in info.tensors] == ["fc.weight", "fc.bias"]
    assert info.pickled_module["caveats"] == [
        "the root module has state-dict hooks, which may change its keys; not run"
    ]
    assert "caveat:" in str(info)


@pytest.mark.parametrize("protocol", [1, 2, 4])
def test_every_pickle_protocol_torch_reads_names_the_class(unimportable, tmp_path, protocol):
    # Protocol 1 pickles objects through copy_reg._reconstructor(cls, object, None).
    nets = unimportable("nets_i10", NETS)
    model = nets.Hooked()
    path = tmp_path / f"p{protocol}.pt"
    torch.save(model, path, pickle_protocol=protocol)
    _forget("nets_i10", tmp_path)
    info = ct.inspect(path)
    assert info.pickled_module["class"] == "nets_i10.Hooked"
    assert [t.name for t in info.tensors] == list(model.state_dict())


def _opaque_tree(obj: Any) -> Any:
    return load_pickle(__import__("io").BytesIO(pickle.dumps(obj, protocol=2))).root


class _Fake:
    """Pickles as an object of an unknown class with the given state (no class needed)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self):
        return (_Fake, (), self.state)


@pytest.mark.parametrize(
    "state",
    [
        {"_parameters": {}, "_buffers": {}},  # no _modules
        {"_parameters": [], "_buffers": {}, "_modules": {}},  # not a dict
        {"weights": {"w": 1}},
    ],
)
def test_objects_that_are_not_modules_are_not_taken_for_one(state):
    node = _opaque_tree(_Fake(state))
    assert not is_pickled_module(node) and recover_module(node) is None


def test_a_module_that_contains_itself_stops():
    inner = {"_parameters": {}, "_buffers": {}, "_modules": {}}
    fake = _Fake(inner)
    inner["_modules"]["again"] = fake
    found = recover_module(_opaque_tree(fake))
    assert found is not None and found.modules == 1 and dict(found.state_dict) == {}


@pytest.mark.parametrize("wrap", [False, True])
def test_load_state_dict_and_load_into_use_the_recovered_state_dict(unimportable, tmp_path, wrap):
    # The loader builds what the reader recovered from a pickled module, untrusted.
    path, expected = _saved_net(unimportable, tmp_path, wrap=wrap)
    loaded = ct.load_state_dict(path)
    assert list(loaded) == list(expected)
    assert all(_same(loaded[k], v) for k, v in expected.items())
    shared = loaded["heads.a.weight"].untyped_storage().data_ptr()
    assert loaded["heads.b.weight"].untyped_storage().data_ptr() == shared  # still tied
    twin = unimportable("nets_i10_twin", NETS).Net()  # same architecture, other weights
    report = ct.load_into(twin, path)
    assert not report.missing and not report.unexpected
    for k, v in expected.items():
        assert _same(twin.state_dict()[k], v), k

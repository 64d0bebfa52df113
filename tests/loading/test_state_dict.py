"""load_state_dict: every map_location form, CUDA-tagged files on a CPU box, safety, selection."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ckpt_tools import load_state_dict, load_with_info
from ckpt_tools.cli.main import main
from ckpt_tools.errors import SelectError, UnsafeContentError, UnsupportedFormatError, UsageError
from ckpt_tools.loading.devices import auto_location, resolve_map_location
from ckpt_tools.loading.state_dict import LoadInfo
from ckpt_tools.ops.rewrite.conversion import retag

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@pytest.fixture
def net() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def save(tmp_path: Path) -> Callable[..., str]:
    """Save an object with torch.save under tmp_path; returns the path."""

    def _save(obj: Any, name: str = "ckpt.pt", **kwargs: Any) -> str:
        path = tmp_path / name
        torch.save(obj, path, **kwargs)
        return str(path)

    return _save


@pytest.fixture
def cuda1_file(net: nn.Module, save: Callable[..., str], tmp_path: Path) -> str:
    """The net's state dict with every storage tagged cuda:1 (as if saved on GPU 1)."""
    plain = save(net.state_dict(), "plain.pt")
    out = str(tmp_path / "cuda1.pt")
    retag(plain, out, mapping={"cpu": "cuda:1"})
    return out


def assert_same(sd: dict[str, Any], expected: dict[str, Any], ordered: bool = True) -> None:
    assert (list(sd) if ordered else sorted(sd)) == (
        list(expected) if ordered else sorted(expected)
    )
    for key, value in expected.items():
        assert torch.equal(sd[key], value), key


# --- map_location forms ---------------------------------------------------------------


def _keep(storage: Any, location: str) -> Any:
    return storage


def _none(storage: Any, location: str) -> None:
    return None


@pytest.mark.parametrize(
    "map_location",
    ["auto", "cpu", torch.device("cpu"), {"cpu": "cpu"}, {}, None, _keep, _none],
    ids=["auto", "str", "device", "dict", "empty-dict", "none", "callable", "callable-none"],
)
def test_every_map_location_form_loads_a_cpu_file(
    net: nn.Module, save: Callable[..., str], map_location: Any
) -> None:
    path = save(net.state_dict())
    sd, info = load_with_info(path, map_location=map_location, mmap=True)
    assert_same(sd, net.state_dict())
    assert all(t.device.type == "cpu" for t in sd.values())
    assert [(p.saved, p.target) for p in info.placements] == [("cpu", "cpu")]
    assert info.moved == ()
    assert info.mmap and info.format == "torch-zip"
    sd, info = load_with_info(path, map_location=map_location)
    assert_same(sd, net.state_dict())
    assert not info.mmap  # read, as torch.load reads it


def test_plain_torch_load_fails_on_a_cuda1_file_but_auto_loads_it(
    net: nn.Module, cuda1_file: str, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the failure needs a CPU-only box")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(cuda1_file)
    with caplog.at_level(logging.INFO, logger="ckpt_tools"):
        sd, info = load_with_info(cuda1_file)
    assert_same(sd, net.state_dict())
    assert [(m.saved, m.target, m.storages) for m in info.moved] == [("cuda:1", "cpu", 7)]
    assert "saved on cuda:1 loaded on cpu" in caplog.text


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cuda:1": "cpu"}, lambda s, loc: s],
    ids=["str", "device", "dict", "callable"],
)
def test_explicit_forms_move_cuda1_storages(
    net: nn.Module, cuda1_file: str, map_location: Any
) -> None:
    sd, info = load_with_info(cuda1_file, map_location=map_location)
    assert_same(sd, net.state_dict())
    assert [(m.saved, m.target) for m in info.placements] == [("cuda:1", "cpu")]


def test_a_target_device_that_does_not_exist_is_refused_before_loading(cuda1_file: str) -> None:
    if torch.cuda.device_count() > 1:
        pytest.skip("cuda:1 exists here")
    with pytest.raises(UsageError, match=r"'cuda:1'.*does not exist here.*map_location='auto'"):
        load_state_dict(cuda1_file, map_location=None)
    with pytest.raises(UsageError, match="not a device"):
        load_state_dict(cuda1_file, map_location="gpu-please")


def test_auto_location_rules() -> None:
    assert auto_location("cpu") == "cpu"
    assert auto_location("meta") == "meta"
    count = torch.cuda.device_count()
    expected = f"cuda:{7 % count}" if count else "cpu"
    assert auto_location("cuda:7") == expected
    assert resolve_map_location({"cuda:1": "cpu"}, ["cuda:1", "cpu"]) == {
        "cuda:1": "cpu",
        "cpu": "cpu",
    }
    assert resolve_map_location(_keep, ["cpu"]) is None


@gpu
@needs_cuda
def test_auto_puts_cuda_storages_on_an_existing_gpu(net: nn.Module, tmp_path: Path) -> None:
    plain = str(tmp_path / "plain.pt")
    torch.save(net.state_dict(), plain)
    count = torch.cuda.device_count()
    tagged = str(tmp_path / "cuda9.pt")
    retag(plain, tagged, mapping={"cpu": "cuda:9"})
    sd = load_state_dict(tagged)
    assert {str(t.device) for t in sd.values()} == {f"cuda:{9 % count}"}
    sd = load_state_dict(plain, map_location="cuda:0")
    assert {str(t.device) for t in sd.values()} == {"cuda:0"}


# --- formats ----------------------------------------------------------------------------


def test_safetensors_with_every_form(net: nn.Module, tmp_path: Path) -> None:
    path = str(tmp_path / "model.safetensors")
    expected = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(expected, path)
    for form in ("auto", "cpu", {"cpu": "cpu"}, _keep):
        sd, info = load_with_info(path, map_location=form, mmap=True)
        assert_same(sd, expected, ordered=False)
        assert info.format == "safetensors" and info.mmap  # mapped, as torch zip records are
        sd, info = load_with_info(path, map_location=form)
        assert_same(sd, expected, ordered=False)
        assert not info.mmap


def test_legacy_file_loads_without_mmap(net: nn.Module, save: Callable[..., str]) -> None:
    path = save(net.state_dict(), "legacy.pt", _use_new_zipfile_serialization=False)
    sd, info = load_with_info(path)
    assert_same(sd, net.state_dict())
    assert info.format == "torch-legacy" and not info.mmap


def test_sharded_folder_merges_shards_in_index_order(net: nn.Module, tmp_path: Path) -> None:
    sd = {k: v.contiguous() for k, v in net.state_dict().items()}
    names = list(sd)
    save_file({k: sd[k] for k in names[:3]}, tmp_path / "model-1.safetensors")
    save_file({k: sd[k] for k in names[3:]}, tmp_path / "model-2.safetensors")
    weight_map = {
        k: "model-1.safetensors" if i < 3 else "model-2.safetensors" for i, k in enumerate(names)
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, info = load_with_info(tmp_path)
    assert_same(loaded, sd)  # the index's order
    assert info.format == "hf-sharded"
    assert sum(p.storages for p in info.placements) == len(sd)


# --- safety -------------------------------------------------------------------------------


def test_unsafe_globals_outside_the_state_dict_load_inside_it_are_refused_unless_trusted(
    net: nn.Module, save: Callable[..., str]
) -> None:
    # Outside the state dict (hyper-parameters): never built, the load succeeds untrusted.
    path = save({"state_dict": net.state_dict(), "hparams": argparse.Namespace(lr=0.1)})
    sd, load_info = load_with_info(path)
    assert_same(sd, net.state_dict())
    assert not load_info.trusted and load_info.selected == ("state_dict",)
    # Inside it (an extra state object): refused by name, with the way out.
    inside = net.state_dict()
    inside["fc._extra_state"] = argparse.Namespace(lr=0.1)
    path = save({"state_dict": inside}, "inside.pt")
    refused = r"fc\._extra_state.*argparse\.Namespace.*trust=True"
    with pytest.raises(UnsafeContentError, match=refused) as info:
        load_state_dict(path)
    assert info.value.globals == ("argparse.Namespace",)
    # The suggested command really gives a loadable file.
    command = str(info.value).split("`")[1]
    assert command.endswith("--drop-extras --allow-global argparse.Namespace")
    assert main([*shlex.split(command)[1:], "-q"]) == 0
    assert_same(load_state_dict(path.replace(".pt", ".safetensors")), net.state_dict(), False)
    # trust is the one knob that runs a file's code: torch's weights_only is not a second one.
    with pytest.raises(TypeError, match="weights_only"):
        load_state_dict(path, weights_only=False)  # type: ignore[call-arg]
    sd, load_info = load_with_info(path, trust=True)
    assert sd["fc._extra_state"] == argparse.Namespace(lr=0.1)
    assert load_info.trusted and load_info.selected == ("state_dict",)


# --- selection ------------------------------------------------------------------------------


def test_selects_like_inspect_and_obeys_select(net: nn.Module, save: Callable[..., str]) -> None:
    ema = {k: v + 1 for k, v in net.state_dict().items()}
    path = save({"epoch": 3, "model": net.state_dict(), "ema": ema})
    sd, info = load_with_info(path)
    assert info.selected == ("model",)
    assert_same(sd, net.state_dict())
    assert_same(load_state_dict(path, select="ema"), ema)
    with pytest.raises(SelectError, match="no entry 'nope'"):
        load_state_dict(path, select="nope")


def test_nothing_like_a_state_dict_asks_for_select(save: Callable[..., str]) -> None:
    path = save({"epoch": 3, "note": "hi"})
    with pytest.raises(UsageError, match=r"no entry looks like a state dict.*select="):
        load_state_dict(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_is_refused_with_the_right_loader(net: nn.Module, tmp_path: Path) -> None:
    path = str(tmp_path / "scripted.pt")
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), path)
    with pytest.raises(UnsupportedFormatError, match=r"torch\.jit\.load"):
        load_state_dict(path)


def test_load_info_serialises(net: nn.Module, save: Callable[..., str]) -> None:
    _, info = load_with_info(save(net.state_dict()))
    assert isinstance(info, LoadInfo)
    data = json.loads(json.dumps(info.to_json()))
    assert data["placements"][0]["saved"] == "cpu" and os.path.isfile(data["path"])


@pytest.mark.parametrize(("root", "kind"), [(torch.arange(3.0), "a tensor"), ([1], "a list")])
def test_a_root_that_is_no_mapping_is_named_as_what_it_is(
    tmp_path: Path, root: Any, kind: str
) -> None:
    path = tmp_path / "root.pt"
    torch.save(root, path)
    with pytest.raises(UsageError, match=f"holds {kind}, not a state dict"):
        load_state_dict(path)
    with pytest.raises(SelectError, match=f"select='': it is {kind}, not a mapping"):
        load_state_dict(path, select=[])


@pytest.mark.parametrize(
    "map_location",
    ["cpu:0", torch.device("cpu", 0), {"cpu": "cpu:0"}],
    ids=["str", "device", "dict"],
)
def test_an_indexed_cpu_is_refused_as_a_usage_error(
    net: nn.Module, save: Callable[..., str], map_location: Any
) -> None:
    path = save(net.state_dict())
    with pytest.raises(RuntimeError):  # torch fails on it, inside its restore
        torch.load(path, weights_only=True, map_location=map_location)
    with pytest.raises(UsageError, match=r"'cpu:0'.*only as 'cpu'") as caught:
        load_state_dict(path, map_location=map_location)
    assert "map_location='cpu'" in str(caught.value)


def test_trust_reads_safetensors_with_the_own_reader(net: nn.Module, tmp_path: Path) -> None:
    path = str(tmp_path / "model.safetensors")
    expected = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(expected, path)
    sd = load_state_dict(path, map_location="meta", trust=True)
    assert all(t.is_meta for t in sd.values()) and list(sd) == list(
        load_state_dict(path, map_location="meta")
    )
    sd, info = load_with_info(path, map_location=_keep, trust=True)
    assert_same(sd, expected, ordered=False)
    assert [(p.saved, p.target) for p in info.placements] == [("cpu", "cpu")]
    assert info.placements[0].storages == len(expected)
    assert not info.trusted  # nothing was unpickled: the file holds no pickle

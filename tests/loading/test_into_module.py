"""load_into: wrapper layouts on both sides, strictness, shape mismatches, reports."""

from __future__ import annotations

import logging
import pickle
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tools import load_into, load_state_dict
from ckpt_tools.cli.main import main
from ckpt_tools.errors import StateDictMismatchError, UnsafeContentError, UsageError
from ckpt_tools.ops.rewrite.conversion import retag
from tests.helpers import data_parallel

# torch.compile's import path touches deprecated torch.jit APIs.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


class Net(nn.Module):
    def __init__(self, head: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(self.norm(x))


class DDPStyle(nn.Module):
    """Stands in for DistributedDataParallel: the model under ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class LitStyle(nn.Module):
    """A Lightning-style module: the network under ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def compiled(model: nn.Module) -> nn.Module:
    # Wrapping is lazy: nothing is compiled until a forward, which these tests never run.
    return torch.compile(model)


WRAP: dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "dataparallel": data_parallel,
    "ddp": DDPStyle,
    "compiled": compiled,
    "lightning": LitStyle,
    "ddp+compiled": lambda m: DDPStyle(compiled(m)),
}


def inner(model: nn.Module) -> nn.Module:
    """The plain Net inside any of the wrappers."""
    while not isinstance(model, Net):
        model = getattr(model, "_orig_mod", None) or getattr(model, "module", None) or model.model
    return model


def make_net(seed: int, head: int = 2) -> Net:
    torch.manual_seed(seed)
    net = Net(head)
    with torch.no_grad():  # non-trivial BatchNorm statistics
        net.norm.running_mean.uniform_(-1, 1)
        net.norm.running_var.uniform_(0.5, 2)
    return net.eval()


@pytest.fixture
def source() -> Net:
    return make_net(0)


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randn(5, 4)


@pytest.mark.parametrize("ckpt_kind", list(WRAP))
@pytest.mark.parametrize("model_kind", ["plain", "dataparallel", "ddp", "compiled", "lightning"])
def test_matrix_loads_strictly_with_equal_outputs(
    ckpt_kind: str, model_kind: str, source: Net, x: torch.Tensor, tmp_path: Path
) -> None:
    path = tmp_path / f"{ckpt_kind}.pt"
    saved = WRAP[ckpt_kind](source).state_dict()
    torch.save(saved, path)
    target = WRAP[model_kind](make_net(1))
    assert not torch.equal(inner(target)(x), source(x))

    report = load_into(target, path, strict=True)

    assert report.ok and report.loaded == len(source.state_dict())
    assert torch.equal(inner(target)(x), source(x))
    assert bool(report.rewrites) == (list(saved) != list(target.state_dict()))


@pytest.mark.parametrize(
    ("ckpt_kind", "model_kind", "rewrites"),
    [
        ("dataparallel", "plain", ("stripping 'module.'",)),
        ("plain", "ddp", ("adding 'module.'",)),
        ("ddp", "compiled", ("stripping 'module.'", "adding '_orig_mod.'")),
        ("ddp+compiled", "plain", ("stripping 'module.'", "stripping '_orig_mod.'")),
        ("ddp+compiled", "compiled", ("stripping 'module.'",)),
        ("plain", "lightning", ("adding 'model.'",)),
    ],
)
def test_rewrites_come_from_comparing_wrapper_stacks(
    ckpt_kind: str, model_kind: str, rewrites: tuple[str, ...], source: Net
) -> None:
    report = load_into(WRAP[model_kind](make_net(1)), WRAP[ckpt_kind](source).state_dict())
    assert report.rewrites == rewrites
    assert report.source == "<state dict>" and report.info is None


@pytest.mark.parametrize("select", [None, "state_dict"])
def test_an_in_memory_dict_holding_a_state_dict_loads_as_a_file_of_it_would(
    source: Net, select: str | None, tmp_path: Path
) -> None:
    # A Lightning-style dict, as torch.load(weights_only=True) returns it.
    held = {"state_dict": source.state_dict(), "epoch": 3}
    torch.save(held, tmp_path / "held.pt")
    from_memory, from_file = make_net(1), make_net(1)
    report = load_into(from_memory, held, select=select)
    load_into(from_file, tmp_path / "held.pt", select=select)
    assert report.source == "<state dict>" and report.loaded == len(source.state_dict())
    for a, b, want in zip(from_memory.state_dict().values(), from_file.state_dict().values(),
                          source.state_dict().values()):  # fmt: skip
        assert torch.equal(a, want) and torch.equal(b, want)


def test_cuda1_checkpoint_loads_into_a_cpu_model(
    source: Net, x: torch.Tensor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = tmp_path / "plain.pt"
    torch.save(data_parallel(source).state_dict(), plain)
    tagged = tmp_path / "cuda1.pt"
    retag(plain, tagged, mapping={"cpu": "cuda:1"})
    target = make_net(1)
    with caplog.at_level(logging.INFO, logger="ckpt_tools"):
        report = load_into(target, tagged)
    assert torch.equal(target(x), source(x))
    assert report.info is not None and report.info.map_location == "auto (staged on cpu)"
    assert [(m.saved, m.target) for m in report.info.moved] == [("cuda:1", "cpu")]
    assert "stripping 'module.' to match Net" in caplog.text


def test_strict_mismatch_raises_folded_and_leaves_the_model_alone(
    source: Net, tmp_path: Path
) -> None:
    sd = source.state_dict()
    for i in range(3):
        sd[f"extra.{i}.weight"] = torch.zeros(2)
    for key in [k for k in sd if k.startswith("blocks.")]:
        del sd[key]
    path = tmp_path / "odd.pt"
    torch.save(sd, path)
    target = make_net(1, head=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    pattern = (
        r"(?s)6 missing.*blocks\.\{0\.\.2\}\.weight ×3.*3 unexpected.*extra\.\{0\.\.2\}\.weight ×3"
        r".*shape mismatch.*head\.weight checkpoint \[2, 8\] vs model \[3, 8\].*strict=False"
    )
    with pytest.raises(StateDictMismatchError, match=pattern):
        load_into(target, path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_non_strict_skips_shape_mismatches_and_reports(source: Net, tmp_path: Path) -> None:
    path = tmp_path / "two.pt"
    torch.save(LitStyle(source).state_dict(), path)
    target = make_net(1, head=3)
    head_before = target.head.weight.clone()
    report = load_into(target, path, strict=False)
    assert report.rewrites == ("stripping 'model.'",)
    assert [(m.key, m.checkpoint_shape, m.model_shape) for m in report.shape_mismatches] == [
        ("head.weight", (2, 8), (3, 8)),
        ("head.bias", (2,), (3,)),
    ]
    assert not report.ok and report.missing == () and report.unexpected == ()
    text = str(report)
    assert "loaded 13 keys" in text and "(stripping 'model.')" in text
    assert "shape mismatch, skipped: head.weight checkpoint [2, 8] vs model [3, 8]" in text
    assert torch.equal(target.head.weight, head_before)
    assert torch.equal(target.stem.weight, source.stem.weight)
    assert report.loaded == len(source.state_dict()) - 2


def test_lightning_module_with_extra_state_gets_model_prefix(source: Net) -> None:
    class LitWithLoss(LitStyle):
        def __init__(self, model: nn.Module) -> None:
            super().__init__(model)
            self.register_buffer("class_weights", torch.ones(2))

    target = LitWithLoss(make_net(1))
    report = load_into(target, source.state_dict(), strict=False)
    assert report.rewrites == ("adding 'model.'",)
    assert report.missing == ("class_weights",)
    assert torch.equal(target.model.head.weight, source.head.weight)


def test_dtype_casts_are_reported(source: Net) -> None:
    sd = {k: v.double() if v.is_floating_point() else v for k, v in source.state_dict().items()}
    report = load_into(make_net(1), sd)
    assert ("stem.weight", "float64", "float32") in report.dtype_casts
    assert report.to_json()["dtype_casts"][0][1] == "float64"


def test_mismatch_message_suggests_a_working_command(source: Net, tmp_path: Path) -> None:
    path = tmp_path / "bb.pt"
    torch.save({"module.backbone." + k: v for k, v in source.state_dict().items()}, path)
    target = data_parallel(make_net(1))
    with pytest.raises(
        StateDictMismatchError, match=r"renaming 'module\.backbone\.' to 'module\.'"
    ) as error:
        load_into(target, path)
    command = next(line for line in str(error.value).splitlines() if "ckpt rename" in line)
    args = shlex.split(command.split(": ", 1)[1])
    assert main([*args[1:], "-q"]) == 0
    assert load_into(target, tmp_path / "bb.renamed.pt").ok
    with pytest.raises(
        StateDictMismatchError, match=r"ckpt_tools\.strip_prefix\(sd, prefix='backbone\.'\)"
    ):
        load_into(make_net(1), {"backbone." + k: v for k, v in source.state_dict().items()})


def test_the_suggested_command_names_the_globals_the_file_holds(
    source: Net, tmp_path: Path
) -> None:
    # Lightning keeps its hyper-parameters as a Namespace: the rewrite must be told so.
    import argparse

    path = tmp_path / "bb.ckpt"
    weights = {"module.backbone." + k: v for k, v in source.state_dict().items()}
    torch.save({"state_dict": weights, "hparams": argparse.Namespace(lr=0.1)}, path)
    target = data_parallel(make_net(1))
    with pytest.raises(StateDictMismatchError) as error:
        load_into(target, path)
    command = next(line for line in str(error.value).splitlines() if "ckpt rename" in line)
    args = shlex.split(command.split(": ", 1)[1])
    assert args[-2:] == ["--allow-global", "argparse.Namespace"]
    assert main([*args[1:], "-q"]) == 0
    assert load_into(target, tmp_path / "bb.renamed.ckpt").ok


def test_names_from_the_checkpoint_reach_messages_escaped(tmp_path: Path) -> None:
    # A key is the file's text: it must neither start a line of its own nor drive a terminal.
    hostile = "x\nckpt: loaded OK \x1b[2J"
    path = tmp_path / "keys.pt"
    torch.save({hostile: 1, "epoch": 2}, path)
    with pytest.raises(UsageError) as no_state_dict:
        load_state_dict(path)
    sd = {"weight": torch.ones(1, 1), "bias": torch.ones(1), hostile: torch.ones(1)}
    with pytest.raises(StateDictMismatchError) as mismatch:
        load_into(nn.Linear(1, 1), sd)
    for message in (str(no_state_dict.value), str(mismatch.value)):
        assert "\x1b" not in message and "\nckpt: loaded" not in message
        assert r"x\nckpt: loaded OK \x1b[2J" in message


def test_a_strict_refusal_names_the_diff_of_what_was_compared(tmp_path: Path) -> None:
    full = nn.Linear(4, 2).state_dict()
    torch.save({"model": full, "ema": {"weight": full["weight"]}}, tmp_path / "ck.pt")
    with pytest.raises(StateDictMismatchError) as info:
        load_into(nn.Linear(4, 2), tmp_path / "ck.pt", select="ema")
    assert f"`ckpt diff {tmp_path / 'ck.pt'} --select ema --model MODULE:FACTORY`" in str(
        info.value
    )
    with pytest.raises(StateDictMismatchError) as info:
        load_into(nn.Linear(4, 2), {"weight": full["weight"]})
    assert "`ckpt_tools.diff(state_dict, model)`" in str(info.value)
    assert "CKPT" not in str(info.value)


def test_weights_beside_a_few_scalars_at_the_root_load_as_torch_loads_them(
    tmp_path: Path,
) -> None:
    # Two tensors among five entries: no entry is a state dict, the root holds the weights.
    src = nn.Linear(4, 3)
    path = tmp_path / "flat.pt"
    torch.save({**src.state_dict(), "epoch": 12, "best_acc": 0.91, "arch": "probe"}, path)
    theirs = nn.Linear(4, 3).load_state_dict(torch.load(path, weights_only=True), strict=False)
    model = nn.Linear(4, 3)
    report = load_into(model, path, strict=False)
    assert set(report.unexpected) == set(theirs.unexpected_keys) == {"epoch", "best_acc", "arch"}
    assert torch.equal(model.weight, src.weight) and torch.equal(model.bias, src.bias)
    with pytest.raises(StateDictMismatchError, match="epoch"):  # strict, as torch is
        load_into(nn.Linear(4, 3), path)
    assert set(load_state_dict(path)) == {"weight", "bias", "epoch", "best_acc", "arch"}
    with pytest.raises(UsageError, match="no entry looks like a state dict"):  # no tensor
        load_into(nn.Linear(4, 3), {"epoch": 1, "arch": "probe"})


class _OwnDict(dict):
    """A dict subclass of the training script's, which the reader never builds."""


def test_an_unbuilt_object_holding_tensors_beside_a_scalar_tensor_asks_for_trust(
    tmp_path: Path,
) -> None:
    # The state dict may be the object: the root (a best accuracy) is not taken for it.
    src = nn.Linear(3, 2)
    path = tmp_path / "own.pt"
    own = {"net": _OwnDict(src.state_dict()), "best_acc": torch.tensor(0.9), "epoch": 5}
    torch.save(own, path)
    with pytest.raises(UsageError, match=r"net: objects of their own class.*trust=True"):
        load_into(nn.Linear(3, 2), path)
    # One that holds no tensors (a config) leaves the root as the state dict: the object in
    # it is then refused as torch.load(weights_only=True) refuses it.
    torch.save({**src.state_dict(), "config": _OwnDict(lr=0.1)}, path)
    with pytest.raises(UnsafeContentError, match=r"the state dict holds .*'config'"):
        load_into(nn.Linear(3, 2), path, strict=False)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


def test_a_live_module_in_memory_loads_its_state_dict(tmp_path: Path) -> None:
    # torch.load(weights_only=False) of {"model": module}: the file loads through the
    # pickled module's recovered state dict, and the object in memory alike.
    def seq() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    src = seq()
    src[1].running_mean.add_(1.0)
    torch.save({"model": src, "epoch": 5}, tmp_path / "whole.pt")
    held = torch.load(tmp_path / "whole.pt", weights_only=False)
    for select in (None, "model"):
        model = seq()
        report = load_into(model, held, select=select)
        assert report.loaded == len(src.state_dict()) and not report.unexpected
        for key, want in src.state_dict().items():
            assert torch.equal(model.state_dict()[key], want), key


def test_auto_on_a_meta_model_resolves_as_load_state_dict_does(source: Net, tmp_path: Path) -> None:
    # Assigned tensors become the model's own: "auto" is not staged on the CPU then (on a
    # GPU machine, a cuda:0 checkpoint stays on cuda:0; tests/loading/test_own_reader_gpu.py).
    from ckpt_tools import load_with_info

    torch.save(source.state_dict(), tmp_path / "sd.pt")
    with torch.device("meta"):
        model = make_net(1)
    report = load_into(model, tmp_path / "sd.pt")
    _, info = load_with_info(tmp_path / "sd.pt")
    assert report.assigned and report.info.map_location == info.map_location
    copied = load_into(make_net(1), tmp_path / "sd.pt")
    assert copied.info.map_location == "auto (staged on cpu)"

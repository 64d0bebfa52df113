"""``consolidate`` on DCP folders saved in one process, against torch's ``dcp_to_torch_save``.

The oracle is torch's converter plus ``torch.load``; safetensors outputs are read with the
``safetensors`` package. FSDP2 checkpoints from several processes:
tests/ops/consolidate/test_consolidate_fsdp.py.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_tools import consolidate
from ckpt_tools.errors import (
    CorruptCheckpointError,
    NonTensorEntriesError,
    OutputExistsError,
    UnsafeContentError,
    UsageError,
)
from ckpt_tools.io.assemble import crc32_combine
from tests.formats.dcp.test_dcp import Custom, save_dcp, small_state
from tests.helpers.cli import run_ckpt
from tests.helpers.dcp_save import reference
from tests.helpers.trees import assert_bitwise_equal, assert_values_bitwise


def assert_same(want: Any, got: Any, where: str = "") -> None:
    """Equal trees: same keys in the same order, tensors equal bit for bit (dtype, shape)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.requires_grad == want.requires_grad, where
        assert_values_bitwise(want, got, where)
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(want, got)):
            assert_same(a, b, f"{where}.{i}")
    else:
        assert got == want, where


def wide_state() -> dict[str, Any]:
    """The small state plus a transposed view (a chunk DCP stores with strides (1, 4))."""
    state = small_state()
    state["model"]["proj.weight"] = torch.arange(24, dtype=torch.float32).reshape(6, 4).t()
    state["model"]["empty"] = torch.zeros(0, 3, dtype=torch.bfloat16)
    return state


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return save_dcp(tmp_path / "ckpt", wide_state())


def test_all_equals_dcp_to_torch_save(folder: Path, tmp_path: Path) -> None:
    want = reference(folder, tmp_path / "theirs.pt")
    result = consolidate(folder, tmp_path / "ours.pt", include_all=True)
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert_same(want, got)
    assert result.output_format == "torch-zip" and result.selected == ()
    # The transposed chunk was assembled, every other one copied in the kernel.
    assert result.bytes_written - result.bytes_copied == 24 * 4
    assert torch.load(tmp_path / "ours.pt", mmap=True, weights_only=True)["epoch"] == 7
    # Every record's CRC-32 (combined from the chunks' records, or computed while assembling)
    # is right: Python's zip reader checks them all.
    with zipfile.ZipFile(tmp_path / "ours.pt") as z:
        assert z.testzip() is None


@pytest.mark.parametrize("sizes", [(0, 5), (5, 0), (1, 1), (1000, 3), (7, 1 << 16), (4097, 123)])
def test_crc32_combine_matches_zlib(sizes: tuple[int, int]) -> None:
    a, b = os.urandom(sizes[0]), os.urandom(sizes[1])
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_default_is_the_model_state_dict(folder: Path, tmp_path: Path) -> None:
    want = reference(folder, tmp_path / "theirs.pt")["model"]
    result = consolidate(folder, tmp_path / "model.pt")
    assert result.selected == ("model",)
    assert_same(want, torch.load(tmp_path / "model.pt", weights_only=True))
    # And it loads into a module of the right shapes (strict).
    net = torch.nn.Linear(3, 4)
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    net.load_state_dict({"weight": sd["layers.0.weight"], "bias": sd["layers.0.bias"].float()})


def test_safetensors_output(folder: Path, tmp_path: Path) -> None:
    want = reference(folder, tmp_path / "theirs.pt")["model"]
    consolidate(folder, tmp_path / "model.safetensors")
    got = load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert_same(tensor, got[name], name)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_dcp_saves_tied_names_apart_and_each_is_written(tmp_path: Path) -> None:
    """DCP writes each name of a tied tensor as its own item (dcp_to_torch_save gives two
    storages), so no name is left to the metadata: both are stored, none is lost."""
    weight = torch.randn(3, 4)
    folder = save_dcp(tmp_path / "run", {"model": {"c.weight": weight, "c2.weight": weight}})
    want = reference(folder, tmp_path / "theirs.pt")["model"]
    for out in (tmp_path / "m.safetensors", tmp_path / "hf"):
        result = consolidate(folder, out)
        got = load_file(out if out.suffix else out / "model.safetensors")
        assert sorted(got) == sorted(want) == ["c.weight", "c2.weight"] and not result.dropped
        for name, tensor in want.items():
            assert_same(tensor, got[name], name)


def test_safetensors_all_flattens_and_leaves_out_values(folder: Path, tmp_path: Path) -> None:
    want = reference(folder, tmp_path / "theirs.pt")
    # safetensors holds tensors only: the values are refused, as convert refuses them ...
    with pytest.raises(NonTensorEntriesError, match="pass drop_extras=True") as info:
        consolidate(folder, tmp_path / "all.safetensors", include_all=True)
    assert "epoch" in info.value.entries and "optim.param_groups.0.lr" in info.value.entries
    assert not (tmp_path / "all.safetensors").exists()
    # ... and left out, each named, when asked.
    result = consolidate(folder, tmp_path / "all.safetensors", include_all=True, drop_extras=True)
    got = load_file(tmp_path / "all.safetensors")
    assert_same(want["optim"]["state"]["0"]["exp_avg"], got["optim.state.0.exp_avg"])
    assert_same(want["model"]["ids"], got["model.ids"])
    assert "epoch" in result.dropped and "optim.param_groups.0.lr" in result.dropped


def test_hf_shards_load_and_index_matches(folder: Path, tmp_path: Path) -> None:
    want = reference(folder, tmp_path / "theirs.pt")["model"]
    out = tmp_path / "hf"
    result = consolidate(folder, out, max_shard_size=60, jobs=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    assert sorted(set(index["weight_map"].values())) == shards
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    for shard in shards:
        got = load_file(out / shard)
        assert sorted(got) == sorted(k for k, v in index["weight_map"].items() if v == shard)
        # The limit bounds tensor bytes, as huggingface_hub's does; one tensor may pass it.
        assert sum(t.nbytes for t in got.values()) <= 60 or len(got) == 1
        for name, tensor in got.items():
            assert_same(want[name], tensor, name)
    assert result.written[-1].endswith("model.safetensors.index.json")


def test_hf_folder_with_other_shards_refused_then_its_weights_replaced(
    folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    consolidate(folder, out, max_shard_size=60)
    with pytest.raises(OutputExistsError, match="already exists"):
        consolidate(folder, out)
    (out / "config.json").write_text("{}")  # not a weight file: force keeps it
    consolidate(folder, out, force=True)  # one shard now: the old ones and their index go
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == "{}"


@pytest.mark.parametrize("out", ["m.pt", "m.safetensors"])
def test_a_shard_size_asks_for_a_folder_as_convert_s_does(
    folder: Path, tmp_path: Path, out: str
) -> None:
    with pytest.raises(UsageError, match="a sharded output is a folder"):
        consolidate(folder, tmp_path / out, max_shard_size="1GB")
    assert list(tmp_path.iterdir()) == [folder]
    result = consolidate(folder, tmp_path / "plain", max_shard_size=60)
    assert result.output_format == "hf-sharded" and len(result.written) > 2


@pytest.mark.parametrize("out", ["m.pt", "m.safetensors", "hf"])
def test_verify_full_makes_every_record_again(folder: Path, tmp_path: Path, out: str) -> None:
    shards = {"max_shard_size": 60} if out == "hf" else {}
    result = consolidate(folder, tmp_path / out, verify="full", include_all=out == "m.pt", **shards)
    assert result.verification.startswith("verified: keys, sizes and") and "bytes" in (
        result.verification
    )
    want = reference(folder, tmp_path / "theirs.pt")
    if out == "m.safetensors":
        got = load_file(tmp_path / out)
        for name, tensor in got.items():
            assert_same(want["model"][name], tensor, name)


def test_strip_removes_wrapper_prefixes(tmp_path: Path) -> None:
    state = {"model": {f"module.{k}": v for k, v in small_state()["model"].items()}}
    folder = save_dcp(tmp_path / "ddp", state)
    result = consolidate(folder, tmp_path / "plain.pt", strip=True)
    got = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert_same(small_state()["model"], got)
    assert result.renamed == 4 and not any("strip" in n for n in result.notes)


@pytest.mark.parametrize("at", ["models.1", "pair.0.g"])
def test_strip_with_all_renames_a_state_dict_held_in_a_list(tmp_path: Path, at: str) -> None:
    # A GAN's generator and discriminator, saved under DDP names in a list (and a tuple).
    model = {f"module.{k}": v for k, v in small_state()["model"].items()}
    state = {"models": [dict(model), dict(model)], "pair": ({"g": dict(model)},), "step": 1}
    folder = save_dcp(tmp_path / "gan", state)
    want = reference(folder, tmp_path / "theirs.pt")
    result = consolidate(folder, tmp_path / "all.pt", select=at, include_all=True, strip=True)
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    first, index, *rest = at.split(".")
    inner = got[first][int(index)]
    assert_same(small_state()["model"], inner[rest[0]] if rest else inner)
    assert result.renamed == 4
    for name in ("models", "pair"):  # everything else as dcp_to_torch_save gives it
        for i, held in enumerate(want[name]):
            if f"{name}.{i}" != ".".join(at.split(".")[:2]):
                assert_same(held, got[name][i])
    assert got["step"] == want["step"] == 1


def test_a_strip_that_finds_no_wrapper_says_so(tmp_path: Path) -> None:
    # Only some keys wrapped: no prefix every key carries, so the keys are kept, with a word.
    model = small_state()["model"].items()
    state = {"model": {(f"module.{k}" if i % 2 else k): v for i, (k, v) in enumerate(model)}}
    folder = save_dcp(tmp_path / "half", state)
    result = consolidate(folder, tmp_path / "kept.pt", strip=True)
    assert list(torch.load(tmp_path / "kept.pt", weights_only=True)) == list(state["model"])
    assert result.renamed == 0
    assert any("no wrapper prefix" in n for n in result.notes), result.notes


def test_select_names_an_entry(folder: Path, tmp_path: Path) -> None:
    want = reference(folder, tmp_path / "theirs.pt")["optim"]["state"]["0"]
    consolidate(folder, tmp_path / "o.pt", select="optim.state.0")
    assert_same(want, torch.load(tmp_path / "o.pt", weights_only=True))


def test_refusals_write_nothing(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"not a torch\.distributed\.checkpoint folder"):
        consolidate(_torch_file(tmp_path), tmp_path / "x.pt")
    (tmp_path / "taken.pt").write_bytes(b"keep")
    with pytest.raises(OutputExistsError):
        consolidate(folder, tmp_path / "taken.pt")
    assert (tmp_path / "taken.pt").read_bytes() == b"keep"
    # A truncated data file: refused while planning (exit 4), before any byte is written.
    data = next(folder.glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    run_ckpt("consolidate", folder, tmp_path / "cut.pt", code=4)
    assert not (tmp_path / "cut.pt").exists()


def _torch_file(tmp_path: Path) -> Path:
    torch.save({"w": torch.zeros(2)}, tmp_path / "plain.pt")
    return tmp_path / "plain.pt"


def test_unsafe_values_refused_with_all_only(tmp_path: Path) -> None:
    state = small_state()
    state["custom"] = Custom()
    folder = save_dcp(tmp_path / "ckpt", state)
    consolidate(folder, tmp_path / "model.pt")  # the model alone holds no foreign global
    with pytest.raises(UnsafeContentError, match="Custom"):
        consolidate(folder, tmp_path / "all.pt", include_all=True)
    run_ckpt("consolidate", folder, tmp_path / "all.pt", "--all", code=3)
    assert not (tmp_path / "all.pt").exists()


def test_cli_json(folder: Path, tmp_path: Path) -> None:
    out = json.loads(run_ckpt("consolidate", folder, tmp_path / "m.safetensors", "--json").stdout)
    assert out["output_format"] == "safetensors"
    assert out["tensors"] == len(wide_state()["model"])
    assert out["verification"].startswith("verified")


def test_cli_without_torch(folder: Path, tmp_path: Path, no_torch_env: dict[str, str]) -> None:
    """The installed command, in a process where importing torch fails."""
    want = reference(folder, tmp_path / "theirs.pt")
    run_ckpt("consolidate", folder, tmp_path / "all.pt", "--all", how="script", env=no_torch_env)
    assert_same(want, torch.load(tmp_path / "all.pt", weights_only=True))


def test_safetensors_serialization(tmp_path: Path) -> None:
    """Chunks saved with SerializationFormat.SAFETENSORS: raw ranges of a safetensors blob.

    torch 2.13's own dcp_to_torch_save cannot read such a folder (it torch.loads the raw
    range), so the oracle is the state dict that was saved.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    state = small_state()
    writer = FileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.distributed.checkpoint.save(state, storage_writer=writer)
    consolidate(tmp_path / "st", tmp_path / "all.pt", include_all=True)
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    assert_same(state["model"], got["model"])
    assert got["optim"]["state"]["0"]["exp_avg"].equal(state["optim"]["state"][0]["exp_avg"])
    assert got["epoch"] == 7
    # A blob whose entry disagrees with the metadata is refused.
    data = next((tmp_path / "st").glob("*.distcp"))
    raw = data.read_bytes()
    data.write_bytes(raw.replace(b'"I64"', b'"I32"', 1))
    with pytest.raises(CorruptCheckpointError, match="stored as I32"):
        consolidate(tmp_path / "st", tmp_path / "bad.pt")


def test_rewrites_point_to_consolidate(folder: Path, tmp_path: Path) -> None:
    err = run_ckpt("convert", folder, tmp_path / "x.pt", code=2).stderr
    assert f"ckpt consolidate {folder} OUT.pt" in err
    assert not (tmp_path / "x.pt").exists()


def test_the_consolidate_command_said_runs_on_a_flat_folder_with_numbers(tmp_path: Path) -> None:
    # {"w": tensor, "step": 3}: a torch output keeps the number beside the tensor.
    flat = save_dcp(tmp_path / "flat", {"w": torch.arange(3.0), "step": 3})
    torch.save({"w": torch.arange(3.0)}, tmp_path / "ref.pt")
    err = run_ckpt("diff", flat, tmp_path / "ref.pt", code=2).stderr
    command = err.split("run `", 1)[1].split("`", 1)[0].replace("OUT", str(tmp_path / "out"))
    run_ckpt(*command.split()[1:])
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["step"] == 3 and torch.equal(got["w"], torch.arange(3.0))


def test_a_tensor_dict_left_beside_the_one_written_is_said(tmp_path: Path) -> None:
    # A GAN's {"model": {"generator": ..., "discriminator": ...}}: the larger is written, the
    # other named in a note; select writes it instead, as dcp_to_torch_save holds it.
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    disc = torch.nn.Linear(4, 1)
    state = {"model": {"generator": gen.state_dict(), "discriminator": disc.state_dict()}}
    folder = save_dcp(tmp_path / "gan", {**state, "step": 10})
    result = consolidate(folder, tmp_path / "g.pt")
    assert result.selected == ("model", "generator")
    assert result.notes == (
        "left out: model.discriminator (select it to write it, or select 'model' for all of them)",
    )
    consolidate(folder, tmp_path / "d.pt", select="model.discriminator")
    consolidate(folder, tmp_path / "m.pt", select="model")
    whole = reference(folder, tmp_path / "ref.pt")["model"]
    for path, want in (("d.pt", whole["discriminator"]), ("m.pt", whole)):
        assert_bitwise_equal(torch.load(tmp_path / path, weights_only=True), want, path)


def test_tensor_dicts_side_by_side_at_the_root_are_written_with_everything(
    tmp_path: Path,
) -> None:
    gen, disc = torch.nn.Linear(4, 8), torch.nn.Linear(4, 1)
    folder = save_dcp(tmp_path / "gan", {"gen": gen.state_dict(), "disc": disc.state_dict()})
    result = consolidate(folder, tmp_path / "g.pt", dry_run=True)
    assert result.notes == ("left out: disc (select it to write it, or include everything saved)",)
    consolidate(folder, tmp_path / "all.pt", include_all=True)
    want = reference(folder, tmp_path / "ref.pt")
    assert_bitwise_equal(torch.load(tmp_path / "all.pt", weights_only=True), want)

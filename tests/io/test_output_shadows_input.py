"""An output written inside an input Hugging Face folder (or beside an input file in one),
under a name the folder is read through, would change what the folder loads as: it is refused
before any work, the folder untouched byte for byte, and ``from_pretrained`` of it still gives
the same weights. A name ``from_pretrained`` would not read is written.

Inputs are made with ``transformers``' ``save_pretrained``; the oracle is ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import run_ckpt

transformers = pytest.importorskip("transformers")


def _model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_positions=8)
    return transformers.GPT2LMHeadModel(config)


def _saved(folder: Path) -> Path:
    """A sharded folder, as ``save_pretrained`` writes it: an index and its shards."""
    _model().save_pretrained(folder, max_shard_size="2KB")
    return folder


def _bin_shards(folder: Path) -> Path:
    """The sharded folder with torch ``.bin`` shards and their index, as older
    ``save_pretrained`` wrote it."""
    _saved(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    renamed = {}
    for shard in sorted({*index["weight_map"].values()}):
        renamed[shard] = shard.replace("model", "pytorch_model").replace(".safetensors", ".bin")
        torch.save(load_file(folder / shard), folder / renamed[shard])
        (folder / shard).unlink()
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").unlink()
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_refused_unchanged(folder: Path, *args: object) -> str:
    """Run ``ckpt ARGS``: it must exit 6, leaving the folder's files and its loaded weights
    as they were. Returns stderr."""
    files, weights = _files(folder), _loaded(folder)
    result = run_ckpt(*args, code=6)
    assert _files(folder) == files
    after = _loaded(folder)
    assert after.keys() == weights.keys()
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ("slim", "--dtype", "fp16"),
        ("rename", "--sub", "transformer.=body."),
        ("strip-module",),
        ("add-module",),
        ("convert",),
    ],
)
def test_single_file_beside_an_index_is_refused(tmp_path: Path, command: tuple[str, ...]) -> None:
    folder = _saved(tmp_path / "m")
    err = _assert_refused_unchanged(
        folder, command[0], f"{folder}/", folder / "model.safetensors", *command[1:]
    )
    assert "model.safetensors" in err and "input folder" in err


def test_bin_beside_bin_shards_is_refused(tmp_path: Path) -> None:
    folder = _bin_shards(tmp_path / "m")
    err = _assert_refused_unchanged(folder, "strip-module", folder, folder / "pytorch_model.bin")
    assert "pytorch_model.bin" in err


def test_config_is_never_replaced_even_with_force(tmp_path: Path) -> None:
    folder = _saved(tmp_path / "m")
    _assert_refused_unchanged(folder, "slim", folder, folder / "config.json", "--force")


def test_names_read_after_the_loaded_file_are_written(tmp_path: Path) -> None:
    """``from_pretrained`` loads the first of its names present: a name after the one it
    loads now (or one it never looks for) changes nothing, and is written."""
    folder = _saved(tmp_path / "m")
    weights = _loaded(folder)
    run_ckpt("slim", folder, folder / "fp16.safetensors", "--dtype", "fp16")
    run_ckpt("convert", folder, folder / "pytorch_model.bin")
    run_ckpt("convert", folder, folder / "other.pt")
    assert (folder / "fp16.safetensors").is_file() and (folder / "pytorch_model.bin").is_file()
    after = _loaded(folder)
    assert all(torch.equal(weights[k], after[k]) for k in weights)


def test_a_second_index_where_none_is_transformers_own_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path / "m")
    (folder / "model.safetensors.index.json").rename(folder / "custom.index.json")
    files = _files(folder)
    err = run_ckpt("convert", folder, folder / "other.index.json", code=6).stderr
    assert "input folder" in err and _files(folder) == files


def test_a_file_chosen_before_the_loaded_one_is_refused_unless_forced(tmp_path: Path) -> None:
    """``model.safetensors`` beside ``pytorch_model.bin`` is what ``from_pretrained`` then
    loads: refused, from the folder or from its file alike; written with ``--force``."""
    folder = tmp_path / "m"
    model = _model()
    model.config.save_pretrained(folder)  # transformers 5 writes no .bin: as older ones did
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, folder / "pytorch_model.bin")
    for source in (folder, folder / "pytorch_model.bin"):
        _assert_refused_unchanged(folder, "convert", source, folder / "model.safetensors")
    run_ckpt("convert", folder, folder / "model.safetensors", "--force")
    assert (folder / "model.safetensors").is_file()


def test_a_shard_converted_beside_its_index_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    err = _assert_refused_unchanged(folder, "convert", shard, folder / "model.safetensors")
    assert "input folder" in err


def test_a_linked_weight_file_is_not_written_through(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot links its files to blobs outside the folder: writing
    over the link would replace the blob the folder loads."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    single = tmp_path / "single"
    _model().save_pretrained(single)
    for p in single.iterdir():
        (blobs / p.name).write_bytes(p.read_bytes())
        (snapshot / p.name).symlink_to(blobs / p.name)
    blob = (blobs / "model.safetensors").read_bytes()
    _assert_refused_unchanged(
        snapshot, "slim", snapshot, snapshot / "model.safetensors", "--dtype", "fp16", "--force"
    )
    assert (blobs / "model.safetensors").read_bytes() == blob


def test_the_file_config_names_is_read_through_present_or_not(tmp_path: Path) -> None:
    from ckpt_tools.io.input_files import shapes_reading

    folder = _saved(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "transformers_weights": "e.safetensors"})
    )
    assert shapes_reading(folder, folder / "e.safetensors")
    # e.safetensors is what from_pretrained loads, present or not: no other name is read.
    assert not shapes_reading(folder, folder / "model.safetensors")
    assert not shapes_reading(folder, folder / "f.safetensors")
    assert not shapes_reading(folder, tmp_path / "model.safetensors")


def test_a_fifo_named_like_an_index_beside_the_input_is_never_opened(tmp_path: Path) -> None:
    # The guard lists what the input's folder would load; a FIFO is refused by name, not read
    # (reading one blocks until something writes it).
    folder = tmp_path / "m"
    folder.mkdir()
    torch.save({"module.w": torch.ones(2)}, folder / "a.pt")
    os.mkfifo(folder / "weights.index.json")
    run_ckpt("strip-module", folder / "a.pt", folder / "out.pt", how="module", timeout=60)
    assert torch.equal(torch.load(folder / "out.pt", weights_only=True)["w"], torch.ones(2))

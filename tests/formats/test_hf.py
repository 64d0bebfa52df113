"""Sharded folders: an ``*.index.json`` opens with its shards, as the folder's advice says."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckpt_tools
from ckpt_tools import UnsupportedFormatError
from ckpt_tools.cli.main import main
from ckpt_tools.formats import detect_format, open_checkpoint


def two_indexes(folder: Path) -> dict[str, torch.Tensor]:
    """A folder with a safetensors index over two shards, and a .bin index over one shard,
    under names from_pretrained does not try (it would read ``model.safetensors.index.json``)."""
    tensors = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(3)}
    save_file({"a.weight": tensors["a.weight"]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": tensors["b.bias"]}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {"a.weight": "model-00001-of-00002.safetensors"}
    weight_map["b.bias"] = "model-00002-of-00002.safetensors"
    index = {"metadata": {"total_size": 36}, "weight_map": weight_map}
    (folder / "a-model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({"other": torch.zeros(2)}, folder / "pytorch_model-00001-of-00001.bin")
    bin_index = {"weight_map": {"other": "pytorch_model-00001-of-00001.bin"}}
    (folder / "b-model.bin.index.json").write_text(json.dumps(bin_index))
    return tensors


def test_the_advised_command_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = two_indexes(tmp_path)
    with pytest.raises(UnsupportedFormatError, match="several indexes") as caught:
        ckpt_tools.inspect(tmp_path)
    index = tmp_path / "a-model.safetensors.index.json"
    assert f"path={str(index)!r}" in str(caught.value)
    advice = re.search(r"e\.g\. (\S+)$", caught.value.render(for_cli=True))
    assert advice, caught.value.render(for_cli=True)
    assert main(["inspect", *shlex.split(advice.group(1)), "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "hf-sharded"
    assert [t["name"] for t in report["tensors"]] == list(tensors)


def test_an_index_opens_with_its_shards_only(tmp_path: Path) -> None:
    tensors = two_indexes(tmp_path)
    index = tmp_path / "a-model.safetensors.index.json"
    assert detect_format(index) == "hf-sharded"
    ckpt = open_checkpoint(index)
    assert ckpt.format == "hf-sharded" and ckpt.path == str(tmp_path)
    assert sorted(ckpt.shards) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert ckpt.metadata == {"total_size": 36}
    loaded = ckpt_tools.load_state_dict(index)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    other = open_checkpoint(tmp_path / "b-model.bin.index.json")
    assert list(other.root) == ["other"]


def test_a_file_that_only_borrows_the_name_is_not_an_index(tmp_path: Path) -> None:
    """Content decides: a torch file named *.index.json is still read as what it is."""
    path = tmp_path / "weights.index.json"
    torch.save({"w": torch.ones(2)}, path)
    assert detect_format(path) == "torch-zip"
    not_json = tmp_path / "notes.index.json"
    not_json.write_text("hello")
    with pytest.raises(UnsupportedFormatError, match="not a checkpoint"):
        open_checkpoint(not_json)


@pytest.mark.parametrize(
    ("weights", "file_format"),
    [("model.safetensors", "safetensors"), ("pytorch_model.bin", "torch-zip")],
)
def test_a_folder_with_one_weight_file_is_inspected_as_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], weights: str, file_format: str
) -> None:
    """As save_pretrained leaves it: config.json and one weight file, no index."""
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    tensors = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(3)}
    if weights.endswith(".safetensors"):
        save_file(tensors, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    assert main(["inspect", str(folder), "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert (report["format"], report["path"], report["shards"]) == (
        "hf-sharded",
        str(folder),
        [weights],
    )
    assert report["format"] == detect_format(folder)
    assert [t["name"] for t in report["tensors"]] == list(tensors)
    assert main(["inspect", str(folder)]) == 0
    head = capsys.readouterr().out.splitlines()[:2]
    assert head == [f"file:        {folder}", "format:      hf-sharded (1 shard)"]
    # Commands that rewrite it read the one file as what it is (its format picks theirs).
    assert open_checkpoint(folder).format == file_format
    assert open_checkpoint(folder / weights).format == file_format


@pytest.mark.parametrize("verify", ["sizes", "full"])
def test_an_index_mixing_safetensors_and_torch_shards_copies_each_tensors_own_bytes(
    tmp_path: Path, verify: str
) -> None:
    # The safetensors tensor "0" shares its name with the torch shard's storage key "0".
    folder = tmp_path / "mixed"
    folder.mkdir()
    save_file({"0": torch.full((4,), 1.0)}, folder / "model-00001-of-00002.safetensors")
    torch.save({"x": torch.full((4,), 7.0)}, folder / "model-00002-of-00002.bin")
    weight_map = {"0": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.bin"}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt_tools.convert(folder, tmp_path / "out.pt", verify=verify)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(out["0"], torch.full((4,), 1.0))
    assert torch.equal(out["x"], torch.full((4,), 7.0))


def test_an_index_whose_metadata_nests_deep_is_inspected_as_json_too(tmp_path: Path) -> None:
    folder = tmp_path / "deep"
    ckpt_tools.convert(
        Path(__file__).parents[2] / "fixtures" / "plain.pt", f"{folder}/", max_shard_size="1KB"
    )
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["deep"] = json.loads("[" * 700 + "]" * 700)  # json.load reads it
    index_path.write_text(json.dumps(index))
    assert main(["inspect", str(folder)]) == 0
    assert main(["inspect", str(folder), "--json"]) == 0

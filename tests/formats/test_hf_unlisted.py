"""An HF folder is read as transformers' ``from_pretrained`` reads it, whatever its index lists.

``from_pretrained`` opens the shard files the ``weight_map`` names and loads every tensor of
each: a tensor the ``weight_map`` leaves out (or places in the wrong shard) is still loaded,
and a shard file it does not name is not opened. The oracles are ``from_pretrained``,
``huggingface_hub.load_torch_model`` and ``accelerate.load_checkpoint_in_model``, on a tiny
GPT-2 made here.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_tools as ct
from ckpt_tools import CorruptCheckpointError
from ckpt_tools.cli.main import main

transformers = pytest.importorskip("transformers")
accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")

NAME = "transformer.h.0.ln_1.bias"


def _config() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)


def _saved(folder: Path) -> dict:
    """A tiny GPT-2 saved by ``save_pretrained`` in several shards; its index's JSON."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(folder, max_shard_size="20KB")
    return json.loads((folder / "model.safetensors.index.json").read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _loaded(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The state dict each Hugging Face loader puts in a fresh model."""
    hub, acc = transformers.GPT2LMHeadModel(_config()), transformers.GPT2LMHeadModel(_config())
    huggingface_hub.load_torch_model(hub, folder, strict=False)
    accelerate_modeling.load_checkpoint_in_model(acc, str(folder))
    return {
        "from_pretrained": transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict(),
        "load_torch_model": hub.state_dict(),
        "load_checkpoint_in_model": acc.state_dict(),
    }


def _agrees(folder: Path, ours: dict[str, torch.Tensor]) -> None:
    for loader, theirs in _loaded(folder).items():
        for name, value in ours.items():
            assert torch.equal(value, theirs[name]), (loader, name)


def test_a_tensor_the_index_leaves_out_is_read_and_noted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = _saved(tmp_path / "hf")
    shard = index["weight_map"].pop(NAME)
    _write_index(tmp_path / "hf", index)
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        ours = ct.load_state_dict(tmp_path / "hf")
    assert NAME in ours
    assert any(
        "does not list 1 tensor" in r.getMessage() and NAME in r.getMessage()
        for r in caplog.records
    )
    _agrees(tmp_path / "hf", ours)
    assert ct.inspect(tmp_path / "hf").shard_of[NAME] == f"{shard}:"
    # A rewrite keeps it: converted and resharded, transformers finds it again.
    ct.convert(tmp_path / "hf", tmp_path / "one.pt")
    assert torch.equal(torch.load(tmp_path / "one.pt", weights_only=True)[NAME], ours[NAME])
    assert (
        main(
            [
                "reshard",
                str(tmp_path / "hf"),
                str(tmp_path / "rs"),
                "--max-shard-size",
                "50KB",
                "-q",
            ]
        )
        == 0
    )
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tmp_path / "hf" / name, tmp_path / "rs" / name)
    model, info = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "rs", output_loading_info=True
    )
    assert NAME not in info["missing_keys"]
    assert torch.equal(model.state_dict()[NAME], ours[NAME])


def test_a_tensor_the_index_misplaces_is_read_from_its_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = _saved(tmp_path / "hf")
    other = next(
        s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][NAME]
    )
    index["weight_map"][NAME] = other
    _write_index(tmp_path / "hf", index)
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        ours = ct.load_state_dict(tmp_path / "hf")
    assert any("does not hold them" in r.getMessage() for r in caplog.records)
    _agrees(tmp_path / "hf", ours)


def test_a_name_two_named_shards_hold_is_refused(tmp_path: Path) -> None:
    index = _saved(tmp_path / "hf")
    listed = index["weight_map"][NAME]
    last = sorted(set(index["weight_map"].values()))[-1]
    assert last != listed
    tensors = load_file(tmp_path / "hf" / last)
    tensors[NAME] = torch.full((32,), 7.0)
    save_file(tensors, tmp_path / "hf" / last, metadata={"format": "pt"})
    # Not the copy the index lists: from_pretrained loads the shards in sorted order, the
    # last copy winning (huggingface_hub's load_torch_model in set order, any copy).
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    assert torch.equal(loaded[NAME], torch.full((32,), 7.0))
    with pytest.raises(CorruptCheckpointError, match="hold the same tensor") as caught:
        ct.load_state_dict(tmp_path / "hf")
    assert NAME in str(caught.value) and listed in str(caught.value) and last in str(caught.value)
    assert main(["inspect", str(tmp_path / "hf")]) == 4


def test_a_shard_file_the_index_does_not_name_is_not_read(tmp_path: Path) -> None:
    _saved(tmp_path / "hf")
    stray = {NAME: torch.full((32,), 9.0), "stray.weight": torch.ones(2)}
    save_file(
        stray, tmp_path / "hf" / "model-00099-of-00099.safetensors", metadata={"format": "pt"}
    )
    ours = ct.load_state_dict(tmp_path / "hf")
    assert (
        "stray.weight" not in ours
        and "model-00099-of-00099.safetensors" not in ct.open_checkpoint(tmp_path / "hf").shards
    )
    _agrees(tmp_path / "hf", ours)


def test_a_listed_name_no_named_shard_holds_is_refused(tmp_path: Path) -> None:
    index = _saved(tmp_path / "hf")
    index["weight_map"]["lost.weight"] = index["weight_map"][NAME]
    _write_index(tmp_path / "hf", index)
    with pytest.raises(CorruptCheckpointError, match=r"'lost\.weight' in .*has no such tensor"):
        ct.load_state_dict(tmp_path / "hf")


def test_an_unlisted_entry_that_is_no_tensor_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "pytorch_model-00001-of-00001.bin")
    index = {"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="no tensors: 'step'"):
        ct.inspect(tmp_path)

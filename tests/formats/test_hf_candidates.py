"""A folder holding several weight files is read through the one ``from_pretrained`` loads.

``transformers`` tries ``model.safetensors``, ``model.safetensors.index.json``,
``pytorch_model.bin`` and ``pytorch_model.bin.index.json`` in that order and loads the first
present, unless config.json names another file in ``transformers_weights``. For every pair,
each holding other weights, and for each file so named, the oracle is ``from_pretrained`` on
a tiny GPT-2 made here; the candidate not read is named in a warning.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.cli.main import main

transformers = pytest.importorskip("transformers")

CANDIDATES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _model(seed: int) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def _save_bin_shards(model: transformers.GPT2LMHeadModel, folder: Path) -> None:
    """``pytorch_model.bin.index.json`` over two ``.bin`` shards (save_pretrained writes none)."""
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = list(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({n: state[n] for n in part}, folder / shard)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


def _save(candidate: str, model: transformers.GPT2LMHeadModel, folder: Path) -> None:
    """``model``'s weights in ``folder`` as ``candidate`` (with its shards), and its config."""
    folder.mkdir(exist_ok=True)
    if candidate == "model.safetensors":
        model.save_pretrained(folder)
    elif candidate == "model.safetensors.index.json":
        model.save_pretrained(folder, max_shard_size="5KB")
    elif candidate == "pytorch_model.bin":
        model.config.save_pretrained(folder)
        state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        torch.save(state, folder / "pytorch_model.bin")
    else:
        model.config.save_pretrained(folder)
        _save_bin_shards(model, folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each candidate in its own folder, each with different weights."""
    root = tmp_path_factory.mktemp("candidates")
    folders = {}
    for seed, candidate in enumerate(CANDIDATES, start=1):
        folders[candidate] = root / str(seed)
        _save(candidate, _model(seed), folders[candidate])
    return folders


def _merge(sources: list[Path], folder: Path) -> None:
    folder.mkdir()
    for source in sources:
        for item in source.iterdir():
            shutil.copy(item, folder / item.name)


@pytest.mark.parametrize("pair", list(itertools.combinations(CANDIDATES, 2)))
def test_the_file_read_is_the_one_from_pretrained_loads(
    pair: tuple[str, str],
    saved: dict[str, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = tmp_path / "both"
    _merge([saved[c] for c in pair], folder)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict()
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        ours = ct.load_state_dict(folder)
    assert ours, pair
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), (pair, name)
    # The two candidates differ, so the test tells them apart.
    other = ct.load_state_dict(saved[pair[1]])
    assert any(not torch.equal(v, other[k]) for k, v in ours.items()), pair
    notes = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(notes) == 1 and notes[0].endswith(f"not read: {pair[1]}"), notes


def test_convert_and_reshard_read_what_from_pretrained_loads(
    saved: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "both"
    _merge([saved["model.safetensors"], saved["model.safetensors.index.json"]], folder)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict()
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        assert main(["convert", str(folder), str(tmp_path / "out.pt")]) == 0
    assert "not read: model.safetensors.index.json" in caplog.text
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(v, theirs[k]) for k, v in out.items())
    assert main(["reshard", str(folder), str(tmp_path / "rs"), "--max-shard-size", "1GB"]) == 0
    resharded = ct.load_state_dict(tmp_path / "rs")
    assert all(torch.equal(v, theirs[k]) for k, v in resharded.items())


def _name_weights(folder: Path, named: object) -> None:
    """config.json names ``named`` in ``transformers_weights``, as a from_pretrained-able
    config may (transformers reads it before its own list)."""
    config = json.loads((folder / "config.json").read_text())
    config["transformers_weights"] = named
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "named", ["ema.safetensors", "sub/ema.safetensors", "./sub/ema.safetensors", "index"]
)
def test_the_file_config_json_names_is_the_one_read(
    named: str, saved: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "named"
    _merge([saved["model.safetensors"], saved["model.safetensors.index.json"]], folder)
    if named == "index":
        named = "model.safetensors.index.json"  # read where model.safetensors would win
    else:
        (folder / named).parent.mkdir(exist_ok=True)
        ema = _model(9)
        ema.save_pretrained(tmp_path / "ema")
        shutil.copy(tmp_path / "ema" / "model.safetensors", folder / named)
    _name_weights(folder, named)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict()
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        ours = ct.load_state_dict(folder)
    assert ours and all(torch.equal(v, theirs[k]) for k, v in ours.items()), named
    unnamed = ct.load_state_dict(folder / "model.safetensors")
    assert any(not torch.equal(v, unnamed[k]) for k, v in ours.items())
    read = named.removeprefix("./")  # the file, as from_pretrained joins it to the folder
    assert f"{read} is read" in caplog.text and "not read: model.safetensors" in caplog.text


@pytest.mark.parametrize(
    ("named", "words"),
    [
        ("pytorch_model.bin", "loads only a *.safetensors file"),
        (7, "loads only a *.safetensors file"),
        ("../model.safetensors", "outside the folder"),
        ("/etc/model.safetensors", "outside the folder"),
        ("missing.safetensors", "which the folder does not hold"),
        # from_pretrained joins the name to the folder: no file where a part does not exist.
        ("nosuch/../model.safetensors", "which the folder does not hold"),
    ],
)
def test_a_config_naming_weights_from_pretrained_refuses_is_refused(
    named: object, words: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "bad"
    _merge([saved["model.safetensors"], saved["pytorch_model.bin"]], folder)
    _name_weights(folder, named)
    with pytest.raises((ValueError, OSError, AttributeError)):
        transformers.GPT2LMHeadModel.from_pretrained(folder)
    with pytest.raises(ct.UnsupportedFormatError, match="names transformers_weights") as info:
        ct.load_state_dict(folder)
    assert words in str(info.value)
    assert main(["inspect", str(folder)]) == info.value.exit_code


def test_a_config_json_that_names_no_weights_or_is_no_json_changes_nothing(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "plain"
    _merge([saved["model.safetensors"], saved["pytorch_model.bin"]], folder)
    want = ct.load_state_dict(folder / "model.safetensors")
    for text in ["{not json", "[1, 2]", '{"transformers_weights": null}']:
        (folder / "config.json").write_text(text)
        got = ct.load_state_dict(folder)
        assert got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items())


@pytest.mark.parametrize("stem", ["adapter_model", "diffusion_pytorch_model"])
def test_a_safetensors_beside_its_bin_is_the_one_read_as_peft_and_diffusers_read_it(
    stem: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Older Hub repos ship both; PEFT's load_peft_weights and diffusers prefer safetensors.
    from safetensors.torch import save_file

    folder = tmp_path / "both"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / f"{stem}.safetensors")
    torch.save({"w": torch.zeros(2)}, folder / f"{stem}.bin")
    if stem == "adapter_model":
        peft = pytest.importorskip("peft")
        theirs = peft.utils.load_peft_weights(str(folder))
        assert torch.equal(theirs["w"], torch.ones(2))
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        ours = ct.load_state_dict(folder)
    assert torch.equal(ours["w"], torch.ones(2))
    notes = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(notes) == 1 and notes[0].endswith(f"not read: {stem}.bin"), notes


def test_weight_files_of_two_kinds_are_refused_as_several_not_as_none(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "mixed"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "adapter_model.safetensors")
    save_file({"w": torch.ones(2)}, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ct.UnsupportedFormatError, match="holds several weight files") as err:
        ct.load_state_dict(folder)
    assert "without a checkpoint" not in str(err.value)
    assert "diffusion_pytorch_model.safetensors" in err.value.render(for_cli=True)


def test_a_variants_sharded_folder_is_read_through_its_index(tmp_path: Path) -> None:
    # save_pretrained(variant="fp16") names its index model.safetensors.index.fp16.json and
    # its shards model.fp16-0000k-of-0000N.safetensors; from_pretrained(variant=) loads them.
    model = _model(3).half()
    model.save_pretrained(tmp_path / "v", variant="fp16", max_shard_size="2KB")
    index = tmp_path / "v" / "model.safetensors.index.fp16.json"
    assert index.is_file()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "v", variant="fp16")
    want = theirs.state_dict()
    for source in (index, tmp_path / "v"):
        ours = ct.load_state_dict(source)
        stored = [k for k in want if k in ours]
        assert stored and all(torch.equal(ours[k], want[k]) for k in stored), source
    assert ct.inspect(tmp_path / "v").format == "hf-sharded"
    ct.reshard(index, tmp_path / "one", max_shard_size="1GB")
    assert (tmp_path / "one" / "model.safetensors").is_file()


@pytest.mark.parametrize("shard", [None, "2KB"])
@pytest.mark.parametrize("variant", ["fp16", "ema.v2"])
def test_a_variants_folder_is_read_as_from_pretrained_variant_loads_it(
    variant: str, shard: str | None, tmp_path: Path
) -> None:
    # save_pretrained(variant=) puts the variant before the suffix (model.fp16.safetensors), and
    # a dotted one whole (model.ema.v2.safetensors, model.safetensors.index.ema.v2.json).
    kwargs = {"max_shard_size": shard} if shard else {}
    _model(4).save_pretrained(tmp_path / "v", variant=variant, **kwargs)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "v", variant=variant)
    want = theirs.state_dict()
    ours = ct.load_state_dict(tmp_path / "v")
    stored = [k for k in want if k in ours]
    assert len(stored) == len(ours) > 1
    assert all(torch.equal(ours[k], want[k]) for k in stored)


def test_a_variant_beside_the_plain_file_is_named_as_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # diffusers' layout: from_pretrained without variant= loads the plain file.
    from safetensors.torch import save_file

    folder = tmp_path / "unet"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "diffusion_pytorch_model.safetensors")
    save_file({"w": torch.zeros(2).half()}, folder / "diffusion_pytorch_model.fp16.safetensors")
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        ours = ct.load_state_dict(folder)
    assert torch.equal(ours["w"], torch.ones(2))
    notes = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(notes) == 1
    assert notes[0].endswith("not read: diffusion_pytorch_model.fp16.safetensors")


def test_a_variants_safetensors_is_read_before_its_bin_and_two_variants_are_refused(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "v"
    folder.mkdir()
    save_file({"w": torch.ones(2)}, folder / "model.fp16.safetensors")
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.fp16.bin")
    assert torch.equal(ct.load_state_dict(folder)["w"], torch.ones(2))
    save_file({"w": torch.zeros(2)}, folder / "model.bf16.safetensors")
    with pytest.raises(ct.UnsupportedFormatError, match="holds several weight files") as err:
        ct.load_state_dict(folder)
    assert "model.bf16.safetensors" in str(err.value)


@pytest.mark.parametrize("suffix", ["safetensors", "bin"])
def test_a_variants_file_is_read_before_its_index_as_from_pretrained_variant_reads_them(
    tmp_path: Path, suffix: str
) -> None:
    # transformers tries model.V.safetensors, then model.safetensors.index.V.json, then
    # pytorch_model.V.bin, then pytorch_model.bin.index.V.json. A re-save as one file
    # leaves the sharded save's index behind.
    folder = tmp_path / "v"
    _model(5).save_pretrained(folder, variant="fp16", max_shard_size="2KB")
    if suffix == "bin":  # the index of .bin shards, beside one .bin
        index = json.loads((folder / "model.safetensors.index.fp16.json").read_text())
        (folder / "pytorch_model.bin.index.fp16.json").write_text(json.dumps(index))
        for shard in folder.glob("model.fp16-*.safetensors"):
            shard.unlink()
        (folder / "model.safetensors.index.fp16.json").unlink()
        state = {k: v.clone() for k, v in _model(6).state_dict().items() if k != "lm_head.weight"}
        torch.save(state, folder / "pytorch_model.fp16.bin")
    else:
        _model(6).save_pretrained(folder, variant="fp16")
        assert (folder / "model.safetensors.index.fp16.json").is_file()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder, variant="fp16").state_dict()
    ours = ct.load_state_dict(folder)
    stored = [k for k in theirs if k in ours]
    assert len(stored) == len(ours) > 1
    assert all(torch.equal(ours[k], theirs[k]) for k in stored)

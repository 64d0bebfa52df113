"""Hugging Face sharded folders: convert to and from a folder, reshard; checked with safetensors
and torch.load, never with our own reader alone."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools import convert, load_state_dict, reshard
from ckpt_tools.errors import (
    ConversionError,
    CorruptCheckpointError,
    OutputError,
    OutputExistsError,
    UsageError,
)
from ckpt_tools.io.writers.shard_plan import INDEX_NAME, parse_shard_size, plan_shards
from ckpt_tools.ops.transform.tied_names import hf_shared_names
from tests.helpers.cli import run_ckpt


def _model_pt(path: Path) -> dict[str, torch.Tensor]:
    """A small LM-like state dict: tied embedding/head, mixed dtypes, one large tensor."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(50, 8, generator=g)
    sd = {
        "model.embed_tokens.weight": embed,
        "model.layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(8, generator=g),
        "model.layers.1.w": torch.randn(8, 8, generator=g).to(torch.float16),
        "model.layers.1.steps": torch.arange(5, dtype=torch.int64),
        "model.layers.1.mask": torch.tensor([True, False, True]),
        "big": torch.randn(40, 40, generator=g),  # 6400 bytes: over the 2000-byte limit
        "lm_head.weight": embed,  # tied: stored once, under huggingface_hub's choice of name
    }
    torch.save(sd, path)
    return sd


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _union(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        part = load_file(shard)
        assert not set(part) & set(out)
        out.update(part)
    return out


def _check_index(folder: Path, limit: int) -> dict:
    index = json.loads((folder / INDEX_NAME).read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for shard in shards:
        with safe_open(folder / shard, "pt") as f:
            assert f.metadata()["format"] == "pt"
            names = list(f.keys())
            sizes = [f.get_tensor(k).nbytes for k in names]
        assert sorted(k for k, v in index["weight_map"].items() if v == shard) == sorted(names)
        assert sum(sizes) <= limit or len(names) == 1  # a tensor over the limit stands alone
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    return index


def test_parse_shard_size_like_huggingface_and_binary_units() -> None:
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("5GiB") == 5 * 2**30
    assert parse_shard_size(" 500mb ") == 500 * 10**6
    assert parse_shard_size("2000") == parse_shard_size(2000) == 2000
    assert parse_shard_size("1.5KB") == 1500
    # A fraction of a byte is no size: "1.5" would be read as 1 byte (huggingface_hub refuses)
    for bad in ("5XB", "GB", "-1GB", "0", "", "1.5", "2.5B"):
        with pytest.raises(UsageError, match="max_shard_size="):
            parse_shard_size(bad)


def test_plan_shards_follows_the_huggingface_hub_docstring_example() -> None:
    # split_torch_state_dict_into_shards's own example: limit 10, sizes [6, 6, 2, 6, 2, 2]
    # -> [6], [6+2], [6+2+2].
    sizes = [("a", 6), ("b", 6), ("c", 2), ("d", 6), ("e", 2), ("f", 2)]
    plan = plan_shards(sizes, 10)
    assert [names for _, names in plan.files] == [("a",), ("b", "c"), ("d", "e", "f")]
    assert plan.total_size == 24 and plan.is_sharded
    single = plan_shards(sizes, 100)
    assert single.files == (("model.safetensors", tuple(n for n, _ in sizes)),)
    assert not single.is_sharded


def test_hf_shared_names_keeps_the_first_complete_name_in_key_order(tmp_path: Path) -> None:
    from ckpt_tools.formats import open_checkpoint

    base = torch.zeros(16)
    torch.save(
        {"z.full": base, "a.view": base[:8], "m.full": base, "own": torch.ones(2)},
        tmp_path / "t.pt",
    )
    root = open_checkpoint(tmp_path / "t.pt").root
    # a.view is not complete; z.full comes before m.full: kept, as save_pretrained keeps the
    # module that owns a tied weight (registered first) rather than those tied to it
    assert hf_shared_names(root) == {"a.view": "z.full", "m.full": "z.full"}
    torch.save({"x": base[:8], "y": base[4:]}, tmp_path / "partial.pt")
    with pytest.raises(
        ConversionError,
        match=r"none of them covers the whole storage, so no one name can be kept: \{x, y\}",
    ):
        hf_shared_names(open_checkpoint(tmp_path / "partial.pt").root)


def test_one_view_of_part_of_a_storage_under_two_names_is_stored_once(tmp_path: Path) -> None:
    # A tied embedding carved from one flat buffer: no name covers the storage, but both are
    # one view, so one is stored and the other recorded as tied, as a single file does it.
    flat = torch.arange(16.0)
    emb = flat[:12].view(3, 4)
    src = tmp_path / "f.pt"
    torch.save({"emb.weight": emb, "head.weight": emb, "norm.weight": flat[12:]}, src)
    result = convert(src, f"{tmp_path}/hf/")
    stored = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(stored) == ["emb.weight", "norm.weight"]
    assert torch.equal(stored["emb.weight"], emb) and torch.equal(stored["norm.weight"], flat[12:])
    assert "head.weight" in result.dropped
    back = load_state_dict(tmp_path / "hf", map_location="cpu")
    assert torch.equal(back["head.weight"], emb)
    assert back["head.weight"].data_ptr() == back["emb.weight"].data_ptr()


def test_convert_pt_to_folder_shards_load_with_safetensors_and_match(tmp_path: Path) -> None:
    sd = _model_pt(tmp_path / "model.pt")
    result = convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    out = tmp_path / "hf"
    index = _check_index(out, 2000)
    assert result.written[-1] == str(out / INDEX_NAME)
    assert len(result.written) == len(list(out.iterdir()))
    union = _union(out)
    assert list(index["weight_map"]) == list(union) or set(index["weight_map"]) == set(union)
    # the first name in key order is kept, the embedding, as save_pretrained keeps it
    assert "lm_head.weight" not in union
    assert index["metadata"]["lm_head.weight"] == "model.embed_tokens.weight"
    assert set(union) == set(sd) - {"lm_head.weight"}
    for key, value in union.items():
        assert value.dtype == sd[key].dtype and torch.equal(value, sd[key]), key
    # the oversized tensor has a shard of its own
    assert [v for k, v in index["weight_map"].items() if k == "big"] and sum(
        1 for v in index["weight_map"].values() if v == index["weight_map"]["big"]
    ) == 1


def test_round_trip_hf_to_pt_to_hf_is_bitwise(tmp_path: Path) -> None:
    sd = _model_pt(tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    before = _digest(tmp_path / "hf")
    back = convert(tmp_path / "hf", tmp_path / "back.pt")
    assert back.input_format == "hf-sharded" and _digest(tmp_path / "hf") == before
    loaded = torch.load(tmp_path / "back.pt", weights_only=True)
    assert set(loaded) == set(sd)  # the tied name the index records comes back
    for key, value in loaded.items():
        assert torch.equal(value, sd[key]) and value.dtype == sd[key].dtype, key
    tied = loaded["model.embed_tokens.weight"].untyped_storage().data_ptr()
    assert tied == loaded["lm_head.weight"].untyped_storage().data_ptr()  # over one storage
    single = convert(tmp_path / "hf", tmp_path / "one.safetensors")
    assert single.output_format == "safetensors"
    with safe_open(tmp_path / "one.safetensors", "pt") as f:  # alias notes carried, not total_size
        assert f.metadata()["lm_head.weight"] == "model.embed_tokens.weight"
        assert "total_size" not in f.metadata()
    convert(tmp_path / "back.pt", tmp_path / "hf2/", max_shard_size="2KB")
    index2 = json.loads((tmp_path / "hf2" / INDEX_NAME).read_text())
    index1 = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert index2["weight_map"] == index1["weight_map"]
    # the .pt kept the tied name over one storage, so the alias note is written again
    assert index2["metadata"] == index1["metadata"]
    assert index2["metadata"]["lm_head.weight"] == "model.embed_tokens.weight"
    for name in index1["weight_map"].values():
        a, b = load_file(tmp_path / "hf" / name), load_file(tmp_path / "hf2" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reshard_changes_shard_size_never_touches_the_input(tmp_path: Path) -> None:
    sd = _model_pt(tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    before = _digest(tmp_path / "hf")
    result = reshard(tmp_path / "hf", tmp_path / "big", max_shard_size="1MB", verify="full")
    assert _digest(tmp_path / "hf") == before
    # everything fits in one: a lone model.safetensors with the metadata in it, no index
    assert result.written == (str(tmp_path / "big" / "model.safetensors"),)
    with safe_open(tmp_path / "big" / "model.safetensors", "pt") as f:
        assert f.metadata() == {
            "format": "pt",
            "lm_head.weight": "model.embed_tokens.weight",
            "ckpt_tools.tied": '{"lm_head.weight":"model.embed_tokens.weight"}',
        }
    union = load_file(tmp_path / "big" / "model.safetensors")
    assert all(torch.equal(union[k], sd[k]) for k in union) and len(union) == len(sd) - 1
    small = reshard(tmp_path / "big", tmp_path / "small", max_shard_size=700)
    _check_index(tmp_path / "small", 700)
    assert len(small.written) == 4  # lm_head (1600 B) and big (6400 B) alone, the rest together
    with pytest.raises(OutputExistsError, match="force=True"):
        reshard(tmp_path / "hf", tmp_path / "small", max_shard_size="1KB")
    reshard(tmp_path / "hf", tmp_path / "small", max_shard_size="1MB", force=True)
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == ["model.safetensors"]
    with pytest.raises(OutputError, match="is the input or holds it"):
        reshard(tmp_path / "hf", tmp_path / "hf", max_shard_size="1KB", force=True)
    with pytest.raises(OutputError, match="never replaced"):  # nor a folder holding the input
        convert(tmp_path / "model.pt", tmp_path, max_shard_size="1KB", force=True)
    assert _digest(tmp_path / "hf") == before
    with pytest.raises(UsageError, match="not a sharded folder"):
        reshard(tmp_path / "model.pt", tmp_path / "x", max_shard_size="1KB")
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp" in p.name]


def test_a_broken_index_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    _model_pt(tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    index_path = tmp_path / "hf" / INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="has no such tensor"):
        reshard(tmp_path / "hf", tmp_path / "out", max_shard_size="1MB")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp" in p.name]


def test_cli_convert_to_a_folder_and_reshard(tmp_path: Path) -> None:
    _model_pt(tmp_path / "model.pt")
    res = run_ckpt("convert", tmp_path / "model.pt", f"{tmp_path / 'hf'}/")
    assert "wrote" in res.stdout and (tmp_path / "hf" / "model.safetensors").is_file()
    res = run_ckpt("convert", tmp_path / "model.pt", tmp_path / "hf", code=6)
    assert "pass --force" in res.stderr
    bad = run_ckpt("reshard", tmp_path / "hf", tmp_path / "o", "--max-shard-size", "5XB", code=2)
    assert "--max-shard-size '5XB'" in bad.stderr
    done = run_ckpt(
        "reshard",
        tmp_path / "hf",
        tmp_path / "r",
        "--max-shard-size",
        "2KB",
        "--json",
        how="script",
    )
    data = json.loads(done.stdout)
    assert data["output_format"] == "hf-sharded"
    assert data["written"][-1] == str(tmp_path / "r" / INDEX_NAME)
    _check_index(tmp_path / "r", 2000)


@pytest.mark.filterwarnings("ignore:ComplexHalf:UserWarning", "ignore:torch.quantize:UserWarning")
def test_dtypes_safetensors_lacks_are_refused_before_any_shard_is_written(tmp_path: Path) -> None:
    sd = {f"ok{i}": torch.randn(64) for i in range(4)}
    sd["half_complex"] = torch.zeros(3, dtype=torch.complex32)
    sd["quantized"] = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    torch.save(sd, tmp_path / "odd.pt")
    with pytest.raises(ConversionError, match=r"2 tensor\(s\).*half_complex \(complex32\)"):
        convert(tmp_path / "odd.pt", tmp_path / "hf", max_shard_size="300B")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.pt"]


def test_a_killed_runs_temp_folders_are_removed_a_live_ones_kept(tmp_path: Path) -> None:
    import os

    _model_pt(tmp_path / "model.pt")
    # PID 4194304 is pid_max's ceiling on Linux: no process has it.
    dead = [
        tmp_path / ".hf.ckpt-tmpdir-4194304-ab12cd34",
        tmp_path / ".hf.ckpt-tmpdir-4194304-ab12cd34-old",
    ]
    live = tmp_path / f".other.ckpt-tmpdir-{os.getpid()}-ef34ab12"
    for folder in (*dead, live):
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    (tmp_path / "hf").mkdir()  # the output has its name: the folder set aside is stale
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    assert not any(d.exists() for d in dead) and live.exists()


def test_a_folder_set_aside_by_a_killed_run_gets_its_name_back(tmp_path: Path) -> None:
    # Killed between moving the old folder aside and naming the new one (a file system
    # without an atomic swap): the old folder, the user's files in it, is the output.
    _model_pt(tmp_path / "model.pt")
    aside = tmp_path / ".out.ckpt-tmpdir-4194304-ab12cd34-old"
    unpublished = tmp_path / ".out.ckpt-tmpdir-4194304-ab12cd34"
    for folder in (aside, unpublished):
        folder.mkdir()
    (aside / "config.json").write_text("{}")
    convert(tmp_path / "model.pt", f"{tmp_path}/hf/")
    assert (tmp_path / "out" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.pt", "out"]


def test_jobs_write_the_same_bytes_as_one_writer(tmp_path: Path) -> None:
    _model_pt(tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    one = reshard(tmp_path / "hf", tmp_path / "one", max_shard_size=600, verify="full")
    many = reshard(tmp_path / "hf", tmp_path / "many", max_shard_size=600, verify="full", jobs=4)
    names = [Path(p).name for p in one.written]
    assert [Path(p).name for p in many.written] == names and len(names) > 3
    assert _digest(tmp_path / "many") == _digest(tmp_path / "one")
    _check_index(tmp_path / "many", 600)
    with pytest.raises(UsageError, match="jobs=0: expected a count of 1 or more"):
        reshard(tmp_path / "hf", tmp_path / "none", max_shard_size=600, jobs=0)
    res = run_ckpt(
        "reshard", tmp_path / "hf", tmp_path / "cli", "--max-shard-size", "600", "--jobs", "3"
    )
    assert "resharded into" in res.stdout
    assert _digest(tmp_path / "cli") == _digest(tmp_path / "one")


@pytest.mark.parametrize("name", ["out.pt", "out.bin", "out.safetensors", "OUT.CKPT"])
def test_a_sharded_output_named_like_a_file_is_refused(tmp_path: Path, name: str) -> None:
    _model_pt(tmp_path / "model.pt")
    res = run_ckpt(
        "convert", tmp_path / "model.pt", tmp_path / name, "--max-shard-size", "200B", code=2
    )
    assert "a sharded output is a folder" in res.stderr and "name a folder, e.g. " in res.stderr
    assert not (tmp_path / name).exists()
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    with pytest.raises(UsageError, match=r"name a folder, e\.g\. out/"):
        reshard(tmp_path / "hf", tmp_path / "out.pt", max_shard_size="1KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.pt"]


def test_shards_cut_from_one_safetensors_hold_small_headers(tmp_path: Path) -> None:
    # Each shard's tensors tile a range deep inside the source: its data keeps the source's
    # offset modulo a block, never the whole offset (a header padded by tens of MB).
    src = tmp_path / "model.safetensors"
    tensors = {f"layers.{i}.weight": torch.rand(64, 64) for i in range(48)}  # 16 KiB each
    save_file(tensors, src)
    convert(src, tmp_path / "hf", max_shard_size=200_000)
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) >= 4
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        with shard.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
        data = sum(t.numel() * t.element_size() for t in load_file(shard).values())
        assert header < 8 * 1024 and shard.stat().st_size == 8 + header + data
        loaded.update(load_file(shard))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_reshard_carries_no_metadata_that_names_a_tensor(tmp_path: Path) -> None:
    sd = _model_pt(tmp_path / "model.pt")
    convert(tmp_path / "model.pt", tmp_path / "hf", max_shard_size="2KB")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["metadata"].update({"big": name, "author": "someone"})
    index_path.write_text(json.dumps(index))
    reshard(tmp_path / "hf", tmp_path / "out", max_shard_size="2KB", verify="full")
    out = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "big" not in out["metadata"] and out["metadata"]["author"] == "someone"
    assert set(load_state_dict(tmp_path / "out")) == set(sd)


def test_an_inputs_stale_total_size_never_replaces_the_computed_one(tmp_path: Path) -> None:
    # The index's total_size is the tensors' bytes, an int, as huggingface_hub computes it,
    # whatever the input folder's index or the input file's metadata said.
    save_file({"a": torch.randn(3)}, tmp_path / "s1.safetensors", metadata={"format": "pt"})
    save_file({"b": torch.randn(4)}, tmp_path / "s2.safetensors", metadata={"format": "pt"})
    weight_map = {"a": "s1.safetensors", "b": "s2.safetensors"}
    (tmp_path / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": "999"}, "weight_map": weight_map})
    )
    both = {"a": torch.randn(3), "b": torch.randn(4)}
    save_file(both, tmp_path / "m.safetensors", metadata={"format": "pt", "total_size": "999"})
    reshard(tmp_path, tmp_path / "resharded", max_shard_size=12)
    convert(tmp_path / "m.safetensors", tmp_path / "converted", max_shard_size=12)
    for out in ("resharded", "converted"):
        index = json.loads((tmp_path / out / INDEX_NAME).read_text())
        assert index["metadata"] == {"total_size": 28}, out


def test_parse_shard_size_is_exact_however_long() -> None:
    # A size past any file means one shard; it is never rounded through a float.
    assert parse_shard_size("99999999999999999999999") == 99999999999999999999999
    assert parse_shard_size("1" + "0" * 320) == 10**320
    assert parse_shard_size("1" + "0" * 300 + "TiB") == 10**300 * 2**40
    assert parse_shard_size("1.5KiB") == 1536 and parse_shard_size(".5KB") == 500
    assert parse_shard_size("0.0015KB") == 1
    for bad in ("1e3", "inf", "nan", "0.0001KB"):
        with pytest.raises(UsageError, match="max_shard_size="):
            parse_shard_size(bad)


def test_a_folder_output_counts_gathered_views_as_written_not_copied(tmp_path: Path) -> None:
    # As a single .safetensors output says it: a transposed view is gathered, not copied.
    torch.save({"w": torch.randn(4, 8), "t": torch.randn(8, 4).t()}, tmp_path / "m.pt")
    one = convert(tmp_path / "m.pt", tmp_path / "m.safetensors")
    folder = convert(tmp_path / "m.pt", f"{tmp_path}/hf/")
    planned = convert(tmp_path / "m.pt", f"{tmp_path}/hf2/", dry_run=True)
    for result in (one, folder, planned):
        assert (result.bytes_written, result.bytes_copied) == (256, 128), result


def test_an_output_spelled_folder_dot_is_a_folder_output(tmp_path: Path) -> None:
    # Path("hf/.") is "hf": without the check a file named hf was written.
    torch.save({"w": torch.randn(3)}, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", f"{tmp_path}/hf/.")
    assert (tmp_path / "hf").is_dir()
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == {"w"}


@pytest.mark.parametrize("root", ["tensor", "list"])
def test_a_root_that_names_no_tensors_is_refused_for_a_folder_as_for_a_file(
    tmp_path: Path, root: str
) -> None:
    value = torch.arange(4.0) if root == "tensor" else [torch.ones(2), torch.zeros(3)]
    torch.save(value, tmp_path / "t.pt")
    for out in ("t.safetensors", "hf/"):
        with pytest.raises(ConversionError, match=f"holds a {root}, not a state dict"):
            convert(tmp_path / "t.pt", f"{tmp_path}/{out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.pt"]


def test_a_folder_output_takes_what_a_safetensors_file_takes(tmp_path: Path) -> None:
    # A pickled module gives up its recovered state dict (its classes are never written),
    # and --drop-extras leaves out a tree too deep for a torch output, as for one file.
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    torch.save(model, tmp_path / "module.pt")
    deep: list = []
    for _ in range(400):
        deep = [deep]
    torch.save({"state_dict": model.state_dict(), "deep": deep}, tmp_path / "deep.pt")
    for name, options in (("module", {}), ("deep", {"drop_extras": True})):
        convert(tmp_path / f"{name}.pt", tmp_path / f"{name}.safetensors", **options)
        convert(tmp_path / f"{name}.pt", str(tmp_path / f"{name}_hf") + "/", **options)
        want = load_file(tmp_path / f"{name}.safetensors")
        got = load_file(tmp_path / f"{name}_hf" / "model.safetensors")
        assert list(got) == list(want) == list(model.state_dict())
        assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_bare_tensor_to_a_folder_names_the_file_that_holds_it(tmp_path: Path) -> None:
    torch.save(torch.ones(3), tmp_path / "t.pt")
    _, _, err = run_ckpt("convert", tmp_path / "t.pt", f"{tmp_path}/shards/", code=7)
    assert "holds a tensor, not a state dict" in err
    assert err.rstrip().endswith("keep the torch format: write a .pt file, not a folder")
    assert not (tmp_path / "shards").exists()

"""Tied names our safetensors writers left out come back over one tensor, as torch.load gives them.

Our writers store tied tensors once and record ``{dropped name: kept name}`` twice: as the
hub-style notes other tools read, and in the reserved entry ``ckpt_tools.tied`` the reader
restores names from. Reading, loading, diffing, converting back and inspecting all see both
names. Every other file reads as ``safetensors.torch.load_file`` reads it: the notes
``save_model`` and huggingface_hub write (or any entry naming a tensor) stay plain metadata.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import load_state_dict_from_file, save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

import ckpt_tools as ct
from ckpt_tools.cli.main import main
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    torch.save(Tied().state_dict(), tmp_path / "plain.pt")
    return tmp_path / "plain.pt"


def _tied(sd: dict[str, torch.Tensor]) -> bool:
    return sd["head.weight"].untyped_storage().data_ptr() == sd["emb.weight"].data_ptr()


def _outputs(plain: Path) -> list[Path]:
    """The tied model as one safetensors file and as an HF folder, both written by us."""
    ct.convert(plain, plain.with_name("c.safetensors"))
    ct.convert(plain, plain.with_name("hf"), max_shard_size=100)
    assert "head.weight" not in load_file(plain.with_name("c.safetensors"))  # stored once
    return [plain.with_name("c.safetensors"), plain.with_name("hf")]


def test_load_state_dict_and_load_into_get_both_names(plain: Path) -> None:
    want = torch.load(plain, weights_only=True)
    for src in _outputs(plain):
        sd = ct.load_state_dict(src)
        assert list(sd) == list(want) and all(torch.equal(sd[k], want[k]) for k in want)
        assert _tied(sd), src
        sd, _ = ct.load_with_info(src)
        assert _tied(sd)
        model, oracle = Tied(), Tied()
        ct.load_into(model, src)
        if src.suffix == ".safetensors":
            load_model(oracle, src)  # safetensors' own reader of the same file
        else:
            oracle.load_state_dict(want)
        for key, value in oracle.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), key
        assert model.head.weight is model.emb.weight


def test_diff_convert_back_and_inspect_see_the_alias(
    plain: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    want = torch.load(plain, weights_only=True)
    for src in _outputs(plain):
        assert main(["diff", str(plain), str(src), "--fail-on", "any"]) == 0, src
        back = src.with_name(f"back-{src.stem}.pt")
        ct.convert(src, back, verify="full")
        got = torch.load(back, weights_only=True)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert _tied(got)  # one storage, as torch.save wrote it
        info = ct.inspect(src)
        shared = {t.name: t.shared_with for t in info.tensors}
        assert "emb.weight" in shared["head.weight"] and "head.weight" in shared["emb.weight"]
        storage = {t.name: t.storage for t in info.tensors}
        assert storage["head.weight"] == storage["emb.weight"]  # one storage, one label
        assert "head.weight" not in (info.metadata or {})  # a name now, not a note
    capsys.readouterr()


def test_save_model_files_read_as_load_file_reads_them(tmp_path: Path) -> None:
    # save_model's note is plain metadata to every reference loader; load_model ties the
    # name back from the model's own shared parameters, not from the file.
    torch.manual_seed(0)
    model = Tied()
    save_model(model, str(tmp_path / "m.safetensors"))
    sd = ct.load_state_dict(tmp_path / "m.safetensors")
    assert (
        set(sd)
        == set(load_file(tmp_path / "m.safetensors"))
        == {"emb.weight", "mid.weight", "mid.bias"}
    )
    ct.convert(tmp_path / "m.safetensors", tmp_path / "again.safetensors", verify="full")
    assert set(ct.load_state_dict(tmp_path / "again.safetensors")) == set(sd)
    again = Tied()
    load_model(again, tmp_path / "again.safetensors")
    assert all(
        torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values())
    )


def test_a_partial_view_is_written_as_its_own_tensor_not_an_alias(tmp_path: Path) -> None:
    # The metadata names the kept tensor, not a view of it: only a whole view is an alias.
    base = torch.randn(4, 3)
    torch.save({"a": base, "b": base[:2], "c": base}, tmp_path / "views.pt")
    want = torch.load(tmp_path / "views.pt", weights_only=True)
    for dst in ("v.safetensors", "hf/"):  # a trailing / names a folder output
        ct.convert(tmp_path / "views.pt", f"{tmp_path}/{dst}", verify="full")
        got = ct.load_state_dict(tmp_path / dst)
        assert (tmp_path / dst).is_dir() == dst.endswith("/")
        assert set(got) == set(want), dst
        for key, value in want.items():
            assert got[key].shape == value.shape and torch.equal(got[key], value), (dst, key)
        assert _tied({"head.weight": got["c"], "emb.weight": got["a"]}), dst


def test_the_reserved_entry_names_a_tie(tmp_path: Path) -> None:
    metadata = {
        "format": "pt",
        "head.weight": "emb.weight",
        "ckpt_tools.tied": '{"head.weight": "emb.weight"}',
    }
    save_file({"emb.weight": torch.ones(2)}, tmp_path / "m.safetensors", metadata=metadata)
    ckpt = open_checkpoint(str(tmp_path / "m.safetensors"))
    assert list(ckpt.root) == ["emb.weight", "head.weight"]
    assert ckpt.root["head.weight"] is ckpt.root["emb.weight"]
    assert ckpt.metadata == {"format": "pt"}


@pytest.mark.parametrize(
    "metadata",
    [
        {"emb.weight": "head.weight"},  # a stored name as key
        {"head.weight": "missing.weight"},  # a value that is no stored tensor
        {"head.weight": "emb"},  # a prefix of one is not one
        {"format": "emb.weight"},  # the writer's own key
        {"head.weight": "emb.weight"},  # a hub-style note without the reserved entry
        {"description": "emb.weight", "layer": "emb.weight"},  # text that names a tensor
    ],
    ids=["stored-key", "absent-value", "prefix-value", "format-key", "hub-note", "description"],
)
def test_anything_else_stays_plain_metadata(tmp_path: Path, metadata: dict[str, str]) -> None:
    save_file({"emb.weight": torch.ones(2)}, tmp_path / "m.safetensors", metadata=metadata)
    ckpt = open_checkpoint(str(tmp_path / "m.safetensors"))
    assert list(ckpt.root) == ["emb.weight"]
    assert ckpt.metadata == metadata
    assert list(ct.load_state_dict(tmp_path / "m.safetensors")) == ["emb.weight"]


@pytest.mark.parametrize(
    "entry",
    [
        "not json",
        '["head.weight"]',  # not an object
        '{"head.weight": 1}',  # not a name
        '{"head.weight": "missing.weight"}',  # no such stored tensor
        '{"emb.weight": "emb.weight"}',  # a stored name is not left out
    ],
)
def test_a_malformed_reserved_entry_is_refused(tmp_path: Path, entry: str) -> None:
    metadata = {"ckpt_tools.tied": entry}
    save_file({"emb.weight": torch.ones(2)}, tmp_path / "m.safetensors", metadata=metadata)
    with pytest.raises(CorruptCheckpointError, match=r"ckpt_tools\.tied"):
        open_checkpoint(str(tmp_path / "m.safetensors"))
    assert main(["inspect", str(tmp_path / "m.safetensors")]) == 4


def test_metadata_that_names_tensors_reads_and_converts_as_load_file(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    metadata = {"format": "pt", "description": "weight", "layer": "bias"}
    save_file({"weight": torch.randn(3, 3), "bias": torch.randn(3)}, src, metadata=metadata)
    assert sorted(ct.load_state_dict(src)) == sorted(load_file(src)) == ["bias", "weight"]
    for dst in ("m.pt", "c.safetensors", "hf/"):
        ct.convert(src, f"{tmp_path}/{dst}", verify="full")
        assert sorted(ct.load_state_dict(tmp_path / dst)) == ["bias", "weight"], dst
    # The metadata is carried into a safetensors output, and still names no tensor there.
    with safe_open(tmp_path / "c.safetensors", "pt") as f:
        assert f.metadata() == metadata
    assert sorted(load_file(tmp_path / "c.safetensors")) == ["bias", "weight"]


def test_hub_saved_tied_files_read_as_the_hub_loads_them(tmp_path: Path) -> None:
    emb = torch.randn(6, 4)
    sd = {"emb.weight": emb, "head.weight": emb, "mid.bias": torch.ones(4)}
    (tmp_path / "one").mkdir()
    (tmp_path / "sharded").mkdir()
    save_torch_state_dict(sd, tmp_path / "one")
    save_torch_state_dict(sd, tmp_path / "sharded", max_shard_size=100)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for folder in ("one", "sharded"):
        want: dict[str, torch.Tensor] = {}
        for shard in sorted((tmp_path / folder).glob("*.safetensors")):
            want.update(load_state_dict_from_file(shard))
        assert "head.weight" not in want
        got = ct.load_state_dict(tmp_path / folder)
        assert sorted(got) == sorted(want), folder
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_our_folder_output_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    ct.convert(tmp_path / "model.pt", f"{tmp_path}/out/", max_shard_size=2000, verify="full")
    # Our reader gives both names back from our reserved entry; transformers ties its own.
    assert _tied(
        {
            k.replace("transformer.wte", "emb").replace("lm_head", "head"): v
            for k, v in ct.load_state_dict(tmp_path / "out").items()
        }
    )
    config.save_pretrained(tmp_path / "out")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    want = model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())
    # A folder saved by transformers reads as its stored tensors: no lm_head.weight.
    stored = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert set(ct.load_state_dict(tmp_path / "hf")) == stored


@pytest.mark.parametrize("out", ["tied.safetensors", "hf/"])
def test_a_tie_named_like_a_metadata_entry_never_replaces_it(tmp_path: Path, out: str) -> None:
    # safetensors' save_model never overrides user data; a tensor named "format" is tied.
    w = torch.randn(3, 2)
    torch.save({"embed": w, "format": w}, tmp_path / "in.pt")
    ct.convert(tmp_path / "in.pt", f"{tmp_path}/{out}")
    path = tmp_path / out / "model.safetensors" if out.endswith("/") else tmp_path / out
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
    back = ct.load_state_dict(path if not out.endswith("/") else tmp_path / out)
    assert torch.equal(back["format"], w) and torch.equal(back["embed"], w)
    assert load_state_dict_from_file(path)  # huggingface_hub checks the format entry


@pytest.mark.parametrize("out", ["sorted.safetensors", "hf/", "one/"])
def test_a_sorted_state_dict_keeps_the_input_embedding_for_the_base_model(
    tmp_path: Path, out: str
) -> None:
    # Sorted, lm_head.weight comes first; transformers' save_pretrained keeps the embedding,
    # which the base model class (no head) loads too.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=8, intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    torch.save(dict(sorted(model.state_dict().items())), tmp_path / "sorted.pt")
    shard = {"hf/": 1000, "one/": None}.get(out)
    ct.convert(tmp_path / "sorted.pt", f"{tmp_path}/{out}", max_shard_size=shard)
    if out.endswith("/"):
        stored = {k for f in (tmp_path / out).glob("*.safetensors") for k in load_file(f)}
        config.save_pretrained(tmp_path / out)
        base = transformers.LlamaModel.from_pretrained(tmp_path / out)
        assert torch.equal(base.embed_tokens.weight, model.model.embed_tokens.weight)
    else:
        stored = set(load_file(tmp_path / out))
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored

"""Tied names a safetensors writer left out come back over one tensor, as torch.load gives them.

safetensors' ``save_model`` and our writers store tied tensors once and record
``{dropped name: kept name}`` in the metadata (a file's ``__metadata__``, an HF index's
``metadata``). Reading, loading, diffing, converting back and inspecting all see both names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

import ckpt_tools as ct
from ckpt_tools.cli.main import main
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


def test_save_model_files_read_the_same(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    save_model(model, str(tmp_path / "m.safetensors"))
    sd = ct.load_state_dict(tmp_path / "m.safetensors")
    assert set(sd) == set(model.state_dict()) and _tied(sd)
    # Rewritten to safetensors, the alias is written again and read back again.
    ct.convert(tmp_path / "m.safetensors", tmp_path / "again.safetensors", verify="full")
    assert set(load_file(tmp_path / "again.safetensors")) == set(
        load_file(tmp_path / "m.safetensors")
    )
    assert set(ct.load_state_dict(tmp_path / "again.safetensors")) == set(sd)


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


def test_the_alias_form_is_a_name_over_its_kept_tensor(tmp_path: Path) -> None:
    metadata = {"format": "pt", "head.weight": "emb.weight"}
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
    ],
    ids=["stored-key", "absent-value", "prefix-value", "format-key"],
)
def test_anything_else_stays_plain_metadata(tmp_path: Path, metadata: dict[str, str]) -> None:
    save_file({"emb.weight": torch.ones(2)}, tmp_path / "m.safetensors", metadata=metadata)
    ckpt = open_checkpoint(str(tmp_path / "m.safetensors"))
    assert list(ckpt.root) == ["emb.weight"]
    assert ckpt.metadata == metadata
    assert list(ct.load_state_dict(tmp_path / "m.safetensors")) == ["emb.weight"]

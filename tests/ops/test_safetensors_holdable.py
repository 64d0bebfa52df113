"""What a safetensors output cannot hold is refused alike by every command that writes one.

Conjugate and negative views, the reserved name ``__metadata__`` and tensors beside the state
dict go through one check while planning (a dry run refuses too); torch outputs carry the view
bits. Oracles: ``torch.load`` and ``safetensors.torch.load_file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError, NonTensorEntriesError, UsageError
from tests import helpers as h
from tests.helpers.lora import write_tiny_adapter


def _views() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "c": torch.randn(3, dtype=torch.complex64).conj(),
        "n": torch.randn(3)._neg_view(),
        "plain": torch.randn(2),
    }


@pytest.fixture
def views(tmp_path: Path) -> Path:
    return h.save(_views(), tmp_path / "views.pt")


@pytest.mark.parametrize(
    "args",
    [
        ["extract", "{src}", "{out}", "--prefix", "n"],
        ["extract", "{src}", "{out}", "--prefix", "c"],
        ["slim", "{src}", "{out}"],
        ["slim", "{src}", "{out}", "--weights-only"],
        ["slim", "{src}", "{out}", "--dry-run"],
        ["rename", "{src}", "{out}", "--sub", "plain=p"],
        ["convert", "{src}", "{out}", "--dry-run"],
    ],
    ids=["extract-neg", "extract-conj", "slim", "slim-weights-only", "slim-dry", "rename", "dry"],
)
def test_every_safetensors_output_refuses_a_view_bit(
    views: Path, tmp_path: Path, args: list[str]
) -> None:
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    code, _, err = h.run_ckpt(*(a.format(src=views, out=out) for a in args), code=None)
    assert code == 7, err
    assert "saved as a" in err and "view" in err and "resolve_" in err
    assert h.listing(out.parent) == []


def test_the_refusal_names_every_view_at_once(views: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError) as info:
        ct.slim(views, tmp_path / "o.safetensors")
    said = str(info.value)
    assert "tensor 'c' is saved as a conjugate view" in said
    assert "tensor 'n' is saved as a negative view" in said
    assert ".resolve_conj().resolve_neg()" in said
    assert not (tmp_path / "o.safetensors").exists()


def test_merge_lora_to_safetensors_refuses_a_view_bit(tmp_path: Path) -> None:
    sd = torch.load(h.FIXTURES / "plain.pt")
    sd["bn.running_mean"] = sd["bn.running_mean"].clone()._neg_view()  # copied, not merged
    base = h.save(sd, tmp_path / "model.pt")
    adapter = write_tiny_adapter(tmp_path / "lora")
    for dst in (str(tmp_path / "m.safetensors"), f"{tmp_path}/folder/"):  # a file, then shards
        with pytest.raises(ConversionError, match=r"'bn\.running_mean' is saved as a negative"):
            ct.merge_lora(base, adapter, dst)
        assert not Path(dst).exists()
    ct.merge_lora(base, adapter, tmp_path / "m.pt")  # a torch output carries the bit
    assert torch.load(tmp_path / "m.pt")["bn.running_mean"].is_neg()
    assert torch.equal(torch.load(tmp_path / "m.pt")["bn.running_mean"], sd["bn.running_mean"])


def test_a_merged_weight_saved_as_a_negative_view_names_the_merge(tmp_path: Path) -> None:
    sd = torch.load(h.FIXTURES / "plain.pt")
    sd["head.weight"] = sd["head.weight"].clone()._neg_view()
    base = h.save(sd, tmp_path / "model.pt")
    adapter = write_tiny_adapter(tmp_path / "lora")
    with pytest.raises(ConversionError, match="which a LoRA merge would take"):
        ct.merge_lora(base, adapter, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize(
    "run",
    [
        lambda src, out: ct.extract(src, out, prefix="n", select="sd"),
        lambda src, out: ct.extract(src, out, prefix="c", select="sd"),
        lambda src, out: ct.slim(src, out, weights_only=True),
        lambda src, out: ct.slim(src, out),
    ],
    ids=["extract-neg", "extract-conj", "slim-weights-only", "slim"],
)
def test_torch_outputs_of_extract_and_slim_carry_the_bits(tmp_path: Path, run: Any) -> None:
    src = h.save({"sd": _views(), "epoch": 3}, tmp_path / "nested.pt")
    out = tmp_path / "o.pt"
    run(src, out)
    got, want = torch.load(out), torch.load(src)["sd"]
    got = got.get("sd", got)
    for k, v in got.items():
        assert torch.equal(v.resolve_conj().resolve_neg(), want[k].resolve_conj().resolve_neg())
        assert (v.is_conj(), v.is_neg()) == (want[k].is_conj(), want[k].is_neg()), k


def test_a_cast_of_a_negative_view_is_refused_or_left_uncast(views: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="a cast to float16") as info:
        ct.slim(views, tmp_path / "o.pt", dtype="fp16")
    assert "keep 'n' in its dtype" in str(info.value)
    assert "torch output" not in str(info.value)  # a .pt output would not help a cast
    ct.slim(views, tmp_path / "o.pt", dtype="fp16", keep_dtype=["^n$"])
    got, src = torch.load(tmp_path / "o.pt"), torch.load(views)
    assert got["n"].is_neg() and torch.equal(got["n"], src["n"])
    assert torch.equal(got["plain"], src["plain"].to(torch.float16))
    assert got["c"].is_conj() and torch.equal(got["c"], src["c"])  # complex is never cast


# --- the reserved name ------------------------------------------------------------------------


@pytest.fixture
def reserved(tmp_path: Path) -> Path:
    return h.save({"__metadata__": torch.randn(2), "w": torch.randn(2)}, tmp_path / "mk.pt")


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "{src}", "{out}"],
        ["convert", "{src}", "{out}", "--dry-run"],
        ["slim", "{src}", "{out}"],
        ["extract", "{src}", "{out}", "--prefix", "__metadata__"],
        ["rename", "{src}", "{out}", "--sub", "w=v"],
    ],
    ids=["convert", "dry-run", "slim", "extract", "rename"],
)
def test_a_tensor_named_metadata_is_refused_before_writing(
    reserved: Path, tmp_path: Path, args: list[str]
) -> None:
    out = tmp_path / "out" / "o.safetensors"
    out.parent.mkdir()
    code, stdout, err = h.run_ckpt(*(a.format(src=reserved, out=out) for a in args), code=None)
    assert code == 7, (stdout, err)
    assert "reserves the name '__metadata__'" in err
    assert "run rename with --regex '^__metadata__$=NEW'" in err  # rename's option, not theirs
    assert "does not read back" not in err
    assert h.listing(out.parent) == []


def test_the_library_names_the_rename_that_fixes_it(reserved: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError) as info:
        ct.convert(reserved, tmp_path / "o.safetensors")
    said = str(info.value)
    assert "rules=[regex_rule('^__metadata__$', 'NEW')]" in said and "--" not in said
    # The fix it names works: the values are torch's, under the new name.
    ct.rename(reserved, tmp_path / "o.safetensors", rules=[ct.regex_rule("^__metadata__$", "m")])
    got, want = load_file(tmp_path / "o.safetensors"), torch.load(reserved)
    assert torch.equal(got["m"], want["__metadata__"]) and torch.equal(got["w"], want["w"])


def test_a_rename_onto_the_reserved_name_is_refused(tmp_path: Path) -> None:
    src = h.save({"meta": torch.randn(2)}, tmp_path / "in.pt")
    with pytest.raises(ConversionError, match="'__metadata__'"):
        ct.rename(src, tmp_path / "o.safetensors", rules=[ct.sub_rule("meta", "__metadata__")])
    assert h.listing(tmp_path) == ["in.pt"]


# --- extract's prefix, and entries beside the state dict ------------------------------------


def test_an_empty_prefix_is_a_usage_error_that_says_why(views: Path, tmp_path: Path) -> None:
    code, _, err = h.run_ckpt("extract", views, tmp_path / "o.pt", "--prefix", "", code=None)
    assert code == 2, err
    assert "would keep every key" in err and "no key starts with" not in err
    assert "--weights-only" in err
    with pytest.raises(UsageError, match="weights_only=True"):
        ct.extract(views, tmp_path / "o.pt", prefix="")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("command", ["convert", "slim"])
def test_a_tensor_beside_the_state_dict_is_named_as_one(tmp_path: Path, command: str) -> None:
    src = h.save(
        {"epoch": 3, "state_dict": {"w": torch.randn(2)}, "best_acc1": torch.tensor(71.5)},
        tmp_path / "best.pth.tar",
    )
    code, _, err = h.run_ckpt(command, src, tmp_path / "o.safetensors", code=None)
    assert code == 7, err
    assert "1 non-tensor entry: epoch" in err
    assert "1 tensor outside the state dict: best_acc1" in err
    with pytest.raises(NonTensorEntriesError) as info:
        ct.convert(src, tmp_path / "o.safetensors")
    assert info.value.entries == ("epoch", "best_acc1")
    ct.convert(src, tmp_path / "o.safetensors", drop_extras=True)
    assert torch.equal(
        load_file(tmp_path / "o.safetensors")["w"], torch.load(src)["state_dict"]["w"]
    )


def _tagged() -> dict[str, torch.Tensor]:
    tagged = torch.arange(3.0)
    tagged.note = "pruned"  # torch.load gives it back; a safetensors file cannot hold it
    flagged = torch.nn.Parameter(torch.ones(2))
    flagged._is_hf_initialized = True  # as transformers' from_pretrained sets on each one
    return {"tagged": tagged, "flagged": flagged, "plain": torch.zeros(2)}


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "{src}", "{out}"],
        ["convert", "{src}", "{folder}"],
        ["rename", "{src}", "{out}", "--sub", "plain=p"],
        ["slim", "{src}", "{out}"],
        ["extract", "{src}", "{out}", "--prefix", "tagged"],
    ],
    ids=["convert", "folder", "rename", "slim", "extract"],
)
def test_tensor_attributes_are_left_out_and_listed(tmp_path: Path, args: list[str]) -> None:
    # A library's flags sit on every parameter it loaded: listed, never a refusal.
    src = h.save(_tagged(), tmp_path / "tagged.pt")
    assert torch.load(src)["tagged"].note == "pruned"
    out, folder = tmp_path / "out" / "o.safetensors", tmp_path / "out" / "shards"
    out.parent.mkdir()
    code, said, err = h.run_ckpt(
        *(a.format(src=src, out=out, folder=f"{folder}/") for a in args), code=None
    )
    assert code == 0, err
    assert "tagged.note" in said  # named among what was left out
    files = [out] if out.exists() else sorted(folder.glob("*.safetensors"))
    written = {k: v for f in files for k, v in load_file(f).items()}
    assert torch.equal(written["tagged"], torch.arange(3.0))


def test_the_library_lists_every_attribute_and_a_torch_output_keeps_them(tmp_path: Path) -> None:
    src = h.save(_tagged(), tmp_path / "tagged.pt")
    result = ct.convert(src, tmp_path / "o.safetensors")
    assert {"tagged.note", "flagged._is_hf_initialized"} <= set(result.dropped)
    assert sorted(load_file(tmp_path / "o.safetensors")) == ["flagged", "plain", "tagged"]
    ct.convert(src, tmp_path / "o.pt")
    back = torch.load(tmp_path / "o.pt")
    assert back["tagged"].note == "pruned" and back["flagged"]._is_hf_initialized

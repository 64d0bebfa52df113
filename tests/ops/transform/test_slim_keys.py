"""``slim`` and ``extract`` keep state-dict keys as ``torch.load`` gives them: ``1`` and ``"1"``
are two keys, a tuple stays a tuple; safetensors, which names tensors by strings, refuses
tensors under other keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError
from tests.helpers.cli import run_ckpt


def _mixed(path: Path) -> dict:
    sd = {
        "a": torch.tensor([1.0, 2.0]),
        1: torch.tensor([3.0, 4.0]),
        "1": torch.tensor([9.0]),
        (2, "x"): torch.tensor([5.0]),
        "n": 3,
    }
    torch.save(sd, path)
    return torch.load(path, weights_only=True)


def _same(got: dict, want: dict) -> None:
    assert [(type(k), k) for k in got] == [(type(k), k) for k in want]
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v


def test_slim_keeps_non_str_keys_and_their_tensors(tmp_path: Path) -> None:
    want = _mixed(tmp_path / "in.pt")
    result = run_ckpt("slim", str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), code=None)
    assert result.returncode == 0, result.stdout + result.stderr
    _same(torch.load(tmp_path / "out.pt", weights_only=True), want)
    assert "verified: 4 tensors" in (result.stdout + result.stderr)


def test_slim_casts_tensors_under_non_str_keys(tmp_path: Path) -> None:
    want = _mixed(tmp_path / "in.pt")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype="bf16", verify="full")
    cast = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    _same(torch.load(tmp_path / "out.pt", weights_only=True), cast)


@pytest.mark.parametrize("drop_extras", [False, True])
def test_slim_to_safetensors_refuses_tensors_under_non_str_keys(
    tmp_path: Path, drop_extras: bool
) -> None:
    _mixed(tmp_path / "in.pt")
    out = tmp_path / "out.safetensors"
    with pytest.raises(ConversionError, match=r"1, \(2, 'x'\)"):
        ct.slim(tmp_path / "in.pt", out, weights_only=True, drop_extras=drop_extras)
    assert not out.exists()


def test_extract_leaves_non_str_keys_out_never_as_strings(tmp_path: Path) -> None:
    torch.save(
        {1: torch.ones(2), "1.w": torch.zeros(1), (2, "x"): torch.ones(1)}, tmp_path / "k.pt"
    )
    result = run_ckpt(
        "extract", str(tmp_path / "k.pt"), str(tmp_path / "x.pt"), "--prefix", "1", code=None
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _same(torch.load(tmp_path / "x.pt", weights_only=True), {"1.w": torch.zeros(1)})
    assert "left out: 1, (2, 'x')" in (result.stdout + result.stderr)


def test_extract_from_an_empty_state_dict_says_it_has_no_keys(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "e.pt")
    result = run_ckpt(
        "extract", str(tmp_path / "e.pt"), str(tmp_path / "x.pt"), "--prefix", "e", code=None
    )
    assert result.returncode == 2
    assert "no key lies under 'e'; the state dict has no string keys" in (
        result.stdout + result.stderr
    )


def test_slim_drop_named_twice_is_said_once(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.ones(1)}, "optimizer": {"lr": 0.1}}, tmp_path / "d.pt")
    result = run_ckpt(
        "slim",
        str(tmp_path / "d.pt"),
        str(tmp_path / "y.pt"),
        "--drop",
        "optimizer,optimizer",
        code=None,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "left out: optimizer\n" in (result.stdout + result.stderr)
    assert list(torch.load(tmp_path / "y.pt", weights_only=True)) == ["model"]


def _none_keyed(path: Path) -> dict:
    torch.save({None: torch.tensor([1.0, 2.0]), "w": torch.tensor([3.0])}, path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("options", [(), ("--dtype", "bf16")])
def test_slim_keeps_a_tensor_under_the_key_none(tmp_path: Path, options: tuple) -> None:
    want = _none_keyed(tmp_path / "in.pt")
    result = run_ckpt("slim", str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), *options)
    if options:
        want = {k: v.to(torch.bfloat16) for k, v in want.items()}
    _same(torch.load(tmp_path / "out.pt", weights_only=True), want)
    assert "left out" not in result.stdout + result.stderr


def test_average_keeps_a_tensor_under_the_key_none(tmp_path: Path) -> None:
    want = _none_keyed(tmp_path / "a.pt")
    _none_keyed(tmp_path / "b.pt")
    ct.average([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "m.pt")
    _same(torch.load(tmp_path / "m.pt", weights_only=True), want)


def test_extract_names_a_left_out_none_key(tmp_path: Path) -> None:
    _none_keyed(tmp_path / "in.pt")
    result = run_ckpt("extract", str(tmp_path / "in.pt"), str(tmp_path / "x.pt"), "--prefix", "w")
    assert "left out: None" in result.stdout + result.stderr
    assert list(torch.load(tmp_path / "x.pt", weights_only=True)) == ["w"]


def test_json_rows_name_keys_of_every_type_as_text(tmp_path: Path) -> None:
    _mixed(tmp_path / "in.pt")
    torch.save({None: torch.ones(1), **torch.load(tmp_path / "in.pt")}, tmp_path / "in.pt")
    result = run_ckpt("slim", str(tmp_path / "in.pt"), str(tmp_path / "o.pt"), "--json")
    rows = json.loads(result.stdout)["rows"]
    assert [(r["source_key"], r["key"]) for r in rows] == [
        (k, k) for k in ["None", "a", "1", "1", "(2, 'x')"]
    ]


def test_entries_dropped_by_name_are_not_refused_for_a_safetensors_output(tmp_path: Path) -> None:
    # --drop removes them before safetensors' no-extras rule is checked: the output is the
    # state dict alone, and each dropped entry is listed once.
    sd = torch.nn.Linear(4, 2).state_dict()
    src = tmp_path / "trainer.pt"
    torch.save({"model": sd, "optimizer": {"param_groups": [{"lr": 0.1}]}, "epoch": 3}, src)
    result = ct.slim(src, tmp_path / "w.safetensors", drop=["optimizer", "epoch"])
    assert sorted(result.dropped) == ["epoch", "optimizer"]
    got = load_file(tmp_path / "w.safetensors")
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    both = ct.slim(src, tmp_path / "w2.safetensors", drop=["optimizer"], drop_extras=True)
    assert sorted(both.dropped) == ["epoch", "optimizer"]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_slim_drop_leaves_entries_of_a_root_state_dict_out_of_the_file(
    tmp_path: Path, suffix: str
) -> None:
    sd = dict(torch.nn.Linear(2, 2).state_dict())
    torch.save({**sd, "epoch": 5, "optimizer": {"state": {}}}, tmp_path / "flat.pt")
    out = tmp_path / f"out{suffix}"
    drop = ["epoch", "optimizer"] if suffix == ".pt" else ["epoch,optimizer", "bias"]
    result = ct.slim(tmp_path / "flat.pt", out, drop=drop)
    got = torch.load(out, weights_only=True) if suffix == ".pt" else load_file(out)
    want = sd if suffix == ".pt" else {"weight": sd["weight"]}
    _same(got, want)
    assert set(result.dropped) == {n for part in drop for n in part.split(",")}


def test_slim_drop_names_a_top_level_key_that_is_not_a_str_by_its_text(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(1)}, 7: "junk"}, tmp_path / "in.pt")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", drop=["7"])
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == ["state_dict"]
    res = run_ckpt("slim", tmp_path / "in.pt", tmp_path / "x.pt", "--drop", "8", code=2)
    assert "cannot drop 8: the checkpoint's top-level entries are 'state_dict', 7" in res.stderr


def test_slim_casts_a_storage_a_dropped_attribute_also_views(tmp_path: Path) -> None:
    # The cast tensor loses its attributes, as .half() does: they hold nothing back.
    base = torch.arange(8.0)
    w = torch.ones(2, 3)
    w.alias = base[2:5]
    torch.save({"w": w, "base": base}, tmp_path / "in.pt")
    result = ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype="float16")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k: v.dtype for k, v in out.items()} == {"w": torch.float16, "base": torch.float16}
    assert torch.equal(out["base"], base.half()) and result.bytes_written == 12 + 16

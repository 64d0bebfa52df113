"""``average`` keeps every key ``torch.load`` gives (``7`` as well as ``"a"``), and never copies
one input's value for another's that differs: quantizer parameters and view bits count, as
``torch.equal`` counts them, and a tensor in one input against a non-tensor in another, or
differing non-tensor entries, are refused (exit 7) unless ``ints`` names the input to take."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError
from tests.helpers.cli import run_ckpt


def _save(path: Path, sd: dict) -> str:
    torch.save(sd, path)
    return str(path)


def _average(tmp_path: Path, a: dict, b: dict, *extra: str) -> tuple[int, str, Path]:
    out = tmp_path / "avg.pt"
    args = [_save(tmp_path / "a.pt", a), _save(tmp_path / "b.pt", b), str(out), *extra]
    code, stdout, stderr = run_ckpt("average", *args, code=None)
    return code, stdout + stderr, out


def test_average_keeps_non_str_keys(tmp_path: Path) -> None:
    code, output, out = _average(
        tmp_path,
        {"a": torch.tensor([1.0]), 7: torch.tensor([2.0]), (1, "t"): torch.tensor([1, 2])},
        {"a": torch.tensor([2.0]), 7: torch.tensor([19.0]), (1, "t"): torch.tensor([1, 2])},
    )
    assert code == 0, output
    got = torch.load(out, weights_only=True)
    assert [(type(k), k) for k in got] == [(str, "a"), (int, 7), (tuple, (1, "t"))]
    assert torch.equal(got[7], (torch.tensor([2.0]) + torch.tensor([19.0])) / 2)
    assert torch.equal(got[(1, "t")], torch.tensor([1, 2]))


def test_average_names_a_non_str_key_missing_in_one_input(tmp_path: Path) -> None:
    code, output, out = _average(
        tmp_path, {"a": torch.ones(1), 7: torch.ones(1)}, {"a": torch.ones(1)}
    )
    assert code == 7 and "- int key 7 (missing in b.pt)" in output
    assert not out.exists()
    # The int 1 and the string "1" read alike: each is named with its type.
    code, output, out = _average(tmp_path, {1: torch.ones(1)}, {"1": torch.ones(1)})
    assert code == 7 and "- int key 1 (missing in b.pt); + 1 (only in b.pt)" in output


def test_average_to_safetensors_refuses_tensors_under_non_str_keys(tmp_path: Path) -> None:
    a = _save(tmp_path / "a.pt", {"a": torch.ones(1), 7: torch.ones(1)})
    b = _save(tmp_path / "b.pt", {"a": torch.ones(1), 7: torch.ones(1)})
    with pytest.raises(ConversionError, match="under other keys: 7"):
        ct.average([a, b], tmp_path / "avg.safetensors")


def _quantized(scale: float, zero_point: int) -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated, still loaded
        warnings.simplefilter("ignore")
        ints = torch.tensor([1, 2, 3], dtype=torch.int8)
        return torch._make_per_tensor_quantized_tensor(ints, scale, zero_point)


def _per_channel(scales: list[float]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ints = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)
        scale = torch.tensor(scales, dtype=torch.float64)
        return torch._make_per_channel_quantized_tensor(
            ints, scale, torch.zeros(2, dtype=torch.long), 0
        )


@pytest.mark.parametrize(
    ("qa", "qb"),
    [
        (lambda: _quantized(0.1, 0), lambda: _quantized(0.5, 0)),
        (lambda: _quantized(0.1, 0), lambda: _quantized(0.1, 2)),
        (lambda: _per_channel([0.5, 0.25]), lambda: _per_channel([0.5, 0.125])),
    ],
    ids=["scale", "zero-point", "per-channel-scales"],
)
def test_average_refuses_quantized_tensors_whose_quantizers_differ(
    tmp_path: Path, qa: Any, qb: Any
) -> None:
    a, b = qa(), qb()
    assert torch.equal(a, qa()) and not torch.equal(a, b)
    code, output, out = _average(tmp_path, {"q": a}, {"q": qa()})  # equal: copied
    assert code == 0, output
    assert torch.equal(torch.load(out, weights_only=True)["q"], a)
    out.unlink()
    code, output, out = _average(
        tmp_path, {"q": a, "w": torch.ones(1)}, {"q": b, "w": torch.ones(1)}
    )
    assert code == 7 and "q (qint8)" in output, output
    assert not out.exists()


def test_average_refuses_an_integer_tensor_that_is_a_negative_view_in_one_input(
    tmp_path: Path,
) -> None:
    a, b = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])._neg_view()
    code, output, out = _average(tmp_path, {"i": a}, {"i": b})
    loaded = torch.load(tmp_path / "b.pt", weights_only=True)["i"]
    assert not torch.equal(a, loaded)
    assert code == 7 and "i (int64)" in output and "negative view" in output, output
    assert not out.exists()


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (torch.tensor([1.0, 2.0]), 1.5),
        (torch.tensor([1, 2]), 1.5),
        (1.5, torch.tensor([1.0, 2.0])),
    ],
    ids=["float-tensor-then-float", "int-tensor-then-float", "float-then-tensor"],
)
def test_average_refuses_a_key_that_is_a_tensor_in_one_input_only(
    tmp_path: Path, first: Any, second: Any
) -> None:
    code, output, out = _average(tmp_path, {"w": first}, {"w": second})
    assert code == 7, output
    assert "~ w:" in output and "a float, not a tensor," in output and "b.pt" in output
    assert not out.exists()


def test_average_refuses_differing_non_tensor_entries(tmp_path: Path) -> None:
    extra = {"cfg": {"depth": 2, "names": ["a", float("nan")]}, "n": None}
    a, b = {"w": torch.ones(1), "scale": 1.0, **extra}, {"w": torch.ones(1), "scale": 3.0, **extra}
    code, output, out = _average(tmp_path, a, b)
    assert code == 7 and "non-tensor entries differ across inputs: scale (float);" in output
    assert not out.exists()


def test_a_dict_in_another_order_is_the_same_entry_an_ordered_one_is_not(tmp_path: Path) -> None:
    # As torch.load's values compare: {"lr": .1, "bs": 8} == {"bs": 8, "lr": .1}.
    a = {"w": torch.ones(1), "cfg": {"lr": 0.1, "bs": 8}}
    b = {"w": torch.ones(1), "cfg": {"bs": 8, "lr": 0.1}}
    code, output, out = _average(tmp_path, a, b)
    assert code == 0, output
    assert torch.load(out, weights_only=True)["cfg"] == {"lr": 0.1, "bs": 8}
    a["cfg"], b["cfg"] = OrderedDict(a["cfg"]), OrderedDict(b["cfg"])
    assert a["cfg"] != b["cfg"]
    out.unlink()
    code, output, out = _average(tmp_path, a, b)
    assert code == 7 and "non-tensor entries differ across inputs: cfg (OrderedDict)" in output


def test_average_takes_differing_non_tensor_entries_from_the_input_ints_names(
    tmp_path: Path,
) -> None:
    extra = {"cfg": {"depth": 2, "names": ["a", float("nan")]}, "n": None}
    a, b = {"w": torch.ones(1), "scale": 1.0, **extra}, {"w": torch.ones(1), "scale": 3.0, **extra}
    for ints, want in (("last", 3.0), ("first", 1.0)):
        code, output, out = _average(tmp_path, a, b, "--ints", ints)
        assert code == 0, output
        got = torch.load(out, weights_only=True)
        assert got["scale"] == want and got["n"] is None and got["cfg"]["depth"] == 2
        out.unlink()


@pytest.mark.parametrize("ints", [None, "last"])
def test_a_differing_entry_holding_tensors_is_offered_the_first_input_only(
    tmp_path: Path, ints: str | None
) -> None:
    # The output's tensors are the first input's: the last input's entry cannot be taken.
    a = {"w": torch.zeros(2), "extra": {"seen": torch.tensor(0)}}
    b = {"w": torch.ones(2), "extra": {"seen": torch.tensor(1)}}
    code, output, out = _average(tmp_path, a, b, *(("--ints", ints) if ints else ()))
    assert code == 7 and "entries holding tensors differ across inputs" in output
    assert "taken): extra (dict)" in output
    assert "--ints first" in output and "--ints last" not in output, output
    assert not out.exists()
    code, output, out = _average(tmp_path, a, b, "--ints", "first")
    assert code == 0, output
    assert torch.load(out, weights_only=True)["extra"]["seen"] == 0


def test_only_remedies_the_next_run_accepts_are_offered(tmp_path: Path) -> None:
    # An integer tensor and an entry holding tensors differ: --ints last fails on the entry.
    a = {"w": torch.zeros(2), "step": torch.tensor(1), "extra": {"ids": torch.tensor([1])}}
    b = {"w": torch.ones(2), "step": torch.tensor(2), "extra": {"ids": torch.tensor([2])}}
    code, output, out = _average(tmp_path, a, b)
    assert code == 7 and "--ints first" in output and "--ints last" not in output, output
    code, output, out = _average(tmp_path, a, b, "--ints", "first")
    assert code == 0, output
    out.unlink()
    # An entry viewing an averaged storage cannot be taken from any input: no --ints at all.
    p, q = torch.zeros(3), torch.ones(3)
    code, output, out = _average(tmp_path, {"w": p, "meta": {"a": p}}, {"w": q, "meta": {"a": q}})
    assert code == 7 and "shares a storage with w, which is averaged" in output, output
    assert "--ints" not in output and ".clone()" in output


def test_an_entry_taken_from_one_input_that_shares_an_averaged_storage_is_refused(
    tmp_path: Path,
) -> None:
    # torch's {**first, "w": mean} keeps the first input's tensor under "extra", no longer
    # tied to "w"; one storage cannot hold both, and writing the mean there is no one's value.
    p, q = torch.zeros(3), torch.ones(3)
    code, output, out = _average(
        tmp_path, {"w": p, "extra": {"ref": p}}, {"w": q, "extra": {"ref": q}}, "--ints", "first"
    )
    assert code == 7, output
    assert "extra (shares a storage with w, which is averaged)" in output, output
    assert "clone()" in output and not out.exists()
    # An entry of its own storage is taken as it was.
    code, output, out = _average(
        tmp_path,
        {"w": p, "extra": {"ref": p.clone()}},
        {"w": q, "extra": {"ref": q.clone()}},
        "--ints",
        "first",
    )
    assert code == 0, output
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["extra"]["ref"], p) and torch.equal(got["w"], (p + q) / 2)


def test_a_mean_of_a_negative_view_is_refused_with_the_fix_that_works(tmp_path: Path) -> None:
    # A torch output would not keep the bit through a mean: resolving the view is the fix.
    a, b = torch.tensor([1.0, 2.0])._neg_view(), torch.tensor([3.0, 4.0])._neg_view()
    code, output, out = _average(tmp_path, {"w": a}, {"w": b})
    assert code == 7 and "'w' is saved as a negative view" in output, output
    assert "torch output" not in output and output.rstrip().endswith(
        "load it, call .resolve_neg() and save that"
    ), output
    assert not out.exists()


def test_tensors_with_no_mean_that_differ_name_a_fix_that_runs(tmp_path: Path) -> None:
    # A pruning mask (bool) differs: slim --drop leaves it out of each input, then they
    # average. Nested one level down, no command drops one key: no command is named.
    def sd(seed: int) -> dict:
        torch.manual_seed(seed)
        return {"blocks.0.weight": torch.randn(3), "blocks.0.mask": torch.rand(3) > 0.5}

    a, b = sd(0), sd(1)
    assert not torch.equal(a["blocks.0.mask"], b["blocks.0.mask"])
    code, output, out = _average(tmp_path, a, b)
    assert code == 7 and "blocks.0.mask (bool)" in output, output
    assert "ckpt slim IN OUT --drop blocks.0.mask" in output and "extract" not in output
    for name in ("a", "b"):
        src, dst = tmp_path / f"{name}.pt", tmp_path / f"{name}-.pt"
        run_ckpt("slim", src, dst, "--drop", "blocks.0.mask")
    run_ckpt("average", tmp_path / "a-.pt", tmp_path / "b-.pt", out)
    assert list(torch.load(out, weights_only=True)) == ["blocks.0.weight"]
    out.unlink()
    code, output, out = _average(tmp_path, {"model": a, "epoch": 1}, {"model": b, "epoch": 1})
    assert code == 7 and "blocks.0.mask (bool)" in output, output
    assert "--drop" not in output and "extract" not in output
    assert "leave the tensors with no mean out of each input's state dict" in output


def test_a_sparse_or_meta_tensor_against_a_dense_one_is_named_as_such(tmp_path: Path) -> None:
    dense = {"w": torch.randn(3, 4), "m": torch.randn(3)}
    other = {"w": torch.randn(3, 4).to_sparse(), "m": torch.empty(3, device="meta")}
    code, output, out = _average(tmp_path, dense, other)
    assert code == 7 and not out.exists()
    assert "~ w: float32 [3, 4] in a.pt, float32 [3, 4] sparse_coo in b.pt" in output
    assert "~ m: float32 [3] in a.pt, float32 [3] meta in b.pt" in output

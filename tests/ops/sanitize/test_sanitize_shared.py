"""``sanitize`` on objects the pickle holds in several places (its memo).

torch.save pickles an object stored twice once and refers back to it the second time. Every
place where a dropped object stood must be listed, and must hold in the output what the first
place holds (a dict entry removed, a list or tuple item None); kept values, tensors and
containers stay shared as ``torch.load`` shares them. The oracle is ``torch.load`` of the input
(``weights_only=False``: the class below is importable) against ``torch.load(weights_only=True)``
of the output, place by place.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct


class Custom:
    """A class outside the allowlist: sanitize drops its objects."""

    def __init__(self, value: int) -> None:
        self.value = value


def _at(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _custom_places(tree: Any, path: str = "") -> list[str]:
    """Every place in ``tree`` (as torch.load gave it) where a Custom object stands."""
    if isinstance(tree, Custom):
        return [path]
    if isinstance(tree, dict):
        items: Any = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [p for key, value in items for p in _custom_places(value, _at(path, key))]


def _assert_kept_or_dropped(got: Any, want: Any, where: str = "") -> None:
    """``got`` is ``want`` with each Custom object left out: dict entries gone, items None."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert type(got) is dict, where
        kept = [k for k, v in want.items() if not isinstance(v, Custom)]
        assert list(got) == kept, where
        for key in kept:
            _assert_kept_or_dropped(got[key], want[key], _at(where, key))
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            if isinstance(b, Custom):
                assert a is None, _at(where, i)
            else:
                _assert_kept_or_dropped(a, b, _at(where, i))
    else:
        assert got == want and type(got) is type(want), where


def _sanitized(tree: dict[str, Any], tmp_path: Path) -> tuple[Any, Any, ct.SanitizeResult]:
    """(the input as torch.load reads it, the output read with weights_only, the report)."""
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(tree, src)
    report = ct.sanitize(src, dst)
    want = torch.load(src, weights_only=False)
    return want, torch.load(dst, weights_only=True), report


def _layout(name: str) -> dict[str, Any]:
    obj, w = Custom(1), torch.arange(4.0)
    if name == "dict":
        return {"a": obj, "b": obj, "w": w}
    if name == "list":
        return {"l": [obj, 1, obj], "w": w}
    if name == "dict_and_list":
        return {"a": obj, "l": [0, obj], "w": w}
    if name == "nested_dict":
        return {"outer": {"inner": {"x": obj, "keep": 2}}, "y": obj, "w": w}
    if name == "tuple":
        return {"t": (obj, "kept"), "u": (1, obj), "w": w}
    shared = {"obj": obj, "w": w} if name == "shared_dict" else [obj, w]
    return {"a": shared, "b": {"again": shared}, "c": obj}


LAYOUTS = ["dict", "list", "dict_and_list", "nested_dict", "tuple", "shared_dict", "shared_list"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_place_of_a_dropped_object_is_listed(name, tmp_path):
    want, got, report = _sanitized(_layout(name), tmp_path)
    places = _custom_places(want)
    assert len(places) >= 2
    assert sorted(report.dropped) == sorted(places)
    assert all(c.was.endswith("Custom object") for c in report.dropped_values)
    _assert_kept_or_dropped(got, want)


@pytest.mark.parametrize("name", ["shared_dict", "shared_list"])
def test_a_kept_container_held_twice_stays_shared(name, tmp_path):
    want, got, report = _sanitized(_layout(name), tmp_path)
    assert want["a"] is want["b"]["again"]
    assert got["a"] is got["b"]["again"]
    inner = "a.obj" if name == "shared_dict" else "a.0"
    assert inner in report.dropped and inner.replace("a.", "b.again.") in report.dropped


def test_refusal_names_every_place(tmp_path):
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(_layout("dict_and_list"), src)
    with pytest.raises(ct.UnsafeContentError, match=r"2 value\(s\).*a: .*l\.1: ") as e:
        ct.sanitize(src, dst, refuse_unsafe=True)
    assert e.value.globals == (f"{__name__}.Custom",) and not dst.exists()


def test_memoized_plain_values_and_tied_tensors_are_kept_everywhere(tmp_path):
    text, pair, w = "a string long enough to be memoized", ("x", 1, 2.5), torch.ones(3)
    tree = {"s1": text, "s2": text, "t1": pair, "t2": [pair], "w1": w, "n": {"w2": w}}
    want, got, report = _sanitized(tree, tmp_path)
    assert report.dropped == () and report.converted == ()
    _assert_kept_or_dropped(got, want)
    assert got["w1"].untyped_storage().data_ptr() == got["n"]["w2"].untyped_storage().data_ptr()


def test_a_converted_object_held_twice_is_listed_in_both_places(tmp_path):
    args = argparse.Namespace(lr=0.1, layers=[1, 2])
    want, got, report = _sanitized({"args": args, "hp": {"args": args}}, tmp_path)
    assert [c.path for c in report.converted] == ["args", "hp.args"]
    assert got["args"] == {"lr": 0.1, "layers": [1, 2]} and got["args"] is got["hp"]["args"]
    assert want["args"] is want["hp"]["args"]


class Tagged(torch.Tensor):
    """A tensor subclass: sanitize writes its tensors as plain ones, on the same storage."""


@pytest.mark.parametrize("verify", ["sizes", "full"])
def test_tensor_subclasses_stay_on_the_storage_they_share(tmp_path: Path, verify: str) -> None:
    base = torch.randn(4, 4)
    saved = {
        "a": base,
        "s": base[1:].as_subclass(Tagged),
        "t": base[:2].as_subclass(Tagged),
        "list": [base[3].as_subclass(Tagged)],
    }
    torch.save(saved, tmp_path / "sub.pt")
    oracle = torch.load(tmp_path / "sub.pt", weights_only=False)
    ct.sanitize(tmp_path / "sub.pt", tmp_path / "out.pt", verify=verify)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    ptr = out["a"].untyped_storage().data_ptr()
    for got, want in (
        (out["s"], oracle["s"]),
        (out["t"], oracle["t"]),
        (out["list"][0], oracle["list"][0]),
    ):
        assert type(got) is torch.Tensor and torch.equal(got, want.as_subclass(torch.Tensor))
        assert got.untyped_storage().data_ptr() == ptr

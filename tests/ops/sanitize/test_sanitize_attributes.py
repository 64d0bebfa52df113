"""``sanitize`` and what a tensor carries besides its values: Python attributes set on it
(``t.note = ...``), made plain as any other value, never dropped silently; a tensor subclass
among them; and dict keys that become equal once made plain.

The oracle is ``torch.load``: ``weights_only=False`` on the input (the attributes as saved),
``weights_only=True`` on the output.
"""

from __future__ import annotations

import pathlib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import ckpt_tools as ct
from tests.helpers.cli import run_ckpt
from tests.helpers.files import module_from_source

SUBCLASS = """
import torch


class Tagged(torch.Tensor):
    pass


class Slotted(torch.Tensor):
    __slots__ = ("tag",)
"""


@pytest.fixture
def tagged(tmp_path: Path) -> Iterator[ModuleType]:
    """A module with a tensor subclass, importable while the test saves, gone when it reads."""
    with module_from_source(tmp_path / "src", "tagged_tensors", SUBCLASS) as module:
        yield module


def test_a_tensors_attributes_are_kept_and_made_plain(tmp_path: Path) -> None:
    w = torch.ones(2)
    w.note, w.scale = "keep me", np.float32(2.0)
    p = torch.nn.Parameter(torch.ones(3))
    p.mask = np.zeros(3)
    torch.save({"w": w, "p": p}, tmp_path / "in.pt")
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt", refuse_unsafe=True)
    assert sorted(c.path for c in result.converted) == ["p.mask", "w.scale"]
    assert not result.dropped_values
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["w"].__dict__ == {"note": "keep me", "scale": 2.0}
    assert isinstance(out["p"], torch.nn.Parameter)
    assert torch.equal(out["p"].mask, torch.zeros(3, dtype=torch.float64))


def test_the_attributes_of_a_tensor_made_plain_are_listed_as_dropped(
    tagged: ModuleType, tmp_path: Path
) -> None:
    t = torch.ones(2).as_subclass(tagged.Tagged)
    t.note = "lost with its class"
    torch.save({"w": t}, tmp_path / "in.pt")
    _, _, err = run_ckpt("sanitize", tmp_path / "in.pt", tmp_path / "strict.pt", "--strict", code=3)
    assert "w.note: an attribute of a tensor made plain -> dropped" in err
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt")
    assert [c.path for c in result.dropped_values] == ["w.note"]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert type(out["w"]) is torch.Tensor and torch.equal(out["w"], torch.ones(2))


def test_a_slotted_subclass_lists_its_slots_and_its_dict_as_dropped(
    tagged: ModuleType, tmp_path: Path
) -> None:
    # Pickled as a (dict, slots) pair of states, which torch._utils._set_obj_state sets both.
    t = torch.ones(2).as_subclass(tagged.Slotted)
    t.tag, t.note = "in a slot", "in the dict"
    torch.save({"w": t}, tmp_path / "in.pt")
    assert torch.load(tmp_path / "in.pt", weights_only=False)["w"].tag == "in a slot"
    _, _, err = run_ckpt("sanitize", tmp_path / "in.pt", tmp_path / "strict.pt", "--strict", code=3)
    assert "w.tag: an attribute of a tensor made plain -> dropped" in err
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt")
    assert sorted(c.path for c in result.dropped_values) == ["w.note", "w.tag"]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert type(out["w"]) is torch.Tensor and torch.equal(out["w"], torch.ones(2))


def test_a_tensor_subclass_held_in_an_attribute_is_made_plain(
    tagged: ModuleType, tmp_path: Path
) -> None:
    w = torch.ones(2)
    w.aux = torch.full((1,), 7.0).as_subclass(tagged.Tagged)
    torch.save({"w": w}, tmp_path / "in.pt")
    dry = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt", dry_run=True)
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt")
    assert [c.path for c in dry.converted] == [c.path for c in result.converted] == ["w.aux"]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert type(out["w"].aux) is torch.Tensor and torch.equal(out["w"].aux, torch.full((1,), 7.0))


def test_keys_that_become_equal_when_made_plain_are_never_merged_silently(
    tmp_path: Path,
) -> None:
    files = {pathlib.PurePosixPath("data/a.txt"): 10, "data/a.txt": 20}
    torch.save({"w": torch.ones(1), "files": files}, tmp_path / "in.pt")
    _, _, err = run_ckpt("sanitize", tmp_path / "in.pt", tmp_path / "strict.pt", "--strict", code=3)
    assert "an entry whose key, made plain, equals another's" in err
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt")
    assert len(result.dropped_values) == 1
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["files"] == {"data/a.txt": 10}  # the first kept, the other listed


def test_set_members_that_become_equal_when_made_plain_are_never_merged_silently(
    tmp_path: Path,
) -> None:
    members = {pathlib.PurePosixPath("data/a.txt"), "data/a.txt", "data/b.txt"}
    torch.save({"w": torch.ones(1), "files": members}, tmp_path / "in.pt")
    _, _, err = run_ckpt("sanitize", tmp_path / "in.pt", tmp_path / "strict.pt", "--strict", code=3)
    assert "a set member that, made plain, equals another" in err
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt")
    assert [c.path for c in result.dropped_values] == ["files"]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["files"] == {"data/a.txt", "data/b.txt"}


def test_a_value_a_pickled_set_lists_twice_is_no_loss(tmp_path: Path) -> None:
    # frozenset([1, 1]) as a pickle may spell it: the unpickler builds {1}, nothing is lost.
    torch.save({"w": torch.ones(1), "tags": 0}, tmp_path / "base.pt")
    with zipfile.ZipFile(tmp_path / "base.pt") as z:
        records = {name: z.read(name) for name in z.namelist()}
    pkl = next(name for name in records if name.endswith("/data.pkl"))
    data = records[pkl]
    at = data.index(b"K\x00", data.index(b"tags"))  # the value 0
    spelled = b"cbuiltins\nfrozenset\n](K\x01K\x01e\x85R"
    records[pkl] = data[:at] + spelled + data[at + 2 :]
    with zipfile.ZipFile(tmp_path / "in.pt", "w") as z:
        for name, body in records.items():
            z.writestr(name, body)
    assert torch.load(tmp_path / "in.pt", weights_only=False)["tags"] == frozenset({1})
    run_ckpt("sanitize", tmp_path / "in.pt", tmp_path / "strict.pt", "--strict", code=0)
    result = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt")
    assert result.dropped_values == () and [c.path for c in result.converted] == ["tags"]
    assert torch.load(tmp_path / "out.pt", weights_only=True)["tags"] == {1}


class _Twice:
    """Pickles as ``kind([a, b])``: one value listed twice, each its own pickle."""

    def __init__(self, kind: type, a: object, b: object) -> None:
        self.kind, self.a, self.b = kind, a, b

    def __reduce__(self) -> tuple[object, ...]:
        return (self.kind, ([self.a, self.b],))


@pytest.mark.parametrize("kind", [frozenset, set])
def test_one_path_a_pickled_set_lists_twice_is_no_loss(tmp_path: Path, kind: type) -> None:
    twice = _Twice(kind, pathlib.PurePosixPath("ckpt/a"), pathlib.PurePosixPath("ckpt/a"))
    torch.save({"w": torch.ones(1), "s": twice}, tmp_path / "in.pt")
    assert torch.load(tmp_path / "in.pt", weights_only=False)["s"] == {
        pathlib.PurePosixPath("ckpt/a")
    }
    run_ckpt("sanitize", tmp_path / "in.pt", tmp_path / "strict.pt", "--strict", code=0)
    assert ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt").dropped_values == ()
    assert torch.load(tmp_path / "out.pt", weights_only=True)["s"] == {"ckpt/a"}


def test_tensors_held_by_a_tensors_attributes_are_counted_and_verified(tmp_path: Path) -> None:
    t = torch.zeros(2)
    t.np = np.ones(2, dtype=np.float32)  # becomes a new record
    t.big = torch.ones(1000)  # copied
    torch.save({"t": t}, tmp_path / "in.pt")
    planned = ct.sanitize(tmp_path / "in.pt", tmp_path / "plan.pt", dry_run=True)
    done = ct.sanitize(tmp_path / "in.pt", tmp_path / "out.pt", verify="full")
    assert planned.bytes_written == done.bytes_written == 8 + 8 + 4000
    assert done.bytes_copied == 8 + 4000
    out = torch.load(tmp_path / "out.pt", weights_only=True)["t"]
    assert torch.equal(out.np, torch.ones(2)) and torch.equal(out.big, torch.ones(1000))

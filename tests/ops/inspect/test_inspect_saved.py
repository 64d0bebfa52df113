"""``inspect`` on checkpoints saved by the test itself with ``torch.save`` to a path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_tools
from ckpt_tools.formats import open_checkpoint
from tests.helpers import describe, tools

FORMATS = {
    "zip": ({}, "torch-zip"),
    "legacy": ({"_use_new_zipfile_serialization": False}, "torch-legacy"),
}


@pytest.mark.parametrize("kind", FORMATS)
def test_parameters_and_buffers(make_checkpoint: Callable[..., Path], kind: str) -> None:
    torch.manual_seed(0)
    obj = {
        "weight": nn.Parameter(torch.randn(3, 2)),
        "frozen": nn.Parameter(torch.randn(2), requires_grad=False),
        "running_mean": torch.zeros(3),
    }
    save_kwargs, fmt = FORMATS[kind]
    path = make_checkpoint(obj, f"params_{kind}.pt", **save_kwargs)
    loaded = torch.load(path, weights_only=True)
    info = ckpt_tools.inspect(path)
    assert info.format == fmt
    for t in info.tensors:
        assert t.is_parameter == isinstance(loaded[t.name], nn.Parameter), t.name
        assert (t.dtype, t.shape, t.stride) == tuple(
            describe(loaded[t.name])[k] for k in ("dtype", "shape", "stride")
        )
    refs = open_checkpoint(path).root
    assert {k: v.requires_grad for k, v in refs.items()} == {
        k: v.requires_grad for k, v in loaded.items()
    }


def test_zip_saved_to_a_path_is_rooted_at_its_stem(make_checkpoint: Callable[..., Path]) -> None:
    """``torch.save(obj, "model_best.pth")`` names the zip's folder ``model_best``."""
    sd: dict[str, Any] = tools().state_dict()
    path = make_checkpoint({"state_dict": sd, "epoch": 1}, "model_best.pth")
    ckpt = open_checkpoint(path)
    assert ckpt.archive_root == path.stem
    info = ckpt_tools.inspect(path)
    assert info.selected == ("state_dict",)
    assert [t.name for t in info.tensors] == list(torch.load(path, weights_only=True)["state_dict"])


def test_views_of_one_storage_hold_one_sharing_tuple(make_checkpoint: Callable[..., Path]) -> None:
    base = torch.arange(6.0)
    sd = {f"t{i}": base[i : i + 1] for i in range(6)}
    sd["alone"] = torch.ones(2)
    path = make_checkpoint(sd, "views.pt")
    info = ckpt_tools.inspect(path)
    views = [t for t in info.tensors if t.name != "alone"]
    # One tuple for the whole storage, not a list of the others per tensor.
    assert all(t.sharing is views[0].sharing for t in views)
    assert views[0].sharing == tuple(f"t{i}" for i in range(6))
    loaded = torch.load(path, weights_only=True)
    for t in info.tensors:  # torch's own answer: which loaded tensors share its storage
        ptr = loaded[t.name].untyped_storage().data_ptr()
        others = [n for n, v in loaded.items() if v.untyped_storage().data_ptr() == ptr]
        assert t.shared_with == tuple(n for n in others if n != t.name)
    assert info.tensor("alone").shared_with == ()
    rows = {row[0]: row[-1] for row in info.rows()}
    assert rows["t0"] == "t1, t2 ..." and rows["t1"] == "t0, t2 ..." and rows["alone"] == ""
    assert info.to_json()["tensors"][5]["shared_with"] == ["t0", "t1", "t2", "t3", "t4"]


def test_json_refuses_shared_with_lists_past_the_limit(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_tools.errors import ResourceLimitError
    from ckpt_tools.ops.inspect import info as inspection_info

    base = torch.arange(4.0)
    path = make_checkpoint({f"t{i}": base[i : i + 1] for i in range(4)}, "views.pt")
    info = ckpt_tools.inspect(path)
    monkeypatch.setattr(inspection_info, "MAX_SHARED_NAMES", 12)  # 4 views name 4 * 3
    assert len(info.to_json()["tensors"]) == 4
    monkeypatch.setattr(inspection_info, "MAX_SHARED_NAMES", 11)
    with pytest.raises(ResourceLimitError, match="4 tensors view one storage") as caught:
        info.to_json()
    assert "leave out --json" in caught.value.render(for_cli=True)
    assert "t0, t1 ..." in info.text()  # the text never lists them all


def test_a_root_that_is_no_mapping_lists_its_tensors_by_path(tmp_path: Path) -> None:
    # torch.save(tensor), torch.save([...]): no state dict, but the tensors are there.
    torch.save(torch.arange(6.0).view(2, 3), tmp_path / "t.pt")
    torch.save([torch.ones(2), {"a": torch.zeros(1, dtype=torch.int8)}], tmp_path / "l.pt")
    bare = ckpt_tools.inspect(tmp_path / "t.pt")
    assert [(t.name, t.shape, t.dtype) for t in bare.tensors] == [("<root>", (2, 3), "float32")]
    assert bare.selection_reason.startswith("the root is a tensor, no state dict")
    listed = ckpt_tools.inspect(tmp_path / "l.pt")
    loaded = torch.load(tmp_path / "l.pt", weights_only=True)
    assert [(t.name, t.shape) for t in listed.tensors] == [
        ("0", tuple(loaded[0].shape)),
        ("1.a", tuple(loaded[1]["a"].shape)),
    ]
    assert listed.total_bytes == 9


def test_a_dict_root_whose_tensors_all_lie_deeper_lists_them_by_path(tmp_path: Path) -> None:
    # An optimizer's state dict: no entry is a state dict, and every tensor is nested.
    model = nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    want = [
        (f"state.{i}.{k}", tuple(v.shape)) for i, s in loaded["state"].items() for k, v in s.items()
    ]
    info = ckpt_tools.inspect(tmp_path / "opt.pt")
    assert [(t.name, t.shape) for t in info.tensors] == want
    assert info.total_bytes == sum(v.nbytes for s in loaded["state"].values() for v in s.values())
    assert info.selection_reason.startswith("the root is a dict, no state dict; its tensors by")


_SUBCLASSED = """
import collections, sys, torch
class MyList(list):
    pass
d = collections.defaultdict(list)
d["enc.weight"], d["enc.bias"] = torch.ones(2, 2), torch.ones(2)
torch.save({"dd": d, "listed": MyList([torch.ones(2), torch.ones(3)])}, sys.argv[1])
"""


def test_tensors_in_dict_and_list_subclasses_are_named_by_their_keys(tmp_path: Path) -> None:
    # Objects the reader never builds: a defaultdict's items and a list subclass's items.
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _SUBCLASSED, str(tmp_path / "s.pt")], check=True)
    info = ckpt_tools.inspect(tmp_path / "s.pt")
    assert [(t.name, t.shape) for t in info.tensors] == [
        ("dd.enc.weight", (2, 2)),
        ("dd.enc.bias", (2,)),
        ("listed.0", (2,)),
        ("listed.1", (3,)),
    ]


def test_entries_whose_dotted_names_collide_are_each_listed(tmp_path: Path) -> None:
    sd = {"w": torch.ones(1)}
    tree = {"model": {"sd": sd, "step": 3}, "model.step": 4, 1: "int key", "1": "str key"}
    torch.save(tree, tmp_path / "c.pt")
    entries = ckpt_tools.inspect(tmp_path / "c.pt", select=("model", "sd")).entries
    assert sorted(entries.values()) == sorted(["int 3", "int 4", "str 'int key'", "str 'str key'"])
    assert {"model.step", "model.step (#2)", "1", "1 (#2)"} == set(entries)


def test_a_tuple_root_lists_its_entries_that_hold_no_tensor(tmp_path: Path) -> None:
    # (model, optimizer, epoch), as some training loops save it: its tensors are listed by
    # place, and so is each entry beside them, as for a dict root.
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 2)).sum().backward()
    optimizer.step()
    torch.save((model.state_dict(), optimizer.state_dict(), 5), tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    info = ckpt_tools.inspect(tmp_path / "t.pt")
    assert info.entries == {
        "1.param_groups": f"list ({len(loaded[1]['param_groups'])} items)",
        "2": f"int {loaded[2]}",
    }
    assert [t.name for t in info.tensors] == [
        "0.weight", "0.bias", "1.state.0.momentum_buffer", "1.state.1.momentum_buffer"
    ]  # fmt: skip
    assert "1.param_groups" in info.text() and "int 5" in info.text()

"""One meaning of ``select`` for every caller: inspect, rewrite and load_state_dict agree.

The same nested trees are saved with torch, then reached through each caller with the same
path: nested dicts, a key that itself holds dots, list items, and object attributes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.descriptors import Opaque
from ckpt_tools.errors import SelectError
from ckpt_tools.loading.state_dict import load_state_dict, load_with_info
from ckpt_tools.ops.inspect.inspection import inspect
from ckpt_tools.ops.rewrite.rewriting import rewrite
from ckpt_tools.structure.keys import add_rule
from ckpt_tools.structure.path_replace import replace_at
from ckpt_tools.structure.paths import entries_beside, resolve_path, walk_path
from ckpt_tools.structure.selection import select_state_dict


class Holder:
    """An object outside the allowlist that keeps a state dict as an attribute."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.step = 7


def _sd(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(3, 2, generator=g), "fc.bias": torch.randn(3, generator=g)}


# name -> (tree, select, keys the walk takes, seed of the state dict it reaches)
CASES: dict[str, tuple[Any, str, tuple[str, ...], int]] = {
    "nested": (
        {"trainer": {"model": _sd(1), "step": 3}, "epoch": 1},
        "trainer.model",
        ("trainer", "model"),
        1,
    ),
    "dotted key": ({"model.ema": _sd(2), "other": 1}, "model.ema", ("model.ema",), 2),
    "dotted inside nested": (
        {"run": {"model.ema": _sd(5)}},
        "run.model.ema",
        ("run", "model.ema"),
        5,
    ),
    "list item": ({"models": [_sd(6), _sd(7)]}, "models.1", ("models", "1"), 7),
    "attribute": (
        {"holder": Holder(_sd(8)), "epoch": 2},
        "holder.weights",
        ("holder", "weights"),
        8,
    ),
}
_TRUSTED = ("attribute",)  # Holder is outside the allowlist


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    torch.save(CASES[request.param][0], tmp_path / "in.pt")
    return request.param, tmp_path / "in.pt"


def test_inspect_reaches_the_same_node(case: tuple[str, Path]) -> None:
    name, path = case
    _, select, keys, _ = CASES[name]
    info = inspect(path, select=select)
    assert info.selected == keys
    assert sorted(t.name for t in info) == ["fc.bias", "fc.weight"]


def test_load_state_dict_reaches_the_same_node(case: tuple[str, Path]) -> None:
    name, path = case
    _, select, keys, seed = CASES[name]
    sd, load = load_with_info(path, select=select, trust=name in _TRUSTED)
    assert load.selected == keys
    for key, value in _sd(seed).items():
        assert torch.equal(sd[key], value)


def test_rewrite_replaces_the_same_node_and_keeps_the_rest(case: tuple[str, Path]) -> None:
    name, path = case
    tree, select, keys, seed = CASES[name]
    out = path.with_name("out.pt")
    allow = (f"{Holder.__module__}.Holder",) if name in _TRUSTED else ()
    rewrite(path, out, rules=[add_rule("net.")], select=select, allow_globals=allow)
    written = torch.load(out, weights_only=False)
    node = walk_path(written, keys).node
    node = node if isinstance(node, dict) else vars(node)
    assert sorted(node) == ["net.fc.bias", "net.fc.weight"]
    assert torch.equal(node["net.fc.weight"], _sd(seed)["fc.weight"])
    # Everything beside the path is as it was (names and plain values).
    assert [k for k, _ in entries_beside(written, keys)] == [
        k for k, _ in entries_beside(tree, keys)
    ]


def test_every_caller_names_the_same_missing_entry(case: tuple[str, Path]) -> None:
    name, path = case
    _, select, _, _ = CASES[name]
    wrong = select + ".nope"
    allow = (f"{Holder.__module__}.Holder",) if name in _TRUSTED else ()
    for call in (
        lambda: inspect(path, select=wrong),
        lambda: load_state_dict(path, select=wrong, trust=name in _TRUSTED),
        lambda: rewrite(
            path, path.with_name("o.pt"), rules=[add_rule("x.")], select=wrong, allow_globals=allow
        ),
    ):
        with pytest.raises(SelectError, match=r"select=.*no entry 'nope'"):
            call()


def test_resolver_follows_opaque_state_and_object_dict() -> None:
    opaque = Opaque.__new__(Opaque)
    vars(opaque).update(vars(Opaque.__new__(Opaque)))
    opaque.state = {"sd": {"w": 1}}
    assert resolve_path({"o": opaque}, "o.sd").node == {"w": 1}
    assert resolve_path({"h": Holder({})}, "h.step").node == 7
    assert resolve_path({0: {"a": 1}}, "0.a").node == 1  # int keys match their digits


def test_missing_entry_lists_what_is_there() -> None:
    with pytest.raises(SelectError, match=r"no entry 'c' under a; it has: b, x") as err:
        resolve_path({"a": {"b": 1, "x": 2}}, "a.c")
    assert err.value.render(for_cli=True).startswith("--select 'a.c': ")


def test_replacer_copies_the_path_and_shares_the_rest() -> None:
    other = {"kept": [1, 2]}
    tree = {"a": {"b": {"w": 1}}, "other": other}
    new = replace_at(tree, ("a", "b"), {"z": 3})
    assert new == {"a": {"b": {"z": 3}}, "other": other}
    assert tree["a"]["b"] == {"w": 1} and new["other"] is other
    # A tuple of keys is followed exactly: ("a", "b") is the nested entry, ("a.b",) the key.
    both = {"a": {"b": 1}, "a.b": 2}
    assert replace_at(both, ("a", "b"), 3) == {"a": {"b": 3}, "a.b": 2}
    assert replace_at(both, ("a.b",), 3) == {"a": {"b": 1}, "a.b": 3}
    holder = Holder({"w": torch.zeros(1)})
    swapped = replace_at({"h": holder}, ("h",), {"weights": {}, "step": 1})["h"]
    assert type(swapped) is Holder and swapped.step == 1 and holder.step == 7
    assert replace_at({"l": (1, 2)}, ("l", "1"), 5) == {"l": (1, 5)}


# name -> (tree, the path chosen automatically): an empty state dict under a candidate name is
# the state dict, chosen only where no entry holds tensors.
EMPTY_CASES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "empty state_dict": ({"state_dict": {}, "epoch": 1}, ("state_dict",)),
    "empty nested": ({"trainer": 3, "model": {"state_dict": {}}}, ("model", "state_dict")),
    "tensors win over an earlier empty entry": (
        {"state_dict": {}, "model": _sd(1), "epoch": 1},
        ("model",),
    ),
    "tensors win over an earlier empty nested entry": (
        {"model": {"state_dict": {}}, "ema": _sd(2)},
        ("ema",),
    ),
    "the largest tensor dict wins too": ({"state_dict": {}, "weights_v2": _sd(3)}, ("weights_v2",)),
    "an empty root is the root": ({}, ()),
}


@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
def test_an_empty_state_dict_is_chosen_where_it_is_the_one(name: str, tmp_path: Path) -> None:
    tree, chosen = EMPTY_CASES[name]
    path = tmp_path / "in.pt"
    torch.save(tree, path)
    assert inspect(path).selected == chosen
    # A rewrite of that state dict renames its keys, never the entries beside it.
    want = walk_path(tree, chosen).node
    if want:  # (load_state_dict refuses a state dict with no tensors, chosen or not)
        assert load_with_info(path)[1].selected == chosen
        rewrite(path, tmp_path / "out.pt", rules=[add_rule("net.")])
        written = torch.load(tmp_path / "out.pt", weights_only=True)
        assert sorted(walk_path(written, chosen).node) == sorted(f"net.{k}" for k in want)
        assert [k for k, _ in entries_beside(written, chosen)] == [
            k for k, _ in entries_beside(tree, chosen)
        ]


@pytest.mark.parametrize(
    ("root", "found"),
    [
        ({}, True),
        ({"state_dict": {}, "epoch": 1}, True),
        ({"trainer": 3, "model": {"state_dict": {}}}, True),
        ({"epoch": 1, "optimizer": {}}, False),
        ({"epoch": 1}, False),
    ],
    ids=["empty root", "empty state_dict", "empty nested", "empty other name", "no tensors"],
)
def test_selection_says_whether_it_found_a_state_dict(root: dict, found: bool) -> None:
    assert select_state_dict(root).found is found


def test_the_largest_of_several_tensor_dicts_names_the_others() -> None:
    # A GAN's {"model": {"generator": ..., "discriminator": ...}}: one is taken, the other said.
    root = {"model": {"generator": _sd(3), "discriminator": _sd(2)}, "step": 10}
    chosen = select_state_dict(root)
    assert chosen.path == ("model", "generator")
    assert "also 'discriminator': select one to take it instead" in chosen.reason
    alone = select_state_dict({"state_dict": {}, "weights_v2": _sd(3)})
    assert "also" not in alone.reason


@pytest.mark.parametrize("entry", ["state_dict", "model", "net"])
def test_a_tensor_beside_the_state_dict_does_not_make_the_root_one(
    tmp_path: Path, entry: str
) -> None:
    # An ImageNet script's {"state_dict": sd, "best_acc1": tensor}: half its values are
    # tensors, but the weights are the entry torch.load's caller reads.
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    path = tmp_path / "best.pth.tar"
    torch.save({entry: net.state_dict(), "best_acc1": torch.tensor(76.1)}, path)
    sd, info = load_with_info(path)
    assert info.selected == (entry,) and list(sd) == list(net.state_dict())
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(sd, strict=True)
    assert [t.name for t in inspect(path).tensors] == list(net.state_dict())


def test_a_dotted_path_deeper_than_the_interpreters_stack_resolves() -> None:
    depth = 3 * sys.getrecursionlimit()
    tree: dict = {"w": 1}
    for _ in range(depth):
        tree = {"a": tree}
    dotted = ".".join(["a"] * depth)
    assert resolve_path(tree, dotted).node == {"w": 1}
    assert resolve_path(tree, dotted).keys == resolve_path(tree, ("a",) * depth).keys
    nested: list = [{"w": 2}]
    for _ in range(depth):
        nested = [nested]
    assert resolve_path(nested, ".".join(["0"] * (depth + 1))).node == {"w": 2}
    with pytest.raises(SelectError, match="no entry 'b' under"):
        resolve_path(tree, dotted + ".b")


@pytest.mark.parametrize("select", ["²", "٣", "w.²"])
def test_a_select_part_of_other_digits_names_no_index(select: str) -> None:
    # "²" is a digit to str.isdigit and no number to int; "٣" is no ASCII index either.
    tree = {"w": [1, 2, 3, 4], 3: "int key"}
    with pytest.raises(SelectError, match="no entry"):
        resolve_path(tree, select)

"""``select`` as a sequence of keys is followed exactly; a dotted path that reads two ways is
refused; keys that are not text are refused with a typed error.

Files are written with ``torch.save``; what each select must reach is read with ``torch.load``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import SelectError, UsageError
from ckpt_tools.loading.state_dict import load_with_info
from ckpt_tools.ops.inspect.inspection import inspect


@pytest.fixture
def both(tmp_path: Path) -> Path:
    """A key that holds a dot beside the nested entries the same dotted path names."""
    path = tmp_path / "both.pt"
    torch.save(
        {
            "a.b": {"x": torch.zeros(2)},
            "a": {"b": {"x": torch.ones(2)}},
            "l": [{"y": torch.arange(3.0)}],
        },
        path,
    )
    return path


def _assert_reaches(path: Path, select: object, where: tuple[object, ...]) -> None:
    node = torch.load(path, weights_only=True)
    for key in where:
        node = node[key]
    sd, info = load_with_info(path, map_location="cpu", select=select)  # type: ignore[arg-type]
    assert info.selected == tuple(str(k) for k in where)
    assert sd.keys() == node.keys()
    for key, value in node.items():
        assert torch.equal(sd[key], value)
    assert inspect(path, select=select).selected == tuple(str(k) for k in where)  # type: ignore[arg-type]


@pytest.mark.parametrize("select", [("a", "b"), ["a", "b"]])
def test_a_sequence_of_keys_is_followed_exactly(both: Path, select: object) -> None:
    _assert_reaches(both, select, ("a", "b"))
    _assert_reaches(both, ("a.b",), ("a.b",))  # the key that holds a dot is one key


def test_a_dotted_path_that_reads_two_ways_is_refused(both: Path) -> None:
    for call in (
        lambda: load_with_info(both, map_location="cpu", select="a.b"),
        lambda: inspect(both, select="a.b"),
    ):
        with pytest.raises(UsageError) as err:
            call()
        assert not isinstance(err.value, SelectError)  # nothing is missing: it is ambiguous
        text = str(err.value)
        assert "select=('a.b',)" in text and "select=('a', 'b')" in text
        assert "--" not in text


def test_a_dotted_path_takes_the_one_reading_that_reaches_an_entry(tmp_path: Path) -> None:
    path = tmp_path / "one.pt"
    torch.save({"a.b": {"w": torch.zeros(1)}, "a": {"b": {"c": {"x": torch.ones(4)}}}}, path)
    want = torch.load(path, weights_only=True)["a"]["b"]["c"]
    sd, info = load_with_info(path, map_location="cpu", select="a.b.c")
    assert info.selected == ("a", "b", "c")
    assert torch.equal(sd["x"], want["x"])


@pytest.mark.parametrize("select", [["l", 0], ("a", None), 5])
def test_keys_that_are_not_text_are_refused(both: Path, select: object) -> None:
    with pytest.raises(UsageError, match=r"select="):
        load_with_info(both, map_location="cpu", select=select)  # type: ignore[arg-type]
    _assert_reaches(both, ["l", "0"], ("l", 0))  # a list item is named by its digits

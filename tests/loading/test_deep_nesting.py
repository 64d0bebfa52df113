"""Containers nested far deeper than a state dict: read as torch.load reads them (any depth),
and refused cleanly only by an output that would pickle them (a rewrite writes 300 levels at
most); an output of the tensors alone leaves them out and is written."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools import convert, extract, load_state_dict, slim, strip_module
from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.pickle.limits import MAX_REWRITE_NESTING, stack_room


def _deep(depth: int, kind: str) -> Any:
    node: Any = torch.arange(3.0)
    for _ in range(depth):
        node = {"a": node} if kind == "dict" else [node]
    return node


def save_deep(path: Path, depth: int, kind: str, *, trainer: bool = False) -> Path:
    """torch.save of ``{"module.w": ..., "deep": <depth levels>}`` (``trainer``: the state
    dict under ``state_dict``, beside ``deep``), past torch.save's own recursion limit:
    saved in a thread with a large stack and a raised limit."""
    weights = {"module.w": torch.ones(2)}
    obj = {"state_dict": weights} if trainer else weights
    obj["deep"] = _deep(depth, kind)
    failed: list[BaseException] = []

    def save() -> None:
        try:
            torch.save(obj, path)
        except BaseException as e:  # re-raised in the test's thread
            failed.append(e)

    limit, stack = sys.getrecursionlimit(), threading.stack_size(256 << 20)
    sys.setrecursionlimit(max(limit, 4 * depth + 1000))
    try:
        thread = threading.Thread(target=save)
        thread.start()
        thread.join()
    finally:
        sys.setrecursionlimit(limit)
        threading.stack_size(stack)
    if failed:
        raise failed[0]
    return path


def _bottom(node: Any, depth: int, kind: str) -> Any:
    for _ in range(depth):
        assert isinstance(node, dict if kind == "dict" else list)
        node = node["a"] if kind == "dict" else node[0]
    return node


@pytest.mark.parametrize("kind", ["dict", "list"])
@pytest.mark.parametrize("depth", [300, 1000, 5000])
def test_deep_containers_load_as_torch_loads_them(tmp_path: Path, depth: int, kind: str) -> None:
    path = save_deep(tmp_path / "deep.pt", depth, kind)
    want = torch.load(path, weights_only=True)
    got = load_state_dict(path, select=[])
    assert list(got) == list(want)
    assert torch.equal(_bottom(got["deep"], depth, kind), _bottom(want["deep"], depth, kind))
    info = ckpt_tools.inspect(path)
    assert [t.name for t in info] == ["module.w"] and "deep" in info.entries


def test_a_rewrite_writes_what_torch_save_writes(tmp_path: Path) -> None:
    depth = MAX_REWRITE_NESTING - 8  # the root, and the tensor (its call, arguments, hooks)
    src = save_deep(tmp_path / "deep.pt", depth, "dict")
    strip_module(src, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == ["w", "deep"]
    assert torch.equal(_bottom(out["deep"], depth, "dict"), torch.arange(3.0))


@pytest.mark.parametrize("depth", [MAX_REWRITE_NESTING, 1000])
def test_a_rewrite_refuses_a_tree_deeper_than_it_writes(tmp_path: Path, depth: int) -> None:
    src = save_deep(tmp_path / "deep.pt", depth, "dict")
    with pytest.raises(ResourceLimitError, match="levels deep"):
        strip_module(src, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("output", ["extract", "slim --weights-only", "convert --drop-extras"])
def test_an_output_that_leaves_the_deep_part_out_is_written(tmp_path: Path, output: str) -> None:
    src = save_deep(tmp_path / "deep.pt", 1000, "dict", trainer=output.startswith("slim"))
    if output == "extract":
        extract(src, tmp_path / "out.pt", prefix="module.")
    elif output == "slim --weights-only":
        slim(src, tmp_path / "out.pt", weights_only=True)
    else:
        convert(src, tmp_path / "out.safetensors", select=[], drop_extras=True)
    out = next(tmp_path.glob("out.*"))
    if out.suffix == ".pt":
        got = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file

        got = load_file(out)
    assert list(got) == ["module.w"] and torch.equal(got["module.w"], torch.ones(2))


def test_a_deep_entry_in_a_state_dict_written_alone_is_refused_on_writing(tmp_path: Path) -> None:
    # A weights-only output keeps the state dict's other entries: the pickler refuses one.
    src = save_deep(tmp_path / "deep.pt", 1000, "dict")
    with pytest.raises(ResourceLimitError, match="more than 300 levels deep"):
        slim(src, tmp_path / "out.pt", weights_only=True, select=[])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.pt"]


def test_a_rewrite_writes_its_whole_depth_under_a_deep_caller(tmp_path: Path) -> None:
    # The frames already on the stack (a server, a test runner) leave the walk its room.
    depth = MAX_REWRITE_NESTING - 8
    src = save_deep(tmp_path / "deep.pt", depth, "dict")
    limit = sys.getrecursionlimit()

    def nested(frames: int) -> None:
        if frames:
            nested(frames - 1)
        else:
            strip_module(src, tmp_path / "out.pt")
            ckpt_tools.sanitize(src, tmp_path / "sanitized.pt")

    nested(limit // 2)
    for name in ("out.pt", "sanitized.pt"):
        out = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(_bottom(out["deep"], depth, "dict"), torch.arange(3.0))
    assert sys.getrecursionlimit() == limit


def test_the_raised_limit_is_put_back_by_the_last_thread_out() -> None:
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit := 500)  # below what a walk needs: each thread raises it
    try:
        _two_overlapping_walks(limit)
    finally:
        sys.setrecursionlimit(before)


def _two_overlapping_walks(limit: int) -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def first() -> None:
        with stack_room():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second() -> None:
        first_in.wait()
        with stack_room():
            second_in.set()
            first_out.wait()
            seen["while the second walks"] = sys.getrecursionlimit()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The first out does not put the limit back under the second's walk.
    assert seen["while the second walks"] > 3 * MAX_REWRITE_NESTING > limit
    assert sys.getrecursionlimit() == limit

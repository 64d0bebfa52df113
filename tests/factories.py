"""Shared test helpers: the committed fixtures, asking torch for the truth, building files.

The fixture writers live in ``fixtures/make_fixtures.py`` (a script, not a package); this
module loads it once and re-exports what tests use.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import pickletools
import shutil
import sys
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.pickles import load_pickle
from ckpt_tools.formats.repickle import dumps, zip_storage_id
from ckpt_tools.ops.inspection import TensorInfo
from ckpt_tools.descriptors import StorageRef, TensorRef

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
REAL_DIR = ROOT.parent / "shared" / "realckpt"
# Files in fixtures/ that are not fixtures, and folders that belong to other tests.
NOT_FIXTURES = frozenset({"make_fixtures.py", "manifest.json", "README.md", "harness"})


@cache
def tools() -> ModuleType:
    """``fixtures/make_fixtures.py`` as a module (its writers and torch comparison helpers)."""
    path = FIXTURES / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_fixtures", module)
    spec.loader.exec_module(module)
    return module


@cache
def manifest() -> tuple[dict[str, Any], ...]:
    """The fixture table ``make_fixtures.py`` wrote beside the files."""
    data = json.loads((FIXTURES / "manifest.json").read_text())
    return tuple(data["fixtures"])


def fixtures_where(**conditions: Any) -> list[dict[str, Any]]:
    """Manifest entries matching every ``field=value`` (a value may be a tuple of choices)."""

    def matches(entry: dict[str, Any]) -> bool:
        for key, wanted in conditions.items():
            choices = wanted if isinstance(wanted, tuple) else (wanted,)
            if entry[key] not in choices:
                return False
        return True

    return [e for e in manifest() if matches(e)]


def by_name(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``pytest.mark.parametrize("entry", **by_name(entries))``: one case per fixture, by name."""
    return {"argvalues": list(entries), "ids": [e["name"] for e in entries]}


def fixture_path(name: str) -> Path:
    return FIXTURES / name


def entry(name: str) -> dict[str, Any]:
    return next(e for e in manifest() if e["name"] == name)


# ---------------------------------------------------------------------------------------------
# Asking torch (or safetensors, or pickle) what a file holds


def load_truth(entry: Mapping[str, Any]) -> Any:
    """The file's object tree as its own library loads it (see ``Fixture.oracle``)."""
    path = fixture_path(entry["name"])
    oracle = entry["oracle"]
    if oracle == "torch":
        return torch.load(path, weights_only=True)
    if oracle == "torch-unsafe":
        # Only for files make_fixtures.py wrote itself (torch refuses weights_only for tar).
        return torch.load(path, weights_only=False)
    if oracle == "jit":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated
            return torch.jit.load(path).state_dict()
    if oracle == "pickle":
        with open(path, "rb") as f:
            return pickle.load(f)
    if oracle == "safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    if oracle == "sharded":
        from safetensors.torch import load_file

        index = json.loads((path / "model.safetensors.index.json").read_text())
        shards = {s: load_file(path / s) for s in dict.fromkeys(index["weight_map"].values())}
        return {name: shards[shard][name] for name, shard in index["weight_map"].items()}
    raise ValueError(f"no oracle for {entry['name']}")


def child(node: Any, key: str) -> Any:
    """``node[key]`` where the path spells int keys as digits (``optimizer.state.0``)."""
    if isinstance(node, Mapping):
        return node[key] if key in node else node[int(key)]
    return node[int(key)]


def at_path(root: Any, path: Sequence[str]) -> Any:
    for key in path:
        root = child(root, key)
    return root


def tensors_of(mapping: Mapping[Any, Any]) -> dict[str, torch.Tensor]:
    """The tensor values of a mapping, by string key, in order."""
    return {str(k): v for k, v in mapping.items() if isinstance(v, torch.Tensor)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def describe(t: torch.Tensor) -> dict[str, Any]:
    """What inspect reports per tensor, as torch sees it."""
    return {
        "dtype": dtype_name(t.dtype),
        "shape": tuple(t.shape),
        "stride": t.stride(),
        "offset": t.storage_offset(),
        "nbytes": t.numel() * t.element_size(),
        "device": str(t.device),
    }


def describe_info(t: TensorInfo) -> dict[str, Any]:
    return {
        "dtype": t.dtype,
        "shape": t.shape,
        "stride": t.stride,
        "offset": t.offset,
        "nbytes": t.nbytes,
        "device": t.device,
    }


def describe_ref(t: TensorRef) -> dict[str, Any]:
    return {
        "dtype": t.dtype,
        "shape": t.shape,
        "stride": t.stride,
        "offset": t.offset,
        "nbytes": t.nbytes,
        "device": t.device,
    }


def partition(pairs: Sequence[tuple[str, Any]]) -> set[frozenset[str]]:
    """Group names by a sharing key (torch: storage data_ptr; ours: StorageRef identity)."""
    groups: dict[Any, set[str]] = {}
    for name, key in pairs:
        groups.setdefault(key, set()).add(name)
    return {frozenset(g) for g in groups.values()}


def walk_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a torch-loaded tree, with the paths :func:`iter_tensors` uses."""
    seen: set[int] = set()

    def walk(node: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(node, torch.Tensor):
            yield where, node
            return
        if id(node) in seen:
            return
        if isinstance(node, Mapping):
            seen.add(id(node))
            for k, v in node.items():
                yield from walk(v, f"{where}.{k}" if where else str(k))
        elif isinstance(node, (list, tuple)):
            seen.add(id(node))
            for i, v in enumerate(node):
                yield from walk(v, f"{where}.{i}" if where else str(i))

    return walk(obj, path)


def bits(t: torch.Tensor) -> torch.Tensor:
    return tools().bits(t)


def assert_same_objects(a: Any, b: Any, where: str = "<root>") -> None:
    """Two torch-loaded trees are equal: containers, plain values, and tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert describe(a) == describe(b), where
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, Mapping):
        assert list(a) == list(b), where
        for key in a:
            assert_same_objects(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_objects(x, y, f"{where}.{i}")
    else:
        assert a == b, where
    if where == "<root>":
        ours = [(n, t.untyped_storage().data_ptr()) for n, t in walk_tensors(a)]
        theirs = [(n, t.untyped_storage().data_ptr()) for n, t in walk_tensors(b)]
        assert partition(ours) == partition(theirs), "storage sharing differs"


# ---------------------------------------------------------------------------------------------
# Reading tensor bytes through our byte locations


def read_span(ckpt: Checkpoint, storage: StorageRef) -> bytes:
    """The bytes our reader says ``storage`` has."""
    span = ckpt.span(storage)
    with open(span.path, "rb") as f:
        f.seek(span.offset)
        data = f.read(span.nbytes)
    assert len(data) == span.nbytes
    return data


def tensor_from_span(ckpt: Checkpoint, tensor: TensorRef) -> torch.Tensor:
    """Rebuild a tensor with torch from the bytes our reader says are its storage's."""
    dtype = torch_dtype(tensor.dtype)
    data = read_span(ckpt, tensor.storage)
    if not data:
        return torch.empty(tensor.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    return flat.as_strided(tensor.shape, tensor.stride, tensor.offset)


# ---------------------------------------------------------------------------------------------
# Building files


def data_pkl_name(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        return next(n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)


def read_data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(data_pkl_name(path))


def repickle_zip(
    src: Path, dst: Path, protocol: int = 2, device_map: Mapping[str, str] | None = None
) -> bytes:
    """Re-emit ``src``'s data.pkl with our re-pickler into a copy of the archive at ``dst``.

    Returns:
        The new data.pkl bytes.
    """
    tree = load_pickle(io.BytesIO(read_data_pkl(src))).root
    payload = dumps(tree, protocol, zip_storage_id(device_map))
    tools().rewrite_zip(src, dst, replace={"data.pkl": payload})
    return payload


def truncated_copy(src: Path, dst: Path, size: int) -> Path:
    """The first ``size`` bytes of ``src`` (negative: all but the last ``-size``)."""
    data = src.read_bytes()
    dst.write_bytes(data[:size])
    return dst


def copy_fixture(name: str, dst_dir: Path) -> Path:
    src = fixture_path(name)
    dst = dst_dir / name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


def pickle_protocol(data: bytes) -> int:
    """The protocol a pickle declares (0 when it has no PROTO opcode), per pickletools."""
    opcode, arg, _ = next(pickletools.genops(data))
    return int(arg) if opcode.name == "PROTO" else 0


def ckpt_env(**extra: str) -> dict[str, str]:
    """The environment for running ``ckpt`` in a subprocess (no inherited CKPT_DEBUG)."""
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    env.update(extra)
    return env

"""Hostile pickles are read as torch.load(weights_only=True) reads them,
or refused with one line and the exit code of their class.

Each test builds a class of input in ``tmp_path``, asks torch what it makes of it (the oracle),
then checks the library's exception and a ``ckpt inspect`` subprocess.
"""

from __future__ import annotations

import collections
import os
import pickle
import pickletools
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckpt_tools as ct
from ckpt_tools.errors import (
    CorruptCheckpointError,
    ResourceLimitError,
    UnsafeContentError,
    quote_foreign,
)
from tests.helpers.committed import tools

torch = pytest.importorskip("torch")

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _torch_error(path: Path) -> str:
    """What torch.load(weights_only=True) says about the file ('' when it loads it)."""
    try:
        torch.load(path, weights_only=True)
    except Exception as e:  # the oracle: any refusal, whatever its type
        return f"{type(e).__name__}: {e}"
    return ""


def _cli(path: Path) -> tuple[int, list[str]]:
    proc = subprocess.run(
        [CKPT, "inspect", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    return proc.returncode, proc.stderr.strip().splitlines()


def _refused(path: Path, error: type[Exception], code: int, needle: str) -> None:
    with pytest.raises(error) as info:
        ct.inspect(str(path))
    assert "\n" not in str(info.value)
    assert needle in str(info.value)
    rc, lines = _cli(path)
    assert rc == code, lines
    assert len(lines) == 1 and lines[0].startswith("ckpt: error:"), lines
    assert needle in lines[0]


# --- GLOBAL names: split on newlines exactly as torch's weights-only unpickler does -------------


@pytest.mark.parametrize("name", ["{ystem", "sy stem", "system.x", "sys\\x00"])
def test_a_mangled_global_is_named_as_torch_names_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / "mangled.pt"
    body = f"cposix\n{name}\n".encode() + b"X\x04\x00\x00\x00true\x85R0"
    path.write_bytes(b"\x80\x02" + body + b"}q\x00.")
    assert f"GLOBAL posix.{name} whose module" in _torch_error(path)
    assert ct.inspect(str(path)).unsafe_globals == (f"posix.{name}",)
    rc, _ = _cli(path)
    assert rc == 0


@pytest.mark.parametrize(
    ("body", "name"),
    [
        (b"cposix\n\nX\x04\x00\x00\x00true\x85R0}.", "posix."),  # an empty name line
        (b"c\nsystem\n0}.", ".system"),  # an empty module line
        (b"cposix\nsystem", "posix.syste"),  # the last line without its newline
        (b"cposix\nsystem\n\xff", "posix.system"),  # a failure after the global
    ],
    ids=["empty-name", "empty-module", "no-newline", "bad-after"],
)
def test_a_global_before_a_failure_is_refused_as_torch_refuses_it(
    tmp_path: Path, body: bytes, name: str
) -> None:
    path = tmp_path / "cut.pt"
    path.write_bytes(b"\x80\x02" + body)
    assert f"GLOBAL {name} " in _torch_error(path)
    _refused(path, UnsafeContentError, 3, f"({name})")


# --- legacy files: every pickle torch unpickles goes through the restricted unpickler -----------


def _legacy_pickles(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of the five pickles at the head of a legacy torch file."""
    spans, start = [], 0
    for _ in range(5):
        end = start
        for op, _arg, pos in pickletools.genops(data[start:]):
            if op.name == "STOP":
                end = start + pos + 1
                break
        spans.append((start, end))
        start = end
    return spans


def _splice_payload(path: Path, which: int) -> None:
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    start, end = _legacy_pickles(data)[which]
    proto = data[start : start + 2] if data[start] == 0x80 else b""
    payload = b"cposix\nsystem\nX\x04\x00\x00\x00true\x85R0"  # posix.system('true'), popped
    spliced = proto + payload + data[start + len(proto) : end]
    path.write_bytes(data[:start] + spliced + data[end:])


@pytest.mark.parametrize("which", [1, 2, 4], ids=["protocol", "sys_info", "keys"])
def test_a_global_in_a_legacy_header_pickle_is_refused_naming_it(
    tmp_path: Path, which: int
) -> None:
    path = tmp_path / "legacy.pt"
    _splice_payload(path, which)
    assert "posix.system" in _torch_error(path)
    _refused(path, UnsafeContentError, 3, "posix.system")


def test_a_global_in_the_magic_number_pickle_is_named(tmp_path: Path) -> None:
    # With the magic number moved off offset 2 the file reads as a plain pickle: the
    # global is reported (inspect exits 0), and a rewrite refuses it (exit 3).
    path = tmp_path / "legacy.pt"
    _splice_payload(path, 0)
    assert "posix.system" in _torch_error(path)
    assert "posix.system" in ct.inspect(str(path)).unsafe_globals


def test_a_legacy_file_with_a_wrong_protocol_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    start, end = _legacy_pickles(data)[1]
    path.write_bytes(data[:start] + pickle.dumps(1002, protocol=2) + data[end:])
    assert "Invalid protocol version" in _torch_error(path)
    _refused(path, CorruptCheckpointError, 4, "protocol version")


# --- allowlisted callables: called with the arity of their real signature, or refused -----------


class _Rebuild:
    """Pickles as a call of ``func`` with ``args`` (how a fuzzer's deleted op looks)."""

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _v2_args(tensor: Any) -> tuple[Any, ...]:
    hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    storage = tensor._typed_storage()
    return (storage, 0, tuple(tensor.size()), tensor.stride(), False, hooks, None, None)


@pytest.mark.parametrize("count", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_rebuild_tensor_v2_with_another_arity_is_refused(
    tmp_path: Path, count: int, legacy: bool
) -> None:
    path = tmp_path / "arity.pt"
    call = _Rebuild(torch._utils._rebuild_tensor_v2, _v2_args(torch.ones(3))[:count])
    torch.save({"w": call}, path, _use_new_zipfile_serialization=not legacy)
    theirs = _torch_error(path)
    if 6 <= count <= 7:
        assert theirs == ""
        assert [t.shape for t in ct.inspect(str(path)).tensors] == [(3,)]
        return
    assert "positional argument" in theirs
    _refused(path, CorruptCheckpointError, 4, "torch._utils._rebuild_tensor_v2")


@pytest.mark.parametrize("count", [1, 3, 5, 6])
def test_a_device_rebuild_with_another_arity_is_refused(tmp_path: Path, count: int) -> None:
    path = tmp_path / "plain.pkl"
    call = _Rebuild(torch._utils._rebuild_device_tensor_from_numpy, (None,) * count)
    path.write_bytes(pickle.dumps({"a": call}, protocol=2))
    assert "positional argument" in _torch_error(path)
    _refused(path, CorruptCheckpointError, 4, "_rebuild_device_tensor_from_numpy")


# --- the unpickler's own built-in exceptions on hostile bytes -----------------------------------


@pytest.mark.parametrize(
    "opcode", [b"\x96", b"\x8e", b"\x8d"], ids=["BYTEARRAY8", "BINBYTES8", "BINUNICODE8"]
)
def test_a_length_past_the_address_space_is_a_resource_limit(tmp_path: Path, opcode: bytes) -> None:
    path = tmp_path / "huge.pkl"
    path.write_bytes(b"\x80\x05" + opcode + struct.pack("<Q", 2**64 - 1) + b".")
    assert _torch_error(path)
    _refused(path, ResourceLimitError, 5, "larger than memory allows")


@pytest.mark.parametrize(
    "body",
    [b"Fbad\nfloat\n.", b"I12x\n.", b"\x80\x02j\x01\x00\x00\x00.", b"\x80\x02.", b"\x80\x02]q"],
    ids=["float-text", "int-text", "memo-miss", "empty-stack", "truncated"],
)
def test_malformed_bytes_are_refused_on_one_line(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "bad.pkl"
    path.write_bytes(body)
    assert _torch_error(path)
    _refused(path, CorruptCheckpointError, 4, "malformed or truncated")


def test_foreign_text_is_quoted_on_one_line() -> None:
    text = quote_foreign(ValueError("a\nb\u2028c" + "x" * 500))
    assert text.startswith("ValueError: a\\nb\\u2028c") and len(text) < 220
    assert len(text.splitlines()) == 1
    assert os.linesep not in text


# --- the allowlist is a subset of torch's --------------------------------------------------------


def test_every_allowlisted_global_is_on_torchs_allowlist() -> None:
    from torch import _weights_only_unpickler as weights_only

    from ckpt_tools.formats.pickle.allowlist import ALLOWED_GLOBALS

    # ``import torch`` adds the jagged nested tensor's and the device mesh layouts' globals.
    nested = {
        f"{g.__module__}.{g.__qualname__}"
        for g in torch.serialization.get_safe_globals()
        if getattr(g, "__module__", "").startswith(("torch.nested.", "torch.distributed."))
    }
    # ``import torch._dynamo`` adds _DimRange, which a jagged tensor made by nested_tensor holds.
    dynamo = {"torch._dynamo.decorators._DimRange"}
    assert set(weights_only._get_allowed_globals()) | nested | dynamo >= ALLOWED_GLOBALS


@pytest.mark.parametrize("value", [frozenset({1}), slice(1, 2)], ids=["frozenset", "slice"])
def test_a_global_torch_refuses_is_reported_unsafe(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"a": value}, protocol=2))
    name = type(value).__name__
    assert f"GLOBAL {name} was not an allowed global" in _torch_error(path)
    # Named as written (protocol 2: ``__builtin__``), so a rewrite re-emits it unchanged.
    assert ct.inspect(str(path)).unsafe_globals == (f"__builtin__.{name}",)


# --- arguments torch checks: storage id lengths per format, requires_grad's type ---------------


class _Flagged(_Rebuild):
    """A tensor rebuilt with ``requires_grad`` set to ``flag``."""

    def __init__(self, tensor: Any, flag: Any) -> None:
        super().__init__(torch._utils._rebuild_tensor_v2, (*_v2_args(tensor)[:4], flag, {}))


@pytest.mark.parametrize("flag", [1, None, {}], ids=["int", "none", "dict"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_requires_grad_that_is_not_a_bool_is_refused(
    tmp_path: Path, flag: Any, legacy: bool
) -> None:
    path = tmp_path / "flag.pt"
    tree = {"w": _Flagged(torch.ones(2), flag)}
    torch.save(tree, path, _use_new_zipfile_serialization=not legacy)
    assert "requires_grad must be a bool" in _torch_error(path)
    _refused(path, CorruptCheckpointError, 4, "requires_grad")


def test_a_legacy_storage_id_without_its_view_field_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    start, end = _legacy_pickles(data)[3]
    main = data[start:end]
    # The storage id is a 6-tuple closed by TUPLE right after its view field (NONE): drop it.
    assert main.count(b"Nt") == 1
    path.write_bytes(data[:start] + main.replace(b"Nt", b"t") + data[end:])
    assert "not enough values to unpack" in _torch_error(path)
    _refused(path, CorruptCheckpointError, 4, "persistent id")


@pytest.mark.parametrize("args", [(), (1, 2, 3)], ids=["no-args", "three"])
def test_a_pickle_that_builds_a_storage_itself_is_refused(tmp_path: Path, args: Any) -> None:
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"a": _Rebuild(torch.storage.TypedStorage, args)}, protocol=2))
    # torch may build one or fail; no descriptor stands for it, so it is refused either way.
    _refused(path, CorruptCheckpointError, 4, "torch.storage.TypedStorage")


# --- globals torch's full unpickler turns into storage types -----------------------------------


def _calling(module: str, name: str) -> bytes:
    """``{"a": module.name()}`` as protocol 2: the global called by REDUCE."""
    return b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01c" + f"{module}\n{name}\n".encode() + b")Rs."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch._utils", "FloatStorage"),  # the fuzzer's find (c7-ff4ec6095d)
        ("nowhere.at_all", "HalfStorage"),
        ("torch.cuda", "QUInt8Storage"),  # named like one, and refused by weights_only
        ("torch", "BFloat16Storage"),  # allowlisted, and as uncallable
    ],
)
def test_a_called_storage_class_is_refused_as_torch_refuses_it(
    tmp_path: Path, module: str, name: str
) -> None:
    src = tmp_path / "clean.pt"
    torch.save({"a": 1}, src)
    path = tmp_path / "called.pt"
    tools().rewrite_zip(src, path, replace={"data.pkl": _calling(module, name)})
    # The oracle is the full unpickler: whatever the module, it resolves a storage class name
    # to torch's StorageType before any import, and calling that fails; nothing else runs.
    with pytest.raises(TypeError, match="'StorageType' object is not callable"):
        torch.load(path, weights_only=False)
    with pytest.raises(ct.CheckpointError, match=f"{module}.{name}"):
        ct.inspect(str(path))
    rc, lines = _cli(path)
    assert rc != 0 and len(lines) == 1 and name in lines[0], lines


def test_a_storage_class_name_used_as_a_value_stays_an_unsafe_global(tmp_path: Path) -> None:
    src = tmp_path / "clean.pt"
    torch.save({"a": 1}, src)
    path = tmp_path / "value.pt"
    payload = b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01ctorch._utils\nFloatStorage\ns."
    tools().rewrite_zip(src, path, replace={"data.pkl": payload})
    assert "StorageType" in str(torch.load(path, weights_only=False)["a"])
    assert ct.inspect(str(path)).unsafe_globals == ("torch._utils.FloatStorage",)


def test_a_called_tensor_class_is_refused_without_blaming_torch(tmp_path: Path) -> None:
    src = tmp_path / "clean.pt"
    torch.save({"a": 1}, src)
    path = tmp_path / "called.pt"
    tools().rewrite_zip(src, path, replace={"data.pkl": _calling("torch", "FloatTensor")})
    assert torch.load(path, weights_only=True)["a"].shape == (0,)  # torch builds an empty one
    with pytest.raises(CorruptCheckpointError, match=r"calls torch\.FloatTensor to build") as info:
        ct.inspect(str(path))
    assert "torch refuses" not in str(info.value)


@pytest.mark.parametrize(
    ("size", "stride"),
    [((2**32, 2**32, 0), (1, 1, 1)), ((2**31, 2**32), (0, 0))],
    ids=["past-64-bits-then-0", "2**63-elements"],
)
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_size_whose_element_count_overflows_is_refused(
    tmp_path: Path, size: tuple[int, ...], stride: tuple[int, ...], legacy: bool
) -> None:
    path = tmp_path / "numel.pt"
    storage = torch.ones(1)._typed_storage()
    hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    call = _Rebuild(torch._utils._rebuild_tensor_v2, (storage, 0, size, stride, False, hooks))
    torch.save({"w": call}, path, _use_new_zipfile_serialization=not legacy)
    assert "numel: integer multiplication overflow" in _torch_error(path)
    _refused(path, CorruptCheckpointError, 4, "more elements than torch counts")

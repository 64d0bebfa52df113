"""Storage keys are read as torch reads them: by the object the pickle holds, not its text.

torch keeps ``"0"`` and ``0`` (or ``b"\\xfe"`` and ``b"\\xff"``) apart as two storages; a reader
keyed by their text would make them one, and a tensor would read the other's bytes. Such
keys are refused; keys of one type load as torch loads them. A zip names a storage's record
``data/{key}`` as Python formats the key, a legacy file matches its key list to the pickle's
keys by equality. Oracle: ``torch.load(weights_only=True)`` of each hand-made file.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import CorruptCheckpointError


class _Storage:
    """A storage by the persistent id the pickler writes for it."""

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Tensor:
    """A float tensor of ``n`` elements over ``storage``, pickled as torch.save does."""

    def __init__(self, storage: _Storage, n: int) -> None:
        self.args = (storage, 0, (n,), (1,), False, collections.OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Storage) else None


def _pickled(obj: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def _zip(path: Path, keys: tuple[Any, Any], records: dict[str, bytes]) -> Path:
    obj = {
        name: _Tensor(_Storage(("storage", torch.FloatStorage, key, "cpu", 4)), 4)
        for name, key in zip("ab", keys)
    }
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", _pickled(obj))
        z.writestr("archive/byteorder", "little")
        for name, data in records.items():
            z.writestr(f"archive/data/{name}", data)
        z.writestr("archive/version", "3\n")
    return path


def _legacy(path: Path, keys: tuple[Any, Any], listed: tuple[Any, Any] | None = None) -> Path:
    obj = {
        name: _Tensor(_Storage(("storage", torch.FloatStorage, key, "cpu", 4, None)), 4)
        for name, key in zip("ab", keys)
    }
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}}
    with open(path, "wb") as f:
        for header in (0x1950A86A20F9469CFC6C, 1001, sys_info):
            f.write(pickle.dumps(header, protocol=2))
        f.write(_pickled(obj))
        f.write(pickle.dumps(list(listed or keys), protocol=2))
        for values in ((0.0, 1, 2, 3), (4.0, 5, 6, 7)):
            f.write(struct.pack("<q", 4) + struct.pack("<4f", *values))
    return path


_FOUR = struct.pack("<4f", 0, 1, 2, 3)


@pytest.mark.parametrize(
    "keys", [("0", 0), ("0", b"0"), (b"\xfe", b"\xff")], ids=["str-int", "str-bytes", "bytes"]
)
def test_legacy_keys_torch_keeps_apart_are_refused(tmp_path: Path, keys: tuple) -> None:
    path = _legacy(tmp_path / "two.pt", keys)
    theirs = torch.load(path, weights_only=True)
    assert theirs["a"].tolist() == [0, 1, 2, 3] and theirs["b"].tolist() == [4, 5, 6, 7]
    for read in (ct.inspect, lambda p: ct.load_state_dict(p, map_location="cpu")):
        with pytest.raises(CorruptCheckpointError, match="torch keeps them apart"):
            read(path)


def test_zip_keys_torch_keeps_apart_are_refused(tmp_path: Path) -> None:
    # torch reads data/0 twice, into two storages: writing one tensor leaves the other.
    path = _zip(tmp_path / "two.pt", ("0", 0), {"0": _FOUR})
    theirs = torch.load(path, weights_only=True)
    assert theirs["a"].untyped_storage().data_ptr() != theirs["b"].untyped_storage().data_ptr()
    with pytest.raises(CorruptCheckpointError, match="torch keeps them apart"):
        ct.load_state_dict(path, map_location="cpu")


def test_legacy_key_list_is_matched_by_equality_as_torch_matches_it(tmp_path: Path) -> None:
    # The pickle says "0" and "1", the key list 0 and 1: torch finds no such storages.
    path = _legacy(tmp_path / "list.pt", ("0", "1"), listed=(0, 1))
    with pytest.raises(AssertionError, match="storage key 0 not found"):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="storage key 0 is not in the pickle"):
        ct.inspect(path)


def test_a_zip_bytes_key_names_the_record_python_formats(tmp_path: Path) -> None:
    # torch reads the record data/b'0' for the key b"0"; data/0 is not it.
    path = _zip(tmp_path / "bytes.pt", (b"0", b"0"), {"0": _FOUR})
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError):
        ct.load_state_dict(path, map_location="cpu")


@pytest.mark.parametrize("key", ["0", 0], ids=["str", "int"])
def test_keys_of_one_type_load_as_torch_loads_them(tmp_path: Path, key: Any) -> None:
    for path in (
        _zip(tmp_path / "z.pt", (key, key), {"0": _FOUR}),
        _legacy(tmp_path / "l.pt", (key, "1" if isinstance(key, str) else 1)),
    ):
        theirs = torch.load(path, weights_only=True)
        ours = ct.load_state_dict(path, map_location="cpu")
        for name in "ab":
            assert torch.equal(ours[name], theirs[name]), (path.name, name)
        shared = (
            theirs["a"].untyped_storage().data_ptr() == theirs["b"].untyped_storage().data_ptr()
        )
        assert (
            ours["a"].untyped_storage().data_ptr() == ours["b"].untyped_storage().data_ptr()
        ) == shared

"""``scan`` of storage records: the raw tensor bytes torch reads for each storage the pickle
names (``archive/data/<key>``) are data, never a pickle, whatever their first bytes spell;
a record that no storage names is searched for a pickle as before. torch is the oracle."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools import scan
from tests.helpers.cli import run_ckpt
from tests.helpers.scan_corpus import data_pkl_name, torch_bytes, write_zip, zip_records

# Whole pickles that would run code, as raw tensor bytes.
_SYSTEM = b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R."
_EVAL_P0 = b"cbuiltins\neval\n(S'1+1'\ntR."


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


# name -> a state dict whose tensors' bytes start like a pickle.
PICKLE_LIKE = {
    "mark-ext2": lambda: {"w": torch.tensor([33576], dtype=torch.int32)},
    "proto-global": lambda: {"w": _u8(_SYSTEM)},
    "protocol-0-global": lambda: {"w": _u8(_EVAL_P0), "b": torch.ones(2)},
    "many-tiny": lambda: {f"t{i}": torch.tensor([33576 + i], dtype=torch.int32) for i in range(64)},
    "int64": lambda: {"w": torch.frombuffer(bytearray(_SYSTEM[:24]), dtype=torch.int64).clone()},
}


def _saved(path: Path, name: str, **kwargs: object) -> dict[str, torch.Tensor]:
    sd = PICKLE_LIKE[name]()
    torch.save(sd, path, **kwargs)
    loaded = torch.load(path, weights_only=True)  # the oracle: torch reads no pickle there
    assert sd.keys() == loaded.keys() and all(torch.equal(sd[k], loaded[k]) for k in sd)
    return sd


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("name", sorted(PICKLE_LIKE))
def test_tensor_bytes_that_spell_a_pickle_are_clean(
    tmp_path: Path, name: str, legacy: bool
) -> None:
    path = tmp_path / "model.pt"
    _saved(path, name, _use_new_zipfile_serialization=not legacy)
    (found,) = scan(path).files
    assert (found.verdict, found.findings, found.error) == ("clean", (), None)


def test_the_command_calls_such_a_file_clean(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    _saved(path, "mark-ext2")
    assert "clean" in run_ckpt("scan", path, code=0).stdout


def test_a_remote_file_with_such_bytes_is_clean(hub, tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    _saved(path, "proto-global")
    url = hub.put("org/storages", path.name, path)
    (found,) = scan(url).files
    assert (found.verdict, found.findings) == ("clean", ())


# Bytes that spell a pickle's import, and the global a walk names in them.
PAYLOADS = {
    "proto-global": (_SYSTEM, "os.system"),
    "protocol-0-global": (_EVAL_P0, "builtins.eval"),
    "mark-ext2": (bytes.fromhex("28830000"), "<copyreg extension code>"),
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("record", ["archive/data/7", "archive/extra/blob"])
def test_a_record_no_storage_names_is_still_searched(
    tmp_path: Path, payload: str, record: str
) -> None:
    data, global_name = PAYLOADS[payload]
    path = tmp_path / "archive.pt"  # torch.save names the zip's folder after the file
    torch.save({"w": _u8(data)}, path)  # data/0 holds the same bytes: torch reads them raw
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(record, data)
    assert torch.equal(torch.load(path, weights_only=True)["w"], _u8(data))
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert [(f.global_name, f.record) for f in found.findings] == [(global_name, record)]


def test_a_storage_record_named_as_a_pickle_is_still_searched(tmp_path: Path) -> None:
    # torch.save never names a storage so; another loader may read such a record by name.
    records = zip_records(torch_bytes({"w": _u8(_SYSTEM)}))
    name = data_pkl_name(records)
    root = name.rsplit("/", 1)[0]
    key = b"X\x01\x00\x00\x000"  # BINUNICODE "0", the storage's key
    assert records[name].count(key) == 1
    records[name] = records[name].replace(key, b"X\x05\x00\x00\x000.pkl")
    records[f"{root}/data/0.pkl"] = records.pop(f"{root}/data/0")
    path = tmp_path / "named.pt"
    write_zip(path, records)
    assert torch.equal(torch.load(path, weights_only=True)["w"], _u8(_SYSTEM))
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert [(f.global_name, f.record) for f in found.findings] == [
        ("os.system", f"{root}/data/0.pkl")
    ]


def test_where_the_pickle_cannot_be_read_every_record_is_searched(tmp_path: Path) -> None:
    # The storage keys are unknown, so no record is taken for a storage's.
    records = zip_records(torch_bytes({"w": _u8(_SYSTEM)}))
    name = data_pkl_name(records)
    records[name] = records[name][:-1]  # no STOP: torch cannot read it either
    path = tmp_path / "cut.pt"
    write_zip(path, records)
    with pytest.raises((pickle.UnpicklingError, EOFError)):
        torch.load(path, weights_only=True)
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert [f.global_name for f in found.findings] == ["os.system"]
    assert found.findings[0].record.endswith("/data/0")


def test_a_storage_record_does_not_hide_an_unsafe_pickle(tmp_path: Path) -> None:
    # The pickle itself is still judged: only its storages' bytes are data.
    obj = {"w": _u8(_SYSTEM), "f": pickle.loads}
    path = tmp_path / "mixed.pt"
    torch.save(obj, path)
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert [f.global_name for f in found.findings] == ["pickle.loads"]
    assert found.findings[0].record.endswith("/data.pkl")


@pytest.mark.parametrize("length", [(1 << 64) - 1, 1 << 63, 1 << 40])
def test_tensor_bytes_declaring_a_frame_no_file_holds_leave_a_refused_file_unreadable(
    tmp_path: Path, length: int
) -> None:
    # A torch file torch refuses (a byte appended) is searched record by record; a tensor
    # whose bytes begin like PROTO 4 and a FRAME of ``length`` bytes is no pickle there.
    frame = b"\x80\x04\x95" + length.to_bytes(8, "little") + bytes(5)
    path = tmp_path / "frame.pt"
    torch.save({"w": _u8(frame)}, path)
    with open(path, "ab") as f:
        f.write(b"\0")
    (found,) = scan(path).files
    assert found.verdict == "unreadable"
    _, out, err = run_ckpt("scan", path, code=4)
    assert "unreadable" in out and "Traceback" not in err

"""Memo bombs: a few hundred bytes of pickle that expand to 2**60 nodes when walked as a tree.

The unpickler hashes every dict key as it builds it, and hashing a tuple walks it as a tree,
so such a pickle, unpickled, would hang ``ckpt inspect`` and every rewrite. It is refused (exit 5)
before anything is unpickled, and a file with heavy but honest sharing still reads. A memo
index far past anything stored is refused too (the C unpickler allocates a table that large).
"""

from __future__ import annotations

import io
import pickle
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.errors import EXIT_RESOURCE, CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats import open_checkpoint
from tests.helpers import console_script

DOUBLINGS = 60


def _bomb(by: str) -> bytes:
    """``{DAG: None}`` where DAG is a tuple of two references to a tuple of two ... (2**60)."""
    body = b"\x80\x02}N"  # PROTO 2, EMPTY_DICT, NONE
    for i in range(DOUBLINGS):
        if by == "dup":
            body += b"2\x86"  # DUP, TUPLE2
        else:  # memo: BINPUT i, BINGET i, TUPLE2
            body += b"q" + bytes([i % 256]) + b"h" + bytes([i % 256]) + b"\x86"
    return body + b"Ns."  # NONE, SETITEM, STOP


def _legacy_head() -> bytes:
    """The pickles torch's legacy writer puts before the main one: magic, protocol, sys_info."""
    sys_info = {
        "protocol_version": 1001,
        "little_endian": True,
        "type_sizes": {"short": 2, "int": 4, "long": 4},
    }
    return b"".join(pickle.dumps(v, protocol=2) for v in (0x1950A86A20F9469CFC6C, 1001, sys_info))


def _in_torch_zip(tmp_path: Path, data_pkl: bytes) -> Path:
    """A real torch.save archive with its data.pkl replaced."""
    clean = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, clean)
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(clean) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            payload = data_pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info, payload)
    return path


def _contained(tmp_path: Path, container: str, payload: bytes, stem: str) -> Path:
    """``payload`` as a bare pickle, after torch's legacy head, or as a torch zip's data.pkl."""
    if container == "torch-zip":
        return _in_torch_zip(tmp_path, payload)
    path = tmp_path / f"{stem}.{'pkl' if container == 'pickle' else 'pt'}"
    path.write_bytes(payload if container == "pickle" else _legacy_head() + payload)
    return path


def _refused(path: Path, match: str, words: str) -> None:
    """Refused by the library, and by ``ckpt inspect`` with exit 5 and one line."""
    with pytest.raises(ResourceLimitError, match=match):
        ckpt_tools.inspect(path)
    run = subprocess.run(
        [console_script(), "inspect", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == EXIT_RESOURCE, run.stderr
    assert run.stderr.count("\n") == 1 and words in run.stderr


@pytest.mark.parametrize("by", ["dup", "memo"])
@pytest.mark.parametrize("container", ["pickle", "torch-legacy", "torch-zip"])
def test_a_memo_bomb_is_refused_before_unpickling(tmp_path: Path, by: str, container: str) -> None:
    _refused(_contained(tmp_path, container, _bomb(by), "bomb"), "memo bomb", "memo bomb")


def test_heavy_honest_sharing_still_reads(tmp_path: Path) -> None:
    """One storage viewed by many tensors, and one dict referenced from many places."""
    base = torch.arange(64.0)
    config = {"layers": list(range(100))}
    obj = {f"v{i}": base[i:] for i in range(64)} | {f"cfg{i}": config for i in range(200)}
    path = tmp_path / "shared.pt"
    torch.save(obj, path)
    assert len(ckpt_tools.inspect(path).tensors) == 64


def test_a_small_bomb_is_a_dag_pickle_loads_and_torch_agrees(tmp_path: Path) -> None:
    """Control: below the limit the same shape loads, as a shared DAG, in Python and torch."""
    small = _bomb("dup").replace(b"2\x86" * DOUBLINGS, b"2\x86" * 8)
    loaded = pickle.loads(small)
    (key,) = loaded
    assert key[0] is key[1]
    path = tmp_path / "small.pkl"
    path.write_bytes(small)
    ckpt_tools.inspect(path)  # no error: 2**8 nodes


@pytest.mark.parametrize("put", [b"r\xff\xff\xff\x7f", b"p2147483647\n"])
@pytest.mark.parametrize("container", ["pickle", "torch-legacy", "torch-zip"])
def test_a_huge_memo_index_is_refused_before_the_table_is_allocated(
    tmp_path: Path, put: bytes, container: str
) -> None:
    # The C unpickler grows (and zero-fills) its memo table up to the index: 16 GiB here.
    bomb = b"\x80\x02}" + put + b"NNs."  # {None: None}, the dict stored at memo index 2**31-1
    path = _contained(tmp_path, container, bomb, "index")
    _refused(path, "memo index 2,147,483,647", "memo index")


def test_a_bomb_behind_an_argument_only_the_unpickler_reads_is_refused(tmp_path: Path) -> None:
    """``I0x1`` is an int to the C unpickler and an error to the check, whose walk stops
    there: the unpickler is given no byte past that point, so the bomb after it never runs."""
    path = tmp_path / "bomb.pkl"
    path.write_bytes(b"\x80\x02I0x1\n0}N" + b"2\x86" * 40 + b"Ns.")
    with pytest.raises(CorruptCheckpointError, match="malformed or truncated at byte 2"):
        open_checkpoint(path)

"""Safetensors headers are checked as strictly as the safetensors crate.

Each hostile file is also opened with ``safetensors.safe_open``: every file it refuses, we
refuse with exit 4; the valid edge cases it reads, we read with the same tensors.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats import open_checkpoint

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPT, *args], capture_output=True, text=True, timeout=60)


def _write(path: Path, header: str, data: bytes) -> Path:
    raw = header.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _entry(begin: Any, end: Any, dtype: str = "F32", shape: Any = (2,)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _json(entries: dict[str, Any]) -> str:
    return json.dumps(entries)


HOSTILE: dict[str, tuple[str, bytes]] = {
    "overlapping": (_json({"a": _entry(0, 8), "b": _entry(4, 12)}), bytes(12)),
    "gap": (_json({"a": _entry(0, 8), "b": _entry(12, 20)}), bytes(20)),
    "trailing-bytes": (_json({"a": _entry(0, 8)}), bytes(12)),
    "float-offsets": (_json({"a": _entry(0.0, 8.0)}), bytes(8)),
    "bool-offsets": (_json({"a": _entry(False, True, dtype="U8", shape=(1,))}), bytes(1)),
    "string-offsets": (_json({"a": _entry("0", "8")}), bytes(8)),
    "three-offsets": (_json({"a": {**_entry(0, 8), "data_offsets": [0, 8, 8]}}), bytes(8)),
    "float-shape": (_json({"a": _entry(0, 8, shape=(2.0,))}), bytes(8)),
    "negative-shape": (_json({"a": _entry(0, 8, shape=(-2,))}), bytes(8)),
    "size-mismatch": (_json({"a": _entry(0, 8, shape=(3,))}), bytes(8)),
    "end-before-begin": (_json({"a": _entry(8, 0)}), bytes(8)),
    "unknown-dtype": (_json({"a": _entry(0, 8, dtype="F31")}), bytes(8)),
    "metadata-not-strings": (_json({"__metadata__": {"k": 1}, "a": _entry(0, 8)}), bytes(8)),
    "metadata-not-object": (_json({"__metadata__": ["k"], "a": _entry(0, 8)}), bytes(8)),
    "nan": ('{"a": ' + _json(_entry(0, 8)) + ', "__metadata__": {"k": NaN}}', bytes(8)),
    "lone-surrogate": ('{"\\ud800": ' + _json(_entry(0, 8)) + "}", bytes(8)),
    "not-an-object": ("[1, 2]", b""),
    # serde_json reads -0 as a float, and numbers past a float's range not at all.
    "minus-zero-offset": (
        '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [-0, 8]}}',
        bytes(8),
    ),
    "minus-zero-shape": ('{"a": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}', b""),
    "huge-float": (
        '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1e999}}',
        bytes(8),
    ),
    "huge-int": (
        '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1' + "0" * 400 + "}}",
        bytes(8),
    ),
}


def _safetensors_reads(path: Path) -> dict[str, np.ndarray] | Exception:
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # the crate raises SafetensorError; odd JSON gives others
        return e


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
def test_what_safetensors_refuses_we_refuse_with_exit_4(
    case: tuple[str, bytes], tmp_path: Path
) -> None:
    path = _write(tmp_path / "bad.safetensors", *case)
    assert isinstance(_safetensors_reads(path), Exception), "the oracle reads it"
    with pytest.raises(CorruptCheckpointError, match=r"bad\.safetensors"):
        open_checkpoint(path)
    result = _ckpt("inspect", str(path))
    assert result.returncode == 4, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_repeated_key_is_refused_though_the_crate_takes_the_last(tmp_path: Path) -> None:
    """serde keeps the last of two equal keys and Python's json too; a reader that kept the
    first would see another tensor, so a repeated key is refused rather than resolved."""
    entry = _json(_entry(0, 8))
    twice = f'{{"a": {entry}, "a": {entry}}}'
    path = _write(tmp_path / "twice.safetensors", twice, bytes(8))
    assert isinstance(_safetensors_reads(path), dict)
    with pytest.raises(CorruptCheckpointError, match="appears twice"):
        open_checkpoint(path)
    result = _ckpt("inspect", str(path))
    assert result.returncode == 4 and "appears twice" in result.stderr, result.stderr


VALID = {
    "out-of-order": (_json({"b": _entry(8, 16), "a": _entry(0, 8)}), bytes(16)),
    "empty-tensor-between": (
        _json({"a": _entry(0, 8), "e": _entry(8, 8, shape=(0, 3)), "b": _entry(8, 16)}),
        bytes(16),
    ),
    "padded-header": (_json({"a": _entry(0, 8)}) + "    ", bytes(8)),
    "nothing": ("{}", b""),
    "metadata": (_json({"__metadata__": {"format": "pt"}, "a": _entry(0, 8)}), bytes(8)),
}


@pytest.mark.parametrize("case", VALID.values(), ids=VALID.keys())
def test_what_safetensors_reads_we_read_the_same(case: tuple[str, bytes], tmp_path: Path) -> None:
    path = _write(tmp_path / "ok.safetensors", *case)
    expected = _safetensors_reads(path)
    assert isinstance(expected, dict), expected
    ckpt = open_checkpoint(path)
    assert sorted(ckpt.root) == sorted(expected)
    with open(path, "rb") as f:
        for name, array in expected.items():
            span = ckpt.span(ckpt.root[name].storage)
            f.seek(span.offset)
            assert f.read(span.nbytes) == array.tobytes()
            assert ckpt.root[name].shape == array.shape
    assert _ckpt("inspect", str(path)).returncode == 0


def test_a_file_saved_by_safetensors_opens(tmp_path: Path) -> None:
    path = tmp_path / "saved.safetensors"
    save_file({"a": np.ones((2, 3), np.float16), "b": np.zeros(0, np.int64)}, str(path))
    assert sorted(open_checkpoint(path).root) == ["a", "b"]


@pytest.mark.parametrize("claimed", [100_000_001, 1 << 62], ids=["just-over", "4-EiB"])
def test_a_header_over_the_crates_limit_is_a_resource_limit(tmp_path: Path, claimed: int) -> None:
    # The crate refuses it ("header too large"); named .safetensors and opening with "{",
    # it is an implausible safetensors file (exit 5), not a file of no known format (exit 4).
    head = ('{"a": ' + _json(_entry(0, 8)) + "}").encode()
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", claimed) + head + bytes(8))
    assert isinstance(_safetensors_reads(path), Exception), "the oracle reads it"
    with pytest.raises(ResourceLimitError, match="over the 100000000 byte limit"):
        open_checkpoint(path)
    result = _ckpt("inspect", str(path))
    assert result.returncode == 5 and len(result.stderr.strip().splitlines()) == 1, result.stderr

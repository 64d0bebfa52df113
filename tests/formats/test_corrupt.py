"""Corrupt, truncated and unsupported input: a typed error, exit code 4, one clear line."""

from __future__ import annotations

import errno
import json
import shutil
import struct
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckpt_tools
from ckpt_tools import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LfsPointerError,
    UnsupportedFormatError,
)
from ckpt_tools.cli.main import main
from ckpt_tools.errors import EXIT_CORRUPT, EXIT_USAGE
from tests.helpers import fixture_path, run_ckpt, tools, truncated_copy


@dataclass(frozen=True)
class Case:
    """A broken input: how to make it in a folder, the error it gives, words its message has."""

    id: str
    make: Callable[[Path], Path]
    error: type[Exception]
    match: str


def committed(name: str) -> Callable[[Path], Path]:
    return lambda tmp: fixture_path(name)


def cut(name: str, size: Callable[[int], int]) -> Callable[[Path], Path]:
    """A copy of fixture ``name`` cut to ``size(original length)`` bytes."""

    def make(tmp: Path) -> Path:
        src = fixture_path(name)
        return truncated_copy(src, tmp / src.name, size(src.stat().st_size))

    return make


def tar_cut_in_last_member(tmp: Path) -> Path:
    src = fixture_path("tar_format.pt")
    with tarfile.open(src) as tar:
        last = tar.getmembers()[-1]
    return truncated_copy(src, tmp / src.name, last.offset_data + last.size - 10)


def safetensors_out_of_range(tmp: Path) -> Path:
    """A valid header whose last tensor ends past the data section."""
    data = fixture_path("model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 64, end + 64]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp / "out_of_range.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    return path


def zip_missing_storage(tmp: Path) -> Path:
    path = tmp / "missing_storage.pt"
    tools().rewrite_zip(fixture_path("plain.pt"), path, drop=("data/3",))
    return path


CASES = [
    Case("empty", committed("empty.pt"), UnsupportedFormatError, r"is empty \(0 bytes\)"),
    Case("truncated-zip", committed("truncated.pt"), CorruptCheckpointError, r"truncated"),
    Case("random-bytes", committed("random.bin"), UnsupportedFormatError, r"not a checkpoint"),
    Case(
        "zip-without-data-pkl",
        committed("no_data_pkl.pt"),
        CorruptCheckpointError,
        r"without a data\.pkl",
    ),
    Case(
        "lfs-pointer",
        committed("lfs_pointer.pt"),
        LfsPointerError,
        r"git-lfs pointer.*git lfs pull",
    ),
    Case(
        "folder-without-checkpoint",
        committed("no_checkpoint"),
        UnsupportedFormatError,
        r"folder without a checkpoint.*\.keep",
    ),
    Case(
        "zip-missing-storage",
        zip_missing_storage,
        CorruptCheckpointError,
        r"storage '3'.*no record data/3",
    ),
    Case(
        "legacy-cut-in-last-storage",
        cut("legacy.pt", lambda n: n - 10),
        CorruptCheckpointError,
        r"is truncated: storage",
    ),
    Case(
        "legacy-cut-in-half",
        cut("legacy.pt", lambda n: n // 2),
        CorruptCheckpointError,
        r"is truncated: storage",
    ),
    Case(
        "legacy-cut-in-pickle",
        cut("legacy.pt", lambda n: 200),
        CorruptCheckpointError,
        r"malformed or truncated",
    ),
    Case(
        "safetensors-cut-in-data",
        cut("model.safetensors", lambda n: n - 10),
        CorruptCheckpointError,
        r"does not fit",
    ),
    Case(
        "safetensors-cut-in-header",
        cut("model.safetensors", lambda n: 100),
        CorruptCheckpointError,
        r"header claims \d+ bytes but the file has 92",
    ),
    Case(
        "safetensors-offsets-out-of-range",
        safetensors_out_of_range,
        CorruptCheckpointError,
        r"byte range \[\d+, \d+\) that does not fit",
    ),
    Case(
        "tar-cut-in-last-member",
        tar_cut_in_last_member,
        CorruptCheckpointError,
        r"cannot be read \(ReadError: unexpected end of data\)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_library_raises_the_typed_error(case: Case, tmp_path: Path) -> None:
    path = case.make(tmp_path)
    with pytest.raises(case.error, match=case.match) as caught:
        ckpt_tools.inspect(path)
    assert type(caught.value) is case.error


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_exit_code_and_one_line(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = case.make(tmp_path)
    assert main(["inspect", str(path)]) == EXIT_CORRUPT
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("ckpt: error: ")
    assert "Traceback" not in err


def test_missing_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointNotFoundError, match=r"no such file or folder.*nope\.pt"):
        ckpt_tools.inspect(missing)
    assert main(["inspect", str(missing)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.pt" in err


def test_ckpt_debug_shows_the_traceback() -> None:
    command = ["inspect", fixture_path("truncated.pt")]
    quiet = run_ckpt(*command, how="module", code=None)
    loud = run_ckpt(*command, how="module", env={"CKPT_DEBUG": "1"}, code=None)
    assert quiet.returncode == EXIT_CORRUPT and "Traceback" not in quiet.stderr
    assert loud.returncode == EXIT_CORRUPT
    assert loud.stderr.endswith(quiet.stderr)  # the same line, after the traceback
    assert "Traceback (most recent call last)" in loud.stderr
    assert "CorruptCheckpointError" in loud.stderr


def test_a_path_that_names_nothing_says_why(tmp_path: Path) -> None:
    # torch says "Too many levels of symbolic links" and "Not a directory"; a hub cache
    # snapshot whose blob never arrived is a symlink to nothing: each is named as it is.
    plain = tmp_path / "plain.pt"
    shutil.copyfile(fixture_path("model.pt"), plain)
    (tmp_path / "loop_a").symlink_to("loop_b")
    (tmp_path / "loop_b").symlink_to("loop_a")
    (tmp_path / "model.safetensors").symlink_to("blobs/deadbeef")
    (tmp_path / "chain").symlink_to("loop_c")  # a link that exists, to one that leads nowhere
    (tmp_path / "loop_c").symlink_to("end")
    cases = {
        "loop_a": r"'.*loop_a': a symlink loop",
        "model.safetensors": r"'.*model\.safetensors' is a symlink to 'blobs/deadbeef', and "
        r"'.*/blobs/deadbeef' does not exist",
        "chain": r"'.*chain' is a symlink to 'loop_c', and '.*/end' does not exist",
        "plain.pt/": r"'.*plain\.pt/': '.*plain\.pt' is a file, not a folder",
        "plain.pt/inner.pt": r"'.*plain\.pt' is a file, not a folder",
        "nope.pt": r"no such file or folder: '.*nope\.pt'; check the path",
    }
    for name, expected in cases.items():
        path = f"{tmp_path}/{name}"
        with pytest.raises(CheckpointNotFoundError, match=expected) as caught:
            ckpt_tools.load_state_dict(path)
        # A FileNotFoundError as the built-in is: handlers that test errno keep working.
        assert (caught.value.errno, caught.value.filename) == (errno.ENOENT, path)
        assert main(["inspect", path]) == EXIT_USAGE
    with pytest.raises(CheckpointNotFoundError, match="is a symlink to 'blobs/deadbeef'"):
        ckpt_tools.average([plain, tmp_path / "model.safetensors"], tmp_path / "mean.pt")
    # A hub snapshot folder whose weights never arrived: the folder names its dangling link.
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").symlink_to("../blobs/0123abcd")
    with pytest.raises(CheckpointNotFoundError, match=r"is a symlink to '\.\./blobs/0123abcd'"):
        ckpt_tools.inspect(snapshot)
    # A file beside such a link is read and written beside it as ever.
    ckpt_tools.convert(plain, tmp_path / "beside.pt")
    from tests.helpers.lora import write_tiny_adapter

    adapter = write_tiny_adapter(tmp_path / "merge" / "adapter")
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to("../blobs/feed")
    with pytest.raises(CheckpointNotFoundError, match=r"is a symlink to '\.\./blobs/feed'"):
        ckpt_tools.merge_lora(fixture_path("model.pt"), adapter, tmp_path / "merge" / "out.pt")
    with pytest.raises(CheckpointNotFoundError, match=r"plain\.pt' is a file, not a folder"):
        ckpt_tools.scan(f"{plain}/inner.pt")  # scan says why as the readers do

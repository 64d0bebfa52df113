"""``formats.base.RangeFile``: the files the pickle reader reads by ``pread`` (a tar member,
a remote object) seek, tell and read as a file does; the oracle is that file on disk."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_tools.formats.base import RangeFile
from ckpt_tools.formats.legacy.tar import _MemberFile
from ckpt_tools.io.remote.rangefile import RemoteFile

DATA = bytes(range(256)) * 5


class _Bytes:
    """A transport over bytes in memory."""

    url = "mem://data"

    def get(self, start: int, end: int) -> tuple[bytes, int]:
        return DATA[start:end], len(DATA)

    def close(self) -> None:
        pass


@pytest.fixture(params=["tar member", "remote"])
def ranged(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RangeFile]:
    if request.param == "remote":
        yield RemoteFile(_Bytes())
        return
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        tar.addfile(tarfile.TarInfo("pad"), io.BytesIO())
        info = tarfile.TarInfo("member")
        info.size = len(DATA)
        tar.addfile(info, io.BytesIO(DATA))
    fd = os.open(archive, os.O_RDONLY)
    try:
        with tarfile.open(archive) as tar:
            yield _MemberFile(fd, tar.getmember("member"))
    finally:
        os.close(fd)


# Each step: (a method, its arguments); both files must answer alike, errors included.
STEPS = [
    ("read", (10,)),
    ("tell", ()),
    ("seek", (-3, io.SEEK_CUR)),
    ("read", (4,)),
    ("seek", (-7, io.SEEK_END)),
    ("read", (100,)),
    ("read", (1,)),
    ("seek", (len(DATA) + 50, io.SEEK_SET)),
    ("read", (5,)),
    ("tell", ()),
    ("seek", (-1, io.SEEK_SET)),
    ("seek", (-len(DATA) - 1, io.SEEK_END)),
    ("tell", ()),
    ("seek", (700, io.SEEK_SET)),
    ("readinto", (bytearray(9),)),
    ("read", ()),
]


def _answer(f: object, name: str, args: tuple[object, ...]) -> object:
    try:
        got = getattr(f, name)(*args)
    except (ValueError, OSError) as e:
        return type(e), getattr(e, "errno", None)
    return bytes(args[0]) if name == "readinto" else got


def test_a_range_file_seeks_and_reads_as_a_file_does(ranged: RangeFile, tmp_path: Path) -> None:
    (tmp_path / "data").write_bytes(DATA)
    # The file itself, unbuffered: io.BytesIO would clamp a seek before the start to 0.
    with (tmp_path / "data").open("rb", buffering=0) as oracle:
        for name, args in STEPS:
            copies = [bytearray(a) if isinstance(a, bytearray) else a for a in args]
            assert _answer(ranged, name, tuple(copies)) == _answer(oracle, name, args), (name, args)
    assert ranged.pread(5, len(DATA) - 2) == DATA[-2:]
    with pytest.raises(OSError):
        ranged.pread(4, -1)  # as os.pread: never a read before the file's own start

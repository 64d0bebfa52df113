"""The zip directory reader asks for local headers together, and stays exact doing so.

``formats/zip/directory.py`` reads the central directory a window of entries at a time, asks the
kernel for the window's local headers together (``posix_fadvise(WILLNEED)``: one wait on the
disk instead of one per record, which is what a cold or freshly cloned file costs), then
checks each header. The prefetch is advisory: these tests hold the reader to ``zipfile``'s
view of the same archives read cold, and show the prefetch never fails a read where the
kernel refuses the advice.
The time it saves is measured in ``benchmarks/``, not here.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.zip.directory import (
    _PREFETCH_WINDOW,
    FileSlice,
    _prefetch,
    read_zip_directory,
)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _saved(tmp_path: Path, n: int = 40) -> Path:
    path = tmp_path / "many.pt"
    torch.save({f"module.layer{i}.weight": torch.full((64, 17), float(i)) for i in range(n)}, path)
    return path


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
@pytest.mark.parametrize("n", [40, 2 * _PREFETCH_WINDOW - 5])  # one window, and three
def test_a_cold_archive_reads_as_zipfile_reads_it(tmp_path: Path, n: int) -> None:
    path = _saved(tmp_path, n)
    _drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        cold = read_zip_directory(str(path), fd, os.fstat(fd).st_size)
        warm = read_zip_directory(str(path), fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert cold == warm
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        oracle = [(i.filename, i.header_offset, i.file_size, i.CRC) for i in infos]
        data = {i.filename: z.read(i) for i in infos}
    assert [(e.name, e.header_offset, e.file_size, e.crc32) for e in cold] == oracle
    with open(path, "rb") as f:
        for e in cold:  # each data offset is where the record's bytes are
            f.seek(e.data_offset)
            assert f.read(e.file_size) == data[e.name]


def test_an_archive_inside_a_file_reads_the_same_through_a_slice(tmp_path: Path) -> None:
    path = _saved(tmp_path, n=5)
    inner = path.read_bytes()
    outer = tmp_path / "outer.bin"
    outer.write_bytes(b"x" * 4099 + inner + b"y" * 77)
    _drop_cache(outer)
    fd_outer, fd_inner = os.open(outer, os.O_RDONLY), os.open(path, os.O_RDONLY)
    try:
        sliced = read_zip_directory(str(outer), FileSlice(fd_outer, 4099, len(inner)), len(inner))
        plain = read_zip_directory(str(path), fd_inner, len(inner))
    finally:
        os.close(fd_outer)
        os.close(fd_inner)
    assert sliced == plain


def test_extra_bytes_after_the_last_window_are_still_refused(tmp_path: Path) -> None:
    # The directory's own end check runs once every window is read: a whole window of
    # records, then bytes the end record counts but no entry holds.
    path = tmp_path / "window.zip"
    with zipfile.ZipFile(path, "w") as z:  # no zip64 records, unlike torch.save's
        for i in range(_PREFETCH_WINDOW):
            z.writestr(f"archive/data/{i}", b"x")
    data = bytearray(path.read_bytes())
    eocd = data.rindex(b"PK\x05\x06")
    count, cd_size = struct.unpack_from("<HL", data, eocd + 10)
    assert count == _PREFETCH_WINDOW
    data[eocd:eocd] = b"\0" * 16  # inside the directory, after its last entry
    struct.pack_into("<L", data, eocd + 16 + 12, cd_size + 16)
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    for name, size in ((path, len(data) - 16), (bad, len(data))):
        fd = os.open(name, os.O_RDONLY)
        try:
            if name == path:
                assert len(read_zip_directory(str(name), fd, size)) == _PREFETCH_WINDOW
                continue
            with pytest.raises(CorruptCheckpointError, match="holds more than the records"):
                read_zip_directory(str(name), fd, size)
        finally:
            os.close(fd)


def test_advice_the_kernel_refuses_is_ignored() -> None:
    read_end, write_end = os.pipe()  # fadvise on a pipe fails with ESPIPE
    try:
        _prefetch(read_end, [(0, 30), (4096, 30)])
        _prefetch(FileSlice(read_end, 10, 100), [(0, 30)])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_advice_for_an_offset_past_off_t_is_ignored(tmp_path: Path) -> None:
    # read_zip_directory refuses such an offset before advising; advice stays advisory anyway.
    path = tmp_path / "small.bin"
    path.write_bytes(b"\0" * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset in (2**63 + 5, 2**64 - 1, -1):
            _prefetch(fd, [(offset, 30)])
            _prefetch(FileSlice(fd, 2**62, 100), [(offset, 30)])
    finally:
        os.close(fd)

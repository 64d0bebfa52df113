"""pread_chunks: bounded pieces of a range, from a real descriptor, and a source ending early."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckpt_tools.io.ranges import SourceEndedError, fd_pread, pread_chunks


@pytest.fixture
def fd(tmp_path: Path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    fd = os.open(path, os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.mark.parametrize(
    ("offset", "count", "chunk"), [(0, 10240, 4096), (5, 1000, 7), (10239, 1, 1)]
)
def test_pieces_are_bounded_and_add_up_to_the_range(
    fd: int, offset: int, count: int, chunk: int
) -> None:
    pieces = list(pread_chunks(fd_pread(fd), offset, count, chunk=chunk))
    assert b"".join(pieces) == os.pread(fd, count, offset)
    assert all(0 < len(p) <= chunk for p in pieces)


def test_an_empty_range_reads_nothing(fd: int) -> None:
    assert list(pread_chunks(fd_pread(fd), 10240, 0)) == []


def test_a_source_that_ends_first_is_an_eio_after_the_bytes_it_had(fd: int) -> None:
    got = []
    with pytest.raises(SourceEndedError) as caught:
        for piece in pread_chunks(fd_pread(fd), 10000, 1000, chunk=100):
            got.append(piece)
    assert sum(map(len, got)) == 240 and (caught.value.done, caught.value.count) == (240, 1000)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.EIO
    assert "source ended after 240 of 1000 bytes" in str(caught.value)

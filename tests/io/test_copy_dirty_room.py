"""A copy that will not be fsynced uses the page cache only as far as the kernel's dirty room.

Oracles: the kernel's own counters (``/proc/vmstat``: the dirty thresholds it computed and
the pages dirty now), the source's bytes read back, and the ``CopyCounts`` of each method. A
copy's room is set by pointing :data:`ckpt_tools.io.copy.dirty_room.VMSTAT` at a file written like
``/proc/vmstat``, so that the split lands where the test says, whatever this machine is doing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.copy import dirty_room as room_module
from ckpt_tools.io.copy.clone import Writeback, copy_range
from ckpt_tools.io.copy.direct import DIRECT_MIN
from ckpt_tools.io.copy.dirty_room import dirty_room
from tests import helpers as h

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


_vmstat = h.vmstat_file


@pytest.mark.parametrize(
    ("threshold", "background", "dirty", "writeback", "pages"),
    [
        (1000, 500, 0, 0, 750),  # halfway between the two thresholds: the freerun ceiling
        (1000, 500, 600, 100, 50),  # pages dirty and under writeback use the room up
        (1000, 500, 800, 0, 0),  # past the ceiling: no room, not a negative one
        (1001, 0, 0, 0, 500),  # the kernel's integer halving
    ],
)
def test_the_room_is_the_freerun_ceiling_less_what_is_dirty(
    tmp_path: Path, threshold: int, background: int, dirty: int, writeback: int, pages: int
) -> None:
    path = _vmstat(tmp_path / "vmstat", threshold, background, dirty, writeback)
    assert dirty_room(path) == pages * PAGE


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nr_dirty 1\nnr_writeback 0\nnr_dirty_threshold 10\n",  # a counter missing
        "nr_dirty x\nnr_writeback 0\nnr_dirty_threshold 10\nnr_dirty_background_threshold 5\n",
    ],
)
def test_counters_that_cannot_be_read_give_no_room_figure(tmp_path: Path, text: str) -> None:
    (tmp_path / "vmstat").write_text(text)
    assert dirty_room(tmp_path / "vmstat") is None
    assert dirty_room(tmp_path / "missing") is None


def test_this_machines_room_is_read_from_its_kernel_counters() -> None:
    try:
        text = Path("/proc/vmstat").read_text()
    except OSError:
        pytest.skip("no /proc/vmstat (not Linux)")
    if "nr_dirty_threshold " not in text:
        pytest.skip("this kernel publishes no dirty thresholds")
    room = dirty_room()
    assert isinstance(room, int) and room % PAGE == 0


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(40 * MIB + 77))
    return path


def _copy_not_durable(src: Path, dst: Path, count: int, method: str | None = None):
    with open(src, "rb") as s, atomic_output(dst, durable=False) as out:
        counts = copy_range(
            s.fileno(),
            0,
            out.file.fileno(),
            0,
            count,
            writeback=Writeback(out.file.fileno(), durable=False),
            method=method,
        )
    assert dst.read_bytes() == src.read_bytes()[:count]
    return counts


@pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="O_DIRECT is a Linux (and BSD) flag")
def test_the_part_past_the_room_goes_straight_to_the_disk(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if h.shares_blocks(tmp_path):
        pytest.skip("this file system shares blocks: the copy clones instead")
    count = 40 * MIB
    room_pages = 12 * MIB // PAGE
    vmstat = _vmstat(tmp_path / "vmstat", 2 * room_pages, 0, 0)
    monkeypatch.setattr(room_module, "VMSTAT", vmstat)
    kernel_copies: list[tuple[int, int]] = []
    real = os.copy_file_range

    def spy(src: int, dst: int, n: int, offset_src: int, offset_dst: int) -> int:
        kernel_copies.append((offset_dst, n))
        return real(src, dst, n, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", spy)
    counts = _copy_not_durable(source, tmp_path / "split.bin", count)
    assert counts.kernel + counts.readwrite == 12 * MIB and counts.direct == count - 12 * MIB
    # The page cache takes the first 12 MiB (the room), the disk the rest, in that order.
    assert kernel_copies[0][0] == 0 and sum(n for _, n in kernel_copies) == 12 * MIB
    monkeypatch.setattr(os, "copy_file_range", real)
    # A range that ends off a page: its last part page goes through the page cache too.
    counts = _copy_not_durable(source, tmp_path / "odd.bin", count - 5)
    assert counts.kernel == 12 * MIB + PAGE - 5 and counts.direct == count - 12 * MIB - PAGE
    # Source and output offsets off the page (agreeing modulo it): direct from the first
    # output page boundary past the room, as a durable copy's direct part starts.
    part = count - 4 * PAGE
    counts, data, _ = h.copy_between(source, tmp_path / "off.bin", 3 * PAGE + 100, 100, part)
    assert data == source.read_bytes()[3 * PAGE + 100 : 3 * PAGE + 100 + part]
    assert counts.kernel == (12 * MIB + PAGE - 100) + 100  # to the boundary, and the tail
    assert counts.direct == part - 12 * MIB - PAGE
    # A room past half of the copy: the page cache takes it, the disk the 16 MiB after.
    _vmstat(vmstat, 2 * 24 * MIB // PAGE, 0, 0)
    reported: list[int] = []
    counts, data, _ = h.copy_between(
        source, tmp_path / "most.bin", 0, 0, count, progress=reported.append
    )
    assert data == source.read_bytes()[:count] and sum(reported) == count
    assert counts.kernel == 24 * MIB and counts.direct == 16 * MIB
    # Room for all of it, or no figure at all: the page cache takes everything, as before.
    _vmstat(vmstat, 2 * count // PAGE, 0, 0)
    assert _copy_not_durable(source, tmp_path / "fits.bin", count).direct == 0
    vmstat.write_text("")
    assert _copy_not_durable(source, tmp_path / "unknown.bin", count).direct == 0
    # No room at all: everything past the first page boundary goes direct.
    _vmstat(vmstat, 10, 10, 20)
    assert _copy_not_durable(source, tmp_path / "full.bin", count).direct == count
    # Under DIRECT_MIN past the room: not worth a wait on the device.
    _vmstat(vmstat, 2 * (count - DIRECT_MIN + PAGE) // PAGE, 0, 0)
    assert _copy_not_durable(source, tmp_path / "small.bin", count).direct == 0
    # A named page-cache method is the page cache, whatever the room.
    _vmstat(vmstat, 10, 10, 20)
    for method in ("copy_file_range", "readwrite"):
        assert _copy_not_durable(source, tmp_path / f"{method}.bin", count, method).direct == 0

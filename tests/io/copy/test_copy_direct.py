"""Direct (``O_DIRECT``) writes of a durable output's large ranges give the same bytes.

Oracles: the source's own bytes read back with plain file reads; ``torch.load`` and
``safetensors`` on whole rewrites; the output's file status flags as the kernel reports them;
and, for "did the direct write happen", the ``fcntl.fcntl`` audit event Python raises for
every ``fcntl`` call. Where the file system refuses ``O_DIRECT`` (ramfs) or fills up (a tiny
loopback ext4), the tests mount one when they run as root and skip otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.copy.clone import COPY_METHODS, Writeback, copy_range
from ckpt_tools.io.copy.direct import DIRECT_MIN, direct_span
from tests import helpers as h

MIB = 1 << 20
PAGE = 4096

pytestmark = pytest.mark.skipif(
    not getattr(os, "O_DIRECT", 0), reason="O_DIRECT is a Linux (and BSD) flag"
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """72 MiB of random bytes: more than one 64 MiB window of direct writes."""
    path = tmp_path_factory.mktemp("direct") / "src.bin"
    path.write_bytes(os.urandom(72 * MIB + 123))
    return path


# Copies told of their output's writeback, as every writer's are: durable unless said not.
_copy = functools.partial(h.copy_between, writeback=True)


def _expected(src: Path, offset: int, count: int) -> bytes:
    with open(src, "rb") as f:
        f.seek(offset)
        return f.read(count)


@pytest.mark.parametrize(
    ("src_offset", "dst_offset", "count"),
    [
        (0, 0, 20 * MIB),
        (0, 0, DIRECT_MIN),  # the smallest range that goes direct
        (3 * PAGE + 100, 100, 17 * MIB + 5),  # unaligned head and tail, offsets agree
        (PAGE, 0, 70 * MIB + 3 * PAGE + 7),  # two windows
    ],
)
def test_a_durable_copy_writes_whole_pages_direct_and_the_ends_through_the_cache(
    tmp_path: Path, source: Path, src_offset: int, dst_offset: int, count: int
) -> None:
    head, body = direct_span(src_offset, dst_offset, count)
    assert body >= DIRECT_MIN and (dst_offset + head) % PAGE == 0 and body % PAGE == 0
    for method in ("direct", None):  # named, and the default for a durable output
        reported: list[int] = []
        counts, data, flags = _copy(
            source,
            tmp_path / "dst.bin",
            src_offset,
            dst_offset,
            count,
            method,
            progress=reported.append,
        )
        assert data == _expected(source, src_offset, count)
        assert sum(reported) == count  # every byte reported once, whichever way it went
        if method is None and counts.cloned:
            continue  # a file system with reflinks shared the blocks instead
        assert counts.direct == body
        assert counts.direct + counts.kernel + counts.readwrite == count
        assert not flags & os.O_DIRECT  # the output's flags are as they were


def test_a_copy_that_is_not_fsynced_stays_in_the_page_cache(tmp_path: Path, source: Path) -> None:
    # --no-fsync: the bytes need not reach the disk before the command ends; they go through
    # the page cache, as `cp` copies.
    for durable in (False, True):
        with (
            open(source, "rb") as s,
            atomic_output(tmp_path / f"{durable}.bin", durable=durable) as out,
        ):
            told = Writeback(out.file.fileno(), durable=out.durable)
            counts = copy_range(s.fileno(), 0, out.file.fileno(), 0, 20 * MIB, writeback=told)
        assert (tmp_path / f"{durable}.bin").read_bytes() == _expected(source, 0, 20 * MIB)
        if not counts.cloned:
            assert counts.direct == (20 * MIB if durable else 0)
    # Without a writeback to tell, a copy is not known to be durable: not direct either.
    counts, data, _ = _copy(source, tmp_path / "x.bin", 0, 0, 20 * MIB, writeback=False)
    assert counts.direct == 0 and data == _expected(source, 0, 20 * MIB)


@pytest.mark.parametrize(
    ("src_offset", "dst_offset", "count"),
    [
        (100, 0, 20 * MIB),  # offsets disagree modulo the page: memory would be unaligned
        (0, 0, DIRECT_MIN - PAGE),  # too small to be worth a wait on the device
        (PAGE - 1, PAGE - 1, DIRECT_MIN),  # under DIRECT_MIN once the ends are cut
    ],
)
def test_ranges_direct_writes_cannot_take_go_through_the_page_cache(
    tmp_path: Path, source: Path, src_offset: int, dst_offset: int, count: int
) -> None:
    assert direct_span(src_offset, dst_offset, count) == (0, 0)
    counts, data, _ = _copy(source, tmp_path / "dst.bin", src_offset, dst_offset, count, "direct")
    assert counts.direct == 0 and counts.kernel + counts.readwrite == count
    assert data == _expected(source, src_offset, count)


def test_a_short_source_is_an_error_and_does_not_rule_out_the_device(
    tmp_path: Path, source: Path
) -> None:
    size = source.stat().st_size
    # The first window is written direct, the second cannot be mapped: the page-cache copy
    # takes the rest over and finds the source's end.
    with pytest.raises(OSError, match="source ended after"):
        _copy(source, tmp_path / "a.bin", 0, 0, size + 8 * MIB, "direct")
    # One window, past the end from the start (offsets that agree: it gets as far as mapping).
    start = (size - 10 * MIB) // PAGE * PAGE
    assert direct_span(start, 0, 20 * MIB) == (0, 20 * MIB)
    with pytest.raises(OSError, match="source ended after"):
        _copy(source, tmp_path / "b.bin", start, 0, 20 * MIB, "direct")
    counts, data, _ = _copy(source, tmp_path / "c.bin", 0, 0, 20 * MIB, "direct")
    assert counts.direct == 20 * MIB and data == _expected(source, 0, 20 * MIB)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A mounted ramfs: a file system whose files refuse ``O_DIRECT`` (EINVAL)."""
    yield from h.mounted("ramfs", tmp_path / "ramfs", "-t", "ramfs", "none")


def test_a_file_system_that_refuses_direct_writes_gets_a_page_cache_copy(
    ramfs: Path, source: Path
) -> None:
    probe = os.open(ramfs / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as refused:
            fcntl.fcntl(probe, fcntl.F_SETFL, fcntl.fcntl(probe, fcntl.F_GETFL) | os.O_DIRECT)
        assert refused.value.errno == errno.EINVAL
    finally:
        os.close(probe)
    for name in ("first", "again"):  # refused each time it is asked
        counts, data, flags = _copy(source, ramfs / f"{name}.bin", 0, 0, 20 * MIB, "direct")
        assert counts.direct == 0 and counts.kernel + counts.readwrite == 20 * MIB
        assert data == _expected(source, 0, 20 * MIB) and not flags & os.O_DIRECT
    # The same source onto tmp_path's file system still goes direct: the refusal was the
    # output's file system's, not the source's.
    shutil.copy(source, ramfs / "src.bin")
    counts, data, _ = _copy(ramfs / "src.bin", source.parent / "from_ramfs.bin", 0, 0, 20 * MIB)
    assert data == _expected(source, 0, 20 * MIB)
    if not counts.cloned:
        assert counts.direct == 20 * MIB


@pytest.fixture
def tiny_ext4(tmp_path: Path) -> Iterator[Path]:
    """A mounted 16 MiB ext4: too small for the copies below."""
    yield from h.loop_mounted(tmp_path, 16 * MIB, ["mkfs.ext4", "-q", "-F"], "loopback ext4")


def test_a_full_disk_is_an_error_not_a_reason_to_try_another_way(
    tiny_ext4: Path, source: Path
) -> None:
    with open(source, "rb") as s, open(tiny_ext4 / "out.bin", "wb") as d:
        with pytest.raises(OSError) as full:
            copy_range(s.fileno(), 0, d.fileno(), 0, 20 * MIB, method="direct")
        assert full.value.errno == errno.ENOSPC
        assert not fcntl.fcntl(d.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    # Once there is room again, the same disk takes direct writes as before.
    (tiny_ext4 / "out.bin").unlink()
    counts, data, _ = _copy(source, tiny_ext4 / "fits.bin", 0, 0, DIRECT_MIN, "direct")
    assert counts.direct == DIRECT_MIN and data == _expected(source, 0, DIRECT_MIN)


# Counts the fcntl calls that set O_DIRECT (Python raises the audit event "fcntl.fcntl" for
# each) while one rewrite runs, in a process of its own: an audit hook cannot be removed.
_COUNT_DIRECT = """
import fcntl, os, sys
from ckpt_tools.ops.rewrite.rewriting import strip_module

seen = []
if len(sys.argv) > 4:  # the method every copy tries first (the writers name none)
    from ckpt_tools.io.copy.clone import copy_range

    copy_range.__kwdefaults__["method"] = sys.argv[4]

def hook(event, args):
    if event == "fcntl.fcntl" and args[1] == fcntl.F_SETFL and args[2] & os.O_DIRECT:
        seen.append(args[0])

sys.addaudithook(hook)
strip_module(sys.argv[1], sys.argv[2], durable=sys.argv[3] == "durable")
print(len(seen))
"""


def _direct_writes(src: Path, dst: Path, durable: bool = True, method: str = "") -> int:
    args = [str(src), str(dst), "durable" if durable else "no", *([method] if method else [])]
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_DIRECT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_durable_rewrite_writes_its_tensor_bytes_direct_with_every_method_alike(
    tmp_path: Path, suffix: str
) -> None:
    g = torch.Generator().manual_seed(13)
    # Odd sizes, so the records and the data section start off the page boundary.
    sd = {f"module.w{i}": torch.randn(1000 + 7 * i, 701, generator=g) for i in range(8)}
    src = tmp_path / f"in{suffix}"
    if suffix == ".pt":
        h.save(sd, src)
    else:
        save_file(sd, src)
    if h.shares_blocks(tmp_path):
        pytest.skip("this file system shares blocks: a rewrite clones instead")
    durable = tmp_path / f"durable{suffix}"
    assert _direct_writes(src, durable) == 1
    # Not durable: all through the page cache.
    cached = tmp_path / f"cached{suffix}"
    assert _direct_writes(src, cached, durable=False) == 0
    outputs = {"durable": durable.read_bytes(), "not durable": cached.read_bytes()}
    for method in COPY_METHODS:
        dst = tmp_path / f"{method}{suffix}"
        seen = _direct_writes(src, dst, method=method)
        assert seen == (1 if method in ("clone", "direct") else 0)
        outputs[method] = dst.read_bytes()
    assert len(set(outputs.values())) == 1
    loaded = h.load(durable)
    assert loaded.keys() == {k.removeprefix("module.") for k in sd}
    assert all(torch.equal(loaded[k.removeprefix("module.")], v) for k, v in sd.items())

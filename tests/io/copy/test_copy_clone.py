"""The copy engine: reflinks, copy_file_range and read/write give the same bytes.

On a file system without reflinks (ext4), FICLONERANGE is refused and the fallbacks run.
Where the tests run as root with ``mkfs.xfs`` and loop devices (``apt-get install
xfsprogs``), a small XFS image with ``reflink=1`` is mounted and the clone path itself is
checked: shared blocks, seen from the file system's free-space count, not from this
package's own counters alone.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import UsageError
from ckpt_tools.io.copy.clone import COPY_METHODS, copy_method, copy_range
from ckpt_tools.ops.rewrite.rewriting import strip_module
from tests import helpers as h

MIB = 1 << 20


@pytest.fixture
def random_file(tmp_path: Path) -> Path:
    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(3 * MIB + 123))
    return path


@pytest.mark.parametrize("method", COPY_METHODS)
@pytest.mark.parametrize(
    ("src_offset", "dst_offset", "count"),
    [(0, 0, 3 * MIB + 123), (4096 + 17, 17, 2 * MIB + 5), (5, 4096 * 3 + 900, MIB), (9, 9, 0)],
)
def test_every_method_copies_the_same_bytes(
    tmp_path: Path, random_file: Path, method: str, src_offset: int, dst_offset: int, count: int
) -> None:
    counts, data, _ = h.copy_between(
        random_file, tmp_path / "dst.bin", src_offset, dst_offset, count, method
    )
    assert data == random_file.read_bytes()[src_offset : src_offset + count]
    assert counts.cloned + counts.direct + counts.kernel + counts.readwrite == count
    if method == "readwrite":
        assert counts.readwrite == count


@pytest.mark.parametrize("dst_offset", [0, 17, 64 * 1024 - 1, 3 * 4096])
def test_kernel_copies_go_in_few_calls_on_64_kib_boundaries(
    tmp_path: Path, random_file: Path, monkeypatch: pytest.MonkeyPatch, dst_offset: int
) -> None:
    # The real step is 2 GiB less 64 KiB (a large copy in 1 GiB calls is throttled by the
    # kernel's dirty limits: benchmarks/README.md); a 256 KiB step shows the same loop on a
    # 3 MiB file. The spy passes every call to the real function.
    from ckpt_tools.io.copy import clone

    assert clone._KERNEL_STEP % (64 << 10) == 0
    assert clone._KERNEL_STEP <= 0x7FFFF000  # Linux's MAX_RW_COUNT: one call's most
    calls: list[tuple[int, int]] = []
    real = os.copy_file_range

    def spy(src: int, dst: int, count: int, offset_src: int, offset_dst: int) -> int:
        calls.append((offset_dst, count))
        return real(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(clone, "_KERNEL_STEP", 256 << 10)
    monkeypatch.setattr(os, "copy_file_range", spy)
    count = 3 * MIB + 100
    counts, data, _ = h.copy_between(
        random_file, tmp_path / "dst.bin", 11, dst_offset, count, "copy_file_range"
    )
    assert data == random_file.read_bytes()[11 : 11 + count]
    assert counts.kernel == count
    assert all(offset % (64 << 10) == 0 for offset, _ in calls[1:])
    assert all(n <= 256 << 10 for _, n in calls)
    head = 1 if dst_offset % (64 << 10) else 0
    assert len(calls) == head + -(-(count - (-dst_offset % (64 << 10))) // (256 << 10))


def test_a_refused_clone_falls_back_to_copying(tmp_path: Path, random_file: Path) -> None:
    """ext4 (and tmpfs) have no reflinks: FICLONERANGE fails and the kernel copy does it all."""
    if h.shares_blocks(tmp_path):
        pytest.skip("this file system shares blocks; the fallback is not taken here")
    counts, data, _ = h.copy_between(random_file, tmp_path / "dst.bin", 4096, 0, 2 * MIB, "clone")
    assert counts.cloned == 0 and counts.kernel + counts.readwrite == 2 * MIB
    assert data == random_file.read_bytes()[4096 : 4096 + 2 * MIB]


def test_a_short_source_is_an_error_whatever_the_method(tmp_path: Path) -> None:
    src = tmp_path / "short.bin"
    src.write_bytes(b"x" * 1000)
    for method in COPY_METHODS:
        with pytest.raises(OSError, match="source ended after 1000 of 5000 bytes"):
            h.copy_between(src, tmp_path / "dst.bin", 0, 0, 5000, method)


def test_the_copy_method_is_an_argument_checked_before_any_byte_moves(tmp_path: Path) -> None:
    assert inspect.signature(copy_range).parameters["method"].default == "clone"
    assert copy_method("copy_file_range") == "copy_file_range"
    with pytest.raises(
        UsageError, match="expected one of: clone, direct, copy_file_range, readwrite"
    ):
        copy_method("sendfile")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    with pytest.raises(UsageError, match="method='reflink': expected one of: clone"):
        h.copy_between(src, tmp_path / "dst.bin", 0, 0, 1000, "reflink")
    assert (tmp_path / "dst.bin").read_bytes() == b""


@pytest.fixture(scope="module")
def xfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A mounted 320 MiB loopback XFS with reflink=1; skips where that cannot be made."""
    yield from h.loop_mounted(
        tmp_path_factory.mktemp("xfs"),
        320 * MIB,
        ["mkfs.xfs", "-q", "-m", "reflink=1"],
        "loopback XFS (apt-get install xfsprogs)",
    )


def _free_bytes(folder: Path) -> int:
    os.sync()
    st = os.statvfs(folder)
    return st.f_bfree * st.f_frsize


def test_clone_shares_whole_blocks_and_copies_head_and_tail(xfs: Path) -> None:
    src = xfs / "src.bin"
    src.write_bytes(os.urandom(16 * MIB + 8192))
    before = _free_bytes(xfs)
    counts, data, _ = h.copy_between(src, xfs / "dst.bin", 4096 + 100, 100, 16 * MIB, "clone")
    assert data == src.read_bytes()[4096 + 100 : 4096 + 100 + 16 * MIB]
    assert counts.cloned == 16 * MIB - 4096 and counts.kernel + counts.readwrite == 4096
    # Shared blocks take no new space: far less than the 16 MiB a copy would take.
    assert before - _free_bytes(xfs) < 2 * MIB
    # A range running past the source's end is refused by the ioctl, then by the copy.
    with pytest.raises(OSError, match="source ended"):
        h.copy_between(src, xfs / "dst3.bin", 8192, 0, 17 * MIB, "clone")
    # Offsets that disagree modulo the block cannot share blocks: copied instead.
    counts, data, _ = h.copy_between(src, xfs / "dst2.bin", 4096, 100, 4 * MIB, "clone")
    assert counts.cloned == 0 and data == src.read_bytes()[4096 : 4096 + 4 * MIB]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_rewrite_on_xfs_shares_the_tensor_bytes(
    xfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    sd = {f"module.w{i}": torch.randn(512, 1024 + i) for i in range(16)}  # ~32 MiB
    src = xfs / f"in{suffix}"
    if suffix == ".pt":
        h.save(sd, src)
    else:
        from safetensors.torch import save_file

        save_file(sd, src)
    before = _free_bytes(xfs)
    strip_module(src, xfs / f"out{suffix}")
    assert before - _free_bytes(xfs) < 4 * MIB  # the 32 MiB of tensors are shared
    # The same bytes as a read/write copy on another file system.
    h.force_copy_method(monkeypatch, "readwrite")
    strip_module(src, tmp_path / f"out{suffix}")
    assert (xfs / f"out{suffix}").read_bytes() == (tmp_path / f"out{suffix}").read_bytes()
    loaded = h.load(xfs / f"out{suffix}", mmap=True)
    assert all(torch.equal(loaded[k.removeprefix("module.")], v) for k, v in sd.items())

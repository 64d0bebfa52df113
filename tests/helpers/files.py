"""Files on disk: fingerprints, leftovers, the pickle inside a zip, byte spans, broken copies."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import importlib
import io
import os
import pickletools
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ckpt_tools.descriptors import StorageRef, TensorRef
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.pickle.repickle import dumps, zip_storage_id
from ckpt_tools.formats.pickle.unpickler import load_pickle
from ckpt_tools.io.copy.clone import CopyCounts, Writeback, copy_range
from tests.helpers.committed import tools
from tests.helpers.trees import torch_dtype


def fingerprint(path: Path) -> tuple[str, int, int]:
    """sha256, mtime_ns and inode of a file: the input must never change."""
    st = os.stat(path)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest(), st.st_mtime_ns, st.st_ino


def temp_files(folder: Path) -> list[Path]:
    """The writers' temp files (``*.ckpt-tmp``, hidden or not) left in ``folder``."""
    return sorted(Path(folder).glob("*.ckpt-tmp*")) + sorted(Path(folder).glob(".*.ckpt-tmp*"))


def shares_blocks(folder: Path) -> bool:
    """Whether ``folder``'s file system has reflinks (``cp --reflink=always`` succeeds there)."""
    a, b = Path(folder) / ".probe-a", Path(folder) / ".probe-b"
    a.write_bytes(b"\0" * 8192)
    try:
        proc = subprocess.run(
            ["cp", "--reflink=always", str(a), str(b)], capture_output=True, check=False
        )
        return proc.returncode == 0
    finally:
        a.unlink()
        b.unlink(missing_ok=True)


def mounted(kind: str, folder: Path, *options: str) -> Iterator[Path]:
    """Mount at a new ``folder`` (``mount OPTIONS FOLDER``) for a fixture to yield from.

    Skips the test where this is not root or the mount fails; unmounts when it ends.
    """
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {kind}")
    folder.mkdir()
    done = subprocess.run(["mount", *options, str(folder)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {kind} here: {done.stderr.decode(errors='replace')[-200:]}")
    try:
        yield folder
    finally:
        gc.collect()  # (a file a failed write left open keeps the mount busy)
        if subprocess.run(["umount", str(folder)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, check=False)


def loop_mounted(folder: Path, size: int, mkfs: Sequence[str], kind: str) -> Iterator[Path]:
    """A ``size``-byte image made by ``mkfs ... IMAGE``, loop-mounted at ``folder/mnt``.

    For a fixture to yield from; skips where this is not root, ``mkfs`` is missing or fails,
    or the mount fails. Unmounts and removes the image when it ends.
    """
    if os.geteuid() != 0 or shutil.which(mkfs[0]) is None:
        pytest.skip(f"needs root and {mkfs[0]} for a {kind}")
    image = folder / "fs.img"
    with open(image, "wb") as f:
        f.truncate(size)
    made = subprocess.run([*mkfs, str(image)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"{mkfs[0]} failed: {made.stderr.decode(errors='replace')[-200:]}")
    try:
        yield from mounted(kind, folder / "mnt", "-o", "loop", str(image))
    finally:
        image.unlink(missing_ok=True)


def copy_between(
    src: Path,
    dst: Path,
    src_offset: int,
    dst_offset: int,
    count: int,
    method: str | None = None,
    *,
    writeback: bool = False,
    progress: Callable[[int], None] | None = None,
) -> tuple[CopyCounts, bytes, int]:
    """``copy_range`` from ``src`` into a fresh ``dst``: the counts, the bytes written, the flags.

    ``writeback`` passes a durable :class:`Writeback` of the output (as a writer does for an
    output that will be fsynced). The flags are the output's
    file status flags after the copy, as the kernel reports them.
    """
    how = {} if method is None else {"method": method}
    with open(src, "rb") as s, open(dst, "w+b") as d:
        told = Writeback(d.fileno(), durable=True) if writeback else None
        counts = copy_range(
            s.fileno(), src_offset, d.fileno(), dst_offset, count, progress, told, **how
        )
        flags = fcntl.fcntl(d.fileno(), fcntl.F_GETFL)
        d.seek(dst_offset)
        return counts, d.read(), flags


def force_copy_method(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """Make ``method`` the first one tried by every copy the writers make, for one test.

    The writers call :func:`copy_range` without naming a method, so its keyword default is
    what they get; the test's monkeypatch puts the default back when it ends.
    """
    monkeypatch.setitem(copy_range.__kwdefaults__, "method", method)


def has_file_open_in(pid: int, folder: Path) -> bool:
    """Whether ``pid`` holds a file open in ``folder`` (its temp file, named or not)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{folder}/"):
                return True
        except OSError:
            continue
    return False


def listing(folder: Path) -> list[str]:
    """The names in ``folder``, sorted."""
    return sorted(p.name for p in Path(folder).iterdir())


def truncated_copy(src: Path, dst: Path, size: int) -> Path:
    """The first ``size`` bytes of ``src`` (negative: all but the last ``-size``)."""
    data = src.read_bytes()
    dst.write_bytes(data[:size])
    return dst


# ---------------------------------------------------------------------------------------------
# The pickle inside a torch zip


def deflated_copy(src: Path, dst: Path) -> Path:
    """``src``'s records deflated into ``dst``, as a zip tool re-zipping it writes them
    (torch reads such a file)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    return dst


def break_crc(path: Path, suffix: str = "/data/0") -> None:
    """Flip one bit of the CRC-32 the local header and the central directory give the record
    whose name ends with ``suffix``; its bytes stay as they are."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith(suffix)))
    raw = bytearray(path.read_bytes())
    for at in (info.header_offset + 14, raw.rindex(info.filename.encode()) - 46 + 16):
        raw[at : at + 4] = (info.CRC ^ 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))


def data_pkl_name(path: Path) -> str:
    """The zip entry of the archive's one top-level ``data.pkl`` (``archive/data.pkl``)."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    assert len(names) == 1, f"{path}: expected one top-level data.pkl, found {names}"
    return names[0]


def read_data_pkl(path: Path) -> bytes:
    """The bytes of a torch zip's top-level ``data.pkl``."""
    with zipfile.ZipFile(path) as archive:
        return archive.read(data_pkl_name(path))


def pickle_protocol(data: bytes) -> int:
    """The protocol a pickle declares (0 when it has no PROTO opcode), per pickletools."""
    opcode, arg, _ = next(pickletools.genops(data))
    return int(arg) if opcode.name == "PROTO" else 0


def pickle_globals(payload: bytes) -> list[str]:
    """Qualified names of the globals a pickle refers to, in order (never imported)."""
    found: list[str] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(io.BytesIO(payload)):
        if op.name == "GLOBAL":
            found.append(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.append(f"{strings[-2]}.{strings[-1]}")
    return found


def repickle_zip(
    src: Path, dst: Path, protocol: int = 2, device_map: Mapping[str, str] | None = None
) -> bytes:
    """Re-emit ``src``'s data.pkl with our re-pickler into a copy of the archive at ``dst``.

    Returns:
        The new data.pkl bytes.
    """
    tree = load_pickle(io.BytesIO(read_data_pkl(src))).root
    payload = dumps(tree, protocol, zip_storage_id(device_map))
    tools().rewrite_zip(src, dst, replace={"data.pkl": payload})
    return payload


# ---------------------------------------------------------------------------------------------
# Tensor bytes where our reader says they are


def read_span(ckpt: Checkpoint, storage: StorageRef) -> bytes:
    """The bytes our reader says ``storage`` has."""
    span = ckpt.span(storage)
    with open(span.path, "rb") as f:
        f.seek(span.offset)
        data = f.read(span.nbytes)
    assert len(data) == span.nbytes
    return data


def tensor_from_span(ckpt: Checkpoint, tensor: TensorRef) -> torch.Tensor:
    """Rebuild a tensor with torch from the bytes our reader says are its storage's."""
    dtype = torch_dtype(tensor.dtype)
    data = read_span(ckpt, tensor.storage)
    if not data:
        return torch.empty(tensor.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    return flat.as_strided(tensor.shape, tensor.stride, tensor.offset)


@contextlib.contextmanager
def module_from_source(folder: Path, name: str, source: str) -> Iterator[ModuleType]:
    """A module written into ``folder`` and imported: importable while a test saves objects of
    its classes, gone (file left, not on the path, not imported) when the file is read, as a
    training script's classes are."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)

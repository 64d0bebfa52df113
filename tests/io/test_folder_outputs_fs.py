"""Folder outputs on the file system: the folder a new output replaces passes on its mode,
owner and group (and each replaced shard its mode); a read-only folder is refused; a symlink
at the output is kept; stale temp symlinks are removed, never followed; and SIGTERM/SIGHUP
during a write by several threads ends it as with one (exit 128 + signal, nothing left).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckpt_tools import convert, rename, sub_rule
from ckpt_tools.errors import OutputError
from ckpt_tools.io import atomic
from ckpt_tools.io.interrupts import Interrupted
from ckpt_tools.io.output_path import check_output_folder
from ckpt_tools.io.writers import folder_swap
from ckpt_tools.io.writers.folder_temp import Stopped, run_jobs
from ckpt_tools.io.writers.hf_folder import FolderFile, write_folder
from tests import helpers as h

# Ids no account on a test machine has; root may give files to them.
OTHER_UID = OTHER_GID = 12345
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="setting another owner needs root")


@pytest.fixture
def umask() -> Iterator[int]:
    """A umask unlike the usual 022, so the modes a test sees come from the code."""
    before = os.umask(0o002)
    yield 0o002
    os.umask(before)


def _plain(path: Path) -> Path:
    torch.save({f"layer{i}.weight": torch.full((64,), float(i)) for i in range(4)}, path)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _no_temps(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if ".ckpt-tmp" in p.name]


# --------------------------------------------------------------------------------------------
# The replaced folder's mode, owner and group; the replaced shards' modes
# --------------------------------------------------------------------------------------------


def test_an_empty_private_folder_stays_private(tmp_path: Path, umask: int) -> None:
    (tmp_path / "priv").mkdir(mode=0o700)
    convert(_plain(tmp_path / "x.pt"), tmp_path / "priv", max_shard_size="1KB")
    assert _mode(tmp_path / "priv") == 0o700
    convert(tmp_path / "x.pt", tmp_path / "new", max_shard_size="1KB")
    assert _mode(tmp_path / "new") == 0o777 & ~umask  # a new folder: as mkdir makes it
    _no_temps(tmp_path)


@as_root
def test_a_group_shared_folder_keeps_its_setgid_mode_owner_and_group(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "config.json").write_text("{}")
    os.chown(shared, OTHER_UID, OTHER_GID)
    os.chmod(shared, 0o2770)
    convert(_plain(tmp_path / "x.pt"), shared, max_shard_size="1KB", force=True)
    st = shared.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o2770, OTHER_UID, OTHER_GID)
    shards = sorted(shared.glob("model*"))
    assert len(shards) > 2
    # Made in a setgid folder of that group, as they would be if written into it.
    assert {p.stat().st_gid for p in shards} == {OTHER_GID}
    assert (shared / "config.json").read_text() == "{}"
    _no_temps(tmp_path)


def test_a_replaced_shard_keeps_its_mode_and_a_new_one_gets_the_umasks(
    tmp_path: Path, umask: int
) -> None:
    out = tmp_path / "hf"
    convert(_plain(tmp_path / "x.pt"), out, max_shard_size="1KB")
    shards = sorted(out.glob("model-*.safetensors"))
    os.chmod(shards[0], 0o600)
    os.chmod(out / "model.safetensors.index.json", 0o640)
    convert(tmp_path / "x.pt", out, max_shard_size="1KB", force=True)
    assert _mode(shards[0]) == 0o600 and _mode(out / "model.safetensors.index.json") == 0o640
    assert {_mode(p) for p in shards[1:]} == {0o666 & ~umask}
    convert(tmp_path / "x.pt", out, max_shard_size="1MB", force=True)  # one new file name
    assert _mode(out / "model.safetensors") == 0o666 & ~umask


def _as_other_user(check: Callable[[], None]) -> None:
    """Run ``check`` in a forked child as an unprivileged user; fail if it fails there."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setgid(OTHER_GID)
            os.setuid(OTHER_UID)
            check()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the check failed as another user"


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder under /tmp, which another user can reach (pytest's temp folders are private),
    that every user may write into; removed, read-only folders in it included, at the end."""
    if os.stat("/tmp").st_mode & 0o1777 != 0o1777:
        pytest.skip("needs a /tmp that every user may enter")
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(base, 0o777)
    try:
        yield base
    finally:
        for folder in [base, *(p for p in base.rglob("*") if p.is_dir())]:
            os.chmod(folder, 0o755)  # (a read-only folder's entries cannot be removed)
        shutil.rmtree(base)


def test_a_folder_the_process_cannot_write_into_is_refused_not_replaced(open_folder: Path) -> None:
    # cp -r and rsync cannot write into it either; replacing it would take someone's
    # read-only folder over (only the parent's write permission is needed for that).
    ro = open_folder / "ro"
    ro.mkdir(mode=0o555)
    before = ro.stat()
    one = FolderFile("model.safetensors", lambda out: out.file.write(b"x"), lambda p: "")

    def check() -> None:
        with pytest.raises(OutputError, match="cannot write into the output folder"):
            check_output_folder(ro, force=True)
        with pytest.raises(OutputError, match="permission denied"):
            write_folder(ro, [one])

    _as_other_user(check) if os.geteuid() == 0 else check()
    after = ro.stat()
    assert (after.st_ino, after.st_mode, after.st_uid) == (
        before.st_ino,
        before.st_mode,
        before.st_uid,
    )
    assert h.listing(open_folder) == ["ro"]


def _refused_in(folder: Path, src: Path, reason: str) -> None:
    """Every output in ``folder`` is refused, dry run or not: a file, a folder, the input
    rewritten in place; ``folder`` takes no new file."""
    inside = folder / "in.pt"
    calls = (
        (convert, src, folder / "out.safetensors", {}),
        (convert, src, f"{folder}/hf/", {}),
        (rename, inside, inside, {"rules": [sub_rule("layer", "block")], "in_place": True}),
    )
    for dry_run in (True, False):
        for func, a, b, options in calls:
            with pytest.raises(OutputError, match=f"cannot create a file in .*: {reason}"):
                func(a, b, dry_run=dry_run, **options)


def test_an_output_whose_folder_takes_no_file_is_refused_by_a_dry_run_too(
    open_folder: Path,
) -> None:
    # A dry run writes nothing, so only a check before the work finds it; it said "would
    # write" where the write then failed.
    src = _plain(open_folder / "x.pt")
    src.chmod(0o644)
    ro = open_folder / "ro"
    ro.mkdir()
    _plain(ro / "in.pt").chmod(0o644)
    ro.chmod(0o555)
    before = h.listing(open_folder)
    check = functools.partial(_refused_in, ro, src, "permission denied")
    _as_other_user(check) if os.geteuid() == 0 else check()
    assert h.listing(open_folder) == before


@as_root
def test_another_users_file_in_a_sticky_folder_is_refused_by_a_dry_run_too(
    open_folder: Path,
) -> None:
    # /tmp's kind: anyone may create files, only an entry's owner (or the folder's) may rename
    # over it, as mv finds; the dry run said "would write" where the write failed.
    open_folder.chmod(0o1777)
    src, theirs = _plain(open_folder / "x.pt"), _plain(open_folder / "theirs.pt")
    src.chmod(0o644)
    before = theirs.read_bytes()

    def check() -> None:
        for dry_run in (True, False):
            with pytest.raises(OutputError, match="another user's, in a sticky folder"):
                convert(src, theirs, force=True, dry_run=dry_run)
        convert(src, open_folder / "mine.pt")  # a new file there is fine

    _as_other_user(check)
    assert theirs.read_bytes() == before and (open_folder / "mine.pt").exists()


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs holding ``in.pt``, remounted read-only (root only)."""
    for folder in h.mounted("tmpfs", tmp_path / "mnt", "-t", "tmpfs", "tmpfs"):
        _plain(folder / "in.pt")
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder


def test_an_output_on_a_read_only_mount_is_refused_by_a_dry_run_too(
    read_only_mount: Path, tmp_path: Path
) -> None:
    _refused_in(read_only_mount, _plain(tmp_path / "x.pt"), "read-only file system")
    assert h.listing(read_only_mount) == ["in.pt"]


# --------------------------------------------------------------------------------------------
# Symlinks
# --------------------------------------------------------------------------------------------


def test_a_symlinked_output_folder_is_kept_and_its_folder_replaced(tmp_path: Path) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    convert(_plain(tmp_path / "x.pt"), real, max_shard_size="1MB")
    (real / "config.json").write_text("{}")
    link.symlink_to("real")
    convert(tmp_path / "x.pt", f"{link}/", max_shard_size="1KB", force=True)
    assert link.is_symlink() and os.readlink(link) == "real"
    assert (real / "config.json").read_text() == "{}"
    assert (real / "model.safetensors.index.json").exists()
    assert not (real / "model.safetensors").exists()
    assert h.listing(tmp_path) == ["link", "real", "x.pt"]


def test_a_stale_temp_symlink_is_removed_and_not_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "keep.txt").write_text("mine")
    # Left by a killed run of an older version (PID 4194304: no process has it).
    (tmp_path / ".link.ckpt-tmpdir-4194304-ab12cd34-old").symlink_to("real")
    convert(_plain(tmp_path / "x.pt"), tmp_path / "hf", max_shard_size="1KB")
    assert h.listing(tmp_path) == ["hf", "real", "x.pt"]
    assert (tmp_path / "real" / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------------------------
# Several threads: stopped as one
# --------------------------------------------------------------------------------------------


def test_a_failing_worker_stops_the_others(tmp_path: Path) -> None:
    stop = threading.Event()
    started = threading.Event()

    def work(item: int) -> int:
        if item == 0:
            started.wait(10)
            raise OSError(5, "Input/output error")
        started.set()
        while not stop.wait(0.01):  # a long write, checking between its pieces
            pass
        raise Stopped("the folder write is stopping")

    begun = time.monotonic()
    with pytest.raises(OSError, match="Input/output error"):
        run_jobs(work, [0, 1, 2], 2, stop)
    assert stop.is_set() and time.monotonic() - begun < 10


def _signal_while_writing(command: list[str], out_dir: Path, signum: int) -> tuple[int, str]:
    """Run ``ckpt COMMAND``, send ``signum`` once it has a file open in ``out_dir``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_tools", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=h.ckpt_env(),
        # A run started under nohup or in the background would pass those signals ignored.
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGHUP, signum)],
    )
    try:
        deadline = time.monotonic() + 60
        while not h.has_file_open_in(proc.pid, out_dir.resolve()):
            if proc.poll() is not None:
                break  # finished (or failed) before a temp file was seen
            assert time.monotonic() < deadline, "no temp file appeared"
            time.sleep(0.001)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize(
    ("operation", "signum"), [("convert", signal.SIGTERM), ("reshard", signal.SIGHUP)]
)
def test_a_signal_during_a_write_by_several_threads_ends_it_as_with_one(
    tmp_path: Path, operation: str, signum: int
) -> None:
    src = tmp_path / "big.pt"
    torch.save({f"layer{i}.weight": torch.full((10_000_000,), float(i)) for i in range(4)}, src)
    if operation == "reshard":
        convert(src, tmp_path / "big-hf", max_shard_size="100MB", durable=False)
        src.unlink()
        src = tmp_path / "big-hf"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    command = [operation, str(src), f"{out_dir / 'hf'}/", "--max-shard-size", "45MB"]
    command += ["--jobs", "2", "--verify", "full", "--quiet"]
    name = signal.Signals(signum).name
    try:
        for _ in range(3):  # a very loaded machine may finish before the signal lands: retry
            code, err = _signal_while_writing(command, out_dir, signum)
            if code != 0:
                break
            shutil.rmtree(out_dir / "hf")
        assert code == 128 + signum, err
        assert f"interrupted by signal {name}" in err and "Traceback" not in err
        assert h.listing(out_dir) == []
    finally:
        # pytest keeps a few runs' tmp_path: do not leave 160 MB behind
        shutil.rmtree(src) if src.is_dir() else src.unlink()


@pytest.mark.parametrize("exists", [False, True])
def test_a_signal_while_the_folder_is_swapped_in_is_raised_once_it_is(
    exists: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_swap = folder_swap._swap

    def signal_then_swap(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        real_swap(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(folder_swap, "_swap", signal_then_swap)
    dst = tmp_path / "hf"
    if exists:
        dst.mkdir()
        (dst / "model.safetensors").write_bytes(b"old")
    new = FolderFile("model.safetensors", lambda out: out.file.write(b"new"), lambda p: "")
    with pytest.raises(Interrupted) as info:
        write_folder(dst, [new], replace=True)
    assert info.value.written == str(dst)
    assert h.listing(tmp_path) == ["hf"] and (dst / "model.safetensors").read_bytes() == b"new"


@pytest.mark.parametrize("where", ["fsync", "cleanup"])
def test_a_sigterm_once_the_folder_has_its_name_says_it_was_written(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After the swap: the parent's fsync, and the removal of the old folder moved aside.
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"old")
    if where == "fsync":
        real_fsync = folder_swap.fsync_folder

        def fsync_then_signal(folder: Path) -> None:
            real_fsync(folder)
            if folder == tmp_path and (dst / "model.safetensors").read_bytes() == b"new":
                os.kill(os.getpid(), signal.SIGTERM)

        monkeypatch.setattr(folder_swap, "fsync_folder", fsync_then_signal)
    else:
        real_discard = folder_swap._discard

        def signal_then_discard(*args: object) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            real_discard(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(folder_swap, "_discard", signal_then_discard)
    new = FolderFile("model.safetensors", lambda out: out.file.write(b"new"), lambda p: "")
    with pytest.raises(Interrupted) as info:
        write_folder(dst, [new], replace=True)
    assert info.value.written == str(dst)
    assert h.listing(tmp_path) == ["hf"] and (dst / "model.safetensors").read_bytes() == b"new"


def test_a_signal_while_a_shard_is_named_in_the_temp_folder_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shard had its name inside the temp folder, which is then removed: no output.
    real_name_it = atomic._name_it

    def signal_then_name(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        real_name_it(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(atomic, "_name_it", signal_then_name)
    new = FolderFile("model.safetensors", lambda out: out.file.write(b"new"), lambda p: "")
    with pytest.raises(Interrupted) as info:
        write_folder(tmp_path / "hf", [new])
    assert (info.value.signum, info.value.written) == (signal.SIGTERM, None)
    assert h.listing(tmp_path) == []

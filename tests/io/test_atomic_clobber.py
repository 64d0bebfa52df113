"""What an output may replace: never a file an input folder holds, a device or a FIFO, nor a
file that appears while the output is written; a replaced file keeps its mode and owner."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.errors import OutputError, OutputExistsError, SameFileError
from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.output_path import check_output_folder, check_output_path
from ckpt_tools.io.writers.hf_folder import FolderFile, write_folder
from tests import helpers as h


def _sharded(folder: Path) -> Path:
    """A Hugging Face folder of two shards and its index, keys under ``module.``."""
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    weight_map = {}
    for name, key in shards.items():
        save_file(
            {f"module.{key}.weight": torch.full((4,), ord(key), dtype=torch.float32)}, folder / name
        )
        weight_map[f"module.{key}.weight"] = name
    index = {"metadata": {"total_size": 32}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_a_file_the_input_folder_reads_is_never_the_output(tmp_path: Path) -> None:
    hf = _sharded(tmp_path / "hf")
    shard = hf / "model-00001-of-00002.safetensors"
    before = shard.read_bytes()
    for flag in ("--force", "--in-place"):
        _, _, err = h.run_ckpt("strip-module", hf, shard, flag, code=6)
        assert f"is a file of the input folder {str(hf)!r}" in err and "--in-place" not in err
    assert shard.read_bytes() == before
    with pytest.raises(SameFileError, match="a file of the input folder"):
        check_output_path(hf / "model.safetensors.index.json", hf, force=True, in_place=True)
    # A new file in the input folder is no input of it.
    assert check_output_path(hf / "new.pt", hf) == hf / "new.pt"


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_a_folders_one_weight_file_is_rewritten_in_place_a_shard_never(
    tmp_path: Path, name: str
) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    weights = {"module.w": torch.ones(2)}
    (save_file if name.endswith(".safetensors") else torch.save)(weights, hf / name)
    h.run_ckpt("strip-module", hf / name, hf / name, "--in-place")
    loaded = load_file(hf / name) if name.endswith(".safetensors") else torch.load(hf / name)
    assert list(loaded) == ["w"]
    # A shard an index names stays refused: its keys are the index's.
    sharded = _sharded(tmp_path / "sharded")
    shard = sharded / "model-00001-of-00002.safetensors"
    _, _, err = h.run_ckpt("strip-module", shard, shard, "--in-place", code=6)
    assert "is a file of the input folder" in err


def test_a_file_read_through_a_linked_tag_folder_is_never_the_output(tmp_path: Path) -> None:
    # A DeepSpeed save folder whose tag folder lies on another volume, linked: its rank
    # files are the input as much as if they were inside it, by either path.
    volume, run = tmp_path / "volume" / "global_step2", tmp_path / "run"
    volume.mkdir(parents=True)
    run.mkdir()
    (run / "latest").write_text("global_step2")
    (run / "global_step2").symlink_to(volume)
    states = volume / "mp_rank_00_model_states.pt"
    states.write_bytes(b"rank 0")
    for out in (run / "global_step2" / states.name, states):
        with pytest.raises(SameFileError, match="a file of the input folder"):
            check_output_path(out, run, force=True)
    assert states.read_bytes() == b"rank 0"
    assert check_output_path(volume / "notes.pt", run) == volume / "notes.pt"


def test_a_file_of_the_input_folder_its_reader_does_not_read_follows_force(
    tmp_path: Path,
) -> None:
    # zero_to_fp32 writes pytorch_model.bin into the DeepSpeed folder; a DCP folder may hold
    # the consolidated file likewise: a second run replaces it with --force.
    run = tmp_path / "run"
    run.mkdir()
    for name in (".metadata", "__0_0.distcp", "model.pt"):
        (run / name).write_bytes(b"")
    with pytest.raises(OutputExistsError):
        check_output_path(run / "model.pt", run)
    assert check_output_path(run / "model.pt", run, force=True) == run / "model.pt"
    with pytest.raises(SameFileError, match="a file of the input folder"):
        check_output_path(run / "__0_0.distcp", run, force=True)


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_device_or_fifo_is_never_replaced_by_a_file(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    dst = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(dst)
    elif os.geteuid() == 0:
        os.mknod(dst, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null
    else:
        pytest.skip("making a device node needs root")
    link = tmp_path / "link"
    link.symlink_to(dst)
    for out in (dst, link):
        _, _, err = h.run_ckpt("strip-module", src, out, "--force", code=6)
        assert "is not a regular file" in err
    assert not stat.S_ISREG(dst.lstat().st_mode) and link.is_symlink()


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_an_output_path_the_system_refuses_to_look_at_is_an_output_error(
    tmp_path: Path, folder: bool
) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    dst = tmp_path / ("a" * 300 + ("/" if folder else ".pt"))  # past any file system's NAME_MAX
    _, _, err = h.run_ckpt("convert" if folder else "strip-module", src, dst, code=6)
    assert "cannot use the output path" in err and "File name too long" in err
    check = check_output_folder if folder else check_output_path
    with pytest.raises(OutputError, match="File name too long"):
        check(dst, src)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may search any folder")
def test_an_output_in_a_folder_this_user_may_not_search_is_an_output_error(
    tmp_path: Path,
) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    (tmp_path / "closed").mkdir(mode=0)
    try:
        for command, dst in (("strip-module", "out.pt"), ("convert", "out/")):
            _, _, err = h.run_ckpt(command, src, f"{tmp_path / 'closed'}/{dst}", code=6)
            assert "Permission denied" in err
    finally:
        (tmp_path / "closed").chmod(0o700)


@pytest.mark.parametrize("unnamed", [True, False])
def test_a_file_that_appears_while_writing_is_not_replaced(tmp_path: Path, unnamed: bool) -> None:
    dst = tmp_path / "out.bin"
    with pytest.raises(OutputExistsError):  # noqa: SIM117
        with atomic_output(dst, unnamed=unnamed) as out:
            out.file.write(b"new")
            dst.write_bytes(b"someone else's")  # another process takes the name meanwhile
    assert dst.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]
    # A file there when the write starts is replaced where the caller said so (force, in place).
    with atomic_output(dst, unnamed=unnamed, replace=True) as out:
        out.file.write(b"replaced")
    assert dst.read_bytes() == b"replaced"


@pytest.mark.parametrize("unnamed", [True, False])
def test_a_file_that_appears_after_the_output_was_checked_is_not_replaced(
    tmp_path: Path, unnamed: bool
) -> None:
    # Planning runs between the check and the write: minutes for a large consolidation.
    dst = tmp_path / "out.bin"
    assert check_output_path(dst) == dst
    dst.write_bytes(b"someone else's")
    with pytest.raises(OutputExistsError), atomic_output(dst, unnamed=unnamed):
        pytest.fail("nothing is written where the output was taken before the write began")
    assert dst.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_a_folder_filled_after_it_was_checked_is_not_written_into(tmp_path: Path) -> None:
    dst = tmp_path / "model-hf"
    assert check_output_folder(dst) == dst
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"someone else's")
    new = FolderFile("model.safetensors", lambda out: out.file.write(b"new"), lambda p: "")
    with pytest.raises(OutputExistsError):
        write_folder(dst, [new])
    assert h.listing(tmp_path) == ["model-hf"] and h.listing(dst) == ["model.safetensors"]
    assert (dst / "model.safetensors").read_bytes() == b"someone else's"
    write_folder(dst, [new], replace=True)  # force
    assert (dst / "model.safetensors").read_bytes() == b"new"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_replaced_file_keeps_its_mode_owner_and_group(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"old")
    os.chown(dst, 12345, 23456)
    os.chmod(dst, 0o640)
    h.run_ckpt("strip-module", src, dst, "--force")
    st = dst.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (12345, 23456, 0o640)
    assert list(torch.load(dst, weights_only=True)) == ["w"]


def test_a_new_file_takes_the_umask_without_the_umask_being_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Setting the umask to read it would hand the shards other threads create meanwhile a
    # moment's other umask: it is read, never set.
    import ckpt_tools.io.atomic as atomic

    def umask(mask: int) -> int:
        raise AssertionError("the process umask was changed")

    old = os.umask(0o027)
    try:
        monkeypatch.setattr(atomic.os, "umask", umask)
        with atomic_output(tmp_path / "new.bin") as out:
            out.file.write(b"x")
    finally:
        monkeypatch.undo()  # (os is one module: the test's own umask call is patched too)
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o640


def test_a_name_near_the_file_systems_limit_is_replaced_and_written_as_a_folder(
    tmp_path: Path,
) -> None:
    # A temp name adds its marker, PID and a random part to the output's name: cut where
    # the whole would pass NAME_MAX (255 bytes), as cp and mkdir take such a name.
    src = tmp_path / "in.pt"
    torch.save({"module.w": torch.ones(2)}, src)
    name = "é" * 118  # 236 bytes
    dst = tmp_path / f"{name}.pt"
    h.run_ckpt("strip-module", src, dst)
    h.run_ckpt("strip-module", src, dst, "--force")
    h.run_ckpt("add-module", dst, dst, "--in-place")
    assert list(torch.load(dst, weights_only=True)) == ["module.w"]
    h.run_ckpt("convert", src, f"{tmp_path / name}/")
    h.run_ckpt("convert", dst, f"{tmp_path / name}/", "--force")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.pt", dst.name, name])

"""``--force`` into an existing output folder: the checkpoint's weight files are replaced, the
rest of the folder (config, tokenizer files, notes, subfolders) is kept, and the swap stays
atomic. Outputs are read back with ``safetensors``; inputs are made with ``torch.save`` and
``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools.io.writers.folder_swap as folder_swap
import ckpt_tools.io.writers.hf_folder as hf_folder
from ckpt_tools import convert, reshard
from ckpt_tools.errors import OutputError, OutputExistsError
from tests.formats.dcp.test_dcp import save_dcp, small_state
from tests.helpers.cli import run_ckpt


def _plain(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = {"fc.weight": torch.randn(16, 16, generator=g), "fc.bias": torch.randn(16, generator=g)}
    torch.save(sd, path)
    return sd


def _user_folder(folder: Path, plain: Path) -> dict[str, bytes]:
    """An HF-like folder with old weights and files of the user's; returns what must stay."""
    folder.mkdir()
    (folder / "notes.txt").write_text("x\n")
    (folder / "config.json").write_text('{"model_type": "toy"}')
    (folder / "other.pt").write_bytes(plain.read_bytes())
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "vocab.txt").write_text("a\nb\n")
    for old in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (folder / old).write_bytes(b"old shard")
    (folder / "model.safetensors.index.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"old bin")
    return {
        "notes.txt": b"x\n",
        "config.json": b'{"model_type": "toy"}',
        "other.pt": plain.read_bytes(),
        "tokenizer/vocab.txt": b"a\nb\n",
    }


def _assert_kept(folder: Path, kept: dict[str, bytes]) -> None:
    for name, data in kept.items():
        assert (folder / name).read_bytes() == data, name
    assert not (folder / "pytorch_model.bin").exists()
    assert not [p for p in folder.parent.iterdir() if ".ckpt-tmp" in p.name]


def _weights(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if folder_swap.WEIGHT_FILES.match(p.name))


def test_convert_force_keeps_the_users_files(tmp_path: Path) -> None:
    sd = _plain(tmp_path / "plain.pt")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    run_ckpt("convert", tmp_path / "plain.pt", f"{tmp_path / 'd'}/", "--force")
    _assert_kept(tmp_path / "d", kept)
    assert _weights(tmp_path / "d") == ["model.safetensors"]  # old shards and index gone
    got = load_file(tmp_path / "d" / "model.safetensors")
    assert all(torch.equal(got[k], sd[k]) for k in sd) and len(got) == len(sd)


def test_reshard_force_keeps_the_users_files(tmp_path: Path) -> None:
    sd = _plain(tmp_path / "plain.pt")
    convert(tmp_path / "plain.pt", tmp_path / "hf", max_shard_size="1MB")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    run_ckpt("reshard", tmp_path / "hf", tmp_path / "d", "--max-shard-size", "1KB", "--force")
    _assert_kept(tmp_path / "d", kept)
    assert _weights(tmp_path / "d") == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    got: dict[str, torch.Tensor] = {}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        got.update(load_file(tmp_path / "d" / shard))
    assert all(torch.equal(got[k], sd[k]) for k in sd) and len(got) == len(sd)


def test_consolidate_force_keeps_the_users_files(tmp_path: Path) -> None:
    _plain(tmp_path / "plain.pt")
    dcp_folder = save_dcp(tmp_path / "dcp", small_state())
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    run_ckpt("consolidate", dcp_folder, tmp_path / "d", "--force")
    _assert_kept(tmp_path / "d", kept)
    assert _weights(tmp_path / "d") == ["model.safetensors"]
    got = load_file(tmp_path / "d" / "model.safetensors")
    want = small_state()["model"]
    assert all(torch.equal(got[k], want[k]) for k in want) and len(got) == len(want)


def test_without_force_a_non_empty_folder_is_refused_and_says_what_force_does(
    tmp_path: Path,
) -> None:
    _plain(tmp_path / "plain.pt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x\n")
    res = run_ckpt("convert", tmp_path / "plain.pt", f"{tmp_path / 'd'}/", code=6)
    assert "pass --force to replace its weight files" in res.stderr
    assert "keep everything else" in res.stderr
    assert sorted(os.listdir(tmp_path / "d")) == ["notes.txt"]
    convert(tmp_path / "plain.pt", tmp_path / "hf", max_shard_size="1MB")
    with pytest.raises(OutputExistsError, match="force=True to replace its weight files"):
        reshard(tmp_path / "hf", tmp_path / "d", max_shard_size="1KB")
    assert sorted(os.listdir(tmp_path / "d")) == ["notes.txt"]


def test_a_failed_write_leaves_the_old_folder_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain(tmp_path / "plain.pt")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir() if p.is_file()}

    def fail(*args: object, **kwargs: object) -> None:
        raise OutputError("disk full")

    monkeypatch.setattr(hf_folder, "write_file", fail)
    with pytest.raises(OutputError, match="disk full"):
        convert(tmp_path / "plain.pt", tmp_path / "d", max_shard_size="1KB", force=True)
    after = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir() if p.is_file()}
    assert (
        after == before
        and (tmp_path / "d" / "tokenizer" / "vocab.txt").read_bytes()
        == (kept["tokenizer/vocab.txt"])
    )
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp" in p.name]


def test_without_hard_links_the_kept_files_are_moved_and_put_back_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plain(tmp_path / "plain.pt")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")

    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(hf_folder.os, "link", no_links)
    monkeypatch.setattr(folder_swap, "exchange", lambda a, b: False)  # two renames, not a swap
    real_rename = os.rename

    def rename(src: object, dst: object) -> None:  # the temp folder cannot take the name
        swap = str(dst) == str(tmp_path / "d") and ".ckpt-tmpdir-" in str(src)
        if swap and not str(src).endswith("-old"):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(hf_folder.os, "rename", rename)
    with pytest.raises(OutputError, match="Input/output error"):
        convert(tmp_path / "plain.pt", tmp_path / "d", max_shard_size="1KB", force=True)
    for name, data in kept.items():
        assert (tmp_path / "d" / name).read_bytes() == data, name
    assert (tmp_path / "d" / "pytorch_model.bin").read_bytes() == b"old bin"
    monkeypatch.setattr(hf_folder.os, "rename", real_rename)
    convert(tmp_path / "plain.pt", tmp_path / "d", max_shard_size="1KB", force=True)
    _assert_kept(tmp_path / "d", kept)


def test_exchange_swaps_two_folders_in_one_step_or_does_nothing(tmp_path: Path) -> None:
    from ckpt_tools.io.writers.folder_temp import exchange

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.txt").write_text(name)
    swapped = exchange(tmp_path / "a", tmp_path / "b")
    want = {"a": ["b.txt"], "b": ["a.txt"]} if swapped else {"a": ["a.txt"], "b": ["b.txt"]}
    assert {n: os.listdir(tmp_path / n) for n in ("a", "b")} == want
    if swapped:  # a failed swap is an error, never a silent False
        with pytest.raises(FileNotFoundError):
            exchange(tmp_path / "a", tmp_path / "missing")


def test_a_failed_carry_puts_back_every_entry_it_had_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without hard links the kept entries are moved into the new folder one by one; when one
    # of them cannot be moved, the ones moved before it go back before the new folder goes.
    _plain(tmp_path / "plain.pt")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    (tmp_path / "d" / "zz-last.txt").write_text("last")

    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(1, "Operation not permitted")

    real_rename = os.rename

    def rename(src: object, dst: object) -> None:
        if str(src) == str(tmp_path / "d" / "zz-last.txt"):
            raise PermissionError(13, "Permission denied")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(hf_folder.os, "link", no_links)
    monkeypatch.setattr(hf_folder.os, "rename", rename)
    with pytest.raises(OutputError, match="Permission denied"):
        convert(tmp_path / "plain.pt", tmp_path / "d", max_shard_size="1KB", force=True)
    for name, data in kept.items():
        assert (tmp_path / "d" / name).read_bytes() == data, name
    assert (tmp_path / "d" / "zz-last.txt").read_text() == "last"
    assert (tmp_path / "d" / "pytorch_model.bin").read_bytes() == b"old bin"
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp" in p.name]


def test_entries_a_killed_run_had_carried_go_back_to_their_folder(tmp_path: Path) -> None:
    # Killed after moving the kept entries into its temp folder, before the swap: the old
    # folder lacks them, and the next write beside it puts them back before removing the rest.
    _plain(tmp_path / "plain.pt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").write_bytes(b"old weights")
    # PID 4194304 is pid_max's ceiling on Linux: no process has it.
    orphan = tmp_path / ".d.ckpt-tmpdir-4194304-ab12cd34"
    (orphan / "runs").mkdir(parents=True)
    (orphan / "runs" / "log.txt").write_text("log")
    (orphan / "notes.txt").write_text("notes")
    (orphan / "model.safetensors").write_bytes(b"new weights")
    # A shard's temp file, named where the file system has no O_TMPFILE: the run's, not kept.
    (orphan / ".model.safetensors.ckpt-tmp-4194304-ab12cd34").write_bytes(b"partial")
    fresh = tmp_path / ".f.ckpt-tmpdir-4194304-ef56ab78"  # a new output's: nothing to put back
    fresh.mkdir()
    (fresh / ".model.safetensors.ckpt-tmp-4194304-ef56ab78").write_bytes(b"partial")
    # Killed between the two renames of a swap: the replaced folder is still aside.
    aside = tmp_path / ".e.ckpt-tmpdir-4194304-cd34ab12-old"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"old weights")
    unnamed = tmp_path / ".e.ckpt-tmpdir-4194304-cd34ab12"
    unnamed.mkdir()
    (unnamed / "notes.txt").write_text("e notes")
    convert(tmp_path / "plain.pt", tmp_path / "other", max_shard_size="1KB")
    assert (tmp_path / "d" / "notes.txt").read_text() == "notes"
    assert (tmp_path / "d" / "runs" / "log.txt").read_text() == "log"
    assert (tmp_path / "d" / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(os.listdir(tmp_path / "d")) == ["model.safetensors", "notes.txt", "runs"]
    assert (tmp_path / "e" / "notes.txt").read_text() == "e notes"
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "e", "other", "plain.pt"]


def test_force_into_a_folder_a_killed_run_had_emptied_puts_its_entries_back_first(
    tmp_path: Path,
) -> None:
    # Killed after carrying every entry out: the folder is empty until they are put back.
    _plain(tmp_path / "plain.pt")
    (tmp_path / "d").mkdir()
    orphan = tmp_path / ".d.ckpt-tmpdir-4194304-ab12cd34"
    (orphan / "runs").mkdir(parents=True)
    (orphan / "runs" / "log.txt").write_text("log")
    convert(tmp_path / "plain.pt", tmp_path / "d", max_shard_size="1KB", force=True)
    assert (tmp_path / "d" / "runs" / "log.txt").read_text() == "log"
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "plain.pt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user: root only")
def test_a_kept_subfolder_keeps_its_owner_mode_and_inode(tmp_path: Path) -> None:
    _plain(tmp_path / "plain.pt")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    private = tmp_path / "d" / "runs" / "private"
    private.mkdir(parents=True)
    (private / "notes.txt").write_text("secret")
    for path in (private.parent, private, private / "notes.txt"):
        os.chown(path, 1234, 1234)
        path.chmod(0o700 if path.is_dir() else 0o600)
    before = {p: os.stat(p) for p in (private.parent, private)}
    run_ckpt("convert", tmp_path / "plain.pt", tmp_path / "d", "--force")
    _assert_kept(tmp_path / "d", kept)
    for path, old in before.items():
        new = os.stat(path)
        assert (new.st_uid, new.st_gid, new.st_mode, new.st_ino) == (
            old.st_uid,
            old.st_gid,
            old.st_mode,
            old.st_ino,
        ), path
    assert (private / "notes.txt").read_text() == "secret"


def test_a_subfolder_that_can_be_neither_moved_nor_linked_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another user's subfolder, for one: its '..' is not ours to change, nor its files to link.
    _plain(tmp_path / "plain.pt")
    kept = _user_folder(tmp_path / "d", tmp_path / "plain.pt")
    real_rename, real_link = os.rename, os.link

    def rename(src: object, dst: object) -> None:
        if str(src) == str(tmp_path / "d" / "tokenizer"):
            raise PermissionError(13, "Permission denied")
        real_rename(src, dst)  # type: ignore[arg-type]

    def link(src: object, dst: object, **kwargs: object) -> None:
        if "tokenizer" in str(src):
            raise PermissionError(1, "Operation not permitted")
        real_link(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hf_folder.os, "rename", rename)
    monkeypatch.setattr(hf_folder.os, "link", link)
    named = r"cannot keep '.*tokenizer' in the new folder: it cannot be moved, nor '.*vocab\.txt'"
    with pytest.raises(OutputError, match=named + r" linked \(Operation not permitted\); move"):
        convert(tmp_path / "plain.pt", tmp_path / "d", max_shard_size="1KB", force=True)
    for name, data in kept.items():
        assert (tmp_path / "d" / name).read_bytes() == data, name
    assert (tmp_path / "d" / "pytorch_model.bin").read_bytes() == b"old bin"
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp" in p.name]


def test_a_killed_runs_folders_of_a_name_cut_to_fit_are_kept_or_given_back(
    tmp_path: Path,
) -> None:
    # A name near NAME_MAX is cut in the temp folders' names. Where the output folder still
    # has its name, what the killed run had carried goes back into it; where the name is gone
    # (killed between two renames) it cannot be told from the cut one: the old folder stays
    # aside, with everything carried put back into it, and nothing of the user's is removed.
    from ckpt_tools.io.writers.folder_temp import temp_folder

    _plain(tmp_path / "plain.pt")
    named, gone = tmp_path / ("n" * 240), tmp_path / ("g" * 240)
    named.mkdir()
    unnamed = temp_folder(named, "4194304-ab12cd34")
    for folder in (
        unnamed,
        temp_folder(gone, "4194304-cd34ab12"),
        temp_folder(gone, "4194304-cd34ab12", aside=True),
    ):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
        assert len(folder.name.encode()) <= 255
    (unnamed / "notes.txt").write_text("named")
    (temp_folder(gone, "4194304-cd34ab12") / "notes.txt").write_text("gone")
    convert(tmp_path / "plain.pt", tmp_path / "other", max_shard_size="1KB")
    assert (named / "notes.txt").read_text() == "named"
    aside = temp_folder(gone, "4194304-cd34ab12", aside=True)
    assert (aside / "notes.txt").read_text() == "gone"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [named.name, aside.name, "other", "plain.pt"]
    )


def test_force_replaces_a_variants_weight_files_too(tmp_path: Path) -> None:
    # transformers' save_pretrained(variant="fp16") names: left in place, from_pretrained(
    # variant="fp16") would load the old weights from the folder that now holds new ones.
    _plain(tmp_path / "plain.pt")
    folder = tmp_path / "d"
    folder.mkdir()
    variants = [
        "model.fp16.safetensors",
        "model.fp16-00001-of-00002.safetensors",
        "model.safetensors.index.fp16.json",
        "pytorch_model.fp16.bin",
        "pytorch_model.fp16-00001-of-00002.bin",
        "pytorch_model.bin.index.fp16.json",
        "model.ema.v2.safetensors",
        "model.ema.v2-00001-of-00002.safetensors",
        "model.safetensors.index.ema.v2.json",
    ]
    kept = ["model_ema.safetensors", "model.fp16.safetensors.bak", "config.json"]
    for name in variants + kept:
        (folder / name).write_bytes(b"old")
    plan = convert(tmp_path / "plain.pt", folder, force=True, dry_run=True)
    assert sorted(Path(p).name for p in plan.removes) == sorted(variants)
    convert(tmp_path / "plain.pt", folder, force=True)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*kept, "model.safetensors"])


@pytest.mark.parametrize(
    "name", ["model.safetensors", "pytorch_model.bin", "model.ema.safetensors"]
)
def test_a_folder_named_as_a_weight_file_is_refused_not_removed(tmp_path: Path, name: str) -> None:
    src = tmp_path / "plain.pt"
    _plain(src)
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "notes.txt").write_text("mine")
    for dry_run in (True, False):
        with pytest.raises(OutputError, match=f"holds '{name}', named as a weight file"):
            convert(src, f"{out}/", force=True, dry_run=dry_run)
    assert (out / name / "notes.txt").read_text() == "mine"

"""``average`` names the inputs it averages in its text, dry run or not, as ``--json`` does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckpt_tools as ct
from ckpt_tools.cli.main import cli
from ckpt_tools.ops.average.averaging import pick_inputs


def _run(folder: Path, steps: range) -> list[str]:
    """One checkpoint per step, named by it (``ckpt_100.pt``); their names in step order."""
    names = []
    for step in steps:
        name = f"ckpt_{step}.pt"
        torch.save({"model": {"w": torch.full((2,), float(step))}, "step": step}, folder / name)
        names.append(name)
    return names


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "written"])
def test_average_text_names_the_inputs_last_picked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    names = _run(tmp_path, range(100, 700, 100))
    monkeypatch.chdir(tmp_path)
    args = ["average", "ckpt_*.pt", "avg.pt", "--last", "5", *(["--dry-run"] if dry_run else [])]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index("  mean of 5 inputs:")
    assert lines[start + 1 : start + 6] == [f"    {name}" for name in names[1:]]
    assert "ckpt_100.pt" not in result.output  # the one --last left out
    assert (tmp_path / "avg.pt").exists() != dry_run


def test_average_text_of_many_inputs_shows_both_ends_and_a_count(tmp_path: Path) -> None:
    names = [str(tmp_path / name) for name in _run(tmp_path, range(1, 13))]
    result = ct.average(names, tmp_path / "avg.pt", dry_run=True)
    lines = result.text().splitlines()
    start = lines.index("  mean of 12 inputs:")
    shown = [line.strip() for line in lines[start + 1 : start + 8]]
    assert shown == [*names[:3], "... 6 more", *names[-3:]]
    assert result.to_json()["sources"] == names  # the JSON keeps every one


def _bytes_read() -> int:
    """Bytes this process has read through system calls (``rchar``), page cache included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
def test_equal_integer_tensors_are_read_once_per_input(tmp_path: Path) -> None:
    """Each input's integer tensor is hashed once, the first input's too, whatever the count."""
    ids = torch.arange(1 << 19)  # 4 MiB of int64, equal in every input
    srcs = []
    for i in range(5):
        srcs.append(tmp_path / f"{i}.pt")
        torch.save({"ids": ids, "w": torch.full((4,), float(i))}, srcs[-1])
    before = _bytes_read()
    result = ct.average(srcs, tmp_path / "mean.pt", dry_run=True)
    read = _bytes_read() - before
    assert [r.action for r in result.rows] == ["copy (equal)", "mean of 5"]
    assert 5 * ids.nbytes <= read < 6 * ids.nbytes  # the first input's is not hashed 4 times


def test_rezipped_inputs_are_averaged_their_integer_tensors_compared_inflated(
    tmp_path: Path,
) -> None:
    # Deflated records (a re-zipping tool; torch reads them): the means inflate them, and so
    # must the comparison of the step counters each input has to hold the same.
    import zipfile

    paths = []
    for i in range(2):
        plain, src = tmp_path / f"plain{i}.pt", tmp_path / f"deflated{i}.pt"
        sd = {"w": torch.full((3, 2), float(i)), "steps": torch.tensor(7)}
        sd["view"] = sd["w"].t()  # a strided view of a compressed storage
        torch.save(sd, plain)
        with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                zout.writestr(info.filename, zin.read(info.filename))
        paths.append(src)
    ct.average(paths, tmp_path / "avg.pt")
    got = torch.load(tmp_path / "avg.pt", weights_only=True)
    assert torch.equal(got["w"], torch.full((3, 2), 0.5)) and torch.equal(
        got["steps"], torch.tensor(7)
    )
    assert torch.equal(got["view"], got["w"].t())


def test_weights_given_as_a_numpy_array_are_checked_as_a_list(tmp_path: Path) -> None:
    import numpy as np

    paths = []
    for i in range(2):
        torch.save({"w": torch.ones(2) * i}, tmp_path / f"{i}.pt")
        paths.append(tmp_path / f"{i}.pt")
    with pytest.raises(ct.UsageError, match=r"weights=\[1\.0, -1\.0\]: the weights sum to 0"):
        ct.average(paths, tmp_path / "avg.pt", weights=np.array([1.0, -1.0]))
    ct.average(paths, tmp_path / "avg.pt", weights=np.array([1.0, 3.0]))
    assert torch.equal(
        torch.load(tmp_path / "avg.pt", weights_only=True)["w"], torch.full((2,), 0.75)
    )


def test_an_existing_name_is_taken_literally_and_a_glob_must_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file named with glob characters (x[1].pt) is that file, not the x1.pt it would match;
    # a pattern that matches nothing is refused, not dropped from the mean.
    monkeypatch.chdir(tmp_path)
    for name, value in (("x[1].pt", 3.0), ("x1.pt", 4.0), ("a.pt", 0.0)):
        torch.save({"w": torch.full((2,), value)}, name)
    assert pick_inputs(["x[1].pt", "a.pt"]) == ["x[1].pt", "a.pt"]
    ct.average(["x[1].pt", "a.pt"], "mean.pt")
    assert torch.equal(torch.load("mean.pt", weights_only=True)["w"], torch.full((2,), 1.5))
    assert pick_inputs(["x[0-9].pt"]) == ["x1.pt"]  # a glob still expands
    with pytest.raises(ct.UsageError, match=r"'nomatch_\*\.pt' matches no file"):
        pick_inputs(["a.pt", "x1.pt", "nomatch_*.pt"])


@pytest.mark.parametrize(
    "layout",
    [
        "ckpt_{}.pt",
        "step{}_bf16.pt",  # every name also ends in the same number
        "global_step{}/mp_rank_00_model_states.pt",  # the step is in the folder's name
        "epoch=0-step={}.ckpt",
    ],
)
def test_last_keeps_the_highest_steps_wherever_the_number_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    monkeypatch.chdir(tmp_path)
    # Written newest first, so an order by modification time would pick the wrong two.
    for step in (1000, 300, 200, 100):
        path = Path(layout.format(step))
        path.parent.mkdir(exist_ok=True)
        torch.save({"w": torch.full((2,), float(step))}, path)
    picked = pick_inputs([layout.format("*")], last=2)
    assert picked == [layout.format(300), layout.format(1000)]
    out = ct.average(picked, tmp_path / "avg.pt")
    assert torch.equal(torch.load(out.written[0])["w"], torch.full((2,), 650.0))


def test_last_takes_the_newest_where_the_names_differ_beyond_their_numbers(
    tmp_path: Path,
) -> None:
    # "best_7.pt" beside "ckpt_9.pt": the numbers are not one count, so time decides.
    names = ["ckpt_9.pt", "best_7.pt", "ckpt_8.pt"]  # oldest to newest
    for age, name in enumerate(names):
        torch.save({"w": torch.ones(1)}, tmp_path / name)
        os.utime(tmp_path / name, ns=(age * 10**9, age * 10**9))
    assert pick_inputs([str(tmp_path / "*.pt")], last=2) == [
        str(tmp_path / "best_7.pt"),
        str(tmp_path / "ckpt_8.pt"),
    ]

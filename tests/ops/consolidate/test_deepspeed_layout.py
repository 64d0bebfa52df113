"""``consolidate`` on DeepSpeed save folders laid out unusually, against DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint``: one saved without ``latest``
(``save_checkpoint(save_latest=False)``), and stale rank files beside a run's.

The inputs are copies of the session's real ZeRO runs (``zero_runs``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckpt_tools import consolidate
from ckpt_tools.errors import CorruptCheckpointError, UsageError
from tests.helpers import run_ckpt
from tests.helpers.trees import assert_values_bitwise
from tests.helpers.zero_runs import ZeroRuns

TAG = "global_step2"


def oracle(folder: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))


def assert_equal_dicts(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key in want:
        assert_values_bitwise(want[key].contiguous(), got[key], key)


def test_a_save_folder_without_latest_reads_the_tag_given(
    zero_runs: ZeroRuns, tmp_path: Path
) -> None:
    folder = zero_runs.copy(2, "z2-bf16", tmp_path / "run")  # global_step1 and global_step2
    (folder / "latest").unlink()
    consolidate(folder, tmp_path / "m.pt", tag="global_step1")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert_equal_dicts(oracle(folder, "global_step1"), got)
    with pytest.raises(UsageError) as caught:
        consolidate(folder, tmp_path / "n.pt")
    said = str(caught.value)
    assert "is a DeepSpeed save folder without a 'latest' file" in said, said
    assert "'global_step1', 'global_step2'" in said and "pass tag='global_step1'" in said, said
    code, _, err = run_ckpt("consolidate", folder, tmp_path / "n.pt", code=None)
    assert code == UsageError.exit_code and "pass --tag global_step1" in err, err
    assert not (tmp_path / "n.pt").exists()


def test_a_tag_of_nested_folders_is_read_as_deepspeed_reads_it(
    zero_runs: ZeroRuns, tmp_path: Path
) -> None:
    # save_checkpoint(dir, tag="epoch1/step2") writes dir/epoch1/step2 and latest names it.
    folder = zero_runs.copy(2, "z2-bf16", tmp_path / "run")
    (folder / "epoch1").mkdir()
    (folder / TAG).rename(folder / "epoch1" / "step2")
    (folder / "latest").write_text("epoch1/step2")
    want = oracle(folder)
    consolidate(folder, tmp_path / "m.pt")
    assert_equal_dicts(want, torch.load(tmp_path / "m.pt", weights_only=True))
    run_ckpt("consolidate", folder, tmp_path / "n.pt", "--tag", "epoch1/step2")
    assert_equal_dicts(want, torch.load(tmp_path / "n.pt", weights_only=True))
    # A tag leading out of the save folder is no tag of it; the nested tags are named.
    for outside in ("../run/epoch1/step2", "epoch1/../epoch1/step2", "/epoch1/step2"):
        with pytest.raises(UsageError, match="tags there: epoch1/step2, global_step1"):
            consolidate(folder, tmp_path / "o.pt", tag=outside)
    assert not (tmp_path / "o.pt").exists()
    # Three folders deep, without latest: found as a save folder, and its tag read.
    (folder / "latest").unlink()
    shutil.rmtree(folder / "global_step1")
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "epoch1" / "step2").rename(folder / "a" / "b" / "c")
    consolidate(folder, tmp_path / "deep.pt", tag="a/b/c")
    assert_equal_dicts(want, torch.load(tmp_path / "deep.pt", weights_only=True))
    with pytest.raises(UsageError, match=r"without a 'latest' file .*; pass tag='a/b/c'"):
        consolidate(folder, tmp_path / "o.pt")


def _stale(folder: Path, kind: str) -> str:
    """A copy of rank 1's file as rank 2's, as an earlier save with 3 ranks leaves it."""
    name = f"zero_pp_rank_2_mp_rank_00_{kind}_states.pt"
    shutil.copy(folder / TAG / f"zero_pp_rank_1_mp_rank_00_{kind}_states.pt", folder / TAG / name)
    return name


def test_a_stale_optimizer_file_is_named_extra(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    folder = zero_runs.copy(2, "z3", tmp_path / "run")
    name = _stale(folder, "optim")
    with pytest.raises(ValueError, match="Expected 2 of"):  # zero_to_fp32 refuses it too
        oracle(folder)
    with pytest.raises(CorruptCheckpointError) as caught:
        consolidate(folder, tmp_path / "m.pt")
    said = str(caught.value)
    assert f"holds 3 optimizer states files: {name!r} is extra" in said, said
    assert "missing" not in said


def test_a_stale_zero3_model_file_is_left_unread(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    folder = zero_runs.copy(2, "z3", tmp_path / "run")
    _stale(folder, "model")
    consolidate(folder, tmp_path / "m.pt", verify="full")
    assert_equal_dicts(oracle(folder), torch.load(tmp_path / "m.pt", weights_only=True))

"""``consolidate`` on DeepSpeed ZeRO checkpoints, against DeepSpeed's own ``zero_to_fp32``.

The inputs are the session's real ZeRO runs (``zero_runs``: stages 1-3, fp32/bf16/fp16, 2 and
3 ranks, a frozen layer, a tied head, BatchNorm buffers); the oracle is ``zero_to_fp32``'s
state dict of the same tag, saved by DeepSpeed in the run and read here with ``torch.load``;
safetensors outputs are read with the ``safetensors`` package. Damaged copies of a run are
refused with one line naming the file, and nothing is written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_tools import consolidate, load_state_dict
from ckpt_tools.errors import CorruptCheckpointError, UnsafeContentError, UsageError
from ckpt_tools.harness.zero.runs import ZeroNet, zero_to_fp32
from tests.helpers import read_data_pkl, run_ckpt, tools, truncated_copy
from tests.helpers.files import deflated_copy
from tests.helpers.trees import assert_values_bitwise
from tests.helpers.zero_runs import RUN_IDS, ZeroRuns

FROZEN = ("frozen.weight", "frozen.bias")
TAG = "global_step2"
# The reserved entry our writers add beside the hub-style tie note.
TIE = {"ckpt_tools.tied": '{"head.weight":"embed.weight"}'}


def module_weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / TAG / "mp_rank_00_model_states.pt", weights_only=True)["module"]


@pytest.mark.parametrize(("ranks", "name"), RUN_IDS, ids=[f"{r}-{n}" for r, n in RUN_IDS])
def test_pt_equals_zero_to_fp32(zero_runs: ZeroRuns, tmp_path: Path, ranks: int, name: str) -> None:
    folder = zero_runs.folder(ranks, name)
    result = consolidate(folder, tmp_path / "m.pt")
    want = torch.load(zero_runs.reference(ranks, name), weights_only=True)
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    # the tied tensor's bytes once
    assert result.bytes_written == sum(t.nbytes for k, t in got.items() if k != "head.weight")
    if name.startswith("z1"):
        # ZeRO-1: zero_to_fp32 leaves the frozen layer out; we take it from the module
        assert not set(FROZEN) & set(want) and result.notes
        for key in FROZEN:
            assert_values_bitwise(module_weights(folder)[key], got.pop(key), key)
    assert list(got) == list(want)
    for key in want:
        assert_values_bitwise(want[key], got[key], key)
    # tied names share one storage, as zero_to_fp32 gives them
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()
    assert result.input_format == "deepspeed" and result.bytes_copied > 0


@pytest.mark.parametrize(("ranks", "name"), [(2, "z3-bf16"), (3, "z2")])
def test_safetensors_store_the_tied_tensor_once(
    zero_runs: ZeroRuns, tmp_path: Path, ranks: int, name: str
) -> None:
    result = consolidate(zero_runs.folder(ranks, name), tmp_path / "m.safetensors", verify="full")
    want = torch.load(zero_runs.reference(ranks, name), weights_only=True)
    got = load_file(tmp_path / "m.safetensors")
    assert result.dropped == ("head.weight",)
    assert "head.weight is stored once, as embed.weight (tied)" in result.notes
    assert sorted(got) == sorted(k for k in want if k != "head.weight")
    for key in got:
        assert_values_bitwise(want[key], got[key], key)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_dry_run_counts_the_tied_tensor_once_as_the_write_does(
    zero_runs: ZeroRuns, tmp_path: Path, suffix: str
) -> None:
    folder, out = zero_runs.folder(3, "z2"), tmp_path / f"m{suffix}"
    planned = consolidate(folder, out, dry_run=True)
    written = consolidate(folder, out)
    planned_bytes = sum(f.nbytes for f in planned.planned if f.tensors)
    assert planned_bytes == planned.bytes_written == written.bytes_written


def _metadata(out: Path) -> dict[str, str]:
    """The metadata that names a safetensors output's tied names: the file's, or the index's
    (less its total_size) in a sharded folder."""
    index = out / "model.safetensors.index.json"
    if index.is_file():
        found = json.loads(index.read_text())["metadata"]
        return {k: v for k, v in found.items() if k != "total_size"}
    with safe_open(out / "model.safetensors" if out.is_dir() else out, "pt") as f:
        return dict(f.metadata())


@pytest.mark.parametrize("output", ["file", "folder", "shards"])
def test_safetensors_outputs_record_the_tied_name(
    zero_runs: ZeroRuns, tmp_path: Path, output: str
) -> None:
    """The tied name left out is recorded as huggingface_hub records it, and loading the
    output gives zero_to_fp32's whole state dict back, the tie included."""
    want = torch.load(zero_runs.reference(3, "z2"), weights_only=True)
    # zero_to_fp32 gives views of one flat buffer, which huggingface_hub refuses to save:
    # each its own copy, the tied names one copy still.
    copies: dict[tuple[object, ...], torch.Tensor] = {}
    for t in want.values():
        copies.setdefault((t.data_ptr(), t.shape, t.stride(), t.dtype), t.clone())
    hub = tmp_path / "hub"  # the oracle's metadata: huggingface_hub's own save
    hub.mkdir()
    save_torch_state_dict(
        {k: copies[(t.data_ptr(), t.shape, t.stride(), t.dtype)] for k, t in want.items()}, hub
    )
    hub_metadata = _metadata(hub)
    assert hub_metadata == {"format": "pt", "head.weight": "embed.weight"}
    out = tmp_path / ("m.safetensors" if output == "file" else "hf")
    limit = 600 if output == "shards" else None
    planned = consolidate(zero_runs.folder(3, "z2"), out, max_shard_size=limit, dry_run=True)
    result = consolidate(zero_runs.folder(3, "z2"), out, max_shard_size=limit, verify="full")
    assert result.dropped == ("head.weight",)
    if output == "shards":  # the index holds the tie; each shard its format only
        assert _metadata(out) == {"head.weight": "embed.weight", **TIE}
        index = out / "model.safetensors.index.json"
        assert planned.planned[-1].nbytes == index.stat().st_size
    else:
        # The hub's note, and our reserved entry: the one our reader restores names from.
        assert _metadata(out) == {**hub_metadata, **TIE}
    got = load_state_dict(out)
    assert sorted(got) == sorted(want)
    for key in want:
        assert_values_bitwise(want[key], got[key], key)
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()
    model = ZeroNet()
    model.load_state_dict(got, strict=True)
    assert model.head.weight is model.embed.weight


def test_hf_folder_shards(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = consolidate(zero_runs.folder(2, "z3"), out, max_shard_size=600, jobs=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and len(result.written) > 2
    got: dict[str, torch.Tensor] = {}
    for shard in set(index["weight_map"].values()):
        got.update(load_file(out / shard))
    want = torch.load(zero_runs.reference(2, "z3"), weights_only=True)
    assert sorted(got) == sorted(k for k in want if k != "head.weight")
    for key in got:
        assert_values_bitwise(want[key], got[key], key)


def test_tag_and_exclude_frozen(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    folder = zero_runs.folder(2, "z2-bf16")
    consolidate(folder, tmp_path / "old.pt", tag="global_step1", exclude_frozen=True)
    want = torch.load(zero_runs.reference(2, "z2-bf16", "global_step1"), weights_only=True)
    got = torch.load(tmp_path / "old.pt", weights_only=True)
    # zero_to_fp32's exclude_frozen_parameters: the same state dict less the frozen layer
    assert list(got) == [k for k in want if k not in FROZEN]
    for key in got:
        assert_values_bitwise(want[key], got[key], key)
    newer = torch.load(zero_runs.reference(2, "z2-bf16"), weights_only=True)
    assert not torch.equal(newer["hidden.weight"], got["hidden.weight"])


def test_cli_writes_reports_and_runs_without_torch(
    zero_runs: ZeroRuns, tmp_path: Path, no_torch_env: dict[str, str]
) -> None:
    folder = zero_runs.folder(3, "z3-bf16")
    code, out, err = run_ckpt("consolidate", str(folder), str(tmp_path / "dry.pt"), "--dry-run")
    assert code == 0, err
    assert "would consolidate" in out and not (tmp_path / "dry.pt").exists()
    code, out, err = run_ckpt(
        "consolidate", str(folder), str(tmp_path / "m.pt"), "--json", how="module", env=no_torch_env
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["input_format"] == "deepspeed" and report["tensors"] == 11
    want = torch.load(zero_runs.reference(3, "z3-bf16"), weights_only=True)
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    for key in want:
        assert_values_bitwise(want[key], got[key], key)


@pytest.mark.parametrize("name", ["z0", "z0-fp16", "z1-bf16opt"])
def test_runs_zero_to_fp32_refuses(zero_runs: ZeroRuns, tmp_path: Path, name: str) -> None:
    """ZeRO-0: the module's weights as saved; the bf16 optimizer's fp32 master weights, which
    torch's cast to bf16 turns into the module's."""
    folder = zero_runs.folder(2, name)
    result = consolidate(folder, tmp_path / "m.pt")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    module = module_weights(folder)
    assert set(got) == set(module) | {"head.weight"}
    for key, want in module.items():
        if name.startswith("z0"):
            assert_values_bitwise(want, got[key], key)
        else:
            assert torch.equal(got[key].to(want.dtype), want), key
    assert got["head.weight"].data_ptr() == got["embed.weight"].data_ptr()
    assert result.notes
    if name == "z0-fp16":  # (an fp16 run keeps an fp32 master copy: it is said to be unread)
        assert any("fp32 master copy, in the optimizer's state, is not read" in n
                   for n in result.notes)  # fmt: skip


def test_a_tag_naming_no_tag_folder_is_a_usage_error(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    folder = zero_runs.folder(2, "z2-bf16")
    with pytest.raises(UsageError, match=r"tags there: global_step1, global_step2") as info:
        consolidate(folder, tmp_path / "m.pt", tag="global_step9")
    assert not isinstance(info.value, CorruptCheckpointError)
    args = ("consolidate", folder, tmp_path / "m.pt", "--tag", "global_step9")
    code, out, err = run_ckpt(*args, code=None)
    assert code == UsageError.exit_code == 2, err
    assert "--tag 'global_step9': not a folder" in err and "pass --tag global_step1" in err
    assert not out and os.listdir(tmp_path) == []


def test_options_that_do_not_apply_are_refused(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="select='module': does not apply"):
        consolidate(zero_runs.folder(2, "z3"), tmp_path / "m.pt", select="module")
    # The command line names its flags, never the library's arguments.
    for flag in (["--all"], ["--select", "module"]):
        folder = zero_runs.folder(2, "z3")
        code, _, err = run_ckpt("consolidate", folder, tmp_path / "m.pt", *flag, code=None)
        assert code == 2 and f"{' '.join(flag)}: does not apply" in err.replace("'", ""), err
        assert "include_all" not in err and "select does" not in err
    with pytest.raises(UsageError, match=r"tag=.*: for DeepSpeed checkpoints only"):
        consolidate(tmp_path, tmp_path / "m.pt", tag="global_step1")
    assert os.listdir(tmp_path) == []


# --- damaged copies: refused while planning, one line naming the file, nothing written -------


def _drop_rank(folder: Path) -> str:
    (folder / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()  # the last
    return "holds 2 optimizer states files: the file of data-parallel rank 2 is missing"


def _truncate_partition(folder: Path) -> str:
    path = folder / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    truncated_copy(path, path.with_suffix(".cut"), -100)
    path.with_suffix(".cut").replace(path)
    return "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _latest_names_nothing(folder: Path) -> str:
    (folder / "latest").write_text("global_step9")
    return "names tag 'global_step9', which is not a folder"


def _shapes_do_not_fit(folder: Path) -> str:
    path = folder / TAG / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=True)
    states["param_shapes"][0]["hidden.bias"] = torch.Size([17])
    torch.save(states, path)
    return "mp_rank_00_model_states.pt': its parameter shapes do not fit"


def _drop_partitions(folder: Path) -> str:
    for path in (folder / TAG).glob("*_optim_states.pt"):
        path.unlink()
    return "though its run trained with ZeRO stage 2: the ranks' partitions are missing"


def _offloaded(folder: Path) -> str:
    (folder / TAG / "offloaded_tensors").mkdir()  # as an NVMe-offloaded save leaves it
    return "offloaded to NVMe"


DAMAGE = {
    "nvme-offload": _offloaded,
    "missing-rank": _drop_rank,
    "no-partitions": _drop_partitions,
    "truncated-partition": _truncate_partition,
    "latest-names-no-folder": _latest_names_nothing,
    "shapes-do-not-fit": _shapes_do_not_fit,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_runs_are_refused(zero_runs: ZeroRuns, tmp_path: Path, damage: str) -> None:
    folder = zero_runs.copy(3, "z2", tmp_path / "run")
    said = DAMAGE[damage](folder)
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, err = run_ckpt("consolidate", folder, out / "m.pt", code=None)
    assert code == CorruptCheckpointError.exit_code, err  # UnsupportedFormatError's too
    assert len(err.strip().splitlines()) == 1 and said in err, err
    assert os.listdir(out) == [] and not stdout


def test_a_hostile_global_in_a_rank_file_is_never_run(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    folder = zero_runs.copy(2, "z2-bf16", tmp_path / "run")
    marker = tmp_path / "ran"
    path = folder / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    payload = read_data_pkl(path)
    version = b"X\x06\x00\x00\x000.19.8"  # the ds_version string, as protocol 2 writes it
    command = f"touch {marker}".encode()
    call = b"cposix\nsystem\n(X" + len(command).to_bytes(4, "little") + command + b"tR"
    assert version in payload
    hostile = tmp_path / "hostile.pt"
    tools().rewrite_zip(path, hostile, replace={"data.pkl": payload.replace(version, call, 1)})
    hostile.replace(path)
    with pytest.raises(UnsafeContentError, match=r"posix\.system"):
        consolidate(folder, tmp_path / "m.pt")
    code, _, err = run_ckpt("consolidate", folder, tmp_path / "m.pt", code=None)
    assert code == UnsafeContentError.exit_code and "posix.system" in err
    assert not marker.exists() and not (tmp_path / "m.pt").exists()


def test_commands_that_read_one_file_say_consolidate_it_first(
    zero_runs: ZeroRuns, tmp_path: Path
) -> None:
    # A usage refusal (exit 2), as for a DCP folder: the run is fine, consolidate reads it.
    folder = zero_runs.folder(3, "z2")
    for args in (
        ["convert", folder, tmp_path / "o.pt"],
        ["slim", folder, tmp_path / "o.pt", "--dtype", "bf16"],
        ["diff", folder, folder],
    ):
        err = run_ckpt(*args, code=UsageError.exit_code).stderr
        assert "is a DeepSpeed ZeRO checkpoint" in err and f"ckpt consolidate {folder}" in err
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("name", ["out.pt", "out.safetensors"])
def test_a_run_whose_rank_files_were_re_zipped_consolidates_as_zero_to_fp32(
    zero_runs: ZeroRuns, tmp_path: Path, name: str
) -> None:
    # torch reads deflated records; the rank files are opened, located and let go before
    # the output is written, so their inflated copies must outlive them.
    folder = tmp_path / "run"
    shutil.copytree(zero_runs.folder(3, "z2"), folder, ignore=shutil.ignore_patterns("*.pt"))
    for rank_file in (zero_runs.folder(3, "z2") / TAG).glob("*.pt"):
        deflated_copy(rank_file, folder / TAG / rank_file.name)
    consolidate(folder, tmp_path / name)
    want = torch.load(zero_runs.reference(3, "z2"), weights_only=True)
    got = (
        load_file(tmp_path / name)
        if name.endswith(".safetensors")
        else torch.load(tmp_path / name, weights_only=True)
    )
    for key in got:
        assert_values_bitwise(want[key], got[key], key)
    assert set(want) - set(got) <= {"head.weight"}


@pytest.mark.parametrize(("ranks", "name"), [(2, "z3"), (3, "z2")])
def test_float8_buffers_come_out_in_fp32_as_zero_to_fp32_gives_them(
    zero_runs: ZeroRuns, tmp_path: Path, ranks: int, name: str
) -> None:
    # DeepSpeed upcasts every buffer whose is_floating_point() holds: float8 too (an FP8
    # run's scale and amax history). Every bit pattern of each format, NaNs included.
    from ckpt_tools.io.float8 import FLOAT8_DTYPES

    folder = zero_runs.copy(ranks, name, tmp_path / "run")
    for states in (folder / TAG).glob("*model_states.pt"):  # ZeRO-3: one per rank
        saved = torch.load(states, weights_only=False)
        for dtype in FLOAT8_DTYPES:
            every = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype))
            saved["module"][f"fp8.{dtype}"] = every
            saved["buffer_names"].append(f"fp8.{dtype}")
        torch.save(saved, states)
    want = zero_to_fp32(folder)
    consolidate(folder, tmp_path / "m.pt")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(got) == list(want)
    for key in want:
        assert_values_bitwise(want[key], got[key], key)
    assert {got[f"fp8.{d}"].dtype for d in FLOAT8_DTYPES} == {torch.float32}

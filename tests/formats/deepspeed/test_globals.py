"""The globals of DeepSpeed's rank files: DeepSpeed's classes read as data, nothing else.

A rank file pickled by Python 3.11.0-3.11.4 names the ZeRO stage as
``getattr(ZeroStageEnum, "gradients")`` (those Pythons pickle an enum member by name; later
ones, like the session's, by value). The files here are the session's real runs with their
stage re-pickled that way; any other use of ``getattr`` is refused, never run. A call of
``posix.system`` planted in a model states file is listed and never run where the reader
does not use the entry (the client state), and refused where it does.
"""

from __future__ import annotations

import pickletools
import re
from pathlib import Path

import pytest
import torch

from ckpt_tools import consolidate
from ckpt_tools.errors import UnsafeContentError
from ckpt_tools.formats.deepspeed.reader import open_deepspeed
from tests.helpers import read_data_pkl, tools
from tests.helpers.zero_runs import ZeroRuns

ENUM = b"cdeepspeed.runtime.zero.config\nZeroStageEnum\n"


def stage_by_name(payload: bytes, member: bytes, module: bytes = b"builtins") -> bytes:
    """``ZeroStageEnum(n)`` (GLOBAL, BINPUT, BININT1 n, TUPLE1, ... REDUCE) turned into
    ``getattr(ZeroStageEnum, member)`` as Python 3.11.0-3.11.4 write it (``module`` is
    ``__builtin__`` in protocol 2, torch.save's, and ``builtins`` from protocol 3)."""
    found = re.search(re.escape(ENUM) + rb"(q.)K.\x85", payload, re.DOTALL)
    if found is None and b"getattr" in payload:
        # The Python that made the runs (3.11.0-3.11.4) pickles the stage by name already:
        # every other DeepSpeed test then reads that real form.
        pytest.skip("the runs were saved with the stage pickled by name")
    assert found is not None
    call = b"c" + module + b"\ngetattr\n" + ENUM + found.group(1)
    call += b"X" + len(member).to_bytes(4, "little") + member + b"\x86"
    return payload[: found.start()] + call + payload[found.end() :]


def by_name_copy(
    zero_runs: ZeroRuns, dst: Path, member: bytes, module: bytes = b"builtins"
) -> Path:
    folder = zero_runs.copy(3, "z2", dst)
    for path in (folder / "global_step2").glob("*_optim_states.pt"):
        payload = stage_by_name(read_data_pkl(path), member, module)
        assert any(op.name == "REDUCE" for op, _, _ in pickletools.genops(payload))
        tools().rewrite_zip(path, path.with_suffix(".new"), replace={"data.pkl": payload})
        path.with_suffix(".new").replace(path)
    return folder


@pytest.mark.parametrize("module", [b"builtins", b"__builtin__"])
def test_a_stage_pickled_by_name_reads_as_by_value(
    zero_runs: ZeroRuns, tmp_path: Path, module: bytes
) -> None:
    folder = by_name_copy(zero_runs, tmp_path / "run", b"gradients", module)
    assert b"getattr" in read_data_pkl(
        folder / "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    assert open_deepspeed(folder).zero.stage == 2  # type: ignore[union-attr]
    consolidate(folder, tmp_path / "m.pt")
    want = torch.load(zero_runs.reference(3, "z2"), weights_only=True)
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("module", [b"builtins", b"__builtin__"])
@pytest.mark.parametrize("member", [b"__class__", b"mro", b"weightss"])
def test_any_other_getattr_is_refused(
    zero_runs: ZeroRuns, tmp_path: Path, member: bytes, module: bytes
) -> None:
    folder = by_name_copy(zero_runs, tmp_path / "run", member, module)
    with pytest.raises(UnsafeContentError, match=module.decode() + r"\.getattr"):
        open_deepspeed(folder)
    with pytest.raises(UnsafeContentError):
        consolidate(folder, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def planted(path: Path, old: bytes, marker: Path) -> None:
    """Replace the pickled string ``old`` (protocol 2's BINUNICODE) in ``path``'s data.pkl
    by ``posix.system("touch MARKER")``, which loading with pickle would run."""
    payload = read_data_pkl(path)
    value = b"X" + len(old).to_bytes(4, "little") + old
    command = f"touch {marker}".encode()
    call = b"cposix\nsystem\n(X" + len(command).to_bytes(4, "little") + command + b"tR"
    assert payload.count(value) >= 1
    tools().rewrite_zip(
        path, path.with_suffix(".new"), replace={"data.pkl": payload.replace(value, call, 1)}
    )
    path.with_suffix(".new").replace(path)


def test_a_global_in_the_client_state_is_reported_never_run(
    zero_runs: ZeroRuns, tmp_path: Path
) -> None:
    """The model states file's entries besides the model (here ds_version, as a client
    state's Namespace would be) may name any global: it is listed, never imported."""
    folder = zero_runs.copy(2, "z2-bf16", tmp_path / "run")
    marker = tmp_path / "ran"
    planted(folder / "global_step2" / "mp_rank_00_model_states.pt", b"0.19.8", marker)
    ckpt = open_deepspeed(folder)
    assert ckpt.unsafe_globals == ("posix.system",)
    consolidate(folder, tmp_path / "m.pt")
    want = torch.load(zero_runs.reference(2, "z2-bf16"), weights_only=True)
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not marker.exists()


def test_a_global_in_an_entry_we_read_is_refused(zero_runs: ZeroRuns, tmp_path: Path) -> None:
    folder = zero_runs.copy(2, "z2-bf16", tmp_path / "run")
    marker = tmp_path / "ran"
    planted(folder / "global_step2" / "mp_rank_00_model_states.pt", b"norm.running_mean", marker)
    with pytest.raises(UnsafeContentError, match=r"posix\.system"):
        consolidate(folder, tmp_path / "m.pt")
    assert not marker.exists() and not (tmp_path / "m.pt").exists()

"""DeepSpeed ZeRO folders read torch-free, against DeepSpeed's own ``zero_to_fp32``.

The folders are the session's real ZeRO runs (``zero_runs``, ``tests/helpers/zero_runs.py``):
stages 1, 2 and 3, fp32, bf16 and fp16 training, 2 and 3 ranks. The reader's state dict
must name what ``zero_to_fp32`` gives, in its order, with its dtypes and shapes, and the
bytes it points at must be ``zero_to_fp32``'s values.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_tools import inspect
from ckpt_tools.formats import detect_format, open_checkpoint
from ckpt_tools.formats.deepspeed.reader import DeepSpeedCheckpoint, open_deepspeed
from tests.helpers import run_ckpt
from tests.helpers.trees import dtype_name, value_bytes
from tests.helpers.zero_runs import RUN_IDS, ZeroRuns

FROZEN = ["frozen.weight", "frozen.bias"]


def spans_tensor(ckpt: DeepSpeedCheckpoint, name: str) -> torch.Tensor:
    """A tensor rebuilt with torch from the byte spans the reader gives for ``name``."""
    source = ckpt.sources[ckpt.aliases.get(name, name)]
    data = bytearray()
    for span in source.spans:
        with open(span.path, "rb") as f:
            f.seek(span.offset)
            data += f.read(span.nbytes)
    stored = torch.frombuffer(data, dtype=getattr(torch, source.dtype)) if data else None
    t = ckpt.root[name]
    if stored is None:
        return torch.empty(t.shape, dtype=getattr(torch, t.dtype))
    return stored.to(getattr(torch, t.dtype)).reshape(t.shape)


@pytest.mark.parametrize(("ranks", "name"), RUN_IDS, ids=[f"{r}-{n}" for r, n in RUN_IDS])
def test_reads_what_zero_to_fp32_gives(zero_runs: ZeroRuns, ranks: int, name: str) -> None:
    ckpt = open_checkpoint(zero_runs.folder(ranks, name))
    assert isinstance(ckpt, DeepSpeedCheckpoint) and ckpt.format == "deepspeed"
    want = torch.load(zero_runs.reference(ranks, name), weights_only=True)
    got = dict(ckpt.root)
    if ckpt.zero.stage == 1:  # type: ignore[union-attr]
        # zero_to_fp32 leaves ZeRO-1's frozen weights out; the module holds them whole
        assert ckpt.zero.frozen_from_module and not set(FROZEN) & set(want)  # type: ignore[union-attr]
        for key in FROZEN:
            got.pop(key)
    assert list(got) == list(want)
    for key, t in got.items():
        assert (t.dtype, t.shape) == (dtype_name(want[key].dtype), tuple(want[key].shape)), key
        assert torch.equal(value_bytes(spans_tensor(ckpt, key)), value_bytes(want[key])), key
    assert ckpt.root["head.weight"] is ckpt.root["embed.weight"]


def test_stage_one_frozen_weights_are_the_modules(zero_runs: ZeroRuns) -> None:
    folder = zero_runs.folder(2, "z1a-bf16")
    module = torch.load(folder / "global_step2" / "mp_rank_00_model_states.pt", weights_only=True)[
        "module"
    ]
    ckpt = open_deepspeed(folder)
    for key in FROZEN:
        assert torch.equal(spans_tensor(ckpt, key), module[key])
        assert ckpt.root[key].dtype == "bfloat16"


def test_stage_one_module_reached_twice_is_no_frozen_weight(zero_runs: ZeroRuns, tmp_path) -> None:
    # A model that holds a module under a second name (self.alias = self.hidden) saves its
    # weights twice in the module state, one storage each; zero_to_fp32 names them once.
    folder = zero_runs.copy(2, "z1a-bf16", tmp_path / "run")
    states = folder / "global_step2" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    module = saved["module"]
    for part in ("weight", "bias"):
        module[f"alias.{part}"] = module[f"hidden.{part}"]  # the same tensor, as state_dict
    torch.save(saved, states)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    want = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    got = dict(open_deepspeed(folder).root)
    assert not [k for k in want if k.startswith("alias.")]
    assert [k for k in got if k not in FROZEN] == list(want)


@pytest.mark.parametrize(
    ("ranks", "name", "stage", "master", "weights", "frozen"),
    [
        (2, "z1", 1, "float32", "float32", True),
        (2, "z2-bf16", 2, "float32", "bfloat16", False),
        (2, "z2-fp16", 2, "float32", "float16", False),
        (3, "z3-bf16", 3, "float32", "bfloat16", False),
    ],
)
def test_inspect_reports_the_run(
    zero_runs: ZeroRuns,
    ranks: int,
    name: str,
    stage: int,
    master: str,
    weights: str,
    frozen: bool,
) -> None:
    info = inspect(zero_runs.folder(ranks, name))
    zero = info.format_info
    assert zero is not None and info.format == "deepspeed"
    assert (zero.tag, zero.stage, zero.dp_world_size, zero.mp_world_size) == (
        "global_step2",
        stage,
        ranks,
        1,
    )
    assert (zero.master_dtype, zero.weights_dtype, zero.frozen_from_module) == (
        master,
        weights,
        frozen,
    )
    assert zero.frozen == tuple(FROZEN) and zero.shared == (("head.weight", "embed.weight"),)
    assert info.tensor("head.weight").shared_with == ("embed.weight",)
    assert len({f.name for f in zero.files if f.name.endswith("_optim_states.pt")}) == ranks
    assert not info.unsafe_globals  # DeepSpeed's classes are read as data
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in zero.data_globals


def test_ckpt_inspect_prints_and_dumps_it(zero_runs: ZeroRuns) -> None:
    folder = zero_runs.folder(2, "z2-bf16")
    code, out, _ = run_ckpt("inspect", str(folder))
    assert code == 0
    assert "format:      deepspeed" in out
    assert "tag global_step2 (tags: global_step1, global_step2), ZeRO stage 2" in out
    assert "weights:     master float32, module bfloat16" in out
    assert "shared:      head.weight = embed.weight" in out
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: float32 partition" in out
    code, out, _ = run_ckpt("inspect", str(folder / "global_step1"), "--json")
    assert code == 0
    dumped = json.loads(out)["format_info"]
    assert dumped["tag"] == "global_step1" and dumped["stage"] == 2
    assert dumped["shared"] == {"head.weight": "embed.weight"}


def test_detects_save_and_tag_folders(zero_runs: ZeroRuns) -> None:
    folder = zero_runs.folder(2, "z3")
    assert detect_format(folder) == detect_format(folder / "global_step2") == "deepspeed"
    assert open_deepspeed(folder).zero.tag == "global_step2"  # type: ignore[union-attr]
    older = open_deepspeed(zero_runs.folder(2, "z2-bf16"), tag="global_step1")
    assert older.zero.tag == "global_step1"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["z0", "z0-fp16"])
def test_zero0_is_the_module_as_saved(zero_runs: ZeroRuns, name: str) -> None:
    """zero_to_fp32 refuses ZeRO-0; its module weights are the model, tied names included."""
    folder = zero_runs.folder(2, name)
    module = torch.load(folder / "global_step2" / "mp_rank_00_model_states.pt", weights_only=True)[
        "module"
    ]
    ckpt = open_deepspeed(folder)
    assert list(ckpt.root) == list(module)
    for key, t in ckpt.root.items():
        assert torch.equal(spans_tensor(ckpt, key), module[key]), key
        assert t.dtype == dtype_name(module[key].dtype), key
    assert ckpt.root["head.weight"] is ckpt.root["embed.weight"]
    zero = ckpt.zero
    assert zero is not None
    assert (zero.stage, zero.optimizer, zero.master_dtype) == (0, "none", "none")
    assert zero.shared == (("head.weight", "embed.weight"),)


def test_bf16_optimizer_partitions_are_read(zero_runs: ZeroRuns) -> None:
    """bf16 at stage 1 with fp32 gradients: DeepSpeed's bf16 optimizer, whose files
    zero_to_fp32 refuses. Its fp32 master weights, cast to bf16 by torch, are the module's
    bf16 weights; the frozen layer comes from the module, as at ZeRO-1."""
    folder = zero_runs.folder(2, "z1-bf16opt")
    module = torch.load(folder / "global_step2" / "mp_rank_00_model_states.pt", weights_only=True)[
        "module"
    ]
    ckpt = open_deepspeed(folder)
    zero = ckpt.zero
    assert zero is not None
    assert (zero.stage, zero.optimizer, zero.master_dtype) == (1, "bf16 optimizer", "float32")
    assert zero.frozen == tuple(FROZEN) and zero.frozen_from_module
    assert set(ckpt.root) == set(module) | {"head.weight"}
    for key, want in module.items():
        got = spans_tensor(ckpt, key)
        assert torch.equal(got.to(want.dtype), want), key
        if ckpt.sources[ckpt.aliases.get(key, key)].kind == "trained":
            assert got.dtype == torch.float32, key

"""The harness's DeepSpeed runs (``ckpt_tools.harness.zero.runs``): real ZeRO training on CPU ranks
under torchrun, saved with ``engine.save_checkpoint``, in the layout each stage writes.

The runs are the session's (``zero_runs`` in ``tests/conftest.py``): made once, read here.
"""

from __future__ import annotations

import pytest
import torch

from ckpt_tools.errors import UsageError
from ckpt_tools.harness.zero.runs import ZeroNet, ZeroRun, deepspeed_config
from tests.helpers.zero_runs import ZeroRuns


def names(folder: object) -> list[str]:
    return sorted(p.name for p in folder.iterdir())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("ranks", "name", "files"),
    [
        (
            2,
            "z2-bf16",  # bf16 training: the optimizer files carry the bf16_ prefix
            [
                "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "mp_rank_00_model_states.pt",
            ],
        ),
        (
            3,
            "z2",
            [
                "mp_rank_00_model_states.pt",
                *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)),
            ],
        ),
        (
            2,
            "z3",  # ZeRO-3: every rank writes its model states too
            [
                f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                for r in range(2)
                for kind in ("model", "optim")
            ],
        ),
    ],
)
def test_each_stage_saves_its_layout(
    zero_runs: ZeroRuns, ranks: int, name: str, files: list[str]
) -> None:
    folder = zero_runs.folder(ranks, name)
    tag = (folder / "latest").read_text()
    assert tag == "global_step2"
    assert names(folder / tag) == sorted(files)
    # save_checkpoint copies DeepSpeed's own converters beside the tags
    assert {"zero_to_fp32.py", "latest", tag} <= set(names(folder))


def test_saves_leave_one_tag_per_saved_step(zero_runs: ZeroRuns) -> None:
    folder = zero_runs.folder(2, "z2-bf16")
    assert {"global_step1", "global_step2"} <= set(names(folder))
    assert (folder / "latest").read_text() == "global_step2"
    assert zero_runs.reference(2, "z2-bf16", "global_step1").is_file()


def test_the_reference_is_zero_to_fp32s_state_dict(zero_runs: ZeroRuns) -> None:
    """Trained fp32 master weights, 16-bit frozen weights, fp32 float buffers, an int64
    counter, and the tied head sharing the embedding's tensor."""
    sd = torch.load(zero_runs.reference(2, "z3-bf16"), weights_only=True)
    model = ZeroNet()
    assert set(sd) == set(model.state_dict())
    assert sd["head.weight"] is sd["embed.weight"]
    assert sd["frozen.weight"].dtype == torch.bfloat16
    assert sd["hidden.weight"].dtype == sd["norm.running_mean"].dtype == torch.float32
    assert sd["norm.num_batches_tracked"].dtype == torch.int64
    assert sd["norm.num_batches_tracked"].item() == 2  # two training steps
    torch.manual_seed(0)
    untrained = ZeroNet().state_dict()
    assert not torch.equal(sd["hidden.weight"], untrained["hidden.weight"])
    assert torch.equal(sd["frozen.weight"], untrained["frozen.weight"].bfloat16())


def test_runs_are_checked_before_anything_starts() -> None:
    with pytest.raises(UsageError, match="stage=4"):
        ZeroRun("r", stage=4).validate()
    with pytest.raises(UsageError, match="dtype"):
        ZeroRun("r", stage=2, dtype="fp8").validate()
    with pytest.raises(UsageError, match="saves"):
        ZeroRun("r", stage=2, steps=1, saves=2).validate()


def test_config_asks_for_what_each_run_needs() -> None:
    bf16 = deepspeed_config(ZeroRun("r", stage=3, dtype="bf16", sub_group_size=40), 8)
    assert bf16["zero_optimization"] == {"stage": 3, "sub_group_size": 40}
    # BatchNorm's buffers must follow the parameters into bf16, or its forward fails
    assert bf16["data_types"] == {"buffer_dtype": "bf16"}
    aligned = deepspeed_config(ZeroRun("r", stage=1, parameter_alignment=True), 8)
    assert aligned["zero_optimization"]["parameter_alignment"] is True
    assert "bf16" not in aligned and "fp16" not in aligned


def test_a_launch_past_its_timeout_ends_every_process_it_started(tmp_path) -> None:
    # torchrun's ranks run in sessions of their own and share its output pipe: killing
    # torchrun (or its group) left them running, and the wait lasted until they closed it.
    import os
    import subprocess
    import sys
    import time

    from ckpt_tools.harness.zero.launch import ZeroLaunch

    child = tmp_path / "child.pid"
    rank = "import time; time.sleep(120)"
    script = (
        "import subprocess, sys, time;"
        f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True);"
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(120)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    launch = ZeroLaunch(tmp_path, (ZeroRun("r", stage=1),), process)
    while not child.exists() or not child.read_text():
        time.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited -15"):  # torchrun is told first
        launch.wait(timeout=1)
    assert time.monotonic() - started < 30
    pid = int(child.read_text())
    for _ in range(100):  # reaped by init once killed
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {pid} outlived the launch")

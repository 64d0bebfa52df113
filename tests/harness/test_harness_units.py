"""Models, data, device placement, config validation and the manual all-reduce: in-process, fast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt_tools.harness as harness
from ckpt_tools.errors import UsageError
from ckpt_tools.harness.config import TrainConfig, TrainResult, torchrun_env
from ckpt_tools.harness.data import batch_indices, shard, steps_per_epoch, synthetic_fashion
from ckpt_tools.harness.loop import deterministic, init_model, local_loss
from ckpt_tools.harness.manual import allreduce_mean_grads, broadcast_state
from ckpt_tools.harness.models import MODEL_NAMES, build_harness_model, has_batchnorm
from ckpt_tools.harness.parity.reference import compare_state_dicts
from ckpt_tools.harness.placement import resolve_devices
from tests.helpers.cli import modules_loaded_by

PACKAGE = Path(harness.__file__).resolve().parent


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_maps_fashion_images_to_ten_logits(name: str) -> None:
    model = build_harness_model(name)
    images = synthetic_fashion(4).tensors[0]
    assert model(images).shape == (4, 10)


def test_resnet_has_batchnorm_and_syncbn_variant_keeps_the_keys() -> None:
    plain, synced = build_harness_model("resnet"), build_harness_model("resnet-syncbn")
    assert has_batchnorm(plain) and not has_batchnorm(build_harness_model("mlp"))
    assert any(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())
    assert list(plain.state_dict()) == list(synced.state_dict())
    assert "layer1.bn1.num_batches_tracked" in plain.state_dict()


def test_lenet_is_the_tutorial_shape() -> None:
    shapes = {k: tuple(v.shape) for k, v in build_harness_model("lenet").state_dict().items()}
    assert shapes["features.0.weight"] == (20, 1, 3, 3)
    assert shapes["features.3.weight"] == (50, 20, 5, 5)
    assert shapes["classifier.1.weight"] == (128, 800)


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(UsageError, match="expected one of: mlp, lenet, resnet"):
        build_harness_model("vgg")
    with pytest.raises(UsageError, match="does not take"):
        build_harness_model("mlp", depth=3)


def test_dataset_is_a_pure_function_of_the_seed() -> None:
    a, b, c = synthetic_fashion(64, 1), synthetic_fashion(64, 1), synthetic_fashion(64, 2)
    images, labels = a.tensors
    assert images.shape == (64, 1, 28, 28) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and int(labels.min()) >= 0 and int(labels.max()) < 10
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    assert not torch.equal(images, c.tensors[0])


def test_batch_schedule_covers_each_epoch_once_and_shards_partition_it() -> None:
    epoch = torch.cat([batch_indices(s, 64, 16, 0) for s in range(steps_per_epoch(64, 16))])
    assert sorted(epoch.tolist()) == list(range(64))
    assert not torch.equal(batch_indices(0, 64, 16, 0), batch_indices(4, 64, 16, 0))
    idx = batch_indices(0, 64, 15, 0)
    parts = [shard(idx, r, 4) for r in range(4)]
    assert [len(p) for p in parts] == [4, 4, 4, 3]
    assert torch.equal(torch.cat(parts), idx)


def test_scaled_local_losses_average_to_the_global_mean_gradient() -> None:
    torch.manual_seed(0)
    w = torch.randn(10, 784, requires_grad=True)
    images, labels = synthetic_fashion(15).tensors
    x = images.flatten(1)
    nn.functional.cross_entropy(x @ w.T, labels).backward()
    global_grad, w.grad = w.grad.clone(), None
    grads = []
    for part in torch.tensor_split(torch.arange(15), 4):  # uneven shards: 4, 4, 4, 3
        local_loss(x[part] @ w.T, labels[part], 15, 4).backward()
        grads.append(w.grad.clone())
        w.grad = None
    torch.testing.assert_close(sum(grads) / 4, global_grad, rtol=0, atol=1e-6)


def test_manual_allreduce_averages_and_broadcast_copies_buffers() -> None:
    master, other = build_harness_model("resnet"), build_harness_model("resnet")
    for i, model in enumerate((master, other)):
        for p in model.parameters():
            p.grad = torch.full_like(p, float(2 * i))  # 0 on the master, 2 on the other
    allreduce_mean_grads([master, other])
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in master.parameters())
    master.stem[1].running_mean.fill_(3.0)
    broadcast_state(master, [master, other])
    assert torch.equal(other.stem[1].running_mean, master.stem[1].running_mean)
    assert all(torch.equal(a, b) for a, b in zip(master.parameters(), other.parameters()))


def test_init_model_is_seeded_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = init_model(TrainConfig(model="lenet", seed=5))
    after = torch.rand(3)
    b = init_model(TrainConfig(model="lenet", seed=5))
    assert torch.equal(expected, after)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_deterministic_restores_the_callers_setting() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic():
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_cpu_placement_and_its_errors() -> None:
    assert resolve_devices(3, device="cpu") == [torch.device("cpu")] * 3
    assert len(resolve_devices(None, device="cpu")) == 2
    with pytest.raises(UsageError, match="at least 1"):
        resolve_devices(0, device="cpu")
    with pytest.raises(UsageError, match="device='tpu'"):
        resolve_devices(2, device="tpu")
    with pytest.raises(UsageError, match="contradict"):
        resolve_devices(2, gpus="0", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_without_a_gpu_asking_for_gpus_is_a_usage_error() -> None:
    assert resolve_devices(2) == [torch.device("cpu")] * 2
    for kw in ({"gpus": "0,1"}, {"gpus": "auto:2"}, {"device": "cuda"}):
        with pytest.raises(UsageError, match="no CUDA device is visible") as info:
            resolve_devices(2, **kw)
        assert isinstance(info.value, ValueError)
        # The fix offered is one the next run accepts: --gpus and --device cpu contradict.
        (remedy,) = info.value.remedies
        fixed = {} if "gpus" in kw else {"device": "cpu"}
        assert remedy.argument == ("gpus" if "gpus" in kw else "device")
        assert resolve_devices(2, **fixed) == [torch.device("cpu")] * 2


@pytest.mark.parametrize(
    ("kw", "message", "option"),
    [
        (
            {"strategy": "zero3"},
            "strategy='zero3': expected one of: single, dp, ddp, manual, fsdp",
            None,
        ),
        ({"model": "vgg"}, "model='vgg'", "--arch 'vgg'"),
        ({"steps": 0}, "steps=0", "--steps 0"),
        ({"world_size": 0}, "world_size=0", "--world-size 0"),
        (
            {"strategy": "manual", "world_size": 4, "batch_size": 2},
            "raise batch_size",
            "raise --batch-size",
        ),
        ({"batch_size": 10_000}, "batch_size=10000: must be between", "--batch-size 10000"),
    ],
)
def test_train_rejects_bad_arguments_with_the_option_that_fixes_them(
    kw: dict[str, object], message: str, option: str | None
) -> None:
    # The library names the argument; the command line names the option.
    with pytest.raises(UsageError, match=message) as info:
        harness.train(TrainConfig(device="cpu", **kw))  # type: ignore[arg-type]
    if option is not None:
        assert option in info.value.render(for_cli=True)


def test_torchrun_detection_needs_all_variables() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    assert torchrun_env(env) is not None and torchrun_env(env).local_world_size == 4
    assert torchrun_env({**env, "LOCAL_WORLD_SIZE": "2"}).local_world_size == 2
    assert torchrun_env({k: v for k, v in env.items() if k != "MASTER_ADDR"}) is None
    for name, value in (("WORLD_SIZE", "abc"), ("RANK", "-1"), ("LOCAL_WORLD_SIZE", "²")):
        with pytest.raises(UsageError, match=f"{name}={value!r} is not a whole number"):
            torchrun_env({**env, name: value})


def test_train_result_json_round_trip(tmp_path: Path) -> None:
    result = TrainResult("ddp", "mlp", 2, ("cpu", "cpu"), (2.3, 2.2), 2, 0, backend="gloo")
    result.write_json(tmp_path)
    assert TrainResult.read_json(tmp_path) == result


def test_state_dict_comparison_is_bitwise_at_zero_tolerance() -> None:
    zero, neg_zero = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(zero, neg_zero)
    assert compare_state_dicts({"w": zero}, {"w": neg_zero}) == (0.0, ["w: bytes differ"])
    assert compare_state_dicts({"w": zero}, {"w": zero.clone()}) == (0.0, [])
    gap, problems = compare_state_dicts({"w": zero}, {"w": zero.double()})
    assert problems == ["w: float64[1], expected float32[1]"]
    gap, problems = compare_state_dicts({"w": torch.zeros(2)}, {"w": torch.zeros(3)})
    assert gap == float("inf") and problems == ["w: float32[3], expected float32[2]"]
    gap, problems = compare_state_dicts({"a": torch.ones(2)}, {"b": torch.ones(2)})
    assert gap == float("inf") and problems == ["missing keys ['a']", "unexpected keys ['b']"]


def test_state_dict_comparison_with_a_tolerance_still_wants_equal_integers() -> None:
    ref = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    close = {"w": torch.tensor([1.0, 2.0 + 2**-20]), "n": torch.tensor(3)}
    gap, problems = compare_state_dicts(ref, close, tolerance=1e-5)
    assert gap == 2**-20 and problems == []
    gap, problems = compare_state_dicts(ref, {**close, "n": torch.tensor(4)}, tolerance=1e-5)
    assert gap == 1.0 and problems == ["n: values differ by more than 1e-05"]
    gap, problems = compare_state_dicts(ref, {**close, "w": ref["w"] + 1e-3}, tolerance=1e-5)
    assert gap == pytest.approx(1e-3, rel=1e-3) and problems[0].startswith("w: values differ")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_torch_distributed_is_imported_only_inside_the_harness() -> None:
    package = PACKAGE.parent
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if PACKAGE not in path.parents
        and any(n.startswith("torch.distributed") for n in _imports(path))
    ]
    assert offenders == []


def test_harness_library_neither_prints_nor_imports_click() -> None:
    entry_points = {"make_fixtures.py", "__main__.py"}
    for path in PACKAGE.glob("*.py"):
        imports = _imports(path)
        assert not imports & {"click", "tabulate"}, path.name
        if path.name != "__main__.py":  # the process entry runs the CLI group
            assert not any(name.startswith("ckpt_tools.cli") for name in imports), path.name
        calls = {
            node.func.id
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        if path.name not in entry_points:
            assert "print" not in calls, path.name
        assert "exit" not in calls, path.name


def test_cli_choices_come_from_the_library_tables() -> None:
    from ckpt_tools.cli.commands import harness as harness_cmd

    params = {p.name: p for c in harness_cmd.harness.commands.values() for p in c.params}
    assert tuple(params["strategy"].type.choices) == harness.STRATEGIES
    assert tuple(params["arch"].type.choices) == harness.MODEL_NAMES
    # (f) dcp_roundtrip and (g) zero_roundtrip: the rows of runs that saved a DCP folder
    # (fsdp) or a DeepSpeed one (zero)
    assert set(harness_cmd.CHECK_HEADERS) == {
        *harness.CHECK_NAMES,
        "dcp_roundtrip",
        "zero_roundtrip",
    }


def test_importing_the_harness_imports_neither_torch_nor_click() -> None:
    code = "import ckpt_tools.harness as h; h.TrainConfig()"
    assert modules_loaded_by(code, ["torch", "click"]) == []


def test_output_comparison_is_bitwise_and_refuses_unpaired_shapes() -> None:
    from ckpt_tools.diffing.value_stats import compare_tensors

    zero, neg_zero = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    stats = compare_tensors(zero, neg_zero)
    assert (stats.bit_equal, stats.max_abs, stats.allclose) == (False, 0.0, True)
    nan = torch.tensor([float("nan"), 2.0])
    same_nan = compare_tensors(nan, nan.clone())
    assert same_nan.bit_equal and (same_nan.nan_a, same_nan.nan_b) == (1, 1)
    off = compare_tensors(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), atol=0.1)
    assert (off.bit_equal, off.max_abs, off.mismatched) == (False, 0.5, 1)
    with pytest.raises(UsageError, match=r"one shape, got \(2,\) and \(3,\)"):
        compare_tensors(torch.zeros(2), torch.zeros(3))

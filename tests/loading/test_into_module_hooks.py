"""load_into decides as ``nn.Module.load_state_dict`` decides: the modules' own loading code
(``_load_from_state_dict`` overrides, load-state-dict pre- and post-hooks, the versions in
``_metadata``) is taken into account, and a refusal still leaves the model untouched.

torch is the oracle: each case loads the same state dict into a copy of the model with
``load_state_dict`` and compares the verdict and the loaded values.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from ckpt_tools import load_into
from ckpt_tools.errors import StateDictMismatchError
from tests.helpers import assert_values_bitwise

# The old weight_norm is what old checkpoints were made with.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")


def torch_loads(model: nn.Module, sd: Mapping[str, Any], **kwargs: Any) -> nn.Module | None:
    """A copy of ``model`` loaded by torch (strict), or None where torch refuses."""
    twin = copy.deepcopy(model)
    try:
        twin.load_state_dict(sd, strict=True, **kwargs)
    except RuntimeError:
        return None
    return twin


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor of ``model`` with a copy of its values, to show later that nothing moved."""
    return {k: (v, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}


def assert_untouched(
    model: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    now = model.state_dict(keep_vars=True)
    assert list(now) == list(before)
    for key, (tensor, values) in before.items():
        assert now[key] is tensor, f"{key} was replaced"
        assert_values_bitwise(now[key], values, key)


def assert_same_state(model: nn.Module, oracle: nn.Module) -> None:
    ours, theirs = model.state_dict(), oracle.state_dict()
    assert list(ours) == list(theirs)
    for key in ours:
        assert_values_bitwise(ours[key], theirs[key], key)


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].num_batches_tracked.fill_(7)
    return net


def test_old_batchnorm_without_num_batches_tracked_loads_as_torch_does(tmp_path: Path) -> None:
    # Saved before BatchNorm's version 2: no num_batches_tracked, no _metadata.
    sd = {k: v for k, v in bn_net().state_dict().items() if "num_batches_tracked" not in k}
    path = tmp_path / "old_bn.pt"
    torch.save(sd, path)
    target = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    oracle = torch_loads(target, torch.load(path))
    assert oracle is not None

    report = load_into(target, path)

    assert report.ok and report.missing == () and report.loaded == 7
    assert_same_state(target, oracle)


def test_batchnorm_version_2_without_num_batches_tracked_is_refused_as_torch_does(
    tmp_path: Path,
) -> None:
    sd = bn_net().state_dict()  # _metadata says BatchNorm version 2
    del sd["1.num_batches_tracked"]
    path = tmp_path / "v2_bn.pt"
    torch.save(sd, path)
    target = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert torch_loads(target, torch.load(path)) is None
    before = snapshot(target)

    with pytest.raises(StateDictMismatchError, match=r"1 missing.*1\.num_batches_tracked"):
        load_into(target, path)
    assert_untouched(target, before)


def test_old_weight_norm_loads_into_the_parametrized_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    old = nn.utils.weight_norm(nn.Linear(4, 3))
    path = tmp_path / "wn_old.pt"
    torch.save(old.state_dict(), path)
    target = parametrizations.weight_norm(nn.Linear(4, 3))
    oracle = torch_loads(target, torch.load(path))
    assert oracle is not None

    report = load_into(target, path)

    assert report.ok and report.loaded == 3
    assert_same_state(target, oracle)
    x = torch.randn(2, 4)
    assert torch.equal(target(x), old(x))


def test_a_mismatch_after_a_hook_is_refused_by_its_new_name_and_nothing_moves() -> None:
    torch.manual_seed(0)
    sd = nn.utils.weight_norm(nn.Linear(4, 3)).state_dict()
    sd["weight_v"] = torch.zeros(5, 4)
    sd["extra"] = torch.zeros(1)
    target = parametrizations.weight_norm(nn.Linear(4, 3))
    assert torch_loads(target, sd) is None
    before = snapshot(target)

    pattern = (
        r"(?s)1 unexpected.*extra.*shape mismatch.*"
        r"parametrizations\.weight\.original1 checkpoint \[5, 4\] vs model \[3, 4\]"
    )
    with pytest.raises(StateDictMismatchError, match=pattern):
        load_into(target, sd)
    assert_untouched(target, before)


class Renaming(nn.Module):
    """Renames the ``fc.`` of older checkpoints to ``proj.`` with a load-state-dict pre-hook,
    and records that it did, on itself."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.register_load_state_dict_pre_hook(Renaming.rename)

    @staticmethod
    def rename(module: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
        for old in [k for k in sd if k.startswith(prefix + "fc.")]:
            sd[prefix + "proj." + old[len(prefix) + 3 :]] = sd.pop(old)
            module.upgraded = True


def old_renaming_sd(proj_rows: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "enc.fc.weight": torch.randn(proj_rows, 4),
        "enc.fc.bias": torch.randn(proj_rows),
        "enc.norm.weight": torch.randn(4),
        "enc.norm.bias": torch.randn(4),
    }


def test_a_pre_hook_that_renames_keys_is_honoured() -> None:
    target = nn.Sequential(OrderedDict(enc=Renaming()))
    sd = old_renaming_sd()
    oracle = torch_loads(target, sd)
    assert oracle is not None

    report = load_into(target, sd)

    assert report.ok and report.loaded == 4
    assert_same_state(target, oracle)


def test_a_shape_mismatch_behind_a_hook_is_skipped_without_strict() -> None:
    target = nn.Sequential(OrderedDict(enc=Renaming()))
    before = snapshot(target)
    sd = old_renaming_sd(proj_rows=2)

    report = load_into(target, sd, strict=False)

    shapes = [(m.key, m.checkpoint_shape, m.model_shape) for m in report.shape_mismatches]
    assert shapes == [("enc.proj.weight", (2, 4), (4, 4)), ("enc.proj.bias", (2,), (4,))]
    assert report.missing == () and report.unexpected == () and report.loaded == 2
    assert_untouched(target.enc.proj, {k[9:]: v for k, v in before.items() if "proj" in k})
    assert torch.equal(target.enc.norm.weight, sd["enc.norm.weight"])
    assert not target.enc.proj._load_state_dict_pre_hooks  # the skipping hook is gone


def test_hooks_run_on_a_copy_when_strict_refuses() -> None:
    target = nn.Sequential(OrderedDict(enc=Renaming()))
    before = snapshot(target)
    sd = {**old_renaming_sd(), "enc.stray": torch.zeros(1)}
    assert torch_loads(target, sd) is None

    with pytest.raises(StateDictMismatchError, match=r"1 unexpected.*enc\.stray"):
        load_into(target, sd)
    assert_untouched(target, before)
    assert not hasattr(target.enc, "upgraded")  # the hook ran on the shadow, not here
    assert len(target.enc._load_state_dict_pre_hooks) == 1


class Versioned(nn.Module):
    """Version 2 renamed the ``gain`` buffer to ``scale``; its loading code upgrades version 1."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("scale", torch.ones(3))

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *args: Any
    ) -> None:
        if local_metadata.get("version", 1) < 2 and prefix + "gain" in state_dict:
            state_dict[prefix + "scale"] = state_dict.pop(prefix + "gain")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


@pytest.mark.parametrize("version", [None, 1, 2])
def test_a_load_from_state_dict_override_and_its_metadata_version(
    version: int | None, tmp_path: Path
) -> None:
    sd: Any = OrderedDict(weight=torch.arange(3.0), gain=torch.full((3,), 2.0))
    if version is not None:
        sd._metadata = OrderedDict({"": {"version": version}})
    path = tmp_path / "versioned.pt"
    torch.save(sd, path)
    target = Versioned()
    oracle = torch_loads(target, torch.load(path))
    before = snapshot(target)

    if oracle is None:  # version 2 has no gain: torch refuses, and so do we
        assert version == 2
        with pytest.raises(StateDictMismatchError, match=r"(?s)missing.*scale.*unexpected.*gain"):
            load_into(target, path)
        assert_untouched(target, before)
        return
    report = load_into(target, path)
    assert report.ok and report.loaded == 2
    assert_same_state(target, oracle)


def test_a_post_hook_that_forgives_a_missing_key_is_honoured() -> None:
    class Lenient(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.register_buffer("table", torch.zeros(2))
            self.register_load_state_dict_post_hook(Lenient.forgive)

        @staticmethod
        def forgive(module: nn.Module, keys: Any) -> None:
            keys.missing_keys[:] = [k for k in keys.missing_keys if not k.endswith("table")]

    sd = {"weight": torch.eye(2), "bias": torch.ones(2)}
    target = Lenient()
    assert torch_loads(target, sd) is not None
    assert load_into(target, sd).ok
    assert torch.equal(target.weight, torch.eye(2))


def test_a_meta_model_is_assigned_an_old_batchnorm_checkpoint(tmp_path: Path) -> None:
    source = bn_net()
    sd = {k: v for k, v in source.state_dict().items() if "num_batches_tracked" not in k}
    path = tmp_path / "old_bn.pt"
    torch.save(sd, path)
    with torch.device("meta"):
        target = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert torch_loads(target, torch.load(path), assign=True) is not None

    report = load_into(target, path)

    assert report.ok and report.assigned and report.left_on_meta == ()
    for key, value in sd.items():
        assert_values_bitwise(target.state_dict()[key], value, key)
    assert target[1].num_batches_tracked.item() == 0  # torch's default for old checkpoints


def test_metadata_is_not_changed_by_an_assigning_load() -> None:
    sd = bn_net().state_dict()
    metadata = copy.deepcopy(sd._metadata)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    load_into(meta, sd)
    assert sd._metadata == metadata
    target = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    weight = target[0].weight
    load_into(target, sd)
    assert target[0].weight is weight  # copied into, not replaced
    assert torch.equal(weight, sd["0.weight"])


def test_a_value_torch_refuses_is_refused_before_loading_even_without_strict() -> None:
    target = bn_net()
    before = snapshot(target)
    sd: dict[str, Any] = dict(bn_net().state_dict())
    sd["0.weight"] = torch.zeros(4, 4)
    sd["1.bias"] = "not a tensor"
    with pytest.raises(StateDictMismatchError, match=r"torch: While copying .*\"1\.bias\""):
        load_into(target, sd, strict=False)
    assert_untouched(target, before)


UNCOPYABLE = {
    "meta": lambda t: torch.empty_like(t, device="meta"),
    "sparse_coo": lambda t: t.to_sparse(),
    "quantized": lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.qint8),
    # Dtypes copy_ has no kernel for: bit-packed into float32, and sub-byte integers.
    "float4_e2m1fn_x2": lambda t: torch.zeros(t.shape, dtype=torch.uint8).view(
        torch.float4_e2m1fn_x2
    ),
    "bits16": lambda t: torch.zeros(t.shape, dtype=torch.int16).view(torch.bits16),
    "uint4": lambda t: torch.zeros(t.shape, dtype=torch.uint8).view(torch.uint4),
}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", list(UNCOPYABLE))
def test_a_value_a_copy_cannot_take_is_refused_before_anything_is_copied(
    kind: str, strict: bool
) -> None:
    # torch copies module by module and fails at the value copy_ refuses, the earlier
    # modules already loaded; the rehearsal assigns, so the kind is checked by name.
    torch.manual_seed(0)
    target = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sd: dict[str, Any] = {k: v + 1 for k, v in target.state_dict().items()}
    sd["1.weight"] = UNCOPYABLE[kind](sd["1.weight"])
    with pytest.raises(RuntimeError, match="While copying the parameter named"):
        copy.deepcopy(target).load_state_dict(sd, strict=strict)
    before = snapshot(target)
    with pytest.raises(StateDictMismatchError, match=rf"named \"1\.weight\": .* no {kind}"):
        load_into(target, sd, strict=strict)
    assert_untouched(target, before)


class Densifies(nn.Linear):
    """A pre-hook that turns a sparse weight into the dense one the layer copies."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_load_state_dict_pre_hook(Densifies.densify)

    @staticmethod
    def densify(module: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
        if sd[prefix + "weight"].layout != torch.strided:
            sd[prefix + "weight"] = sd[prefix + "weight"].to_dense()


def test_a_value_a_module_s_own_hook_makes_copyable_loads_as_torch_loads_it() -> None:
    sd = {k: v + 1 for k, v in Densifies().state_dict().items()}
    sd["weight"] = sd["weight"].to_sparse()
    ours, theirs = Densifies(), Densifies()
    theirs.load_state_dict(dict(sd))
    load_into(ours, sd)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)


class NeedsValues(nn.Linear):
    """A pre-hook that reads a value, which a meta tensor does not have."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_load_state_dict_pre_hook(NeedsValues.check)

    @staticmethod
    def check(module: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix + "bias" in sd and sd[prefix + "bias"].abs().sum().item() < 0:
            raise ValueError("impossible")


class Locked(nn.Linear):
    """Holds a lock, which cannot be deep-copied."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.lock = threading.Lock()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (NeedsValues, "a module's loading code failed on meta tensors"),
        (Locked, "could not be copied"),
    ],
)
def test_without_a_rehearsal_keys_are_compared_by_name_and_it_says_so(
    make: type[nn.Linear], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    sd = {"weight": torch.eye(2), "bias": torch.ones(2)}
    target = make()
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"):
        report = load_into(target, sd)
    # Keys that match by name need no rehearsal, so none was tried.
    assert report.ok and torch.equal(target.weight, torch.eye(2)) and not caplog.text

    before = snapshot(target)
    refused = pytest.raises(StateDictMismatchError, match=rf"(?s)extra.*compared by name.*{why}")
    with caplog.at_level(logging.WARNING, logger="ckpt_tools"), refused:
        load_into(target, {**sd, "extra": torch.zeros(1)})
    assert_untouched(target, before)
    assert "compared by name" in caplog.text and why in caplog.text

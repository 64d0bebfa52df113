"""Real checkpoints built in a test's ``tmp_path``: tiny modules, awkward tensors, layouts.

Everything here is made with real torch (and safetensors); nothing depends on ``fixtures/``.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

# --------------------------------------------------------------------------------------------
# Tiny purpose-built modules
# --------------------------------------------------------------------------------------------


class TinyNet(nn.Module):
    """Embedding, MLP, BatchNorm (int64 buffer), and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied weights

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(idx))))


class Compiled(nn.Module):
    """What ``torch.compile(model)`` looks like to ``state_dict()``: ``_orig_mod.`` keys.

    (The real ``OptimizedModule`` stores the model as ``self._orig_mod`` just like this;
    building one imports dynamo, which costs seconds.)
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


class LitModule(nn.Module):
    """A Lightning module holding the network as ``self.model``: keys start with ``model.``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner


def make_model(seed: int = 0) -> TinyNet:
    """A seeded :class:`TinyNet` whose BatchNorm buffers are not at their defaults."""
    torch.manual_seed(seed)
    model = TinyNet()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
        model.norm.num_batches_tracked.fill_(17)
    return model


def trained(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """An Adam optimizer and a StepLR scheduler after one real step (state is populated)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loss = model(torch.tensor([0, 1, 2, 3, 4, 5])).square().mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


# --------------------------------------------------------------------------------------------
# Tensors with awkward bits and layouts
# --------------------------------------------------------------------------------------------


def _bits(values: list[int], int_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    width = torch.iinfo(int_dtype).bits
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in values]
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


def nan_payloads() -> dict[str, torch.Tensor]:
    """NaNs with payloads (quiet, signalling, negative) and -0.0, in four float dtypes."""
    return {
        "f32": _bits(
            [0x7FC00001, 0xFFC12345, 0x7F800001, 0x80000000, 0x7F800000, 0x3F800000],
            torch.int32,
            torch.float32,
        ),
        "f64": _bits(
            [0x7FF8000000000ABC, 0xFFF0000000000001, 0x8000000000000000],
            torch.int64,
            torch.float64,
        ),
        "f16": _bits([0x7E01, 0xFC01, 0x8000, 0x7C00], torch.int16, torch.float16),
        "bf16": _bits([0x7FC1, 0xFF81, 0x8000, 0x3F80], torch.int16, torch.bfloat16),
    }


def mixed_dtypes() -> dict[str, torch.Tensor]:
    """One tensor of each awkward dtype (bf16, f8, bool, u16, ...), a scalar and an empty one."""
    torch.manual_seed(1)
    return {
        "bf16": torch.randn(3, 4).to(torch.bfloat16),
        "f16": torch.randn(5).to(torch.float16),
        "i64": torch.arange(-3, 7, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "f8": torch.randn(2, 8).to(torch.float8_e4m3fn),
        "f64": torch.randn(2).double(),
        "u8": torch.arange(7, dtype=torch.uint8),
        "u16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
    }


def offset_views() -> dict[str, torch.Tensor]:
    """Several views of one storage, at non-zero storage offsets, and the base itself."""
    base = torch.arange(40, dtype=torch.float32) * 0.5
    return {
        "base": base,
        "tail": base[7:19],
        "block": base[8:24].view(4, 4)[1:3],
        "every_other": base[1::2],
    }


def transposed_views() -> dict[str, torch.Tensor]:
    """Non-contiguous views: a whole transposed storage, and one at an offset."""
    torch.manual_seed(2)
    m = torch.randn(3, 5)
    return {
        "t": m.t(),  # non-contiguous, the whole storage
        "col": torch.randn(4, 6)[:, 2:5].t(),  # non-contiguous at an offset
    }


def tied() -> dict[str, torch.Tensor]:
    """Two keys holding the same tensor (tied weights) and one on its own."""
    torch.manual_seed(3)
    w = torch.randn(6, 4)
    return {"encoder.weight": w, "decoder.weight": w, "bias": torch.randn(6)}


def with_prefix(sd: Mapping[str, Any], prefix: str) -> collections.OrderedDict:
    """``sd`` with ``prefix`` in front of every key, in order."""
    return collections.OrderedDict((prefix + k, v) for k, v in sd.items())


# --------------------------------------------------------------------------------------------
# Layouts: name -> (object to save, the wrapper prefix on its state-dict keys)
# --------------------------------------------------------------------------------------------

MODEL_LAYOUTS = (
    "plain",
    "state_dict",
    "model",
    "model_state_dict",
    "lightning",
    "trainer",
    "dataparallel",
    "orig_mod",
    "stacked",
)
TENSOR_LAYOUTS = ("tied", "offset_views", "transposed", "mixed_dtypes", "nan_payloads")
LAYOUTS = (*MODEL_LAYOUTS, *TENSOR_LAYOUTS, "legacy", "safetensors")


def data_parallel(module: nn.Module) -> nn.DataParallel:
    """``nn.DataParallel(module)`` as a machine without a GPU builds it, on any machine.

    Where CUDA is visible the constructor moves the module to cuda:0 and ``forward`` scatters
    over the GPUs; the tests want the wrapper's keys, CPU tensors and a plain forward.
    """
    wrapped = nn.DataParallel(module)
    wrapped.device_ids = []  # forward() then calls the module, as it does without a GPU
    return wrapped.cpu()


def build_layout(name: str) -> tuple[Any, str, str]:
    """The object for layout ``name``, the wrapper prefix its state dict carries, and where.

    Returns:
        ``(obj, prefix, select)``: ``select`` is the dotted path to the state dict ("" = root).
    """
    model = make_model()
    dp = data_parallel(model)
    if name in ("plain", "dataparallel"):
        return dp.state_dict(), "module.", ""
    if name in ("state_dict", "model", "model_state_dict"):
        obj: dict[str, Any] = {name: dp.state_dict()}
        if name == "model_state_dict":
            obj["epoch"] = 4
        return obj, "module.", name
    if name == "lightning":
        lit = LitModule(model)
        optimizer, scheduler = trained(model)
        return (
            {
                "epoch": 3,
                "global_step": 120,
                "pytorch-lightning_version": "2.4.0",
                "state_dict": lit.state_dict(),
                "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
                "callbacks": {},
                "optimizer_states": [optimizer.state_dict()],
                "lr_schedulers": [scheduler.state_dict()],
                "hyper_parameters": {"lr": 1e-3, "hidden": 8, "name": "tiny", "betas": (0.9, 0.99)},
            },
            "model.",
            "state_dict",
        )
    if name == "trainer":
        optimizer, scheduler = trained(dp)
        return (
            {
                "model": dp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": 7,
            },
            "module.",
            "model",
        )
    if name == "orig_mod":
        return Compiled(model).state_dict(), "_orig_mod.", ""
    if name == "stacked":
        return data_parallel(Compiled(model)).state_dict(), "module._orig_mod.", ""
    makers: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
        "tied": tied,
        "offset_views": offset_views,
        "transposed": transposed_views,
        "mixed_dtypes": mixed_dtypes,
        "nan_payloads": nan_payloads,
    }
    if name in makers:
        return with_prefix(makers[name](), "module."), "module.", ""
    if name == "legacy":
        sd = dp.state_dict()
        sd.update(with_prefix(offset_views(), "module.views."))
        sd.update(with_prefix(nan_payloads(), "module.nan."))
        return sd, "module.", ""
    if name == "safetensors":
        sd = {**dict(dp.state_dict()), **with_prefix(mixed_dtypes(), "module.x.")}
        sd.pop("module.head.weight")  # safetensors refuses shared tensors
        return sd, "module.", ""
    raise ValueError(name)


SAFETENSORS_METADATA = {"format": "pt", "producer": "ckpt-tests", "note": "ümlaut & {json}"}


def save_layout(name: str, path: Path) -> tuple[Path, str, str]:
    """Write layout ``name`` to ``path`` (suffix fixed up); returns ``(path, prefix, select)``."""
    obj, prefix, select = build_layout(name)
    if name == "safetensors":
        from safetensors.torch import save_file

        path = path.with_suffix(".safetensors")
        save_file(obj, str(path), metadata=SAFETENSORS_METADATA)
    elif name == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    else:
        torch.save(obj, path)
    return path, prefix, select


def save(obj: Any, path: Path, **kwargs: Any) -> Path:
    """``torch.save(obj, path, **kwargs)``; returns ``path``."""
    torch.save(obj, path, **kwargs)
    return path


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` for torch files; a plain dict for safetensors."""
    if Path(path).suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True, mmap=mmap)


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file, as safetensors reads it."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def rebuilt_tensors() -> dict[str, Any]:
    """One tensor of each kind torch rebuilds by a call, and a dense one beside them."""
    torch.manual_seed(0)
    with warnings.catch_warnings():  # torch's "sparse CSR is in beta" and friends
        warnings.simplefilter("ignore", UserWarning)
        dense = torch.randn(4, 6).relu()
        return {
            "coo": dense.to_sparse(),
            "csr": dense.to_sparse_csr(),
            "csc": dense.to_sparse_csc(),
            "bsr": dense.to_sparse_bsr((2, 3)),
            "meta": torch.empty(2, 3, dtype=torch.float16, device="meta"),
            "nested": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
            "dense": dense,
        }

"""Factories and bitwise comparisons for the rewrite tests (strip/add/rename/convert/retag).

Everything here builds real checkpoints with real torch in a test's ``tmp_path``; nothing
depends on ``fixtures/``. Owned by the rewrite tests; other test files may import it.
"""

from __future__ import annotations

import collections
import hashlib
import io
import math
import os
import pickletools
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]

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
    torch.manual_seed(2)
    m = torch.randn(3, 5)
    return {
        "t": m.t(),  # non-contiguous, the whole storage
        "col": torch.randn(4, 6)[:, 2:5].t(),  # non-contiguous at an offset
    }


def tied() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    w = torch.randn(6, 4)
    return {"encoder.weight": w, "decoder.weight": w, "bias": torch.randn(6)}


def with_prefix(sd: Mapping[str, Any], prefix: str) -> collections.OrderedDict:
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


def build_layout(name: str) -> tuple[Any, str, str]:
    """The object for layout ``name``, the wrapper prefix its state dict carries, and where.

    Returns:
        ``(obj, prefix, select)``: ``select`` is the dotted path to the state dict ("" = root).
    """
    model = make_model()
    dp = nn.DataParallel(model)  # on a CPU-only machine this just wraps the module
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
        return nn.DataParallel(Compiled(model)).state_dict(), "module._orig_mod.", ""
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
    torch.save(obj, path, **kwargs)
    return path


# --------------------------------------------------------------------------------------------
# Loading and comparing
# --------------------------------------------------------------------------------------------


def load(path: Path, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` for torch files; a plain dict for safetensors."""
    if Path(path).suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True, mmap=mmap)


def safetensors_metadata(path: Path) -> dict[str, str] | None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def select(obj: Any, dotted: str) -> Any:
    for part in filter(None, dotted.split(".")):
        obj = obj[part]
    return obj


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole untyped storage under ``t``, as uint8."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def value_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in row-major order, as raw bytes (NaN payloads and -0.0 kept)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def iter_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}/{i}")


def sharing(obj: Any) -> dict[str, str]:
    """tensor path -> path of the first tensor on the same storage (empty storages skipped)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for path, t in iter_tensors(obj):
        if t.untyped_storage().nbytes() == 0:
            continue
        out[path] = first.setdefault(t.untyped_storage().data_ptr(), path)
    return out


def assert_tensor_bitwise(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    """Same class, dtype, shape, strides, storage offset, requires_grad, storage bytes."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
    assert a.storage_offset() == b.storage_offset(), f"{where}: storage offset differs"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    assert a.device == b.device, f"{where}: device {a.device} != {b.device}"
    assert torch.equal(storage_bytes(a), storage_bytes(b)), f"{where}: storage bytes differ"
    assert torch.equal(value_bytes(a), value_bytes(b)), f"{where}: value bytes differ"


def assert_values_bitwise(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    """Same dtype, shape and element bytes (layout may differ: contiguous copies, dedup)."""
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    assert torch.equal(value_bytes(a), value_bytes(b)), f"{where}: value bytes differ"


def assert_bitwise_equal(a: Any, b: Any, where: str = "root") -> None:
    """Two loaded checkpoints are the same, bit for bit.

    Compares container types and key order, ``_metadata`` of state dicts, floats by their
    bits, tensors by class, dtype, shape, strides, storage offset and raw storage bytes, and
    which tensors share a storage.
    """
    _assert_same(a, b, where)
    assert sharing(a) == sharing(b), "storage sharing differs"


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b)}"
        assert_tensor_bitwise(a, b, where)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, Mapping):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
        meta_a, meta_b = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
        assert meta_a == meta_b, f"{where}: _metadata {meta_a} != {meta_b}"
        if meta_a is not None:
            assert list(meta_a) == list(meta_b), f"{where}: _metadata order differs"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert _float_bits(a) == _float_bits(b) or (math.isnan(a) and math.isnan(b)), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def fingerprint(path: Path) -> tuple[str, int, int]:
    """sha256, mtime_ns and inode of a file: the input must never change."""
    st = os.stat(path)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest(), st.st_mtime_ns, st.st_ino


def temp_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.ckpt-tmp")) + sorted(Path(folder).glob(".*.ckpt-tmp"))


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in Path(folder).iterdir())


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


def pickle_globals(payload: bytes) -> list[str]:
    """Qualified names of the globals a pickle refers to, in order (never imported)."""
    found: list[str] = []
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(io.BytesIO(payload)):
        if op.name == "GLOBAL":
            found.append(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.append(f"{strings[-2]}.{strings[-1]}")
    return found


def run_ckpt(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m ckpt_tools ARGS`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPT_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tools", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=kwargs.pop("timeout", 60),
        **kwargs,
    )

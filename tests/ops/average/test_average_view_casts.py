"""``average`` of keys that are views of one larger storage, against torch's own mean of each
view, bit for bit: the mean is cast back as torch casts each tensor (NaN bits depend on an
element's place in the tensor cast, not in its storage)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt_tools as ct

# NaN bits come from torch's x86 CPU kernels on one thread (see ckpt_tools/io/casting.py).
_X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# Each dtype's exponent bits and width: OR-ed into random mantissa bits they make a NaN.
_NAN = {
    torch.float64: (0x7FF0000000000000, 64),
    torch.float32: (0x7F800000, 32),
    torch.float16: (0x7C00, 16),
    torch.bfloat16: (0x7F80, 16),
}
# Contiguous slices (start, stop) of the storage, at offsets that put runs of torch's cast
# kernel (16 or 8 elements wide, then a scalar tail) out of step with the storage's.
_LAYOUTS = {
    "one_view_at_the_start": (100, [(0, 10)]),
    "several_views": (200, [(3, 20), (20, 47), (50, 69), (69, 117), (130, 200)]),
    "views_out_of_storage_order": (150, [(90, 131), (0, 33), (33, 40), (45, 90)]),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _storage_with_nans(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` random values of ``dtype``, about a third of them NaNs of random sign and payload."""
    rng = np.random.default_rng(seed)
    exponent, width = _NAN[dtype]
    unsigned = np.dtype(f"uint{width}")
    x = torch.from_numpy(rng.standard_normal(n)).to(dtype)
    mantissa = rng.integers(1, exponent & -exponent, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64) << np.uint64(width - 1)
    nan = (mantissa | np.uint64(exponent) | sign).astype(unsigned)
    values = x.view(_INT[width // 8]).numpy().view(unsigned)
    bits = np.where(rng.random(n) < 0.35, nan, values)
    return torch.from_numpy(bits.view(f"int{width}").copy()).view(dtype)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(_INT[t.element_size()]).numpy()


@pytest.mark.skipif(not _X86, reason="NaN bits of torch's x86 kernels")
@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str
)
@pytest.mark.parametrize("weights", [[1.0, 1.0], [0.5, -2.0, 0.25]], ids=["two", "three"])
def test_average_of_views_casts_each_views_mean_as_torch(
    tmp_path: Path, layout: str, dtype: torch.dtype, weights: list[float]
) -> None:
    numel, slices = _LAYOUTS[layout]
    paths = []
    for i in range(len(weights)):
        big = _storage_with_nans(dtype, numel, seed=i)
        paths.append(tmp_path / f"in_{i}.pt")
        torch.save({f"k{a}": big[a:b] for a, b in slices}, paths[-1])
    ct.average(paths, tmp_path / "avg.pt", weights=weights)
    ours = torch.load(tmp_path / "avg.pt", weights_only=True)
    inputs = [torch.load(p, weights_only=True) for p in paths]
    for key, out in ours.items():
        # The views stay one storage, so the mean was computed (and cast) storage-wide.
        assert out.untyped_storage().nbytes() == numel * out.element_size()
        acc = sum(w * sd[key].double() for w, sd in zip(weights, inputs))
        assert isinstance(acc, torch.Tensor)
        want = (acc / sum(weights)).to(dtype)
        assert out.dtype == want.dtype and out.shape == want.shape
        a, b = _bits(out), _bits(want)
        wrong = np.flatnonzero(a != b)
        assert wrong.size == 0, (key, [(int(i), hex(a[i]), hex(b[i])) for i in wrong[:4]])


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_tensors_of_no_elements_average_to_either_format(tmp_path: Path, suffix: str) -> None:
    # Their strides after a size-0 dimension are torch's choice (Linear(0, 4): (1, 1)); the
    # mean of no elements is written as safetensors writes any empty tensor.
    from safetensors.torch import load_file

    srcs = []
    for i in range(2):
        torch.manual_seed(i)
        sd = {
            "fc.weight": torch.empty(4, 0),  # as Linear(0, 4).weight
            "conv.weight": torch.empty(2, 0, 3, 3).contiguous(memory_format=torch.channels_last),
            "b": torch.randn(4),
        }
        srcs.append(tmp_path / f"a{i}.pt")
        torch.save(sd, srcs[-1])
    out = ct.average(srcs, tmp_path / f"avg.{suffix}").written[0]
    got = load_file(out) if suffix == "safetensors" else torch.load(out, weights_only=True)
    assert got["fc.weight"].shape == (4, 0) and got["conv.weight"].shape == (2, 0, 3, 3)
    want = (torch.load(srcs[0])["b"].double() + torch.load(srcs[1])["b"].double()) / 2
    assert torch.equal(got["b"], want.float())

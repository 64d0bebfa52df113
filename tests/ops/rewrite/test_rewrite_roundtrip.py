"""Round trips through real files: strip/add are exact inverses, convert is bit-exact.

Every checkpoint is built here with real torch in ``tmp_path``; outputs are read back with
``torch.load(weights_only=True)`` (and ``mmap=True``) or safetensors' own loader, and
compared bit for bit: raw storage bytes, dtypes, shapes, strides, storage offsets, sharing,
non-tensor entries, key order and ``_metadata``.
"""

from __future__ import annotations

import collections
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.formats import open_checkpoint
from ckpt_tools.ops.rewrite.conversion import convert, retag
from ckpt_tools.ops.rewrite.rewriting import add_module, strip_module
from ckpt_tools.structure.tensor_walk import iter_tensors
from tests import helpers as h

# What puts each prefix on the keys, to load the round-tripped file into the real wrapper.
WRAPPERS = {
    "module.": h.data_parallel,
    "_orig_mod.": h.Compiled,
    "module._orig_mod.": lambda m: h.data_parallel(h.Compiled(m)),
    "model.": h.LitModule,
}


@pytest.fixture
def layout_file(tmp_path):
    """Factory: write a layout into tmp_path, return ``(path, prefix, select)``."""

    def make(name: str) -> tuple[Path, str, str]:
        return h.save_layout(name, tmp_path / f"{name}.pt")

    return make


@pytest.mark.parametrize("layout", h.LAYOUTS)
def test_strip_then_add_is_bitwise_identity(layout, layout_file, tmp_path):
    src, prefix, sel = layout_file(layout)
    before = h.fingerprint(src)
    bare = tmp_path / f"bare{src.suffix}"
    again = tmp_path / f"again{src.suffix}"

    stripped = strip_module(src, bare, verify="full")
    assert stripped.written
    assert "".join(w.prefix for w in stripped.wrappers) == prefix
    assert stripped.renamed == stripped.total_keys > 0
    added = add_module(bare, again, prefix=prefix, verify="full")
    assert added.written and added.renamed == added.total_keys

    original = h.load(src)
    bare_sd = h.at_path(h.load(bare), sel)
    assert list(bare_sd) == [k[len(prefix) :] for k in h.at_path(original, sel)]
    h.assert_bitwise_equal(original, h.load(again))
    if src.suffix == ".safetensors":
        assert h.safetensors_metadata(again) == h.SAFETENSORS_METADATA
        assert h.safetensors_metadata(bare) == h.SAFETENSORS_METADATA
    else:
        assert zipfile.is_zipfile(bare) and zipfile.is_zipfile(again)
        h.assert_bitwise_equal(original, h.load(again, mmap=True))
        h.assert_bitwise_equal(h.load(bare), h.load(bare, mmap=True))
    assert h.fingerprint(src) == before
    assert h.temp_files(tmp_path) == []


@pytest.mark.parametrize("layout", h.MODEL_LAYOUTS)
def test_stripped_loads_into_bare_model_and_readded_into_wrapper(layout, layout_file, tmp_path):
    src, prefix, sel = layout_file(layout)
    strip_module(src, tmp_path / "bare.pt")
    add_module(tmp_path / "bare.pt", tmp_path / "wrapped.pt", prefix=prefix)
    want = {k[len(prefix) :]: v for k, v in h.at_path(h.load(src), sel).items()}

    for mmap in (False, True):
        bare = h.make_model(seed=99)
        bare.load_state_dict(h.at_path(h.load(tmp_path / "bare.pt", mmap=mmap), sel), strict=True)
        got = bare.state_dict()
        for k in want:
            h.assert_values_bitwise(want[k], got[k], k)
        assert bare.head.weight is bare.embed.weight  # tying survives loading

        wrapper = WRAPPERS[prefix](h.make_model(seed=99))
        wrapper.load_state_dict(
            h.at_path(h.load(tmp_path / "wrapped.pt", mmap=mmap), sel), strict=True
        )
        got = wrapper.state_dict()
        for k in want:
            h.assert_values_bitwise(want[k], got[prefix + k], k)


def test_add_module_output_loads_into_dataparallel_strict(tmp_path):
    model = h.make_model()
    src = h.save(model.state_dict(), tmp_path / "plain.pt")
    add_module(src, tmp_path / "dp.pt")
    for mmap in (False, True):
        dp = h.data_parallel(h.make_model(seed=5))
        dp.load_state_dict(h.load(tmp_path / "dp.pt", mmap=mmap), strict=True)
        for k, v in model.state_dict().items():
            h.assert_values_bitwise(v, dp.state_dict()[f"module.{k}"], k)
    # The output is what DataParallel itself saves, _metadata included.
    h.assert_bitwise_equal(
        {k: v for k, v in h.data_parallel(model).state_dict().items()},
        {k: v for k, v in h.load(tmp_path / "dp.pt").items()},
    )
    assert h.load(tmp_path / "dp.pt")._metadata == h.data_parallel(model).state_dict()._metadata


class _WithModuleAttribute(torch.nn.Module):
    """A model with a submodule named ``module`` beside others (an EMA helper's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)
        self.other = torch.nn.Linear(2, 2)


def test_a_submodule_named_module_is_no_wrapper(tmp_path):
    # DataParallel prefixes every key: a partial module. is the model's own attribute.
    model = _WithModuleAttribute()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    result = strip_module(tmp_path / "plain.pt", tmp_path / "out.pt")
    assert result.written == () and not (tmp_path / "out.pt").exists()
    torch.save(torch.nn.DataParallel(model).state_dict(), tmp_path / "dp.pt")
    strip_module(tmp_path / "dp.pt", tmp_path / "stripped.pt")  # one layer, not two
    _WithModuleAttribute().load_state_dict(torch.load(tmp_path / "stripped.pt"), strict=True)


def test_add_then_strip_is_bitwise_identity(tmp_path):
    model = h.make_model()
    sd = model.state_dict()
    sd.update(h.nan_payloads())
    src = h.save(sd, tmp_path / "plain.pt")
    add_module(src, tmp_path / "dp.pt", verify="full")
    result = strip_module(tmp_path / "dp.pt", tmp_path / "back.pt", verify="full")
    assert [w.prefix for w in result.wrappers] == ["module."]
    h.assert_bitwise_equal(h.load(src), h.load(tmp_path / "back.pt"))


def _zoo() -> collections.OrderedDict:
    sd: collections.OrderedDict = collections.OrderedDict()
    sd.update(h.tied())
    sd.update(h.offset_views())
    sd.update(h.transposed_views())
    sd.update(h.with_prefix(h.mixed_dtypes(), "dt."))
    sd.update(h.with_prefix(h.nan_payloads(), "nan."))
    return sd


def test_convert_pt_to_safetensors_to_pt_is_bit_exact(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    original = _zoo()
    src = h.save(original, tmp_path / "zoo.pt")
    before = h.fingerprint(src)

    to_st = convert(src, tmp_path / "zoo.safetensors", verify="full")
    assert to_st.output_format == "safetensors"
    # tied: stored once, under the first name in key order, as save_pretrained keeps it
    assert to_st.dropped == ("decoder.weight",)
    meta = h.safetensors_metadata(tmp_path / "zoo.safetensors")
    assert meta == {
        "format": "pt",
        "decoder.weight": "encoder.weight",
        "ckpt_tools.tied": '{"decoder.weight":"encoder.weight"}',
    }

    st = load_file(str(tmp_path / "zoo.safetensors"))
    kept = [k for k in original if k != "decoder.weight"]
    assert list(st) == kept
    for k in kept:
        h.assert_values_bitwise(original[k], st[k], k)
    with safe_open(str(tmp_path / "zoo.safetensors"), "pt") as f:
        # Non-contiguous views were written contiguous: same values, row-major bytes.
        h.assert_values_bitwise(original["t"].contiguous(), f.get_tensor("t"), "t")
        h.assert_values_bitwise(original["col"].contiguous(), f.get_tensor("col"), "col")

    back = convert(tmp_path / "zoo.safetensors", tmp_path / "back.pt", verify="full")
    assert back.output_format == "torch-zip" and zipfile.is_zipfile(tmp_path / "back.pt")
    for mmap in (False, True):
        pt = h.load(tmp_path / "back.pt", mmap=mmap)
        assert list(pt) == [*kept, "decoder.weight"]  # the tied name is back, after the stored
        for k in kept:
            h.assert_values_bitwise(original[k], pt[k], k)
            assert pt[k].is_contiguous() and pt[k].storage_offset() == 0
        h.assert_values_bitwise(original["encoder.weight"], pt["encoder.weight"], "encoder.weight")
        shared = pt["encoder.weight"].untyped_storage().data_ptr()
        assert shared == pt["decoder.weight"].untyped_storage().data_ptr()  # over one storage
    assert h.fingerprint(src) == before
    assert h.temp_files(tmp_path) == []


def test_convert_model_to_safetensors_loads_with_safetensors_load_model(tmp_path):
    from safetensors.torch import load_model

    model = h.make_model()
    src = h.save(model.state_dict(), tmp_path / "model.pt")
    result = convert(src, tmp_path / "model.safetensors")
    assert result.dropped == ("head.weight",)
    assert h.safetensors_metadata(tmp_path / "model.safetensors")["head.weight"] == "embed.weight"
    fresh = h.make_model(seed=42)
    missing, unexpected = load_model(fresh, str(tmp_path / "model.safetensors"), strict=True)
    assert not missing and not unexpected
    for k, v in model.state_dict().items():
        h.assert_values_bitwise(v, fresh.state_dict()[k], k)


def test_convert_safetensors_to_pt_and_back_keeps_metadata_and_bits(layout_file, tmp_path):
    src, _, _ = layout_file("safetensors")
    original = h.load(src)
    convert(src, tmp_path / "st.pt", verify="full")
    pt = h.load(tmp_path / "st.pt", mmap=True)
    assert list(pt) == list(original)
    for k in original:
        h.assert_tensor_bitwise(original[k], pt[k], k)  # each tensor owns a storage
    convert(src, tmp_path / "copy.safetensors")
    assert h.safetensors_metadata(tmp_path / "copy.safetensors") == h.SAFETENSORS_METADATA
    h.assert_bitwise_equal(original, h.load(tmp_path / "copy.safetensors"))


def test_legacy_input_comes_out_as_a_zip_archive(layout_file, tmp_path):
    src, _, _ = layout_file("legacy")
    assert not zipfile.is_zipfile(src)
    for fmt in ("pt", "pth"):
        out = tmp_path / f"new.{fmt}"
        result = convert(src, out, verify="full")
        assert result.input_format == "torch-legacy" and result.output_format == "torch-zip"
        assert zipfile.is_zipfile(out)
        h.assert_bitwise_equal(h.load(src), h.load(out))
        h.assert_bitwise_equal(h.load(src), h.load(out, mmap=True))


def test_pt_to_pt_convert_of_a_trainer_dict_is_bitwise_identity(layout_file, tmp_path):
    src, _, _ = layout_file("trainer")
    convert(src, tmp_path / "same.pt", verify="full")
    h.assert_bitwise_equal(h.load(src), h.load(tmp_path / "same.pt"))


def test_retag_round_trip(tmp_path):
    sd = _zoo()
    src = h.save(sd, tmp_path / "cpu.pt")
    result = retag(src, tmp_path / "gpu.pt", mapping={"cpu": "cuda:1"})
    assert result.device_map == {"cpu": "cuda:1"}
    payload = h.read_data_pkl(tmp_path / "gpu.pt")
    assert b"cuda:1" in payload and b"cpu" not in payload
    # Loads anywhere with map_location, bytes unchanged.
    mapped = torch.load(tmp_path / "gpu.pt", weights_only=True, map_location="cpu")
    h.assert_bitwise_equal(h.load(src), mapped)
    retag(tmp_path / "gpu.pt", tmp_path / "back.pt", mapping={"cuda:1": "cpu"})
    h.assert_bitwise_equal(h.load(src), h.load(tmp_path / "back.pt"))


_ROOTS = {
    "tensor": lambda: torch.arange(5.0),
    "list": lambda: [torch.ones(2), torch.zeros(3, dtype=torch.int64)],
    "tuple": lambda: (torch.ones(2), {"step": 3}),
    "none": lambda: None,
}


def _assert_same(got: object, want: object) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("root", sorted(_ROOTS))
def test_a_root_that_is_no_dict_is_rewritten_whole_or_refused(tmp_path: Path, root: str) -> None:
    # torch.save(tensor), torch.save([...]): the key rewrites have no keys to change and write
    # the root as it is; what needs a dict of tensors refuses, writing nothing.
    src = tmp_path / "in.pt"
    torch.save(_ROOTS[root](), src)
    want = torch.load(src, weights_only=True)
    for i, args in enumerate(
        (
            ["rename", "--sub", "a.=b."],
            ["add-module"],
            ["convert"],
            *([["retag", "--map", "cpu=cuda:1"]] if root != "none" else []),
        )
    ):
        out = tmp_path / f"out{i}.pt"
        h.run_ckpt(args[0], src, out, *args[1:])
        _assert_same(torch.load(out, weights_only=True, map_location="cpu"), want)
        devices = {t.device for _, t in iter_tensors(open_checkpoint(out).root)}
        assert devices == (set() if root == "none" else {"cuda:1" if args[0] == "retag" else "cpu"})
    refused = {
        "o.safetensors": ["convert", src, tmp_path / "o.safetensors"],
        "s.pt": ["slim", src, tmp_path / "s.pt", "--dtype", "bf16"],
    }
    for name, args in refused.items():
        _, _, err = h.run_ckpt(*args, code=7)
        assert " not a " in err and not (tmp_path / name).exists()


def _with_attributes(path: Path, **attributes: Any) -> dict:
    sd = OrderedDict([("module.a", torch.ones(2))])
    for name, value in attributes.items():
        setattr(sd, name, value)
    torch.save(sd, path)
    return torch.load(path, weights_only=True).__dict__


@pytest.mark.parametrize(
    "attributes",
    [
        {"_metadata": OrderedDict([("", {"version": 1})]), "note": "keep me"},
        {"_metadata": OrderedDict([(0, {"version": 5}), ("", {"version": 1})])},
        {"_metadata": [1, 2]},
    ],
    ids=["another attribute", "a path that is no str", "no mapping"],
)
@pytest.mark.parametrize("command", [["convert"], ["slim"], ["rename", "--sub", "x.=y."]])
def test_a_state_dict_s_attributes_come_back_as_torch_load_gives_them(
    attributes: dict, command: list[str], tmp_path: Path
) -> None:
    want = _with_attributes(tmp_path / "in.pt", **attributes)
    name, *options = command
    if name == "rename":  # no key matches 'x.': a key that does, so the rename writes
        sd = torch.load(tmp_path / "in.pt", weights_only=True)
        sd["x.b"] = torch.zeros(1)
        torch.save(sd, tmp_path / "in.pt")
    h.run_ckpt(name, tmp_path / "in.pt", tmp_path / "out.pt", *options)
    assert torch.load(tmp_path / "out.pt", weights_only=True).__dict__ == want


@pytest.mark.parametrize("tag", ["npu:0", "privateuseone:0"])
def test_retag_takes_a_backends_own_saved_tag(tmp_path, tag):
    # A backend's tag (torch_npu's npu:0), which plain torch.load cannot restore here.
    import torch.serialization as serialization

    registry = serialization._package_registry[:]
    serialization.register_package(
        1, lambda obj: tag if getattr(obj, "device", None) is not None else None, lambda o, _: o
    )
    try:
        torch.save({"w": torch.arange(3.0)}, tmp_path / "npu.pt")
    finally:
        serialization._package_registry[:] = registry
    with pytest.raises(RuntimeError):
        torch.load(tmp_path / "npu.pt", weights_only=True)
    retag(tmp_path / "npu.pt", tmp_path / "cpu.pt", mapping={tag: "cpu"})
    assert torch.equal(torch.load(tmp_path / "cpu.pt", weights_only=True)["w"], torch.arange(3.0))


def test_a_retag_dry_run_says_what_it_retags_not_keys_renamed(tmp_path):
    src = h.save({"w": torch.ones(2)}, tmp_path / "cpu.pt")
    result = retag(src, tmp_path / "gpu.pt", mapping={"cpu": "cuda:0"}, dry_run=True)
    assert result.message == "dry run: would write " + str(tmp_path / "gpu.pt") + (
        " (8 tensor bytes; saved devices cpu -> cuda:0)"
    )

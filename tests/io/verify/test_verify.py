"""``--verify``: full verification passes on good outputs and catches every kind of mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.cli.main import main
from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import VerificationError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.structure.selection import select_state_dict
from ckpt_tools.structure.tensor_walk import iter_listed_tensors
from tests import helpers as h


def expected_from(path: Path, select: str | None = None) -> Expected:
    """What ``path``'s state dict holds, as the expectation another file is checked against."""
    ckpt = open_checkpoint(path)
    selection = select_state_dict(ckpt.root, select=select)
    tensors = {k: v for k, v in selection.state_dict.items() if isinstance(v, TensorRef)}
    return Expected(tensors, selection.path, ckpt)


@pytest.fixture
def saved(tmp_path):
    """Factory: ``torch.save(obj)`` into tmp_path under ``name``."""

    def make(name: str, obj) -> Path:
        return h.save(obj, tmp_path / name)

    return make


@pytest.mark.parametrize(
    ("layout", "command", "suffix"),
    [
        ("trainer", ["strip-module"], ".pt"),
        ("lightning", ["strip-module"], ".pt"),
        ("stacked", ["strip-module"], ".pt"),
        ("nan_payloads", ["add-module", "--prefix", "outer."], ".pt"),
        ("transposed", ["rename", "--regex", r"^module\.(\w+)$=m.\1"], ".pt"),
        ("offset_views", ["convert"], ".safetensors"),
        ("mixed_dtypes", ["convert"], ".safetensors"),
        ("safetensors", ["convert"], ".pt"),
        ("legacy", ["convert"], ".pt"),
        ("tied", ["retag", "--map", "cpu=cuda:3"], ".pt"),
    ],
)
def test_verify_full_passes_on_good_outputs(layout, command, suffix, tmp_path, capsys):
    src, _, _ = h.save_layout(layout, tmp_path / f"{layout}.pt")
    out = tmp_path / f"out{suffix}"
    code = main([command[0], str(src), str(out), *command[1:], "--verify", "full"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert "verified:" in stdout and "keys, sizes and bytes" in stdout
    assert h.temp_files(tmp_path) == []


def test_verify_output_accepts_a_faithful_copy(saved):
    a = saved("a.pt", h.with_prefix({**h.offset_views(), **h.transposed_views()}, ""))
    b = saved("b.pt", torch.load(a, weights_only=True))
    for level in ("sizes", "full"):
        assert verify_output(str(b), expected_from(a), level).startswith("verified: 6 tensors")
    assert verify_output(str(b), expected_from(a), "none") == "not verified (verify none)"


def test_verify_output_detects_different_keys(saved):
    a = saved("a.pt", {"w": torch.ones(2), "b": torch.ones(1)})
    b = saved("b.pt", {"w": torch.ones(2), "bias": torch.ones(1)})
    with pytest.raises(VerificationError, match=r"missing \['b'\], unexpected \['bias'\]"):
        verify_output(str(b), expected_from(a), "sizes")
    c = saved("c.pt", {"b": torch.ones(1), "w": torch.ones(2)})  # same keys, other order
    with pytest.raises(VerificationError, match="keys differ"):
        verify_output(str(c), expected_from(a), "sizes")


@pytest.mark.parametrize(
    "command",
    [["convert"], ["slim", "--dtype", "bf16"], ["retag", "--map", "cpu=meta"], ["sanitize"]],
)
def test_a_nan_key_is_the_same_key_read_back(command, tmp_path):
    # NaN never equals itself, but torch.save and torch.load keep a NaN key as a key.
    nan = float("nan")
    src = tmp_path / "m.pt"
    want = [torch.ones(2), torch.zeros(2), torch.arange(3.0), torch.ones(4)]
    torch.save(dict(zip(["w", nan, (1, nan), float("nan")], want)), src)  # two NaN keys
    name, *options = command
    h.run_ckpt(name, src, tmp_path / "o.pt", *options, "--verify", "full")
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    assert [repr(k) for k in out] == ["'w'", "nan", "(1, nan)", "nan"]
    for got, value in zip(out.values(), want):
        assert got.shape == value.shape
        assert got.is_meta if name == "retag" else torch.equal(got.float(), value)
    if name == "convert":  # the same tensors under the same keys
        said = verify_output(str(tmp_path / "o.pt"), expected_from(src), "full")
        assert said.startswith("verified: 4 tensors")


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (torch.ones(3), r"reads back as float32 \[3\], expected float32 \[2\]"),
        (torch.ones(2, dtype=torch.float64), "reads back as float64"),
        (torch.ones(1, 2), r"reads back as float32 \[1, 2\]"),
    ],
)
def test_verify_output_detects_dtype_and_shape_mismatches(other, message, saved):
    a = saved("a.pt", {"w": torch.ones(2)})
    b = saved("b.pt", {"w": other})
    with pytest.raises(VerificationError, match=message):
        verify_output(str(b), expected_from(a), "sizes")


def test_verify_output_detects_different_bytes_only_at_full(saved):
    nan = h.nan_payloads()["f32"]
    a = saved("a.pt", {"w": nan})
    flipped = nan.clone()
    flipped.view(torch.int32)[0] ^= 1  # another NaN payload: equal as NaN, not as bits
    b = saved("b.pt", {"w": flipped})
    assert verify_output(str(b), expected_from(a), "sizes").startswith("verified")
    with pytest.raises(VerificationError, match="the bytes of 'w' differ"):
        verify_output(str(b), expected_from(a), "full")
    # -0.0 is not 0.0 either.
    c = saved("c.pt", {"w": torch.tensor([0.0, 1.0])})
    d = saved("d.pt", {"w": torch.tensor([-0.0, 1.0])})
    with pytest.raises(VerificationError, match="the bytes of 'w' differ"):
        verify_output(str(d), expected_from(c), "full")


def test_verify_output_detects_changed_views(saved):
    m = torch.arange(15.0).view(3, 5)
    a = saved("a.pt", {"w": m.t()})
    b = saved("b.pt", {"w": m.t().contiguous()})  # same values, other strides
    with pytest.raises(VerificationError, match=r"strides \[3, 1\] at storage offset 0"):
        verify_output(str(b), expected_from(a), "sizes")
    base = torch.arange(10.0)
    c = saved("c.pt", {"w": base[2:6]})
    d = saved("d.pt", {"w": base[2:6].clone()})
    with pytest.raises(VerificationError, match=r"at storage offset 0, expected \[1\] at 2"):
        verify_output(str(d), expected_from(c), "sizes")


def test_verify_output_detects_lost_or_added_sharing(saved):
    w = torch.randn(4)
    shared = saved("shared.pt", {"a": w, "b": w})
    separate = saved("separate.pt", {"a": w.clone(), "b": w.clone()})
    with pytest.raises(VerificationError, match="'b' shares storage with 'b' in the output"):
        verify_output(str(separate), expected_from(shared), "sizes")
    with pytest.raises(VerificationError, match="'b' shares storage with 'a' in the output"):
        verify_output(str(shared), expected_from(separate), "sizes")


def test_verify_output_of_an_unreadable_file(saved, tmp_path):
    a = saved("a.pt", {"w": torch.ones(2)})
    broken = tmp_path / "broken.pt"
    broken.write_bytes(a.read_bytes()[:-30])
    with pytest.raises(VerificationError, match="does not read back"):
        verify_output(str(broken), expected_from(a), "sizes")


def test_verify_output_against_a_nested_selection(saved):
    sd = {"w": torch.ones(2)}
    a = saved("a.pt", {"model": sd, "epoch": 1})
    b = saved("b.pt", {"model": {"w": torch.zeros(2)}, "epoch": 1})
    assert verify_output(str(b), expected_from(a), "sizes").startswith("verified: 1 tensors")
    with pytest.raises(VerificationError, match="the bytes of 'w' differ"):
        verify_output(str(b), expected_from(a), "full")


def test_verify_safetensors_output_against_a_pt_source(saved, tmp_path):
    from safetensors.torch import save_file

    m = torch.arange(6.0).view(2, 3)
    a = saved("a.pt", {"w": m.t()})
    good = tmp_path / "good.safetensors"
    save_file({"w": m.t().contiguous()}, str(good))
    assert verify_output(str(good), expected_from(a), "full").startswith("verified")
    bad = tmp_path / "bad.safetensors"
    save_file({"w": m.contiguous().view(3, 2)}, str(bad))  # same bytes as m, not as m.t()
    with pytest.raises(VerificationError, match="the bytes of 'w' differ"):
        verify_output(str(bad), expected_from(a), "full")


def test_verify_full_reads_a_compressed_record_once_for_all_its_views(saved, tmp_path, monkeypatch):
    import zipfile

    from ckpt_tools.io.verify import outputs as verify_module

    base = torch.arange(64.0)
    stored = saved("stored.pt", {f"module.t{i}": base[i : i + 1] for i in range(64)})
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(stored) as src, zipfile.ZipFile(deflated, "w") as dst:
        for item in src.infolist():
            method = zipfile.ZIP_DEFLATED if item.filename.endswith("/data/0") else None
            dst.writestr(item, src.read(item), compress_type=method or item.compress_type)
    assert open_checkpoint(deflated).records["data/0"].compressed
    calls = []
    real = verify_module._record_crc
    monkeypatch.setattr(
        verify_module, "_record_crc", lambda ckpt, key: calls.append(key) or real(ckpt, key)
    )
    out = tmp_path / "out.pt"
    assert main(["strip-module", str(deflated), str(out), "--verify", "full", "-q"]) == 0
    # Once for the comparison with the source's CRC, once for the written record's own.
    assert calls == ["0", "0"]
    loaded = torch.load(out, weights_only=True)
    assert all(torch.equal(loaded[f"t{i}"], base[i : i + 1]) for i in range(64))


def test_a_root_that_is_no_mapping_is_verified_tensor_by_tensor(saved, tmp_path):
    # torch.save(tensor) or of a list: no state dict, yet every tensor is checked by its place.
    t = torch.arange(6.0)
    a = saved("a.pt", [t, t[2:], {"x": torch.ones(2)}, 3])
    b = saved("b.pt", [t, t[2:], {"x": torch.tensor([1.0, 2.0])}, 3])
    ckpt = open_checkpoint(a)
    expected = Expected(dict(iter_listed_tensors(ckpt.root)), None, ckpt)
    assert verify_output(str(a), expected, "full") == ("verified: 3 tensors, keys, sizes and bytes")
    with pytest.raises(VerificationError, match=r"the bytes of '2\.x' differ"):
        verify_output(str(b), expected, "full")
    bare = saved("bare.pt", t)
    result = ct.convert(bare, tmp_path / "out.pt", verify="full")
    assert result.verification == "verified: 1 tensors, keys, sizes and bytes"
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), t)


def test_every_writing_command_words_no_verification_alike(tmp_path: Path) -> None:
    import ckpt_tools as ct
    from ckpt_tools.io.verify.levels import NOT_VERIFIED

    torch.save({"module.w": torch.ones(2), "module.b": torch.zeros(3)}, tmp_path / "in.pt")
    src = tmp_path / "in.pt"
    results = [
        ct.strip_module(src, tmp_path / "a.pt", verify="none"),
        ct.convert(src, f"{tmp_path}/hf/", verify="none"),
        ct.sanitize(src, tmp_path / "s.pt", verify="none"),
        ct.slim(src, tmp_path / "l.pt", dtype="bf16", verify="none"),
    ]
    assert {r.verification for r in results} == {NOT_VERIFIED}
    assert "--" not in NOT_VERIFIED  # the library names no command-line flag

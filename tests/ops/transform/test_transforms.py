"""slim, extract, average and --dry-run, checked with torch.load and safetensors (the oracles)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.cli.main import cli, main

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
NESTED = [
    "plain.pt",
    "state_dict.pt",
    "model.pt",
    "model_state_dict.pt",
    "model_state.pt",
    "module.pt",
    "state_dict_ema.pt",
    "model_ema.pt",
    "ema_only.pt",
    "lightning.ckpt",
    "trainer_sgd.pt",
    "trainer_adam.pt",
    "dataparallel.pt",
    "tied_views.pt",
    "dtypes.pt",
    "legacy.pt",
    "model.safetensors",
]


def _sd(path: Path, select: tuple[str, ...]) -> dict:
    if path.suffix == ".safetensors":
        return load_file(path)
    obj = torch.load(path, weights_only=True)
    for key in select:
        obj = obj[key]
    return obj


@pytest.mark.parametrize("name", NESTED)
def test_slim_bf16_weights_only_equals_torch_to(tmp_path: Path, name: str) -> None:
    src = FIXTURES / name
    result = ct.slim(
        src, tmp_path / "out.pt", dtype="bf16", weights_only=True, keep_dtype=["running_var"]
    )
    assert result.written
    ref = _sd(src, _selected(src))
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == list(ref)
    for key, value in ref.items():
        castable = (
            value.dtype in (torch.float32, torch.float64, torch.float16)
            and "running_var" not in key
        )
        want = value.to(torch.bfloat16) if castable else value
        assert out[key].dtype == want.dtype, key
        assert torch.equal(_bits(out[key]), _bits(want)), key
        assert out[key].stride() == value.stride()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _selected(src: Path) -> tuple[str, ...]:
    return ct.inspect(src).selected


@pytest.mark.parametrize("name", ["tied_views.pt", "legacy_tied_views.pt"])
def test_slim_keeps_ties_and_views(tmp_path: Path, name: str) -> None:
    ct.slim(FIXTURES / name, tmp_path / "out.pt", dtype="fp16", weights_only=True)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = _sd(FIXTURES / name, _selected(FIXTURES / name))
    pointers = {k: v.untyped_storage().data_ptr() for k, v in ref.items()}
    got = {k: v.untyped_storage().data_ptr() for k, v in out.items()}
    for a in ref:
        for b in ref:
            assert (pointers[a] == pointers[b]) == (got[a] == got[b]), (a, b)


@pytest.mark.parametrize("other", ["optimizer", "ema"])
def test_slim_keeps_a_storage_a_tensor_outside_the_state_dict_shares(
    tmp_path: Path, other: str
) -> None:
    # An optimizer state that holds a weight itself, or an EMA not yet apart from the model:
    # the same tensor outside the state dict keeps the storage as it is, and a note says so.
    torch.manual_seed(0)
    sd = {"w": torch.randn(3), "b": torch.randn(2)}
    outside = {"state": {0: {"exp_avg": sd["w"]}}} if other == "optimizer" else dict(sd)
    torch.save({"model": sd, other: outside}, tmp_path / "in.pt")
    result = ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype="bf16")
    ref = torch.load(tmp_path / "in.pt", weights_only=True)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    shared = ["w"] if other == "optimizer" else ["w", "b"]
    for key, value in out["model"].items():
        want = ref["model"][key] if key in shared else ref["model"][key].bfloat16()
        assert value.dtype == want.dtype and torch.equal(value, want), key
    moved = out[other]["state"][0]["exp_avg"] if other == "optimizer" else out[other]["w"]
    assert moved.untyped_storage().data_ptr() == out["model"]["w"].untyped_storage().data_ptr()
    assert [n for n in result.notes if "outside the state dict shares it" in n] == [
        f"storage {k!r} kept as float32: a tensor outside the state dict shares it"
        for k in (["0"] if other == "optimizer" else ["0", "1"])
    ]


def test_slim_to_safetensors_casts_a_storage_shared_only_with_what_it_leaves_out(
    tmp_path: Path,
) -> None:
    # The EMA copy that shares the weight's storage is not written to safetensors: nothing
    # keeps the weight from its cast.
    torch.manual_seed(0)
    p = torch.randn(4, 4)
    torch.save(
        {"state_dict": {"w": p, "b": torch.randn(4)}, "ema_w": p, "epoch": 3}, tmp_path / "in.pt"
    )
    result = ct.slim(
        tmp_path / "in.pt", tmp_path / "out.safetensors", dtype="bf16", drop_extras=True
    )
    got = load_file(tmp_path / "out.safetensors")
    assert {k: v.dtype for k, v in got.items()} == {"w": torch.bfloat16, "b": torch.bfloat16}
    assert torch.equal(got["w"], p.bfloat16())
    assert not [n for n in result.notes if "outside the state dict shares it" in n]


def test_slim_drop_and_keep_dtype_leave_the_rest_bit_for_bit(tmp_path: Path) -> None:
    src = FIXTURES / "trainer_adam.pt"
    result = ct.slim(
        src, tmp_path / "o.pt", dtype="fp16", drop=["optimizer"], keep_dtype=[r"^bn\."]
    )
    ref = torch.load(src, weights_only=True)
    out = torch.load(tmp_path / "o.pt", weights_only=True)
    assert set(out) == set(ref) - {"optimizer"}
    assert out["scheduler"] == ref["scheduler"] and out["epoch"] == ref["epoch"]
    assert out["model"]["bn.weight"].dtype == torch.float32
    assert out["model"]["conv.weight"].dtype == torch.float16
    assert "optimizer" in result.dropped and result.size_after["optimizer"] == 0
    assert result.size_before["optimizer"] > 0


def test_slim_refuses_unknown_drop_and_missing_ema(tmp_path: Path) -> None:
    with pytest.raises(ct.UsageError, match="cannot drop nope"):
        ct.slim(FIXTURES / "trainer_adam.pt", tmp_path / "o.pt", drop=["nope"])
    with pytest.raises(ct.SelectError, match="no EMA copy found"):
        ct.slim(FIXTURES / "trainer_adam.pt", tmp_path / "o.pt", ema=True)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("state_dict_ema.pt", "state_dict_ema"),
        ("model_ema.pt", "model_ema"),
        ("ema_only.pt", "model_ema"),
    ],
)
def test_slim_ema_takes_the_ema_copy(tmp_path: Path, name: str, key: str) -> None:
    result = ct.slim(FIXTURES / name, tmp_path / "e.safetensors", ema=True, weights_only=True)
    assert any(key in n for n in result.notes)
    ref = torch.load(FIXTURES / name, weights_only=True)[key]
    out = load_file(tmp_path / "e.safetensors")
    assert list(out) == list(ref) and all(torch.equal(out[k], ref[k]) for k in ref)


def test_an_ema_entry_holding_only_settings_is_passed_over(tmp_path: Path) -> None:
    # {"ema": {"decay": ...}} beside the EMA weights: the weights are taken; with no weights
    # anywhere, there is no EMA copy.
    sd = {"fc.weight": torch.randn(2, 2), "fc.bias": torch.randn(2)}
    ema = {"fc.weight": torch.randn(2, 2), "fc.bias": torch.randn(2)}
    settings = {"decay": 0.9999, "enabled": True}
    torch.save({"state_dict": sd, "ema": settings, "ema_state_dict": ema}, tmp_path / "a.pt")
    torch.save({"state_dict": sd, "ema": settings}, tmp_path / "b.pt")
    ct.slim(tmp_path / "a.pt", tmp_path / "a-ema.pt", ema=True, weights_only=True, dtype="bf16")
    out = torch.load(tmp_path / "a-ema.pt", weights_only=True)
    assert list(out) == list(ema)
    assert all(torch.equal(out[k], v.to(torch.bfloat16)) for k, v in ema.items())
    ct.extract(tmp_path / "a.pt", tmp_path / "head.pt", ema=True, prefix="fc")
    assert list(torch.load(tmp_path / "head.pt", weights_only=True)) == list(ema)
    with pytest.raises(ct.SelectError, match="no EMA copy found"):
        ct.slim(tmp_path / "b.pt", tmp_path / "b-ema.pt", ema=True, weights_only=True)
    assert not (tmp_path / "b-ema.pt").exists()


@pytest.mark.parametrize(
    "name", ["plain.pt", "model.pt", "lightning.ckpt", "dataparallel.pt", "model.safetensors"]
)
def test_extract_prefix(tmp_path: Path, name: str) -> None:
    ref = _sd(FIXTURES / name, _selected(FIXTURES / name))
    prefix = next(k for k in ref if "layers." in k).split("layers.")[0] + "layers."
    ct.extract(FIXTURES / name, tmp_path / "x.pt", prefix=prefix, strip_prefix=True)
    out = torch.load(tmp_path / "x.pt", weights_only=True)
    want = {k[len(prefix) :]: v for k, v in ref.items() if k.startswith(prefix)}
    assert list(out) == list(want) and all(torch.equal(out[k], want[k]) for k in want)
    with pytest.raises(ct.UsageError, match=r"no key lies under 'nothing\.'"):
        ct.extract(FIXTURES / name, tmp_path / "y.pt", prefix="nothing.")


def test_extract_names_a_bare_key_without_a_dot_when_no_key_lies_under_the_prefix(
    tmp_path: Path,
) -> None:
    torch.save({"conv1.weight": torch.ones(2), "fc": torch.ones(2)}, tmp_path / "in.pt")
    with pytest.raises(ct.UsageError, match=r"the keys start with conv1\., fc$"):
        ct.extract(tmp_path / "in.pt", tmp_path / "out.pt", prefix="head.")


def _inputs(tmp_path: Path) -> list[dict]:
    sds = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        w = torch.randn(64, 33, generator=g)
        sd = {
            "enc.weight": w,
            "dec.weight": w,
            "h": torch.randn(1001, generator=g).half(),
            "b": torch.randn(77, generator=g).bfloat16(),
            "d": torch.randn(5, dtype=torch.float64, generator=g),
            "n": torch.tensor(7),
        }
        sds.append(sd)
        saved = {("module." + k if i == 1 else k): v for k, v in sd.items()}  # a DDP input
        torch.save(saved, tmp_path / f"ckpt_{i}.pt")
    return sds


def test_average_of_three_equals_float64_reference(tmp_path: Path) -> None:
    sds = _inputs(tmp_path)
    weights = [1.0, 2.0, 0.5]
    ct.average([tmp_path / f"ckpt_{i}.pt" for i in range(3)], tmp_path / "avg.pt", weights=weights)
    out = torch.load(tmp_path / "avg.pt", weights_only=True)
    for key, first in sds[0].items():
        if not first.is_floating_point():
            assert torch.equal(out[key], first)
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for sd, w in zip(sds, weights):
            acc += sd[key].double() * w
        want = (acc / sum(weights)).to(first.dtype)
        assert out[key].dtype == first.dtype
        assert torch.equal(out[key].view(torch.uint8), want.view(torch.uint8)), key
    assert out["enc.weight"].data_ptr() == out["dec.weight"].data_ptr()  # tied: averaged once


def test_average_refuses_mismatches(tmp_path: Path) -> None:
    _inputs(tmp_path)
    torch.save({"enc.weight": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(ct.ConversionError, match=r"- dec.weight \(missing in other.pt\)") as e:
        ct.average([tmp_path / "ckpt_0.pt", tmp_path / "other.pt"], tmp_path / "a.pt")
    assert e.value.exit_code == 7
    sd = torch.load(tmp_path / "ckpt_2.pt", weights_only=True)
    sd["n"] = torch.tensor(8)
    torch.save(sd, tmp_path / "ckpt_2.pt")
    with pytest.raises(ct.ConversionError, match="integer tensors differ across inputs: n"):
        ct.average([tmp_path / f"ckpt_{i}.pt" for i in range(3)], tmp_path / "a.pt")
    ct.average([tmp_path / f"ckpt_{i}.pt" for i in range(3)], tmp_path / "a.pt", ints="last")
    assert torch.load(tmp_path / "a.pt", weights_only=True)["n"].item() == 8


def test_an_input_given_twice_is_named_not_miscounted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # ``ckpt average a.pt a.pt OUT``: two inputs given, one file. Averaging a file with itself
    # is never what naming it twice meant; a weight says "count this one more".
    sds = _inputs(tmp_path)
    first = tmp_path / "ckpt_0.pt"
    before = _snapshot(tmp_path)
    with pytest.raises(ct.UsageError, match=r"'ckpt_0.pt' is given twice \(inputs 1 and 2 of 2\)"):
        ct.average(["ckpt_0.pt", "ckpt_0.pt"], tmp_path / "avg.pt")
    os.link(first, tmp_path / "same.pt")  # one file, two names
    before["same.pt"] = before["ckpt_0.pt"]
    with pytest.raises(ct.UsageError, match=r"ckpt_0.pt' and '.*same.pt' are the same file") as e:
        ct.average([first, tmp_path / "ckpt_1.pt", tmp_path / "same.pt"], tmp_path / "avg.pt")
    assert "(inputs 1 and 3 of 3)" in str(e.value) and "pass weights" in str(e.value)
    assert _snapshot(tmp_path) == before  # nothing written

    assert main(["average", str(first), str(first), str(tmp_path / "avg.pt")]) == 2
    err = capsys.readouterr().err
    assert f"{str(first)!r} is given twice" in err and "--weights" in err, err
    assert "at least two inputs" not in err
    assert _snapshot(tmp_path) == before

    # An HF folder and its own weight file or index: one checkpoint, read from the same files.
    for name, shard in (("one", None), ("sharded", 100)):
        ct.convert(first, f"{tmp_path}/{name}/", max_shard_size=shard)
        index = "model.safetensors.index.json" if shard else "model.safetensors"
        for twin in (f"{tmp_path}/{name}/{index}", f"{tmp_path}/./{name}"):
            srcs = [tmp_path / name, tmp_path / "ckpt_1.pt", twin]
            with pytest.raises(ct.UsageError, match=r"same (checkpoint|file) \(inputs 1 and 3"):
                ct.average(srcs, tmp_path / "avg.pt")

    # What repeating it meant, said with a weight.
    ct.average([first, tmp_path / "ckpt_2.pt"], tmp_path / "avg.pt", weights=[2, 1])
    out = torch.load(tmp_path / "avg.pt", weights_only=True)
    want = ((2 * sds[0]["d"] + sds[2]["d"]) / 3).to(torch.float64)
    assert torch.equal(out["d"], want)


@pytest.mark.parametrize(
    "call",
    [
        lambda src, dst, fmt: ct.rewrite(src, dst, output_format=fmt),
        lambda src, dst, fmt: ct.strip_module(src, dst, prefix="enc.", output_format=fmt),
        lambda src, dst, fmt: ct.add_module(src, dst, output_format=fmt),
        lambda src, dst, fmt: ct.convert(src, dst, output_format=fmt),
        lambda src, dst, fmt: ct.slim(src, dst, weights_only=True, output_format=fmt),
        lambda src, dst, fmt: ct.extract(src, dst, prefix="enc.", output_format=fmt),
        lambda src, dst, fmt: ct.average([src, src.with_name("ckpt_2.pt")], dst, output_format=fmt),
    ],
    ids=["rewrite", "strip_module", "add_module", "convert", "slim", "extract", "average"],
)
@pytest.mark.parametrize(
    ("name", "fmt", "fits"),
    [("out.safetensors", "torch", "out.pt"), ("out.pth", "safetensors", "out.safetensors")],
)
def test_an_output_format_its_name_contradicts_is_refused(tmp_path, call, name, fmt, fits):
    # A torch zip named .safetensors is refused by torch.load and by safetensors alike, and a
    # safetensors file under a torch name likewise: refused before a byte is written, with
    # the name that fits.
    _inputs(tmp_path)
    src = tmp_path / "ckpt_0.pt"
    before = _snapshot(tmp_path)
    with pytest.raises(ct.UsageError, match=rf"output_format='{fmt}': .* name it '.*{fits}'"):
        call(src, tmp_path / name, fmt)
    assert _snapshot(tmp_path) == before
    result = call(src, tmp_path / fits, fmt)  # the name it suggests works
    assert result.written == (str(tmp_path / fits),)
    assert result.output_format == {"torch": "torch-zip", "safetensors": "safetensors"}[fmt]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    "args",
    [
        ["strip-module", "dataparallel.pt", "out.pt"],
        ["add-module", "plain.pt", "out.pt"],
        ["rename", "plain.pt", "out.pt", "--sub", "layers.=blocks."],
        ["retag", "plain.pt", "out.pt", "--map", "cpu=cuda:0"],
        ["convert", "plain.pt", "out.safetensors"],
        ["slim", "trainer_adam.pt", "out.pt", "--dtype", "bf16", "--weights-only"],
        ["extract", "plain.pt", "out.pt", "--prefix", "layers."],
        ["average", "plain.pt", "other_root.pt", "out.pt"],
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_dry_run_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], as_json: bool
) -> None:
    for name in ("dataparallel.pt", "plain.pt", "trainer_adam.pt", "other_root.pt"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(cli, [*args, "--dry-run", *(["--json"] if as_json else [])])
    assert result.exit_code == 0, result.output
    assert _snapshot(tmp_path) == before
    if as_json:
        data = json.loads(result.output)
        assert data["written"] == [] and data["dry_run"] is True
    else:
        assert "dry run" in result.output


def test_cli_slim_subprocess_and_refusal_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = Path(sys.executable).parent / "ckpt"
    run = subprocess.run(
        [
            str(ckpt),
            "slim",
            str(FIXTURES / "trainer_adam.pt"),
            str(tmp_path / "w.safetensors"),
            "--dtype",
            "fp16",
            "--weights-only",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["written"] and data["size_after"]["optimizer"] == 0
    ref = torch.load(FIXTURES / "trainer_adam.pt", weights_only=True)["model"]
    out = load_file(tmp_path / "w.safetensors")
    assert all(
        torch.equal(out[k], v.half() if v.is_floating_point() else v) for k, v in ref.items()
    )
    code = main(["slim", str(FIXTURES / "trainer_adam.pt"), str(tmp_path / "x.safetensors")])
    assert code == 7 and "pass --weights-only" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.safetensors")


def test_average_mixed_formats_to_safetensors(tmp_path: Path) -> None:
    """A safetensors input first, a DDP .pt second; the output is safetensors."""
    from safetensors.torch import save_file

    sds = _inputs(tmp_path)
    plain = {k: v.clone() for k, v in sds[0].items() if k != "dec.weight"}
    save_file(plain, tmp_path / "first.safetensors")
    second = torch.load(tmp_path / "ckpt_1.pt", weights_only=True)
    torch.save({k: v for k, v in second.items() if k != "module.dec.weight"}, tmp_path / "ddp.pt")
    ct.average([tmp_path / "first.safetensors", tmp_path / "ddp.pt"], tmp_path / "avg.safetensors")
    out = load_file(tmp_path / "avg.safetensors")
    for key, first in plain.items():
        if first.is_floating_point():
            want = ((first.double() + sds[1][key].double()) / 2).to(first.dtype)
            assert torch.equal(_bits(out[key]), _bits(want)), key
        else:
            assert torch.equal(out[key], first)


def test_average_cli_globs_and_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sds = _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["average", "ckpt_*.pt", "avg.pt", "--last", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["sources"] == ["ckpt_1.pt", "ckpt_2.pt"]
    out = torch.load(tmp_path / "avg.pt", weights_only=True)
    want = ((sds[1]["h"].double() + sds[2]["h"].double()) / 2).half()
    assert torch.equal(_bits(out["module.h"]), _bits(want))  # the first input's keys (DDP)


def test_average_cli_writes_its_last_argument_as_cp_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # INPUT... OUT, as the library's average(srcs, dst): the first input is never overwritten.
    sds = _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    first = (tmp_path / "ckpt_0.pt").read_bytes()
    args = ["average", "ckpt_0.pt", "ckpt_1.pt", "ckpt_2.pt", "--force"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ckpt_0.pt").read_bytes() == first
    out = torch.load(tmp_path / "ckpt_2.pt", weights_only=True)
    want = ((sds[0]["d"] + sds[1]["d"]) / 2).to(torch.float64)
    assert torch.equal(out["d"], want)  # mean(ckpt_0, ckpt_1), written over the last argument
    assert "ckpt_2.pt" in result.output


@pytest.mark.parametrize(
    "args",
    [["ckpt_*.pt", "missing.pt", "avg.pt", "--last", "2"], ["ckpt_0.pt", "missing.pt", "avg.pt"]],
    ids=["last", "plain"],
)
def test_average_a_missing_input_is_named_not_a_traceback(
    tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    _inputs(tmp_path)
    before = _snapshot(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["average", *args])
        with pytest.raises(ct.CheckpointNotFoundError, match=r"missing\.pt"):
            ct.average(["ckpt_0.pt", "missing.pt"], "avg.pt")
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == ct.CheckpointNotFoundError.exit_code, err
    assert err.startswith("ckpt: error: ") and "missing.pt" in err and "Traceback" not in err
    assert _snapshot(tmp_path) == before


def test_slim_ema_from_a_lightning_callback(tmp_path: Path) -> None:
    weights = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    ema = {k: v * 0.5 for k, v in weights.items()}
    ckpt = {
        "state_dict": weights,
        "epoch": 1,
        "global_step": 10,
        "pytorch-lightning_version": "2.4.0",
        "callbacks": {"EMACallback": {"ema_state_dict": ema}},
    }
    torch.save(ckpt, tmp_path / "l.ckpt")
    result = ct.slim(
        tmp_path / "l.ckpt", tmp_path / "ema.pt", ema=True, weights_only=True, dtype="fp16"
    )
    assert "EMACallback" in " ".join(result.notes)
    out = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert all(torch.equal(out[k], v.half()) for k, v in ema.items())


@pytest.mark.parametrize("dst", ["full.pt", "full.safetensors"])
def test_verify_full_recomputes_every_record(tmp_path: Path, dst: str) -> None:
    _inputs(tmp_path)
    result = ct.slim(FIXTURES / "tied_views.pt", tmp_path / dst, dtype="bf16", verify="full")
    assert "bytes of" in result.verification
    result = ct.average(
        [tmp_path / "ckpt_0.pt", tmp_path / "ckpt_2.pt"], tmp_path / f"avg_{dst}", verify="full"
    )
    assert "bytes of" in result.verification


def test_verify_full_catches_a_record_that_differs_and_keeps_nothing(tmp_path: Path) -> None:
    """A producer that yields other bytes the second time (a mutated record) is caught."""
    import dataclasses
    import itertools

    from ckpt_tools.formats import open_checkpoint
    from ckpt_tools.io.output_path import check_output_path
    from ckpt_tools.ops.transform.plan import execute_plan

    planned = ct.slim(FIXTURES / "plain.pt", tmp_path / "o.pt", dtype="fp16", dry_run=True).plan
    runs = itertools.count()
    sid, record = next((k, r) for k, r in planned.records.items() if r.produce is not None)

    def flaky():  # the first run (the write) is right; the re-run for verification is not
        for piece in record.produce():
            yield piece if next(runs) == 0 else bytes(len(piece))

    records = {**planned.records, sid: dataclasses.replace(record, produce=flaky)}
    plan = dataclasses.replace(planned, records=records)
    target = check_output_path(str(tmp_path / "o.pt"), str(FIXTURES / "plain.pt"))
    with pytest.raises(
        ct.VerificationError, match=r"record 'data/\d+' \(cast float32 -> float16\) differs"
    ):
        execute_plan(plan, target, open_checkpoint(str(FIXTURES / "plain.pt")), "full")
    assert list(tmp_path.iterdir()) == []


def test_slim_and_extract_inflate_a_rezipped_archive(tmp_path: Path) -> None:
    """Deflated storage records (a re-zipping tool; torch reads them) are inflated, then cast."""
    import zipfile

    src = tmp_path / "deflated.pt"
    deflated = zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(FIXTURES / "trainer_adam.pt") as zin, deflated as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    ref = torch.load(src, weights_only=True)
    ct.slim(src, tmp_path / "s.pt", dtype="fp16", verify="full")
    out = torch.load(tmp_path / "s.pt", weights_only=True)
    for key, value in ref["model"].items():
        want = value.half() if value.is_floating_point() else value
        assert torch.equal(_bits(out["model"][key]), _bits(want)), key
    exp_avg = ref["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], exp_avg)  # optimizer: copied
    ct.extract(src, tmp_path / "x.pt", prefix="layers.", verify="full")
    extracted = torch.load(tmp_path / "x.pt", weights_only=True)
    assert extracted and all(torch.equal(extracted[k], ref["model"][k]) for k in extracted)


def test_dry_run_still_refuses_what_the_write_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refusals come from planning, so a dry run says the same as the real run, exit code too."""
    dst = tmp_path / "t.safetensors"
    code = main(["convert", str(FIXTURES / "trainer_adam.pt"), str(dst), "--dry-run"])
    assert code == 7 and "pass --drop-extras" in capsys.readouterr().err
    code = main(["slim", str(FIXTURES / "trainer_adam.pt"), str(dst), "--dry-run"])
    assert code == 7 and "pass --weights-only" in capsys.readouterr().err
    code = main(
        [
            "average",
            str(FIXTURES / "plain.pt"),
            str(FIXTURES / "tied_views.pt"),
            str(dst),
            "--dry-run",
        ]
    )
    assert code == 7 and "the inputs do not match" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    result = ct.rewrite(
        FIXTURES / "dataparallel.pt",
        tmp_path / "p.pt",
        rules=[ct.sub_rule("module.", "")],
        dry_run=True,
    )
    assert not result.written and len(result.examples) == result.renamed == 17
    assert list(tmp_path.iterdir()) == []


def _casts(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dtype.itemsize > 1  # float8 stays as it is


@pytest.mark.parametrize("name", NESTED)
def test_slim_keep_dtype_and_drop_on_every_nested_layout(tmp_path: Path, name: str) -> None:
    # --keep-dtype and --drop on every layout, torch.load the oracle.
    src = FIXTURES / name
    selected = _selected(src)
    ref_sd = _sd(src, selected)
    kept_key = next(k for k, v in ref_sd.items() if _casts(v))
    beside = (
        []
        if src.suffix == ".safetensors" or not selected
        else [k for k in torch.load(src, weights_only=True) if k != selected[0]]
    )
    dst = tmp_path / ("o" + src.suffix)
    result = ct.slim(
        src, dst, dtype="fp16", keep_dtype=[f"^{re.escape(kept_key)}$"], drop=beside[:1]
    )
    assert result.written and set(beside[:1]) <= set(result.dropped)
    out_sd = _sd(dst, selected)
    assert list(out_sd) == list(ref_sd)

    # A storage is cast only when every tensor on it is cast: a tie to the kept key, or a
    # view sharing bytes with a tensor that is not cast, keeps the whole storage as it is.
    def storage(key: str) -> object:
        ptr = ref_sd[key].untyped_storage().data_ptr()
        return ptr or key  # empty tensors have no storage to share

    groups: dict[object, list[torch.Tensor]] = {}
    for key, value in ref_sd.items():
        groups.setdefault(storage(key), []).append(value)
    held = {storage(kept_key)} | {
        s
        for s, ts in groups.items()
        if not all(_casts(t) for t in ts) or len({t.dtype for t in ts}) > 1
    }
    for key, want in ref_sd.items():
        got = out_sd[key]
        if not _casts(want) or storage(key) in held:
            assert got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert got.dtype == torch.float16 and torch.equal(got, want.to(torch.float16)), key
    if beside:
        root = torch.load(dst, weights_only=True)
        assert beside[0] not in root and set(root) == set(beside[1:]) | {selected[0]}


@pytest.mark.parametrize("name", NESTED)
@pytest.mark.parametrize("strip", [False, True])
def test_extract_on_every_nested_layout(tmp_path: Path, name: str, strip: bool) -> None:
    src = FIXTURES / name
    ref = _sd(src, _selected(src))
    first = next(iter(ref))
    prefix = first.split(".")[0] + "." if "." in first else first
    if strip and not prefix.endswith("."):  # a plain key: stripping would leave it empty
        with pytest.raises(ct.UsageError, match="empty key"):
            ct.extract(src, tmp_path / "x.pt", prefix=prefix, strip_prefix=strip)
        assert not (tmp_path / "x.pt").exists()
        return
    ct.extract(src, tmp_path / "x.pt", prefix=prefix, strip_prefix=strip)
    out = torch.load(tmp_path / "x.pt", weights_only=True)
    cut = len(prefix) if strip else 0
    want = {k[cut:]: v for k, v in ref.items() if k == prefix or k.startswith(prefix)}
    assert list(out) == list(want)
    assert all(out[k].dtype == want[k].dtype and torch.equal(out[k], want[k]) for k in want)


# average: the mean is per key, whatever each input's storage layout and dtype.


def _weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The oracle: ``sum(w_i * x_i) / sum(w_i)`` in float64 (complex128), cast back by torch."""
    wide = torch.complex128 if tensors[0].is_complex() else torch.float64
    acc = torch.zeros(tensors[0].shape, dtype=wide)
    for t, w in zip(tensors, weights):
        acc += t.to(wide) * w
    return (acc / sum(weights)).to(tensors[0].dtype)


def _assert_means(out: dict, sds: list[dict], weights: list[float]) -> None:
    for key in sds[0]:
        want = _weighted_mean([sd[key] for sd in sds], weights)
        assert out[key].dtype == want.dtype, key
        assert torch.equal(_bits(out[key]), _bits(want)), key


def _tied_layouts(dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(2)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    e, x, y = rand(4, 3), rand(6), rand(6)
    return [
        {"emb": e, "head": e, "a": x[:3], "b": x[3:]},  # tied, and two views of one storage
        {"emb": rand(4, 3), "head": rand(4, 3), "a": y[3:], "b": y[:3]},  # apart, views swapped
        {"emb": rand(4, 3), "head": rand(4, 3), "a": rand(3), "b": rand(3)},  # all apart
    ]


@pytest.mark.parametrize("dst", ["avg.pt", "avg.safetensors"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex64]
)
@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (2, 1, 0)], ids=str)
def test_average_tied_in_one_input_apart_in_another_is_the_mean_of_each_key(
    tmp_path: Path, dtype: torch.dtype, dst: str, order: tuple[int, ...]
) -> None:
    layouts = _tied_layouts(dtype)
    sds = [layouts[i] for i in order]
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    weights = [1.0, 2.0, 0.5]
    ct.average([tmp_path / f"in_{i}.pt" for i in range(3)], tmp_path / dst, weights=weights)
    out = _sd(tmp_path / dst, ())
    _assert_means(out, sds, weights)


def test_average_keeps_tied_keys_tied_where_every_input_ties_them_alike(tmp_path: Path) -> None:
    sds = [_tied_layouts(torch.float32)[0] for _ in range(2)]
    sds[1] = {k: v * 3 for k, v in sds[1].items()}  # the same values, untied: no longer alike
    e, x = torch.randn(4, 3), torch.randn(6)
    sds.append({"emb": e, "head": e, "a": x[:3], "b": x[3:]})
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    ct.average([tmp_path / "in_0.pt", tmp_path / "in_2.pt"], tmp_path / "tied.pt")
    out = torch.load(tmp_path / "tied.pt", weights_only=True)
    _assert_means(out, [sds[0], sds[2]], [1.0, 1.0])
    assert out["emb"].data_ptr() == out["head"].data_ptr()
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()

    result = ct.average([tmp_path / "in_0.pt", tmp_path / "in_1.pt"], tmp_path / "apart.pt")
    out = torch.load(tmp_path / "apart.pt", weights_only=True)
    _assert_means(out, sds[:2], [1.0, 1.0])
    assert out["emb"].data_ptr() != out["head"].data_ptr()
    assert any("emb, head share a storage" in note for note in result.notes), result.notes


@pytest.mark.parametrize("dst", ["avg.pt", "avg.safetensors"])
def test_average_ints_last_takes_each_key_from_the_last_input(tmp_path: Path, dst: str) -> None:
    x, y = torch.tensor([5, 6]), torch.tensor([6, 5])
    grid, cols = torch.arange(6).reshape(2, 3), torch.arange(10, 16).reshape(3, 2)
    sds = [
        {"w": torch.randn(2), "a": x[0], "b": x[1], "m": grid},
        {"w": torch.randn(2), "a": torch.tensor(1), "b": torch.tensor(2), "m": grid + 1},
        {"w": torch.randn(2), "a": y[1], "b": y[0], "m": cols.t()},  # a strided view
    ]
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    srcs = [tmp_path / f"in_{i}.pt" for i in range(3)]
    ct.average(srcs, tmp_path / dst, ints="last")
    out = _sd(tmp_path / dst, ())
    for key in ("a", "b", "m"):
        assert torch.equal(out[key], sds[-1][key]), key
    ct.average(srcs, tmp_path / f"first_{dst}", ints="first")
    out = _sd(tmp_path / f"first_{dst}", ())
    assert all(torch.equal(out[k], sds[0][k]) for k in ("a", "b", "m"))


def test_average_means_complex_and_float8_and_never_calls_them_integers(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    sds = []
    for _ in range(2):
        f = torch.randn(64, generator=g) * 100  # past float8_e4m3fn's 448: saturates
        sds.append(
            {
                "c64": torch.randn(3, 5, dtype=torch.complex64, generator=g),
                "c128": torch.randn(7, dtype=torch.complex128, generator=g),
                "e4m3": f.to(torch.float8_e4m3fn),
                "e5m2": f.to(torch.float8_e5m2),
            }
        )
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    weights = [3.0, 1.0]
    ct.average([tmp_path / "in_0.pt", tmp_path / "in_1.pt"], tmp_path / "avg.pt", weights=weights)
    _assert_means(torch.load(tmp_path / "avg.pt", weights_only=True), sds, weights)


def test_average_bool_has_no_mean_and_ints_do_not_apply_to_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mask = torch.tensor([True, False, True])
    sds = [
        {"w": torch.randn(3), "n": torch.tensor(1), "mask": mask},
        {"w": torch.randn(3), "n": torch.tensor(2), "mask": ~mask},
    ]
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    srcs = [tmp_path / "in_0.pt", tmp_path / "in_1.pt"]
    with pytest.raises(ct.ConversionError) as e:
        ct.average(srcs, tmp_path / "avg.pt")
    said = str(e.value)
    assert "integer tensors differ across inputs: n (int64)" in said, said
    assert "tensors with no mean (bool" in said and "mask (bool)" in said, said
    assert "integer tensors differ across inputs: n (int64);" in said  # mask not among them
    with pytest.raises(ct.ConversionError, match=r"no mean .*: mask \(bool\)") as e:
        ct.average(srcs, tmp_path / "avg.pt", ints="last")
    assert "integer" not in str(e.value) and "ints=" not in str(e.value)
    assert main(["average", *map(str, srcs), str(tmp_path / "avg.pt"), "--ints", "last"]) == 7
    err = capsys.readouterr().err
    assert "mask (bool)" in err and "--ints" not in err, err
    assert not (tmp_path / "avg.pt").exists()

    sds[1]["mask"] = mask.clone()  # equal in every input: copied
    torch.save(sds[1], tmp_path / "in_1.pt")
    ct.average(srcs, tmp_path / "avg.pt", ints="last")
    out = torch.load(tmp_path / "avg.pt", weights_only=True)
    assert torch.equal(out["mask"], mask) and out["n"].item() == 2


@pytest.mark.parametrize(
    ("weights", "said"),
    [
        ("nan,1", "input 1's is nan"),
        ("1,inf", "input 2's is inf"),
        ("-inf,1", "input 1's is -inf"),
        ("1e308,1e308", "sum past float64's largest number"),
        ("1,-1", "sum to 0"),
    ],
)
def test_average_refuses_weights_with_no_finite_mean(
    tmp_path: Path, weights: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _inputs(tmp_path)
    srcs = [str(tmp_path / "ckpt_0.pt"), str(tmp_path / "ckpt_2.pt")]
    before = _snapshot(tmp_path)
    assert main(["average", *srcs, str(tmp_path / "avg.pt"), f"--weights={weights}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt: error: --weights ") and said in err, err
    assert "Warning" not in err
    with pytest.raises(ct.UsageError, match=re.escape(said)) as e:
        ct.average(srcs, tmp_path / "avg.pt", weights=[float(w) for w in weights.split(",")])
    assert str(e.value).startswith("weights=") and "--" not in str(e.value)
    assert _snapshot(tmp_path) == before


def test_average_huge_weights_and_infinite_values_match_torch_without_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inf, nan = float("inf"), float("nan")
    sds = [
        {"w": torch.tensor([inf, 1.0, inf, nan, 3e38, -inf]), "h": torch.randn(9).half()},
        {"w": torch.tensor([-inf, 2.0, inf, 1.0, 3e38, 1.0]), "h": torch.randn(9).half()},
    ]
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    srcs = [str(tmp_path / "in_0.pt"), str(tmp_path / "in_1.pt")]
    assert main(["average", *srcs, str(tmp_path / "avg.pt"), "-q"]) == 0
    assert capsys.readouterr().err == ""  # inf - inf is NaN, said by no warning
    _assert_means(torch.load(tmp_path / "avg.pt", weights_only=True), sds, [1.0, 1.0])
    # Weights whose sum is finite are used as given: w * x overflows where torch's does.
    huge = [2.0**1000, 3 * 2.0**1000]
    ct.average(srcs, tmp_path / "huge.pt", weights=huge)
    _assert_means(torch.load(tmp_path / "huge.pt", weights_only=True), sds, huge)


def test_average_to_safetensors_writes_a_transposed_view_as_its_rows(tmp_path: Path) -> None:
    sds = [{"w": torch.randn(3, 4).t(), "b": torch.randn(4)} for _ in range(2)]
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    ct.average([tmp_path / "in_0.pt", tmp_path / "in_1.pt"], tmp_path / "avg.safetensors")
    _assert_means(load_file(tmp_path / "avg.safetensors"), sds, [1.0, 1.0])


def test_average_to_safetensors_writes_views_of_one_storage_each_as_its_own(
    tmp_path: Path,
) -> None:
    # q, k and v chunked from one weight, and a slice saved with its whole storage: each is
    # averaged on its own, as convert writes each on its own.
    sds = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        q, k, v = torch.randn(12, 4, generator=g).chunk(3)
        sds.append({"q": q, "k": k, "v": v, "part": torch.randn(10, generator=g)[2:6]})
    for i, sd in enumerate(sds):
        torch.save(sd, tmp_path / f"in_{i}.pt")
    result = ct.average([tmp_path / "in_0.pt", tmp_path / "in_1.pt"], tmp_path / "avg.safetensors")
    _assert_means(load_file(tmp_path / "avg.safetensors"), sds, [1.0, 1.0])
    assert not result.notes  # laid out alike in every input: nothing to say


def test_average_of_pickled_modules_is_the_mean_of_their_state_dicts(tmp_path: Path) -> None:
    # As slim and extract: the module's state dict is recovered, never the module built.
    models = [torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)) for _ in "ab"]
    for i, m in enumerate(models):
        torch.save({"model": m, "epoch": 3}, tmp_path / f"m{i}.pt")
    result = ct.average([tmp_path / "m0.pt", tmp_path / "m1.pt"], tmp_path / "avg.pt")
    assert any("pickled nn.Module" in n for n in result.notes)
    out = torch.load(tmp_path / "avg.pt", weights_only=True)
    sds = [{k: v.detach() for k, v in m.state_dict().items()} for m in models]
    assert list(out) == list(sds[0])
    _assert_means(
        {k: v for k, v in out.items() if v.is_floating_point()},
        [{k: v for k, v in sd.items() if v.is_floating_point()} for sd in sds],
        [1.0, 1.0],
    )
    assert torch.equal(out["1.num_batches_tracked"], sds[0]["1.num_batches_tracked"])

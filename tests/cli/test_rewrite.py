"""The rewrite commands through click's ``CliRunner``: human output, ``--json``, options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import helpers as h

JSON_FIELDS = {
    "src",
    "dst",
    "written",
    "dry_run",
    "bytes_written",
    "notes",
    "input_format",
    "output_format",
    "selected",
    "tensors",
    "max_shard_size",
    "rules",
    "renamed",
    "total_keys",
    "examples",
    "wrappers",
    "bytes_copied",
    "verification",
    "dropped",
    "device_map",
    "message",
}


@pytest.fixture
def invoke():
    """``invoke(*args, code=0)``: ``ckpt ARGS`` in this process (:func:`tests.helpers.run_ckpt`)."""
    return h.run_ckpt


@pytest.fixture
def layout(tmp_path):
    """Factory: a layout file in tmp_path, returned with its prefix and selection."""

    def make(name: str) -> tuple[Path, str, str]:
        return h.save_layout(name, tmp_path / f"{name}.pt")

    return make


def unique_storage_bytes(obj) -> int:
    seen = {}
    for _, t in h.walk_tensors(obj):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_help_lists_the_rewrite_commands(invoke):
    out = invoke("--help").stdout
    for name in ("strip-module", "add-module", "rename", "convert", "retag"):
        assert name in out
    for name in ("strip-module", "add-module", "rename", "convert", "retag"):
        text = invoke(name, "--help").stdout
        for option in ("--select", "--force", "--in-place", "--verify", "--allow-global"):
            assert option in text
        assert "--json" in text and "--quiet" in text


def test_strip_module_human_output_names_the_wrappers(invoke, layout, tmp_path):
    src, _, _ = layout("stacked")
    out = tmp_path / "bare.pt"
    text = invoke("strip-module", src, out).stdout
    lines = text.splitlines()
    assert lines[0] == f"stripped 'module.', '_orig_mod.': wrote {out} (11 of 11 keys renamed)"
    assert lines[1] == "  module._orig_mod.embed.weight -> embed.weight"
    assert lines[4] == "  ... and 8 more"
    assert lines[-1].startswith("torch-zip, ") and "verified: 11 tensors, keys and sizes" in text
    assert list(h.load(out)) == list(h.make_model().state_dict())


def test_strip_module_json(invoke, layout, tmp_path):
    src, _, _ = layout("trainer")
    out = tmp_path / "bare.pt"
    data = json.loads(invoke("strip-module", src, out, "--json", "--verify", "full").stdout)
    assert set(data) == JSON_FIELDS
    assert data["src"] == str(src) and data["dst"] == str(out) and data["written"] == [str(out)]
    assert (data["input_format"], data["output_format"]) == ("torch-zip", "torch-zip")
    assert data["selected"] == ["model"]
    assert data["rules"] == ["strip 'module.'"]
    assert (data["renamed"], data["total_keys"]) == (11, 11)
    assert data["examples"][0] == ["module.embed.weight", "embed.weight"]
    assert data["wrappers"] == [
        {
            "prefix": "module.",
            "kind": "nn.DataParallel / DistributedDataParallel",
            "count": 11,
            "of": 11,
            "inner": False,
        }
    ]
    # The whole file is copied (optimizer state too), tensor bytes only.
    assert data["bytes_copied"] == data["bytes_written"] == unique_storage_bytes(h.load(src))
    assert data["dry_run"] is False and data["notes"] == []
    assert data["verification"] == "verified: 11 tensors, keys, sizes and bytes"
    assert data["dropped"] == [] and data["device_map"] == {}
    assert data["message"].startswith("stripped 'module.': wrote")
    got = h.load(out)
    assert list(got["model"]) == list(h.make_model().state_dict())
    h.assert_bitwise_equal(h.load(src)["optimizer"], got["optimizer"])


def test_strip_module_with_nothing_to_strip_writes_nothing(invoke, tmp_path):
    src = h.save(h.make_model().state_dict(), tmp_path / "plain.pt")
    out = tmp_path / "out.pt"
    text = invoke("strip-module", src, out).stdout
    assert text.startswith("nothing to strip: no wrapper prefix in the 11 keys")
    assert f"{out} was not written" in text
    data = json.loads(invoke("strip-module", src, out, "--json").stdout)
    assert data["written"] == [] and data["dst"] == str(out) and data["renamed"] == 0
    assert data["wrappers"] == [] and data["total_keys"] == 11
    assert not out.exists() and h.listing(tmp_path) == ["plain.pt"]


def test_strip_module_explicit_prefix_and_inner_segments(invoke, tmp_path):
    w = torch.ones(2)
    sd = {
        "_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module.fc.weight": w,
        "_fsdp_wrapped_module.blocks.1._checkpoint_wrapped_module.fc.weight": w * 2,
        "_fsdp_wrapped_module.head.weight": w * 3,
    }
    src = h.save(sd, tmp_path / "fsdp.pt")
    data = json.loads(invoke("strip-module", src, tmp_path / "a.pt", "--json").stdout)
    assert [w["prefix"] for w in data["wrappers"]] == [
        "_fsdp_wrapped_module.",
        "_checkpoint_wrapped_module.",
    ]
    assert data["rules"] == [
        "strip '_fsdp_wrapped_module.'",
        "strip '_checkpoint_wrapped_module.' everywhere",
    ]
    bare = ["blocks.0.fc.weight", "blocks.1.fc.weight", "head.weight"]
    assert list(h.load(tmp_path / "a.pt")) == bare
    text = invoke(
        "strip-module", src, tmp_path / "b.pt", "--prefix", "_fsdp_wrapped_module."
    ).stdout
    assert text.startswith(f"wrote {tmp_path / 'b.pt'} (3 of 3 keys renamed)")
    assert next(iter(h.load(tmp_path / "b.pt"))) == (
        "blocks.0._checkpoint_wrapped_module.fc.weight"
    )


def test_add_module_json_and_custom_prefix(invoke, tmp_path):
    model = h.make_model()
    src = h.save(model.state_dict(), tmp_path / "plain.pt")
    data = json.loads(invoke("add-module", src, tmp_path / "dp.pt", "--json").stdout)
    assert set(data) == JSON_FIELDS
    assert data["rules"] == ["add 'module.'"] and data["renamed"] == 11
    assert data["wrappers"] == [] and data["examples"][0] == ["embed.weight", "module.embed.weight"]
    h.data_parallel(h.make_model(1)).load_state_dict(h.load(tmp_path / "dp.pt"))

    text = invoke("add-module", src, tmp_path / "c.pt", "--prefix", "_orig_mod.").stdout
    assert text.startswith(f"wrote {tmp_path / 'c.pt'} (11 of 11 keys renamed)")
    h.Compiled(h.make_model(1)).load_state_dict(h.load(tmp_path / "c.pt"), strict=True)


def test_rename_with_subs_and_regexes(invoke, tmp_path):
    sd = {
        "backbone.layers.0.weight": torch.ones(1),
        "backbone.layers.1.weight": torch.ones(2),
        "head.weight": torch.ones(3),
    }
    src = h.save({"state_dict": sd, "epoch": 9}, tmp_path / "in.pt")
    out = tmp_path / "out.pt"
    result = invoke(
        "rename",
        src,
        out,
        "--sub",
        "backbone.=encoder.",
        "--sub",
        "head.=decoder.",
        "--regex",
        r"layers\.(\d+)=blocks.\1",
        "--json",
    )
    data = json.loads(result.stdout)
    assert data["rules"] == [
        "'backbone.' -> 'encoder.'",
        "'head.' -> 'decoder.'",
        r"s/layers\.(\d+)/blocks.\1/",
    ]
    assert data["selected"] == ["state_dict"] and data["renamed"] == 3
    got = h.load(out)
    renamed = ["encoder.blocks.0.weight", "encoder.blocks.1.weight", "decoder.weight"]
    assert list(got["state_dict"]) == renamed
    assert got["epoch"] == 9


def test_rename_applies_subs_and_regexes_in_the_order_given(invoke, tmp_path):
    # As the library applies its rules: each to the keys the ones before it made.
    src = h.save({"blocks.0.w": torch.zeros(1), "head.w": torch.ones(2)}, tmp_path / "m.pt")
    invoke("rename", src, tmp_path / "a.pt", "--regex", r"^blocks\.0\.=stem.", "--sub",
           "stem.=encoder.stem.")  # fmt: skip
    assert list(h.load(tmp_path / "a.pt")) == ["encoder.stem.w", "head.w"]
    invoke("rename", src, tmp_path / "b.pt", "--regex", r"^head\.=blocks.head.", "--sub",
           "blocks.=encoder.", "--regex", r"\.w$=.weight")  # fmt: skip
    assert list(h.load(tmp_path / "b.pt")) == ["encoder.0.weight", "encoder.head.weight"]
    result = invoke("rename", src, tmp_path / "c.pt", "--regex", r"^head\.=h.", "--sub",
                    "blocks.=b.", "--dry-run", "--json")  # fmt: skip
    assert json.loads(result.stdout)["rules"] == [r"s/^head\./h./", "'blocks.' -> 'b.'"]


def test_select_picks_a_nested_state_dict(invoke, tmp_path):
    w = torch.arange(4.0)
    src = h.save(
        {"model": {"module.w": w}, "ema": {"module.w": w * 2}, "step": 5}, tmp_path / "in.pt"
    )
    data = json.loads(
        invoke("strip-module", src, tmp_path / "o.pt", "--select", "ema", "--json").stdout
    )
    assert data["selected"] == ["ema"]
    got = h.load(tmp_path / "o.pt")
    assert list(got["ema"]) == ["w"] and list(got["model"]) == ["module.w"]
    assert torch.equal(got["ema"]["w"], w * 2)


def test_convert_json_and_format_option(invoke, tmp_path):
    sd = {"a": torch.randn(3, 4), "b": torch.randn(4, 3).t()}
    sd["tied"] = sd["a"]
    src = h.save(sd, tmp_path / "in.pt")
    # A safetensors file under a torch name is refused, with the name that fits; nothing written.
    _, _, err = invoke("convert", src, tmp_path / "weights.bin", "--format", "safetensors", code=2)
    assert "is named as a torch file" in err and repr(str(tmp_path / "weights.safetensors")) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]
    out = tmp_path / "weights"  # no suffix to say a format: --format decides
    data = json.loads(
        invoke("convert", src, out, "--format", "safetensors", "--json", "--verify", "full").stdout
    )
    assert (data["input_format"], data["output_format"]) == ("torch-zip", "safetensors")
    assert data["dropped"] == ["tied"] and data["renamed"] == 0 and data["rules"] == []
    # "a" copied as it lies; the transposed view "b" gathered row by row ("tied" is "a")
    assert (data["bytes_written"], data["bytes_copied"]) == (4 * (12 + 12), 4 * 12)
    tie = {"ckpt_tools.tied": '{"tied":"a"}'}
    assert h.safetensors_metadata(out) == {"format": "pt", "tied": "a", **tie}

    text = invoke("convert", out, tmp_path / "back.pt").stdout
    assert text.startswith(f"converted safetensors to torch-zip: wrote {tmp_path / 'back.pt'}")
    back = h.load(tmp_path / "back.pt")
    h.assert_values_bitwise(sd["b"], back["b"], "b")


@pytest.mark.parametrize(
    ("name", "fmt", "fits"),
    [("x.safetensors", "torch", "x.pt"), ("x.pt", "safetensors", "x.safetensors")],
)
def test_convert_refuses_a_format_its_output_name_contradicts(invoke, tmp_path, name, fmt, fits):
    # torch.load refuses a torch zip named .safetensors by path, and a safetensors file under a
    # torch name is read as neither: the name that fits is suggested, and nothing is written.
    src = h.save({"w": torch.ones(2)}, tmp_path / "in.pt")
    _, _, err = invoke("convert", src, tmp_path / name, "--format", fmt, code=2)
    assert f"--format '{fmt}'" in err and f"name it {str(tmp_path / fits)!r}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]
    invoke("convert", src, tmp_path / fits, "--format", fmt)  # the suggested name works
    assert h.load(tmp_path / fits)["w"].tolist() == [1.0, 1.0]


def test_convert_drop_extras(invoke, layout, tmp_path):
    src, _, _ = layout("model_state_dict")
    out = tmp_path / "o.safetensors"
    text = invoke("convert", src, out, "--drop-extras").stdout
    assert "left out: epoch, module.head.weight" in text
    assert h.safetensors_metadata(out) == {
        "format": "pt",
        "module.head.weight": "module.embed.weight",
        "ckpt_tools.tied": '{"module.head.weight":"module.embed.weight"}',
    }


def test_retag_json_and_human_output(invoke, tmp_path):
    src = h.save(h.offset_views(), tmp_path / "in.pt")
    data = json.loads(
        invoke("retag", src, tmp_path / "gpu.pt", "--map", "cpu=cuda:1", "--json").stdout
    )
    assert data["device_map"] == {"cpu": "cuda:1"} and data["renamed"] == 0
    assert data["output_format"] == "torch-zip"
    text = invoke("retag", tmp_path / "gpu.pt", tmp_path / "cpu.pt", "--map", "cuda:1=cpu").stdout
    assert "device tags: cuda:1 -> cpu" in text
    h.assert_bitwise_equal(h.load(src), h.load(tmp_path / "cpu.pt"))
    inspected = json.loads(invoke("inspect", tmp_path / "gpu.pt", "--json").stdout)
    assert {t["device"] for t in inspected["tensors"]} == {"cuda:1"}


def test_force_and_in_place_through_the_runner(invoke, layout, tmp_path):
    src, _, _ = layout("dataparallel")
    out = tmp_path / "o.pt"
    invoke("strip-module", src, out)
    invoke("add-module", out, out, "--in-place", "--verify", "full")
    h.assert_bitwise_equal(h.load(src), h.load(out))
    invoke("strip-module", src, out, "--force", "--quiet")
    assert next(iter(h.load(out))) == "embed.weight"
    assert h.temp_files(tmp_path) == []


def test_the_installed_entry_point(tmp_path):
    src, _, _ = h.save_layout("orig_mod", tmp_path / "c.pt")
    proc = h.run_ckpt("strip-module", src, tmp_path / "o.pt", "--json", how="module")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [w["prefix"] for w in data["wrappers"]] == ["_orig_mod."]
    assert "torch.compile" in data["wrappers"][0]["kind"]
    h.Compiled(h.make_model()).load_state_dict(
        h.load(src), strict=True
    )  # the input itself still loads as it was
    h.make_model(3).load_state_dict(h.load(tmp_path / "o.pt"), strict=True)


def test_the_console_script_refuses_an_existing_output_and_shows_help(tmp_path):
    src = h.fixture_path("dataparallel.pt")
    script = h.console_script()
    first = h.run_ckpt(
        "strip-module", src, "out.pt", "--json", code=None, how="script", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["written"] == ["out.pt"]
    again = h.run_ckpt("strip-module", src, "out.pt", code=None, how="script", cwd=tmp_path)
    assert again.returncode == 6 and "already exists" in again.stderr
    shown = subprocess.run(
        [script, "strip-module", "--help"], capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0 and "Usage: ckpt strip-module" in shown.stdout


# Runs `ckpt ARGV` in the working folder as a user who cannot read other users' 0o200 files.
# As root it first refuses a line (what click's usage errors import loads then), then drops
# to uid/gid 65534 (in /etc/passwd or not): the interpreter, the venv and the checkout,
# wherever they are and whoever may enter them, were read before; the paths are relative,
# so only the working folder must be open to that user.
_AS_ANOTHER_USER = """
import contextlib, io, os, sys
from ckpt_tools.cli.main import main
with contextlib.redirect_stderr(io.StringIO()):
    assert main(["strip-module"]) == 2
if os.geteuid() == 0:
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("case", ["unreadable input", "unreadable output", "unreadable folder"])
def test_a_path_this_user_cannot_read_is_refused_before_anything_is_written(case, tmp_path):
    # click.Path() refuses an existing path this user cannot read: exit 2, nothing written,
    # the existing output untouched.
    tmp_path.chmod(0o777)
    (tmp_path / "in.pt").write_bytes(h.fixture_path("dataparallel.pt").read_bytes())
    dst = "out.pt"
    if case == "unreadable input":
        (tmp_path / "in.pt").chmod(0o200)
    elif case == "unreadable output":
        (tmp_path / dst).write_bytes(b"keep me")
        (tmp_path / dst).chmod(0o222)
    else:
        dst = "sub"
        (tmp_path / dst).mkdir(mode=0o333)
        (tmp_path / dst).chmod(0o333)
    before = h.listing(tmp_path)
    try:
        run = subprocess.run(
            [sys.executable, "-c", _AS_ANOTHER_USER, "strip-module", "in.pt", dst, "--force"],
            capture_output=True,
            text=True,
            env=h.ckpt_env(),
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert run.returncode == 2, run.stderr
        assert "is not readable" in run.stderr
        assert h.listing(tmp_path) == before
    finally:
        for path in tmp_path.iterdir():
            path.chmod(0o700)
    if case == "unreadable output":
        assert (tmp_path / dst).read_bytes() == b"keep me"


@pytest.mark.parametrize(
    ("regex", "key", "renamed"),
    [
        (r"(?<\=\.)gamma=weight", "ln.gamma", "ln.weight"),  # a lookbehind
        (r"(?P<n>a)(?P\=n)=x", "aa.w", "x.w"),  # a named back-reference
        (r"^k\=1\.=k1.", "k=1.w", "k1.w"),  # a literal '=' in a key
        (r"^a\\=b", "a\\.w", "b.w"),  # an escaped backslash, then the '=' that splits
        (r"^x=y=", "x.w", "y=.w"),  # REPL is taken as it is, '=' included
        (r"layers\.(\d+)=blocks.\1", "layers.0.w", "blocks.0.w"),  # the common form, unchanged
    ],
)
def test_rename_regex_writes_an_equals_sign_inside_the_pattern_as_escaped(
    invoke, tmp_path, regex, key, renamed
):
    src = h.save({key: torch.ones(2), "other": torch.zeros(1)}, tmp_path / "in.pt")
    out = tmp_path / "out.pt"
    invoke("rename", src, out, "--regex", regex)
    got = torch.load(out, weights_only=True)
    assert list(got) == [renamed, "other"] and torch.equal(got[renamed], torch.ones(2))


def test_rename_help_says_how_to_write_an_equals_sign_in_a_pattern(invoke):
    text = " ".join(invoke("rename", "--help").stdout.split())
    assert r"write an '=' inside it as '\='" in text and r"--regex '(?<\=\.)gamma=weight'" in text


def test_a_tensor_dict_beside_the_chosen_one_is_named_as_not_renamed(invoke, tmp_path):
    # A GAN's two DataParallel state dicts: the larger is chosen, the other keeps module.
    gen = {f"module.{i}.weight": torch.ones(4, 4) for i in range(2)}
    src = h.save(
        {"generator": gen, "discriminator": {"module.w": torch.ones(1)}}, tmp_path / "g.pt"
    )
    out = invoke("strip-module", src, tmp_path / "plain.pt").stdout
    assert "note: not renamed: 'discriminator', a tensor dict beside the chosen one" in out
    data = json.loads(invoke("strip-module", src, tmp_path / "p2.pt", "--json").stdout)
    assert [n for n in data["notes"] if "discriminator" in n]
    assert list(h.load(tmp_path / "plain.pt")["discriminator"]) == ["module.w"]
    # An EMA beside the state dict: chosen by its name, the other is named too.
    sd = {"module.fc.weight": torch.ones(2, 2)}
    timm = h.save({"state_dict": sd, "state_dict_ema": dict(sd), "epoch": 3}, tmp_path / "t.pt")
    out = invoke("strip-module", timm, tmp_path / "t2.pt").stdout
    assert "not renamed: 'state_dict_ema'" in out
    # A dict beside whose keys the rules would not change is no news.
    plain = h.save({"state_dict": sd, "ema": {"fc.weight": torch.ones(2, 2)}}, tmp_path / "p.pt")
    assert "not renamed" not in invoke("strip-module", plain, tmp_path / "q.pt").stdout


def test_safetensors_names_a_tensor_dict_beside_the_chosen_one_as_such(invoke, tmp_path):
    both = {"generator": {"w": torch.ones(4, 4), "b": torch.ones(4)}, "discriminator": {
        "w": torch.zeros(3, 3), "b": torch.zeros(3)}}  # fmt: skip
    src = h.save(both, tmp_path / "gan.pt")
    err = invoke("convert", src, tmp_path / "g.safetensors", code=7).stderr
    assert "1 tensor dict beside the chosen one: discriminator" in err
    assert "non-tensor" not in err and "--drop-extras" in err
    chosen = ("--select", "discriminator", "--drop-extras")
    invoke("convert", src, tmp_path / "d.safetensors", *chosen)
    assert torch.equal(load_file(tmp_path / "d.safetensors")["w"], torch.zeros(3, 3))

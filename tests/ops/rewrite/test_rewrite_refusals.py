"""Every refusal of the rewrite commands: its exit code, its message, and no side effects.

Each refusal is checked through ``ckpt_tools.cli.main.main`` (the real exit-code boundary):
the input's sha256, mtime and inode never change, and nothing (no output, no temp file) is
left in the output folder.
"""

from __future__ import annotations

import collections
import os
import pickle
import shlex
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import safetensors.torch
import torch

from ckpt_tools.errors import (
    KeyCollisionError,
    NonTensorEntriesError,
    OutputExistsError,
    SameFileError,
    UnsafeContentError,
    UsageError,
)
from ckpt_tools.ops.rewrite.conversion import convert
from ckpt_tools.ops.rewrite.rewriting import add_module, rename, strip_module
from ckpt_tools.structure.keys import regex_rule, sub_rule
from tests import helpers as h


@pytest.fixture
def ddp_file(tmp_path):
    """Factory: a small DataParallel-style checkpoint in its own folder."""

    def make(name: str = "ddp.pt", obj=None) -> Path:
        folder = tmp_path / "in"
        folder.mkdir(exist_ok=True)
        obj = obj if obj is not None else h.build_layout("plain")[0]
        return h.save(obj, folder / name)

    return make


COMMANDS = {
    "strip-module": [],
    "add-module": [],
    "rename": ["--sub", "module.=net."],
    "convert": [],
    "retag": ["--map", "cpu=cuda:0"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_existing_output_is_refused_without_force(command, ddp_file, out_dir, capsys):
    src = ddp_file()
    dst = out_dir / "taken.pt"
    dst.write_bytes(b"precious")
    before_src, before_dst = h.fingerprint(src), h.fingerprint(dst)

    code, _, err = h.run_ckpt(command, src, dst, *COMMANDS[command], code=None)
    assert code == 6
    assert "already exists" in err and "--force" in err
    assert h.fingerprint(src) == before_src and h.fingerprint(dst) == before_dst
    assert h.listing(out_dir) == ["taken.pt"]

    code, _, err = h.run_ckpt(command, src, dst, *COMMANDS[command], "--force", code=None)
    assert code == 0, err
    assert dst.read_bytes() != b"precious"
    assert h.fingerprint(src) == before_src
    assert h.listing(out_dir) == ["taken.pt"]


@pytest.mark.parametrize("how", ["same path", "hard link", "symlink", "relative path"])
@pytest.mark.parametrize("command", ["strip-module", "convert"])
def test_output_that_is_the_input_is_refused(how, command, ddp_file, capsys, monkeypatch):
    src = ddp_file()
    folder = src.parent
    if how == "same path":
        dst = src
    elif how == "hard link":
        dst = folder / "hard.pt"
        os.link(src, dst)
    elif how == "symlink":
        dst = folder / "soft.pt"
        dst.symlink_to(src)
    else:
        monkeypatch.chdir(folder)
        dst = Path("..") / folder.name / src.name
    names = h.listing(folder)
    before = h.fingerprint(src)

    for extra in ([], ["--force"]):  # --force never allows writing over the input
        code, _, err = h.run_ckpt(command, src, dst, *extra, code=None)
        assert code == 6
        assert "is the input file" in err and "--in-place" in err
        assert h.fingerprint(src) == before
        assert h.listing(folder) == names
    if how == "symlink":
        assert dst.is_symlink() and dst.resolve() == src.resolve()


@pytest.mark.parametrize("via_symlink", [False, True])
def test_in_place_rewrites_through_a_temp_file(via_symlink, ddp_file, capsys):
    src = ddp_file()
    dst = src
    if via_symlink:
        dst = src.parent / "link.pt"
        dst.symlink_to(src.name)
    names = h.listing(src.parent)
    original = h.load(src)
    inode = os.stat(src).st_ino

    code, out, err = h.run_ckpt(
        "strip-module", src, dst, "--in-place", "--verify", "full", code=None
    )
    assert code == 0, err
    assert "stripped 'module.'" in out
    got = h.load(src)
    assert list(got) == [k.removeprefix("module.") for k in original]
    for k in original:
        h.assert_tensor_bitwise(original[k], got[k.removeprefix("module.")], k)
    assert os.stat(src).st_ino != inode  # replaced by rename, never written in place
    assert h.listing(src.parent) == names  # no temp file left, the link kept
    assert h.temp_files(src.parent) == []
    if via_symlink:
        assert dst.is_symlink() and dst.resolve() == src.resolve()


def test_collision_is_refused_naming_both_keys(ddp_file, out_dir, capsys):
    src = ddp_file(obj={"module.w": torch.ones(2), "w": torch.zeros(2), "b": torch.ones(1)})
    before = h.fingerprint(src)
    code, _, err = h.run_ckpt(
        "strip-module", src, out_dir / "out.pt", "--prefix", "module.", code=None
    )
    assert code == 7
    assert "'module.w' and 'w' -> 'w'" in err
    assert h.fingerprint(src) == before and h.listing(out_dir) == []

    with pytest.raises(KeyCollisionError, match=r"'module\.w' and 'w'") as info:
        strip_module(src, out_dir / "out.pt", prefix="module.")
    assert info.value.collisions == (("w", ("module.w", "w")),)
    with pytest.raises(KeyCollisionError, match=r"'a\.x' and 'b\.x' -> 'c\.x'"):
        rename(
            ddp_file("ab.pt", {"a.x": torch.ones(1), "b.x": torch.ones(1)}),
            out_dir / "out.pt",
            rules=[sub_rule("a.", "c."), sub_rule("b.", "c.")],
        )
    assert h.listing(out_dir) == []


def test_non_tensor_entries_to_safetensors_are_refused_and_listed(ddp_file, out_dir, capsys):
    obj, _, _ = h.build_layout("trainer")
    obj["model"]["module.note"] = "extra state"  # a non-tensor entry inside the state dict
    src = ddp_file("trainer.pt", obj)
    before = h.fingerprint(src)
    dst = out_dir / "w.safetensors"

    code, _, err = h.run_ckpt("convert", src, dst, code=None)
    assert code == 7
    for name in ("module.note", "optimizer", "scheduler", "epoch"):
        assert name in err
    assert "--drop-extras" in err
    assert h.fingerprint(src) == before and h.listing(out_dir) == []
    with pytest.raises(NonTensorEntriesError, match="4 non-tensor entries") as info:
        convert(src, dst)
    assert info.value.entries == ("module.note", "optimizer", "scheduler", "epoch")

    code, out, err = h.run_ckpt("convert", src, dst, "--drop-extras", "--verify", "full", code=None)
    assert code == 0, err
    assert "left out: module.note, optimizer, scheduler, epoch, module.head.weight" in out
    st = h.load(dst)
    assert "module.note" not in st and "module.head.weight" not in st
    for k, v in obj["model"].items():
        if isinstance(v, torch.Tensor) and k != "module.head.weight":
            h.assert_values_bitwise(v, st[k], k)
    assert h.fingerprint(src) == before


class Evil:
    """Pickles as a call of ``os.system`` (``posix.system``): must never run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _stub_pickle_module() -> types.ModuleType:
    """A pickle module for torch.load whose ``posix.system`` only records its arguments."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("posix", "system"):
                return lambda *args: ("posix.system", args)
            return super().find_class(module, name)

    module = types.ModuleType("stub_pickle")
    module.Unpickler = Unpickler
    module.load = pickle.load
    return module


_SHELL_NAMED = """
import sys, torch
name = "Evil;touch${IFS}pwned;#"
cls = type("Evil", (), {})
cls.__qualname__ = name
setattr(sys.modules["__main__"], name, cls)
torch.save({"w": torch.ones(2), "cfg": cls()}, sys.argv[1])
"""


def test_the_allow_global_flag_suggested_is_one_shell_word(tmp_path: Path) -> None:
    # A global's name comes from the file: pasted unquoted, it would run what it spells.
    src = tmp_path / "evil.pt"
    subprocess.run([sys.executable, "-c", _SHELL_NAMED, str(src)], check=True)
    err = h.run_ckpt("convert", src, tmp_path / "o.safetensors", code=3).stderr
    flag = err.split("pass ", 1)[1].split(" to carry", 1)[0]
    assert flag == "--allow-global '__main__.Evil;touch${IFS}pwned;#'", err
    assert shlex.split(flag) == ["--allow-global", "__main__.Evil;touch${IFS}pwned;#"]
    h.run_ckpt("convert", src, tmp_path / "o.pt", *shlex.split(flag))
    assert not (tmp_path / "pwned").exists()


def test_unsafe_global_is_refused_then_carried_through_byte_faithfully(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    sd = h.build_layout("plain")[0]
    src = h.save({"state_dict": sd, "callback": Evil(marker), "epoch": 2}, tmp_path / "evil.pt")
    assert "posix.system" in h.pickle_globals(h.read_data_pkl(src))
    before = h.fingerprint(src)
    out = tmp_path / "out.pt"

    for command in ("strip-module", "convert", "rename --sub module.=m."):
        code, _, err = h.run_ckpt(*command.split(), src, out, code=None)
        assert code == 3
        assert "posix.system" in err and "--allow-global posix.system" in err
        assert not out.exists() and h.temp_files(tmp_path) == []
    with pytest.raises(UnsafeContentError, match=r"posix\.system") as info:
        strip_module(src, out)
    assert info.value.globals == ("posix.system",)

    code, stdout, err = h.run_ckpt(
        "strip-module", src, out, "--allow-global", "posix.system", "--verify", "full", code=None
    )
    assert code == 0, err
    payload = h.read_data_pkl(out)
    assert "posix.system" in h.pickle_globals(payload)
    assert f"touch {marker}".encode() in payload
    code, stdout, _ = h.run_ckpt("inspect", out, code=None)
    assert code == 0 and "posix.system" in stdout
    code, stdout, _ = h.run_ckpt("inspect", out, "--json", code=None)
    assert code == 0 and '"posix.system"' in stdout

    stub = _stub_pickle_module()
    original = torch.load(src, weights_only=False, pickle_module=stub)
    rewritten = torch.load(out, weights_only=False, pickle_module=stub)
    assert rewritten["callback"] == original["callback"] == ("posix.system", (f"touch {marker}",))
    assert rewritten["epoch"] == 2
    for k, v in original["state_dict"].items():
        h.assert_tensor_bitwise(v, rewritten["state_dict"][k.removeprefix("module.")], k)
    # A rewrite that renames nothing reproduces every record, data.pkl included, byte for byte.
    same = tmp_path / "same.pt"
    code, _, err = h.run_ckpt("convert", src, same, "--allow-global", "posix.system", code=None)
    assert code == 0, err
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(same) as b:
        assert [(i.filename, a.read(i)) for i in a.infolist()] == [
            (i.filename, b.read(i)) for i in b.infolist()
        ]
    assert not marker.exists()
    assert h.fingerprint(src) == before


def test_unsafe_global_in_a_fresh_process(tmp_path):
    marker = tmp_path / "MARKER"
    src = h.save({"w": torch.ones(2), "cb": Evil(marker)}, tmp_path / "evil.pt")
    proc = h.run_ckpt("convert", src, tmp_path / "o.pt", how="module", cwd=tmp_path, code=None)
    assert proc.returncode == 3, proc.stderr
    assert "posix.system" in proc.stderr
    assert not marker.exists() and not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rename"], "pass --sub OLD=NEW, or pass --regex PATTERN=REPLACEMENT"),
        (["rename", "--regex", "(unclosed=x"], "not a valid regular expression"),
        (["rename", "--regex", "[z-a]=x"], "not a valid regular expression"),
        (["rename", "--sub", "noequals"], "expected OLD=NEW"),
        (["rename", "--sub", "=new."], "expected OLD=NEW"),
        (["rename", "--regex", r"conv=\9"], r"rule s/conv/\9/ cannot be applied: invalid group"),
        (["rename", "--regex", r"conv=\g<x>"], "cannot be applied: unknown group name 'x'"),
        (["rename", "--regex", "noequals"], "expected PATTERN=REPLACEMENT"),
        (["rename", "--regex", "=new."], r"(an '=' inside PATTERN is written '\=')"),
        (["rename", "--regex", r"(?<=\.)w=v"], r"pass --regex '(?<\=\.)w=v' (the pattern ends"),
        (["add-module", "--prefix", "module"], "pass --prefix module."),
        (["strip-module", "--prefix", "module"], "pass --prefix module."),
        (["retag", "--map", "cpu=gpu7"], "is not one torch restores"),
        # Tags torch.device refuses, which plain torch.load could not read back.
        (["retag", "--map", "cpu=cuda:"], "is not one torch restores"),
        (["retag", "--map", "cpu=cuda:01"], "is not one torch restores"),
        # torch keeps a device index in 8 bits: cuda:128 reads back as cuda:-128.
        (["retag", "--map", "cpu=cuda:128"], "is not one torch restores"),
        (["retag", "--map", "cpu=cuda:99999999999999999999"], "is not one torch restores"),
        (["retag", "--map", "cpu=cuda:\u00b2"], "is not one torch restores"),
        (["retag", "--map", "cpu=cpu:0"], "is not one torch restores"),
        (["retag", "--map", "cpu=cuda:1", "--map", "cpu=meta"], "--map maps cpu twice"),
        (["convert", "--verify", "bogus"], "bogus"),
        (["strip-module", "--select", "nope"], "no entry 'nope'"),
    ],
)
def test_usage_errors_exit_2(args, message, ddp_file, out_dir, capsys):
    src = ddp_file()
    before = h.fingerprint(src)
    command, *options = args
    code, _, err = h.run_ckpt(command, src, out_dir / "out.pt", *options, code=None)
    assert code == 2
    assert message in err
    assert h.fingerprint(src) == before and h.listing(out_dir) == []


def test_usage_errors_from_the_api(ddp_file, out_dir):
    src = ddp_file()
    with pytest.raises(UsageError, match=r"at least one rename rule; pass rules=\[sub_rule\('OLD'"):
        rename(src, out_dir / "o.pt", rules=[])
    with pytest.raises(UsageError, match=r"pattern='\(x': not a valid regular expression"):
        rename(src, out_dir / "o.pt", rules=[regex_rule("(x", "y")])
    other = src.parent / "other.pt"
    other.write_bytes(b"x")
    with pytest.raises(OutputExistsError, match="already exists"):
        strip_module(src, other)
    assert other.read_bytes() == b"x"
    with pytest.raises(SameFileError, match="is the input file"):
        convert(src, src)
    assert h.listing(out_dir) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing-forced"])
def test_retag_to_safetensors_is_refused_not_written_as_a_torch_zip(tmp_path, out_dir, existing):
    # Written, the tags would go into a torch zip named .safetensors, which safetensors
    # refuses to open ("header too large").
    src = tmp_path / "in.safetensors"
    safetensors.torch.save_file({"w": torch.ones(2)}, str(src))
    dst = out_dir / "out.safetensors"
    if existing:
        dst.write_bytes(b"old")
    code, _, err = h.run_ckpt("retag", src, dst, "--map", "cpu=cuda:1", "--force", code=None)
    assert code == 2 and "only torch files hold" in err and "out.pt" in err
    assert (dst.read_bytes() == b"old") if existing else not dst.exists()
    h.run_ckpt("retag", src, out_dir / "out.pt", "--map", "cpu=cuda:1")
    assert torch.load(out_dir / "out.pt", map_location="cpu", weights_only=True)["w"].tolist() == [
        1.0,
        1.0,
    ]


def test_missing_input_exits_2(out_dir, capsys):
    code, _, err = h.run_ckpt("strip-module", out_dir / "nope.pt", out_dir / "o.pt", code=None)
    assert code == 2 and "no such file" in err
    assert h.listing(out_dir) == []


def _corruptions(good: bytes) -> dict[str, bytes]:
    return {
        "truncated": good[: len(good) // 2],
        "garbage": b"this is not a checkpoint at all\n" * 4,
        "empty": b"",
        "bad pickle": good.replace(b"data.pkl", b"data.pkx", 1),
    }


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "bad pickle"])
@pytest.mark.parametrize("command", ["strip-module", "convert", "add-module"])
def test_corrupt_input_exits_4(kind, command, ddp_file, out_dir, capsys):
    good = ddp_file().read_bytes()
    src = ddp_file(f"{kind.replace(' ', '_')}.pt")
    src.write_bytes(_corruptions(good)[kind])
    before = h.fingerprint(src)
    code, _, err = h.run_ckpt(command, src, out_dir / "out.pt", code=None)
    assert code == 4, err
    assert err.startswith("ckpt: error: ") and "Traceback" not in err
    assert h.fingerprint(src) == before and h.listing(out_dir) == []


def test_corrupt_safetensors_exits_4(tmp_path, out_dir, capsys):
    from safetensors.torch import save_file

    src = tmp_path / "bad.safetensors"
    save_file({"module.w": torch.ones(4)}, str(src))
    src.write_bytes(src.read_bytes()[:-4])  # a tensor's bytes are cut off
    code, _, err = h.run_ckpt("strip-module", src, out_dir / "out.safetensors", code=None)
    assert code == 4 and "module.w" in err
    assert h.listing(out_dir) == []


def test_read_only_input_is_only_read(tmp_path, capsys):
    src = h.save(collections.OrderedDict(module_w=torch.ones(2)), tmp_path / "x.pt")
    os.chmod(src, 0o444)
    before = h.fingerprint(src)
    code, _, err = h.run_ckpt("rename", src, tmp_path / "y.pt", "--sub", "module_=m_", code=None)
    assert code == 0, err
    assert h.fingerprint(src) == before
    assert list(h.load(tmp_path / "y.pt")) == ["m_w"]


@pytest.mark.parametrize("name", ["rewrite", "strip_module", "sanitize", "reshard"])
def test_an_unknown_verify_level_is_refused_before_the_input_is_read(name, tmp_path):
    import ckpt_tools

    call = getattr(ckpt_tools, name)
    # Never opened: the argument check comes first. (reshard first asks whether its input
    # is a folder, which reads nothing: an empty one is given.)
    src = tmp_path / "missing.pt"
    if name == "reshard":
        (src := tmp_path / "shards").mkdir()
    with pytest.raises(UsageError, match=r"verify='fast': expected one of: sizes, full, none"):
        call(src, tmp_path / "out.pt", verify="fast")
    assert sorted(os.listdir(tmp_path)) == (["shards"] if name == "reshard" else [])


def test_slim_names_why_it_offers_its_levels(ddp_file, tmp_path):
    import ckpt_tools

    with pytest.raises(UsageError, match=r"verify='bits': .*cast and averaged bytes differ"):
        ckpt_tools.slim(ddp_file(), tmp_path / "out.pt", dtype="float16", verify="bits")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("wrapped", [True, False], ids=["something-to-strip", "nothing-to-strip"])
@pytest.mark.parametrize("how", [[], ["--prefix", "module."]], ids=["detected", "prefix"])
def test_strip_module_orders_its_refusals_as_every_rewrite_does(wrapped, how, tmp_path, capsys):
    # The output path first (exit 6), then the input's content (exit 3), whether strip-module
    # detects its prefixes or is given one, and whether or not there is anything to strip.
    sd = h.build_layout("plain")[0]
    if not wrapped:
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
    marker = tmp_path / "MARKER"
    src = h.save({"state_dict": sd, "callback": Evil(marker)}, tmp_path / "evil.pt")
    out = tmp_path / "out.pt"
    out.write_bytes(b"already here")

    code, _, err = h.run_ckpt("strip-module", src, out, *how, code=None)
    assert code == 6 and "already exists" in err, err
    code, _, err = h.run_ckpt("strip-module", src, src, *how, code=None)
    assert code == 6, err  # the input itself as the output: refused before it is read
    out.unlink()
    code, _, err = h.run_ckpt("strip-module", src, out, *how, code=None)
    assert code == 3 and "posix.system" in err, err
    assert not out.exists() and not marker.exists()


def test_strip_module_reads_its_input_as_often_as_an_explicit_prefix(tmp_path):
    # Detecting the prefixes costs no second pass over the input (its small records are
    # CRC-checked once, by the rewrite): count the opens of the input, by an audit hook.
    src = h.save(h.build_layout("plain")[0], tmp_path / "ddp.pt")
    code = (
        "import os, sys\n"
        "from ckpt_tools.ops.rewrite.rewriting import strip_module\n"
        "src, out = os.path.abspath(sys.argv[1]), sys.argv[2]\n"
        "opens = []\n"
        "sys.addaudithook(lambda e, a: opens.append(1) if e == 'open' and isinstance(a[0], str)"
        " and os.path.abspath(a[0]) == src else None)\n"
        "for prefix in ('module.', None):\n"
        "    opens.clear()\n"
        "    strip_module(src, out, prefix=prefix, force=True)\n"
        "    print(len(opens))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(src), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    given, detected = (int(n) for n in run.stdout.split())
    assert given >= 3  # detect, read, copy: the hook sees them
    assert detected == given


def test_consolidate_refuses_a_verification_level_before_reading(tmp_path):
    # consolidate offers the levels every writing operation offers, and checks them first.
    import ckpt_tools

    with pytest.raises(UsageError, match=r"verify='fast': expected one of: sizes, full, none$"):
        ckpt_tools.consolidate(tmp_path / "missing", tmp_path / "out.pt", verify="fast")
    assert sorted(os.listdir(tmp_path)) == []


def _saved_locations(path: Path) -> collections.Counter[str]:
    """The saved device tag of every storage, as ``torch.load`` hands them to map_location."""
    seen: collections.Counter[str] = collections.Counter()

    def note(storage, location):
        seen[location] += 1
        return storage

    torch.load(path, map_location=note, weights_only=True)
    return seen


_MIXED = """
import sys, torch
tags = {}
# Tags by storage (as a file saved from two GPUs has them), for this process only.
torch.serialization.register_package(1, lambda s: tags.get(s.data_ptr()), lambda o, l: None)
a, b, c = torch.arange(4.0), torch.ones(2), torch.zeros(3)
for t, tag in ((a, "cuda:0"), (b, "cuda:1")):
    tags[t.untyped_storage().data_ptr()] = tag
torch.save({"a": a, "b": b, "c": c}, sys.argv[1])
"""


def test_retag_refuses_an_entry_that_matches_nothing_while_a_tag_stays_unmapped(
    tmp_path: Path,
) -> None:
    # A typo (cuda:2 for cuda:1) left cuda:1 storages where plain torch.load fails.
    from ckpt_tools import retag

    src = tmp_path / "mixed.pt"
    subprocess.run([sys.executable, "-c", _MIXED, str(src)], check=True)
    assert _saved_locations(src) == {"cuda:0": 1, "cuda:1": 1, "cpu": 1}
    args = ["--map", "cuda:0=cpu", "--map", "cuda:2=cpu"]
    res = h.run_ckpt("retag", src, tmp_path / "out.pt", *args, code=2)
    assert "no storage is saved on cuda:2, and cuda:1 would stay unmapped" in res.stderr
    assert "pass --map cuda:1=cpu in place of cuda:2" in res.stderr
    assert not (tmp_path / "out.pt").exists()
    # The fix it names works; a mapping covering every saved tag passes idle entries over.
    h.run_ckpt("retag", src, tmp_path / "out.pt", "--map", "cuda:0=cpu", "--map", "cuda:1=cpu")
    assert _saved_locations(tmp_path / "out.pt") == {"cpu": 3}
    every = {"cuda:0": "cpu", "cuda:1": "cpu", "cuda:2": "cpu"}
    assert retag(src, tmp_path / "o2.pt", mapping=every).device_map == {
        "cuda:0": "cpu",
        "cuda:1": "cpu",
    }
    # A CPU storage (a GPU run's rng_state) is never unmapped: a swap of two GPUs retags.
    swap = {"cuda:0": "cuda:1", "cuda:1": "cuda:0", "cuda:2": "cuda:0"}
    assert retag(src, tmp_path / "o3.pt", mapping=swap).device_map == {
        "cuda:0": "cuda:1",
        "cuda:1": "cuda:0",
    }
    assert _saved_locations(tmp_path / "o3.pt") == {"cuda:1": 1, "cuda:0": 1, "cpu": 1}


def test_retag_applies_a_chain_whose_idle_entries_target_tags_it_moves(tmp_path: Path) -> None:
    # --map cuda:1=cuda:0 --map cuda:2=cuda:1 --map cuda:3=cuda:2 (a script's shift down):
    # torch.load(map_location=) applies it, and so does retag; cuda:0 stays as it is.
    from ckpt_tools import retag

    src = tmp_path / "mixed.pt"
    subprocess.run([sys.executable, "-c", _MIXED, str(src)], check=True)
    chain = {"cuda:1": "cuda:0", "cuda:2": "cuda:1", "cuda:3": "cuda:2"}
    assert retag(src, tmp_path / "o.pt", mapping=chain).device_map == {"cuda:1": "cuda:0"}
    assert _saved_locations(tmp_path / "o.pt") == {"cuda:0": 2, "cpu": 1}
    # The same shape with other indexes (cuda:0=cuda:1 cuda:2=cuda:0) is a chain as well.
    other = {"cuda:0": "cuda:1", "cuda:2": "cuda:0"}
    assert retag(src, tmp_path / "p.pt", mapping=other).device_map == {"cuda:0": "cuda:1"}
    assert _saved_locations(tmp_path / "p.pt") == {"cuda:1": 2, "cpu": 1}


def test_retag_that_matches_no_storage_is_refused(tmp_path: Path) -> None:
    from ckpt_tools import retag

    torch.save({f"w{i}": torch.ones(2) for i in range(9)}, tmp_path / "plain.pt")
    retag(tmp_path / "plain.pt", tmp_path / "g.pt", mapping={"cpu": "cuda:1"})
    assert _saved_locations(tmp_path / "g.pt") == {"cuda:1": 9}
    res = h.run_ckpt("retag", tmp_path / "g.pt", tmp_path / "g2.pt", "--map", "cuda:0=cpu", code=2)
    assert "no storage is saved on cuda:0 (saved: cuda:1 ×9); pass --map cuda:1=cpu" in res.stderr
    assert not (tmp_path / "g2.pt").exists()
    with pytest.raises(UsageError, match=r"pass mapping=\{'cuda:1': 'cpu'\}"):
        retag(tmp_path / "g.pt", tmp_path / "g2.pt", mapping={"cuda:0": "cpu"}, dry_run=True)
    # Of several mappings, the result reports the one that matched; a dry run says so too.
    both = {"cuda:0": "cpu", "cuda:1": "cpu"}
    planned = retag(tmp_path / "g.pt", tmp_path / "g2.pt", mapping=both, dry_run=True)
    assert planned.device_map == {"cuda:1": "cpu"} and "cuda:1 -> cpu" in planned.message
    assert not (tmp_path / "g2.pt").exists()
    result = retag(tmp_path / "g.pt", tmp_path / "g2.pt", mapping=both)
    assert result.device_map == {"cuda:1": "cpu"} and "cuda:0" not in str(result)
    assert _saved_locations(tmp_path / "g2.pt") == {"cpu": 9}


@pytest.mark.parametrize(
    "args",
    [["strip-module", "--prefix", "modul."], ["rename", "--sub", "modul.=m."]],
    ids=["strip-module --prefix", "rename --sub"],
)
def test_a_rule_that_matches_no_key_is_refused_not_copied(tmp_path, args):
    # A typo in the prefix wrote an unchanged copy and exited 0.
    src = tmp_path / "ddp.pt"
    torch.save({"module.fc.weight": torch.ones(2)}, src)
    command, *options = args
    _, _, err = h.run_ckpt(command, src, tmp_path / "out.pt", *options, code=2)
    assert "matches" in err and "nothing would be renamed" in err and "module." in err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    "rules",
    [
        ["--sub", "module.=", "--sub", "haed.=head."],
        ["--sub", "module.=", "--regex", "^haed\\.=head."],
        ["--sub", "module.=", "--sub", "module.=x."],  # the first renamed every one
    ],
)
def test_a_rule_that_matches_no_key_beside_rules_that_do_is_refused(tmp_path, rules):
    # The typo in the second rule was written as a success, its keys left as they were.
    src = tmp_path / "ddp.pt"
    torch.save({"module.fc.weight": torch.ones(2), "module.head.bias": torch.ones(1)}, src)
    _, _, err = h.run_ckpt("rename", src, tmp_path / "out.pt", *rules, code=2)
    assert "no key of" in err and "the other rules rename 2 of the keys" in err, err
    assert rules[-1].split("=")[0].strip("^\\") in err, err
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("root", ["empty", "nested"])
@pytest.mark.parametrize(
    "args",
    [
        ["strip-module", "--prefix", "module."],
        ["rename", "--sub", "zzz.=y."],
        ["rename", "--regex", "^=y."],
        ["add-module"],
    ],
    ids=["strip-module --prefix", "rename --sub", "rename --regex", "add-module"],
)
def test_a_rule_on_an_empty_state_dict_is_refused_not_copied(tmp_path, root, args):
    # {} and {"state_dict": {}} were written as unchanged copies, exit 0; add-module renamed
    # the nested one's top-level entries ('module.state_dict', 'module.epoch').
    src = tmp_path / "in.pt"
    torch.save({} if root == "empty" else {"state_dict": {}, "epoch": 1}, src)
    command, *options = args
    _, _, err = h.run_ckpt(command, src, tmp_path / "out.pt", *options, code=2)
    where = "at the root" if root == "empty" else "at 'state_dict'"
    assert f"the state dict of {src} ({where}) is empty: no key matches" in err
    assert "nothing would be renamed" in err and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("root", ["empty", "nested"])
def test_strip_module_finds_nothing_to_strip_in_an_empty_state_dict(tmp_path, root):
    src = tmp_path / "in.pt"
    torch.save({} if root == "empty" else {"state_dict": {}, "epoch": 1}, src)
    result = strip_module(src, tmp_path / "out.pt")
    assert result.written == () and result.total_keys == 0
    assert result.selected == (() if root == "empty" else ("state_dict",))
    assert result.message.startswith("nothing to strip: no wrapper prefix in the 0 keys")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("command", ["strip-module", "add-module"])
@pytest.mark.parametrize("prefix", ["module", ""])
def test_a_wrapper_prefix_without_its_dot_is_refused(tmp_path, command, prefix):
    # add-module --prefix module wrote 'moduleweight'; strip-module left '.weight'.
    sd = (
        {"module.weight": torch.ones(2)} if command == "strip-module" else {"weight": torch.ones(2)}
    )
    src = h.save(sd, tmp_path / "in.pt")
    dotted = f"{prefix}." if prefix else "module."
    _, _, err = h.run_ckpt(command, src, tmp_path / "out.pt", "--prefix", prefix, code=2)
    assert "expected a module path ending with '.'" in err and f"pass --prefix {dotted}" in err
    call = strip_module if command == "strip-module" else add_module
    with pytest.raises(UsageError, match=rf"prefix={prefix!r}: .*pass prefix={dotted!r}$"):
        call(src, tmp_path / "out.pt", prefix=prefix)
    assert not (tmp_path / "out.pt").exists()
    # The dotted one works; rename --sub still maps a prefix of any text.
    h.run_ckpt(command, src, tmp_path / "out.pt", "--prefix", "module.")
    want = ["weight"] if command == "strip-module" else ["module.weight"]
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == want
    key = next(iter(sd))
    h.run_ckpt("rename", src, tmp_path / "sub.pt", "--sub", f"{key[:3]}=x")
    assert list(torch.load(tmp_path / "sub.pt", weights_only=True)) == ["x" + key[3:]]


def test_rules_matching_no_key_name_dotless_keys_whole(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1), "enc.b": torch.ones(1)}, tmp_path / "in.pt")
    _, _, err = h.run_ckpt(
        "rename", tmp_path / "in.pt", tmp_path / "out.pt", "--regex", "zzz=y", code=2
    )
    assert "(the keys start with enc., w)" in err

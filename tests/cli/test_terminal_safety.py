"""Names read from a checkpoint reach the terminal escaped, as ``repr`` escapes them.

A tensor key, a global named in a pickle, a record name inside a zip or a file name may hold
escape sequences, carriage returns, NUL, DEL, C1 controls or bidi overrides. The ``ckpt``
console script runs in a fresh process on real files (``torch.save``, safetensors'
``save_file``, a zip and a pickle written by hand), and its output is read as bytes: no
character that is not printable reaches stdout or stderr but the line breaks of the layout,
each name shows as ``repr`` writes it, and ordinary names (accents, CJK) print as they are.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import ckpt_env, console_script

HOSTILE = [
    "\x1b]0;pwned\x07evil",  # OSC: sets the window title
    "a\x1b[2J",  # CSI: clears the screen
    "cr\rret",
    "tab\tbed",
    "rtl\u202eexe.pt",  # a bidi override: the rest reads backwards
    "nul\x00x",
    "del\x7fx",
    "csi\x9b31m",  # C1: a one-byte CSI
    "sep\u2028x",  # a line separator
    "zw\u200bj",  # a zero-width space: hides in the name
]
LINE_BREAK = "line\nbreak"
ORDINARY = ["ñ.weight", "权重", "fc.weight"]


def _escaped(name: str) -> str:
    """How the name must show: as ``repr`` writes it, without the quotes."""
    return repr(name)[1:-1]


def _ckpt(*args: object, code: int) -> tuple[str, str]:
    """Run the console script; its stdout and stderr, decoded from the bytes written."""
    proc = subprocess.run(
        [console_script(), *map(str, args)],
        capture_output=True,  # bytes: text mode would turn a raw "\r" into "\n"
        env=ckpt_env(PYTHONIOENCODING="utf-8"),
        timeout=120,
        check=False,
    )
    out, err = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
    assert proc.returncode == code, f"ckpt {args}: exit {proc.returncode}\n{out}\n{err}"
    return out, err


def _assert_safe(text: str) -> None:
    raw = sorted({c for c in text if not c.isprintable() and c != "\n"})
    assert raw == [], f"raw characters reached the terminal: {raw}\n{text}"


def _tensors(names: list[str]) -> dict[str, torch.Tensor]:
    return {name: torch.full((2,), float(i)) for i, name in enumerate(names)}


@pytest.fixture
def hostile_pt(tmp_path: Path) -> Path:
    path = tmp_path / "hostile.pt"
    torch.save(_tensors([*HOSTILE, LINE_BREAK, *ORDINARY]), path)
    return path


def test_inspect_escapes_keys_in_its_table(hostile_pt: Path, tmp_path: Path) -> None:
    safetensors = tmp_path / "hostile.safetensors"
    save_file(_tensors([*HOSTILE, LINE_BREAK, *ORDINARY]), safetensors)
    for path in (hostile_pt, safetensors):
        out, err = _ckpt("inspect", path, code=0)
        _assert_safe(out + err)
        for name in [*HOSTILE, LINE_BREAK]:
            assert _escaped(name) in out
        for name in ORDINARY:
            assert name in out
        # One row a tensor: the line break in a key stays inside its row.
        rows = out.split("\n\n")[1].splitlines()[2:]
        assert len(rows) == len(HOSTILE) + 1 + len(ORDINARY)


def test_inspect_escapes_a_file_name_and_the_zip_records_named(tmp_path: Path) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    path = folder / "ev\x1b[2Jil\u202e.pt"
    torch.save({"w": torch.zeros(1), "cfg": argparse.Namespace(a=1)}, path)
    out, err = _ckpt("inspect", path, code=0)
    _assert_safe(out + err)
    assert _escaped(str(path)) in out
    out, err = _ckpt("scan", folder, code=0)
    _assert_safe(out + err)
    assert f"nonstandard  {_escaped(str(path))} (torch-zip)" in out


def test_scan_escapes_globals_and_record_names(hostile_pt: Path, tmp_path: Path) -> None:
    # A pickle whose one global is named with escape sequences, a bidi override and C1.
    module, name = "os\x1b]0;pwned\x07", "sys\x9btem\u202e"
    pickled = b"\x80\x04"
    for text in (module, name):
        encoded = text.encode("utf-8")
        pickled += b"\x8c" + bytes([len(encoded)]) + encoded  # SHORT_BINUNICODE
    pickle_path = tmp_path / "global.pkl"
    pickle_path.write_bytes(pickled + b"\x93)R.")  # STACK_GLOBAL, (), REDUCE, STOP
    # A torch zip whose records lie under a folder named with an escape sequence.
    record_root = "ar\x1b[2Jch\u202e"
    saved = io.BytesIO()
    torch.save({"w": torch.zeros(1), "cfg": argparse.Namespace(a=1)}, saved)
    renamed = tmp_path / "records.pt"
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(renamed, "w") as out_zip:
        for info in src.infolist():
            out_zip.writestr(info.filename.replace("archive", record_root, 1), src.read(info))
    assert set(torch.load(renamed, weights_only=False)) == {"w", "cfg"}

    out, err = _ckpt("scan", pickle_path, renamed, hostile_pt, code=1)
    _assert_safe(out + err)
    assert f"dangerous: {_escaped(module)}.{_escaped(name)} in pickle" in out
    assert f"argparse.Namespace in {_escaped(record_root)}/data.pkl" in out


def test_diff_escapes_keys_in_its_table_and_its_key_lists(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    half = len(HOSTILE) // 2
    common = [*HOSTILE[:half], LINE_BREAK, *ORDINARY]
    torch.save(_tensors([*common, *HOSTILE[half:-1]]), a)
    torch.save({k: v + 1 for k, v in _tensors(common).items()} | {HOSTILE[-1]: torch.zeros(1)}, b)
    out, err = _ckpt("diff", a, b, code=0)
    _assert_safe(out + err)
    for name in [*HOSTILE, LINE_BREAK]:
        assert _escaped(name) in out
    for name in ORDINARY:
        assert name in out
    assert f"missing (in B, not in A): 1\n  {_escaped(HOSTILE[-1])}\n" in out


def test_an_error_message_escapes_the_keys_it_quotes(tmp_path: Path) -> None:
    path = tmp_path / "hostile.pt"
    names = [*HOSTILE, "ñ.weight", "权重"]  # as many as the message lists
    torch.save(_tensors(names), path)
    out, err = _ckpt("inspect", path, "--select", "missing", code=2)
    _assert_safe(out + err)
    assert err.startswith("ckpt: error: ") and err.count("\n") == 1
    for name in names:
        assert _escaped(name) in err


def test_json_stays_exact_and_ascii(hostile_pt: Path, tmp_path: Path) -> None:
    """--json is for programs: every name exact once parsed, and nothing raw on the wire
    (json.dumps escapes controls and, by default, every non-ASCII character)."""
    safetensors = tmp_path / "meta.safetensors"
    metadata = {"note\x1b[2J": "v\x1b]0;t\x07\u202e", "权重": "ñ"}
    save_file(_tensors([*HOSTILE, LINE_BREAK, *ORDINARY]), safetensors, metadata=metadata)
    out, _ = _ckpt("inspect", safetensors, "--json", code=0)
    assert out.isascii()
    data = json.loads(out)
    assert {t["name"] for t in data["tensors"]} == {*HOSTILE, LINE_BREAK, *ORDINARY}
    assert data["metadata"] == metadata
    out, _ = _ckpt("diff", hostile_pt, safetensors, "--json", code=0)
    assert out.isascii()
    assert {t["name"] for t in json.loads(out)["tensors"]} == {*HOSTILE, LINE_BREAK, *ORDINARY}


def test_a_lone_surrogate_in_a_key_is_shown_not_a_crash(tmp_path: Path) -> None:
    # pickle stores it (surrogatepass); written raw, it could not be encoded for the terminal.
    path = tmp_path / "surrogate.pt"
    torch.save({"a\ud800b": torch.zeros(1)}, path)
    out, err = _ckpt("inspect", path, code=0)
    assert "a\\ud800b" in out and err == ""


# --- line breaks in names printed outside a table -------------------------------------------
# Each name carries a line break and then a line that ``ckpt`` itself could print: written raw,
# the name would forge that line. Shown, it stays inside the line that quotes it.


def _global_pickle(module: str, name: str) -> bytes:
    """A pickle that imports ``module.name`` and calls it (written by hand: no class needed)."""
    pickled = b"\x80\x04"
    for text in (module, name):
        encoded = text.encode("utf-8")
        pickled += b"\x8c" + bytes([len(encoded)]) + encoded  # SHORT_BINUNICODE
    return pickled + b"\x93)R."  # STACK_GLOBAL, (), REDUCE, STOP


def _lines(text: str) -> list[str]:
    _assert_safe(text)
    assert text.endswith("\n")
    return text[:-1].split("\n")


def test_scan_a_line_break_in_a_global_or_a_file_name_forges_no_verdict(tmp_path: Path) -> None:
    forged = "clean        other.pt (torch-zip)"
    folder = tmp_path / "dir"
    folder.mkdir()
    module = f"x\n{forged}"
    name = f"system\r\n{forged}"
    (folder / "g1.pkl").write_bytes(_global_pickle(module, "y"))
    (folder / "g2.pkl").write_bytes(_global_pickle("os", name))
    torch.save({"w": torch.zeros(1)}, folder / f"ok\n{forged}")
    out, err = _ckpt("scan", folder, code=1)
    assert err == ""
    lines = _lines(out)
    # A line for each file, one for each of the two findings, and the summary.
    assert len(lines) == 3 + 2 + 1, out
    assert lines[-1] == "3 files: 2 dangerous, 1 clean"
    assert not any(line.startswith("clean        other.pt") for line in lines)
    assert f"dangerous: x\\n{forged}.y in pickle" in out
    assert f"dangerous: os.system\\r\\n{forged} in pickle" in out
    assert f"ok\\n{forged} (torch-zip)" in out
    # --json keeps the names exact.
    out, _ = _ckpt("scan", folder, "--json", code=1)
    globals_named = {f["global"] for s in json.loads(out)["files"] for f in s["findings"]}
    assert globals_named == {f"{module}.y", f"os.{name}"}


def test_diff_a_line_break_in_a_key_or_a_file_name_stays_in_its_line(tmp_path: Path) -> None:
    missing = "miss\nunexpected (in A, not in B): 0"
    unexpected = "unex\r\nidentical: same keys, every tensor bit-equal"
    a, b = tmp_path / "a\nB: forged.pt", tmp_path / "b.pt"
    torch.save({"w": torch.ones(1), unexpected: torch.zeros(1)}, a)
    torch.save({"w": torch.zeros(1), missing: torch.zeros(1)}, b)
    out, err = _ckpt("diff", a, b, code=0)
    assert err == ""
    lines = _lines(out)
    # A, B, tolerances, "", the table (header, rule, w), "", compared, and two key lists.
    assert len(lines) == 3 + 1 + 3 + 1 + 1 + 2 + 2, out
    assert lines[0].startswith("A: ") and _escaped(str(a)) in lines[0]
    assert lines[1].startswith("B: ") and str(b) in lines[1]
    assert lines[-4:] == [
        "missing (in B, not in A): 1",
        f"  {_escaped(missing)}",
        "unexpected (in A, not in B): 1",
        f"  {_escaped(unexpected)}",
    ]


def test_inspect_a_line_break_in_an_entry_or_a_file_name_stays_in_its_line(
    tmp_path: Path,
) -> None:
    model, epoch = "model\nfile:        forged.pt", "epoch\r\nformat:      safetensors"
    path = tmp_path / "i\ntensors:     0"
    torch.save({model: {"w": torch.zeros(2), "b": torch.zeros(1)}, epoch: 3}, path)
    out, err = _ckpt("inspect", path, code=0)
    assert err == ""
    summary, table = out.split("\n\n")
    lines = _lines(summary + "\n")
    # file, format, state dict, tensors, parameters, bytes, dtypes, devices, wrappers, and
    # the other entries under their heading: one line each.
    assert len(lines) == 11, summary
    assert lines[0] == f"file:        {_escaped(str(path))}"
    assert lines[2].startswith(f"state dict:  {_escaped(model)} (")
    assert lines[3] == "tensors:     2"
    assert lines[-2:] == ["other entries:", f"  {_escaped(epoch)}: int 3"]
    assert len(_lines(table)) == 2 + 2


def test_a_select_error_quotes_keys_with_line_breaks_on_one_line(tmp_path: Path) -> None:
    names = ["a\nckpt: error: forged", "c\r\nd"]
    path = tmp_path / "keys.pt"
    torch.save(_tensors(names), path)
    for select in ("missing", "a\nckpt.w"):
        out, err = _ckpt("inspect", path, "--select", select, code=2)
        assert out == ""
        assert len(_lines(err)) == 1, err
        assert err.startswith("ckpt: error: ") and "it has: " in err
        for name in names:
            assert _escaped(name) in err


def test_a_write_s_summary_and_dry_run_keep_a_line_break_in_its_line(tmp_path: Path) -> None:
    src, dst = tmp_path / "wrapped.pt", tmp_path / "out.pt"
    forged = "a\nclean     other.pt (torch-zip)"
    torch.save({"module." + forged: torch.zeros(2), "module.b": torch.ones(2)}, src)
    for dry in (("--dry-run",), ()):
        out, err = _ckpt("strip-module", src, dst, *dry, code=0)
        _assert_safe(out + err)
        assert _escaped(forged) in out
        assert not any(line.startswith("clean") for line in _lines(out))
    assert sorted(torch.load(dst, weights_only=True)) == sorted(["b", forged])  # exact names


def test_a_folder_s_warnings_escape_its_file_names_and_quiet_hushes_them(tmp_path: Path) -> None:
    folder, sharded = tmp_path / "one", tmp_path / "sharded"
    folder.mkdir()
    sharded.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    stray = "x\x1b[31mRED\nckpt: forged.index.json"
    (folder / stray).write_text("{}")
    shard = "sh\x1b[2Jard\n.safetensors"
    save_file({"a": torch.zeros(1), "b": torch.zeros(1)}, sharded / shard)
    index = {"metadata": {}, "weight_map": {"a": shard}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    for path, name in ((folder, stray), (sharded, shard)):
        out, err = _ckpt("inspect", path, "--json", code=0)
        assert len(_lines(err)) == 1 and _escaped(name) in err, err
        json.loads(out)
        out, err = _ckpt("convert", path, tmp_path / f"{path.name}.pt", "--quiet", code=0)
        assert (out, err) == ("", "")

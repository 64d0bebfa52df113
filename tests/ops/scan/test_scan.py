"""``scan`` and ``ckpt scan``: a verdict per file, against live payloads and real checkpoints.

The malicious corpus (``tests/helpers/scan_corpus.py``) is proven live by
``tests/ops/scan/test_scan_corpus.py``; here every one of its files must be called dangerous, every
benign one clean, and every nonstandard one nonstandard. What ``scan`` calls clean must load
with torch's own weights-only unpickler (or be refused by it only for an opcode the README
names). Scanning never runs anything: no marker ever appears.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import re
import shutil
import tarfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ckpt_tools import scan
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.ops.scan.report import VERDICTS
from ckpt_tools.ops.scan.scanning import scan_file
from tests.helpers import REAL_DIR
from tests.helpers.child_oracle import run_script
from tests.helpers.cli import run_ckpt
from tests.helpers.committed import fixture_files, fixture_path
from tests.helpers.scan_corpus import BENIGN, MALICIOUS, NONSTANDARD

# Fixtures that are not benign checkpoints, and what scan says of each.
NOT_BENIGN = {
    "evil.pt": "dangerous",
    "truncated.pt": "unreadable",
    "no_data_pkl.pt": "unreadable",
    "empty.pt": "unreadable",
    "random.bin": "unreadable",
    "lfs_pointer.pt": "unreadable",
    "torchscript.pt": "nonstandard",
    "tar_format.pt": "nonstandard",  # torch.load(weights_only=True) refuses the format
}
EXPECTED = {MALICIOUS: "dangerous", BENIGN: "clean", NONSTANDARD: "nonstandard"}


def test_every_corpus_file_gets_its_verdict_and_nothing_runs(corpus) -> None:
    entries, markers = corpus
    report = scan([e.path for e in entries])
    verdicts = {Path(f.path).name: f.verdict for f in report.files}
    wrong = {
        e.name: (EXPECTED[e.kind], verdicts[e.path.name])
        for e in entries
        if verdicts[e.path.name] != EXPECTED[e.kind]
    }
    assert not wrong
    assert {e.kind for e in entries} == {MALICIOUS, BENIGN, NONSTANDARD}
    assert not list(markers.iterdir())  # nothing was run


@pytest.mark.parametrize("kind", [MALICIOUS, NONSTANDARD, BENIGN])
def test_the_command_exits_by_the_worst_verdict(corpus, kind: str) -> None:
    entries, markers = corpus
    paths = [str(e.path) for e in entries if e.kind == kind]
    code = {MALICIOUS: 1, NONSTANDARD: 0, BENIGN: 0}[kind]
    res = run_ckpt("scan", *paths, code=code)
    assert res.stdout.count("\n") >= len(paths)
    strict = {MALICIOUS: 1, NONSTANDARD: 1, BENIGN: 0}[kind]
    run_ckpt("scan", "--fail-on", "nonstandard", *paths, code=strict)
    assert not list(markers.iterdir())


def test_each_malicious_file_alone_exits_1_naming_a_dangerous_global(corpus) -> None:
    entries, _ = corpus
    for e in (e for e in entries if e.kind == MALICIOUS):
        res = run_ckpt("scan", "--json", e.path, code=1)
        (found,) = json.loads(res.stdout)["files"]
        assert found["verdict"] == "dangerous", e.name
        assert any(f["severity"] == "dangerous" for f in found["findings"]), e.name


def test_fixtures_get_their_verdicts_and_torchscript_is_listed_as_code() -> None:
    report = scan(fixture_files())
    verdicts = {Path(f.path).name: f for f in report.files}
    for name, found in verdicts.items():
        assert found.verdict == NOT_BENIGN.get(name, "clean"), (name, found)
    script = verdicts["torchscript.pt"]
    assert any("class TinyNet" in line for line in script.code)
    assert all(f.severity == "nonstandard" for f in script.findings)
    benign = [p for p in fixture_files() if p.name not in NOT_BENIGN]
    run_ckpt("scan", *benign, fixture_path("torchscript.pt"), code=0)


def test_the_fixture_folder_mixes_verdicts_and_the_worst_decides(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(fixture_path("plain.pt").parent, folder)
    (folder / "notes.md").write_text("# not a checkpoint\n")
    res = run_ckpt("scan", "--json", folder, code=1)
    data = json.loads(res.stdout)
    by_name = {Path(f["path"]).name: f["verdict"] for f in data["files"]}
    assert by_name["evil.pt"] == "dangerous" and by_name["plain.pt"] == "clean"
    assert by_name["truncated.pt"] == "unreadable"
    assert data["verdict"] == "dangerous"
    # Files that are not checkpoints by content are skipped, whatever their names.
    assert {Path(p).name for p in data["skipped"]} >= {"notes.md", "random.bin", "empty.pt"}
    # A git-lfs pointer named as a checkpoint is one never pulled: nothing of it was judged.
    assert by_name["lfs_pointer.pt"] == "unreadable"
    (folder / "evil.pt").unlink()
    run_ckpt("scan", folder, code=4)  # now the worst is an unreadable file
    for name in ("truncated.pt", "no_data_pkl.pt", "lfs_pointer.pt"):
        (folder / name).unlink()
    run_ckpt("scan", folder, code=0)
    run_ckpt("scan", "--fail-on", "nonstandard", folder, code=1)  # torchscript.pt


@pytest.mark.real
@pytest.mark.skipif(not REAL_DIR.is_dir(), reason="../shared/realckpt is absent")
def test_real_checkpoints_nobody_here_wrote_are_clean() -> None:
    res = run_ckpt("scan", "--json", REAL_DIR, code=4)
    data = json.loads(res.stdout)
    verdicts = {Path(f["path"]).name: f["verdict"] for f in data["files"]}
    # The git-lfs pointer, named as the adapter's weights, is a checkpoint never pulled.
    pointers = [name for name in verdicts if "lfs_pointer" in name]
    assert pointers and all(verdicts[name] == "unreadable" for name in pointers)
    assert all(v == "clean" for name, v in verdicts.items() if name not in pointers)
    assert len(verdicts) > len(pointers)
    assert any(p.endswith(".json") for p in data["skipped"])  # the adapter's config


def test_a_git_lfs_pointer_not_named_as_a_checkpoint_is_skipped(tmp_path: Path) -> None:
    # LFS tracks images and datasets too: only a checkpoint's name makes a pointer unreadable.
    pointer = fixture_path("lfs_pointer.pt").read_bytes()
    (tmp_path / "figure.png").write_bytes(pointer)
    (tmp_path / "weights.safetensors").write_bytes(pointer)
    data = json.loads(run_ckpt("scan", "--json", tmp_path, code=4).stdout)
    assert [Path(f["path"]).name for f in data["files"]] == ["weights.safetensors"]
    assert [Path(p).name for p in data["skipped"]] == ["figure.png"]
    (tmp_path / "weights.safetensors").unlink()
    run_ckpt("scan", tmp_path, code=0)


def test_unreadable_files_exit_4_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(4)}, tmp_path / "good.pt")
    bad.write_bytes((tmp_path / "good.pt").read_bytes()[:300])
    res = run_ckpt("scan", bad, fixture_path("lfs_pointer.pt"), code=4)
    assert "unreadable" in res.stdout and "git lfs pull" in res.stdout
    run_ckpt("scan", tmp_path / "missing.pt", code=2)


def _weights_only_load(path: Path, fmt: str) -> None:
    """Load ``path`` as torch's weights-only unpickler would, by its format."""
    if fmt == "safetensors":
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                f.get_tensor(key)
    elif fmt == "pickle":  # torch.load reads no plain pickle; its unpickler does
        from torch._weights_only_unpickler import Unpickler

        with path.open("rb") as f:
            Unpickler(f).load()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.load(path, weights_only=True)


def test_what_scan_calls_clean_loads_with_weights_only(corpus) -> None:
    entries, markers = corpus
    paths = [e.path for e in entries if e.kind != MALICIOUS] + fixture_files()
    report = scan(paths)
    clean = [f for f in report.files if f.verdict == "clean"]
    assert len(clean) >= 30
    for found in clean:
        path = Path(found.path)
        try:
            _weights_only_load(path, found.format or "")
        except pickle.UnpicklingError as e:
            # Only for an opcode outside torch's subset, which the README names.
            assert "Unsupported operand" in str(e), (path, e)
            assert open_checkpoint(path).beyond_weights_only, path
    assert not list(markers.iterdir())


def test_extra_pickle_records_are_scanned_even_where_torch_never_reads_them(
    tmp_path: Path,
) -> None:
    """A torch.package-style record beside data.pkl: torch.load ignores it, a scan does not."""
    path = tmp_path / "archive.pt"  # torch.save names the zip's folder after the file
    torch.save({"w": torch.ones(2)}, path)
    payload = b"\x80\x02cbuiltins\neval\nX\x03\x00\x00\x001+1\x85R."
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("archive/extra/model.pkl", payload)
    assert torch.load(path, weights_only=True)["w"].shape == (2,)
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert [(f.global_name, f.record) for f in found.findings] == [
        ("builtins.eval", "archive/extra/model.pkl")
    ]


def test_a_tar_whose_first_header_is_a_pickle_is_dangerous(tmp_path: Path) -> None:
    # torch.load(path) reads the tar; torch.load of a stream with no file number (a BytesIO)
    # and pickle.load read its bytes as pickles from the first: the first member's name.
    payload = b"cposix\nsystem\n(S'true'\ntR."
    sys_info = {"protocol_version": 1001, "little_endian": True,
                "type_sizes": {"short": 2, "int": 4, "long": 4}}  # fmt: skip
    members = [(payload.decode(), b""), ("sys_info", pickle.dumps(sys_info, 2))]
    members += [("pickle", pickle.dumps({"a": 1}, 2)), ("tensors", pickle.dumps(0, 2))]
    members += [("storages", pickle.dumps(0, 2) + pickle.dumps([], 2))]
    path = _tar(tmp_path / "old.pt", members)
    calls = []

    class Recording(pickle.Unpickler):  # the C unpickler, asked for globals it never gets
        def find_class(self, module: str, name: str) -> Callable[..., None]:
            return lambda *args: calls.append((module, name, args))

    Recording(io.BytesIO(path.read_bytes())).load()
    assert calls == [("posix", "system", ("true",))]
    assert torch.load(path, weights_only=False) == {"a": 1}
    _, out, _ = run_ckpt("scan", path, code=1)
    assert "dangerous: posix.system in magic number (the tar's bytes read as a pickle)" in out


def _tar(path: Path, members: list[tuple[str, bytes | str]]) -> Path:
    """A tar-format file of ``members``: bytes, or a str for a symbolic link's target."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_a_tar_storages_member_linked_out_of_the_archive_is_dangerous(tmp_path: Path) -> None:
    # torch extracts 'storages' (a link as a link) and unpickles the file it reaches, which
    # may be any file (/proc/self/fd/N: the checkpoint's own bytes); no walk reaches it.
    sys_info = {"protocol_version": 1001, "little_endian": True,
                "type_sizes": {"short": 2, "int": 4, "long": 4}}  # fmt: skip
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(pickle.dumps(0, 2) + pickle.dumps([], 2))  # no storages, no views
    path = _tar(
        tmp_path / "old.pt",
        [("sys_info", pickle.dumps(sys_info, 2)), ("pickle", pickle.dumps({"a": 1}, 2)),
         ("tensors", pickle.dumps(0, 2)), ("storages", str(outside))],
    )  # fmt: skip
    assert torch.load(path, weights_only=False) == {"a": 1}
    outside.unlink()
    with pytest.raises(FileNotFoundError):  # (it is the outside file torch reads)
        torch.load(path, weights_only=False)
    _, out, _ = run_ckpt("scan", path, code=1)
    assert "dangerous: <bytes not read> in storages" in out


@pytest.mark.parametrize("called", ["imaplib\nIMAP4_stream", "mypkg.tools\nrun"])
def test_a_cut_pickle_calling_a_global_the_table_does_not_know_is_found_in_a_folder(
    tmp_path: Path, called: str
) -> None:
    # No PROTO, no STOP, no checkpoint's name: it counts as a pickle where it calls a global
    # before it breaks. Any global the table does not know is dangerous, not only its own.
    data = f"c{called}\n(S'true'\ntR".encode()
    (tmp_path / "weights.dat").write_bytes(data)
    calls = []

    class Recording(pickle.Unpickler):  # the C unpickler, asked for globals it never gets
        def find_class(self, module: str, name: str) -> Callable[..., None]:
            return lambda *args: calls.append((module, name))

    with pytest.raises(EOFError):
        Recording(io.BytesIO(data)).load()
    assert calls == [tuple(called.split("\n"))]
    _, out, _ = run_ckpt("scan", tmp_path, code=1)
    assert "dangerous" in out and "weights.dat" in out


def test_text_that_reads_as_a_call_of_a_global_no_loader_imports_is_no_payload(
    tmp_path: Path,
) -> None:
    # A Lisp or Scheme source starts with "(i": a MARK, then an INST of "n-package :cl-user)",
    # which pickle.load fails to import: nothing runs.
    (tmp_path / "main.lisp").write_text('(in-package :cl-user)\n(defun main ()\n  (print "hi"))\n')
    (tmp_path / "hello.scm").write_text('(import (rnrs))\n(display "hi")\n(newline)\n')
    for name in ("main.lisp", "hello.scm"):
        with pytest.raises(ModuleNotFoundError):
            pickle.loads((tmp_path / name).read_bytes())
    report = scan(tmp_path)
    assert report.files == () and sorted(Path(p).name for p in report.skipped) == [
        "hello.scm", "main.lisp"
    ]  # fmt: skip
    # A tar whose first member's name reads as a GLOBAL of junk ("onfig.json\0...") likewise.
    config = b'{\n  "model_type": "gpt2"\n}\n'
    path = _tar(tmp_path / "bundle.tar", [("config.json", config), ("readme.txt", b"hi\n")])
    with pytest.raises(ModuleNotFoundError):
        pickle.loads(path.read_bytes())
    assert scan(path).files[0].verdict != "dangerous"


def test_a_case_twin_record_is_dangerous_and_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "archive.pt"
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("archive/DATA.PKL", b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.")
    (found,) = scan(path).files
    assert found.verdict == "dangerous" and "both answer torch's lookup" in found.error
    assert [(f.global_name, f.record) for f in found.findings] == [
        ("posix.system", "archive/DATA.PKL")
    ]


def test_a_torch_file_named_safetensors_is_still_scanned(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    shutil.copy(fixture_path("evil.pt"), path)
    (found,) = scan(path).files
    assert found.format == "torch-zip" and found.verdict == "dangerous"


def test_numpy_values_and_object_arrays(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "mean": np.zeros(3)}, tmp_path / "np.pt")
    # A masked array: numpy 2 names its class numpy.ma.MaskedArray, 1.x numpy.ma.core's.
    torch.save({"m": np.ma.masked_array([1.0, 2.0], mask=[0, 1])}, tmp_path / "masked.pt")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "numbers.npy", np.zeros(3))  # numpy.load reads it, no pickle: clean
    report = scan(tmp_path)
    verdicts = {Path(f.path).name: f.verdict for f in report.files}
    assert verdicts == {
        "np.pt": "nonstandard", "masked.pt": "nonstandard", "objects.npy": "nonstandard",
        "numbers.npy": "clean",
    }  # fmt: skip
    assert report.skipped == ()


def test_a_dcp_folder_is_one_checkpoint(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(2, 3)}, "step": 5}, checkpoint_id=tmp_path / "run")
    (found,) = scan(tmp_path).files
    assert found.format == "dcp" and found.verdict == "clean"
    assert found.pickles >= 3  # .metadata, the tensor's archive, the value's archive


def test_dcp_enum_members_by_name_scan_as_by_value(tmp_path: Path) -> None:
    # Python 3.11.0-3.11.4 pickle DCP's memory format enum as getattr(Enum, "MEMBER").
    from tests.formats.dcp.test_dcp import enums_by_name, save_dcp, small_state

    folder = save_dcp(tmp_path / "run", small_state())
    enums_by_name(folder)
    (found,) = scan(tmp_path).files
    assert (found.format, found.verdict, found.findings, found.error) == ("dcp", "clean", (), None)
    run_ckpt("scan", folder)


@pytest.mark.parametrize("form", ["another class", "a dunder", "a value"])
def test_dcp_getattr_in_any_other_form_is_dangerous(tmp_path: Path, form: str) -> None:
    from tests.formats.dcp.test_dcp import HOSTILE_GETATTR, save_dcp, small_state

    folder = save_dcp(tmp_path / "run", small_state())
    HOSTILE_GETATTR[form](folder)
    (found,) = scan(tmp_path).files
    assert found.verdict == "dangerous"
    assert ("builtins.getattr", ".metadata") in {(f.global_name, f.record) for f in found.findings}
    run_ckpt("scan", folder, code=1)


def test_a_sarif_uri_is_the_path_percent_encoded(tmp_path: Path) -> None:
    # A '#' would start a fragment, a bare '%' is no escape, a space no URI character.
    import shutil
    from urllib.parse import unquote, urlsplit

    src = tmp_path / "my model #2 100%.pt"
    shutil.copy(fixture_path("evil.pt"), src)
    sarif = json.loads(run_ckpt("scan", "--format", "sarif", src, code=1).stdout)
    location = sarif["runs"][0]["results"][0]["locations"][0]["physicalLocation"]
    uri = location["artifactLocation"]["uri"]
    parts = urlsplit(uri)
    assert not parts.scheme and not parts.fragment and " " not in uri
    assert unquote(parts.path) == src.as_posix()


def test_a_sarif_uri_of_a_name_that_is_no_utf8_is_its_bytes_percent_encoded(
    tmp_path: Path,
) -> None:
    import os
    import shutil
    from urllib.parse import unquote_to_bytes

    folder = tmp_path / "odd"
    folder.mkdir()
    src = os.path.join(os.fsencode(folder), b"w\xff.pt")
    shutil.copy(fixture_path("evil.pt"), src)
    sarif = json.loads(run_ckpt("scan", "--format", "sarif", folder, code=1).stdout)
    uri = sarif["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert uri["uri"].endswith("/w%FF.pt") and unquote_to_bytes(uri["uri"]) == src


def test_json_and_sarif_name_each_finding(tmp_path: Path) -> None:
    res = run_ckpt("scan", "--format", "sarif", fixture_path("evil.pt"), code=1)
    sarif = json.loads(res.stdout)
    assert sarif["version"] == "2.1.0"
    (run,) = sarif["runs"]
    (result,) = run["results"]
    assert result["ruleId"] == "dangerous-global" and result["level"] == "error"
    assert "posix.system" in result["message"]["text"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith("evil.pt")
    assert {r["id"] for r in run["tool"]["driver"]["rules"]} >= {result["ruleId"]}
    data = json.loads(run_ckpt("scan", "--json", fixture_path("evil.pt"), code=1).stdout)
    (finding,) = data["files"][0]["findings"]
    assert finding["global"] == "posix.system" and finding["record"] == "archive/data.pkl"
    assert finding["severity"] == "dangerous" and finding["reason"]
    assert data["verdict"] in VERDICTS
    for other in ("sarif", "text"):
        both = run_ckpt("scan", "--json", "--format", other, fixture_path("evil.pt"), code=2)
        assert both.stdout == "" and "name two outputs" in both.stderr
    same = run_ckpt("scan", "--json", "--format", "json", fixture_path("evil.pt"), code=1)
    assert json.loads(same.stdout) == data


def test_scan_never_imports_torch(no_torch_env: dict[str, str]) -> None:
    folder = fixture_path("plain.pt").parent
    res = run_ckpt("scan", folder, code=1, how="module", env=no_torch_env)
    assert "dangerous" in res.stdout and "evil.pt" in res.stdout


def test_on_file_is_told_each_file_before_it_is_scanned(tmp_path: Path) -> None:
    for name in ("a.pt", "b.pt", "notes.txt"):
        shutil.copy(fixture_path("plain.pt"), tmp_path / name)
    (tmp_path / "notes.txt").write_text("text")
    told: list[tuple[int, int, str]] = []
    report = scan(tmp_path, on_file=lambda done, total, path: told.append((done, total, path)))
    assert [(d, t, Path(p).name) for d, t, p in told] == [
        (0, 3, "a.pt"),
        (1, 3, "b.pt"),
        (2, 3, "notes.txt"),
    ]
    assert [Path(f.path).name for f in report.files] == ["a.pt", "b.pt"]
    assert [Path(p).name for p in report.skipped] == ["notes.txt"]


# Shapes that evade a looser scan: each loads a payload (proven below in one child process) that a
# looser scan would call nonstandard, clean or skipped.
def _sbu(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _touch(marker: Path) -> bytes:
    """A protocol 0 call of posix.system that creates ``marker``."""
    return b"cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR."


def _evasive_shapes(folder: Path, markers: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, how it is loaded): each creates ``markers/<name>`` when loaded."""
    shapes: dict[str, tuple[Path, str]] = {}
    # A dotted attribute path from a module a family calls nonstandard, to os.system.
    path = folder / "attribute_path.pkl"
    m = markers / "attribute_path"
    path.write_bytes(
        b"\x80\x04"
        + _sbu("torch.nn.functional")
        + _sbu("torch.serialization.os.system")
        + b"\x93"
        + _sbu(f"touch {m}")
        + b"\x85R."
    )
    shapes["attribute_path"] = (path, "pickle")
    # A protocol 0 int that pickletools refuses and the C unpickler reads, before the call.
    path = folder / "pytorch_model.bin"
    path.write_bytes(b"I0x1\n0" + _touch(markers / "hex_int"))
    shapes["hex_int"] = (path, "torch")
    # An object array whose pickle is protocol 1, behind a header past 64 KiB.
    header = "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    header = header + " " * (70_000 - len(header)) + "\n"
    path = folder / "objects.npy"
    path.write_bytes(
        b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header.encode()
        + b"\x80\x01(" + _touch(markers / "npy")[:-1] + b"l."
    )  # fmt: skip
    shapes["npy"] = (path, "numpy")
    return shapes


_LOAD_ALL = """
import pickle, sys, numpy, torch
for path, how in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        if how == "pickle":
            pickle.load(open(path, "rb"))
        elif how == "numpy":
            numpy.load(path, allow_pickle=True)
        else:
            torch.load(path, weights_only=False)
    except Exception:
        pass  # the payload ran first, or did not: the markers tell
"""


def test_evasive_shapes_are_live_and_dangerous(tmp_path: Path) -> None:
    import subprocess
    import sys

    folder, markers, scratch = tmp_path / "files", tmp_path / "markers", tmp_path / "cwd"
    for made in (folder, markers, scratch):
        made.mkdir()
    shapes = _evasive_shapes(folder, markers)
    report = scan(folder)
    verdicts = {Path(f.path).name: f.verdict for f in report.files}
    assert {p.name: verdicts.get(p.name) for p, _ in shapes.values()} == {
        p.name: "dangerous" for p, _ in shapes.values()
    }
    assert not list(markers.iterdir())  # scanning ran nothing
    argv = [str(x) for path, how in shapes.values() for x in (path, how)]
    subprocess.run([sys.executable, "-c", _LOAD_ALL, *argv], cwd=scratch, timeout=120)
    assert sorted(p.name for p in markers.iterdir()) == sorted(shapes)


def test_a_dcp_folder_does_not_hide_the_files_beside_it(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=run)
    (run / "sub").mkdir()
    shutil.copy(fixture_path("evil.pt"), run / "extra_state.pt")
    shutil.copy(fixture_path("evil.pt"), run / "sub" / "model.pt")
    for target in (tmp_path, run):
        report = scan(target)
        by_name = {Path(f.path).name: f for f in report.files}
        assert by_name["run"].format == "dcp" and by_name["run"].verdict == "clean"
        assert by_name["extra_state.pt"].verdict == by_name["model.pt"].verdict == "dangerous"


def test_fifos_and_symlinked_folders(tmp_path: Path) -> None:
    import os

    dcp_like = tmp_path / "d"
    dcp_like.mkdir()
    (dcp_like / "x.distcp").write_bytes(b"")
    os.mkfifo(dcp_like / ".metadata")
    res = run_ckpt("scan", dcp_like, code=4, timeout=30)  # refused, not waited on
    assert "FIFO" in res.stdout
    run_ckpt("inspect", dcp_like, code=4, timeout=30)
    # A linked folder is scanned, as a linked file is; a link back is walked once.
    store = tmp_path / "store" / "run1"
    store.mkdir(parents=True)
    shutil.copy(fixture_path("evil.pt"), store / "evil.pt")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(store, linked / "run1")
    os.symlink(linked, store / "back")
    os.symlink(tmp_path / "nowhere.pt", linked / "dangling.pt")
    os.mkfifo(linked / "pipe.pt")
    os.symlink("/proc", linked / "kernel")  # a link to / would reach it: never walked
    report = scan(linked)
    assert [(Path(f.path).name, f.verdict) for f in report.files] == [("evil.pt", "dangerous")]
    skipped = ["back", "dangling.pt", "kernel", "pipe.pt"]
    assert sorted(Path(p).name for p in report.skipped) == skipped
    assert "1 dangerous; 4 skipped" in run_ckpt("scan", linked, code=1, timeout=30).stdout


class _Scaled(torch.nn.Module):
    """A TorchScript module with no ``__setstate__``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_torchscript_with_setstate_is_dangerous(tmp_path: Path) -> None:
    class Stateful(_Scaled):
        @torch.jit.export
        def __getstate__(self) -> tuple[torch.Tensor, bool]:
            return (self.w, self.training)

        @torch.jit.export
        def __setstate__(self, state: tuple[torch.Tensor, bool]) -> None:
            self.w = state[0]
            self.training = state[1]

    torch.jit.save(torch.jit.script(Stateful()), tmp_path / "stateful.pt")
    (found,) = scan(tmp_path / "stateful.pt").files
    assert found.format == "torchscript" and found.verdict == "dangerous"
    assert [f.global_name for f in found.findings if f.severity == "dangerous"] == ["__setstate__"]
    # The same code spaced otherwise, as Python reads it: torch.jit.load still runs it.
    # A line continued with a backslash too; and records named in another case, which torch's
    # lookup (ASCII case-insensitive) reads as the code it looks for.
    spacings = (b"def __setstate__ (", b"def  __setstate__(", b"def\t__setstate__\t(")
    spacings += (b"def \\\n  __setstate__(",)
    renames = {"CODE": ("/code/", "/CODE/"), "PY": ("__torch__.py", "__torch__.PY")}
    variants = [(spaced, ("", "")) for spaced in spacings] + [
        (b"def __setstate__(", rename) for rename in renames.values()
    ]
    for spaced, (old, new) in variants:
        respaced = tmp_path / "respaced.pt"
        with zipfile.ZipFile(tmp_path / "stateful.pt") as z, zipfile.ZipFile(respaced, "w") as out:
            for info in z.infolist():
                data = z.read(info)
                if "/code/" in info.filename and info.filename.endswith(".py"):
                    data = data.replace(b"def __setstate__(", spaced)
                out.writestr(info.filename.replace(old, new) if old else info.filename, data)
        assert torch.equal(torch.jit.load(respaced).w, torch.ones(2))
        (found,) = scan(respaced).files
        assert found.verdict == "dangerous", (spaced, new)


def test_torchscript_code_past_what_is_read_is_not_called_safe(tmp_path: Path) -> None:
    # A code file is read in part (its first 64 MiB); a comment that long, which deflate
    # makes small, would hide a __setstate__ behind it: what is not read is named.
    torch.jit.save(torch.jit.script(_Scaled()), tmp_path / "plain.pt")
    padded = tmp_path / "padded.pt"
    with zipfile.ZipFile(tmp_path / "plain.pt") as z, zipfile.ZipFile(padded, "w") as out:
        for info in z.infolist():
            data = z.read(info)
            if "/code/" in info.filename and info.filename.endswith(".py"):
                data = b"#" + b" " * (65 << 20) + b"\n" + data
            out.writestr(info.filename, data, zipfile.ZIP_DEFLATED)
    assert padded.stat().st_size < 1 << 20
    assert torch.equal(torch.jit.load(padded).w, torch.ones(2))  # torch reads it whole
    assert scan(tmp_path / "plain.pt").files[0].verdict == "nonstandard"
    (found,) = scan(padded).files
    assert found.verdict == "dangerous"
    assert [f.global_name for f in found.findings if f.severity == "dangerous"] == [
        "<bytes not read>"
    ]


def test_ordinary_state_objects_are_not_dangerous(tmp_path: Path) -> None:
    import types

    torch.save(
        {
            "generator": torch.Generator(),
            "rng": np.random.default_rng(0),
            "legacy_rng": np.random.RandomState(0),
            "config": types.SimpleNamespace(lr=0.1),
            "scaler": torch.amp.GradScaler("cpu"),
        },
        tmp_path / "state.pt",
    )
    np.savez(tmp_path / "arrays.npz", a=np.arange(3))
    np.save(tmp_path / "array.npy", np.arange(3))  # as numpy.load reads it: no pickle
    verdicts = {Path(f.path).name: (f.format, f.verdict) for f in scan(tmp_path).files}
    assert verdicts == {
        "state.pt": ("torch-zip", "nonstandard"),
        "arrays.npz": ("numpy", "clean"),
        "array.npy": ("numpy", "clean"),
    }
    assert run_ckpt("scan", tmp_path / "array.npy").stdout.startswith("clean ")


def test_a_zip_no_directory_reader_lists_is_searched_by_its_local_headers(tmp_path: Path) -> None:
    """Its central directory gone, neither our reader nor zipfile lists the records; a pickle
    a reader could still find by its local header is walked, and its payload named."""
    src = tmp_path / "full.pt"
    torch.save({"w": torch.ones(2)}, src)
    data = src.read_bytes()
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    lengths = data[info.header_offset + 26 : info.header_offset + 30]  # the local header's
    start = info.header_offset + 30 + int.from_bytes(lengths[:2], "little")
    start += int.from_bytes(lengths[2:], "little")
    pkl = data[start : start + info.compress_size]
    # os.system, called and popped right after PROTO.
    payload = b"cposix\nsystem\n(S'true'\ntR0"
    evil = pkl[:2] + payload + pkl[2:]
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[:start] + evil + data[start + len(pkl) : data.rfind(b"PK\x01\x02")])
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(cut)
    found = scan([cut]).files[0]
    assert found.verdict == "dangerous" and found.findings[0].global_name == "posix.system"


def test_tar_pickles_past_the_first_and_a_tar_torch_reads_as_legacy(tmp_path: Path) -> None:
    import io
    import tarfile

    # A header torch's tarfile.open refuses; torch then reads the file as legacy pickles.
    info = tarfile.TarInfo("cposix\nsystem\n(S'true'\ntR.")
    info.type, info.size = tarfile.XHDTYPE, 0
    (tmp_path / "model.bin").write_bytes(info.tobuf(format=tarfile.USTAR_FORMAT))
    # A payload in the second pickle of the storages member (torch reads every one).
    shutil.copy(fixture_path("tar_format.pt"), tmp_path / "tar.pt")
    with tarfile.open(fixture_path("tar_format.pt")) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    with tarfile.open(tmp_path / "tar.pt", "w", format=tarfile.PAX_FORMAT) as out:
        for member, data in members:
            if member.name == "storages":
                data = pickle.dumps(1, protocol=2) + b"\x80\x02" + b"cposix\nsystem\n(S'x'\ntR."
                member.size = len(data)
            out.addfile(member, io.BytesIO(data))
    verdicts = {Path(f.path).name: f.verdict for f in scan(tmp_path).files}
    assert verdicts == {"model.bin": "dangerous", "tar.pt": "dangerous"}


def _opens(path: Path) -> bytes:
    """A protocol 2 pickle that calls builtins.open(path, "w"): the file appears."""
    return b"\x80\x02cbuiltins\nopen\nX" + _u32(str(path)) + b"X\x01\x00\x00\x00w\x86R."


def _u32(text: str) -> bytes:
    return len(text).to_bytes(4, "little") + text.encode()


@pytest.mark.parametrize(
    "storages",
    [
        # The count is int("1") or bool("1"): torch calls it, then reads one storage.
        lambda m: b"\x80\x02cbuiltins\nint\nX\x01\x00\x00\x001\x85R." + _opens(m),
        lambda m: b"\x80\x02cbuiltins\nbool\nX\x01\x00\x00\x001\x85R." + _opens(m),
        # One storage whose header tuple is built by a call: its size is out of reach, and
        # the storage views torch reads after it open the file.
        lambda m: (
            pickle.dumps(1, protocol=2)
            + b"\x80\x02cbuiltins\ntuple\n](X\x01\x00\x00\x000X\x03\x00\x00\x00cpu"
            + b"ctorch\nFloatStorage\ne\x85R."
            + (0).to_bytes(8, "little")
            + _opens(m)
        ),
    ],
    ids=["int", "bool", "header"],
)
def test_a_tar_count_built_by_a_call_hides_no_pickle_after_it(
    tmp_path: Path, storages: Callable[[Path], bytes]
) -> None:
    import io
    import tarfile

    marker = tmp_path / "ran"
    path = tmp_path / "tar.pt"
    with tarfile.open(fixture_path("tar_format.pt")) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as out:
        for member, data in members:
            if member.name == "storages":
                data = storages(marker)
                member.size = len(data)
            out.addfile(member, io.BytesIO(data))
    code = f"import torch\ntry:\n    torch.load({str(path)!r}, weights_only=False)\n"
    run_script(code + "except Exception:\n    pass", preload=("torch",), check=True)
    assert marker.exists()  # torch.load opened it
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert {"builtins.open", "<bytes not read>"} & {f.global_name for f in found.findings}


def test_a_tar_member_that_is_a_hard_link_is_read_as_its_target(tmp_path: Path) -> None:
    """torch extracts a hard-link member as the member it names; so does the scan."""
    import io
    import tarfile

    with tarfile.open(fixture_path("tar_format.pt")) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    path = tmp_path / "linked.pt"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as out:
        payload = b"\x80\x02cposix\nsystem\n(S'true'\ntR."
        hidden = tarfile.TarInfo("x")
        hidden.size = len(payload)
        out.addfile(hidden, io.BytesIO(payload))
        for member, data in members:
            if member.name == "pickle":
                link = tarfile.TarInfo("pickle")
                link.type, link.linkname = tarfile.LNKTYPE, "x"
                out.addfile(link)
            else:
                out.addfile(member, io.BytesIO(data))
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert ("posix.system", "pickle") in [(f.global_name, f.record) for f in found.findings]


def test_tensor_bytes_that_begin_like_a_pickle_are_data(tmp_path: Path) -> None:
    # These four floats begin with MARK, BINUNICODE8 and a length past any file: scanning
    # their storage record for a pickle must find none, not fail.
    raw = bytes.fromhex("288d48bfdaf032bfdeab1bbfd2e9c7bf")
    path = tmp_path / "floats.pt"
    torch.save({"w": torch.frombuffer(bytearray(raw), dtype=torch.float32).clone()}, path)
    assert scan(path).verdict == "clean"
    assert "clean" in run_ckpt("scan", path, code=0).stdout


def test_a_pickle_cut_inside_a_global_names_what_torch_names(tmp_path: Path) -> None:
    # torch's weights-only reader takes each of a GLOBAL's lines less its last byte, so a
    # file that ends inside one still names a global as torch refuses it; bytes that only
    # look like a GLOBAL where torch reads no pickle (a zip's byteorder "little") name none.
    path = tmp_path / "cut.pt"
    torch.save({"a": collections.OrderedDict()}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"collections\nOrderedDict") + len("collections\nOrd")])
    with pytest.raises(pickle.UnpicklingError, match=r"collections\.Or\b"):
        torch.load(path, weights_only=True)
    (cut,) = scan([path]).files
    assert [f.global_name for f in cut.findings] == ["collections.Or"]
    whole = tmp_path / "whole.pt"
    torch.save({"a": torch.ones(2)}, whole)
    assert scan([whole]).files[0].verdict == "clean"


def test_a_pickle_with_any_protocol_number_names_what_torch_names(tmp_path: Path) -> None:
    # torch's weights-only reader reads past a PROTO no Python writes (66 here) and meets the
    # global before the bytes that break the pickle; Python's pickle refuses the protocol.
    payload = pickle.dumps({"a": shutil.rmtree}, protocol=2)
    path = tmp_path / "odd.pt"
    path.write_bytes(b"\x80B" + payload[2:-1] + b"\xff\xfe")
    with pytest.raises(pickle.UnpicklingError, match=r"shutil\.rmtree"):
        torch.load(path, weights_only=True)
    (odd,) = scan([path]).files
    assert odd.verdict == "dangerous" and [f.global_name for f in odd.findings] == ["shutil.rmtree"]
    noise = tmp_path / "noise.bin"
    noise.write_bytes(b"\x80B" + bytes(range(256)) * 4)  # no global: not a checkpoint at all
    assert scan_file(str(noise)) is None


def _cut_inside_the_name(payload: bytes, name: bytes, tail: bytes) -> bytes:
    """``payload`` up to ``name``'s GLOBAL name line, then ``tail`` and the end of the file."""
    return payload[: payload.index(b"\n" + name + b"\n") + 1 + len(name)] + tail


@pytest.mark.parametrize(
    "head",
    [pytest.param(b"\x80\x02", id="plain-pickle"), pytest.param(b"\x80\x09", id="any-proto")],
)
def test_a_plain_pickle_cut_inside_a_global_names_what_torch_names(
    tmp_path: Path, head: bytes
) -> None:
    # The fuzzer's input: a plain pickle (the first pickle torch reads) that ends inside a
    # GLOBAL's name line holding binary bytes. torch's reader takes the line less its last
    # byte and refuses that name; Python's pickle refuses the cut line, so nothing runs.
    payload = head + pickle.dumps({"a": shutil.rmtree}, protocol=2)[2:]
    path = tmp_path / "cut.pt"
    path.write_bytes(_cut_inside_the_name(payload, b"rmtree", b"\x1aq\x02X1\x00\x00\x00 ${C"))
    torch_name = "shutil.rmtree\x1aq\x02X1\x00\x00\x00 ${"
    with warnings.catch_warnings(), pytest.raises(pickle.UnpicklingError) as refused:
        warnings.simplefilter("ignore")  # (torch warns of a protocol other than 2)
        torch.load(path, weights_only=True)
    assert f"GLOBAL {torch_name} was not an allowed global" in str(refused.value)
    with pytest.raises((pickle.UnpicklingError, ValueError)):  # truncated, or its protocol
        pickle.loads(path.read_bytes())
    (cut,) = scan([path]).files
    assert cut.verdict == "dangerous"
    assert [f.global_name for f in cut.findings] == [torch_name]
    assert "dangerous: shutil.rmtree" in run_ckpt("scan", path, code=1).stdout


def test_a_global_line_with_binary_bytes_is_named_whole(tmp_path: Path) -> None:
    # A name line ends at its newline whatever bytes come before it, as both readers read it.
    payload = pickle.dumps({"a": shutil.rmtree}, protocol=2)
    path = tmp_path / "binary.pt"
    path.write_bytes(payload.replace(b"\nrmtree\n", b"\nrmtree\x00q\x1a\n"))
    with pytest.raises(pickle.UnpicklingError, match=re.escape("GLOBAL shutil.rmtree\x00q\x1a ")):
        torch.load(path, weights_only=True)
    (found,) = scan([path]).files
    assert found.verdict == "dangerous"
    assert [f.global_name for f in found.findings] == ["shutil.rmtree\x00q\x1a"]


def test_escaped_string_operands_are_named_as_pickle_imports_them(tmp_path: Path) -> None:
    # Protocol 0 STRINGs with escapes feed a STACK_GLOBAL: the import is the decoded name.
    path = tmp_path / "escaped.pkl"
    path.write_bytes(b"\x80\x02S'p\\x6fsix'\nS'sys\\x74em'\n\x93.")

    class Asking(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> type:
            asked.append(f"{module}.{name}")
            return dict

    asked: list[str] = []
    with path.open("rb") as f:
        Asking(f).load()  # the oracle: what pickle.load would import
    res = run_ckpt("scan", "--json", path, code=1)
    (found,) = json.loads(res.stdout)["files"]
    assert [f["global"] for f in found["findings"]] == asked == ["posix.system"]


def test_a_dcp_item_that_is_no_zip_is_walked_as_torch_load_reads_it(tmp_path: Path) -> None:
    # DCP hands a non-tensor item's bytes to torch.load(weights_only=False), which reads
    # bytes that are no zip as a legacy file: the first pickle is unpickled, whatever it is.
    from tests.formats.dcp.test_dcp import save_dcp

    folder = save_dcp(tmp_path / "run", {"w": torch.ones(3), "extra": {"lr": 0.1}})
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    (span,) = [v for k, v in metadata.storage_data.items() if k.fqn == "extra.lr"]
    marker = tmp_path / "ran"
    payload = f"cbuiltins\nopen\n(S'{marker}'\nS'w'\ntR.".encode()
    assert len(payload) <= span.length
    data = bytearray((folder / span.relative_path).read_bytes())
    data[span.offset : span.offset + len(payload)] = payload
    (folder / span.relative_path).write_bytes(bytes(data))
    load = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "state = {'w': torch.zeros(3), 'extra': {'lr': 0.0}}\n"
        "try:\n    dcp.load(state, checkpoint_id=sys.argv[1], no_dist=True)\n"
        "except Exception:\n    pass\n"
    )
    run_script(load, folder)
    assert marker.exists()  # the oracle: loading ran it
    (found,) = scan(folder).files
    assert found.verdict == "dangerous", found
    assert "builtins.open" in {f.global_name for f in found.findings}
    run_ckpt("scan", folder, code=1)


def test_a_tar_whose_pax_header_tarfile_cannot_parse_is_unreadable(tmp_path: Path) -> None:
    # tarfile raises ValueError (not TarError) for a malformed GNU.sparse.map, and so does
    # torch.load, before any pickle is read: one line, unreadable, in a folder scan too.
    path = tmp_path / "old.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pickle")
        info.pax_headers = {"GNU.sparse.map": "x"}
        data = b"\x80\x02}q\x00."
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError), tarfile.open(path):
        pass
    for target in (path, tmp_path):
        report = scan(target)
        assert [f.verdict for f in report.files] == ["unreadable"]
        assert "the tar archive cannot be read (ValueError" in report.files[0].error
    code, _, err = run_ckpt("inspect", path, code=None)
    assert code == 4 and "Traceback" not in err and len(err.strip().splitlines()) == 1

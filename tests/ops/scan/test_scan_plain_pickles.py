"""``scan`` walks a file that is a pickle to its end, whatever opcode starts it and however
many pickles it holds: a payload past its first 64 KiB, in a pickle cut short, or after many
benign pickles is dangerous (and an ``.npy`` of objects however its header spells the dtype).
The oracle is a loader in a child process, which creates a marker file where it runs code."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest

from ckpt_tools import scan
from tests.helpers.child_oracle import run_script


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _opens(marker: Path) -> bytes:
    """Opcodes that call builtins.open(marker, "w"), which creates the marker."""
    return _short("builtins") + _short("open") + b"\x93" + _short(str(marker)) + _short("w")


def _call(marker: Path) -> bytes:
    return _opens(marker) + b"\x86R"


def _runs(path: Path, marker: Path, loader: str) -> bool:
    """Whether ``loader`` (Python reading the file ``f``) creates ``marker`` in a child."""
    module = loader.split(".")[0].split()[-1]
    code = f"import {module}\nf = open({str(path)!r}, 'rb')\ntry:\n    {loader}\n"
    code += "except Exception:\n    pass"
    run_script(code, preload=(module,), check=True)
    return marker.exists()


_PAD = b"X" + (70000).to_bytes(4, "little") + b"a" * 70000 + b"0"  # a string, popped


@pytest.mark.parametrize(
    ("shape", "build"),
    [
        (
            "protocol 1 dict",
            lambda m: (
                b"}q\x00(X\x03\x00\x00\x00pad"
                + _PAD[:-1]
                + b"X\x01\x00\x00\x00x"
                + _call(m)
                + b"u."
            ),
        ),
        ("text first", lambda m: _PAD + _call(m) + b"."),
        ("None first", lambda m: b"N0" + _PAD + _call(m) + b"."),
        ("mark first", lambda m: b"(" + _PAD + _call(m) + b"l."),
        ("cut short", lambda m: _call(m)),
        ("cut short, popped", lambda m: _call(m) + b"0"),
        (
            "in a FRAME, cut short",
            lambda m: b"\x95" + len(_call(m)).to_bytes(8, "little") + _call(m),
        ),
    ],
)
def test_a_payload_anywhere_in_a_pickle_file_is_dangerous(
    tmp_path: Path, shape: str, build
) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "models"
    folder.mkdir()
    path = folder / "pytorch_model.bin"
    path.write_bytes(build(marker))
    assert _runs(path, marker, "torch.load(f, weights_only=False)"), shape
    for target in (path, folder):  # named, and found in a folder
        report = scan(target)
        assert [f.verdict for f in report.files] == ["dangerous"], shape
        assert report.skipped == ()


def test_the_python_pickle_of_a_large_object_is_walked_whole(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Opens:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(pickle.dumps({"pad": "a" * 70000, "x": Opens()}, protocol=1))
    assert _runs(path, marker, "pickle.load(f)")
    assert scan(tmp_path).files[0].verdict == "dangerous"


def test_a_payload_after_many_benign_pickles_is_dangerous(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "many.pkl"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=2) * 40 + b"\x80\x04" + _call(marker) + b".")
    assert _runs(path, marker, "while True: pickle.load(f)")
    found = scan(path).files[0]
    assert found.verdict == "dangerous"
    assert [f.record for f in found.findings] == ["pickle 41"]


def _npy(path: Path, descr: str, body: bytes, shape: str = "(1,)") -> None:
    header = f"{{'descr': {descr}, 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    path.write_bytes(
        b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + body
    )


@pytest.mark.parametrize(
    "descr",
    [
        "'object'",
        "'object_'",
        "[('a', '<f4'), ('b', 'object')]",
        "('object', (1,))",
        # numpy's comma and repeat strings: a field or a subarray of objects.
        "'i8,O'",
        "'(2,)O'",
        "'2O'",
        "'?,O'",
    ],
)
def test_an_npy_of_objects_is_dangerous_however_its_dtype_is_spelled(
    tmp_path: Path, descr: str
) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "array.npy"
    _npy(path, descr, b"\x80\x02" + _call(marker) + b"\x85.")
    assert _runs(path, marker, "numpy.load(f, allow_pickle=True)")
    assert [f.verdict for f in scan(tmp_path).files] == ["dangerous"]


def test_an_npy_header_in_python_2_spelling_is_read_as_numpy_reads_it(tmp_path: Path) -> None:
    # numpy drops the long suffix of a shape written by Python 2 ((1L,)), then unpickles.
    marker = tmp_path / "ran"
    path = tmp_path / "old.npy"
    _npy(path, "'|O'", b"\x80\x02" + _call(marker) + b"\x85.", shape="(1L,)")
    assert _runs(path, marker, "numpy.load(f, allow_pickle=True)")
    assert [f.verdict for f in scan(tmp_path).files] == ["dangerous"]


@pytest.mark.parametrize("method", [zipfile.ZIP_LZMA, zipfile.ZIP_BZIP2], ids=["lzma", "bzip2"])
def test_an_npz_member_compressed_otherwise_is_not_taken_for_clean(
    tmp_path: Path, method: int
) -> None:
    # numpy.load reads every method Python's zipfile reads; the scan reads stored and deflate.
    marker = tmp_path / "ran"
    _npy(tmp_path / "x.npy", "'|O'", b"\x80\x02" + _call(marker) + b"\x85.")
    path = tmp_path / "arrays.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.write(tmp_path / "x.npy", "x.npy", compress_type=method)
    (tmp_path / "x.npy").unlink()
    assert _runs(path, marker, "numpy.load(f, allow_pickle=True)['x']")
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert [f.global_name for f in found.findings] == ["<bytes not read>"]


def test_an_npz_pickle_longer_than_the_walk_is_not_taken_for_clean(tmp_path: Path) -> None:
    # 65 MiB of bytes popped, then the call: one compressed member of a few hundred KB.
    marker = tmp_path / "ran"
    pad = 65 << 20
    body = b"\x80\x03B" + pad.to_bytes(4, "little") + bytes(pad) + b"0" + _call(marker) + b"."
    _npy(tmp_path / "x.npy", "'|O'", body)
    path = tmp_path / "big.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.write(tmp_path / "x.npy", "x.npy")
    (tmp_path / "x.npy").unlink()
    assert _runs(path, marker, "numpy.load(f, allow_pickle=True)['x']")
    (found,) = scan(path).files
    assert found.verdict == "dangerous"
    assert "<bytes not read>" in {f.global_name for f in found.findings}


def test_a_broken_protocol_0_pickle_named_as_a_checkpoint_is_scanned_in_a_folder(
    tmp_path: Path,
) -> None:
    # torch.load unpickles it (its "magic number") and runs the call before the bad byte.
    marker = tmp_path / "ran"
    folder = tmp_path / "models"
    folder.mkdir()
    text = f"cbuiltins\nopen\n(S'{marker}'\nS'w'\ntR\xff".encode("latin-1")
    (folder / "model.bin").write_bytes(text)
    # Under any other name, a payload pickle.load runs before the bad byte is one still...
    other = tmp_path / "ran too"
    (folder / "payload.data").write_bytes(text.replace(str(marker).encode(), str(other).encode()))
    # ...while text that merely reads as protocol 0 (a GLOBAL or an INST of two lines, a
    # mark) is no pickle: it names a global, perhaps of a dangerous module, but calls none.
    texts = {
        "notes.txt": b"config\nsettings\nlearning rate: 0.1\n",
        "ops.txt": b"cos\nsin\ntan\n",
        "requirements-dev.txt": b"ipdb\nipython\nblack\n",
        "labels.txt": b"cat\ndog\nbird\n",
        "LICENSE": b"(c) 2024 the authors\nall rights reserved\nsee NOTICE\n",
        "cities.csv": b"city,country\nParis,France\nOslo,Norway\n",
    }
    for name, data in texts.items():
        (folder / name).write_bytes(data)
    assert _runs(folder / "model.bin", marker, "torch.load(f, weights_only=False)")
    assert _runs(folder / "payload.data", other, "pickle.load(f)")
    report = scan(folder)
    found = [(Path(f.path).name, f.verdict) for f in report.files]
    assert found == [("model.bin", "dangerous"), ("payload.data", "dangerous")]
    assert sorted(Path(p).name for p in report.skipped) == sorted(texts)


_LOADS = """
import os, pickle, sys, time
try:
    pickle.load(open(sys.argv[1], "rb"))
except Exception:
    pass
for _ in range(100):  # (Popen's child creates the marker a moment later)
    if os.path.exists(sys.argv[2]) or os.environ.pop("CKPT_SCAN_CANARY", None):
        print("ran")
        break
    time.sleep(0.05)
"""


@pytest.mark.parametrize("shape", ["copyreg gadget", "torch gadget", "environ filled"])
def test_a_payload_a_gadget_calls_under_another_name_is_dangerous(
    tmp_path: Path, shape: str
) -> None:
    # No direct call of the dangerous global: copyreg._reconstructor(cls, base, state) calls
    # base.__init__; torch's _rebuild_from_type_v2(func, ...) calls func; a SETITEM fills
    # os.environ. pickle.load runs each before the bad byte, whatever the file is named.
    marker = tmp_path / "ran"
    # The dangerous global, imported but not called: subprocess.Popen opens a child that
    # creates the marker (a harmless command: touch).
    popen, touch = b"csubprocess\nPopen\n", f"(S'touch'\nS'{marker}'\nl".encode()
    payload = {
        "copyreg gadget": b"ccopyreg\n_reconstructor\n(" + popen + popen + touch + b"tR\xff",
        "torch gadget": b"ctorch._tensor\n_rebuild_from_type_v2\n("
        + popen
        + b"cbuiltins\nobject\n("
        + touch
        + b"t}tR\xff",
        "environ filled": b"cos\nenviron\nS'CKPT_SCAN_CANARY'\nS'yes'\ns\xff",
    }[shape]
    folder = tmp_path / "models"
    folder.mkdir()
    path = folder / "weights.dat"
    path.write_bytes(payload)
    said = run_script(_LOADS, path, marker, preload=("pickle",), check=True)
    assert [line.strip() for line in said] == ["ran"], shape  # it runs
    for target in (path, folder):  # named, and found in a folder
        report = scan(target)
        assert [f.verdict for f in report.files] == ["dangerous"], (shape, report)

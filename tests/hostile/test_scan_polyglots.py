"""Pickles dressed as something else: a zip record with no PROTO in front, a ``data.pkl`` our
reader refuses for its size after a payload, a file whose first bytes also spell a
safetensors header. ``scan`` walks each as the loader that runs it reads it; the oracle is
that loader in a child process, which creates a marker file where it runs code."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import torch

from ckpt_tools import scan
from tests.helpers.child_oracle import run_script


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _call(marker: Path) -> bytes:
    """Opcodes with no PROTO that call builtins.open(marker, "w"), creating the marker."""
    opens = _short("builtins") + _short("open") + b"\x93"
    return opens + _short(str(marker)) + _short("w") + b"\x86R"


def _torch_zip(path: Path, data_pkl: bytes | None = None, extra: bytes | None = None) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if data_pkl is not None and info.filename.endswith("/data.pkl"):
                data = data_pkl
            out.writestr(info.filename, data)
        if extra is not None:
            out.writestr("archive/extra.pkl", extra)


def _runs(marker: Path, code: str, path: Path) -> bool:
    run_script(code, path, preload=("torch", "pickle"))
    return marker.exists()


def test_a_record_pickled_without_proto_is_walked(tmp_path: Path) -> None:
    marker, path = tmp_path / "ran", tmp_path / "model.pt"
    _torch_zip(path, extra=_call(marker) + b".")
    read = "import pickle, sys, zipfile\n"
    read += "pickle.loads(zipfile.ZipFile(sys.argv[1]).read('archive/extra.pkl'))"
    assert _runs(marker, read, path)
    found = scan(path).files[0]
    assert found.verdict == "dangerous"
    assert [(f.global_name, f.record) for f in found.findings] == [
        ("builtins.open", "archive/extra.pkl")
    ]


def test_a_payload_before_what_our_reader_refuses_is_dangerous(tmp_path: Path) -> None:
    marker, path = tmp_path / "ran", tmp_path / "model.pt"
    # After the call: a tuple that doubles 40 times through shared references, which torch
    # builds in microseconds and our reader refuses as a memo bomb.
    _torch_zip(path, data_pkl=_call(marker) + b"0N" + b"2\x86" * 40 + b".")
    load = "import sys, torch\ntorch.load(sys.argv[1], weights_only=False)"
    assert _runs(marker, load, path)
    found = scan(path).files[0]
    assert found.verdict == "dangerous"
    assert found.error is not None  # still refused, and said so
    open_found = [f for f in found.findings if f.global_name == "builtins.open"]
    assert open_found and open_found[0].position is not None
    assert not open_found[0].reason.startswith("an attribute path")


def test_a_pickle_that_spells_a_safetensors_header_is_walked(tmp_path: Path) -> None:
    marker, path = tmp_path / "ran", tmp_path / "pytorch_model.bin"
    # As safetensors: an 8-byte header length, then "{". As a pickle: LONG1 of 7 bytes (the
    # magic number torch.load reads first), then the payload in protocol 0.
    payload = f"0cbuiltins\nopen\n(V{marker}\nVw\ntR.".encode()
    path.write_bytes(b"\x8a\x07" + b"\x00" * 6 + b"{" + payload)
    load = "import sys, torch\ntorch.load(sys.argv[1], weights_only=False)"
    assert _runs(marker, load, path)
    report = scan(tmp_path)
    assert [f.verdict for f in report.files] == ["dangerous"]
    assert "builtins.open" in {f.global_name for f in report.files[0].findings}

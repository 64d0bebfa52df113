"""Globals whose names hold characters no Python class name may hold (a NUL in a GLOBAL line, a
lone surrogate in a STACK_GLOBAL string) are named and refused as any global outside the
allowlist is, never called malformed.

The oracles: torch.load(weights_only=True), which names a GLOBAL's module and name as it
refuses it, and Python's own unpickler, whose ``find_class`` is asked for the name a load
would import.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError, UnsafeContentError
from ckpt_tools.ops.rewrite.rewriting import rewrite
from tests.helpers.committed import tools
from tests.helpers.files import read_data_pkl

CKPT = str(Path(sys.executable).with_name("ckpt"))
NUL_NAME = "posix.sys\x00tem"
# {"x": posix.sys<NUL>tem()} at protocol 2: GLOBAL, EMPTY_TUPLE, NEWOBJ.
NUL_PAYLOAD = b"\x80\x02}q\x00X\x01\x00\x00\x00xcposix\nsys\x00tem\n)\x81s."
# {"x": posix.<U+D800>()} at protocol 4: the name is a SHORT_BINUNICODE of a lone surrogate.
SURROGATE_PAYLOAD = b"\x80\x04}q\x00X\x01\x00\x00\x00x\x8c\x05posix\x8c\x03\xed\xa0\x80\x93)\x81s."


def _zip_with(tmp_path: Path, payload: bytes, name: str = "g.pt") -> Path:
    """A torch.save archive whose data.pkl is ``payload``."""
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)
    path = tmp_path / name
    tools().rewrite_zip(plain, path, replace={"data.pkl": payload})
    return path


def _asked(payload: bytes) -> list[tuple[str, str]]:
    """What Python's unpickler asks ``find_class`` for, nothing imported."""

    class Recording(pickle.Unpickler):
        asked: list[tuple[str, str]] = []

        def find_class(self, module: str, name: str) -> Any:
            self.asked.append((module, name))
            return type("StandIn", (), {})

    unpickler = Recording(io.BytesIO(payload))
    unpickler.load()
    return unpickler.asked


def _ckpt(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CKPT, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_nul_in_a_global_name_is_named_as_torch_names_it(tmp_path: Path) -> None:
    path = _zip_with(tmp_path, NUL_PAYLOAD)
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"GLOBAL {NUL_NAME} whose module")):
        torch.load(path, weights_only=True)
    assert ct.inspect(str(path)).unsafe_globals == (NUL_NAME,)
    shown = _ckpt("inspect", path)
    assert shown.returncode == 0, shown.stderr
    assert "posix.sys\\x00tem (outside the allowlist" in shown.stdout
    scanned = _ckpt("scan", path)
    assert scanned.returncode == 1 and "malformed" not in scanned.stdout, scanned.stdout
    assert "dangerous: posix.sys\\x00tem" in scanned.stdout
    refused = _ckpt("strip-module", path, tmp_path / "out.pt")
    assert refused.returncode == 3, refused.stderr
    assert "outside the allowlist: posix.sys\\x00tem" in refused.stderr


@pytest.mark.parametrize(
    ("body", "name"),
    [
        (b"cposix\nsys\x00tem\n\xff", NUL_NAME),  # a failure after the global
        (b"cposix\nsys\x00temX", NUL_NAME),  # the last line without its newline
    ],
    ids=["bad-after", "no-newline"],
)
def test_a_nul_global_before_a_failure_is_refused_as_unsafe(
    tmp_path: Path, body: bytes, name: str
) -> None:
    path = tmp_path / "cut.pt"
    path.write_bytes(b"\x80\x02" + body)
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"GLOBAL {name} whose module")):
        torch.load(path, weights_only=True)
    with pytest.raises(UnsafeContentError) as info:
        ct.inspect(str(path))
    assert info.value.globals == (name,)
    refused = _ckpt("inspect", path)
    assert refused.returncode == 3 and "posix.sys\\x00tem" in refused.stderr, refused.stderr


def test_a_surrogate_in_a_stack_global_name_is_named_as_pickle_asks_for_it(
    tmp_path: Path,
) -> None:
    assert _asked(SURROGATE_PAYLOAD) == [("posix", "\ud800")]
    path = _zip_with(tmp_path, SURROGATE_PAYLOAD)
    assert ct.inspect(str(path)).unsafe_globals == ("posix.\ud800",)
    shown = _ckpt("inspect", path)
    assert shown.returncode == 0 and "posix.\\ud800 (outside the allowlist" in shown.stdout


def test_a_global_no_global_line_can_say_is_not_written(tmp_path: Path) -> None:
    # Carried through on request, a NUL is written as read; a lone surrogate cannot be.
    nul = _zip_with(tmp_path, NUL_PAYLOAD, "nul.pt")
    out = tmp_path / "nul-out.pt"
    rewrite(nul, out, allow_globals=[NUL_NAME])
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"GLOBAL {NUL_NAME} whose module")):
        torch.load(out, weights_only=True)
    written = read_data_pkl(out)
    globals_ = [a for op, a, _ in pickletools.genops(written) if op.name == "GLOBAL"]
    assert globals_ == ["posix sys\x00tem"]
    surrogate = _zip_with(tmp_path, SURROGATE_PAYLOAD, "surrogate.pt")
    with pytest.raises(ConversionError, match="cannot be written"):
        rewrite(surrogate, tmp_path / "s-out.pt", allow_globals=["posix.\ud800"])
    assert not (tmp_path / "s-out.pt").exists()

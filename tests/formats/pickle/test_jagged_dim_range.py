"""The ``_DimRange`` objects that ``torch.nested.nested_tensor(..., layout=torch.jagged)`` leaves
in an NJT's metadata are allowlisted, as ``import torch._dynamo`` allowlists them for torch
(torch's refusal of such a file tells its users to import it): read, scanned, kept and
re-emitted as torch.load(weights_only=True) builds them, and refused where torch refuses.

The oracle runs in a fresh process that imports ``torch._dynamo``; this one may not have.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.ops.scan.severity import classify
from tests.helpers.child_oracle import json_per_path

_DIM_RANGE = "torch._dynamo.decorators._DimRange"

# Each file's outcome under torch.load(weights_only=True) once torch._dynamo is imported:
# the refusal's type ('' when it loads), entry "r"'s ranges as (class, dim, min, max), and
# those of an NJT's cached sequence lengths.
_ORACLE = """
import json, sys, torch, torch._dynamo
def ranges(value):
    found = value if isinstance(value, (set, frozenset)) else {value}
    return sorted([type(r).__qualname__, r.dim, r.min, r.max] for r in found)
for path in sys.argv[1:]:
    try:
        loaded = torch.load(path, weights_only=True)
        out = {"error": "", "ranges": ranges(loaded["r"]) if "r" in loaded else None}
        for value in loaded.values():
            if isinstance(value, torch.Tensor) and value.is_nested:
                cache = value._metadata_cache
                out["njt"] = {k: ranges(v._dynamo_dynamic_range) for k, v in cache.items()}
    except Exception as e:
        out = {"error": type(e).__name__}
    print(json.dumps(out))
"""


def torch_with_dynamo(*paths: Path) -> list[dict]:
    return json_per_path(_ORACLE, *paths, preload=("torch", "torch._dynamo"))


def _njt() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


_GLOBAL = b"ctorch._dynamo.decorators\n_DimRange\n"
_NEWOBJ = _GLOBAL + b")\x81"  # _DimRange.__new__(_DimRange), as torch.save writes it


def _in_set(obj: bytes) -> bytes:
    return b"c__builtin__\nset\n]" + obj + b"a\x85R"


def _crafted(path: Path, obj: bytes) -> Path:
    """A torch zip whose pickle is ``{"r": obj}``."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}" + _text("r") + obj + b"s.")
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return path


def test_an_njt_made_by_nested_tensor_is_read_and_scanned_as_allowed(tmp_path: Path) -> None:
    path = tmp_path / "njt.pt"
    torch.save({"w": torch.ones(2), "nj": _njt()}, path)
    assert torch_with_dynamo(path)[0]["error"] == ""

    assert classify(_DIM_RANGE).severity == "allowed"
    found = ct.inspect(str(path))
    assert found.unsafe_globals == ()
    nj = found.tensor("nj")
    assert (nj.layout, list(nj.shape), nj.dtype) == ("jagged", [2, -1, 3], "float32")
    report = ct.scan([str(path)])
    assert [f.verdict for f in report.files] == ["clean"]


@pytest.mark.parametrize(
    "obj",
    [
        _in_set(_NEWOBJ + b"](K\x00NNeb"),  # torch.save's: BUILD with [dim, min, max]
        _in_set(_GLOBAL + b"(K\x00K\x01K\x08tR"),  # the dataclass called: _DimRange(0, 1, 8)
        _NEWOBJ + b"](K\x01K\x02Neb",
    ],
    ids=["saved", "called", "bare"],
)
def test_a_range_torch_builds_is_read_as_it(tmp_path: Path, obj: bytes) -> None:
    path = _crafted(tmp_path / "r.pt", obj)
    (want,) = torch_with_dynamo(path)
    assert want["error"] == ""
    value = ct.inspect(str(path))  # nothing refused, nothing unsafe
    assert value.unsafe_globals == ()
    out = tmp_path / "out.pt"
    ct.convert(str(path), str(out))  # re-emitted as torch.save writes it
    assert torch_with_dynamo(out) == [want]


@pytest.mark.parametrize(
    "obj",
    [
        _in_set(_NEWOBJ + b"](K\x00Neb"),  # two fields: its max is never set
        _in_set(_NEWOBJ + b"N}(" + _text("dim") + b"K\x00" + _text("min") + b"N" + _text("max")
                + b"Nu\x86b"),  # (None, slots): its __setstate__ zips fields with the pair
        _in_set(_NEWOBJ),  # no state at all, hashed in the set
        _in_set(_NEWOBJ + b"K\x05b"),  # a state that is not a list
    ],
    ids=["short", "slots-pair", "no-state", "int-state"],
)  # fmt: skip
def test_a_range_torch_refuses_is_refused(tmp_path: Path, obj: bytes) -> None:
    path = _crafted(tmp_path / "r.pt", obj)
    assert torch_with_dynamo(path)[0]["error"] != ""
    with pytest.raises(CorruptCheckpointError, match="_DimRange"):
        ct.inspect(str(path))


@pytest.mark.parametrize("how", ["convert", "strip_module", "sanitize"])
def test_rewrites_re_emit_the_ranges_torch_loads(tmp_path: Path, how: str) -> None:
    src, out = tmp_path / "src.pt", tmp_path / "out.pt"
    torch.save({"module.w": torch.ones(2), "module.nj": _njt()}, src)
    getattr(ct, how)(str(src), str(out))
    before, after = torch_with_dynamo(src, out)
    assert after == before
    # dim 0 of each cached sequence length, unbounded, as nested_tensor marks it
    unbounded = [["_DimRange", 0, None, None]]
    assert after["njt"] == {"max_seqlen": unbounded, "min_seqlen": unbounded}
    report = ct.scan([str(out)])
    assert [f.verdict for f in report.files] == ["clean"]

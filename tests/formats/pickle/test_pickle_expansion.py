"""The walk over a pickle's bytes finds exactly what a walk over ``pickletools.genops`` finds.

``formats/pickle/opcode_walk.py`` reads each opcode's argument in place (``scan_bytes``); a
pickle in a file is read as genops reads it, then walked the same way (``_scan_stream``). The
oracle is
the straightforward walk over genops's opcodes (``_genops_scan`` below, the product's walk
before): every committed fixture, every fuzz regression input, pickles of every protocol,
and thousands of their mutations (flipped, cut, spliced) must give the same opcodes,
protocols and malformation message, or the same refusal, from memory and from a file.
"""

from __future__ import annotations

import collections
import datetime
import io
import pickle
import pickletools
import random
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.pickle.expansion import MAX_EXPANDED_NODES, _scan_stream, scan_pickle
from ckpt_tools.formats.pickle.opcode_walk import (
    _DUP,
    _GET,
    _MARKS,
    _PLAIN,
    _SHAPES,
    MEMO_SLACK,
    OpcodeScan,
    _expands_past,
    _memo_too_far,
)
from ckpt_tools.formats.pickle.opcode_walk import scan_bytes as _scan_bytes

# (both walks decode protocol-0 STRING arguments with escapes, which Python warns about)
pytestmark = pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[3]
INPUTS = sorted(
    p
    for folder in (ROOT / "fixtures", ROOT / "tests" / "fuzz" / "regressions")
    for p in folder.rglob("*")
    if p.is_file()
    and p.stat().st_size < (8 << 20)
    and p.suffix not in (".py", ".pyc", ".md", ".json")
)


def _outcome(scan: Callable[[], OpcodeScan]) -> tuple[str, object]:
    # (Where the walk stopped is checked on its own below: genops does not say.)
    try:
        return "scanned", scan()._replace(end=None)
    except ResourceLimitError as e:
        return "refused", str(e)


def _both(data: bytes, limit: int = MAX_EXPANDED_NODES) -> tuple[object, object]:
    """(the product's scan, the oracle's); the product's from a file must equal its own."""
    fast = _outcome(lambda: _scan_bytes(data, limit))
    assert _outcome(lambda: _scan_stream(io.BytesIO(data), limit)) == fast
    oracle = _outcome(lambda: _genops_scan(io.BytesIO(data), limit))
    return fast, oracle


def _genops_scan(pickled: Any, limit: int) -> OpcodeScan:
    """The reference walk: pickletools.genops's opcodes, replayed one by one (the product's
    walk before it read bytes in place, kept here as the oracle)."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    seen: dict[str, None] = {}
    protocols: dict[int, None] = {}
    malformed: str | None = None
    try:
        for op, arg, pos in pickletools.genops(pickled):
            seen[op.name] = None
            if op.name == "PROTO":
                protocols[arg] = None
            kind, below, marked, after = _SHAPES[op.code]
            if kind == _PLAIN:
                size = 1
                if marked:
                    mark = marks.pop() if marks else 0
                    size += sum(stack[mark:])
                    del stack[mark:]
                for _ in range(below):
                    size += stack.pop() if stack else 1
                if size > limit:
                    raise _expands_past(limit)
                stack.extend([size] * after)
            elif kind == _MARKS:
                marks.append(len(stack))
            elif kind == _DUP:
                stack.append(stack[-1] if stack else 1)
            elif kind == _GET:
                stack.append(memo.get(arg, 1))
            else:  # _PUT, or MEMOIZE (which numbers the memo itself)
                if arg is not None and arg > (pos or 0) + MEMO_SLACK:
                    raise _memo_too_far(arg, pos)
                memo[len(memo) if arg is None else arg] = stack[-1] if stack else 1
    except ResourceLimitError:  # a ValueError too: a refusal, not a malformed pickle
        raise
    except ValueError as e:
        if isinstance(e, OSError):  # io.UnsupportedOperation: the reader, not the pickle
            raise
        malformed = str(e)  # the unpickler, or the caller, says it in its own words
    return OpcodeScan(tuple(seen), tuple(protocols), malformed)


def _pickles_in(path: Path) -> list[bytes]:
    """The file's bytes, and each ``.pkl`` member's when it is a readable zip."""
    data = path.read_bytes()
    found = [data]
    try:
        with zipfile.ZipFile(path) as z:
            found += [z.read(n) for n in z.namelist() if n.endswith(".pkl")]
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError, zlib.error):
        pass
    return found


def _protocol_samples() -> list[bytes]:
    od = collections.OrderedDict(a=[1, 2.5, -(2**70)], b=(None, True, False))
    shared = ("x", b"y")
    values = [
        {"w": [1, 2, 3], "s": "\u00e9\U0001f600", "b": b"\x00\xff", "big": 2**200, "f": -0.0},
        [shared, shared, {shared: shared}],
        od,
        {1, 2, 3},
        frozenset({"a"}),
        bytearray(b"abc"),
        datetime.date(2026, 11, 23),
        complex(1, -2),
        ("a" * 300, b"b" * 70000, "c" * 70000),
        [[[]] * 3] * 2,
    ]
    return [pickle.dumps(v, protocol=p) for v in values for p in range(pickle.HIGHEST_PROTOCOL + 1)]


def test_the_inputs_are_there() -> None:
    assert len(INPUTS) > 100  # the fixtures and the fuzz regressions


@pytest.mark.parametrize("path", INPUTS, ids=lambda p: p.name)
def test_committed_files_scan_the_same_both_ways(path: Path) -> None:
    for data in _pickles_in(path):
        fast, oracle = _both(data)
        assert fast == oracle


def test_every_protocol_scans_the_same_both_ways() -> None:
    samples = _protocol_samples()
    names = set()
    for data in samples:
        fast, oracle = _both(data)
        assert fast == oracle
        assert fast[0] == "scanned" and fast[1].malformed is None  # type: ignore[union-attr]
        names.update(fast[1].opcodes)  # type: ignore[union-attr]
    # Text opcodes (read by pickletools in both walks) and the binary ones read in place.
    assert {"GLOBAL", "PUT", "GET", "INT", "UNICODE", "FLOAT", "LONG"} <= names
    assert {"SHORT_BINUNICODE", "BINUNICODE", "LONG1", "BINBYTES", "FRAME", "MEMOIZE"} <= names
    assert {"STACK_GLOBAL", "BYTEARRAY8", "EMPTY_SET", "FROZENSET", "BINFLOAT"} <= names


def _mutants(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        b = bytearray(data)
        how = rng.randrange(5)
        i = rng.randrange(len(b))
        if how == 0:
            b[i] = rng.randrange(256)
        elif how == 1:
            del b[i:]
        elif how == 2:
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randrange(1, 9)]
        elif how == 3:
            b[i : i + 4] = rng.randbytes(4)
        else:
            del b[i : i + rng.randrange(1, 6)]
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_mutated_pickles_scan_the_same_both_ways(seed: int) -> None:
    rng = random.Random(20261123 + seed)
    bases = _protocol_samples()
    bases += [p for path in INPUTS[:: 7 + seed] for p in _pickles_in(path)[1:]][:20]
    outcomes = collections.Counter()
    for base in bases:
        for data in _mutants(base, rng, 40):
            for limit in (MAX_EXPANDED_NODES, 40):
                fast, oracle = _both(data, limit)
                assert fast == oracle, (base[:40], data[:80], limit)
                kind, result = fast
                if kind == "scanned":
                    kind = "malformed" if result.malformed else "clean"  # type: ignore[union-attr]
                outcomes[kind] += 1
    # The mutations reach every outcome: clean scans, genops' errors, and refusals.
    assert min(outcomes.values()) > 20 and len(outcomes) == 3, outcomes


def test_a_memo_bomb_is_refused_both_ways() -> None:
    bomb = b"\x80\x02}N" + b"2\x86" * 40 + b"N" + b"s."
    fast, oracle = _both(bomb)
    assert fast == oracle and fast[0] == "refused"
    with pytest.raises(ResourceLimitError, match="memo bomb"):
        scan_pickle(bomb)


def test_a_far_memo_index_is_refused_both_ways() -> None:
    far = b"\x80\x02N" + b"r" + (2**31).to_bytes(4, "little") + b"."
    fast, oracle = _both(far)
    assert fast == oracle and fast[0] == "refused"
    assert "memo index 2,147,483,648 at byte 3" in str(fast[1])


def test_the_walk_says_where_it_stopped() -> None:
    """Past the STOP of a whole pickle; at the opcode it could not read otherwise (the
    unpickler is given no byte past it: ``I0x1`` is an int to the C unpickler)."""
    whole = pickle.dumps({"a": [1, 2]}, protocol=2)
    assert scan_pickle(whole + b"junk").end == len(whole)
    hex_int = b"\x80\x02I0x1\n0N."
    scan = scan_pickle(hex_int)
    assert scan.malformed and scan.end == 2
    assert _scan_stream(io.BytesIO(hex_int), MAX_EXPANDED_NODES).end == 2

"""The static walk names every import a pickle performs, as Python's own unpickler does.

The oracle is ``pickle.Unpickler`` itself, whose ``find_class`` is replaced by one that
records what it is asked for and returns a harmless stand-in (so nothing is imported or
run): the walk must list the same globals, in the same order, for every pickle of the scan
corpus (hand-written opcodes: memoized STACK_GLOBAL operands, INST, OBJ, protocol 0 text,
dotted names) and of the fixtures.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ckpt_tools.formats.pickle.imports import find_imports, python3_qualname, starts_like_pickle
from tests.helpers.committed import fixture_path
from tests.helpers.scan_corpus import PICKLE_LOAD, build_corpus, zip_records


class _StandIn(dict):
    """Accepts any call, state, item or element: what a recorded global turns into."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        return _StandIn()

    def __setstate__(self, state: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return _StandIn()

    def __hash__(self) -> int:  # type: ignore[override]
        return id(self)

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


class _Recording(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Python's pure unpickler, recording each find_class call, as Python 3 maps it."""

    def __init__(self, data: bytes, encoding: str = "latin-1") -> None:
        super().__init__(io.BytesIO(data), encoding=encoding)
        self.asked: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        self.asked.append(f"{module}.{name}")
        return _StandIn

    def persistent_load(self, pid: Any) -> Any:
        return _StandIn()


def _oracle(data: bytes, encoding: str = "latin-1") -> list[str]:
    unpickler = _Recording(data, encoding)
    # A stand-in cannot be everything; what was asked for before a failure counts.
    with contextlib.suppress(Exception):
        unpickler.load()
    return unpickler.asked


def _pickles(tmp_path: Path) -> dict[str, bytes]:
    """Every pickle of the corpus's plain-pickle files and of the fixtures' zips."""
    folder, markers = tmp_path / "corpus", tmp_path / "markers"
    folder.mkdir()
    markers.mkdir()
    found = {
        e.name: e.path.read_bytes() for e in build_corpus(folder, markers) if e.load == PICKLE_LOAD
    }
    for name in ("plain.pt", "evil.pt", "lightning.ckpt", "torchscript.pt", "trainer_adam.pt"):
        for record, data in zip_records(fixture_path(name).read_bytes()).items():
            if record.endswith(".pkl"):
                found[f"{name}:{record}"] = data
    found["numbers_p0.pkl"] = fixture_path("numbers_p0.pkl").read_bytes()
    return found


def test_the_walk_names_what_the_unpickler_imports(tmp_path: Path) -> None:
    pickles = _pickles(tmp_path)
    assert len(pickles) >= 25
    for name, data in pickles.items():
        walked = [i.qualname for i in find_imports(data).imports]
        assert walked == _oracle(data), name


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_every_protocol(protocol: int) -> None:
    import collections

    data = pickle.dumps([collections.OrderedDict(a=1), {1, 2}, b"x", 1.5], protocol=protocol)
    scan = find_imports(data)
    assert scan.end == len(data) and scan.malformed is None
    assert [i.qualname for i in scan.imports] == _oracle(data)


def test_computed_and_extension_globals_are_reported_unresolved() -> None:
    # STACK_GLOBAL on operands a call built: the walk cannot know them, and says so.
    computed = b"\x80\x04cbuiltins\nstr\n)R\x8c\x06system\x93."
    ext = b"\x80\x02\x82\x07."
    assert [i.qualname for i in find_imports(computed).imports] == [
        "builtins.str",
        "<computed global>",
    ]
    assert [(i.opcode, i.qualname) for i in find_imports(ext).imports] == [
        ("EXT1", "<copyreg extension code>")
    ]


def test_a_malformed_pickle_keeps_the_imports_before_the_fault() -> None:
    scan = find_imports(b"\x80\x02cposix\nsystem\n\xff")
    assert [i.qualname for i in scan.imports] == ["posix.system"]
    assert scan.end is None and scan.malformed and not scan.truncated
    cut = find_imports(b"\x80\x02cposix\nsystem\nX\x10\x00\x00\x00ab")
    assert cut.truncated and [i.qualname for i in cut.imports] == ["posix.system"]


def test_pickles_back_to_back_from_an_offset() -> None:
    first, second = pickle.dumps(1, protocol=2), pickle.dumps(Path("x"), protocol=2)
    data = first + second
    assert find_imports(data).end == len(first)
    scan = find_imports(io.BytesIO(data), len(first))
    assert scan.end == len(data) and [i.qualname for i in scan.imports] == ["pathlib.PosixPath"]


def test_helpers() -> None:
    assert starts_like_pickle(pickle.dumps(1, protocol=0))
    assert not starts_like_pickle(b"PK\x03\x04") and not starts_like_pickle(b"")
    assert python3_qualname("__builtin__.set") == "builtins.set"
    assert python3_qualname("mypackage.Net") == "mypackage.Net"


def test_a_zip_record_read_through_zipfile_matches(tmp_path: Path) -> None:
    with zipfile.ZipFile(fixture_path("evil.pt")) as z:
        data = z.read("archive/data.pkl")
    assert "posix.system" in [i.qualname for i in find_imports(data).imports]


@pytest.mark.parametrize("length", [1 << 63, (1 << 64) - 1, 1 << 40])
def test_a_declared_length_no_file_holds_ends_the_walk_as_malformed(length: int) -> None:
    # MARK, then BINUNICODE8 or BINBYTES8 with an 8-byte length: how a float tensor's bytes
    # may begin (float32 [-0.7834, -0.6990, ...] start with 28 8d).
    for opcode in (b"\x8d", b"\x8e"):
        data = b"(" + opcode + length.to_bytes(8, "little") + b"rest of the bytes"
        scan = find_imports(data)
        assert scan.imports == () and scan.end is None and scan.malformed
        with io.BytesIO(data) as f:
            assert find_imports(f).end is None


@pytest.mark.parametrize("length", [1 << 63, (1 << 64) - 1, 1 << 40])
def test_a_frame_no_file_holds_ends_the_walk_as_truncated(length: int) -> None:
    # pickle.load: OverflowError past sys.maxsize, else it runs out of bytes.
    data = b"\x80\x04\x95" + length.to_bytes(8, "little") + b"}."
    for source in (data, io.BytesIO(data)):
        scan = find_imports(source)
        assert scan.imports == () and scan.end is None and scan.truncated


# STRING arguments feeding a STACK_GLOBAL: quotes and escapes as pickle reads them.
_STRING_GLOBALS = {
    "hex-escapes": b"S'p\\x6fsix'\nS'sys\\x74em'\n\x93.",
    "octal-escape": b"S'\\160osix'\nS\"system\"\n\x93.",
    "escaped-quote": b"S'it\\'s'\nS'system'\n\x93.",
    "mismatched-quotes": b"S\"posix'\nS'system'\n\x93.",
    "unquoted": b"Sposix\nS'system'\n\x93.",
    "bad-escape": b"S'posix\\x'\nS'system'\n\x93.",
    "protocol-2-binstring": b"\x80\x02U\x0b__builtin__U\x04eval\x93.",
}


@pytest.mark.parametrize("data", _STRING_GLOBALS.values(), ids=_STRING_GLOBALS)
def test_string_operands_are_read_as_pickle_reads_them(data: bytes) -> None:
    scan = find_imports(data)
    assert [i.qualname for i in scan.imports] == _oracle(data)
    # What Python's unpickler refuses before its STACK_GLOBAL, the walk calls malformed there.
    assert (scan.malformed is None) == bool(_oracle(data))


@pytest.mark.parametrize(
    ("data", "encoding"),
    [(b"S'\xc3\xa9'\nS'x'\n\x93.", "utf-8"), (b"S'\xe9'\nS'x'\n\x93.", "latin-1")],
    ids=["utf-8", "not-utf-8"],
)
def test_python2_strings_are_named_as_a_loader_that_takes_them_decodes_them(
    data: bytes, encoding: str
) -> None:
    # torch.load decodes Python 2 strings as UTF-8; bytes that are not UTF-8 are named as a
    # latin-1 loader (numpy.load(encoding="latin1")) imports them.
    assert [i.qualname for i in find_imports(data).imports] == _oracle(data, encoding) == ["é.x"]


def test_inst_lines_are_ascii_as_pickle_reads_them() -> None:
    named, refused = b"(iposix\nsystem\n.", b"(iposix\nsyst\xc3\xa9m\n."
    assert [i.qualname for i in find_imports(named).imports] == _oracle(named) == ["posix.system"]
    for encoding in ("latin-1", "utf-8"):
        assert _oracle(refused, encoding) == []
    scan = find_imports(refused)
    assert scan.imports == () and scan.malformed and "ascii" in scan.malformed
    # The C unpickler, which pickle.load uses, refuses it too.
    with pytest.raises(UnicodeDecodeError, match="ascii"):
        pickle.loads(refused)


_PROTOCOL_NAMES = {
    "global-protocol-4": b"\x80\x04c__builtin__\neval\n.",
    "global-protocol-2": b"\x80\x02c__builtin__\neval\n.",
    "stack-global-protocol-2": b"\x80\x02X\x0b\x00\x00\x00__builtin__X\x04\x00\x00\x00eval\x93.",
    "last-proto-4": b"\x80\x02\x80\x04c__builtin__\neval\n.",
    "last-proto-2": b"\x80\x04\x80\x02c__builtin__\neval\n.",
    "inst-protocol-0": b"(icopy_reg\n_reconstructor\n.",
}


@pytest.mark.parametrize("data", _PROTOCOL_NAMES.values(), ids=_PROTOCOL_NAMES)
def test_python2_names_are_mapped_only_below_protocol_3(data: bytes) -> None:
    assert [i.qualname for i in find_imports(data).imports] == _oracle(data)


def test_a_frame_longer_than_the_file_is_not_read_into_memory() -> None:
    # The walk can tell the stream's end: nothing of the frame is kept to be dropped.
    import tracemalloc

    stream = io.BytesIO(b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + bytes(32 << 20))
    tracemalloc.start()
    try:
        scan = find_imports(stream)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert scan.truncated and peak < 4 << 20, peak

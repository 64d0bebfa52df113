"""Which record torch reads for a name, and that we read that record too or refuse.

torch's reader finds a record with miniz's ``mz_zip_reader_locate_file``: a binary search over
the names sorted without regard to ASCII case, so ``archive/DATA.PKL`` answers a lookup of
``archive/data.pkl``, and of two records that differ only in case torch reads one by the order
of its sort, not ours. It takes the archive's folder from the first record and refuses an
archive with any record outside it (compared exactly), and lists every record name as UTF-8
text. Each case below edits a ``torch.save`` file, and ``torch.load`` is the oracle: what it
refuses we refuse, what it reads we read the same or refuse, and an archive where a name
torch looks up matches several records is refused naming them.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tools import load_state_dict
from ckpt_tools.errors import CorruptCheckpointError
from tests.helpers.cli import run_ckpt

Records = list[tuple[str, bytes]]

# Every name torch.load looks up in a torch.save archive, and other bytes for a twin of it.
LOOKED_UP: dict[str, bytes] = {
    "data.pkl": pickle.dumps({"other": 1}, protocol=2),
    "version": b"99\n",
    ".data/version": b"99\n",
    "byteorder": b"big",
    ".format_version": b"1",
    ".storage_alignment": b"xx",
    ".data/serialization_id": b"\xff\xfe",
    "data/0": bytes(24),
}


def _saved(tmp_path: Path, data_version: bool = False) -> Records:
    """The records of a small ``torch.save`` file; with a ``.data/version`` record added
    (which torch reads instead of ``version`` where there is one) if ``data_version``."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32)}, good)
    with zipfile.ZipFile(good) as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    root = records[0][0].partition("/")[0]
    return [*records, (f"{root}/.data/version", b"3\n")] if data_version else records


def _write(path: Path, records: Records) -> Path:
    """The records as a zip; a name of bytes that are not UTF-8 is spelled with surrogate
    escapes (written as one placeholder byte each, then replaced by the escaped byte)."""

    def placeholder(name: str) -> str:
        return "".join("\x01" if "\udc80" <= c <= "\udcff" else c for c in name)

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(zipfile.ZipInfo(placeholder(name)), data)
    raw = path.read_bytes()
    for name, _ in records:
        if placeholder(name) != name:
            raw = raw.replace(placeholder(name).encode(), name.encode("utf-8", "surrogateescape"))
    path.write_bytes(raw)
    return path


def _upper(rel: str) -> str:
    return rel.upper() if rel != "data/0" else "DATA/0"


def _twin(rel: str, before: bool) -> Callable[[Records], Records]:
    """A record spelled as ``rel`` but for case, with other bytes, before or after it."""

    def change(records: Records) -> Records:
        root = records[0][0].partition("/")[0]
        at = next(i for i, (n, _) in enumerate(records) if n == f"{root}/{rel}")
        twin = (f"{root}/{_upper(rel)}", LOOKED_UP[rel])
        return [*records[: at + (not before)], twin, *records[at + (not before) :]]

    return change


def _respelled(rel: str) -> Callable[[Records], Records]:
    """The record ``rel`` renamed to its upper-case spelling (torch still finds it)."""

    def change(records: Records) -> Records:
        root = records[0][0].partition("/")[0]
        return [(f"{root}/{_upper(rel)}" if n == f"{root}/{rel}" else n, d) for n, d in records]

    return change


def _renamed(how: Callable[[str, str], str], which: int = 0) -> Callable[[Records], Records]:
    """data.pkl copied under another spelling (``how(root, rel)``), at position ``which``."""

    def change(records: Records) -> Records:
        root = records[0][0].partition("/")[0]
        copy = (how(root, "data.pkl"), LOOKED_UP["data.pkl"])
        return [*records[:which], copy, *records[which:]]

    return change


def _both_read(path: Path) -> tuple[dict | None, dict | None, str]:
    """``(torch's state dict, ours, our refusal)``, each None where that reader refuses."""
    try:
        theirs = torch.load(path, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, UnicodeDecodeError, ValueError):
        theirs = None
    try:
        return theirs, load_state_dict(path), ""
    except CorruptCheckpointError as e:
        return theirs, None, str(e)


BOTH_READ, BOTH_REFUSE, WE_REFUSE = "both read", "both refuse", "torch reads, we refuse"
AMBIGUOUS = "ambiguous: we refuse naming both records"
CASES: dict[str, tuple[Callable[[Records], Records], str]] = {
    **{f"twin after {rel}": (_twin(rel, before=False), AMBIGUOUS) for rel in LOOKED_UP},
    **{f"twin before {rel}": (_twin(rel, before=True), AMBIGUOUS) for rel in LOOKED_UP},
    **{f"only {_upper(rel)}": (_respelled(rel), WE_REFUSE) for rel in LOOKED_UP},
    # The folder comes from the first record and is compared exactly.
    "folder in upper case, later": (_renamed(lambda r, n: f"{r.upper()}/{n}", 1), BOTH_REFUSE),
    "folder in upper case, first": (_renamed(lambda r, n: f"{r.upper()}/{n}", 0), BOTH_REFUSE),
    "a leading folder, later": (_renamed(lambda r, n: f"x/{r}/{n}", 1), BOTH_REFUSE),
    "a leading folder, first": (_renamed(lambda r, n: f"x/{r}/{n}", 0), BOTH_REFUSE),
    "backslash, later": (_renamed(lambda r, n: f"{r}\\{n}", 1), BOTH_REFUSE),
    "backslash, first": (_renamed(lambda r, n: f"{r}\\{n}", 0), BOTH_REFUSE),
    # No path is normalised: these are other names, and torch reads the real data.pkl.
    "a doubled slash": (_renamed(lambda r, n: f"{r}//{n}", 1), BOTH_READ),
    "a dot segment": (_renamed(lambda r, n: f"{r}/./{n}", 1), BOTH_READ),
    "a trailing space": (_renamed(lambda r, n: f"{r}/{n} ", 1), BOTH_READ),
    "a name that is not UTF-8": (_renamed(lambda r, n: f"{r}/x\udcff", 1), BOTH_REFUSE),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_we_read_the_record_torch_reads_or_refuse(tmp_path: Path, case: str) -> None:
    change, expected = CASES[case]
    records = _saved(tmp_path, data_version=".data/version" in case.lower())
    path = _write(tmp_path / "case.pt", change(records))
    theirs, ours, refusal = _both_read(path)
    if expected == BOTH_READ:
        assert theirs is not None and ours is not None
        assert list(ours) == list(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    elif expected == BOTH_REFUSE:
        assert theirs is None and ours is None
    elif expected == WE_REFUSE:
        assert theirs is not None and ours is None
        assert "the one torch reads as" in refusal
    else:
        # torch reads one of the two (by its sort; a twin of bad bytes makes it refuse).
        assert ours is None
        assert "both answer torch's lookup" in refusal and "ignores case" in refusal


def test_torch_reads_one_twin_or_the_other_by_their_order(tmp_path: Path) -> None:
    """Which of two twins torch reads depends on where they lie: no order-free rule
    picks torch's record, hence the refusal."""
    picked = set()
    for before in (True, False):
        path = _write(tmp_path / f"{before}.pt", _twin("data.pkl", before)(_saved(tmp_path)))
        picked.add(tuple(torch.load(path, weights_only=True)))
    assert picked == {("w",), ("other",)}


def test_version_is_looked_up_only_without_data_version(tmp_path: Path) -> None:
    """torch reads ``.data/version`` where there is one and never looks up ``version``:
    a twin of ``version`` is then no ambiguity, for torch or for us."""
    records = _twin("version", before=False)(_saved(tmp_path, data_version=True))
    theirs, ours, _ = _both_read(_write(tmp_path / "v.pt", records))
    assert theirs is not None and ours is not None and list(ours) == list(theirs)


def test_torch_reads_the_twin_after_data_pkl(tmp_path: Path) -> None:
    """The shape that made the reader unsafe: a data.pkl that a case-sensitive reader takes,
    and a twin after it that torch reads instead (here a benign dict; in the wild a payload)."""
    path = _write(tmp_path / "twin.pt", _twin("data.pkl", before=False)(_saved(tmp_path)))
    assert torch.load(path, weights_only=True) == {"other": 1}
    with pytest.raises(CorruptCheckpointError, match="both answer torch's lookup"):
        load_state_dict(path)


def test_an_ambiguous_archive_is_exit_4_naming_both_records(tmp_path: Path) -> None:
    path = _write(tmp_path / "twin.pt", _twin("data.pkl", before=True)(_saved(tmp_path)))
    res = run_ckpt("inspect", str(path), code=4)
    assert len(res.stderr.strip().splitlines()) == 1
    assert "/DATA.PKL'" in res.stderr and "/data.pkl'" in res.stderr

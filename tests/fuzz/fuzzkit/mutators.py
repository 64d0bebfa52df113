"""Structure-aware mutators for torch zips, legacy pickles, tar files, safetensors and pickles.

Each mutator takes the file's bytes and a :class:`~fuzzkit.draw.Draw` and returns new bytes,
or None when it does not apply (the driver then falls back to a byte-level mutator). Names
are ``<family>.<what>``; :data:`FORMAT_DECISIONS` lists those that change which bytes a reader
takes as the file (prepended bytes, duplicate entries, ...), which the oracle reports as
finding class 1 (read differently from torch) rather than 7 (validation below the format).
"""

from __future__ import annotations

from typing import Any

from .draw import Draw
from .mutate_legacy import LEGACY_MUTATORS, LEGACY_WEIGHTS, TAR_MUTATORS, TAR_WEIGHTS
from .mutate_pickle import mutate_pickle
from .mutate_st import ST_MUTATORS, ST_WEIGHTS
from .mutate_zip import ZIP_MUTATORS, ZIP_WEIGHTS
from .seeds import Seed, kind_of

FORMAT_DECISIONS = frozenset(
    {
        "zip.prefix",
        "zip.duplicate",
        "zip.comment",
        "zip.local_name",
        "zip.method_lie",
        "zip.eocd",
        "zip.reorder",
        "tar.duplicate",
        "st.duplicate_key",
        "legacy.prefix",
        "any.splice",
    }
)


# ---------------------------------------------------------------------------------------------
# Bytes, for any file


def g_truncate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    names.append("any.truncate")
    return data[: d.int(0, max(0, len(data) - 1))]


def g_flip(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    if not data:
        return None
    out = bytearray(data)
    for _ in range(d.int(1, 4)):
        out[d.index(out)] ^= 1 << d.int(0, 7)
    names.append("any.flip")
    return bytes(out)


def g_insert(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    at = d.int(0, len(data))
    names.append("any.insert")
    return data[:at] + d.bytes(1, 16) + data[at:]


def g_delete(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    if len(data) < 2:
        return None
    at = d.int(0, len(data) - 1)
    names.append("any.delete")
    return data[:at] + data[at + d.int(1, 64) :]


def g_splice(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    from .seeds import built_seeds

    other = d.choice(built_seeds()).data
    at, cut = d.int(0, len(data)), d.int(0, len(other))
    names.append("any.splice")
    return data[:at] + other[cut:]


def g_append(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    names.append("any.append")
    return data + d.bytes(1, 64)


ANY_MUTATORS = {
    "truncate": g_truncate,
    "flip": g_flip,
    "insert": g_insert,
    "delete": g_delete,
    "splice": g_splice,
    "append": g_append,
}


def _weighted(table: dict[str, Any], weights: dict[str, int]) -> tuple[str, ...]:
    return tuple(n for n in table for _ in range(weights.get(n, 1)))


FAMILIES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "zip": (ZIP_MUTATORS, _weighted(ZIP_MUTATORS, ZIP_WEIGHTS)),
    "torchscript": (ZIP_MUTATORS, _weighted(ZIP_MUTATORS, ZIP_WEIGHTS)),
    "legacy": (LEGACY_MUTATORS, _weighted(LEGACY_MUTATORS, LEGACY_WEIGHTS)),
    "tar": (TAR_MUTATORS, _weighted(TAR_MUTATORS, TAR_WEIGHTS)),
    "safetensors": (ST_MUTATORS, _weighted(ST_MUTATORS, ST_WEIGHTS)),
}


def pickle_file(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    return mutate_pickle(data, d, names, "pickle")


def mutate_once(data: bytes, kind: str, d: Draw, names: list[str]) -> bytes:
    """One mutation: structure-aware for the format (mostly), bytes otherwise."""
    if d.bool(85):
        out = None
        try:
            if kind == "pickle":
                out = pickle_file(data, d, names)
            elif kind in FAMILIES:
                table, choices = FAMILIES[kind]
                out = table[d.choice(choices)](data, d, names)
        except Exception:
            out = None
        if out is not None:
            return out
    while True:
        out = ANY_MUTATORS[d.choice(tuple(ANY_MUTATORS))](data, d, names)
        if out is not None:
            return out


def mutate(seed: Seed, d: Draw, count: int) -> tuple[bytes, list[str]]:
    """``count`` mutations in a row, each chosen for the format the bytes now look like."""
    data, names = seed.data, []
    for i in range(count):
        kind = seed.kind if i == 0 else kind_of(data)
        if kind == "other" and seed.kind in FAMILIES:
            kind = seed.kind
        data = mutate_once(data, kind, d, names)
    return data, names

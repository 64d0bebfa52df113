"""The ``--json`` schemas of docs/formats.md, checked against what the commands print.

A schema is a ``json`` block marked ``<!-- schema: NAME; COMMAND; COMMAND ... -->``: the
commands (none for a schema that others include) run in a fresh example folder and each
prints JSON that must fit the block. The block is JSON that reads as a type:

- ``"str"``, ``"int"``, ``"float"``, ``"number"`` (int or float), ``"bool"``, ``"null"``,
  ``"any"``, or a union of them: ``"int | null"``;
- ``[S]``: a list whose items fit ``S``;
- ``{"key": S, "other?": S}``: an object with exactly these keys; ``other?`` may be absent or
  null; ``{"<what>": S}`` (one key in angle brackets) maps any key to ``S``;
- ``{"...": "NAME", ...}``: the keys of schema ``NAME`` and these;
- ``{"one of": [S1, S2, ...]}``: a value that fits one of them (each must be seen).

Fitting every output is half of it: each optional key, each mapped key and each list of
objects or lists must be seen (not null, not empty) at least once across all outputs, so that
the page cannot describe a field the commands no longer print.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tests.docs.blocks import Block

_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (float,),
    "number": (int, float),
    "bool": (bool,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Schema:
    """One schema block: its name, the commands that must fit it, and the type it describes."""

    name: str
    commands: tuple[str, ...]
    shape: Any
    where: str


@dataclass
class Checker:
    """Fits outputs to schemas and remembers which optional parts were seen."""

    schemas: dict[str, Schema]
    errors: list[str] = field(default_factory=list)
    seen: set[tuple[int, str]] = field(default_factory=set)
    expected: dict[tuple[int, str], str] = field(default_factory=dict)

    def fit(self, value: Any, shape: Any, path: str) -> None:
        """Record in ``errors`` every place where ``value`` does not fit ``shape``."""
        if isinstance(shape, str):
            self._scalar(value, shape, path)
        elif isinstance(shape, list):
            self._list(value, shape, path)
        elif set(shape) == {"one of"}:
            self._one_of(value, shape["one of"], path)
        elif not isinstance(value, dict):
            self.errors.append(f"{path}: expected an object, got {value!r}")
        elif len(shape) == 1 and next(iter(shape)).startswith("<"):
            self._map(value, shape, path)
        else:
            self._object(value, shape, path)

    def unseen(self) -> list[str]:
        """Optional keys and list items that no output showed."""
        return [
            f"{where}: never seen in any output"
            for key, where in self.expected.items()
            if key not in self.seen
        ]

    def _scalar(self, value: Any, shape: str, path: str) -> None:
        names = [n.strip() for n in shape.split("|")]
        unknown = [n for n in names if n not in _SCALARS and n != "any"]
        if unknown:
            self.errors.append(f"{path}: unknown type {unknown} in the schema")
        elif "any" not in names and not any(_is(value, n) for n in names):
            self.errors.append(f"{path}: {value!r} is not {shape}")

    def _list(self, value: Any, shape: list[Any], path: str) -> None:
        key = (id(shape), "[]")
        if not isinstance(shape[0], str):  # a list of scalars may be empty in every output
            self.expected.setdefault(key, f"{path}[]")
        if not isinstance(value, list):
            self.errors.append(f"{path}: expected a list, got {value!r}")
            return
        for i, item in enumerate(value):
            self.seen.add(key)
            self.fit(item, shape[0], f"{path}[{i}]")

    def _one_of(self, value: Any, forms: list[Any], path: str) -> None:
        for form in forms:
            self.expected.setdefault((id(form), "form"), f"{path} (form with {form_name(form)})")
        tries = []
        for form in forms:
            key = (id(form), "form")
            trial = Checker(self.schemas)
            trial.fit(value, form, path)
            if not trial.errors:
                self.seen |= trial.seen | {key}
                for part, where in trial.expected.items():
                    self.expected.setdefault(part, where)
                return
            tries.append(trial.errors)
        fewest = min(tries, key=len)
        self.errors.append(f"{path}: fits none of the {len(forms)} forms; closest: {fewest}")

    def _map(self, value: dict[str, Any], shape: dict[str, Any], path: str) -> None:
        ((name, item),) = shape.items()
        key = (id(shape), name)
        self.expected.setdefault(key, f"{path}.{name}")
        for k, v in value.items():
            self.seen.add(key)
            self.fit(v, item, f"{path}.{k}")

    def _object(self, value: dict[str, Any], shape: dict[str, Any], path: str) -> None:
        fields = self._fields(shape)
        for name in sorted(set(value) - set(fields)):
            self.errors.append(f"{path}.{name}: printed, not in the schema")
        for name, (owner, optional, item) in fields.items():
            if name not in value and not optional:
                self.errors.append(f"{path}.{name}: in the schema, not printed")
                continue
            if optional:
                self.expected.setdefault((owner, name), f"{path}.{name}?")
            if value.get(name) is None and optional:
                continue
            self.seen.add((owner, name))
            self.fit(value.get(name), item, f"{path}.{name}")

    def _fields(self, shape: dict[str, Any]) -> dict[str, tuple[int, bool, Any]]:
        """Each key: the id of the dict it is written in, whether it is optional, its type."""
        fields: dict[str, tuple[int, bool, Any]] = {}
        base = shape.get("...")
        if base is not None:
            fields.update(self._fields(self.schemas[base].shape))
        for key, item in shape.items():
            if key != "...":
                fields[key.rstrip("?")] = (id(shape), key.endswith("?"), item)
        return fields


def schema_of(block: Block) -> Schema:
    """The schema a marked ``json`` block describes."""
    name, *commands = (part.strip() for part in block.markers["schema"].split(";"))
    return Schema(name, tuple(c for c in commands if c), json.loads(block.text), block.id)


def form_name(form: Any) -> str:
    """How a form of a ``one of`` is named in messages: by its first key."""
    return repr(next(iter(form))) if isinstance(form, dict) and form else repr(form)


def _is(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name != "bool":
        return False  # JSON true is not a number
    return isinstance(value, _SCALARS[name])

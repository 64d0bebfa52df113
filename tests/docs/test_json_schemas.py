"""The ``--json`` schemas of docs/formats.md describe what the commands print, exactly.

Each schema's commands run in one fresh example folder; every output must fit its schema,
and every optional part of a schema must show up in some output (see ``schemas.py``). A
command naming ``{zero_run}`` reads a DeepSpeed ZeRO run, which only DeepSpeed training on
several ranks makes: it runs beside the session's ZeRO runs (``zero_runs``), in its own test.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.docs.blocks import all_blocks
from tests.docs.schemas import Checker, Schema, schema_of
from tests.docs.workspace import fresh_copy
from tests.helpers import run_ckpt

SCHEMAS = {s.name: s for s in (schema_of(b) for b in all_blocks() if "schema" in b.markers)}
# What formats.md promises: a schema for each command that prints JSON of its own kind.
DOCUMENTED = {"inspect", "diff", "scan", "write-result"}
ZERO_RUN = "{zero_run}"
# The form of inspect's format_info only a DeepSpeed folder fills, checked with the ZeRO runs.
DEEPSPEED_FORM = ".format_info (form with 'tag')"


def _output(command: str) -> object:
    words = shlex.split(command)
    assert words[0] == "ckpt" and "--json" in words, f"not a ckpt --json command: {command}"
    # Exit codes are the examples' business; here only the JSON counts (diff and scan may
    # exit 1 and still print it).
    result = run_ckpt(*words[1:], code=None)
    assert result.stdout.strip(), f"`{command}` printed no JSON:\n{result.stderr}"
    return json.loads(result.stdout)


def test_every_json_output_fits_its_schema(
    docs_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every field printed is documented with its type, and every field documented is printed."""
    monkeypatch.chdir(fresh_copy(docs_template, tmp_path / "work"))
    checker = Checker(SCHEMAS)
    for schema in SCHEMAS.values():
        for command in (c for c in schema.commands if ZERO_RUN not in c):
            checker.fit(_output(command), schema.shape, f"{schema.name} (`{command}`)")
    assert checker.errors == []
    assert [u for u in checker.unseen() if DEEPSPEED_FORM not in u] == []


def test_a_deepspeed_folder_fits_the_inspect_schema(zero_runs: Any) -> None:
    """inspect's ``format_info``, on real ZeRO runs (stage 1 and 3, two and three ranks)."""
    checker = Checker(SCHEMAS)
    runs = [zero_runs.folder(2, "z1"), zero_runs.folder(3, "z3-bf16")]
    commands = [c for s in SCHEMAS.values() for c in s.commands if ZERO_RUN in c]
    assert commands, "formats.md names no command on a DeepSpeed folder"
    for schema in SCHEMAS.values():
        for command in (c for c in schema.commands if ZERO_RUN in c):
            for run in runs:
                line = command.replace(ZERO_RUN, shlex.quote(str(run)))
                checker.fit(_output(line), schema.shape, f"{schema.name} (`{command}`)")
    assert checker.errors == []
    assert [u for u in checker.unseen() if DEEPSPEED_FORM in u] == []


def test_the_page_documents_each_kind_of_output() -> None:
    """inspect, diff, scan and the writing commands each have a schema that something runs."""
    assert set(SCHEMAS) >= DOCUMENTED, sorted(SCHEMAS)
    for name in DOCUMENTED - {"write-result"}:
        assert SCHEMAS[name].commands, f"nothing checks the {name} schema"


def test_the_checker_finds_each_kind_of_drift() -> None:
    """A field printed but not documented, one documented but gone, a type and a stale option."""
    base = Schema("base", (), {"path": "str", "size?": "int"}, "test")
    shape = {"...": "base", "count": "int", "items": [{"name": "str"}]}
    schemas = {"base": base}

    def errors(value: object) -> list[str]:
        checker = Checker(schemas)
        checker.fit(value, shape, "out")
        return checker.errors + checker.unseen()

    good = {"path": "a", "size": 1, "count": 2, "items": [{"name": "x"}]}
    assert errors(good) == []
    assert errors({**good, "extra": 1}) == ["out.extra: printed, not in the schema"]
    assert errors({k: v for k, v in good.items() if k != "count"}) == [
        "out.count: in the schema, not printed"
    ]
    assert errors({**good, "count": "2"}) == ["out.count: '2' is not int"]
    assert errors({**good, "size": None}) == ["out.size?: never seen in any output"]
    assert errors({**good, "items": []}) == ["out.items[]: never seen in any output"]


def test_the_checker_takes_one_of_several_forms() -> None:
    """A value fits one form or is an error; a form no output shows is reported."""
    shape = {"info?": {"one of": [{"tag": "str"}, {"peft_type": "str"}]}}

    def problems(*values: object) -> list[str]:
        checker = Checker({})
        for value in values:
            checker.fit(value, shape, "out")
        return checker.errors + checker.unseen()

    assert problems({"info": {"tag": "a"}}, {"info": {"peft_type": "LORA"}}) == []
    assert problems({"info": {"tag": "a"}}) == [
        "out.info (form with 'peft_type'): never seen in any output"
    ]
    error, unseen = problems({"info": {"tag": 1}}, {"info": {"peft_type": "LORA"}})
    assert error.startswith("out.info: fits none of the 2 forms")
    assert unseen == "out.info (form with 'tag'): never seen in any output"

"""The command's tables are tabulate's ``simple`` tables, whichever function lays them out.

``cli.render.table`` escapes each text cell (``structure.text.shown``: a name's control and
format characters as ``repr`` writes them), then lays out plain tables (one line of printable
ASCII a cell) with the library's ``text_table`` and leaves the rest to tabulate; the oracle is
tabulate itself, laying out the same escaped cells (the very cells, where they are safe).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from ckpt_tools.cli.render import table
from ckpt_tools.ops.inspect.inspection import inspect
from ckpt_tools.structure.text import display_width, shown
from tests.helpers import copy_fixture, run_ckpt
from tests.helpers.lora import write_tiny_adapter


def _tabulate(rows: list[list[Any]], headers: list[str]) -> str:
    rows = [[shown(c) if isinstance(c, str) else c for c in row] for row in rows]
    headers = [shown(h) for h in headers]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _one_line_cells(text: str) -> bool:
    """Whether every line of a table is printable: no cell brought a control character."""
    return all(line.isprintable() for line in text.split("\n"))


def test_inspect_table_is_tabulate_s(tmp_path: Path) -> None:
    names = ["fc.weight", "  padded  ", "tab\there", "line\nbreak", "\x1b[31mred\x1b[0m", "\x01"]
    names += ["幅広い", "e\u0301", "×", "1e5", "True", ""]
    path = tmp_path / "odd.pt"
    base = torch.zeros(8)
    torch.save({n: base[i : i + 2] for i, n in enumerate(names)} | {"own": torch.ones(3)}, path)
    info = inspect(path)
    for group in (False, True):
        rows = info.rows(group)
        headers = ["name", "dtype", "shape", "device", "storage", "offset", "bytes", "shared with"]
        # tabulate without wcwidth counts a wide character as one column: the rows whose
        # name is as wide as it is long are its layout; the others are aligned by width.
        narrow = [r for r in rows if display_width(shown(r[0])) == len(shown(r[0]))]
        for some in ([r for r in rows if r[0] in ("fc.weight", "own")], narrow):
            assert table(some, headers) == _tabulate(some, headers)
            assert _one_line_cells(table(some, headers))
        lines = table(rows, headers).splitlines()
        dtype_at = {display_width(line[: line.index("float32")]) for line in lines[2:]}
        assert len(rows) > len(narrow) and len(dtype_at) == 1, lines
    assert len(table(info.rows(), ["name"] * 8).splitlines()) == len(names) + 1 + 2


def test_random_tables_are_tabulate_s() -> None:
    rng = random.Random(0)
    alphabet = string.printable[:95] + "  ×\n\x1b"
    pool = ["1", "-2.50", "1e5", "nan", "True", "False", "None", "[1, 2]", "", " ", "\x01"]
    for _ in range(3000):
        width = rng.randint(1, 5)

        def cell() -> str:
            if rng.random() < 0.3:
                return rng.choice(pool)
            return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 4, 12])))

        headers = [cell() for _ in range(width)]
        rows = [[cell() for _ in range(width)] for _ in range(rng.randint(0, 4))]
        assert table(rows, headers) == _tabulate(rows, headers), (headers, rows)
        assert _one_line_cells(table(rows, headers)), (headers, rows)
        if "".join([*headers, *(c for row in rows for c in row)]).isprintable():
            raw = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
            assert table(rows, headers) == raw, (headers, rows)


def test_cells_that_are_not_text_are_tabulate_s() -> None:
    headers = ["chunk of", "offsets", "file", "at byte"]
    rows: list[list[Any]] = [["w", [0, 4], "__0_0.distcp", 128], [None, (), b"x", True]]
    assert table(rows, headers) == _tabulate(rows, headers)
    assert table([["a", "b"], ["c"]], ["x", "y"]) == _tabulate([["a", "b"], ["c"]], ["x", "y"])


def _strict(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_writes_numbers_that_are_not_finite_as_names(tmp_path: Path) -> None:
    # PEFT's LoraConfig takes lora_alpha=inf; JSON has no such number.
    adapter = write_tiny_adapter(tmp_path / "lora")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["lora_alpha"] = float("inf")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert _strict(run_ckpt("inspect", adapter, "--json").stdout)["format_info"]["alpha"] == "inf"
    base = copy_fixture("plain.pt", tmp_path)
    merge = run_ckpt("merge-lora", base, adapter, tmp_path / "m.pt", "--dry-run", "--json")
    assert _strict(merge.stdout)["merged"][0]["alpha"] == "inf"


def test_harness_json_of_a_diverged_run_is_strict(tmp_path: Path) -> None:
    out = run_ckpt(
        "harness",
        "train",
        "--strategy",
        "single",
        "--steps",
        "2",
        "--lr",
        "1e30",
        "--out",
        tmp_path,
        "--json",
    ).stdout
    losses = _strict(out)["losses"]
    assert "nan" in losses or "inf" in losses, losses
    assert _strict((tmp_path / "run.json").read_text())["losses"] == losses

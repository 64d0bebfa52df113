"""``structure.text.shown``: text made safe for a terminal, as ``repr`` escapes it.

The oracle is ``repr``: every character it escapes is escaped the same way, every other
character is left as it is; and ``text_table`` keeps one line a row whatever its cells hold.
"""

from __future__ import annotations

import sys
import unicodedata

from ckpt_tools import errors
from ckpt_tools.errors import quote_foreign
from ckpt_tools.structure.text import display_width, shown, text_table

ORDINARY = ["fc.weight", "ñ.weight", "权重", "e\u0301", "layers.{0..31}.fc ×32", "a b", "", "\\x1b"]


def test_ordinary_text_is_returned_as_it_is() -> None:
    for text in ORDINARY:
        assert shown(text) is text
        assert shown(text, lines=True) is text


def test_every_character_is_escaped_as_repr_escapes_it() -> None:
    # Controls, Latin, bidi and format marks, the lone surrogates, the start of private use,
    # the specials and the last code point: each alone shows as repr writes it (unquoted).
    for code in [*range(0x3000), *range(0xD7F0, 0xE010), *range(0xFE00, 0x10000), sys.maxunicode]:
        char = chr(code)
        expected = char if char in "'\\" else repr(char)[1:-1]
        assert shown(char) == expected, hex(code)


def test_the_categories_that_drive_or_disguise_text_are_escaped() -> None:
    for code in range(0x10000):
        char = chr(code)
        if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            assert shown(char).startswith("\\") and shown(char).isprintable(), hex(code)


def test_a_name_stays_recognisable() -> None:
    assert shown("\x1b]0;pwned\x07evil") == "\\x1b]0;pwned\\x07evil"
    assert shown("rtl\u202eexe.pt") == "rtl\\u202eexe.pt"
    assert shown("a\r\nb\t\x00\x7f\x9b") == "a\\r\\nb\\t\\x00\\x7f\\x9b"
    assert shown(shown("a\x1b[2J")) == shown("a\x1b[2J")  # escaped text is safe text


def test_lines_keeps_line_breaks_only() -> None:
    assert shown("a\x1b[2J\nb\rc\u2028", lines=True) == "a\\x1b[2J\nb\\rc\\u2028"
    assert shown("one\ntwo", lines=True) == "one\ntwo"
    assert shown("one\ntwo") == "one\\ntwo"


def test_text_table_keeps_one_line_a_row() -> None:
    rows = [["line\nbreak", "float32"], ["\x1b[31mred\x1b[0m\t", "bf16"], ["权重", "x"]]
    table = text_table(rows, ["name", "dtype"])
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.isprintable() for line in lines)
    assert lines[2].startswith("line\\nbreak  ")
    assert lines[3].startswith("\\x1b[31mred\\x1b[0m\\t  ")
    assert lines[4].startswith("权重")


def test_one_escaping_for_text_and_errors() -> None:
    # structure.text re-exports the function errors.py holds; a quoted exception is shown too.
    assert shown is errors.shown
    for text in ["a\nclean  b.pt", "c\r\nd\x1b[2J", "权重 'q' \"r\" \\n", "\u202e"]:
        assert quote_foreign(ValueError(text)) == f"ValueError: {shown(text)}"
        assert len(quote_foreign(KeyError(text)).splitlines()) == 1


def test_text_table_aligns_wide_and_combining_characters_by_display_width() -> None:
    rows = [["日本語.weight", "float32"], ["e\u0301.w", "bf16"], ["plain.w", "int8"]]
    lines = text_table(rows, ["name", "dtype"]).splitlines()
    # The dtype column starts at the same terminal column on every line.
    starts = [
        display_width(line[: line.index(dtype)])
        for line, dtype in zip(lines[2:], ["float32", "bf16", "int8"])
    ]
    assert len(set(starts)) == 1, lines
    assert display_width(lines[1].split()[0]) == display_width("日本語.weight")


def test_display_width_is_the_terminal_width_of_each_character() -> None:
    # The oracle is the Unicode database: a wide or full-width character takes two columns,
    # a combining one none, any other one; ASCII text and text beside it alike.
    def columns(char: str) -> int:
        if unicodedata.combining(char):
            return 0
        return 2 if unicodedata.east_asian_width(char) in "WF" else 1

    for code in [*range(0x3100), *range(0xFE00, 0xFF70)]:
        char = chr(code)
        assert display_width(char) == columns(char), hex(code)
        assert display_width(f"fc.{char}.weight") == 10 + columns(char), hex(code)
    assert display_width("layers.0.attention.wq.weight" * 40) == 28 * 40


def test_results_are_containers_of_tensors_by_name_and_true_when_empty(tmp_path) -> None:
    import torch

    import ckpt_tools

    full, empty = tmp_path / "full.pt", tmp_path / "empty.pt"
    torch.save({"a.w": torch.ones(2), "b": torch.zeros(1)}, full)
    torch.save({}, empty)
    for result in (ckpt_tools.inspect(full), ckpt_tools.diff(full, full)):
        assert len(result) == 2 and [t.name for t in result] == ["a.w", "b"]
        assert "a.w" in result and "a" not in result and 0 not in result
    for result in (ckpt_tools.inspect(empty), ckpt_tools.diff(empty, empty)):
        assert len(result) == 0 and list(result) == [] and bool(result)

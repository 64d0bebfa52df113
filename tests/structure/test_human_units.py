"""``structure.text.human_bytes`` and ``human_count``: the unit is the one the rounded number
reaches, at every boundary, up to EiB and T.

The oracle is the exact value: the number shown, times its unit, is within half a last digit
of the count, and is below the next unit (or the unit is the last one).
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from ckpt_tools.structure.text import human_bytes, human_count

BYTE_UNITS = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
COUNT_SUFFIXES = ["K", "M", "B", "T"]


def _near(base: int, levels: int) -> list[int]:
    """Counts around each power of ``base``, and around where rounding reaches it."""
    out = [0, 1, base - 1]
    for i in range(1, levels + 2):
        edge = base**i
        out += [edge - 1, edge, edge + 1, edge * (base - 1), edge * base - 1]
        out += [edge - edge // 2000, edge - edge // 3000]  # 0.05%/0.03% under: round up or not
    return sorted({n for n in out if n >= 0})


def _check(text_number: str, unit_index: int, n: int, base: int, units: int, digits: int) -> None:
    value = Decimal(text_number)
    exact = Decimal(n) / Decimal(base) ** unit_index
    assert abs(value - exact) <= Decimal(5) / Decimal(10) ** (digits + 1) * Decimal("1.0001")
    # Rolled over once rounded: never "1024.0 KiB" or "1000.00K" while a next unit exists.
    assert value < base or unit_index == units, (n, text_number)
    if unit_index > 1:  # and never "0.9 MiB" where the unit below shows it
        assert round(exact * base, digits) >= base


@pytest.mark.parametrize("n", _near(1024, len(BYTE_UNITS)))
def test_human_bytes_rolls_over_after_rounding(n: int) -> None:
    text = human_bytes(n)
    number, unit = text.split(" ")
    if unit == "B":
        assert n < 1024 and number == str(n)
        return
    assert len(number.split(".")[1]) == 1
    _check(number, BYTE_UNITS.index(unit) + 1, n, 1024, len(BYTE_UNITS), 1)


@pytest.mark.parametrize("n", _near(1000, len(COUNT_SUFFIXES)))
def test_human_count_rolls_over_after_rounding(n: int) -> None:
    text = human_count(n)
    if text.isdigit():
        assert n < 1000 and text == str(n)
        return
    number, suffix = text[:-1], text[-1]
    assert len(number.split(".")[1]) == 2
    _check(number, COUNT_SUFFIXES.index(suffix) + 1, n, 1000, len(COUNT_SUFFIXES), 2)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1048524, "1023.9 KiB"),
        (1048525, "1.0 MiB"),
        (1048575, "1.0 MiB"),
        (50331648 * 1024**4, "48.0 EiB"),
        (1024**7, "1024.0 EiB"),
    ],
)
def test_human_bytes_examples(n: int, expected: str) -> None:
    assert human_bytes(n) == expected


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (999, "999"),
        (1000, "1.00K"),
        (999994, "999.99K"),
        (999995, "1.00M"),
        (999999, "1.00M"),
        (10**12 - 1, "1.00T"),
        (12 * 10**12, "12.00T"),
        (10**15, "1000.00T"),
    ],
)
def test_human_count_examples(n: int, expected: str) -> None:
    assert human_count(n) == expected

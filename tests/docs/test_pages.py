"""The README stays short and its links lead somewhere; the pages cover what they promise."""

from __future__ import annotations

import re

from tests.helpers import ROOT

README = ROOT / "README.md"
_LINK = re.compile(r"\]\((?!https?://|#)([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short() -> None:
    """What it is, install, the tours, exit codes and links: the rest lives in docs/."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"


def test_relative_links_in_readme_and_changelog_resolve() -> None:
    """The site builder checks docs/ (mkdocs --strict); these two pages live outside it."""
    broken = [
        f"{page.name}: {target}"
        for page in (README, ROOT / "CHANGELOG.md")
        for target in _LINK.findall(page.read_text(encoding="utf-8"))
        if not (page.parent / target).exists()
    ]
    assert broken == []


def test_the_performance_page_says_how_to_run_every_benchmark() -> None:
    """Each script in benchmarks/ has its command line on docs/performance.md."""
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert scripts, "no benchmark scripts found"
    missing = [s for s in scripts if f"benchmarks/{s}" not in page]
    assert missing == []


def test_every_page_is_in_the_site_navigation() -> None:
    """A page left out of mkdocs.yml's nav is built but unreachable."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in config] == []


def test_the_api_reference_shows_every_public_name() -> None:
    """docs/reference.md renders each name of ``ckpt_tools.__all__``, and no other."""
    import ckpt_tools

    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"^::: ckpt_tools\.(\w+)$", page, re.MULTILINE))
    public = set(ckpt_tools.__all__) - {"__version__"}
    assert sorted(public - shown) == [], "public names missing from docs/reference.md"
    assert sorted(shown - public) == [], "docs/reference.md shows names that are not public"

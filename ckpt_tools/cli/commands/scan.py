"""``ckpt scan PATH...``."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from ckpt_tools.cli.render import echo_json, echo_text, shown
from ckpt_tools.ops.scan import scan


@click.command("scan")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["text", "json", "sarif"]),
    default=None,
    show_default="text",
    help="How to print the verdicts (sarif: SARIF 2.1.0, for code-scanning tools).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the same as --format json).")
@click.option(
    "--fail-on",
    type=click.Choice(["dangerous", "nonstandard"]),
    default="dangerous",
    show_default=True,
    help="Exit 1 on this severity or worse (nonstandard: numpy, Namespace, OmegaConf ...).",
)
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="For URLs, also print on stderr the requests made and the bytes received.",
)
def scan_cmd(
    paths: tuple[str, ...], output_format: str | None, as_json: bool, fail_on: str, verbose: bool
) -> int:
    """Can loading these checkpoints run code? A verdict per file, running nothing in it.

    Every pickle in each file is read without being run, and each global it imports is
    judged: dangerous (can run code, or unknown), nonstandard (known data types that
    torch's weights_only refuses), or allowed. Verdicts: clean, nonstandard, unreadable
    (not read the way torch reads it), dangerous. Exit 0: nothing dangerous; 1: something
    dangerous (or nonstandard, with --fail-on nonstandard); 4: an unreadable file.

    A PATH may be a URL (https://, hf://ORG/REPO[@REV][/FILE], s3://BUCKET/KEY): the bytes a
    scan reads are fetched by byte ranges (each zip record's header and first bytes, a
    request each), never the tensors; a folder URL is scanned as its weight files.
    """
    if as_json and output_format not in (None, "json"):
        raise click.UsageError(f"--json and --format {output_format} name two outputs; give one")
    report = scan(paths, on_file=_progress_line())
    if verbose and report.transfer is not None:
        for file in report.files:
            if file.transfer is not None and len(report.files) > 1:
                echo_text(f"remote: {file.path}: {file.transfer}", err=True)
        echo_text(f"remote: {report.transfer}", err=True)
    if output_format == "sarif":
        echo_json(report.to_sarif())
    elif as_json or output_format == "json":  # text is the default
        echo_json(report.to_json())
    else:
        echo_text(report.text())
    return report.exit_code(fail_on=fail_on)  # type: ignore[arg-type]


def _progress_line() -> Callable[[int, int, str], None] | None:
    """One line on a terminal's stderr, rewritten per file, for scans of several files."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, path: str) -> None:
        if total > 1:
            line = f"scanning {done + 1}/{total} {shown(path)}"[:78]
            end = "\n" if done + 1 == total else ""
            sys.stderr.write(f"\r{line:<78}{end}")
            sys.stderr.flush()

    return show

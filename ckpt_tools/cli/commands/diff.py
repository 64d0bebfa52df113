"""``ckpt diff A B`` and ``ckpt diff CKPT --model MODULE:FACTORY``."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import click

from ckpt_tools.cli.options import json_option, select_option
from ckpt_tools.cli.render import echo_json, echo_text, table
from ckpt_tools.diffing.report import FAIL_CATEGORIES
from ckpt_tools.errors import EXIT_DIFFERENCES, EXIT_OK, UsageError


def parse_fail_on(text: str | None) -> tuple[frozenset[str], bool]:
    """``"missing,value"`` -> that set; ``"any"`` or ``"all"`` -> every category; and whether
    ``value`` was named itself (a gate on values, which needs them compared)."""
    if not text:
        return frozenset(), False
    parts = {p.strip() for p in text.split(",") if p.strip()}
    bad = sorted(parts - set(FAIL_CATEGORIES) - {"any", "all"})
    if bad or not parts:  # a typo beside "any" is a typo too
        raise UsageError(
            f"--fail-on {text!r}: unknown {', '.join(bad) or 'empty list'}; choose from "
            f"{','.join(FAIL_CATEGORIES)} (or 'any')"
        )
    if parts & {"any", "all"}:
        return frozenset(FAIL_CATEGORIES), "value" in parts
    return frozenset(parts), "value" in parts


def parse_model_args(values: tuple[str, ...]) -> dict[str, Any]:
    """``("depth=3", "act=relu")`` -> ``{"depth": 3, "act": "relu"}`` (int/float/bool/str)."""
    from ckpt_tools.loading.module_spec import parse_value

    out: dict[str, Any] = {}
    for value in values:
        key, sep, raw = value.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(f"--model-arg {value!r}: expected KEY=VALUE, e.g. --model-arg depth=3")
        out[key.strip()] = parse_value(raw)
    return out


@click.command("diff")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path(), required=False)
@click.option(
    "--model",
    "model_spec",
    metavar="MODULE:FACTORY",
    default=None,
    help="Compare A with a freshly built model: pkg.module:Factory or path/to/file.py:Factory.",
)
@click.option(
    "--model-arg",
    "model_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="Keyword argument for the factory (repeatable; int, float, bool or str).",
)
@select_option
@click.option("--select-b", default=None, metavar="A.B", help="Like --select, for B.")
@click.option(
    "--rtol", type=float, default=1e-5, show_default=True, help="Relative tolerance (finite, >= 0)."
)
@click.option(
    "--atol", type=float, default=1e-8, show_default=True, help="Absolute tolerance (finite, >= 0)."
)
@click.option(
    "--fail-on",
    default=None,
    metavar="LIST",
    help=f"Exit 1 when any of these is found: {','.join(FAIL_CATEGORIES)} (or 'any').",
)
@click.option(
    "--align",
    is_flag=True,
    help="Match wrapper prefixes first (module., _orig_mod., model. ...), as load_into does.",
)
@click.option(
    "--values/--no-values",
    default=None,
    help="Compare values too (the default unless A or B is a URL, whose compared tensors "
    "--values fetches); --no-values: keys, shapes and dtypes only, with no torch needed.",
)
@click.option("--all", "show_all", is_flag=True, help="Also list bit-equal tensors.")
@click.option("--no-group", is_flag=True, help="Do not fold repeated layers.")
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="For URLs, also print on stderr the requests made and the bytes received.",
)
@json_option
def diff_cmd(
    a: str,
    b: str | None,
    model_spec: str | None,
    model_args: tuple[str, ...],
    select: str | None,
    select_b: str | None,
    rtol: float,
    atol: float,
    fail_on: str | None,
    align: bool,
    values: bool | None,
    show_all: bool,
    no_group: bool,
    verbose: bool,
    as_json: bool,
) -> int:
    """Compare two checkpoints (or a checkpoint and a model): keys, shapes, dtypes, values.

    Files are streamed tensor by tensor, never loaded whole and never unpickled with code.
    A is what you have, B what it should match: "missing" keys are in B only,
    "unexpected" keys in A only. A or B may be a URL (https://, hf://ORG/REPO[@REV][/FILE],
    s3://BUCKET/KEY): its keys, shapes and dtypes are read from its structure by byte
    ranges, and its values only with --values (which fetches the compared tensors only).
    """
    categories, values_named = parse_fail_on(fail_on)
    if values_named:
        # A gate on values needs them read: a URL's compared tensors are fetched for it.
        if values is False:
            raise UsageError("--fail-on value needs the values, which --no-values leaves out")
        values = True
    if (b is None) == (model_spec is None):
        raise UsageError("give B or --model MODULE:FACTORY (exactly one): `ckpt diff A B`")
    if model_args and model_spec is None:
        raise UsageError("--model-arg needs --model MODULE:FACTORY")
    from ckpt_tools.diffing.engine import check_tolerances, compares_values, diff

    if model_spec is not None or compares_values(a, b, values):
        from ckpt_tools.loading.extras import require_torch

        require_torch("ckpt diff")  # values (and models) are compared with torch

    check_tolerances(rtol, atol)  # before a model is built: refusing is instant
    # The model's own code (its module, factory, hooks) may print: stdout is the report's.
    with contextlib.redirect_stdout(sys.stderr) if model_spec else contextlib.nullcontext():
        if model_spec is not None:
            from ckpt_tools.loading.module_spec import module_from_spec

            other: Any = module_from_spec(model_spec, parse_model_args(model_args))
        else:
            other = b
        report = diff(
            a,
            other,
            rtol=rtol,
            atol=atol,
            select=select,
            select_b=select_b,
            align=align,
            values=values,
        )
    if verbose and report.transfer is not None:
        echo_text(f"remote: {report.transfer}", err=True)
    failed = sorted(report.found() & categories)
    if as_json:
        echo_json({**report.to_json(), "fail_on": sorted(categories), "failed_on": failed})
    else:
        text = report.text(
            show_all=show_all, group=not no_group, model_spec=model_spec, table=table, for_cli=True
        )
        echo_text(text)
        if failed:
            click.echo(f"failing on: {', '.join(failed)}")
    if "value" in categories and not report.values_compared:
        echo_text("note: values were not compared, so no value difference can fail", err=True)
    return EXIT_DIFFERENCES if failed else EXIT_OK

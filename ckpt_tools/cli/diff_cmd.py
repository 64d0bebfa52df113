"""``ckpt diff A B`` and ``ckpt diff CKPT --model MODULE:FACTORY``."""

from __future__ import annotations

import math
from typing import Any

import click

from ckpt_tools.cli.options import json_option, select_option
from ckpt_tools.cli.render import echo_json, table
from ckpt_tools.diffing.report import FAIL_CATEGORIES, DiffReport, SideInfo, TensorDiff
from ckpt_tools.errors import EXIT_DIFFERENCES, EXIT_OK, UsageError
from ckpt_tools.structure.grouping import group_names


def parse_fail_on(text: str | None) -> frozenset[str]:
    """``"missing,value"`` -> that set; ``"any"`` or ``"all"`` -> every category."""
    if not text:
        return frozenset()
    parts = {p.strip() for p in text.split(",") if p.strip()}
    if parts & {"any", "all"}:
        return frozenset(FAIL_CATEGORIES)
    bad = sorted(parts - set(FAIL_CATEGORIES))
    if bad:
        raise UsageError(
            f"--fail-on {text!r}: unknown {', '.join(bad)}; choose from "
            f"{','.join(FAIL_CATEGORIES)} (or 'any')"
        )
    return frozenset(parts)


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
@click.option("--rtol", type=float, default=1e-5, show_default=True, help="Relative tolerance.")
@click.option("--atol", type=float, default=1e-8, show_default=True, help="Absolute tolerance.")
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
@click.option("--all", "show_all", is_flag=True, help="Also list bit-equal tensors.")
@click.option("--no-group", is_flag=True, help="Do not fold repeated layers.")
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
    show_all: bool,
    no_group: bool,
    as_json: bool,
) -> int:
    """Compare two checkpoints (or a checkpoint and a model): keys, shapes, dtypes, values.

    Files are streamed tensor by tensor, never loaded whole and never unpickled with code.
    A is what you have, B what it should match: "missing" keys are in B only,
    "unexpected" keys in A only.
    """
    categories = parse_fail_on(fail_on)
    if (b is None) == (model_spec is None):
        raise UsageError("give B or --model MODULE:FACTORY (exactly one): `ckpt diff A B`")
    if model_args and model_spec is None:
        raise UsageError("--model-arg needs --model MODULE:FACTORY")
    from ckpt_tools.diffing.engine import diff

    if model_spec is not None:
        from ckpt_tools.loading.module_spec import build_model

        other: Any = build_model(model_spec, parse_model_args(model_args))
    else:
        other = b
    report = diff(a, other, rtol=rtol, atol=atol, select_a=select, select_b=select_b, align=align)
    failed = sorted(report.found() & categories)
    if as_json:
        echo_json({**report.to_json(), "fail_on": sorted(categories), "failed_on": failed})
    else:
        click.echo(render(report, show_all=show_all, group=not no_group, model_spec=model_spec))
        if failed:
            click.echo(f"failing on: {', '.join(failed)}")
    return EXIT_DIFFERENCES if failed else EXIT_OK


def _side_line(name: str, side: SideInfo, model_spec: str | None) -> str:
    label = side.label if side.kind != "module" or not model_spec else f"{model_spec} {side.label}"
    bits = [side.format] if side.format else [side.kind.replace("_", " ")]
    if side.selected:
        bits.append(f"state dict {'.'.join(side.selected)!r}")
    bits.append(f"{side.tensors} tensors")
    if side.wrappers:
        bits.append("wrappers " + " ".join(side.wrappers))
    if side.skipped:
        bits.append(f"{len(side.skipped)} non-tensor entries not compared")
    return f"{name}: {label} ({', '.join(bits)})"


def _number(x: float | None) -> str:
    if x is None:
        return ""
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.3g}"


def _fold(names: tuple[str, ...], group: bool, limit: int = 12) -> list[str]:
    if group:
        shown = [
            g.pattern + (f" ×{g.count}" if g.count > 1 else "") for g, _ in group_names(names, str)
        ]
    else:
        shown = list(names)
    more = [f"... {len(shown) - limit} more (see --json)"] if len(shown) > limit else []
    return shown[:limit] + more


def _rows(tensors: list[TensorDiff], group: bool) -> list[list[str]]:
    def signature(t: TensorDiff) -> Any:
        return (t.status, t.dtype_a, t.dtype_b, t.shape_a, t.shape_b)

    if group:
        groups = group_names(tensors, lambda t: t.name, signature)
    else:
        groups = [(None, [t]) for t in tensors]
    rows = []
    for g, members in groups:
        first = members[0]
        name = first.name if g is None or g.count == 1 else f"{g.pattern} ×{g.count}"
        dtype = (
            first.dtype_a
            if first.dtype_a == first.dtype_b
            else (f"{first.dtype_a} / {first.dtype_b}")
        )
        shape = (
            str(list(first.shape_a))
            if first.shape_a == first.shape_b
            else (f"{list(first.shape_a)} / {list(first.shape_b)}")
        )
        abs_values = [t.max_abs for t in members if t.max_abs is not None]
        rel_values = [t.max_rel for t in members if t.max_rel is not None]
        mismatched = [t.mismatched for t in members if t.mismatched is not None]
        nan = (sum(t.nan_a for t in members), sum(t.nan_b for t in members))
        inf = (sum(t.inf_a for t in members), sum(t.inf_b for t in members))
        rows.append(
            [
                name,
                first.status,
                dtype,
                shape,
                _number(max(abs_values)) if abs_values else "",
                _number(max(rel_values)) if rel_values else "",
                str(sum(mismatched)) if mismatched else "",
                f"{nan[0]}/{nan[1]}" if any(nan) else "",
                f"{inf[0]}/{inf[1]}" if any(inf) else "",
            ]
        )
    return rows


def render(
    report: DiffReport, show_all: bool = False, group: bool = True, model_spec: str | None = None
) -> str:
    """The text report: both sides, a table of differing tensors, key lists, suggestions."""
    lines = [
        _side_line("A", report.a, None),
        _side_line("B", report.b, model_spec),
        f"tolerances: rtol={report.rtol:g} atol={report.atol:g}",
    ]
    if report.aligned:
        lines.append(f"aligned: A's keys compared after {', then '.join(report.aligned)}")
    lines.append("")
    statuses: dict[str, int] = {}
    for t in report.tensors:
        statuses[t.status] = statuses.get(t.status, 0) + 1
    shown = [t for t in report.tensors if show_all or t.status != "equal"]
    if shown:
        headers = [
            "name",
            "status",
            "dtype",
            "shape",
            "max abs",
            "max rel",
            "mismatched",
            "NaN A/B",
            "inf A/B",
        ]
        lines += [table(_rows(shown, group), headers), ""]
    summary = ", ".join(f"{n} {s}" for s, n in statuses.items()) or "no common tensors"
    lines.append(f"compared {len(report.tensors)} common tensors: {summary}")
    if report.missing:
        lines.append(f"missing (in B, not in A): {len(report.missing)}")
        lines += [f"  {k}" for k in _fold(report.missing, group)]
    if report.unexpected:
        lines.append(f"unexpected (in A, not in B): {len(report.unexpected)}")
        lines += [f"  {k}" for k in _fold(report.unexpected, group)]
    if report.suggestions:
        lines.append("suggestions:")
        lines += [f"  {s.text()}" for s in report.suggestions]
    if report.identical:
        lines.append("identical: same keys, every tensor bit-equal")
    return "\n".join(lines)

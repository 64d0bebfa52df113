"""The parity plot: each strategy's loss, and how far its weights are from single-device training.

Two panels share the steps. Left, the loss of every strategy: the curves coincide when
parity holds, so there they only show that training went as expected. Right, what parity
is about: per step, the largest absolute difference of each strategy's parameters from
single-device training's, on a log axis, against the tolerance of check (c). A difference
of exactly 0 (the same maths in the same order) has no place on a log axis: it is drawn on
a floor line marked "0", below every real difference. Each strategy keeps one colour, marker
and dash in both panels, and its markers sit a little to one side of the step, so that
strategies with the same values stay apart.

matplotlib is imported only when asked for, and the figure is drawn on an Agg canvas
directly (no ``pyplot``), so plotting neither needs a display nor changes the process-wide
matplotlib backend of whoever calls us.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.formats.urls import refuse_url
from ckpt_tools.io.output_access import check_folder_writable

__all__ = ["COMMON_FORMATS", "check_plot_path", "parity_figure", "plot_parity", "zero_floor"]

#: The image formats every matplotlib saves, for the check when matplotlib is not importable.
COMMON_FORMATS: tuple[str, ...] = ("eps", "pdf", "png", "ps", "svg")

_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
# Sideways shift between strategies' markers, in steps.
_SHIFT = 0.09


def zero_floor(gaps: Mapping[str, Sequence[float]], tolerance: float) -> float:
    """Where a difference of exactly 0 is drawn on the log axis: a decade below the smallest
    non-zero difference (or the tolerance), so that it never passes for a real one.

    Example:
        >>> zero_floor({"ddp": [0.0, 2e-8], "dp": [0.0, 0.0]}, 1e-5)
        2e-09
    """
    positive = [g for values in gaps.values() for g in values if 0 < g < math.inf]
    return min([*positive, tolerance]) / 10


def plot_parity(
    losses: Mapping[str, Sequence[float]],
    gaps: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    tolerance: float,
    title: str = "parity with single-device training",
) -> Path:
    """Draw the loss per step and the weight difference from single-device training per step.

    Args:
        losses: strategy name to its loss per step (``ParityReport.losses``), ``single``
            included.
        gaps: strategy name to the largest absolute difference of its parameters from
            single-device training's after each step (``ParityReport.weight_gaps``).
        path: output image; the suffix picks the format (``.png``, ``.svg``, ``.pdf``).
        tolerance: the allowed difference of check (c), drawn as a line.
        title: the figure title.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: matplotlib is not installed (``pip install 'ckpt_tools[plot]'``), or
            the suffix is not a format it saves (:func:`check_plot_path`).
        OSError: the file cannot be written.

    Example:
        >>> losses = {"single": [2.3, 2.2], "dp": [2.3, 2.2], "ddp": [2.3, 2.2]}
        >>> gaps = {"dp": [0.0, 0.0], "ddp": [7e-9, 1.5e-8]}
        >>> plot_parity(losses, gaps, "parity.png", tolerance=1e-5)
        PosixPath('parity.png')
    """
    out = check_plot_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)  # as --out's folder is made (often its home)
    parity_figure(losses, gaps, tolerance=tolerance, title=title).savefig(out, dpi=110)
    return out


def _missing_matplotlib() -> UsageError:
    return UsageError(
        "plotting needs matplotlib, which is not installed",
        remedies=(
            Remedy(command="pip install 'ckpt_tools[plot]'"),
            Remedy(verb="leave out", flag="--plot"),
        ),
    )


def check_plot_path(path: str | Path) -> Path:
    """Refuse a plot that could not be saved, before anything is trained for it.

    Args:
        path: the image to write; its suffix picks the format.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: a URL (plots are written to local paths only), a suffix that is not
            one of matplotlib's formats (its own list where it
            is importable, else :data:`COMMON_FORMATS`), a folder that cannot be made (a
            file stands in its path), or matplotlib not installed.
        OutputError: the folder it would be written in (or its nearest existing parent)
            cannot be written.

    Example:
        >>> check_plot_path("parity.txt")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: path='parity.txt': not an image format matplotlib saves; ...
    """
    refuse_url(path, output=True)
    out = Path(path)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        formats: tuple[str, ...] = COMMON_FORMATS
        missing = True
    else:
        formats, missing = tuple(sorted(FigureCanvasBase.get_supported_filetypes())), False
    suffix = out.suffix[1:].lower()
    if suffix not in formats:
        what = "has no suffix" if not suffix else "not an image format matplotlib saves"
        raise UsageError(
            f"{what}; expected a file ending in one of .{', .'.join(formats)}",
            argument="path",
            value=repr(str(path)),
            flag="--plot",
        )
    # The folder is made when the plot is saved: what stands in its way is refused now.
    blocking = next((p for p in out.absolute().parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise UsageError(
            f"{str(blocking)!r} is a file, where its folder would be made",
            argument="path",
            value=repr(str(path)),
            flag="--plot",
        )
    if blocking is not None:
        check_folder_writable(blocking, path, argument="path", value=repr(str(path)), flag="--plot")
    if missing:
        raise _missing_matplotlib()
    return out


def parity_figure(
    losses: Mapping[str, Sequence[float]],
    gaps: Mapping[str, Sequence[float]],
    *,
    tolerance: float,
    title: str = "parity with single-device training",
) -> Any:
    """The figure :func:`plot_parity` saves: loss panel left, weight-difference panel right.

    Returns:
        A ``matplotlib.figure.Figure`` on an Agg canvas.

    Raises:
        UsageError: matplotlib is not installed.

    Example:
        >>> fig = parity_figure({"single": [2.3]}, {"dp": [0.0]}, tolerance=1e-5)
        >>> [ax.get_yscale() for ax in fig.axes]
        ['linear', 'log']
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise _missing_matplotlib() from exc
    fig = Figure(figsize=(11.0, 4.4), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to the figure; savefig renders through it
    loss_ax, gap_ax = fig.subplots(1, 2)
    names = list(dict.fromkeys([*losses, *gaps]))
    styles = {name: _style(i, len(names)) for i, name in enumerate(names)}
    _draw_losses(loss_ax, losses, styles)
    _draw_gaps(gap_ax, gaps, styles, tolerance)
    fig.suptitle(title)
    return fig


def _style(index: int, count: int) -> dict[str, Any]:
    """One strategy's colour, marker, dash and sideways shift, the same in both panels."""
    return {
        "color": f"C{index % 10}",
        "marker": _MARKERS[index % len(_MARKERS)],
        "linestyle": _STYLES[index % len(_STYLES)],
        "shift": (index - (count - 1) / 2) * _SHIFT,
    }


def _plot(ax: Any, name: str, values: Sequence[float], style: dict[str, Any], **kw: Any) -> None:
    steps = [i + 1 + style["shift"] for i in range(len(values))]
    ax.plot(
        steps,
        list(values),
        color=style["color"],
        marker=style["marker"],
        linestyle=style["linestyle"],
        markersize=6,
        markerfacecolor="none",
        label=name,
        **kw,
    )


def _steps_axis(ax: Any, count: int) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlim(0.5, count + 0.5)
    ax.set_xlabel("step (markers shifted sideways to keep strategies apart)")
    ax.grid(True, alpha=0.3)


def _draw_losses(
    ax: Any, losses: Mapping[str, Sequence[float]], styles: Mapping[str, dict[str, Any]]
) -> None:
    for name, values in losses.items():
        _plot(ax, name, values, styles[name])
    _steps_axis(ax, max((len(v) for v in losses.values()), default=1))
    ax.set_ylabel("loss (global batch mean, before the step)")
    ax.set_title("loss per step")
    ax.legend(fontsize="small")


def _labelled_line(
    ax: Any, y: float, text: str, color: str, linestyle: str, linewidth: float
) -> None:
    """A horizontal line at ``y`` with ``text`` just above its left end."""
    ax.axhline(y, color=color, linestyle=linestyle, linewidth=linewidth)
    ax.annotate(
        text,
        (0.01, y),
        xycoords=("axes fraction", "data"),
        xytext=(0, 3),
        textcoords="offset points",
        color=color,
        fontsize="small",
    )


def _draw_gaps(
    ax: Any,
    gaps: Mapping[str, Sequence[float]],
    styles: Mapping[str, dict[str, Any]],
    tolerance: float,
) -> None:
    floor = zero_floor(gaps, tolerance)
    top = max([g for v in gaps.values() for g in v if g < math.inf] + [tolerance])
    for name, values in gaps.items():
        # 0 is drawn on the floor line; a step whose weights did not pair up is left out.
        shown = [max(g, floor) if g < math.inf else math.nan for g in values]
        label = name + (" (0: equal to single at every step)" if values and not any(values) else "")
        _plot(ax, label, shown, styles[name])
    ax.set_yscale("log")
    _labelled_line(ax, tolerance, f"tolerance {tolerance:g}", "red", "--", 1.2)
    _labelled_line(ax, floor, "0 (equal): drawn here", "grey", ":", 1.0)
    ax.set_ylim(floor / 4, top * 20)
    _steps_axis(ax, max((len(v) for v in gaps.values()), default=1))
    ax.set_ylabel("max |w - w_single| over all parameters")
    ax.set_title("weight difference from single-device training (log)")
    if gaps:
        ax.legend(fontsize="small", loc="best")

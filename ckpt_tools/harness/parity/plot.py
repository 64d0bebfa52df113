"""Loss curves of a parity run as a PNG, with matplotlib imported only when asked for.

The figure is drawn on an Agg canvas directly (no ``pyplot``), so plotting neither needs
a display nor changes the process-wide matplotlib backend of whoever calls us.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ckpt_tools.errors import Remedy, UsageError

__all__ = ["plot_losses"]


def plot_losses(
    losses: Mapping[str, Sequence[float]], path: str | Path, title: str = "loss per step"
) -> Path:
    """Draw one loss curve per strategy over the steps and save it.

    Args:
        losses: strategy name to its loss per step (e.g. ``ParityReport.losses``).
        path: output image; the suffix picks the format (``.png``, ``.svg``, ``.pdf``).
        title: the figure title.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: matplotlib is not installed (``pip install 'ckpt_tools[plot]'``).
        OSError: the file cannot be written.

    Example:
        >>> plot_losses({"single": [2.3, 2.2], "ddp": [2.3, 2.2]}, "parity.png")
        PosixPath('parity.png')
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise UsageError(
            "plotting needs matplotlib, which is not installed",
            remedies=(
                Remedy(command="pip install 'ckpt_tools[plot]'"),
                Remedy(verb="leave out", flag="--plot"),
            ),
        ) from exc
    out = Path(path)
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to the figure; savefig renders through it
    ax = fig.add_subplot()
    # Curves often coincide exactly; markers and a dash cycle keep each one visible.
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "x", "d"]
    for i, (name, values) in enumerate(losses.items()):
        ax.plot(
            range(1, len(values) + 1),
            list(values),
            linestyle=styles[i % len(styles)],
            marker=markers[i % len(markers)],
            label=name,
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch mean)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(out)
    return out

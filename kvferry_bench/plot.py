"""Line plots for the benchmarks: panels of labelled series, saved as PNG (matplotlib, Agg)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    style: str = "-o"


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    logy: bool = False


def save_panels(
    path: Path,
    panels: list[Panel],
    xlabel: str,
    title: str,
    xticks: tuple[list[float], list[str]] | None = None,
    logx: bool = False,
) -> bool:
    """Draw ``panels`` side by side (two per row) into ``path``; False if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, xlabel, xticks, logx)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    save_figure(fig, path, title)
    return True


def pyplot():  # noqa: ANN201 - matplotlib.pyplot, imported only when a plot is drawn
    """matplotlib's pyplot on the file-only backend; None (with a warning) if it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib missing: no plot (pip install 'kvferry[bench]')")
        return None
    return plt


def save_figure(fig, path: Path, title: str) -> None:  # noqa: ANN001 - a matplotlib Figure
    """Title, lay out and write ``fig`` to ``path`` (its folder made), then release it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _draw(ax, panel: Panel, xlabel: str, xticks: tuple[list[float], list[str]] | None, logx: bool) -> None:
    colors = {}
    for series in panel.series:
        base = series.label.split(" ")[0]  # "pd p99" and "pd p50" share a colour
        color = colors.setdefault(base, f"C{len(colors)}")
        ax.plot(series.xs, series.ys, series.style, label=series.label, color=color)
    ax.set_title(panel.title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(panel.ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if panel.logy:
        ax.set_yscale("log")
    if xticks is not None:
        ax.set_xticks(xticks[0], xticks[1])
    ax.grid(True, alpha=0.3)
    if panel.series:
        ax.legend(fontsize="small")

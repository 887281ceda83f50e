"""Plot partition plans like the paper's Fig. 11: layer memory bars under slice boxes.

One panel per strategy, stacked, sharing the x axis (layer index in topological order). Each layer
is a bar of its predicted memory; each slice is a box over its layers whose height is the memory
allocated to its function, labelled with the slice's name and size.

matplotlib is imported inside `plot_plans`, on the Agg canvas (never pyplot), so importing this
module is cheap and nothing touches a display or matplotlib's global state.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mopar._files import as_if_made
from mopar.errors import MoparError, Option

__all__ = ["PlotError", "plot_plans", "plot_trace", "save_png"]

#: Most layer names written under the x axis; beyond this they are thinned out.
MAX_TICK_LABELS = 40
#: A log y axis is used when the largest memory exceeds the smallest by more than this factor.
LOG_RANGE = 100.0
_DPI = 150
_NAME_CHARS = 24  # longer layer names are shortened in tick labels
_BAR_COLOR = "#8b96a3"
_SLICE_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


class PlotError(MoparError):
    """A plot cannot be written: a bad output path or inconsistent data."""


def plot_plans(
    path: str | os.PathLike[str],
    layer_names: Sequence[str],
    layer_memory_mb: Sequence[float],
    panels: Mapping[str, Sequence[tuple[int, int, float]]],
    *,
    title: str = "",
) -> Path:
    """Write a PNG comparing how strategies cut one model into slices.

    Args:
        path: the PNG to write (its folder must exist); replaced atomically.
        layer_names: each layer's name, in topological order.
        layer_memory_mb: each layer's predicted memory, MB.
        panels: strategy name -> its slices as ``(lo, hi, memory_mb)``: the half-open layer range
            ``[lo, hi)`` and the memory allocated to the slice's function, MB. One panel each,
            in the mapping's order.
        title: a title over all panels.

    Returns:
        The path written.

    Raises:
        PlotError: the path is not a ``.png`` in an existing folder, or the data do not fit
            together (lengths, ranges, memories).
    """
    out = Path(path)
    _check(out, layer_names, layer_memory_mb, panels)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(layer_names)
    fig = Figure(figsize=(min(16.0, 8.0 + n / 25), 1.2 + 2.4 * len(panels)), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    values = [*layer_memory_mb, *(m for slices in panels.values() for _, _, m in slices)]
    positive = [v for v in values if v > 0]
    log = bool(positive) and max(positive) > LOG_RANGE * min(positive)
    bottom = _set_y_limits(axes[0], positive, log=log)
    for ax, (strategy, slices) in zip(axes, panels.items()):
        _draw_panel(ax, strategy, slices, layer_memory_mb, bottom=bottom, log=log)
    _set_x_ticks(axes[-1], layer_names)
    axes[-1].set_xlabel("layer (topological order)")
    _legend(axes[0])
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_png(fig, out, dpi=_DPI)
    return out


def _check(
    out: Path,
    layer_names: Sequence[str],
    layer_memory_mb: Sequence[float],
    panels: Mapping[str, Sequence[tuple[int, int, float]]],
) -> None:
    if out.suffix.lower() != ".png":
        raise PlotError(f"plot path must end in .png, got {str(out)!r}; pass a name like plan.png")
    if not out.parent.is_dir():
        raise PlotError(
            f"folder {str(out.parent)!r} of plot path {str(out)!r} does not exist; "
            f"create it first or choose another path"
        )
    n = len(layer_names)
    if n == 0 or len(layer_memory_mb) != n:
        raise PlotError(
            f"need one memory per layer and at least one layer, got {n} layer names "
            f"and {len(layer_memory_mb)} memories; pass lists of equal length"
        )
    bad = [(i, m) for i, m in enumerate(layer_memory_mb) if not (math.isfinite(m) and m >= 0)]
    if bad:
        raise PlotError(
            f"layer memories must be finite and >= 0 MB, got {bad[0][1]} for layer "
            f"{bad[0][0]} ({layer_names[bad[0][0]]}); check the predictor output"
        )
    if not panels:
        raise PlotError("no panels to plot; pass at least one strategy with its slices")
    for strategy, slices in panels.items():
        for lo, hi, memory_mb in slices:
            if not 0 <= lo < hi <= n or not (math.isfinite(memory_mb) and memory_mb > 0):
                raise PlotError(
                    f"slice ({lo}, {hi}, {memory_mb}) of {strategy!r} must span layers "
                    f"0 <= lo < hi <= {n} with a memory > 0 MB; check the plan"
                )


def _draw_panel(
    ax: Any,
    strategy: str,
    slices: Sequence[tuple[int, int, float]],
    layer_memory_mb: Sequence[float],
    *,
    bottom: float,
    log: bool,
) -> None:
    """Bars of the layers' memory, then one labelled box per slice standing on ``bottom``."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    n = len(layer_memory_mb)
    ax.bar(range(n), layer_memory_mb, width=0.8, color=_BAR_COLOR, zorder=2)
    width_pt = _axes_width_pt(ax)
    for k, (lo, hi, memory_mb) in enumerate(slices):
        color = _SLICE_COLORS[k % len(_SLICE_COLORS)]
        # Alpha on the fill only: the outline stays solid so that thin boxes remain visible.
        ax.add_patch(
            Rectangle(
                (lo - 0.5, bottom),
                hi - lo,
                memory_mb - bottom,
                facecolor=to_rgba(color, 0.12),
                edgecolor=color,
                linewidth=1.4,
                zorder=3,
            )
        )
        _label_slice(ax, k, lo, hi, memory_mb, color, box_pt=width_pt * (hi - lo) / n)
    total = sum(m for _, _, m in slices)
    plural = "slice" if len(slices) == 1 else "slices"
    ax.set_title(
        f"{strategy}: {len(slices)} {plural}, {total:,.0f} MB allocated in all",
        fontsize=9,
        loc="left",
    )
    ax.set_ylabel("memory (MB)", fontsize=8)
    ax.set_yscale("log" if log else "linear")
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.set_xlim(-0.5, n - 0.5)


def _label_slice(
    ax: Any, k: int, lo: int, hi: int, memory_mb: float, color: str, *, box_pt: float
) -> None:
    """Name and size just below the box's top edge; turned upright or cut to the name if narrow."""
    text = f"s{k}\n{memory_mb:,.0f} MB"
    center = (lo + hi - 1) / 2
    if box_pt >= 44:  # room for "10,240 MB" across at 7 pt
        rotation, size = 0, 7
    elif box_pt >= 11:
        text, rotation, size = f"s{k} {memory_mb:,.0f} MB", 90, 6.5
    else:
        text, rotation, size = f"s{k}", 90, 6
    ax.annotate(
        text,
        (center, memory_mb),
        xytext=(0, -3),
        textcoords="offset points",
        ha="center",
        va="top",
        rotation=rotation,
        fontsize=size,
        color=color,
        fontweight="bold",
        zorder=4,
        annotation_clip=False,
        bbox={
            "boxstyle": "round,pad=0.15",
            "facecolor": "white",
            "edgecolor": "none",
            "alpha": 0.75,
        },
    )


def _legend(ax: Any) -> None:
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color=_BAR_COLOR, label="layer memory (predicted)"),
            Patch(facecolor="white", edgecolor="black", label="slice (allocated memory)"),
        ],
        # Above the top panel, right of its title: inside, it would hide the tallest box.
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
        fontsize=7,
        frameon=False,
        borderaxespad=0.2,
    )


def _axes_width_pt(ax: Any) -> float:
    """Approximate axes width in points, from the figure size (before tight_layout)."""
    fig_width_in = ax.figure.get_figwidth()
    return ax.get_position().width * fig_width_in * 72


def _set_y_limits(ax: Any, positive: Sequence[float], *, log: bool) -> float:
    """Set the y range shared by all panels, with headroom above the tallest box for its label.

    Returns the bottom of the range (a log axis cannot reach 0).
    """
    top = max(positive, default=1.0)
    bottom = min(positive) / 2 if log else 0.0
    ax.set_ylim(bottom, top * (2.5 if log else 1.12))
    return bottom


def _set_x_ticks(ax: Any, layer_names: Sequence[str]) -> None:
    """Label at most `MAX_TICK_LABELS` layers, evenly spaced, as ``index name``."""
    n = len(layer_names)
    step = max(1, math.ceil(n / MAX_TICK_LABELS))
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{i} {_shorten(layer_names[i])}" for i in ticks], rotation=90, fontsize=6)


def _shorten(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else "…" + name[-(_NAME_CHARS - 1) :]


def save_png(fig: Any, out: Path, *, dpi: int) -> Path:
    """Save ``fig`` to a temporary file beside ``out``, then rename it over ``out``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".png", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=dpi)
        as_if_made(tmp)  # mkstemp's 0600: give it the mode open() would
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def plot_trace(trace, path: Path, *, title: str = "") -> Path:
    """A heat map of an activation trace (`mopar.profile.experts.ExpertTrace`), layers x
    experts, each cell the expert's share of its layer's routed tokens."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if path.suffix.lower() != ".png" or not path.parent.is_dir():
        raise PlotError(Option("plot"), f" must be a .png in an existing folder, got {str(path)!r}")
    width = max(len(t) for t in trace.tokens)
    grid = np.full((len(trace.layers), width), np.nan)
    for i, name in enumerate(trace.layers):
        share = trace.share(name)
        grid[i, : share.size] = share
    fig = Figure(figsize=(2.5 + 0.45 * width, 1.2 + 0.4 * len(trace.layers)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(width), [str(e) for e in range(width)])
    ax.set_yticks(range(len(trace.layers)), list(trace.layers), fontsize=8)
    ax.set_xlabel("expert")
    fig.colorbar(image, ax=ax, label="token share")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return save_png(fig, path, dpi=120)

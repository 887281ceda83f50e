"""Bar charts of a bench run, like the paper's Fig. 10: per model, each variant's MC, cost and
p95 latency normalised to unsplit's (1.0 = unsplit; lower is better). A panel with an outlier
(torch-unsplit at thousands of times unsplit's MC) is drawn on a log axis, bars growing from 1.0.

matplotlib is imported inside `write_charts`, on the Agg canvas (never pyplot), so importing this
module is cheap and nothing touches a display or matplotlib's global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.plot import save_png

__all__ = ["CHARTS", "LOG_SPAN", "chart_figure", "write_charts"]

#: file name -> (title, one (results.json key, panel title) per panel)
CHARTS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "mc.png": (
        "MC (allocated GB x measured s per request), normalised to unsplit",
        (("mc_gb_s", "MC"),),
    ),
    "cost.png": (
        "cost per 1M requests, normalised to unsplit",
        (
            ("cost_per_1m_openfaas_usd", "OpenFaaS (reserved memory x time)"),
            ("cost_per_1m_lambda_usd", "Lambda (CPU share of the allocation modelled)"),
        ),
    ),
    "p95.png": ("p95 end-to-end latency, normalised to unsplit", (("p95_ms", "p95 latency"),)),
}
_DPI = 130
#: a panel whose ratios reach beyond LOG_SPAN x unsplit (or below 1 / LOG_SPAN x) is drawn on a log
#: axis, so that one outlier does not flatten every other bar
LOG_SPAN = 10.0
_COLORS = (
    "#7f7f7f",
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
)


def write_charts(rows: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Write `CHARTS` into ``folder`` from ``results.json`` rows; returns the paths written.

    Models without an unsplit run are left out (nothing to normalise to); a bar of a run with an
    OOM is hatched and marked "OOM".
    """
    written = []
    for name in CHARTS:
        fig = chart_figure(rows, name)
        if fig is None:
            return []
        written.append(save_png(fig, Path(folder) / name, dpi=_DPI))
    return written


def chart_figure(rows: Sequence[dict[str, Any]], name: str) -> Any:
    """The matplotlib Figure of chart ``name`` (a key of `CHARTS`); None without a model that
    has an unsplit run.

    A panel whose ratios span more than `LOG_SPAN` (torch-unsplit at thousands of times
    unsplit's MC, say) gets a log axis, its bars drawn from 1.0 (above: worse than unsplit,
    below: better), and each bar beyond `LOG_SPAN` x or below 1 / `LOG_SPAN` x is labelled
    with its ratio; otherwise the axis is linear from 0.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = {r["model"]: r for r in rows if r["strategy"] == "unsplit"}
    models = [m for m in dict.fromkeys(r["model"] for r in rows) if m in base]
    labels = list(dict.fromkeys(r["strategy"] for r in rows if r["model"] in base))
    if not models:
        return None
    by = {(r["model"], r["strategy"]): r for r in rows}
    title, panels = CHARTS[name]
    width = max(6.0, 1.2 + 0.22 * len(labels) * len(models))
    fig = Figure(figsize=(width, 1.0 + 2.6 * len(panels)), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (key, panel_title) in zip(axes, panels):
        _panel(ax, models, labels, by, base, key, panel_title)
    _legend(axes[0], labels)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _legend(ax: Any, labels: list[str]) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=_COLORS[j % len(_COLORS)], label=label) for j, label in enumerate(labels)
    ]
    handles.append(
        Patch(facecolor="white", edgecolor="black", hatch="///", label="OOM: peak RSS > allocated")
    )
    ax.legend(
        handles=handles,
        fontsize=7,
        ncol=min(len(handles), 5),
        loc="lower left",
        bbox_to_anchor=(0.0, 1.08),
        frameon=False,
    )


def _panel(
    ax: Any, models: list[str], labels: list[str], by: dict, base: dict, key: str, title: str
) -> None:
    width = 0.8 / len(labels)
    series = []  # per label: (xs, ratios, ooms)
    for j, label in enumerate(labels):
        xs, ys, ooms = [], [], []
        for i, model in enumerate(models):
            row, ref = by.get((model, label)), base[model]
            if row is None or not ref[key] or not math.isfinite(row[key]) or row[key] <= 0:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(row[key] / ref[key])
            ooms.append(bool(row["oom"]))
        series.append((xs, ys, ooms))
    ratios = [y for _, ys, _ in series for y in ys] or [1.0]
    log = max(ratios) > LOG_SPAN or min(ratios) < 1 / LOG_SPAN
    for j, (xs, ys, ooms) in enumerate(series):
        # On a log axis a bar grows from 1.0 (unsplit) towards its ratio, up or down.
        bars = ax.bar(
            xs,
            [y - 1.0 for y in ys] if log else ys,
            bottom=1.0 if log else 0.0,
            width=width * 0.95,
            color=_COLORS[j % len(_COLORS)],
            zorder=2,
        )
        for bar, y, oom in zip(bars, ys, ooms):
            mark = []
            if log and not 1 / LOG_SPAN <= y <= LOG_SPAN:
                mark.append(f"{y:,.0f}x" if y >= 10 else f"{y:.2g}x")
            if oom:
                bar.set_hatch("///")
                bar.set_edgecolor("black")
                mark.append("OOM")
            if mark:
                ax.annotate(
                    " ".join(mark),
                    (bar.get_x() + bar.get_width() / 2, max(y, 1.0)),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                    color="#b00000" if oom else "black",
                )
    ax.axhline(1.0, color="black", linewidth=0.8, zorder=3)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, fontsize=8, rotation=30 if len(models) > 6 else 0)
    ax.set_xlim(-0.5, len(models) - 0.5)
    if log:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        # room above the tallest bar (and below the lowest) for its label
        ax.set_ylim(min(min(ratios), 1.0) / 1.6, max(max(ratios), 1.0) * 8)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylabel("x unsplit (log)", fontsize=8)
    else:
        ax.set_ylim(0, max(max(ratios), 1.0) * 1.18)
        ax.set_ylabel("x unsplit", fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", alpha=0.3, zorder=0)

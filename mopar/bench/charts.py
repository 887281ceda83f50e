"""Bar charts of a bench run, like the paper's Fig. 10: per model, each variant's MC, cost and
p95 latency normalised to unsplit's (1.0 = unsplit; lower is better).

matplotlib is imported inside `write_charts`, on the Agg canvas (never pyplot), so importing this
module is cheap and nothing touches a display or matplotlib's global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mopar.planner.plot import save_png

__all__ = ["CHARTS", "write_charts"]

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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = {r["model"]: r for r in rows if r["strategy"] == "unsplit"}
    models = [m for m in dict.fromkeys(r["model"] for r in rows) if m in base]
    labels = list(dict.fromkeys(r["strategy"] for r in rows if r["model"] in base))
    if not models:
        return []
    by = {(r["model"], r["strategy"]): r for r in rows}
    written = []
    for name, (title, panels) in CHARTS.items():
        width = max(6.0, 1.2 + 0.22 * len(labels) * len(models))
        fig = Figure(figsize=(width, 1.0 + 2.6 * len(panels)), dpi=_DPI)
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
        for ax, (key, panel_title) in zip(axes, panels):
            _panel(ax, models, labels, by, base, key, panel_title)
        _legend(axes[0], labels)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        written.append(save_png(fig, Path(folder) / name, dpi=_DPI))
    return written


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
    top = 1.0
    for j, label in enumerate(labels):
        xs, ys, ooms = [], [], []
        for i, model in enumerate(models):
            row, ref = by.get((model, label)), base[model]
            if row is None or not ref[key] or not math.isfinite(row[key]):
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(row[key] / ref[key])
            ooms.append(bool(row["oom"]))
        bars = ax.bar(xs, ys, width=width * 0.95, color=_COLORS[j % len(_COLORS)], zorder=2)
        for bar, y, oom in zip(bars, ys, ooms):
            if oom:
                bar.set_hatch("///")
                bar.set_edgecolor("black")
                ax.annotate(
                    "OOM",
                    (bar.get_x() + bar.get_width() / 2, y),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    rotation=90,
                    color="#b00000",
                )
        top = max([top, *ys])
    ax.axhline(1.0, color="black", linewidth=0.8, zorder=3)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, fontsize=8, rotation=30 if len(models) > 6 else 0)
    ax.set_xlim(-0.5, len(models) - 0.5)
    ax.set_ylim(0, top * 1.18)
    ax.set_ylabel("x unsplit", fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", alpha=0.3, zorder=0)

"""The accuracy report's slice section and its rendering."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.table import Table

from mopar.runner.bundle import read_manifest

__all__ = ["slice_errors", "report_table"]


def slice_errors(bundles: list[Path]) -> dict[str, Any]:
    """Planned vs measured slices of compiled bundles (their plan.json ``sizing`` section).

    ``slice_memory_rel_err`` is mean |predicted need - measured peak RSS| / measured and
    ``slice_time_rel_err`` mean |predicted time - measured median| / measured; ``slices_over_plan``
    counts slices whose measured peak RSS exceeded the memory the plan allocated (before compile
    raised it to the measurement).
    """
    rows = []
    for bundle in bundles:
        rows += read_manifest(bundle).document.sizing or ()
    mem = [abs(r.need_mb - r.peak_rss_mb) / r.peak_rss_mb for r in rows if r.peak_rss_mb]
    tim = [
        abs(r.planned_time_ms - r.p50_ms) / r.p50_ms for r in rows if r.p50_ms and r.planned_time_ms
    ]
    return {
        "slice_memory_rel_err": sum(mem) / len(mem) if mem else None,
        "slice_time_rel_err": sum(tim) / len(tim) if tim else None,
        "slices_over_plan": sum(1 for r in rows if r.peak_rss_mb > r.planned_mb),
        "slices": len(rows),
    }


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.4f}"


def report_table(report: dict[str, Any]) -> Table:
    table = Table(title="predictor accuracy (held out)")
    for col in ("metric", "xgboost", "linear", "random forest"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    sections = [report, report["baselines"]["lr"], report["baselines"]["rf"]]
    for label, key, pct in (
        ("layer memory RMSLE (leave-one-family-out)", "layer_memory_rmsle", False),
        ("memory under-estimate rate", "memory_underestimate_rate", True),
        ("time MAPE", "time_mape", True),
        ("time within +-10%", "time_within_10pct", True),
    ):
        table.add_row(label, *(_fmt(s.get(key), pct) for s in sections))
    table.add_section()
    for family in sorted(report["models"]):
        table.add_row(
            f"time MAPE, held-out {family} layers",
            *(_fmt(s["models"].get(family, {}).get("time_mape"), True) for s in sections),
        )
    for op in sorted(report.get("time_mape_by_op", {})):
        table.add_row(
            f"time MAPE, {op} layers",
            *(_fmt(s.get("time_mape_by_op", {}).get(op), True) for s in sections),
        )
    table.add_section()
    for op in sorted(report["memory_rmsle"]):
        table.add_row(f"memory RMSLE: {op}", *(_fmt(s["memory_rmsle"].get(op)) for s in sections))
    if report.get("slices"):
        table.add_section()
        table.add_row("slice memory rel. error", _fmt(report["slice_memory_rel_err"], True), "", "")
        table.add_row("slice time rel. error", _fmt(report["slice_time_rel_err"], True), "", "")
        table.add_row(
            "slices over planned memory",
            f"{report['slices_over_plan']} of {report['slices']}",
            "",
            "",
        )
    return table

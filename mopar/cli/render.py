"""Rich tables for plans, layers and run reports."""

from __future__ import annotations

from rich.table import Table

from mopar.cli.common import human_bytes

__all__ = ["plan_table", "layer_table", "run_table", "compare_table"]


def _flops(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def plan_table(plan) -> Table:
    table = Table(title=f"plan for {plan.model} ({plan.strategy}, {len(plan.slices)} slices, "
                        f"{plan.num_layers} layers)")
    for col in ("slice", "layers", "first .. last", "params", "FLOPs", "in", "out", "memory"):
        table.add_column(col, justify="left" if col in ("slice", "first .. last") else "right")
    for s in plan.slices:
        table.add_row(
            s.name, str(len(s.layers)), f"{s.layers[0]} .. {s.layers[-1]}", human_bytes(s.param_bytes),
            _flops(s.flops), human_bytes(s.in_bytes), human_bytes(s.out_bytes), f"{s.memory_mb} MB",
        )
    return table


def layer_table(lg, name: str) -> Table:
    table = Table(title=f"{name}: {len(lg)} layers, {human_bytes(lg.param_bytes)} of parameters")
    for col in ("#", "layer", "type", "ops", "params", "FLOPs", "out"):
        table.add_column(col, justify="right" if col in ("#", "params", "FLOPs", "out") else "left")
    for layer in lg.layers:
        ops = ", ".join(layer.ops[:4]) + (" ..." if len(layer.ops) > 4 else "")
        table.add_row(str(layer.index), layer.name, layer.module_type, ops,
                      human_bytes(layer.param_bytes), _flops(layer.flops), human_bytes(layer.output_bytes))
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def run_table(report, title: str) -> Table:
    table = Table(title=title)
    for col in ("slice", "peak RSS", "allocated", "p50", "p95", "load"):
        table.add_column(col, justify="left" if col == "slice" else "right")
    for s in report.slices:
        over = " [red](over)[/red]" if s.peak_rss_mb > s.allocated_mb else ""
        table.add_row(s.name, f"{s.peak_rss_mb:.1f} MB{over}", f"{s.allocated_mb} MB",
                      _ms(s.p50_ms), _ms(s.p95_ms), f"{s.load_ms:.0f} ms")
    table.add_section()
    table.add_row("end to end", f"{sum(s.peak_rss_mb for s in report.slices):.1f} MB",
                  f"{sum(s.allocated_mb for s in report.slices)} MB",
                  _ms(report.latency_p50_ms), _ms(report.latency_p95_ms), "")
    return table


def compare_table(report, baseline) -> Table:
    """This bundle against a baseline bundle (e.g. unsplit), as ratios (bundle / baseline)."""

    def mc(r) -> float:  # GB-seconds per request: allocated GB x median time, summed over slices
        return sum(s.allocated_mb / 1024 * (s.p50_ms or 0.0) / 1e3 for s in r.slices)

    def label(r) -> str:
        return "unsplit" if len(r.slices) == 1 else f"{len(r.slices)} slices"

    rows = [
        ("latency p50 (ms)", baseline.latency_p50_ms, report.latency_p50_ms),
        ("latency p95 (ms)", baseline.latency_p95_ms, report.latency_p95_ms),
        ("largest function peak RSS (MB)", max(s.peak_rss_mb for s in baseline.slices),
         max(s.peak_rss_mb for s in report.slices)),
        ("sum of peak RSS (MB)", sum(s.peak_rss_mb for s in baseline.slices),
         sum(s.peak_rss_mb for s in report.slices)),
        ("MC: allocated GB x s per request", mc(baseline), mc(report)),
    ]
    a, b = label(baseline), label(report)
    table = Table(title=f"{b} vs {a} (measured, requests interleaved)")
    for col in ("metric", a, b, "ratio"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, base, ours in rows:
        base, ours = base or 0.0, ours or 0.0
        fmt = "{:.4f}" if base < 1 else "{:.1f}"
        table.add_row(name, fmt.format(base), fmt.format(ours), f"{ours / base:.2f}x" if base else "-")
    return table

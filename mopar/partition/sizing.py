"""Memory size of a slice's function.

Two pure steps. Before export, `estimate_memory_mb` gives a first size: runtime baseline (python +
numpy + onnxruntime, measured) + weight_copies x parameter bytes + activation_copies x (bytes in +
bytes out + the largest layer's activations). After export, `size_from_peaks` replaces it with the
slice's measured peak RSS plus a margin: until the profiler predicts per-layer memory, a
measurement is the only size we can stand behind. Both round up to the platform's memory grid.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from mopar.partition.plan import Plan

__all__ = [
    "MEASURED_SOURCE", "PREDICTED_SOURCE", "estimate_memory_mb", "predicted_memory_mb", "size_from_peaks",
]

MB = 1 << 20


def estimate_memory_mb(
    *, param_bytes: int, io_bytes: int, peak_activation_bytes: int, runtime: dict[str, Any]
) -> int:
    """Memory in MB for a slice, rounded up to ``runtime['memory_grid_mb']``."""
    need = (
        runtime["runtime_baseline_mb"] * MB
        + runtime["weight_copies"] * param_bytes
        + runtime["activation_copies"] * (io_bytes + peak_activation_bytes)
    )
    return _round_up(need / MB, runtime)


PREDICTED_SOURCE = "predicted: runtime baseline + sum of the XGBoost layer predictions (with margin)"
MEASURED_SOURCE = "measured: peak RSS of each slice process over 10 requests on the reference input, plus margin"


def _round_up(mb: float, runtime: dict[str, Any]) -> int:
    grid = runtime["memory_grid_mb"]
    rounded = math.ceil(mb / grid) * grid
    return int(min(max(rounded, runtime["min_memory_mb"]), runtime["max_memory_mb"]))


def predicted_memory_mb(layer_memory_mb, runtime: dict[str, Any]) -> int:
    """A slice's memory from its layers' predicted footprints (MB, margin included).

    Summed, not the chain rule's max: each layer's footprint holds its own weights, and all of a
    slice's weights stay resident while it serves, so the max would under-size weight-heavy slices.
    """
    return _round_up(runtime["runtime_baseline_mb"] + float(sum(layer_memory_mb)), runtime)


def size_from_peaks(plan: Plan, peaks_mb: dict[str, float], runtime: dict[str, Any]) -> Plan:
    """A new Plan whose slices are sized to their measured peak RSS (MB) times (1 + margin)."""
    margin = runtime["measured_margin"]
    slices = tuple(
        replace(s, memory_mb=_round_up(peaks_mb[s.name] * (1 + margin), runtime)) for s in plan.slices
    )
    notes = tuple(n for n in plan.notes if "estimate" not in n)
    return replace(plan, slices=slices, memory_source=MEASURED_SOURCE, notes=notes)

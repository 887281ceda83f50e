"""Memory size of a slice's function, from the measured runtime baseline.

Until the profiler predicts per-layer memory, a slice is sized as: runtime baseline (python +
numpy + onnxruntime, measured) + weight_copies x parameter bytes + activation_copies x (bytes in
+ bytes out + the largest layer's activations), rounded up to the platform's memory grid.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["estimate_memory_mb"]

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
    grid = runtime["memory_grid_mb"]
    mb = math.ceil(need / MB / grid) * grid
    return int(min(max(mb, runtime["min_memory_mb"]), runtime["max_memory_mb"]))

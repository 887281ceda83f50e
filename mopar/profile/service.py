"""Predict every layer of a LayerGraph: the service profile vectors M (MB) and T (ms)."""

from __future__ import annotations

from dataclasses import dataclass

from mopar.ir import LayerGraph
from mopar.profile.features import CAST_READS, feature_matrix, layer_features
from mopar.profile.store import Predictors

__all__ = ["LayerPrediction", "predict_layers"]


@dataclass(frozen=True, kw_only=True)
class LayerPrediction:
    """Predicted footprint of each layer, in layer order.

    Attributes:
        layers: layer names.
        memory_mb: each layer's planned memory beyond the runtime baseline, MB (margin included).
        unmargined_mb: the same without the margin on its predicted transient, MB.
        time_ms: each layer's predicted time at ``threads`` threads, ms.
        parallel: the share of each layer's time that runs in parallel (its op family's).
        threads: the thread count of the measurements.
    """

    layers: tuple[str, ...]
    memory_mb: tuple[float, ...]
    unmargined_mb: tuple[float, ...]
    time_ms: tuple[float, ...]
    parallel: tuple[float, ...]
    threads: float


def predict_layers(lg: LayerGraph, predictors: Predictors) -> LayerPrediction:
    """Run the predictors on every layer's features."""
    rows = [layer_features(layer, lg) for layer in lg.layers]
    x = feature_matrix(rows)
    # a 16-bit weight cast where it is used moves CAST_READS x its bytes a run
    timed = [
        {**r, "param_bytes": r["param_bytes"] + (CAST_READS - 1) * r["cast_bytes"]} for r in rows
    ]
    return LayerPrediction(
        layers=tuple(layer.name for layer in lg.layers),
        memory_mb=tuple(float(v) for v in predictors.predict_memory_mb(x)),
        unmargined_mb=tuple(float(v) for v in predictors.predict_memory_mb(x, margin=False)),
        time_ms=tuple(float(v) for v in predictors.predict_time_ms(feature_matrix(timed))),
        parallel=tuple(predictors.parallel_fraction(row["family"]) for row in rows),
        threads=predictors.threads,
    )

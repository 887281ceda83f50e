"""Predict every layer of a LayerGraph: the service profile vectors M (MB) and T (ms)."""

from __future__ import annotations

from dataclasses import dataclass

from mopar.ir import LayerGraph
from mopar.profile.features import feature_matrix, layer_features
from mopar.profile.store import Predictors

__all__ = ["LayerPrediction", "predict_layers"]


@dataclass(frozen=True, kw_only=True)
class LayerPrediction:
    """Predicted footprint of each layer, in layer order.

    Attributes:
        layers: layer names.
        memory_mb: each layer's planned memory beyond the runtime baseline, MB (margin included).
        time_ms: each layer's predicted time at the measurement's thread count, ms.
    """

    layers: tuple[str, ...]
    memory_mb: tuple[float, ...]
    time_ms: tuple[float, ...]


def predict_layers(lg: LayerGraph, predictors: Predictors) -> LayerPrediction:
    """Run the predictors on every layer's features."""
    x = feature_matrix([layer_features(layer, lg) for layer in lg.layers])
    return LayerPrediction(
        layers=tuple(layer.name for layer in lg.layers),
        memory_mb=tuple(float(v) for v in predictors.predict_memory_mb(x)),
        time_ms=tuple(float(v) for v in predictors.predict_time_ms(x)),
    )

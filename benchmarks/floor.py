"""A function's memory floor: what its peak RSS should not exceed (issue 16).

    floor = runtime baseline + 1.1 x its weights + its largest live activations

The baseline is the calibrated one (``runtime_baseline_mb`` in ``profiles/transports.json``: a
process that imported what a function imports). The weights are the bytes of the function's
initializers. The live activations are found by walking the function's ONNX graph in its stored
(topological) order: a value is live from the node that makes it until the last node that reads
it (graph inputs from the start, graph outputs to the end); the largest sum of live values over
the walk is the figure. Values whose shape is not static count zero, and the walk says how many.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import shape_inference

__all__ = ["WEIGHT_FACTOR", "Floor", "function_floor"]

WEIGHT_FACTOR = 1.1
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Floor:
    """A function's floor and its parts, MB; ``unknown`` values had no static shape."""

    baseline_mb: float
    weights_mb: float
    live_mb: float
    unknown: int

    @property
    def floor_mb(self) -> float:
        return self.baseline_mb + WEIGHT_FACTOR * self.weights_mb + self.live_mb


def function_floor(model_path: Path, baseline_mb: float) -> Floor:
    """The floor of the function whose graph is ``model_path`` (weights may be external)."""
    model = onnx.load(str(model_path), load_external_data=False)
    graph = shape_inference.infer_shapes(model).graph
    weights = {t.name: _tensor_bytes(t) for t in graph.initializer}
    sizes: dict[str, int | None] = {}
    for v in [*graph.input, *graph.value_info, *graph.output]:
        sizes[v.name] = _value_bytes(v)
    last_use: dict[str, int] = {}
    for k, node in enumerate(graph.node):
        for name in node.input:
            last_use[name] = k
    outputs = {v.name for v in graph.output}
    live = {v.name for v in graph.input if v.name not in weights}
    unknown: set[str] = set()

    def nbytes(name: str) -> int:
        size = sizes.get(name)
        if size is None:
            unknown.add(name)
            return 0
        return size

    current = sum(nbytes(n) for n in live)
    peak = current
    for k, node in enumerate(graph.node):
        made = [n for n in node.output if n and n not in live]
        live.update(made)
        current += sum(nbytes(n) for n in made)
        peak = max(peak, current)
        done = [n for n in node.input if n in live and last_use.get(n) == k and n not in outputs]
        for n in done:
            live.discard(n)
            current -= nbytes(n)
    return Floor(
        baseline_mb=baseline_mb,
        weights_mb=sum(weights.values()) / MB,
        live_mb=peak / MB,
        unknown=len(unknown),
    )


def _tensor_bytes(t: onnx.TensorProto) -> int:
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return int(np.prod(t.dims, dtype=np.int64)) * itemsize


def _value_bytes(v: onnx.ValueInfoProto) -> int | None:
    t = v.type.tensor_type
    if not t.HasField("shape") or any(not d.HasField("dim_value") for d in t.shape.dim):
        return None
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
    return int(np.prod([d.dim_value for d in t.shape.dim], dtype=np.int64)) * itemsize

"""The layer graph: an exported model grouped into layers, with tensors on its edges."""

from mopar.ir.graph import (
    INPUT,
    OUTPUT,
    Layer,
    LayerGraph,
    TensorInfo,
    build_layer_graph,
    tensor_info,
)

__all__ = [
    "INPUT",
    "OUTPUT",
    "Layer",
    "LayerGraph",
    "TensorInfo",
    "build_layer_graph",
    "tensor_info",
]

"""The edges of a plan: which tensors each function hands which other, from the layer graph.

A vertical cut assigns every layer to one function; an edge of the layer graph whose ends fall in
two functions becomes part of the plan edge between them (a skip connection is an edge of its
own, from the function that makes the tensor to each that reads it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mopar.ir import INPUT, OUTPUT, LayerGraph
from mopar.plan import REQUEST, RESPONSE, Edge, data_edges

__all__ = ["vertical_edges"]


def vertical_edges(
    lg: LayerGraph, slices: Sequence[tuple[str, Sequence[str]]], transport: Mapping[str, str]
) -> tuple[Edge, ...]:
    """The edges between ``slices`` (name, layer names), in order, of ``lg``.

    Args:
        transport: how each slice hands its outputs on.
    """
    owner = {layer: name for name, layers in slices for layer in layers}
    owner.update({INPUT: REQUEST, OUTPUT: RESPONSE})
    reads: dict[str, dict[str, None]] = {name: {} for name, _ in slices}
    makes: dict[str, dict[str, None]] = {name: {} for name, _ in slices}
    inputs: dict[str, None] = {}
    outputs: dict[str, None] = {}
    nbytes: dict[str, int] = {}
    for u, v, tensors in lg.graph.edges(data="tensors"):
        src, dst = owner[u], owner[v]
        if src == dst:
            continue
        for t in tensors:
            nbytes[t.name] = t.nbytes
            (inputs if src == REQUEST else makes[src]).setdefault(t.name)
            (outputs if dst == RESPONSE else reads[dst]).setdefault(t.name)
    io = [(name, tuple(reads[name]), tuple(makes[name])) for name, _ in slices]
    return data_edges(
        io, model_inputs=inputs, model_outputs=outputs, nbytes=nbytes, transport=transport
    )

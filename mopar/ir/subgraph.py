"""Subgraphs of the exported graph as modules: one `SliceModule` per slice of a vertical cut.

Extraction, not a rewrite: it copies nodes into a new graph and changes none of the model's. It
sits beside the IR (as ``torch.fx.passes.split_module`` sits beside FX) because the planner
analyses the slices it plans (`mopar.ir.sharding`) and the rewrite applies a Plan to the very
same modules (the rewrite's ``split_by_plan``), so the two cannot see different graphs.

A slice's inputs are exactly the tensors it reads that were made outside it (model inputs and
earlier slices' results, skip connections included); its outputs are exactly the tensors it makes
that a later slice or the model output reads. Parameters are copied into every slice that reads
them. Tensors are named by their public value name, which is also their ONNX name.

Read in this order: `SliceModule`, `extract_slices` (with `_build_slice`), then the small
readers of a slice's graph that the sharding analysis and the rewrite share (`public_name`,
`held_bytes`, `slice_flops`...).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mopar.errors import InternalError
from mopar.ir.flops import node_flops
from mopar.ir.graph import LayerGraph, TensorInfo, tensor_info
from mopar.ir.layout import contiguous_as_clone, contiguous_before_view

__all__ = [
    "SliceModule",
    "SliceLayers",
    "extract_slices",
    "public_name",
    "param_tensor",
    "held_bytes",
    "slice_flops",
    "placeholders",
    "output_nodes",
]


@dataclass(frozen=True, kw_only=True)
class SliceModule:
    """One slice as a torch module.

    Attributes:
        name: the slice's name (from the Plan).
        gm: a GraphModule whose forward takes ``inputs`` positionally and returns ``outputs``.
        inputs: the tensors the slice receives, in forward() order.
        outputs: the tensors the slice produces, in return order.
        rows: the first dimension of every input and output may be smaller than its shape says
            (an expert function, sent only the tokens routed to it).
        feed: makes the unit's inputs from the tensors before it, when no unit makes them (an
            expert function's tokens and gates, which its dispatch makes per request).
        dispatch: a dispatch function's routing and tail (`mopar.rewrite.experts.Dispatch`):
            the tail is what it exports; ``gm`` is its layer's dense translation, for the
            tensors after it.
    """

    name: str
    gm: fx.GraphModule
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    rows: bool = False
    feed: Any = None
    dispatch: Any = None


class SliceLayers(Protocol):
    """What extraction reads of a slice: its name and its layers (a Plan's function)."""

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> Sequence[str]: ...


def extract_slices(lg: LayerGraph, slices: Sequence[SliceLayers]) -> tuple[SliceModule, ...]:
    """One `SliceModule` per slice, in order; ``slices`` must cover every layer of ``lg``."""
    nodes = {n.name: n for n in lg.gm.graph.nodes}
    slice_of: dict[str, int] = {}
    for i, sl in enumerate(slices):
        for layer_name in sl.layers:
            layer = lg.graph.nodes[layer_name]["layer"]
            slice_of.update((n, i) for n in layer.nodes)
    missing = set(lg.node_layer) - set(slice_of)
    if missing:
        raise InternalError(
            f"plan leaves {len(missing)} graph nodes unassigned, e.g. {min(missing)}"
        )
    model_outputs = {n.name for n in output_nodes(lg.gm.graph) if isinstance(n, fx.Node)}
    readers: dict[str, set[int]] = {}
    for name, i in slice_of.items():
        for arg in nodes[name].all_input_nodes:
            readers.setdefault(arg.name, set()).add(i)
    return tuple(
        _build_slice(lg, sl.name, i, nodes, slice_of, readers, model_outputs)
        for i, sl in enumerate(slices)
    )


def _build_slice(lg, name, index, nodes, slice_of, readers, model_outputs) -> SliceModule:
    body = [nodes[n] for n in nodes if slice_of.get(n) == index]  # graph order
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[TensorInfo] = []
    for node in body:  # placeholders first, in order of first use
        for arg in node.all_input_nodes:
            if arg in env or arg.op == "get_attr" or slice_of.get(arg.name) == index:
                continue
            if not isinstance(arg.meta.get("val"), torch.Tensor):
                raise InternalError(f"non-tensor value {arg.name} crosses into slice {name}")
            public = lg.value_names[arg.name]
            env[arg] = graph.placeholder(arg.name)  # FX needs an identifier; ONNX gets `public`
            env[arg].meta = dict(arg.meta)
            inputs.append(tensor_info(arg, public))

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env and arg.op == "get_attr":
            env[arg] = graph.get_attr(arg.target)
        return env[arg]

    for node in body:
        env[node] = graph.node_copy(node, lookup)
    outputs = [
        n
        for n in body
        if n.name in model_outputs or any(r > index for r in readers.get(n.name, ()))
    ]
    if not outputs:
        raise InternalError(f"slice {name} produces nothing that is used later")
    graph.output(tuple(env[n] for n in outputs))
    # The ONNX exporter traces the slice again, and may lay tensors out otherwise than capture did.
    contiguous_as_clone(graph)
    contiguous_before_view(graph)
    graph.lint()
    gm = fx.GraphModule(lg.gm, graph, class_name=f"Slice_{name}")
    return SliceModule(
        name=name,
        gm=gm,
        inputs=tuple(inputs),
        outputs=tuple(tensor_info(n, lg.value_names[n.name]) for n in outputs),
    )


# --- readers of a slice's graph -------------------------------------------------------------------


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    """The graph's inputs, in forward() order."""
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The graph's flat outputs, in return order."""
    out = next(n for n in graph.nodes if n.op == "output")
    return list(pytree.tree_leaves(out.args[0]))


def public_name(sm: SliceModule, node: fx.Node) -> str:
    """A slice input or output keeps its public name; another tensor is ``t:`` + its FX name."""
    for out, info in zip(output_nodes(sm.gm.graph), sm.outputs):
        if out is node:
            return info.name
    for ph, info in zip(placeholders(sm.gm.graph), sm.inputs):
        if ph is node:
            return info.name
    return f"t:{node.name}"


def param_tensor(gm: fx.GraphModule, target: str) -> torch.Tensor:
    """The parameter or buffer a ``get_attr`` node of ``gm`` reads."""
    return operator.attrgetter(target)(gm)


def held_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the distinct parameters and buffers ``gm``'s graph reads."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    tensors = [param_tensor(gm, t) for t in targets]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def slice_flops(sm: SliceModule, names: set[str] | None = None) -> int:
    """Forward FLOPs of ``sm``'s nodes (of those named in ``names``, when given)."""
    return sum(node_flops(n) for n in sm.gm.graph.nodes if names is None or n.name in names)

"""Apply a Plan: split the exported graph into one GraphModule per slice.

A slice's inputs are exactly the tensors it reads that were made outside it (model inputs and
earlier slices' results, skip connections included); its outputs are exactly the tensors it makes
that a later slice or the model output reads. Parameters are copied into every slice that reads
them. Tensors are named by their public value name, which is also their ONNX name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from mopar.errors import InternalError
from mopar.ir import LayerGraph, TensorInfo, tensor_info
from mopar.planner import Plan
from mopar.rewrite.layout import contiguous_as_clone, contiguous_before_view

__all__ = ["SliceModule", "split_by_plan", "output_values"]


@dataclass(frozen=True, kw_only=True)
class SliceModule:
    """One slice as a torch module.

    Attributes:
        name: the slice's name (from the Plan).
        gm: a GraphModule whose forward takes ``inputs`` positionally and returns ``outputs``.
        inputs: the tensors the slice receives, in forward() order.
        outputs: the tensors the slice produces, in return order.
    """

    name: str
    gm: fx.GraphModule
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]


def output_values(lg: LayerGraph) -> tuple[str, ...]:
    """Value name of each flat model output, in output order."""
    out_node = next(n for n in lg.gm.graph.nodes if n.op == "output")
    return tuple(lg.value_names[n.name] for n in pytree.tree_leaves(out_node.args[0]))


def split_by_plan(lg: LayerGraph, plan: Plan) -> tuple[SliceModule, ...]:
    """Build one `SliceModule` per slice of ``plan``'s vertical cut (sub-slices aside)."""
    plan = plan.vertical()
    nodes = {n.name: n for n in lg.gm.graph.nodes}
    slice_of: dict[str, int] = {}
    for i, sp in enumerate(plan.slices):
        for layer_name in sp.layers:
            layer = lg.graph.nodes[layer_name]["layer"]
            slice_of.update((n, i) for n in layer.nodes)
    missing = set(lg.node_layer) - set(slice_of)
    if missing:
        raise InternalError(f"plan leaves {len(missing)} graph nodes unassigned, e.g. {min(missing)}")
    out_node = next(n for n in lg.gm.graph.nodes if n.op == "output")
    model_outputs = {n.name for n in pytree.tree_leaves(out_node.args[0]) if isinstance(n, fx.Node)}
    readers: dict[str, set[int]] = {}
    for name, i in slice_of.items():
        for arg in nodes[name].all_input_nodes:
            readers.setdefault(arg.name, set()).add(i)
    return tuple(
        _build_slice(lg, plan.slices[i].name, i, nodes, slice_of, readers, model_outputs)
        for i in range(len(plan.slices))
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
        n for n in body
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


"""LayerGraph: the exported FX graph grouped into layers, as a networkx DiGraph.

Read in this order: `TensorInfo`, `Layer`, `LayerGraph`, then `build_layer_graph`, which
(1) finds each node's owning module from torch.export's ``nn_module_stack``, (2) cuts the node
sequence into runs owned by one module call, attaching functional ops to the neighbouring run,
(3) merges runs across boundaries that a non-tensor value crosses (those cannot be cut), and
(4) measures parameter bytes, FLOPs and the tensors on every edge.

Layers are contiguous runs of the graph's (topological) node order, so the layer order is a
topological order of the layer DiGraph by construction.
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import networkx as nx
import torch
from torch import fx

from mopar.ir import sizes
from mopar.ir.flops import data_dependent, node_flops, op_name

__all__ = [
    "TensorInfo",
    "Layer",
    "LayerGraph",
    "build_layer_graph",
    "tensor_info",
    "INPUT",
    "OUTPUT",
    "module_paths",
    "normal_path",
]

log = logging.getLogger(__name__)

INPUT = "<input>"
OUTPUT = "<output>"
# The module stack torch.export's node-metadata hook gives a node it adds without one to copy.
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"
# Ops that start a new layer when the graph carries no module hierarchy (e.g. from TorchScript).
_ANCHOR_OPS = {
    "conv1d",
    "conv2d",
    "conv3d",
    "convolution",
    "linear",
    "addmm",
    "mm",
    "bmm",
    "matmul",
    "lstm",
    "gru",
    "embedding",
    "scaled_dot_product_attention",
    "layer_norm",
    "batch_norm",
}


@dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """A tensor value in the graph: its public name, shape, dtype and size in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Layer:
    """A group of graph nodes owned by one module call.

    Attributes:
        name: unique layer name: the module path, with ``#k`` for its k-th later call.
        index: position in topological order.
        module_type: class name of the owning module (``""`` when there is none).
        nodes: names of the FX nodes in this layer, in graph order.
        ops: distinct ATen op names in this layer.
        param_bytes: bytes of parameters and buffers this layer reads.
        flops: forward floating-point operations (a multiply-add counts 2).
        output_bytes: bytes of the tensors this layer hands to later layers or the output.
        activation_bytes: bytes of all tensors this layer produces.
    """

    name: str
    index: int
    module_type: str
    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    param_bytes: int
    flops: int
    output_bytes: int
    activation_bytes: int


class LayerGraph:
    """Layers of an exported model and the tensors flowing between them.

    ``graph`` is a networkx DiGraph whose nodes are layer names plus `INPUT` and `OUTPUT`; each
    layer node has a ``layer`` attribute, and each edge has ``tensors`` (a tuple of `TensorInfo`)
    and ``bytes``.
    """

    def __init__(
        self,
        *,
        gm: fx.GraphModule,
        layers: tuple[Layer, ...],
        graph: nx.DiGraph,
        node_layer: Mapping[str, str],
        value_names: Mapping[str, str],
        inputs: tuple[TensorInfo, ...],
        outputs: tuple[TensorInfo, ...],
    ) -> None:
        self.gm = gm
        self.layers = layers
        self.graph = graph
        self.node_layer = MappingProxyType(dict(node_layer))
        self.value_names = MappingProxyType(dict(value_names))
        self.inputs = inputs
        self.outputs = outputs

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    @property
    def param_bytes(self) -> int:
        """Bytes of all distinct parameters and buffers (shared ones counted once)."""
        return sum(_attr_bytes(self.gm, t) for t in _attr_targets(self.gm.graph.nodes))


def build_layer_graph(
    gm: fx.GraphModule,
    *,
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    depth: int | None = None,
) -> LayerGraph:
    """Group ``gm``'s nodes into layers by module hierarchy.

    Args:
        gm: an exported GraphModule (``ExportedProgram.module()``).
        input_names: public names of the placeholders, in order.
        output_names: public names of the flat outputs, in order.
        depth: group by module path truncated to this many components; ``None`` groups by leaf
            module.
    """
    body = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    # Tensors crossing cuts become ONNX graph inputs and outputs. A name with ":" can never equal
    # a name the exporter gives its own values (FX node names and parameter paths have none).
    value_names = {n.name: f"t:{n.name}" for n in body}
    value_names.update({p.name: pub for p, pub in zip(placeholders, input_names)})

    runs = _runs(body, depth)
    runs = _merge_uncuttable(runs)
    node_layer: dict[str, str] = {}
    layers: list[Layer] = []
    seen: dict[str, int] = {}
    for index, (owner, module_type, nodes) in enumerate(runs):
        base = owner or op_name(nodes[0])
        name = base if base not in seen else f"{base}#{seen[base]}"
        seen[base] = seen.get(base, 0) + 1
        for n in nodes:
            node_layer[n.name] = name
        layers.append(
            Layer(
                name=name,
                index=index,
                module_type=module_type,
                nodes=tuple(n.name for n in nodes),
                ops=tuple(dict.fromkeys(op_name(n) for n in nodes)),
                param_bytes=sum(_attr_bytes(gm, t) for t in _attr_targets(_inputs_of(nodes))),
                flops=sum(node_flops(n) for n in nodes),
                output_bytes=0,
                activation_bytes=sum(tensor_info(n, n.name).nbytes for n in nodes if _is_tensor(n)),
            )
        )
    _warn_data_dependent(body, node_layer, layers)
    graph = _edges(layers, node_layer, value_names, placeholders, output_node)
    out_bytes = {
        lay.name: sum(d["bytes"] for _, _, d in graph.out_edges(lay.name, data=True))
        for lay in layers
    }
    layers = [replace(lay, output_bytes=out_bytes[lay.name]) for lay in layers]
    for lay in layers:
        graph.nodes[lay.name]["layer"] = lay
    flat_out = torch.utils._pytree.tree_leaves(output_node.args[0])
    return LayerGraph(
        gm=gm,
        layers=tuple(layers),
        graph=graph,
        node_layer=node_layer,
        value_names=value_names,
        inputs=tuple(tensor_info(p, pub) for p, pub in zip(placeholders, input_names)),
        outputs=tuple(tensor_info(n, pub) for n, pub in zip(flat_out, output_names)),
    )


def _warn_data_dependent(
    nodes: list[fx.Node], node_layer: Mapping[str, str], layers: list[Layer]
) -> None:
    """One warning per node that makes a data-dependent size: what it counts as, and the layer
    that holds it and every reader of its tensors (no cut falls inside)."""
    for found in data_dependent(nodes):
        bound = (
            f"its upper bound, shape {found.shape}"
            if found.bounded
            else f"{sizes.UNBOUNDED_DIM} per data-dependent dimension (torch knows no bound)"
        )
        where = f"{found.source}, " if found.source else ""
        layer = node_layer[found.node]
        held = next(la for la in layers if la.name == layer).nodes
        log.warning(
            "%s (%snode %s) makes a data-dependent size: its tensors count at %s, and layer %s "
            "(%d nodes) holds it and their readers, since no cut may fall where they are live; "
            "a fixed-size form plans better (see docs/exportable.md)",
            found.op,
            where,
            found.node,
            bound,
            layer,
            len(held),
        )


# --- grouping ---------------------------------------------------------------------------------


def _module_stack(node: fx.Node) -> dict:
    """``node``'s ``nn_module_stack``, less the placeholder entry torch.export's passes give
    nodes they add when there is no stack to copy (TorchScript conversion, say)."""
    stack = node.meta.get("nn_module_stack") or {}
    return {k: v for k, v in stack.items() if k != _NO_MODULE}


def _module_path(node: fx.Node, depth: int | None) -> tuple[str, str] | None:
    stack = _module_stack(node)
    if not stack:
        return None
    path, mtype = list(stack.values())[-1]
    path = normal_path(path)
    if depth is not None:
        path = ".".join(path.split(".")[:depth])
    mtype = mtype if isinstance(mtype, str) else getattr(mtype, "__qualname__", str(mtype))
    return (path, mtype.rsplit(".", 1)[-1]) if path else None


def normal_path(path: object) -> str:
    """A module path as ``layer1.0``: strict-mode paths look like ``L['self'].layer1[0]``."""
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).strip(".")


def module_paths(node: fx.Node) -> list[str]:
    """The module paths of ``node``'s module stack, outermost first."""
    return [normal_path(path) for path, _ in _module_stack(node).values()]


def _call_key(node: fx.Node) -> str:
    stack = _module_stack(node)
    return list(stack)[-1] if stack else ""


def _runs(body: list[fx.Node], depth: int | None) -> list[tuple[str, str, list[fx.Node]]]:
    owners = [_module_path(n, depth) for n in body]
    paths = {o[0] for o in owners if o}
    # A path that is a proper prefix of another owns only glue code (a residual add in a block's
    # forward): such nodes are functional and attach to a neighbouring layer.
    parents = {p for p in paths for q in paths if q.startswith(p + ".")}
    if not paths:
        return _anchor_runs(body)
    runs: list[tuple[str, str, list[fx.Node]]] = []
    current_key: tuple[str, str] | None = None
    pending: list[fx.Node] = []  # functional nodes seen before the first owned node
    for node, owner in zip(body, owners):
        if owner is None or owner[0] in parents:
            if runs:
                runs[-1][2].append(node)
            else:
                pending.append(node)
            continue
        key = (owner[0], _call_key(node) if depth is None else owner[0])
        if runs and key == current_key:
            runs[-1][2].append(node)
        else:
            runs.append((owner[0], owner[1], [*pending, node]))
            pending = []
            current_key = key
    if pending:  # a model with only functional nodes around no module: one layer
        runs.append(("", "", pending))
    return runs


def _anchor_runs(body: list[fx.Node]) -> list[tuple[str, str, list[fx.Node]]]:
    runs: list[tuple[str, str, list[fx.Node]]] = []
    for node in body:
        if not runs or (op_name(node) in _ANCHOR_OPS and runs[-1][2]):
            runs.append(("", op_name(node), []))
        runs[-1][2].append(node)
    return runs


def _merge_uncuttable(runs):
    """Merge a run into its predecessor while a non-tensor value crosses the boundary, and the
    runs from the maker of a tensor of data-dependent size (or of such a size) to each reader
    into one: a function hands on tensors of one known shape (`mopar.ir.sizes`)."""
    merged: list[tuple[str, str, list[fx.Node]]] = []
    where: dict[fx.Node, int] = {}  # node -> index of its run in ``merged``
    for owner, mtype, nodes in runs:
        reads = [a for n in nodes for a in n.all_input_nodes if a in where]
        starts = [where[a] for a in reads if _data_dependent(a)]
        if merged and any(not _is_tensor(a) for a in reads):
            starts.append(len(merged) - 1)
        if starts:
            start = min(starts)
            owner, mtype = merged[start][0], merged[start][1]
            nodes = [n for run in merged[start:] for n in run[2]] + list(nodes)
            del merged[start:]
        merged.append((owner, mtype, list(nodes)))
        where.update(dict.fromkeys(nodes, len(merged) - 1))
    return merged


def _data_dependent(node: fx.Node) -> bool:
    """Whether ``node`` is a tensor of data-dependent size, or such a size itself."""
    val = node.meta.get("val")
    return isinstance(val, (torch.Tensor, torch.SymInt)) and not sizes.is_exact(val)


# --- measurements -------------------------------------------------------------------------------


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def tensor_info(node: fx.Node, name: str) -> TensorInfo:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return TensorInfo(name=name, shape=(), dtype=type(val).__name__, nbytes=0)
    return TensorInfo(
        name=name,
        shape=sizes.shape(val),  # a data-dependent dimension at its upper bound
        dtype=str(val.dtype).removeprefix("torch."),
        nbytes=sizes.nbytes(val),
    )


def _inputs_of(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    return [a for n in nodes for a in n.all_input_nodes]


def _attr_targets(nodes: Iterable[fx.Node]) -> set[str]:
    return {str(n.target) for n in nodes if n.op == "get_attr"}


def _attr_bytes(gm: fx.GraphModule, target: str) -> int:
    obj = operator.attrgetter(target)(gm)
    return obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0


def _edges(layers, node_layer, value_names, placeholders, output_node) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_node(INPUT)
    graph.add_nodes_from(lay.name for lay in layers)
    graph.add_node(OUTPUT)
    flows: dict[tuple[str, str], dict[str, TensorInfo]] = {}
    placeholder_names = {p.name for p in placeholders}

    def source(node: fx.Node) -> str | None:
        if node.name in placeholder_names:
            return INPUT
        return node_layer.get(node.name)

    by_name = {n.name: n for n in output_node.graph.nodes}
    for lay in layers:
        for name in lay.nodes:
            for arg in by_name[name].all_input_nodes:
                src = source(arg)
                if src is None or src == lay.name or not _is_tensor(arg):
                    continue
                flows.setdefault((src, lay.name), {})[arg.name] = tensor_info(
                    arg, value_names[arg.name]
                )
    flat_out = torch.utils._pytree.tree_leaves(output_node.args[0])
    for node in flat_out:
        src = source(node) if isinstance(node, fx.Node) else None
        if src is not None:
            flows.setdefault((src, OUTPUT), {})[node.name] = tensor_info(
                node, value_names[node.name]
            )
    for (u, v), tensors in flows.items():
        infos = tuple(tensors.values())
        graph.add_edge(u, v, tensors=infos, bytes=sum(t.nbytes for t in infos))
    return graph

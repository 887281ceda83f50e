"""Layout passes: make a slice's graph independent of the memory layouts seen at capture.

torch.export records a graph on fake tensors whose strides come from the kernels it traced. The
ONNX exporter traces each slice again, and its decompositions may lay tensors out otherwise: then
an op that only works for one layout fails. Two such ops, each made layout-free here:

* ``aten.contiguous`` is a no-op when its input already is contiguous, and re-tracing can drop
  it, after which a following ``view`` fails: `contiguous_as_clone` makes it an explicit clone.
* ``aten.view`` works only on strides that allow it. torch.export leaves out a ``.contiguous()``
  the model calls when the traced input was contiguous already: under ``torch.no_grad()`` CPU
  SDPA returns its output laid out so that ``out.transpose(1, 2)`` is contiguous, so T5's
  ``.transpose(1, 2).contiguous().view(...)`` is captured as ``transpose`` then ``view``. The
  ONNX exporter's own re-trace sees that layout too, but its decomposition of SDPA lays the
  output out the usual way, and the ``view`` fails ("Cannot view a tensor with shape ... and
  strides ..."). ``reshape`` (and ``flatten``, ``unflatten``) fail the same way: re-tracing
  records them as a ``view`` wherever the traced strides allow one. `contiguous_before_view`
  puts a contiguous clone between a view op and such a reshaping of its result, wherever no
  in-place op could tell the copy from the alias.

Each pass changes the graph in place and returns whether it changed anything.
"""

from __future__ import annotations

import operator

import networkx as nx
import torch
from torch import fx

__all__ = ["contiguous_as_clone", "contiguous_before_view"]


def contiguous_as_clone(graph: fx.Graph) -> bool:
    """Replace ``aten.contiguous`` with an explicit contiguous ``clone``; return whether it did."""
    modified = False
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.contiguous.default:
            node.target = torch.ops.aten.clone.default
            node.kwargs = {"memory_format": torch.contiguous_format}
            modified = True
    return modified


_RESHAPES = frozenset(
    {
        torch.ops.aten.view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.flatten.using_ints,
        torch.ops.aten.unflatten.int,
    }
)
"""Ops that re-tracing may record as a ``view`` of their input, valid for its strides only."""


def contiguous_before_view(graph: fx.Graph) -> bool:
    """Make a view or reshape read a contiguous clone where its input is the result of a view op
    (``transpose``, ``permute``, ``expand``...: strides inherited from a kernel's layout) and no
    in-place op writes to the storage they share; return whether it changed anything.

    The clone costs nothing in ONNX (an Identity, which the exporter's optimizer removes).
    """
    aliases = _alias_sets(graph)
    written = {aliases[arg] for node in graph.nodes for arg in _written(node)}
    modified = False
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target in _RESHAPES):
            continue
        source = node.args[0]
        if not (_is_view_op(source) and aliases[node] not in written):
            continue
        with graph.inserting_before(node):
            clone = graph.call_function(
                torch.ops.aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
            )
        clone.meta = {k: v for k, v in source.meta.items() if k != "val"}
        if isinstance(source.meta.get("val"), torch.Tensor):
            clone.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
        node.replace_input_with(source, clone)
        modified = True
    return modified


def _is_view_op(node: object) -> bool:
    """Whether ``node`` is an ATen call that returns a view of an argument."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and any(
            r.alias_info is not None and not r.alias_info.is_write
            for r in node.target._schema.returns
        )
    )


def _alias_sets(graph: fx.Graph) -> nx.utils.UnionFind:
    """Union-find over the nodes that may share storage: an op's result joins the arguments its
    schema says it aliases (views, in-place ops); ``getitem`` joins its container; a call that is
    no ATen op (a higher-order op) joins all its inputs, to be safe."""
    sets = nx.utils.UnionFind()
    for node in graph.nodes:
        if node.op == "call_function":
            sets.union(node, *_aliased(node))
    return sets


def _schema_args(node: fx.Node):
    """(schema argument, value) pairs of an ATen call, positional and keyword."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        yield arg, value


def _aliased(node: fx.Node) -> list[fx.Node]:
    """The argument nodes ``node``'s result may share storage with."""
    if node.target is operator.getitem:
        return [a for a in node.args[:1] if isinstance(a, fx.Node)]
    if not isinstance(node.target, torch._ops.OpOverload):
        return list(node.all_input_nodes)
    if all(r.alias_info is None for r in node.target._schema.returns):
        return []
    return [
        v for arg, v in _schema_args(node) if arg.alias_info is not None and isinstance(v, fx.Node)
    ]


def _written(node: fx.Node) -> list[fx.Node]:
    """The argument nodes an ATen call writes to (in-place and ``out=`` ops)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [
        v
        for arg, v in _schema_args(node)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(v, fx.Node)
    ]

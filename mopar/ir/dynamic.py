"""Slices that take their dynamic dimensions at any size: re-symbolised from the program.

The planner and the rewrite work on the static graph, where every size is the example's
(`mopar.frontend.dynamic`). A slice made from it has those sizes written into its ops
(``view(x, [1, 128, 4, 64])``). To export it for any size, `symbolic_slice` copies it, taking
each op's arguments from the same-named node of the *program* (the graph with the dynamic
dimensions still symbolic): where the program passes a size computed from a symbol, the copy
computes it again from the slice's own inputs (``sym_size(x, 1)``), since a size is no tensor
and does not cross a cut.

Read in this order: `symbolic_slice`, then `export_shapes` (torch.export's ``dynamic_shapes``
for its inputs), `extents` (a tensor's smallest and largest shape), `values_of` (tensors of
the program at other input sizes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy
import torch
from torch import fx
from torch.utils import _pytree as pytree

from mopar.errors import CaptureError, Option

__all__ = ["Dynamic", "PROGRAM_NAME", "export_shapes", "extents", "symbolic_slice", "values_of"]

PROGRAM_NAME = "mopar_program_name"
"""The ``meta`` key of a static-graph node that the program knows by another name: a node a
rewrite made in place of the program's (the experts' dense translation holds the MoE block's
output, a dispatch's tail receives it as ``moe_out``). Without it, a node's name is the
program's."""


def program_name(node: fx.Node) -> str:
    """The program's name of ``node``'s value (`PROGRAM_NAME`)."""
    return node.meta.get(PROGRAM_NAME, node.name)


_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True, kw_only=True)
class Dynamic:
    """What exporting the slices of a model with dynamic dimensions needs.

    Attributes:
        program: the graph with the dynamic dimensions symbolic
            (`mopar.frontend.CapturedModel.program`).
        ranges: each dynamic symbol's (min, max), by name.
        values: the tensors the slices receive, by FX name, at the middle of every range
            (`values_of`): what they are traced on, since a size of 1 would be fixed.
    """

    program: fx.GraphModule
    ranges: Mapping[str, tuple[int, int]]
    values: Mapping[str, torch.Tensor]

    def slice(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple, Any]:
        """(slice ``gm`` re-symbolised, its inputs at the middle sizes, its dynamic_shapes)."""
        sym = symbolic_slice(gm, self.program, self.ranges)
        args = tuple(
            self.values[program_name(n)].contiguous()
            for n in sym.graph.nodes
            if n.op == "placeholder"
        )
        return sym, args, export_shapes(sym, self.program, self.ranges)


def _expr(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return val.node.expr if isinstance(val, _SYM) else None


def _is_size(a: Any) -> bool:
    return isinstance(a, fx.Node) and _expr(a) is not None


def _dynamic(expr: Any, ranges: Mapping[str, tuple[int, int]]) -> bool:
    return bool({str(s) for s in getattr(expr, "free_symbols", ())} & set(ranges))


def symbolic_slice(
    gm: fx.GraphModule, program: fx.GraphModule, ranges: Mapping[str, tuple[int, int]]
) -> fx.GraphModule:
    """``gm`` (a slice of the static graph) with the sizes of ``program``'s dynamic symbols
    (``ranges``) computed from its inputs instead of written in.

    Raises:
        CaptureError: the slice needs a dynamic size that none of its inputs carries.
    """
    ours = {n.name: n for n in program.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    local: dict[str, fx.Node] = {}  # program node name -> this slice's copy
    sizes: dict[Any, fx.Node] = {}  # expression -> this slice's node computing it
    carriers: list[tuple[Any, fx.Node, int]] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        local[node.name] = env[node]
        known = program_name(node)
        val = ours[known].meta.get("val") if known in ours else None
        for axis, size in enumerate(getattr(val, "shape", ())):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and _dynamic(expr, ranges) and expr not in sizes:
                carriers.append((expr, env[node], axis))
    for expr, ph, axis in carriers:
        if expr not in sizes:
            sizes[expr] = graph.call_function(torch.ops.aten.sym_size.int, (ph, axis))

    def size_of(src: fx.Node) -> fx.Node:
        """A node of ``graph`` computing the program's size node ``src``."""
        expr = _expr(src)
        if expr in sizes:
            return sizes[expr]
        if src.name in local:
            return local[src.name]
        if src.target is torch.ops.aten.sym_size.int and src.args[0].name in local:
            made = graph.call_function(src.target, (local[src.args[0].name], *src.args[1:]))
        elif src.op == "call_function" and all(
            _is_size(a) or not isinstance(a, fx.Node) for a in pytree.tree_leaves(src.args)
        ):
            args = pytree.tree_map(lambda a: size_of(a) if _is_size(a) else a, src.args)
            made = graph.call_function(src.target, args, dict(src.kwargs))
        else:
            raise CaptureError(
                f"slice {gm.__class__.__name__.removeprefix('Slice_')} needs the dynamic size "
                f"{expr}, which none of its inputs carries; narrow or drop that dimension in ",
                Option("dynamic"),
                ", or move the cut (",
                Option("slices"),
                ")",
            )
        sizes[expr] = made
        return made

    def arguments(node: fx.Node) -> tuple[Any, Any]:
        src = ours.get(node.name)
        mapped = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args)
        kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.kwargs)
        if src is None or src.target != node.target:
            return mapped, kwargs
        out = []
        for static, symbolic in ((mapped, src.args), (kwargs, src.kwargs)):
            leaves, spec = pytree.tree_flatten(static)
            theirs, their_spec = pytree.tree_flatten(symbolic)
            if spec != their_spec:
                out.append(static)
                continue
            out.append(
                pytree.tree_unflatten(
                    [
                        size_of(b) if _is_size(b) and _dynamic(_expr(b), ranges) else a
                        for a, b in zip(leaves, theirs, strict=True)
                    ],
                    spec,
                )
            )
        return out[0], out[1]

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            graph.output(
                pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, node.args[0])
            )
            continue
        if node.op == "get_attr":
            env[node] = graph.get_attr(node.target)
        else:
            args, kwargs = arguments(node)
            env[node] = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        env[node].meta = dict(node.meta)
        local[node.name] = env[node]
    out = fx.GraphModule(gm, graph, class_name=gm.__class__.__name__)
    out.graph.eliminate_dead_code()  # owned: a call_module node's purity is its module's
    out.graph.lint()
    out.recompile()
    return out


def _program_val(program: fx.GraphModule, name: str) -> Any:
    for n in program.graph.nodes:
        if n.name == name:
            return n.meta.get("val")
    return None


def export_shapes(
    gm: fx.GraphModule, program: fx.GraphModule, ranges: Mapping[str, tuple[int, int]]
) -> tuple[dict[int, Any] | None, ...] | None:
    """torch.export's ``dynamic_shapes`` for slice ``gm``'s inputs: each dimension of a dynamic
    symbol free within its range (None: the slice has none)."""
    shapes, any_dynamic = [], False
    for ph in (n for n in gm.graph.nodes if n.op == "placeholder"):
        val = _program_val(program, program_name(ph))
        axes = {}
        for axis, size in enumerate(getattr(val, "shape", ())):
            expr = getattr(getattr(size, "node", None), "expr", None)
            if expr is not None and _dynamic(expr, ranges):
                lo, hi = _bounds(expr, ranges)
                axes[axis] = torch.export.Dim.DYNAMIC(min=lo, max=hi)
        any_dynamic |= bool(axes)
        shapes.append(axes or None)
    return tuple(shapes) if any_dynamic else None


def _bounds(expr: Any, ranges: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
    """``expr`` at every symbol's smallest and at every symbol's largest size (sizes grow with
    the dimensions they are made of)."""
    symbols = {str(s): s for s in expr.free_symbols}
    at = [int(expr.subs({s: ranges.get(k, (1, 1))[i] for k, s in symbols.items()})) for i in (0, 1)]
    return min(at), max(at)


def extents(
    program: fx.GraphModule, names: Iterable[str], ranges: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The smallest and the largest shape of each tensor of ``program`` named in ``names``
    that has a dynamic dimension."""
    wanted = set(names)
    out = {}
    for n in program.graph.nodes:
        val = n.meta.get("val")
        if n.name not in wanted or not isinstance(val, torch.Tensor):
            continue
        exprs = [
            d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d) for d in val.shape
        ]
        if not any(_dynamic(e, ranges) for e in exprs):
            continue
        bounds = [_bounds(e, ranges) if _dynamic(e, ranges) else (int(e), int(e)) for e in exprs]
        out[n.name] = (tuple(b[0] for b in bounds), tuple(b[1] for b in bounds))
    return out


def values_of(
    program: fx.GraphModule, inputs: Iterable[np.ndarray], names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The tensors of ``program`` named in ``names`` (and its outputs, as ``output:<i>``) on
    ``inputs``: a run of the whole program that keeps only those."""
    wanted = set(names)
    kept: dict[str, torch.Tensor] = {}

    class Keeper(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if n.name in wanted:
                kept[n.name] = result
            return result

    with torch.no_grad():
        out = Keeper(program).run(*[torch.from_numpy(np.ascontiguousarray(a)) for a in inputs])
    for i, leaf in enumerate(pytree.tree_leaves(out)):
        kept[f"output:{i}"] = leaf
    return kept

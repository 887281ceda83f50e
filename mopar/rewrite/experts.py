"""Apply a plan's expert functions: one executable unit per expert function, and the dispatch;
and the sparse translation of the experts a slice holds inline.

A plan places a mixture-of-experts layer as functions (`mopar.planner.experts`): its dispatch
function holds the layer (the vertical split gives it the layer's dense translation, which the
compiler runs in torch for the tensors after it, and never exports), and each expert function
holds a group of the layer's experts. An expert function's unit is `ExpertGroup`: it takes the
tokens routed to the group ``(n, H)`` and each token's weight for each of its experts
``(n, G)``, and returns their weighted sum ``(n, H)`` for any ``n`` up to the tokens of a
request. The dispatch unit carries a `Dispatch`: the `DispatchSpec` the runtime routes with, the
tail of its layer -- what the layer computes after the experts' weighted sum (a residual add
the layer grouping attached to it, a reshape) -- which is what the dispatch function exports and
runs once the answers are in, and the unit of its hot experts (the ones it runs itself), if it
keeps any.

A slice that holds an experts layer itself (inline: ``--experts inline``, the unsplit plan, or a
layer the planner kept inline) gets the layer's sparse translation (`mopar.ir.moe.SparseExperts`)
in place of the dense one where the plan says so (`Function.sparse_experts`, decided by
`mopar.planner.experts.inline_sparse`): each expert runs on the tokens routed to it only, as the
model does (`sparse_inline`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

from mopar.bundle.dispatch import DispatchSpec
from mopar.errors import InternalError
from mopar.ir import LayerGraph, TensorInfo, tensor_info
from mopar.ir.dynamic import PROGRAM_NAME, program_name
from mopar.ir.experts import dense_translation
from mopar.ir.moe import SparseExperts, router_of
from mopar.ir.subgraph import SliceModule, output_nodes, placeholders
from mopar.plan import Plan
from mopar.runtime.dispatch import expert_tensors
from mopar.runtime.transports import handing_on

__all__ = ["ExpertGroup", "Dispatch", "expert_units", "sparse_inline", "sparse_unit"]


@dataclass(frozen=True, kw_only=True)
class Dispatch:
    """A dispatch unit's runtime part: how it routes, the tail it runs after the combine
    (inputs: ``spec.output``, the weighted sum, and the layer's other inputs), the unit of
    the experts it holds itself (None when it holds none), and the next MoE layer's router on
    its hidden states, which predicts the expert functions to pre-warm (None: no next layer,
    or a router that reads more than the hidden states)."""

    spec: DispatchSpec
    tail: SliceModule
    hot: SliceModule | None = None
    warm: SliceModule | None = None


class ExpertGroup(nn.Module):
    """forward(tokens (n, H), gates (n, G)) -> the gate-weighted sum of G experts on the tokens."""

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, tokens: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        out = self.experts[0](tokens) * gates[:, 0:1]
        for g in range(1, len(self.experts)):
            out = out + self.experts[g](tokens) * gates[:, g : g + 1]
        return out


def expert_units(
    units: tuple[SliceModule, ...],
    plan: Plan,
    lg: LayerGraph,
    blocks: Sequence,
    experts: Mapping[str, Sequence[nn.Module]] | None,
) -> tuple[SliceModule, ...]:
    """``units`` (the plan's other functions, in its order) with its expert functions' units
    added and each dispatch unit given its `DispatchSpec`, in the plan's order; the experts
    layers a slice holds inline in their sparse translation (`sparse_inline`)."""
    units = sparse_inline(units, plan, blocks, experts)
    dispatches = plan.dispatches()
    if not dispatches:
        return units
    by_name = {u.name: u for u in units}
    by_layer = {b.name: b for b in blocks}
    made: dict[str, SliceModule] = {}
    for d, after in zip(dispatches, (*dispatches[1:], None)):
        block = by_layer[d.layers[0]]
        unit = by_name[d.name]
        callees = plan.callees(d.name)
        spec = _dispatch_spec(lg, block, unit, d, callees, plan)
        targets = plan.prewarms(d.name)
        warm = _warm_unit(lg, d.name, unit, spec, by_layer[after.layers[0]]) if targets else None
        if warm is not None:
            spec = replace(spec, warm=tuple((f.name, tuple(f.experts)) for f in targets))
        tail = _tail(unit, block.output, spec.output)
        modules = experts[block.name]

        def feed(values: dict, spec=spec, modules=modules, block=block) -> dict:
            t, h, k = block.tokens, block.hidden_size, block.top_k
            with torch.no_grad():
                out = dense_translation(
                    modules,
                    values[spec.hidden].reshape(t, h),
                    values[spec.index].reshape(t, k),
                    values[spec.weights].reshape(t, k),
                )
            return {spec.output: out.reshape(spec.output_shape)}

        hot = _expert_unit(spec.local, spec.hot, modules, block, spec) if spec.hot else None
        made[d.name] = replace(
            unit, dispatch=Dispatch(spec=spec, tail=tail, hot=hot, warm=warm), feed=feed
        )
        for f in callees:
            made[f.name] = _expert_unit(f.name, f.experts, experts[block.name], block, spec)
    out = [made.get(f.name) or by_name.get(f.name) for f in plan.functions]
    if any(u is None for u in out):
        raise InternalError(f"units {sorted(by_name)} do not follow the plan's functions")
    return tuple(out)


def sparse_inline(
    units: tuple[SliceModule, ...],
    plan: Plan,
    blocks: Sequence,
    experts: Mapping[str, Sequence[nn.Module]] | None,
) -> tuple[SliceModule, ...]:
    """``units`` with the experts layers the plan runs sparse (`Function.sparse_experts`: the
    planner's `inline_sparse`) in their sparse translation; a dispatch's layer and a sharded
    slice's units are left as they are."""
    if not experts:
        return units
    dispatches = {d.name for d in plan.dispatches()}  # they export their layer's tail only
    out = []
    for u in units:
        f = next((f for f in plan.functions if f.name == u.name), None)
        if f is not None and f.name not in dispatches and not u.rows and f.parallel == 1:
            for b in blocks:
                if b.name in f.sparse_experts:
                    u = sparse_unit(u, b, experts[b.name])
        out.append(u)
    return tuple(out)


def sparse_unit(unit: SliceModule, block, modules: Sequence[nn.Module]) -> SliceModule:
    """``unit`` with ``block``'s dense translation replaced by a call of its `SparseExperts` on
    the same hidden states, indices and weights (a new module; ``unit.gm`` gains the experts
    as a submodule). The dense translation's nodes and weights leave the graph."""
    graph = fx.Graph()
    result = graph.graph_copy(unit.gm.graph, {})
    graph.output(result)
    nodes = {n.name: n for n in graph.nodes}
    names = (block.output, block.hidden, block.index, block.weights)
    if not all(n in nodes for n in names):
        raise InternalError(f"unit {unit.name} holds no whole experts layer {block.name}")
    old = nodes[block.output]
    h, k = block.hidden_size, block.top_k
    target = "moe_sparse_" + re.sub(r"\W", "_", block.name)
    reshape = torch.ops.aten.reshape.default
    lead = [int(d) for d in old.meta["val"].shape[:-2]]  # as `mopar.ir.experts.inline_dense`
    with graph.inserting_before(old):
        xs = graph.call_function(reshape, (nodes[block.hidden], [-1, h]))
        ix = graph.call_function(reshape, (nodes[block.index], [-1, k]))
        ws = graph.call_function(reshape, (nodes[block.weights], [-1, k]))
        y = graph.call_module(target, (xs, ix, ws))
        new = graph.call_function(reshape, (y, [*lead, -1, h]))
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    unit.gm.add_submodule(target, SparseExperts(modules))
    staged = fx.GraphModule(unit.gm, graph)  # the purity check needs an owning module
    staged.graph.eliminate_dead_code()
    staged.graph.lint()
    # built again, so that it keeps only what the graph still reads
    return replace(unit, gm=fx.GraphModule(staged, staged.graph, class_name=type(unit.gm).__name__))


def _dispatch_spec(
    lg: LayerGraph, block, unit: SliceModule, dispatch, callees, plan: Plan
) -> DispatchSpec:
    """Which of the dispatch unit's inputs are the hidden states, indices and weights; the
    experts it holds (its hot ones) and calls; and how it sends tokens (``store`` when its
    expert functions' edges go through Redis)."""
    nodes = {n.name: n for n in lg.gm.graph.nodes}
    layer = lg.graph.nodes[block.name]["layer"]
    inside = set(layer.nodes)
    received = {t.name for t in unit.inputs}

    def value(name: str) -> str:
        node = nodes[name]
        while node.name in inside:  # views of it inside the layer: back to what it receives
            ins = [a for a in node.all_input_nodes if a.op != "get_attr"]
            if len(ins) != 1:
                break
            node = ins[0]
        got = lg.value_names.get(node.name, f"t:{node.name}")
        if got not in received:
            raise InternalError(f"dispatch {unit.name} does not receive {got} ({name})")
        return got

    out = nodes[block.output]
    return DispatchSpec(
        hidden=value(block.hidden),
        index=value(block.index),
        weights=value(block.weights),
        output=f"{unit.name}:experts",
        output_shape=tuple(int(d) for d in out.meta["val"].shape),
        tokens=block.tokens,
        hidden_size=block.hidden_size,
        top_k=block.top_k,
        num_experts=block.num_experts,
        groups=tuple(tuple(f.experts) for f in callees),
        callees=tuple(f.name for f in callees),
        hot=tuple(dispatch.experts),
        local=f"{dispatch.name}.hot" if dispatch.experts else "",
        mode="store"
        if callees
        and all(handing_on(e.transport).stores for f in callees for e in plan.edges_out(f.name))
        else "direct",
    )


def _expert_unit(
    name: str, ids: Sequence[int], modules: Sequence[nn.Module], block, spec: DispatchSpec
) -> SliceModule:
    tokens, gates, out = expert_tensors(name)
    t, h, g = block.tokens, block.hidden_size, len(ids)

    def info(value: str, width: int) -> TensorInfo:
        return TensorInfo(name=value, shape=(t, width), dtype="float32", nbytes=t * width * 4)

    def feed(values: dict) -> dict:
        x = values[spec.hidden].reshape(t, h).float()
        idx = values[spec.index].reshape(t, block.top_k)
        w = values[spec.weights].reshape(t, block.top_k).float()
        gate = torch.stack([(w * (idx == e)).sum(-1) for e in ids], dim=-1)
        return {tokens: x.contiguous(), gates: gate.contiguous()}

    module = fx.symbolic_trace(ExpertGroup([modules[e] for e in ids]))
    return SliceModule(
        name=name,
        gm=module,
        inputs=(info(tokens, h), info(gates, g)),
        outputs=(info(out, h),),
        rows=True,
        feed=feed,
    )


def _warm_unit(
    lg: LayerGraph, name: str, unit: SliceModule, spec: DispatchSpec, nxt
) -> SliceModule | None:
    """The next MoE layer's router (block ``nxt``) on this dispatch's hidden states: what the
    dispatch runs to predict the experts the next layer will use. None when the router cannot
    run on these hidden states."""
    router = router_of(lg.gm, nxt)
    hidden = next(t for t in unit.inputs if t.name == spec.hidden)
    nodes = {n.name: n for n in lg.gm.graph.nodes}
    if router is None or tuple(nodes[nxt.hidden].meta["val"].shape) != tuple(hidden.shape):
        return None
    out = tensor_info(nodes[nxt.index], f"{name}.warm:experts")  # top-k's int64 indices
    ours = next(p for p, t in zip(placeholders(unit.gm.graph), unit.inputs) if t is hidden)
    for p in placeholders(router.graph):  # the next layer's hidden states: this one's here
        p.meta[PROGRAM_NAME] = program_name(ours)
    return SliceModule(name=f"{name}.warm", gm=router, inputs=(hidden,), outputs=(out,))


def _tail(unit: SliceModule, output: str, value: str) -> SliceModule:
    """What ``unit`` computes from its node ``output`` (the experts' weighted sum, received as
    ``value``: a name of the dispatch's own, apart from the layer's) and its other inputs."""
    g = unit.gm.graph
    out = next((n for n in g.nodes if n.name == output), None)
    if out is None:
        raise InternalError(f"dispatch {unit.name} has no node {output}")
    results = output_nodes(g)
    needed: set[fx.Node] = set()
    stack = list(results)
    while stack:
        n = stack.pop()
        if n not in needed and n is not out:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    info = dict(zip(placeholders(g), unit.inputs))
    graph = fx.Graph()
    env = {out: graph.placeholder("moe_out")}
    env[out].meta = {"val": out.meta["val"], PROGRAM_NAME: program_name(out)}
    inputs = [tensor_info(out, value)]
    for n in g.nodes:
        if n not in needed or n.op == "output":
            continue
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
            inputs.append(info[n])
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    if out in results:  # the layer's output is the sum itself: an op, so the names differ
        env[out] = graph.call_function(torch.ops.aten.clone.default, (env[out],))
    graph.output(tuple(env[r] for r in results))
    return SliceModule(
        name=unit.name,
        gm=fx.GraphModule(unit.gm, graph),
        inputs=tuple(inputs),
        outputs=unit.outputs,
    )

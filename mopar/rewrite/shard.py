"""Horizontal partitioning: cut one slice into η parameter-sharded sub-slices.

Decide, then apply. `analyze_sharding` propagates a sharding state (`shard_rules.State`: R, S(d)
or P) through the slice's FX graph in topological order with the rules of `shard_rules`. The
first node no rule covers ends the *sharded region*; it and everything that depends on it form
the *tail*. The result is a frozen `ShardDecision` (or `Unshardable`, with a one-line reason).
`apply_sharding` then builds:

* η sub-slice GraphModules (`SliceModule`), each computing its part of the region, holding its
  own narrowed copies of the sharded parameters (really smaller tensors) and the replicated ones;
* one `Join` per sub-slice output: ``sum`` (partial sums), ``concat`` along a dimension (split
  tensors) or ``replicated`` (every shard computed the same tensor; take shard 0's);
* an optional tail `SliceModule`, run once on the joined tensors (and the slice's inputs), which
  computes the rest of the slice. A tail is an ordinary slice module, so `shard_slice` can shard
  it again (`shard_stages`): a transformer block is attention (sharded, summed), then
  LayerNorm + MLP (sharded again, summed), then the last LayerNorm.

`run_sharded` executes a `ShardedSlice`, or a chain of stages, in torch: the reference for the
runtime's fork-join.

Read in this order: `Join`, `ShardDecision`, `Unshardable`, `ShardedSlice`, `shard_slice`,
`shard_stages`, `analyze_sharding` (with `_propagate` and `_partition`), `apply_sharding`
(`_build_shard`, `_build_tail`), `run_sharded`.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import fx, nn

from mopar.errors import InternalError
from mopar.ir import TensorInfo, tensor_info
from mopar.rewrite.shard_rules import (
    Edit, Narrow, NodeState, RuleContext, State, Stop, decide_node,
)
from mopar.rewrite.split import SliceModule

__all__ = ["Join", "NodeRule", "ShardDecision", "Unshardable", "ShardedSlice", "shard_slice",
           "shard_stages", "analyze_sharding", "apply_sharding", "join_parts", "run_sharded"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

# Side-effect-only checks with no value; sub-slices and tails leave them out.
_ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}


# --- decisions ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Join:
    """How the sub-slices' parts of one tensor become the tensor.

    Attributes:
        name: the tensor's public name (a sub-slice output, and a tail input or slice output).
        kind: ``"sum"`` (add the parts), ``"concat"`` (concatenate them along ``dim``) or
            ``"replicated"`` (the parts are equal; take the first).
        dim: the concatenation dimension (``concat`` only; -1 otherwise).
        shape: the joined tensor's shape.
    """

    name: str
    kind: str
    dim: int = -1
    shape: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class NodeRule:
    """The rule applied to one node of the sharded region, its output state and the edit."""

    node: str
    rule: str
    state: NodeState
    edit: Edit


@dataclass(frozen=True, kw_only=True)
class ShardDecision:
    """How to shard one slice η ways.

    Attributes:
        slice_name: the slice's name.
        eta: the number of sub-slices.
        region: the nodes every sub-slice computes, in graph order, with their rules.
        tail: the nodes computed once after the join, in graph order.
        joins: the tensors handed from the sub-slices to the join, in output order.
        region_end: why the region ends where it does ("" when the tail is empty).
        sharded_params: the parameters narrowed to 1/η per sub-slice (their targets).
    """

    slice_name: str
    eta: int
    region: tuple[NodeRule, ...]
    tail: tuple[str, ...]
    joins: tuple[Join, ...]
    region_end: str
    sharded_params: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Unshardable:
    """A slice that cannot be sharded η ways; ``reason`` is one line for the plan's notes."""

    slice_name: str
    eta: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ShardedSlice:
    """A slice cut into η sub-slices, a join and an optional tail.

    Attributes:
        name: the slice's name.
        eta: the number of sub-slices.
        shards: the sub-slices; all take the same inputs and give one part per ``joins`` entry.
        joins: how to aggregate each sub-slice output, in sub-slice output order.
        tail: run once on the joined tensors and the slice's inputs (None: the joins give all
            the slice's outputs).
        inputs: the slice's inputs.
        outputs: the slice's outputs, each a joined tensor or a tail output.
        shard_param_bytes: bytes of parameters and buffers each sub-slice holds.
        tail_param_bytes: bytes of parameters and buffers the tail holds.
        decision: the decision this applies.
    """

    name: str
    eta: int
    shards: tuple[SliceModule, ...]
    joins: tuple[Join, ...]
    tail: SliceModule | None
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    shard_param_bytes: tuple[int, ...]
    tail_param_bytes: int
    decision: ShardDecision


def shard_slice(sm: SliceModule, eta: int) -> ShardedSlice | Unshardable:
    """Shard ``sm`` into ``eta`` sub-slices, or say why it cannot be."""
    decision = analyze_sharding(sm, eta)
    if isinstance(decision, Unshardable):
        log.info("slice %s stays whole at η = %d: %s", sm.name, eta, decision.reason)
        return decision
    return apply_sharding(sm, decision)


def shard_stages(sm: SliceModule, eta: int) -> tuple[ShardedSlice, ...] | Unshardable:
    """Shard ``sm``, then its tail, then that tail's tail, while a tail can be sharded.

    Each stage after the first stands in for the previous stage's tail; the last stage's tail
    (if any) runs unsharded. A transformer block comes out as two stages (attention; LayerNorm
    and MLP) and a LayerNorm tail: the two all-reduces per layer of Megatron-LM.
    """
    first = shard_slice(sm, eta)
    if isinstance(first, Unshardable):
        return first
    stages = [first]
    while stages[-1].tail is not None:
        following = shard_slice(stages[-1].tail, eta)
        if isinstance(following, Unshardable):
            break
        stages.append(following)
    return tuple(stages)


# --- decide ---------------------------------------------------------------------------------------


def analyze_sharding(sm: SliceModule, eta: int) -> ShardDecision | Unshardable:
    """Decide how to shard ``sm`` ``eta`` ways (no graph is changed)."""
    if not isinstance(eta, int) or eta < 2:
        raise InternalError(f"sharding slice {sm.name} needs η >= 2, got {eta!r}; keep η = 1 "
                            "slices whole without calling shard_slice")
    graph = sm.gm.graph
    forced: dict[str, str] = {}
    # A tensor that leaves the region must be joinable (a fused-q/k/v split is not); move its
    # producer to the tail and decide again. Each round moves at least one node, so this ends.
    while True:
        propagated = _propagate(sm, eta, forced)
        if isinstance(propagated, Unshardable):
            return propagated
        states, rules, tail, first_stop = propagated
        region, tail = _partition(graph, states, rules, tail)
        if not any(_is_sharded(states[n]) for n in region):
            return Unshardable(slice_name=sm.name, eta=eta, reason=_why_nothing(first_stop))
        crossing = _crossing(graph, region, tail)
        bad = {n.name: f"{n.name} cannot be joined in state {_fmt(states[n])}"
               for n in crossing if not _joinable(n, states[n])}
        if not bad:
            break
        forced.update(bad)
    joins = tuple(_join(sm, n, states[n], eta) for n in crossing)
    in_region = set(region)
    return ShardDecision(
        slice_name=sm.name,
        eta=eta,
        region=tuple(rules[n] for n in graph.nodes if n in in_region),
        tail=tuple(n.name for n in graph.nodes if n in tail),
        joins=joins,
        region_end=_why_end(first_stop, tail),
        sharded_params=tuple(dict.fromkeys(
            str(node.args[nw.arg].target) for node in region for nw in rules[node].edit.narrow
            if node.args[nw.arg].op == "get_attr")),
    )


def _propagate(sm: SliceModule, eta: int, forced: Mapping[str, str]):
    """States and rules of the nodes before the first stop; the tail; the first stop."""
    states: dict[fx.Node, NodeState] = {}
    rules: dict[fx.Node, NodeRule] = {}
    tail: set[fx.Node] = set()
    first_stop: Stop | None = None
    ctx = RuleContext(eta=eta, states=states, param=lambda t: _param(sm.gm, t))
    for node in sm.gm.graph.nodes:
        if node.op != "call_function" or node.target in _ASSERTS:
            continue
        if any(a in tail for a in node.all_input_nodes):
            tail.add(node)
            continue
        outcome = Stop(reason=forced[node.name]) if node.name in forced else decide_node(node, ctx)
        if isinstance(outcome, Stop):
            outcome = replace(outcome, reason=outcome.reason + _module_of(node))
            if outcome.refuse:
                return Unshardable(slice_name=sm.name, eta=eta, reason=outcome.reason)
            first_stop = first_stop or outcome
            tail.add(node)
            continue
        states[node] = outcome.state
        rules[node] = NodeRule(node=node.name, rule=outcome.rule, state=outcome.state,
                               edit=outcome.edit)
    return states, rules, tail, first_stop


def _partition(graph: fx.Graph, states, rules, tail: set[fx.Node]):
    """The region (sharded nodes and what they read) and the tail (everything else)."""
    region = {n for n in rules if _is_sharded(states[n])}
    stack = list(region)
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg.op == "call_function" and arg not in region:
                region.add(arg)
                stack.append(arg)
    # A tuple (BatchNorm's) never crosses to the tail: its getitems stay with it.
    region |= {u for n in list(region) if isinstance(states[n], tuple) for u in n.users
               if u.target is operator.getitem and u in rules}
    rest = {n for n in graph.nodes if n.op == "call_function" and n.target not in _ASSERTS}
    return [n for n in graph.nodes if n in region], tail | (rest - region)


def _crossing(graph: fx.Graph, region: list[fx.Node], tail: set[fx.Node]) -> list[fx.Node]:
    """Region nodes the tail reads or the slice outputs, in graph order."""
    outputs = set(_output_nodes(graph))
    return [n for n in region if n in outputs or any(u in tail for u in n.users)]


def _is_sharded(state: NodeState) -> bool:
    states = state if isinstance(state, tuple) else (state,)
    return any(s.kind != "replicated" for s in states)


def _joinable(node: fx.Node, state: NodeState) -> bool:
    return (isinstance(state, State) and isinstance(node.meta.get("val"), torch.Tensor)
            and (state.kind != "split" or state.blocks == 1))


def _join(sm: SliceModule, node: fx.Node, state: State, eta: int) -> Join:
    shape = tensor_info(node, "").shape
    name = _public_name(sm, node)
    if state.kind == "partial":
        return Join(name=name, kind="sum", shape=shape)
    if state.kind == "split":
        return Join(name=name, kind="concat", dim=state.dim, shape=shape)
    return Join(name=name, kind="replicated", shape=shape)


def _module_of(node: fx.Node) -> str:
    """`` (in module PATH)`` for the module that made ``node``, so a reason points at the model."""
    stack = node.meta.get("nn_module_stack") or {}
    path = str(list(stack.values())[-1][0]) if stack else ""
    return f" (in module {path})" if path else ""


def _why_nothing(stop: Stop | None) -> str:
    if stop is None:
        return "no Linear, Conv, Embedding or MatMul with a weight to shard"
    return f"nothing can be sharded before the region ends: {stop.reason}"


def _why_end(stop: Stop | None, tail: set[fx.Node]) -> str:
    if not tail:
        return ""
    return stop.reason if stop else "the rest of the slice reads no sharded tensor"


def _fmt(state: NodeState) -> str:
    return "(" + ", ".join(map(str, state)) + ")" if isinstance(state, tuple) else str(state)


# --- apply ----------------------------------------------------------------------------------------


def apply_sharding(sm: SliceModule, decision: ShardDecision) -> ShardedSlice:
    """Build the sub-slices and the tail that ``decision`` describes."""
    shards = tuple(_build_shard(sm, decision, k) for k in range(decision.eta))
    tail = _build_tail(sm, decision) if decision.tail else None
    return ShardedSlice(
        name=sm.name,
        eta=decision.eta,
        shards=shards,
        joins=decision.joins,
        tail=tail,
        inputs=sm.inputs,
        outputs=sm.outputs,
        shard_param_bytes=tuple(_held_bytes(s.gm) for s in shards),
        tail_param_bytes=_held_bytes(tail.gm) if tail else 0,
        decision=decision,
    )


class _Params:
    """The parameters of one sub-slice: replicated ones shared, narrowed ones copied smaller."""

    def __init__(self, source: fx.GraphModule, graph: fx.Graph, k: int, eta: int) -> None:
        self.source, self.graph, self.k, self.eta = source, graph, k, eta
        self.root = nn.Module()
        self.nodes: dict[tuple, fx.Node] = {}

    def get(self, target: str, narrow: Narrow | None = None, *, zeros: bool = False) -> fx.Node:
        key = (target, narrow.dim, narrow.blocks) if narrow else (target, "zeros") if zeros \
            else (target,)
        if key not in self.nodes:
            original = _param(self.source, target)
            tensor = (_chunk(original, narrow, self.k, self.eta) if narrow is not None
                      else torch.zeros_like(original.detach()) if zeros else original)
            name = "_".join([target.replace(".", "_"), *(f"{n}" for n in key[1:])])
            while hasattr(self.root, name):  # "a.b" and "a_b" would meet
                name += "_"
            if isinstance(original, nn.Parameter):
                self.root.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
            else:
                self.root.register_buffer(name, tensor)
            self.nodes[key] = self.graph.get_attr(name)
        return self.nodes[key]


def _chunk(tensor: torch.Tensor, narrow: Narrow, k: int, eta: int) -> torch.Tensor:
    """Shard k's chunk along ``narrow.dim``: the k-th of η pieces of every one of its blocks."""
    dim, blocks = narrow.dim, narrow.blocks
    size = tensor.shape[dim]
    if size % (blocks * eta):
        raise InternalError(f"cannot cut dimension {dim} of size {size} into {blocks}x{eta} pieces")
    shape = (*tensor.shape[:dim], blocks, size // blocks, *tensor.shape[dim + 1:])
    piece = size // (blocks * eta)
    chunk = tensor.detach().reshape(shape).narrow(dim + 1, k * piece, piece)
    return chunk.reshape(*tensor.shape[:dim], blocks * piece, *tensor.shape[dim + 1:]).clone()


def _build_shard(sm: SliceModule, decision: ShardDecision, k: int) -> SliceModule:
    graph = fx.Graph()
    nodes = {n.name: n for n in sm.gm.graph.nodes}
    region = [nodes[r.node] for r in decision.region]
    params = _Params(sm.gm, graph, k, decision.eta)
    env: dict[fx.Node, fx.Node] = {}
    read = {a for n in region for a in n.all_input_nodes if a.op == "placeholder"}
    info = dict(zip(_placeholders(sm.gm.graph), sm.inputs))
    for node in _placeholders(sm.gm.graph):
        if node in read:
            env[node] = graph.placeholder(node.name)

    def lookup(arg: fx.Node) -> fx.Node:
        return params.get(str(arg.target)) if arg.op == "get_attr" else env[arg]

    for rule in decision.region:
        node = nodes[rule.node]
        env[node] = _emit(graph, node, rule.edit, k, decision.eta, lookup, params)
    by_name = {_public_name(sm, n): n for n in region}
    graph.output(tuple(env[by_name[j.name]] for j in decision.joins))
    # Shards other than 0 skip a replicated term added once; drop what only it needed, inputs
    # included (so a sub-slice may take fewer of the slice's inputs than shard 0).
    graph.eliminate_dead_code()
    inputs = []
    for original, placeholder in list(env.items()):
        if placeholder.op == "placeholder":
            if placeholder.users:
                inputs.append(info[original])
            else:
                graph.erase_node(placeholder)
    graph.lint()
    gm = fx.GraphModule(params.root, graph, class_name=f"Shard_{sm.name}_{k}")
    outputs = tuple(_part_info(j, by_name[j.name], decision.eta) for j in decision.joins)
    return SliceModule(name=f"{sm.name}-shard{k}", gm=gm, inputs=tuple(inputs), outputs=outputs)


def _emit(graph: fx.Graph, node: fx.Node, edit: Edit, k: int, eta: int, lookup, params: _Params
          ) -> fx.Node:
    """Shard k's copy of ``node`` under ``edit``."""
    if k != 0 and edit.identity_off_first is not None:
        return fx.map_arg(node.args[edit.identity_off_first], lookup)
    narrowed = {nw.arg: nw for nw in edit.narrow}
    dropped = set(edit.once) if k != 0 else set()  # a bias added by shard 0 only
    zeroed = set(edit.zero_off_first) if k != 0 else set()
    args = [None if i in dropped
            else params.get(str(a.target), zeros=True) if i in zeroed
            else _narrowed(graph, a, narrowed[i], k, eta, lookup, params) if i in narrowed
            else fx.map_arg(a, lookup) for i, a in enumerate(node.args)]
    kwargs = dict(fx.map_arg(node.kwargs, lookup))
    target = node.target
    if k != 0 and edit.target_off_first is not None:
        target, args, kwargs = edit.target_off_first, [args[i] for i in edit.args_off_first], {}
    elif edit.target is not None:
        target, args, kwargs = edit.target, [args[i] for i in edit.keep_args], {}
    for i, value in edit.set_args:
        args.extend([None] * (i + 1 - len(args)))
        args[i] = value
    return graph.create_node("call_function", target, tuple(args), kwargs, name=node.name)


def _narrowed(graph: fx.Graph, arg: fx.Node, narrow: Narrow, k: int, eta: int, lookup,
              params: _Params) -> fx.Node:
    if arg.op == "get_attr":
        return params.get(str(arg.target), narrow)
    if narrow.blocks != 1:
        raise InternalError(f"a computed operand {arg.name} cannot be narrowed in blocks")
    size = tensor_info(arg, "").shape[narrow.dim]
    piece = size // eta
    return graph.call_function(aten.slice.Tensor,
                               (lookup(arg), narrow.dim, k * piece, (k + 1) * piece))


def _build_tail(sm: SliceModule, decision: ShardDecision) -> SliceModule:
    graph = fx.Graph()
    nodes = {n.name: n for n in sm.gm.graph.nodes}
    body = [nodes[name] for name in decision.tail]
    in_tail = set(body)
    joined = {j.name: j for j in decision.joins}
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[TensorInfo] = []
    read = {a for n in body for a in n.all_input_nodes if a not in in_tail and a.op != "get_attr"}
    info = dict(zip(_placeholders(sm.gm.graph), sm.inputs))
    # Joined tensors first (in join order), then the slice inputs the tail reads (in input order).
    crossing = sorted((n for n in read if n.op != "placeholder"),
                      key=lambda n: list(joined).index(_public_name(sm, n)))
    for node in crossing + [p for p in _placeholders(sm.gm.graph) if p in read]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        inputs.append(info.get(node) or tensor_info(node, _public_name(sm, node)))

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env and arg.op == "get_attr":
            env[arg] = graph.get_attr(arg.target)
        return env[arg]

    for node in body:
        env[node] = graph.node_copy(node, lookup)
    made = [n for n in _output_nodes(sm.gm.graph) if n in in_tail]
    graph.output(tuple(env[n] for n in made))
    graph.lint()
    gm = fx.GraphModule(sm.gm, graph, class_name=f"Tail_{sm.name}")
    outputs = tuple(t for n, t in zip(_output_nodes(sm.gm.graph), sm.outputs) if n in in_tail)
    return SliceModule(name=f"{sm.name}-tail", gm=gm, inputs=tuple(inputs), outputs=outputs)


# --- run ------------------------------------------------------------------------------------------


def join_parts(join: Join, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Aggregate the sub-slices' parts of one tensor."""
    if join.kind == "sum":
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total
    if join.kind == "concat":
        return torch.cat(list(parts), dim=join.dim)
    if join.kind == "replicated":
        return parts[0]
    raise InternalError(f"unknown join kind {join.kind!r} for {join.name}")


def run_sharded(
    sharded: ShardedSlice | Sequence[ShardedSlice], inputs: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Run a sharded slice on ``inputs`` (by public name); return its outputs by public name.

    ``sharded`` is one `ShardedSlice` (sub-slices, join, tail), or the stages of `shard_stages`,
    where each stage stands in for the previous stage's tail.
    """
    stages = (sharded,) if isinstance(sharded, ShardedSlice) else tuple(sharded)
    values = dict(inputs)
    with torch.no_grad():
        for stage in stages:
            parts = [s.gm(*[values[t.name] for t in s.inputs]) for s in stage.shards]
            for i, join in enumerate(stage.joins):
                values[join.name] = join_parts(join, [p[i] for p in parts])
        tail = stages[-1].tail
        if tail is not None:
            values.update(zip((t.name for t in tail.outputs),
                              tail.gm(*[values[t.name] for t in tail.inputs])))
    return {t.name: values[t.name] for t in stages[0].outputs}


# --- helpers --------------------------------------------------------------------------------------


def _param(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _held_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the distinct parameters and buffers ``gm``'s graph reads."""
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    tensors = [_param(gm, t) for t in targets]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _output_nodes(graph: fx.Graph) -> list[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output")
    return list(torch.utils._pytree.tree_leaves(out.args[0]))


def _public_name(sm: SliceModule, node: fx.Node) -> str:
    """A slice output keeps its public name; another tensor is ``t:`` + its FX name, as in split."""
    for out, info in zip(_output_nodes(sm.gm.graph), sm.outputs):
        if out is node:
            return info.name
    for ph, info in zip(_placeholders(sm.gm.graph), sm.inputs):
        if ph is node:
            return info.name
    return f"t:{node.name}"


def _part_info(join: Join, node: fx.Node, eta: int) -> TensorInfo:
    """A sub-slice's part of a joined tensor: the whole shape, or 1/η of it for a concat."""
    shape = list(join.shape)
    if join.kind == "concat":
        shape[join.dim] //= eta
    val = node.meta["val"]
    return TensorInfo(name=join.name, shape=tuple(shape), dtype=tensor_info(node, "").dtype,
                      nbytes=math.prod(shape) * val.element_size())


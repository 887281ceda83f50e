"""Shardability analysis: how one slice would be cut into η parameter-sharded sub-slices.

Decide only; nothing here builds a sub-slice or copies a parameter (the rewrite's ``shard``
module does, from the same decisions). `analyze_sharding` propagates a sharding state
(`shard_states.State`: R, S(d) or P) through the slice's FX graph in topological order with the
rules of `shard_rules`. The first node no rule covers ends the *sharded region*; it and
everything that depends on it form the *tail*. The result is a frozen `ShardDecision` (or
`Unshardable`, with a one-line reason): the region's nodes with their rules and edits, the tail,
and one `Join` per tensor the sub-slices hand over (``sum``, ``concat`` or ``replicated``).

A tail is an ordinary slice module (`extract_tail`), so it can be analysed again:
`analyze_stages` chains the decisions into fork-join stages (a transformer block is attention,
sharded and summed, then LayerNorm + MLP, sharded again and summed, then the last LayerNorm),
and gives per stage what the planner prices: the parameter bytes each sub-slice would hold
(`_shard_bytes`, read off the decision's narrowing), the tail's, and the FLOPs of each part.

Read in this order: `Join`, `NodeRule`, `ShardDecision`, `Unshardable`, `StageAnalysis`,
`analyze_stages`, `analyze_sharding` (with `_propagate` and `_partition`), `extract_tail`,
`_shard_bytes`.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from mopar.errors import InternalError
from mopar.ir.graph import TensorInfo, tensor_info
from mopar.ir.shard_rules import decide_node
from mopar.ir.shard_states import Edit, NodeState, RuleContext, State, Stop
from mopar.ir.subgraph import (
    SliceModule,
    held_bytes,
    output_nodes,
    param_tensor,
    placeholders,
    public_name,
    slice_flops,
)

__all__ = [
    "Join",
    "NodeRule",
    "ShardDecision",
    "Unshardable",
    "StageAnalysis",
    "analyze_stages",
    "analyze_sharding",
    "extract_tail",
    "ASSERTS",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

ASSERTS = frozenset({aten._assert_tensor_metadata.default, aten._assert_scalar.default})
"""Side-effect-only checks with no value; sub-slices and tails leave them out."""


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
class StageAnalysis:
    """One fork-join stage of a slice sharded η ways, as analysed: nothing is built but the tail.

    Attributes:
        source: the module the stage is cut from: the slice, or the previous stage's tail.
        decision: how ``source`` is sharded.
        tail: ``source``'s tail (None: the joins give all its outputs). The next stage, if any,
            is cut from it; after the last stage it runs once, after the join.
        shard_param_bytes: bytes of parameters and buffers sub-slice k would hold, per k (the
            narrowed parameters at 1/η, the rest whole), as the rewrite builds them.
        tail_param_bytes: bytes of parameters and buffers ``tail`` holds (0 without a tail).
        region_flops: forward FLOPs of the region in ``source`` (the η sub-slices share them).
        tail_flops: forward FLOPs of ``tail`` (0 without a tail).
    """

    source: SliceModule
    decision: ShardDecision
    tail: SliceModule | None
    shard_param_bytes: tuple[int, ...]
    tail_param_bytes: int
    region_flops: int
    tail_flops: int

    @property
    def eta(self) -> int:
        return self.decision.eta

    @property
    def joins(self) -> tuple[Join, ...]:
        return self.decision.joins

    @property
    def region(self) -> tuple[str, ...]:
        """The names of the region's nodes, in graph order."""
        return tuple(r.node for r in self.decision.region)


def analyze_stages(sm: SliceModule, eta: int) -> tuple[StageAnalysis, ...] | Unshardable:
    """Analyse ``sm``, then its tail, then that tail's tail, while a tail can be sharded.

    Each stage after the first stands in for the previous stage's tail; the last stage's tail
    (if any) runs unsharded. A transformer block comes out as two stages (attention; LayerNorm
    and MLP) and a LayerNorm tail: the two all-reduces per layer of Megatron-LM.
    """
    decision = analyze_sharding(sm, eta)
    if isinstance(decision, Unshardable):
        log.info("slice %s stays whole at η = %d: %s", sm.name, eta, decision.reason)
        return decision
    stages = [_stage(sm, decision)]
    while stages[-1].tail is not None:
        following = analyze_sharding(stages[-1].tail, eta)
        if isinstance(following, Unshardable):
            log.info("the tail of %s stays whole at η = %d: %s", sm.name, eta, following.reason)
            break
        stages.append(_stage(stages[-1].tail, following))
    return tuple(stages)


def _stage(source: SliceModule, decision: ShardDecision) -> StageAnalysis:
    tail = extract_tail(source, decision) if decision.tail else None
    return StageAnalysis(
        source=source,
        decision=decision,
        tail=tail,
        shard_param_bytes=_shard_bytes(source, decision),
        tail_param_bytes=held_bytes(tail.gm) if tail is not None else 0,
        region_flops=slice_flops(source, {r.node for r in decision.region}),
        tail_flops=slice_flops(tail) if tail is not None else 0,
    )


# --- decide ---------------------------------------------------------------------------------------


def analyze_sharding(sm: SliceModule, eta: int) -> ShardDecision | Unshardable:
    """Decide how to shard ``sm`` ``eta`` ways (no graph is changed)."""
    if not isinstance(eta, int) or eta < 2:
        raise InternalError(
            f"sharding slice {sm.name} needs η >= 2, got {eta!r}; keep η = 1 "
            "slices whole without analysing them"
        )
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
        bad = {
            n.name: f"{n.name} cannot be joined in state {_fmt(states[n])}"
            for n in crossing
            if not _joinable(n, states[n])
        }
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
        sharded_params=tuple(
            dict.fromkeys(
                str(node.args[nw.arg].target)
                for node in region
                for nw in rules[node].edit.narrow
                if node.args[nw.arg].op == "get_attr"
            )
        ),
    )


def _propagate(sm: SliceModule, eta: int, forced: Mapping[str, str]):
    """States and rules of the nodes before the first stop; the tail; the first stop."""
    states: dict[fx.Node, NodeState] = {}
    rules: dict[fx.Node, NodeRule] = {}
    tail: set[fx.Node] = set()
    first_stop: Stop | None = None
    ctx = RuleContext(eta=eta, states=states, param=lambda t: param_tensor(sm.gm, t))
    for node in sm.gm.graph.nodes:
        if node.op != "call_function" or node.target in ASSERTS:
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
        rules[node] = NodeRule(
            node=node.name, rule=outcome.rule, state=outcome.state, edit=outcome.edit
        )
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
    region |= {
        u
        for n in list(region)
        if isinstance(states[n], tuple)
        for u in n.users
        if u.target is operator.getitem and u in rules
    }
    rest = {n for n in graph.nodes if n.op == "call_function" and n.target not in ASSERTS}
    return [n for n in graph.nodes if n in region], tail | (rest - region)


def _crossing(graph: fx.Graph, region: list[fx.Node], tail: set[fx.Node]) -> list[fx.Node]:
    """Region nodes the tail reads or the slice outputs, in graph order."""
    outputs = set(output_nodes(graph))
    return [n for n in region if n in outputs or any(u in tail for u in n.users)]


def _is_sharded(state: NodeState) -> bool:
    states = state if isinstance(state, tuple) else (state,)
    return any(s.kind != "replicated" for s in states)


def _joinable(node: fx.Node, state: NodeState) -> bool:
    return (
        isinstance(state, State)
        and isinstance(node.meta.get("val"), torch.Tensor)
        and (state.kind != "split" or state.blocks == 1)
    )


def _join(sm: SliceModule, node: fx.Node, state: State, eta: int) -> Join:
    shape = tensor_info(node, "").shape
    name = public_name(sm, node)
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


# --- extract --------------------------------------------------------------------------------------


def extract_tail(sm: SliceModule, decision: ShardDecision) -> SliceModule:
    """The tail of ``decision`` as a slice module: it takes the joined tensors (in join order),
    then the slice inputs it reads (in input order), and gives the slice outputs it makes."""
    graph = fx.Graph()
    nodes = {n.name: n for n in sm.gm.graph.nodes}
    body = [nodes[name] for name in decision.tail]
    in_tail = set(body)
    joined = {j.name: j for j in decision.joins}
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[TensorInfo] = []
    read = {a for n in body for a in n.all_input_nodes if a not in in_tail and a.op != "get_attr"}
    info = dict(zip(placeholders(sm.gm.graph), sm.inputs))
    # Joined tensors first (in join order), then the slice inputs the tail reads (in input order).
    crossing = sorted(
        (n for n in read if n.op != "placeholder"),
        key=lambda n: list(joined).index(public_name(sm, n)),
    )
    for node in crossing + [p for p in placeholders(sm.gm.graph) if p in read]:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
        inputs.append(info.get(node) or tensor_info(node, public_name(sm, node)))

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env and arg.op == "get_attr":
            env[arg] = graph.get_attr(arg.target)
        return env[arg]

    for node in body:
        env[node] = graph.node_copy(node, lookup)
    made = [n for n in output_nodes(sm.gm.graph) if n in in_tail]
    graph.output(tuple(env[n] for n in made))
    graph.lint()
    gm = fx.GraphModule(sm.gm, graph, class_name=f"Tail_{sm.name}")
    outputs = tuple(t for n, t in zip(output_nodes(sm.gm.graph), sm.outputs) if n in in_tail)
    return SliceModule(name=f"{sm.name}-tail", gm=gm, inputs=tuple(inputs), outputs=outputs)


# --- parameter bytes of a sub-slice ---------------------------------------------------------------
# The rewrite's ``_build_shard`` emits each region node under its edit, then drops dead code:
# shards other than 0 skip a bias or a replicated term added once, and with it what only that
# needed. The walk below follows the same edits from the joined tensors back, and counts each
# parameter it reaches once per form: whole, narrowed to 1/η along a dimension, or zeros.

_Key = tuple  # (target,) whole; (target, "zeros"); (target, dim, blocks) narrowed
_Uses = tuple[list[fx.Node], list[_Key]]


def _shard_bytes(sm: SliceModule, decision: ShardDecision) -> tuple[int, ...]:
    """Bytes of parameters and buffers each sub-slice holds (shards 1.. are alike)."""
    first, other = (_held(sm, decision, k) for k in (0, 1))
    return (first, *[other] * (decision.eta - 1))


def _held(sm: SliceModule, decision: ShardDecision, k: int) -> int:
    nodes = {n.name: n for n in sm.gm.graph.nodes}
    uses: dict[fx.Node, _Uses] = {}
    live: list[fx.Node] = []
    for rule in decision.region:
        node = nodes[rule.node]
        uses[node] = _operands(node, rule.edit, k)
        if _kept_for_effect(node, rule.edit, k):
            live.append(node)
    by_name = {public_name(sm, n): n for n in uses}
    live += [by_name[j.name] for j in decision.joins]
    seen: set[fx.Node] = set()
    keys: dict[_Key, None] = {}
    while live:
        node = live.pop()
        if node in seen or node not in uses:  # a placeholder
            continue
        seen.add(node)
        args, params = uses[node]
        keys.update(dict.fromkeys(params))
        live.extend(args)
    return sum(_key_bytes(sm.gm, key, decision.eta) for key in keys)


def _operands(node: fx.Node, edit: Edit, k: int) -> _Uses:
    """The nodes and parameters shard k's copy of ``node`` reads (as `_emit` builds it)."""
    if k != 0 and edit.identity_off_first is not None:
        return _refs(node.args[edit.identity_off_first])
    narrowed = {nw.arg: nw for nw in edit.narrow}
    args: list[_Uses] = []
    for i, a in enumerate(node.args):
        if k != 0 and i in edit.once:
            args.append(([], []))
        elif k != 0 and i in edit.zero_off_first:
            args.append(([], [(str(a.target), "zeros")]))
        elif i in narrowed and a.op == "get_attr":
            args.append(([], [(str(a.target), narrowed[i].dim, narrowed[i].blocks)]))
        elif i in narrowed:  # a computed operand, sliced
            args.append(([a], []))
        else:
            args.append(_refs(a))
    kwargs = _refs(node.kwargs)
    if k != 0 and edit.target_off_first is not None:
        args, kwargs = [args[i] for i in edit.args_off_first], ([], [])
    elif edit.target is not None:
        args, kwargs = [args[i] for i in edit.keep_args], ([], [])
    for i, _ in edit.set_args:  # a constant in place of an operand
        if i < len(args):
            args[i] = ([], [])
    return ([n for a in (*args, kwargs) for n in a[0]], [p for a in (*args, kwargs) for p in a[1]])


def _refs(arg: Any) -> _Uses:
    found: list[fx.Node] = []
    fx.map_arg(arg, lambda n: found.append(n) or n)
    return (
        [n for n in found if n.op != "get_attr"],
        [(str(n.target),) for n in found if n.op == "get_attr"],
    )


def _kept_for_effect(node: fx.Node, edit: Edit, k: int) -> bool:
    """Whether dead-code elimination keeps shard k's copy of ``node`` unused (a side effect)."""
    if k != 0 and (edit.identity_off_first is not None or edit.target_off_first is not None):
        return False
    return edit.target is None and node.is_impure()


def _key_bytes(gm: fx.GraphModule, key: _Key, eta: int) -> int:
    tensor = param_tensor(gm, key[0])
    if not isinstance(tensor, torch.Tensor):
        return 0
    whole = tensor.numel() * tensor.element_size()
    if len(key) == 3:  # narrowed: the k-th of η pieces of every block
        dim, blocks = key[1], key[2]
        size = tensor.shape[dim]
        if size % (blocks * eta):
            raise InternalError(
                f"cannot cut dimension {dim} of size {size} into {blocks}x{eta} pieces"
            )
        return whole // eta
    return whole

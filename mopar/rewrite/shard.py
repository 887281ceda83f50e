"""Horizontal partitioning, applied: cut one slice into η parameter-sharded sub-slices.

Decide, then apply. The decision is the IR's shardability analysis (`mopar.ir.sharding`:
`analyze_sharding` for one slice, `analyze_stages` for the chain of fork-join stages), run once
before the horizontal planner (`mopar.profile.shards.analyze_shards`); the planner prices it, and
the rewrite builds the very analysis it priced (`build_stages`), so the plan and this rewrite
cannot disagree. `apply_sharding` builds:

* η sub-slice GraphModules (`SliceModule`), each computing its part of the region, holding its
  own narrowed copies of the sharded parameters (really smaller tensors) and the replicated ones;
* the decision's joins, one per sub-slice output: ``sum`` (partial sums), ``concat`` along a
  dimension (split tensors) or ``replicated`` (every shard computed the same tensor);
* an optional tail `SliceModule` (`mopar.ir.sharding.extract_tail`), run once on the joined
  tensors (and the slice's inputs), which computes the rest of the slice. `build_stages` shards
  the tail again, as the analysis did: a transformer block is attention (sharded, summed), then
  LayerNorm + MLP (sharded again, summed), then the last LayerNorm.

Read in this order: `ShardedSlice`, `build_stages`, `apply_sharding` (`_build_shard` with
`_Params` and `_emit`). The tests hold the reference that runs a `ShardedSlice` in torch
(``tests/test_shard.py``'s ``run_sharded``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from mopar.errors import InternalError
from mopar.ir.graph import TensorInfo, tensor_info
from mopar.ir.shard_states import Edit, Narrow
from mopar.ir.sharding import Join, ShardDecision, StageAnalysis, extract_tail
from mopar.ir.subgraph import SliceModule, held_bytes, param_tensor, placeholders, public_name

__all__ = ["ShardedSlice", "build_stages", "apply_sharding"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


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


def build_stages(stages: Sequence[StageAnalysis]) -> tuple[ShardedSlice, ...]:
    """Build the fork-join ``stages`` of a slice as analysed
    (`mopar.ir.sharding.analyze_stages`, which the planner priced): the slice, then its tail,
    then that tail's tail.

    Each stage after the first stands in for the previous stage's tail; the last stage's tail
    (if any) runs unsharded.

    Raises:
        InternalError: a sub-slice holds other parameter bytes than the analysis (and so the
            plan's memory sizes) counted.
    """
    return tuple(_apply_stage(stage) for stage in stages)


def _apply_stage(stage: StageAnalysis) -> ShardedSlice:
    sharded = _assemble(stage.source, stage.decision, stage.tail)
    if sharded.shard_param_bytes != stage.shard_param_bytes:
        raise InternalError(
            f"the sub-slices of {stage.source.name} hold "
            f"{sharded.shard_param_bytes} bytes of parameters, but the analysis "
            f"counted {stage.shard_param_bytes}"
        )
    return sharded


# --- apply ----------------------------------------------------------------------------------------


def apply_sharding(sm: SliceModule, decision: ShardDecision) -> ShardedSlice:
    """Build the sub-slices and the tail that ``decision`` describes."""
    return _assemble(sm, decision, extract_tail(sm, decision) if decision.tail else None)


def _assemble(sm: SliceModule, decision: ShardDecision, tail: SliceModule | None) -> ShardedSlice:
    shards = tuple(_build_shard(sm, decision, k) for k in range(decision.eta))
    return ShardedSlice(
        name=sm.name,
        eta=decision.eta,
        shards=shards,
        joins=decision.joins,
        tail=tail,
        inputs=sm.inputs,
        outputs=sm.outputs,
        shard_param_bytes=tuple(held_bytes(s.gm) for s in shards),
        tail_param_bytes=held_bytes(tail.gm) if tail else 0,
        decision=decision,
    )


class _Params:
    """The parameters of one sub-slice: replicated ones shared, narrowed ones copied smaller."""

    def __init__(self, source: fx.GraphModule, graph: fx.Graph, k: int, eta: int) -> None:
        self.source, self.graph, self.k, self.eta = source, graph, k, eta
        self.root = nn.Module()
        self.nodes: dict[tuple, fx.Node] = {}

    def get(self, target: str, narrow: Narrow | None = None, *, zeros: bool = False) -> fx.Node:
        key = (
            (target, narrow.dim, narrow.blocks)
            if narrow
            else (target, "zeros")
            if zeros
            else (target,)
        )
        if key not in self.nodes:
            original = param_tensor(self.source, target)
            tensor = (
                _chunk(original, narrow, self.k, self.eta)
                if narrow is not None
                else torch.zeros_like(original.detach())
                if zeros
                else original
            )
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
    shape = (*tensor.shape[:dim], blocks, size // blocks, *tensor.shape[dim + 1 :])
    piece = size // (blocks * eta)
    chunk = tensor.detach().reshape(shape).narrow(dim + 1, k * piece, piece)
    return chunk.reshape(*tensor.shape[:dim], blocks * piece, *tensor.shape[dim + 1 :]).clone()


def _build_shard(sm: SliceModule, decision: ShardDecision, k: int) -> SliceModule:
    graph = fx.Graph()
    nodes = {n.name: n for n in sm.gm.graph.nodes}
    region = [nodes[r.node] for r in decision.region]
    params = _Params(sm.gm, graph, k, decision.eta)
    env: dict[fx.Node, fx.Node] = {}
    read = {a for n in region for a in n.all_input_nodes if a.op == "placeholder"}
    info = dict(zip(placeholders(sm.gm.graph), sm.inputs))
    for node in placeholders(sm.gm.graph):
        if node in read:
            env[node] = graph.placeholder(node.name)

    def lookup(arg: fx.Node) -> fx.Node:
        return params.get(str(arg.target)) if arg.op == "get_attr" else env[arg]

    for rule in decision.region:
        node = nodes[rule.node]
        env[node] = _emit(graph, node, rule.edit, k, decision.eta, lookup, params)
    by_name = {public_name(sm, n): n for n in region}
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


def _emit(
    graph: fx.Graph, node: fx.Node, edit: Edit, k: int, eta: int, lookup, params: _Params
) -> fx.Node:
    """Shard k's copy of ``node`` under ``edit``."""
    if k != 0 and edit.identity_off_first is not None:
        return fx.map_arg(node.args[edit.identity_off_first], lookup)
    narrowed = {nw.arg: nw for nw in edit.narrow}
    dropped = set(edit.once) if k != 0 else set()  # a bias added by shard 0 only
    zeroed = set(edit.zero_off_first) if k != 0 else set()
    args = [
        None
        if i in dropped
        else params.get(str(a.target), zeros=True)
        if i in zeroed
        else _narrowed(graph, a, narrowed[i], k, eta, lookup, params)
        if i in narrowed
        else fx.map_arg(a, lookup)
        for i, a in enumerate(node.args)
    ]
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


def _narrowed(
    graph: fx.Graph, arg: fx.Node, narrow: Narrow, k: int, eta: int, lookup, params: _Params
) -> fx.Node:
    if arg.op == "get_attr":
        return params.get(str(arg.target), narrow)
    if narrow.blocks != 1:
        raise InternalError(f"a computed operand {arg.name} cannot be narrowed in blocks")
    size = tensor_info(arg, "").shape[narrow.dim]
    piece = size // eta
    return graph.call_function(
        aten.slice.Tensor, (lookup(arg), narrow.dim, k * piece, (k + 1) * piece)
    )


# --- helpers --------------------------------------------------------------------------------------


def _part_info(join: Join, node: fx.Node, eta: int) -> TensorInfo:
    """A sub-slice's part of a joined tensor: the whole shape, or 1/η of it for a concat."""
    shape = list(join.shape)
    if join.kind == "concat":
        shape[join.dim] //= eta
    val = node.meta["val"]
    return TensorInfo(
        name=join.name,
        shape=tuple(shape),
        dtype=tensor_info(node, "").dtype,
        nbytes=math.prod(shape) * val.element_size(),
    )

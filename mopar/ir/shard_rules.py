"""Sharding rules: how one ATen op carries the sharding state of its inputs to its output.

Every tensor of a slice is in one of three states across the η sub-slices (shards):
``R`` (replicated: every shard holds all of it), ``S(d)`` (split: shard k holds the k-th of η
equal contiguous chunks along dimension d) or ``P`` (partial: every shard holds a full-shape
tensor, and the true value is their sum). A rule looks at the states of a node's inputs and
either says what the node's output state is and how each shard must rewrite the node (an
`Edit`: which operands to narrow to the shard's chunk, which bias to add on shard 0 only), or
says why it cannot (`Stop`), which ends the sharded region there.

The rules are those of Megatron-LM and Gillis: a Linear (or Conv, Embedding, a MatMul with a
weight) on a replicated input is column-parallel (output-channel sharded), per-feature ops follow
a split, and a Linear (Conv) on an input split on its features is row-parallel (input-channel
sharded), which leaves a partial sum. Linear ops (add, mul by a replicated tensor, views) carry a
partial sum along; a replicated term added to one is added by shard 0 only.

The states and edits live in `mopar.ir.shard_states`. Read in this order: `decide_node` (dispatch
through `_RULES`, a table from op name to rule), then the rules, grouped by kind.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from mopar.ir.flops import op_name
from mopar.ir.shard_states import (
    PARTIAL,
    REPLICATED,
    Apply,
    Edit,
    Narrow,
    Outcome,
    RuleContext,
    State,
    Stop,
    split,
)

__all__ = ["decide_node", "map_split_through_reshape"]

aten = torch.ops.aten


# --- dispatch -------------------------------------------------------------------------------------

_Rule = Callable[[fx.Node, RuleContext], Outcome]
_RULES: dict[str, _Rule] = {}
# Ops that hold a weight: on a replicated input they are sharded (column-parallel), not copied.
_DOMINANT = {
    "linear",
    "addmm",
    "mm",
    "matmul",
    "bmm",
    "embedding",
    "conv1d",
    "conv2d",
    "conv3d",
    "convolution",
}


def decide_node(node: fx.Node, ctx: RuleContext) -> Outcome:
    """The outcome of the sharding rules for one ``call_function`` node."""
    if node.target is operator.getitem:  # its input is a tuple, whose states R-checks miss
        return _getitem(node, ctx)
    name = op_name(node)
    inputs = [ctx.state(a) for a in node.all_input_nodes]
    if name not in _DOMINANT and all(s.kind == "replicated" for s in inputs):
        return Apply(state=REPLICATED, rule="replicated")
    rule = _RULES.get(name)
    if rule is None:
        seen = ", ".join(f"{a.name}: {ctx.state(a)}" for a in node.all_input_nodes)
        return Stop(reason=f"{node.name} ({name}) has no sharding rule for inputs {seen}")
    return rule(node, ctx)


def _register(*names: str) -> Callable[[_Rule], _Rule]:
    def add(rule: _Rule) -> _Rule:
        _RULES.update(dict.fromkeys(names, rule))
        return rule

    return add


def _nd(ctx: RuleContext, arg: Any) -> int:
    return len(ctx.shape(arg))


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


def _indivisible(node: fx.Node, what: str, size: int, eta: int) -> Stop:
    # Not a refusal: the region ends here (a 10-class head after sharded blocks), and a region
    # left empty makes the slice unshardable with this reason.
    return Stop(
        reason=f"η = {eta} does not divide the {size} {what} of {node.name}; pick an η "
        f"that divides {size}"
    )


# --- dominant operators: column-parallel on R, row-parallel on S(features) ------------------------


@_register("linear")
def _linear(node: fx.Node, ctx: RuleContext) -> Outcome:
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    s, nd = ctx.state(x), _nd(ctx, node)
    if not ctx.is_param(weight):
        return _not_a_weight(node, s)
    if s.kind == "replicated":
        out = ctx.shape(weight)[0]
        blocks = _fused_blocks(node, ctx)
        if out % (ctx.eta * blocks):
            return _indivisible(node, "output features", out // blocks, ctx.eta)
        narrow = [Narrow(arg=1, dim=0, blocks=blocks)]
        if bias is not None:
            narrow.append(Narrow(arg=2, dim=0, blocks=blocks))
        return Apply(
            state=split(nd - 1, blocks),
            rule="column-parallel linear",
            edit=Edit(narrow=tuple(narrow)),
        )
    if s.kind == "split" and s.dim == _nd(ctx, x) - 1 and s.blocks == 1:
        once = (2,) if bias is not None else ()
        return Apply(
            state=PARTIAL,
            rule="row-parallel linear",
            edit=Edit(narrow=(Narrow(arg=1, dim=1),), once=once),
        )
    return _linear_stop(node, s)


def _linear_stop(node: fx.Node, s: State) -> Stop:
    if s.kind == "partial":
        return Stop(
            reason=f"{node.name} is a Linear/MatMul over a partial sum (the sum must be "
            "taken first)"
        )
    return Stop(
        reason=f"{node.name} is a Linear/MatMul over a tensor split as {s}, not on its "
        "features (sharding it would replicate its weight)"
    )


def _not_a_weight(node: fx.Node, s: State) -> Outcome:
    if s.kind == "replicated":
        return Apply(state=REPLICATED, rule="replicated")
    return Stop(reason=f"{node.name} multiplies by a computed tensor, not a parameter, over {s}")


@_register("addmm")
def _addmm(node: fx.Node, ctx: RuleContext) -> Outcome:
    """``addmm(bias, x, W)`` with W of shape [in, out], as GPT-2's Conv1D exports."""
    bias, x, weight = node.args[:3]
    s = ctx.state(x)
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return Stop(reason=f"{node.name} is an addmm with beta/alpha, which has no sharding rule")
    if not ctx.is_param(weight) or ctx.state(bias).kind != "replicated":
        return _not_a_weight(node, s)
    if s.kind == "replicated":
        out = ctx.shape(weight)[1]
        blocks = _fused_blocks(node, ctx)
        if out % (ctx.eta * blocks):
            return _indivisible(node, "output features", out // blocks, ctx.eta)
        if ctx.shape(bias)[-1:] != (out,):
            return Stop(
                reason=f"{node.name}'s bias of shape {ctx.shape(bias)} is not one per "
                "output feature"
            )
        narrow = (
            Narrow(arg=0, dim=len(ctx.shape(bias)) - 1, blocks=blocks),
            Narrow(arg=2, dim=1, blocks=blocks),
        )
        return Apply(state=split(1, blocks), rule="column-parallel addmm", edit=Edit(narrow=narrow))
    if s.kind == "split" and s.dim == 1 and s.blocks == 1:
        return Apply(
            state=PARTIAL,
            rule="row-parallel addmm",
            edit=Edit(
                narrow=(Narrow(arg=2, dim=0),),
                once=(0,),
                target_off_first=aten.mm.default,
                args_off_first=(1, 2),
            ),
        )
    return _linear_stop(node, s)


@_register("mm", "matmul", "bmm")
def _matmul(node: fx.Node, ctx: RuleContext) -> Outcome:
    a, b = node.args[:2]
    sa, sb = ctx.state(a), ctx.state(b)
    if ctx.is_param(b) and _nd(ctx, b) == 2:
        return _matmul_weight(node, ctx, sa)
    if sa.kind == "replicated" and sb.kind == "replicated":
        return Apply(state=REPLICATED, rule="replicated")
    if "partial" in (sa.kind, sb.kind):
        if {sa.kind, sb.kind} == {"partial", "replicated"}:
            return Apply(state=PARTIAL, rule="matmul of a partial sum by a replicated tensor")
        return Stop(
            reason=f"{node.name} multiplies a partial sum by a tensor in state "
            f"{sb if sa.kind == 'partial' else sa}"
        )
    if sa.blocks > 1 or sb.blocks > 1:
        return Stop(reason=f"{node.name} is a matmul over a fused split ({sa}, {sb})")
    return _batched_matmul(node, ctx, sa, sb)


def _matmul_weight(node: fx.Node, ctx: RuleContext, s: State) -> Outcome:
    nd_a, out = _nd(ctx, node.args[0]), ctx.shape(node.args[1])[1]
    if s.kind == "replicated":
        if out % ctx.eta:
            return _indivisible(node, "output features", out, ctx.eta)
        return Apply(
            state=split(_nd(ctx, node) - 1),
            rule="column-parallel matmul",
            edit=Edit(narrow=(Narrow(arg=1, dim=1),)),
        )
    if s.kind == "split" and s.dim == nd_a - 1 and s.blocks == 1:
        return Apply(
            state=PARTIAL, rule="row-parallel matmul", edit=Edit(narrow=(Narrow(arg=1, dim=0),))
        )
    return _linear_stop(node, s)


def _batched_matmul(node: fx.Node, ctx: RuleContext, sa: State, sb: State) -> Outcome:
    """Two computed operands, at least one split: per-head attention scores and context."""
    a, b = node.args[:2]
    na, nb, no = _nd(ctx, a), _nd(ctx, b), _nd(ctx, node)
    if na < 2 or nb < 2:
        return Stop(reason=f"{node.name} is a matmul of a vector, which has no sharding rule")
    # Output coordinates of each operand's split dimension (batch dims broadcast from the right).
    oa = sa.dim + no - na if sa.kind == "split" and sa.dim < na - 2 else None
    ob = sb.dim + no - nb if sb.kind == "split" and sb.dim < nb - 2 else None
    if sa.kind == "split" and sb.kind == "split":
        if oa is not None and oa == ob:
            return Apply(state=split(oa), rule="batched matmul follows the split")
        if sa.dim == na - 1 and sb.dim == nb - 2:
            return Apply(state=PARTIAL, rule="matmul contracting the split dimension")
        return Stop(reason=f"{node.name} multiplies tensors split as {sa} and {sb}")
    if sa.kind == "split":
        if oa is not None:
            return _batch_with_replicated(node, ctx, oa, other=1)
        if sa.dim == na - 2:
            return Apply(state=split(no - 2), rule="matmul follows the row split")
    elif ob is not None:
        return _batch_with_replicated(node, ctx, ob, other=0)
    elif sb.dim == nb - 1:
        return Apply(state=split(no - 1), rule="matmul follows the column split")
    return Stop(reason=f"{node.name} multiplies tensors split as {sa} and {sb}")


def _batch_with_replicated(node: fx.Node, ctx: RuleContext, out_dim: int, *, other: int) -> Outcome:
    shape, no = ctx.shape(node.args[other]), _nd(ctx, node)
    dim = out_dim - (no - len(shape))
    narrow = () if dim < 0 or shape[dim] == 1 else (Narrow(arg=other, dim=dim),)
    return Apply(
        state=split(out_dim), rule="batched matmul follows the split", edit=Edit(narrow=narrow)
    )


@_register("embedding")
def _embedding(node: fx.Node, ctx: RuleContext) -> Outcome:
    weight, indices = node.args[:2]
    if ctx.state(indices).kind != "replicated":
        return Stop(reason=f"{node.name} looks up indices in state {ctx.state(indices)}")
    if not ctx.is_param(weight):
        return Apply(state=REPLICATED, rule="replicated")
    dim = ctx.shape(weight)[1]
    if dim % ctx.eta:
        return _indivisible(node, "embedding features", dim, ctx.eta)
    return Apply(
        state=split(_nd(ctx, node) - 1),
        rule="column-parallel embedding",
        edit=Edit(narrow=(Narrow(arg=0, dim=1),)),
    )


@_register("conv1d", "conv2d", "conv3d", "convolution")
def _conv(node: fx.Node, ctx: RuleContext) -> Outcome:
    x, weight = node.args[:2]
    s = ctx.state(x)
    if not ctx.is_param(weight):
        return _not_a_weight(node, s)
    args = _conv_args(node)
    if args is None:  # a transposed convolution
        if s.kind == "replicated":
            return Apply(state=REPLICATED, rule="replicated")
        return Stop(reason=f"{node.name} is a transposed convolution, which has no sharding rule")
    bias, groups, groups_at = args
    channel = _nd(ctx, node) - (_nd(ctx, weight) - 2) - 1
    out = ctx.shape(weight)[0]
    has_bias = bias is not None
    if s.kind == "replicated":
        if groups != 1:  # a depthwise conv on a replicated input: cheap, every shard runs it
            return Apply(state=REPLICATED, rule="replicated")
        if out % ctx.eta:
            return _indivisible(node, "output channels", out, ctx.eta)
        narrow = (Narrow(arg=1, dim=0),) + ((Narrow(arg=2, dim=0),) if has_bias else ())
        return Apply(state=split(channel), rule="output-channel conv", edit=Edit(narrow=narrow))
    if s.kind == "split" and s.dim == channel and s.blocks == 1:
        if groups == 1:
            return Apply(
                state=PARTIAL,
                rule="input-channel conv",
                edit=Edit(narrow=(Narrow(arg=1, dim=1),), once=(2,) if has_bias else ()),
            )
        if groups % ctx.eta:
            return _indivisible(node, "groups", groups, ctx.eta)
        narrow = (Narrow(arg=1, dim=0),) + ((Narrow(arg=2, dim=0),) if has_bias else ())
        # groups != 1 is spelt out in the node, so position groups_at exists.
        return Apply(
            state=split(channel),
            rule="grouped conv follows the channel split",
            edit=Edit(narrow=narrow, set_args=((groups_at, groups // ctx.eta),)),
        )
    if s.kind == "partial":
        return Stop(
            reason=f"{node.name} is a convolution over a partial sum (the sum must be taken first)"
        )
    return Stop(
        reason=f"{node.name} is a convolution over a tensor split as {s}, not on its "
        f"channels (dim {channel})"
    )


def _conv_args(node: fx.Node) -> tuple[Any, int, int] | None:
    """(bias, groups, position of groups), or None for a transposed convolution."""
    args = node.args
    if op_name(node) == "convolution":
        return None if args[6] else (args[2], int(args[8]), 8)
    return (args[2] if len(args) > 2 else None, int(args[6]) if len(args) > 6 else 1, 6)


def _fused_blocks(node: fx.Node, ctx: RuleContext) -> int:
    """How many equal chunks a later ``split`` cuts this projection's output features into.

    GPT-2 computes q, k and v with one projection and splits its output in three; sharding that
    projection in one contiguous piece would give shard 0 all of q. Looking ahead through views
    that keep the last dimension, find such a split.
    """
    width = ctx.shape(node)[-1]
    current = node
    while len(current.users) == 1:
        (user,) = current.users
        name = op_name(user)
        if name in ("view", "reshape", "_unsafe_view") and ctx.shape(user)[-1:] == (width,):
            current = user
            continue
        if (
            name == "split"
            and _norm(int(_arg(user, 2, 0)), _nd(ctx, user.args[0])) == _nd(ctx, user.args[0]) - 1
        ):
            size = int(user.args[1])
            return width // size if width % size == 0 and width // size > 1 else 1
        return 1
    return 1


# --- per-feature ops: follow a split --------------------------------------------------------------

# Nonlinear elementwise ops: they follow a split, and end the region on a partial sum.
_UNARY = (
    "relu",
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "hardtanh",
    "hardswish",
    "hardsigmoid",
    "leaky_relu",
    "elu",
    "erf",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "abs",
    "sin",
    "cos",
    "clamp",
    "softplus",
    "mish",
    "reciprocal",
    "square",
    "pow",
    "logical_not",
    "bitwise_not",
    "sign",
)
# Linear one-input ops: they carry a split or a partial sum unchanged.
_LINEAR_UNARY = (
    "neg",
    "clone",
    "contiguous",
    "alias",
    "detach",
    "dropout",
    "lift_fresh_copy",
    "to",
    "_to_copy",
    "type_as",
)


@_register(*_UNARY)
def _unary(node: fx.Node, ctx: RuleContext) -> Outcome:
    tensors = node.all_input_nodes
    if len(tensors) != 1:
        return _elementwise(node, ctx)
    s = ctx.state(tensors[0])
    if s.kind == "partial":
        return Stop(
            reason=f"{node.name} ({op_name(node)}) is not linear, so it cannot run on a partial sum"
        )
    return Apply(state=s, rule="elementwise follows the split")


@_register(*_LINEAR_UNARY)
def _linear_unary(node: fx.Node, ctx: RuleContext) -> Outcome:
    s = ctx.state(node.args[0])
    if op_name(node) == "dropout" and _arg(node, 2, False):
        return Stop(reason=f"{node.name} is a dropout in training mode")
    val = node.meta.get("val")
    if s.kind == "partial" and not (isinstance(val, torch.Tensor) and val.is_floating_point()):
        return Stop(reason=f"{node.name} casts a partial sum to {getattr(val, 'dtype', '?')}")
    if len(node.all_input_nodes) != 1:
        return Stop(reason=f"{node.name} ({op_name(node)}) reads several tensors")
    return Apply(state=s, rule="follows its input")


_LINEAR_BINARY = {"add", "sub", "mul", "div"}


@_register(
    "add",
    "sub",
    "mul",
    "div",
    "maximum",
    "minimum",
    "where",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "__and",
    "__or",
    "bitwise_and",
    "bitwise_or",
    "logical_and",
    "logical_or",
    "masked_fill",
    "fmod",
    "remainder",
    "atan2",
)
def _elementwise(node: fx.Node, ctx: RuleContext) -> Outcome:
    tensors = [(i, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
    states = {i: ctx.state(a) for i, a in tensors}
    kinds = {s.kind for s in states.values()}
    if "partial" in kinds:
        if "split" in kinds:
            return Stop(reason=f"{node.name} combines a partial sum with a split tensor")
        return _on_partial(node, ctx, states)
    out_nd = _nd(ctx, node)
    dims = {s.dim + out_nd - _nd(ctx, node.args[i]) for i, s in states.items() if s.kind == "split"}
    blocks = {s.blocks for s in states.values() if s.kind == "split"}
    if len(dims) != 1 or len(blocks) != 1:
        seen = ", ".join(str(s) for s in states.values())
        return Stop(reason=f"{node.name} combines tensors split differently ({seen})")
    (dim,), (nblocks,) = dims, blocks
    narrow = []
    for i, a in tensors:
        shape = ctx.shape(a)
        at = dim - (out_nd - len(shape))
        if states[i].kind == "replicated" and at >= 0 and shape[at] != 1:
            if nblocks > 1 and not ctx.is_param(a):
                return Stop(reason=f"{node.name} combines a fused split with a computed tensor")
            narrow.append(Narrow(arg=i, dim=at, blocks=nblocks))
    return Apply(
        state=split(dim, nblocks),
        rule="elementwise follows the split",
        edit=Edit(narrow=tuple(narrow)),
    )


def _on_partial(node: fx.Node, ctx: RuleContext, states: dict[int, State]) -> Outcome:
    """Linear combinations keep a partial sum: P + P, P + R (R added once), P * R, P / R."""
    kind = op_name(node) if op_name(node) in _LINEAR_BINARY else None
    partial = [i for i, s in states.items() if s.kind == "partial"]
    other = [i for i in range(len(node.args)) if i not in partial]
    if kind is None or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return Stop(reason=f"{node.name} ({op_name(node)}) is not linear in a partial sum")
    if kind in ("add", "sub"):
        if not other:
            return Apply(state=PARTIAL, rule="sum of partial sums")
        if kind == "sub" and partial != [0]:
            return Stop(reason=f"{node.name} subtracts a partial sum from a replicated tensor")
        if ctx.shape(node.args[partial[0]]) != ctx.shape(node):
            return Stop(reason=f"{node.name} broadcasts a partial sum to a larger shape")
        return Apply(
            state=PARTIAL,
            rule="replicated term added by shard 0 only",
            edit=Edit(identity_off_first=partial[0]),
        )
    if len(partial) == 1 and (kind == "mul" or partial == [0]):
        return Apply(
            state=PARTIAL,
            rule=f"partial sum {'scaled' if kind == 'mul' else 'divided'} by a replicated tensor",
        )
    return Stop(reason=f"{node.name} ({kind}) is not linear in its partial-sum operands")


@_register("softmax", "_softmax", "log_softmax", "_log_softmax")
def _softmax(node: fx.Node, ctx: RuleContext) -> Outcome:
    s, nd = ctx.state(node.args[0]), _nd(ctx, node)
    if s.kind == "partial":
        return Stop(reason=f"{node.name} is a softmax over a partial sum")
    if _norm(int(node.args[1]), nd) == s.dim:
        return Stop(reason=f"{node.name} is a softmax over the split dimension {s.dim}")
    return Apply(state=s, rule="softmax follows the split")


@_register("layer_norm", "native_layer_norm", "rms_norm")
def _layer_norm(node: fx.Node, ctx: RuleContext) -> Outcome:
    s, nd = ctx.state(node.args[0]), _nd(ctx, node.args[0])
    if any(ctx.state(a).kind != "replicated" for a in node.all_input_nodes[1:]):
        return Stop(reason=f"{node.name} normalises with sharded affine parameters")
    if s.kind == "partial":
        return Stop(reason=f"{node.name} is a LayerNorm over a partial sum")
    if s.dim >= nd - len(node.args[1]):
        return Stop(reason=f"{node.name} is a LayerNorm over the split dimension {s.dim}")
    state = (s, s, s) if op_name(node) == "native_layer_norm" else s
    return Apply(state=state, rule="LayerNorm follows a split outside its normalised dims")


@_register("batch_norm", "_native_batch_norm_legit_no_training")
def _batch_norm(node: fx.Node, ctx: RuleContext) -> Outcome:
    s = ctx.state(node.args[0])
    legit = op_name(node) != "batch_norm"
    if not legit and node.args[5]:
        return Stop(reason=f"{node.name} is a BatchNorm in training mode")
    if s.kind == "partial":
        # Inference BatchNorm is affine, (x - mean) * w / sqrt(var + eps) + b: shard 0 applies it
        # whole, the others only the scale (mean and b zero), and the parts still sum exactly.
        if any(not ctx.is_param(node.args[i]) for i in (2, 3) if node.args[i] is not None):
            return Stop(
                reason=f"{node.name} is a BatchNorm over a partial sum with computed statistics"
            )
        zero = tuple(i for i in (2, 3) if node.args[i] is not None)
        state = (PARTIAL, REPLICATED, REPLICATED) if legit else PARTIAL
        return Apply(
            state=state,
            rule="BatchNorm of a partial sum (shift added by shard 0 only)",
            edit=Edit(zero_off_first=zero),
        )
    if s.kind != "split" or s.dim != 1 or s.blocks != 1:
        return Stop(reason=f"{node.name} is a BatchNorm over a tensor split as {s}")
    narrow = tuple(Narrow(arg=i, dim=0) for i in range(1, 5) if node.args[i] is not None)
    state = (s, REPLICATED, REPLICATED) if legit else s
    return Apply(state=state, rule="BatchNorm follows the channel split", edit=Edit(narrow=narrow))


@_register(
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d",
    "max_pool2d_with_indices",
)
def _pool(node: fx.Node, ctx: RuleContext) -> Outcome:
    name, s = op_name(node), ctx.state(node.args[0])
    if s.kind == "partial":
        if "avg" in name:
            return Apply(state=PARTIAL, rule="average pool of a partial sum")
        return Stop(reason=f"{node.name} is a max pool over a partial sum")
    spatial = int(next(c for c in name if c.isdigit()))
    if s.dim >= _nd(ctx, node.args[0]) - spatial:
        return Stop(reason=f"{node.name} pools over the split dimension {s.dim}")
    state = (s, s) if name.endswith("with_indices") else s
    return Apply(state=state, rule="pooling follows the channel split")


@_register("mean", "sum", "amax", "amin")
def _reduce(node: fx.Node, ctx: RuleContext) -> Outcome:
    s, nd = ctx.state(node.args[0]), _nd(ctx, node.args[0])
    linear = op_name(node) in ("mean", "sum")
    dims = _arg(node, 1, None)
    if dims is None or dims == []:  # no dims: reduce them all
        reduced = set(range(nd))
    else:
        reduced = {_norm(int(d), nd) for d in ([dims] if isinstance(dims, int) else dims)}
    if s.kind == "partial":
        if linear:
            return Apply(state=PARTIAL, rule="reduction of a partial sum")
        return Stop(reason=f"{node.name} ({op_name(node)}) is not linear in a partial sum")
    if s.dim in reduced:
        return Stop(reason=f"{node.name} reduces over the split dimension {s.dim}")
    keep = bool(_arg(node, 2, False))
    dim = s.dim if keep else s.dim - sum(1 for d in reduced if d < s.dim)
    return Apply(state=split(dim, s.blocks), rule="reduction follows the split")


# --- layout ops: move the split dimension ---------------------------------------------------------


@_register("view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze")
def _reshape(node: fx.Node, ctx: RuleContext) -> Outcome:
    s = ctx.state(node.args[0])
    if s.kind == "partial":
        return Apply(state=PARTIAL, rule="view of a partial sum")
    src, dst = ctx.shape(node.args[0]), ctx.shape(node)
    mapped = map_split_through_reshape(src, s.dim, dst, ctx.eta, s.blocks)
    if isinstance(mapped, str):
        return Stop(
            reason=f"{node.name} reshapes {src} to {dst}: {mapped}", refuse=mapped.startswith("η")
        )
    local = list(dst)
    local[mapped] //= ctx.eta
    return Apply(
        state=split(mapped, s.blocks),
        rule="view moves the split",
        edit=Edit(target=aten.reshape.default, keep_args=(0,), set_args=((1, tuple(local)),)),
    )


def map_split_through_reshape(
    src: tuple[int, ...], dim: int, dst: tuple[int, ...], eta: int, blocks: int = 1
) -> int | str:
    """The dimension of ``dst`` that a split of ``src`` along ``dim`` becomes, or why none does.

    A contiguous split of dimension d of ``src`` into η chunks is, in row-major element order, η
    equal runs inside every block of prod(src[:d]) outer indices. It stays a split along
    dimension e of ``dst`` exactly when prod(dst[:e]) equals that outer count and η divides
    dst[e]: the run lengths then agree, since the inner sizes have equal products.
    """
    outer = math.prod(src[:dim])
    candidates = [e for e in range(len(dst)) if math.prod(dst[:e]) == outer and dst[e] != 1]
    if not candidates:
        return f"the split dimension {dim} is mixed with others"
    e = candidates[0]
    if blocks > 1 and (dst[e] != src[dim] or math.prod(dst[e + 1 :]) != math.prod(src[dim + 1 :])):
        return "a fused projection's split dimension is reshaped"
    if dst[e] % eta:
        return (
            f"η = {eta} does not divide dimension {e} of size {dst[e]} (for attention, η must "
            "divide the number of heads)"
        )
    return e


@_register("permute")
def _permute(node: fx.Node, ctx: RuleContext) -> Outcome:
    s = ctx.state(node.args[0])
    if s.kind == "partial":
        return Apply(state=PARTIAL, rule="permute of a partial sum")
    nd = _nd(ctx, node)
    order = [_norm(int(d), nd) for d in node.args[1]]
    return Apply(state=split(order.index(s.dim), s.blocks), rule="permute moves the split")


@_register("transpose", "t")
def _transpose(node: fx.Node, ctx: RuleContext) -> Outcome:
    s = ctx.state(node.args[0])
    if s.kind == "partial":
        return Apply(state=PARTIAL, rule="transpose of a partial sum")
    nd = _nd(ctx, node)
    if op_name(node) == "t":
        i, j = 0, 1
    else:
        i, j = _norm(int(node.args[1]), nd), _norm(int(node.args[2]), nd)
    dim = j if s.dim == i else i if s.dim == j else s.dim
    return Apply(state=split(dim, s.blocks), rule="transpose moves the split")


@_register("select", "slice")
def _index(node: fx.Node, ctx: RuleContext) -> Outcome:
    s, nd = ctx.state(node.args[0]), _nd(ctx, node.args[0])
    if s.kind == "partial":
        return Apply(state=PARTIAL, rule=f"{op_name(node)} of a partial sum")
    dim = _norm(int(_arg(node, 1, 0)), nd)
    if dim == s.dim:
        if op_name(node) == "slice" and ctx.shape(node) == ctx.shape(node.args[0]):
            return Apply(state=s, rule="full slice follows the split")
        return Stop(reason=f"{node.name} indexes into the split dimension {s.dim}")
    shift = 1 if op_name(node) == "select" and dim < s.dim else 0
    return Apply(state=split(s.dim - shift, s.blocks), rule=f"{op_name(node)} follows the split")


@_register("split", "split_with_sizes")
def _split(node: fx.Node, ctx: RuleContext) -> Outcome:
    s, nd = ctx.state(node.args[0]), _nd(ctx, node.args[0])
    count = len(node.meta.get("val") or ())
    if s.kind == "partial":
        return Apply(state=(PARTIAL,) * count, rule="split of a partial sum")
    dim = _norm(int(_arg(node, 2, 0)), nd)
    if dim != s.dim:
        return Apply(state=(s,) * count, rule="split follows the split")
    sizes = node.args[1]
    equal = isinstance(sizes, int) or len(set(sizes)) == 1
    if s.blocks == count and equal:
        local = sizes // ctx.eta if isinstance(sizes, int) else tuple(n // ctx.eta for n in sizes)
        return Apply(
            state=(split(dim),) * count,
            rule="split of a fused projection",
            edit=Edit(set_args=((1, local),)),
        )
    return Stop(reason=f"{node.name} splits the split dimension {s.dim} into {count} pieces")


@_register("getitem")
def _getitem(node: fx.Node, ctx: RuleContext) -> Outcome:
    parent, index = node.args
    states = ctx.states.get(parent, REPLICATED)
    state = states[index] if isinstance(states, tuple) else states
    return Apply(state=state, rule="follows its tuple")


@_register("cat")
def _cat(node: fx.Node, ctx: RuleContext) -> Outcome:
    parts, nd = node.args[0], _nd(ctx, node)
    dim = _norm(int(_arg(node, 1, 0)), nd)
    states = {ctx.state(p) for p in parts}
    if states == {PARTIAL}:
        return Apply(state=PARTIAL, rule="concatenation of partial sums")
    if len(states) == 1 and (s := next(iter(states))).kind == "split" and s.dim != dim:
        return Apply(state=s, rule="concatenation follows the split")
    seen = ", ".join(str(st) for st in states)
    return Stop(reason=f"{node.name} concatenates tensors in states {seen} along dim {dim}")


def _arg(node: fx.Node, position: int, default: Any) -> Any:
    return node.args[position] if len(node.args) > position else default

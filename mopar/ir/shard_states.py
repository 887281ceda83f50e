"""The vocabulary of the sharding rules (`mopar.ir.shard_rules`): a tensor's state across the
η shards (`State`: ``R``, ``S(d)`` or ``P``), how a shard rewrites a node (`Narrow`, `Edit`),
and a rule's verdict (`Apply` or `Stop`) from what it may read (`RuleContext`).

Read in this order: `State`, `Narrow` and `Edit`, `Apply` and `Stop`, `RuleContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

__all__ = [
    "PARTIAL",
    "REPLICATED",
    "Apply",
    "Edit",
    "Narrow",
    "NodeState",
    "Outcome",
    "RuleContext",
    "State",
    "Stop",
    "split",
]


@dataclass(frozen=True, kw_only=True)
class State:
    """How one tensor is spread over the shards.

    Attributes:
        kind: ``"replicated"``, ``"split"`` or ``"partial"``.
        dim: the split dimension (non-negative; split only).
        blocks: the split dimension is made of this many equal blocks, and shard k holds the
            k-th of η chunks of every block (a fused q/k/v projection, split into q, k and v
            later); 1 for a plain contiguous split.
    """

    kind: str
    dim: int = 0
    blocks: int = 1

    def __str__(self) -> str:
        if self.kind == "split":
            return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim}, blocks={self.blocks})"
        return "R" if self.kind == "replicated" else "P"


REPLICATED = State(kind="replicated")
PARTIAL = State(kind="partial")
NodeState = State | tuple[State, ...]


def split(dim: int, blocks: int = 1) -> State:
    """The state of a tensor split along ``dim``."""
    return State(kind="split", dim=dim, blocks=blocks)


@dataclass(frozen=True, kw_only=True)
class Narrow:
    """Replace operand ``arg`` (a position in ``node.args``) by shard k's chunk along ``dim``."""

    arg: int
    dim: int
    blocks: int = 1


@dataclass(frozen=True, kw_only=True)
class Edit:
    """How every shard rewrites one node; the empty Edit copies the node unchanged.

    Attributes:
        narrow: operands replaced by the shard's chunk (a smaller parameter, or a slice op).
        once: positions of operands (a bias) passed as None on every shard but shard 0.
        identity_off_first: on every shard but shard 0 the node is this operand (a replicated
            term added to a partial sum once).
        zero_off_first: positions of parameters replaced by zeros on every shard but shard 0
            (a BatchNorm's shift, applied to a partial sum once).
        target: a replacement op on every shard (``aten.reshape`` for view-like ops).
        keep_args: with ``target``, the positions of the original operands it keeps.
        set_args: ``(position, value)`` constants set after the above (local shapes, groups).
        target_off_first: a replacement op on shards other than 0 (``addmm`` -> ``mm``), taking
            the operands at ``args_off_first``.
    """

    narrow: tuple[Narrow, ...] = ()
    once: tuple[int, ...] = ()
    identity_off_first: int | None = None
    zero_off_first: tuple[int, ...] = ()
    target: Any = None
    keep_args: tuple[int, ...] = ()
    set_args: tuple[tuple[int, Any], ...] = ()
    target_off_first: Any = None
    args_off_first: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Apply:
    """A rule applies: the node's output state, the rule's name, and the shards' edit."""

    state: NodeState
    rule: str
    edit: Edit = field(default_factory=Edit)


@dataclass(frozen=True, kw_only=True)
class Stop:
    """No rule applies: the sharded region ends before this node.

    ``refuse`` marks a dimension that η does not divide: the slice is refused for this η rather
    than sharded over a shorter region.
    """

    reason: str
    refuse: bool = False


Outcome = Apply | Stop


@dataclass(frozen=True)
class RuleContext:
    """What a rule may read: η, the states decided so far, and the slice's parameters."""

    eta: int
    states: Mapping[fx.Node, NodeState]
    param: Callable[[str], torch.Tensor]

    def state(self, arg: Any) -> State:
        if not isinstance(arg, fx.Node):
            return REPLICATED
        s = self.states.get(arg, REPLICATED)
        return s if isinstance(s, State) else REPLICATED

    def shape(self, arg: Any) -> tuple[int, ...]:
        if not isinstance(arg, fx.Node):
            return ()
        if arg.op == "get_attr":
            return tuple(self.param(str(arg.target)).shape)
        val = arg.meta.get("val")
        return tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()

    def is_param(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg.op == "get_attr"

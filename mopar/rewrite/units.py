"""Apply the Plan's η: replace each sharded slice by its sub-slices and its join.

A slice the Plan runs η ways (`mopar.planner.horizontal`) becomes a chain of fork-join stages,
built from the analysis the planner priced (`mopar.profile.shards.ShardAnalysis`, by
`mopar.rewrite.shard.build_stages`; nothing is analysed again here), each η + 1 executable
units in this order: the sub-slices
(`stage_names`), whose outputs are renamed to their parts (`part_name`), then the join: one module
that sums or concatenates the parts (and, in the last stage, runs the rest of the slice, the
tail), so that it exports to ONNX and runs like any other slice. Every other slice is its own
unit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from mopar.errors import InternalError
from mopar.plan import Plan
from mopar.planner.horizontal import part_name, stage_names
from mopar.rewrite.shard import Join, build_stages
from mopar.rewrite.split import SliceModule

if TYPE_CHECKING:
    from mopar.profile.shards import ShardAnalysis
    from mopar.rewrite.shard import ShardedSlice

__all__ = ["expand_units"]


def expand_units(
    slices: tuple[SliceModule, ...], plan: Plan, analysis: ShardAnalysis | None
) -> tuple[SliceModule, ...]:
    """The executable units of ``plan``, in its order, from its vertical ``slices`` and the
    sharding ``analysis`` it was planned from.

    Raises:
        InternalError: the plan shards a slice the analysis has no stages of.
    """
    eta = {f.group: f.parallel for f in plan.functions if f.parallel > 1}
    units: list[SliceModule] = []
    for sm in slices:
        if sm.name not in eta:
            units.append(sm)
            continue
        if analysis is None:
            raise InternalError(f"slice {sm.name} is planned sharded without a sharding analysis")
        stages = build_stages(analysis.stages_of(sm.name, eta[sm.name]))
        names = stage_names(sm.name, len(stages), eta[sm.name])
        for i, (stage, (shards, join)) in enumerate(zip(stages, names)):
            last = i == len(stages) - 1
            units.extend(_shards(stage, shards))
            units.append(_join(stage, join, last=last))
    names = [u.name for u in units]
    if names != [f.name for f in plan.functions]:
        raise InternalError(f"units {names} do not follow the plan's functions")
    return tuple(units)


def _shards(sh: ShardedSlice, names: list[str]) -> list[SliceModule]:
    return [
        SliceModule(
            name=name,
            gm=shard.gm,
            inputs=shard.inputs,
            outputs=tuple(replace(t, name=part_name(t.name, k)) for t in shard.outputs),
        )
        for k, (shard, name) in enumerate(zip(sh.shards, names))
    ]


class _JoinTail(nn.Module):
    """forward(*parts, *other inputs): aggregate each joined tensor's parts, run the tail."""

    def __init__(
        self, sh: ShardedSlice, other: list[str], tail: SliceModule | None, outputs: list[str]
    ) -> None:
        super().__init__()
        self.joins: tuple[Join, ...] = sh.joins
        self.eta = sh.eta
        self.other = other
        self.tail = tail.gm if tail is not None else None
        self.tail_inputs = [t.name for t in tail.inputs] if tail is not None else []
        self.tail_outputs = [t.name for t in tail.outputs] if tail is not None else []
        self.outputs = outputs

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.eta * len(self.joins)
        values = dict(zip(self.other, args[n:]))
        for j, join in enumerate(self.joins):
            parts = [args[k * len(self.joins) + j] for k in range(self.eta)]
            if join.kind == "sum":  # parts[0] + parts[1] + ..., in order
                joined = sum(parts[1:], parts[0])
            elif join.kind == "concat":
                joined = torch.cat(parts, dim=join.dim)
            else:  # replicated: every part is the same tensor
                joined = parts[0]
            values[join.name] = joined
        if self.tail is not None:
            values.update(zip(self.tail_outputs, self.tail(*[values[x] for x in self.tail_inputs])))
        return tuple(values[x] for x in self.outputs)


def _join(sh: ShardedSlice, name: str, *, last: bool) -> SliceModule:
    """The join of one stage: the last runs the slice's tail; an earlier one hands the joined
    tensors to the next stage's sub-slices."""
    joined = {j.name for j in sh.joins}
    parts = [
        replace(t, name=part_name(t.name, k))
        for k, shard in enumerate(sh.shards)
        for t in shard.outputs
    ]
    tail = sh.tail if last else None
    wanted = {t.name for t in tail.inputs} if tail is not None else set()
    other = [t for t in sh.inputs if t.name in wanted and t.name not in joined]
    if last:
        outputs = list(sh.outputs)
    else:
        shapes = {t.name: t for t in sh.shards[0].outputs}
        outputs = [
            replace(
                shapes[j.name],
                shape=j.shape,
                nbytes=shapes[j.name].nbytes * (sh.eta if j.kind == "concat" else 1),
            )
            for j in sh.joins
        ]
    module = _JoinTail(sh, [t.name for t in other], tail, [t.name for t in outputs])
    return SliceModule(name=name, gm=module, inputs=(*parts, *other), outputs=tuple(outputs))

"""Sharding figures: what each slice of a vertical plan would be, run η ways.

The horizontal planner (`mopar.planner.horizontal`) decides η per slice from numbers only.
Those numbers come from the slices' FX graphs, so they are measured here, between the vertical
plan and the horizontal one: `analyze_shards` extracts each slice of the vertical cut, runs the
IR's shardability analysis (`mopar.ir.sharding.analyze_stages`) for every η up to the cap, and
returns both what the planner reads (`SliceShards`: FLOPs, parameter bytes, joins, or why a
slice stays whole) and the analyses themselves, which the rewrite builds the chosen sub-slices
from (`ShardAnalysis.stages_of`) without analysing again.

Read in this order: `StageFigures`, `ShardOption`, `SliceShards`, `ShardAnalysis`, then
`analyze_shards`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mopar.errors import InternalError

if TYPE_CHECKING:
    from mopar.ir import LayerGraph
    from mopar.ir.sharding import Join, StageAnalysis
    from mopar.ir.subgraph import SliceLayers

__all__ = [
    "StageFigures",
    "ShardOption",
    "SliceShards",
    "ShardAnalysis",
    "analyze_shards",
    "sum_mb_per_s",
]

_MB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class StageFigures:
    """One fork-join stage of a slice run η ways, in numbers.

    Attributes:
        shard_param_bytes: bytes of parameters and buffers sub-slice k holds, per k.
        tail_param_bytes: bytes of parameters and buffers the stage's tail holds.
        region_flops: forward FLOPs of the region the η sub-slices share.
        tail_flops: forward FLOPs of the stage's tail (0 without one).
        joins: how each tensor the join makes whole is made of the parts.
    """

    shard_param_bytes: tuple[int, ...]
    tail_param_bytes: int
    region_flops: int
    tail_flops: int
    joins: tuple[Join, ...]


@dataclass(frozen=True, kw_only=True)
class ShardOption:
    """One slice at one η: its stages, or (none) why it cannot be sharded that way."""

    eta: int
    stages: tuple[StageFigures, ...] = ()
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class SliceShards:
    """What the planner knows of sharding one slice of the vertical cut.

    Attributes:
        name: the slice's name.
        flops: the slice's forward FLOPs, as its FX graph counts them.
        tensor_bytes: the bytes of each tensor the slice takes or gives.
        options: one per η from 2 to the cap, in order.
    """

    name: str
    flops: int
    tensor_bytes: Mapping[str, int]
    options: tuple[ShardOption, ...]


@dataclass(frozen=True, kw_only=True)
class ShardAnalysis:
    """The sharding figures of a vertical plan's slices, and the analyses behind them.

    Attributes:
        slices: the figures, per slice of the vertical cut, in plan order.
        sum_mb_per_s: the throughput of adding one float32 part into another on this
            machine, MB/s (what a join's aggregation costs).
        analyses: the stages of each (slice, η) that can be sharded.
    """

    slices: tuple[SliceShards, ...]
    sum_mb_per_s: float
    analyses: Mapping[tuple[str, int], tuple[StageAnalysis, ...]] = field(default_factory=dict)

    def stages_of(self, name: str, eta: int) -> tuple[StageAnalysis, ...]:
        """The analysed stages of slice ``name`` at ``eta``, as the plan chose them.

        Raises:
            InternalError: the plan shards a slice this analysis did not find shardable.
        """
        try:
            return self.analyses[(name, eta)]
        except KeyError:
            raise InternalError(
                f"slice {name} was planned {eta} ways, but the sharding analysis has no "
                f"such option (it has {sorted(self.analyses)}); report this"
            ) from None


def analyze_shards(lg: LayerGraph, vertical: Sequence[SliceLayers], max_eta: int) -> ShardAnalysis:
    """Analyse every slice of ``vertical`` (a plan's vertical cut) at each η in 2..``max_eta``."""
    from mopar.ir.sharding import Unshardable, analyze_stages
    from mopar.ir.subgraph import extract_slices, slice_flops

    figures, analyses = [], {}
    for sm in extract_slices(lg, vertical):
        options = []
        for eta in range(2, max_eta + 1):
            stages = analyze_stages(sm, eta)
            if isinstance(stages, Unshardable):
                options.append(ShardOption(eta=eta, reason=stages.reason))
                continue
            analyses[(sm.name, eta)] = stages
            options.append(ShardOption(eta=eta, stages=tuple(map(_figures, stages))))
        figures.append(
            SliceShards(
                name=sm.name,
                flops=slice_flops(sm),
                tensor_bytes={t.name: t.nbytes for t in (*sm.inputs, *sm.outputs)},
                options=tuple(options),
            )
        )
    return ShardAnalysis(slices=tuple(figures), sum_mb_per_s=sum_mb_per_s(), analyses=analyses)


def _figures(stage: StageAnalysis) -> StageFigures:
    return StageFigures(
        shard_param_bytes=stage.shard_param_bytes,
        tail_param_bytes=stage.tail_param_bytes,
        region_flops=stage.region_flops,
        tail_flops=stage.tail_flops,
        joins=stage.joins,
    )


def sum_mb_per_s() -> float:
    """Throughput of adding one float32 part into another, MB/s, measured here."""
    a = np.ones(1 << 20, dtype=np.float32)  # 4 MB
    b = np.ones_like(a)
    np.add(a, b, out=a)
    start = time.perf_counter()
    for _ in range(10):
        np.add(a, b, out=a)
    seconds = (time.perf_counter() - start) / 10
    return a.nbytes / _MB / max(seconds, 1e-9)

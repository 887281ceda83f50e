"""Horizontal partitioning: choose η, the number of parameter-sharded sub-slices, per slice.

Read in this order: `ShardEstimate` (the predicted figures of one slice at one η), `plan_parallel`
(the decision over a vertical plan), then `_estimate` (the model behind the figures).

A slice at η > 1 runs as η sub-slices side by side, each holding 1/η of the weights the sharding
rules can narrow (`mopar.ir.sharding`), and a join that aggregates their parts (sum, concat)
and runs the rest of the slice once. In the Plan this shows as η slices ``<s>.p<k>``
(kind ``shard``, no layers of their own) followed by ``<s>`` (kind ``join``, the slice's
layers). The latency model of a sharded slice:

    t(η) = hop + max_k t_shard + gather + aggregate + t_tail
    t_shard = t_slice x f / η x (CPU slow-down of the smaller function, below one vCPU)
    t_tail = t_slice x (1 - f)

with ``f`` the FLOP share of the sharded region, the gather priced on the cut's measured
transport and the aggregation at a numpy sum throughput measured on this machine. The FLOPs,
parameter bytes and joins of every slice at every η come measured from its FX graph
(`mopar.profile.shards.analyze_shards`): this module decides over those numbers only. The join
function waits for its sub-slices, so it is billed for the whole fork.

η > 1 is taken only where the rules apply, η <= M / λ where CPU follows memory (λ MB per vCPU:
a sub-slice below one vCPU gains no parallelism there), η <= the slice's own CPU share where CPU
is a resource of its own (η functions of a small share buy what one larger share would), and
the predicted latency improves by at least `MIN_GAIN`; ``force`` takes the largest applicable
η up to the cap instead (for testing and measurement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from mopar.plan import REQUEST, RESPONSE, Edge, Function, Plan, Remark, data_edges
from mopar.planner.cost import Platform, priced
from mopar.profile.shards import ShardAnalysis, ShardOption

__all__ = [
    "StageEstimate",
    "ShardEstimate",
    "plan_parallel",
    "stage_names",
    "MIN_GAIN",
    "part_name",
]

MIN_GAIN = 0.05
"""η > 1 must cut the slice's predicted latency by this fraction (the noise of the model)."""

_MB = 1024 * 1024


def part_name(tensor: str, k: int) -> str:
    """The name of sub-slice ``k``'s part of ``tensor`` (a valid frame and ONNX name)."""
    return f"{tensor}:p{k}"


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """Predicted figures of one fork-join stage of a sharded slice.

    Attributes:
        shard_ms, join_ms: billed time of each sub-slice, and of the join (its whole fork).
        shard_mb, join_mb: memory of each sub-slice's function, and of the join's.
        shard_param_bytes: parameter bytes each sub-slice holds.
        join_param_bytes: parameter bytes the join holds (the last stage's tail).
        transport: how the parts are handed over.
        joins: (tensor, bytes of one sub-slice's part of it, bytes of the whole) of each tensor
            the join makes whole.
    """

    shard_ms: float
    join_ms: float
    shard_mb: int
    join_mb: int
    shard_param_bytes: tuple[int, ...]
    join_param_bytes: int
    transport: str
    joins: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True, kw_only=True)
class ShardEstimate:
    """Predicted figures of one slice run η ways, as a chain of fork-join stages.

    Attributes:
        eta: the number of sub-slices per stage.
        stages: the fork-join stages (`mopar.profile.shards.StageFigures`), in order.
        latency_ms: the slice's latency, first fork to last join.
        cost_usd: the bill of one request over all sub-slices and joins.
    """

    eta: int
    stages: tuple[StageEstimate, ...]
    latency_ms: float
    cost_usd: float


def plan_parallel(
    plan: Plan,
    shards: ShardAnalysis,
    platform: Platform,
    *,
    max_eta: int,
    force: bool,
    weight_copies: float,
) -> Plan:
    """The plan with η chosen for each slice (sub-slices inserted where η > 1).

    Args:
        plan: a vertical plan (no sub-slices yet).
        shards: the sharding figures of its slices, in plan order
            (`mopar.profile.shards.analyze_shards`).
        platform: the target's facts.
        max_eta: the cap on η (``--parallel``).
        force: take the largest η a rule allows, up to the cap, whatever the prediction says.
        weight_copies: the memory rule's copies of the weights (``profiles/runtime.json``).
    """
    if max_eta < 2:
        return plan
    out: list[Function] = []
    chosen: dict[str, ShardEstimate] = {}
    notes: list[str] = []
    for sp, figures in zip(plan.functions, shards.slices, strict=True):
        best, why = None, []
        for option in figures.options[: max_eta - 1]:
            eta = option.eta
            if platform.mb_per_vcpu > 0 and not force and eta > sp.memory_mb / platform.mb_per_vcpu:
                why.append(f"η = {eta} exceeds M / λ = {sp.memory_mb / platform.mb_per_vcpu:.2f}")
                break
            if platform.cpu_grid and not force and eta > sp.vcpus:  # a larger share is cheaper
                why.append(f"η = {eta} exceeds the slice's {sp.vcpus:g} vCPUs")
                break
            if not option.stages:
                why.append(option.reason)
                continue
            est = _estimate(sp, figures.flops, option, platform, weight_copies, shards.sum_mb_per_s)
            if force or (
                est.latency_ms <= (1 - MIN_GAIN) * sp.time_ms
                and (best is None or est.latency_ms < best.latency_ms)
            ):
                best = est
        if best is None:
            out.append(sp)
            if why:
                notes.append(f"{sp.name}: η = 1 ({why[-1]})")
            elif not force:
                notes.append(
                    f"{sp.name}: η = 1 (no η up to {max_eta} is predicted {MIN_GAIN:.0%} faster)"
                )
            continue
        chosen[sp.name] = best
        out.extend(_units(sp, best, platform))
        held = sum(max(st.shard_param_bytes) for st in best.stages)
        notes.append(
            f"{sp.name}: η = {best.eta} in {len(best.stages)} fork-join stage(s), "
            f"predicted {best.latency_ms:.1f} ms vs {sp.time_ms:.1f} ms whole; each "
            f"sub-slice holds at most {_bytes(held)} of its {_bytes(sp.param_bytes)} "
            "of weights"
        )
    sizes = {t: n for figures in shards.slices for t, n in figures.tensor_bytes.items()}
    sharded = replace(
        plan,
        functions=tuple(out),
        edges=_edges(plan, chosen, sizes),
        notes=(*plan.notes, *map(Remark, notes)),
    )
    return priced(sharded, platform)


def stage_names(slice_name: str, stages: int, eta: int) -> list[tuple[list[str], str]]:
    """(sub-slice names, join name) of each stage: ``s1.0.p0`` .. ``s1.0``, ..., and the last
    join is the slice's own name; a one-stage slice: ``s1.p0`` .. ``s1``."""
    out = []
    for i in range(stages):
        prefix = slice_name if stages == 1 else f"{slice_name}.{i}"
        join = slice_name if i == stages - 1 else prefix
        out.append(([f"{prefix}.p{k}" for k in range(eta)], join))
    return out


def _units(sp: Function, est: ShardEstimate, platform: Platform) -> list[Function]:
    """The sub-slices and joins of ``sp`` at ``est``; the last join carries its layers."""

    def unit(name: str, kind: str, mb: int, ms: float, *, param_bytes: int, **more) -> Function:
        cpu = platform.cpu_of(mb, sp.vcpus)
        return Function(
            name=name,
            kind=kind,
            group=sp.name,
            artifact=f"functions/{name}/model.onnx",
            memory_mb=mb,
            time_ms=round(ms, 3),
            need_mb=float(mb),
            vcpus=round(cpu, 3),
            param_bytes=param_bytes,
            cost_per_1m_usd=_sig(platform.cost_usd(mb, ms, param_bytes, cpu) * 1e6),
            parallel=est.eta,
            **more,
        )

    units = []
    names = stage_names(sp.name, len(est.stages), est.eta)
    for i, (st, (shards, join)) in enumerate(zip(est.stages, names)):
        units += [
            unit(name, "shard", st.shard_mb, st.shard_ms, param_bytes=st.shard_param_bytes[k])
            for k, name in enumerate(shards)
        ]
        last = i == len(est.stages) - 1
        units.append(
            unit(
                join,
                "join",
                st.join_mb,
                st.join_ms,
                param_bytes=st.join_param_bytes,
                **({"layers": sp.layers, "flops": sp.flops} if last else {}),
            )
        )
    return units


def _edges(
    vertical: Plan, estimates: dict[str, ShardEstimate], sizes: dict[str, int]
) -> tuple[Edge, ...]:
    """The edges once the sharded slices (``estimates``, by slice) are in: a stage's sub-slices
    read what the slice (or the stage before) hands in and hand their parts to the stage's
    join; the last join hands on what the slice did. Tensors a tail reads besides the parts
    show once the rewrite has made the units (the compiler re-derives the edges from them)."""
    reads = {
        f.name: tuple(t for e in vertical.edges_in(f.name) for t in e.tensors)
        for f in vertical.functions
    }
    makes = {
        f.name: tuple(dict.fromkeys(t for e in vertical.edges_out(f.name) for t in e.tensors))
        for f in vertical.functions
    }
    transport = {f.name: vertical.handoff(f.name) for f in vertical.functions}
    transport[RESPONSE] = vertical.answer
    sizes = dict(sizes)
    io = []
    for f in vertical.functions:
        est = estimates.get(f.name)
        if est is None:
            io.append((f.name, reads[f.name], makes[f.name]))
            continue
        feed = reads[f.name]
        names = stage_names(f.name, len(est.stages), est.eta)
        for i, (st, (shards, join)) in enumerate(zip(est.stages, names)):
            parts: list[str] = []
            for k, shard in enumerate(shards):
                mine = tuple(part_name(t, k) for t, _, _ in st.joins)
                sizes.update((part_name(t, k), part) for t, part, _ in st.joins)
                io.append((shard, feed, mine))
                transport[shard] = st.transport
                parts += mine
            last = i == len(est.stages) - 1
            joined = makes[f.name] if last else tuple(t for t, _, _ in st.joins)
            sizes.update((t, whole) for t, _, whole in st.joins)
            io.append((join, tuple(parts), joined))
            if not last:
                transport[join] = est.stages[i + 1].transport
            feed = joined
    inputs = [t for e in vertical.edges_out(REQUEST) for t in e.tensors]
    outputs = [t for e in vertical.edges_in(RESPONSE) for t in e.tensors]
    return data_edges(
        io, model_inputs=inputs, model_outputs=outputs, nbytes=sizes, transport=transport
    )


def _estimate(
    sp: Function,
    flops: int,
    option: ShardOption,
    platform: Platform,
    copies: float,
    sum_mb_per_s: float,
) -> ShardEstimate:
    """The figures of ``sp`` (of ``flops`` forward FLOPs) run as ``option``'s stages."""
    total = flops or 1
    stages = option.stages
    eta = option.eta
    # memory: the slice's rule with the weights each function holds
    transient = max(sp.need_mb - platform.baseline_mb - copies * sp.param_bytes / _MB, 0.0)
    out, latency, cost = [], 0.0, 0.0
    for i, stage in enumerate(stages):
        # the stage's share of the slice's FLOPs: its region, counted in the graph it was cut
        # from (the slice, or the previous stage's tail), where every node has its shapes
        f = stage.region_flops / total
        joins = tuple(
            (
                j.name,
                int(np.prod(j.shape)) * 4 // (eta if j.kind == "concat" else 1),
                int(np.prod(j.shape)) * 4,
            )
            for j in stage.joins
        )
        part_bytes = sum(part for _, part, _ in joins)
        last = i == len(stages) - 1
        tail_params = stage.tail_param_bytes if last else 0
        shard_mb = platform.round_mb(
            platform.baseline_mb + copies * max(stage.shard_param_bytes) / _MB + transient
        )
        join_mb = platform.round_mb(
            platform.baseline_mb + copies * tail_params / _MB + transient + eta * part_bytes / _MB
        )
        whole, shard = platform.cpu_of(sp.memory_mb, sp.vcpus), platform.cpu_of(shard_mb, sp.vcpus)
        slow = min(whole, 1.0) / max(min(shard, 1.0), 1e-9)
        shard_ms = sp.time_ms * f / eta * max(slow, 1.0)
        transport, gather_ms = platform.handoff(part_bytes)
        aggregate_ms = (eta - 1) * part_bytes / _MB / sum_mb_per_s * 1e3
        tail_ms = sp.time_ms * stage.tail_flops / total if last else 0.0
        span = platform.hop_ms + shard_ms + gather_ms + aggregate_ms + tail_ms
        latency += span + (platform.hop_ms if i else 0.0)
        st = StageEstimate(
            shard_ms=platform.billed_ms(shard_ms),
            join_ms=platform.billed_ms(span),
            shard_mb=shard_mb,
            join_mb=join_mb,
            shard_param_bytes=stage.shard_param_bytes,
            join_param_bytes=tail_params,
            transport=transport,
            joins=joins,
        )
        cost += sum(
            platform.cost_usd(shard_mb, st.shard_ms, b) for b in stage.shard_param_bytes
        ) + platform.cost_usd(join_mb, st.join_ms, tail_params)
        out.append(st)
    return ShardEstimate(eta=eta, stages=tuple(out), latency_ms=latency, cost_usd=cost)


def _bytes(n: float) -> str:
    return f"{n / _MB:.1f} MB" if n >= 0.1 * _MB else f"{n / 1024:.1f} KB"


def _sig(x: float) -> float:
    return float(f"{x:.4g}") if x and math.isfinite(x) else x

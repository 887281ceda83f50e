"""Horizontal partitioning: choose η, the number of parameter-sharded sub-slices, per slice.

Read in this order: `ShardEstimate` (the predicted figures of one slice at one η), `plan_parallel`
(the decision over a vertical plan), then `_estimate` (the model behind the figures).

A slice at η > 1 runs as η sub-slices side by side, each holding 1/η of the weights the sharding
rules can narrow (`mopar.rewrite.shard`), and a join that aggregates their parts (sum, concat)
and runs the rest of the slice once. In the Plan this shows as η slices ``<s>.p<k>``
(``role="shard"``, no layers of their own) followed by ``<s>`` (``role="join"``, the slice's
layers). The latency model of a sharded slice:

    t(η) = hop + max_k t_shard + gather + aggregate + t_tail
    t_shard = t_slice x f / η x (CPU slow-down of the smaller function, below one vCPU)
    t_tail = t_slice x (1 - f)

with ``f`` the FLOP share of the sharded region, the gather priced on the cut's measured
transport and the aggregation at a numpy sum throughput measured on this machine when the pass
runs. The join function waits for its sub-slices, so it is billed for the whole fork.

η > 1 is taken only where the rules apply, η <= M / λ where CPU follows memory (λ MB per vCPU:
a sub-slice below one vCPU gains no parallelism there), and the predicted latency improves by at
least `MIN_GAIN`; ``force`` takes the largest applicable η up to the cap instead (for testing and
measurement).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mopar.partition.cost import Platform
from mopar.partition.plan import Plan, SlicePlan

__all__ = ["ShardEstimate", "plan_parallel", "MIN_GAIN", "part_name"]

MIN_GAIN = 0.05
"""η > 1 must cut the slice's predicted latency by this fraction (the noise of the model)."""

_MB = 1024 * 1024


def part_name(tensor: str, k: int) -> str:
    """The name of sub-slice ``k``'s part of ``tensor`` (a valid frame and ONNX name)."""
    return f"{tensor}:p{k}"


@dataclass(frozen=True, kw_only=True)
class ShardEstimate:
    """Predicted figures of one slice run η ways.

    Attributes:
        eta: the number of sub-slices.
        latency_ms: the slice's latency, fork to join.
        shard_ms, join_ms: billed time of each sub-slice, and of the join (the whole fork).
        shard_mb, join_mb: memory of each sub-slice's function, and of the join's.
        shard_param_bytes: parameter bytes each sub-slice holds.
        tail_param_bytes: parameter bytes the join holds.
        cost_usd: the bill of one request over the sub-slices and the join.
        part_bytes: bytes each sub-slice hands to the join.
        transport: how the parts are handed over.
    """

    eta: int
    latency_ms: float
    shard_ms: float
    join_ms: float
    shard_mb: int
    join_mb: int
    shard_param_bytes: tuple[int, ...]
    tail_param_bytes: int
    cost_usd: float
    part_bytes: int
    transport: str


def plan_parallel(plan: Plan, slices: tuple[Any, ...], platform: Platform, *, max_eta: int,
                  force: bool, weight_copies: float) -> Plan:
    """The plan with η chosen for each slice (sub-slices inserted where η > 1).

    Args:
        plan: a vertical plan (no sub-slices yet).
        slices: its slices as `mopar.rewrite.SliceModule`, in plan order.
        platform: the target's facts.
        max_eta: the cap on η (``--parallel``).
        force: take the largest η a rule allows, up to the cap, whatever the prediction says.
        weight_copies: the memory rule's copies of the weights (``profiles/runtime.json``).
    """
    from mopar.rewrite.shard import Unshardable, analyze_sharding, apply_sharding

    if max_eta < 2:
        return plan
    out: list[SlicePlan] = []
    notes: list[str] = []
    latency, cost = plan.latency_ms, plan.cost_per_1m_usd / 1e6
    for sp, sm in zip(plan.slices, slices, strict=True):
        best, why = None, []
        for eta in range(2, max_eta + 1):
            if platform.mb_per_vcpu > 0 and not force and eta > sp.memory_mb / platform.mb_per_vcpu:
                why.append(f"η = {eta} exceeds M / λ = {sp.memory_mb / platform.mb_per_vcpu:.2f}")
                break
            decision = analyze_sharding(sm, eta)
            if isinstance(decision, Unshardable):
                why.append(decision.reason)
                continue
            est = _estimate(sp, sm, apply_sharding(sm, decision), platform, weight_copies)
            if force or (est.latency_ms <= (1 - MIN_GAIN) * sp.time_ms
                         and (best is None or est.latency_ms < best.latency_ms)):
                best = est
        if best is None:
            out.append(sp)
            if why:
                notes.append(f"{sp.name}: η = 1 ({why[-1]})")
            elif not force:
                notes.append(f"{sp.name}: η = 1 (no η up to {max_eta} is predicted "
                             f"{MIN_GAIN:.0%} faster)")
            continue
        out.extend(_units(sp, best, platform))
        latency += best.latency_ms - sp.time_ms
        cost += best.cost_usd - platform.cost_usd(sp.memory_mb, sp.time_ms)
        notes.append(f"{sp.name}: η = {best.eta}, predicted {best.latency_ms:.1f} ms vs "
                     f"{sp.time_ms:.1f} ms whole, each sub-slice holding at most "
                     f"{_bytes(max(best.shard_param_bytes))} of its {_bytes(sp.param_bytes)} of "
                     "weights")
    mc = sum(s.memory_mb / 1024 * s.time_ms / 1e3 for s in out)
    return replace(plan, slices=tuple(out), latency_ms=round(latency, 3),
                   cost_per_1m_usd=_sig(cost * 1e6), mc_gb_s=_sig(mc),
                   notes=(*plan.notes, *notes))


def _units(sp: SlicePlan, est: ShardEstimate, platform: Platform) -> list[SlicePlan]:
    shards = [
        SlicePlan(name=f"{sp.name}.p{k}", layers=(), memory_mb=est.shard_mb,
                  param_bytes=est.shard_param_bytes[k], flops=0, in_bytes=sp.in_bytes,
                  out_bytes=est.part_bytes, time_ms=round(est.shard_ms, 3),
                  need_mb=float(est.shard_mb), vcpus=round(platform.cpu(est.shard_mb), 3),
                  transport=est.transport,
                  cost_per_1m_usd=_sig(platform.cost_usd(est.shard_mb, est.shard_ms) * 1e6),
                  parallel=est.eta, group=sp.name, role="shard")
        for k in range(est.eta)
    ]
    join = replace(sp, memory_mb=est.join_mb, param_bytes=est.tail_param_bytes,
                   time_ms=round(est.join_ms, 3), need_mb=float(est.join_mb),
                   vcpus=round(platform.cpu(est.join_mb), 3),
                   cost_per_1m_usd=_sig(platform.cost_usd(est.join_mb, est.join_ms) * 1e6),
                   parallel=est.eta, group=sp.name, role="join")
    return [*shards, join]


def _estimate(sp: SlicePlan, sm, sharded, platform: Platform, copies: float) -> ShardEstimate:
    from mopar.ir.flops import node_flops

    flops = {n.name: node_flops(n) for n in sm.gm.graph.nodes}
    total = sum(flops.values()) or 1
    f = sum(flops.get(r.node, 0) for r in sharded.decision.region) / total
    eta = sharded.eta
    part_bytes = sum(
        int(np.prod(j.shape)) * 4 // (eta if j.kind == "concat" else 1)
        for j in sharded.joins)
    # memory: the slice's rule with the weights each function holds
    transient = max(sp.need_mb - platform.baseline_mb - copies * sp.param_bytes / _MB, 0.0)
    shard_mb = platform.round_mb(platform.baseline_mb
                                 + copies * max(sharded.shard_param_bytes) / _MB + transient)
    join_mb = platform.round_mb(platform.baseline_mb + copies * sharded.tail_param_bytes / _MB
                                + transient + eta * part_bytes / _MB)
    slow = min(platform.cpu(sp.memory_mb), 1.0) / max(min(platform.cpu(shard_mb), 1.0), 1e-9)
    shard_ms = sp.time_ms * f / eta * max(slow, 1.0)
    transport, gather_ms = platform.handoff(part_bytes)
    aggregate_ms = (eta - 1) * part_bytes / _MB / _sum_mb_per_s() * 1e3
    tail_ms = sp.time_ms * (1 - f)
    latency = platform.hop_ms + shard_ms + gather_ms + aggregate_ms + tail_ms
    join_ms = platform.billed_ms(latency)
    cost = eta * platform.cost_usd(shard_mb, shard_ms) + platform.cost_usd(join_mb, join_ms)
    return ShardEstimate(
        eta=eta, latency_ms=latency, shard_ms=platform.billed_ms(shard_ms), join_ms=join_ms,
        shard_mb=shard_mb, join_mb=join_mb, shard_param_bytes=sharded.shard_param_bytes,
        tail_param_bytes=sharded.tail_param_bytes, cost_usd=cost, part_bytes=part_bytes,
        transport=transport)


@functools.cache
def _sum_mb_per_s() -> float:
    """Throughput of adding one float32 part into another, MB/s, measured here once."""
    a = np.ones(1 << 20, dtype=np.float32)  # 4 MB
    b = np.ones_like(a)
    np.add(a, b, out=a)
    start = time.perf_counter()
    for _ in range(10):
        np.add(a, b, out=a)
    seconds = (time.perf_counter() - start) / 10
    return a.nbytes / _MB / max(seconds, 1e-9)


def _bytes(n: float) -> str:
    return f"{n / _MB:.1f} MB" if n >= 0.1 * _MB else f"{n / 1024:.1f} KB"


def _sig(x: float) -> float:
    return float(f"{x:.4g}") if x and math.isfinite(x) else x

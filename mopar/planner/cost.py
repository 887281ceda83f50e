"""The cost model: what a slice costs and how long it takes on a target platform.

Read in this order: `Link` and `Platform` (frozen facts from `mopar.facts`, which the API
loads once from ``profiles/`` or a caller builds in code; re-exported here), then the three pure
functions the solvers call: `slice_time_ms` (the CPU-share time model),
`Platform.memory_options` (which memory sizes are worth considering for a slice) and
`Platform.cost_usd` (the bill); then `price_plan`, which prices a whole plan graph.

A plan's latency is its critical path: the functions on the request path one after another, a
hop before each but the first; a called function's time is inside its caller's, which waits for
it. Its cost sums every invocation, each function weighted by the share of requests that invoke
it (`Plan.invocation_probability`).

Time model. A slice's time at one full vCPU is ``t1``; ``par`` of it runs in parallel across
onnxruntime's threads (Amdahl, the share measured per op family by the profiler). With ``c``
vCPUs, ``t(c) = (t1 - par) / min(c, 1) + par / c``: below one vCPU everything slows down
in proportion (Lambda throttles the whole process), above one only the parallel share speeds up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from mopar.facts import Link, Platform
from mopar.plan import Plan

__all__ = [
    "Link",
    "Platform",
    "PlanPrice",
    "price_plan",
    "priced",
    "significant",
    "slice_time_ms",
]


def slice_time_ms(t1_ms, parallel_ms, vcpus):
    """Time of a slice with ``vcpus``, from its time at one vCPU and the parallel part of it
    (numbers or numpy arrays)."""
    serial = np.maximum(np.subtract(t1_ms, parallel_ms), 0.0)
    return serial / np.minimum(vcpus, 1.0) + np.divide(parallel_ms, vcpus)


@dataclass(frozen=True, kw_only=True)
class PlanPrice:
    """What `price_plan` finds: a request's latency (ms), cost (USD) and MC (GB-s)."""

    latency_ms: float
    cost_usd: float
    mc_gb_s: float


def price_plan(plan: Plan, platform: Platform) -> PlanPrice:
    """Price ``plan``'s graph on ``platform`` from its functions' memory and predicted times."""
    path = plan.path()
    latency = sum(f.time_ms for f in path) + platform.hop_ms * max(len(path) - 1, 0)
    cost = mc = 0.0
    for f in plan.functions:
        p = plan.invocation_probability(f.name)
        cost += p * platform.cost_usd(f.memory_mb, f.time_ms, f.param_bytes)
        mc += p * f.memory_mb / 1024 * f.time_ms / 1e3
    return PlanPrice(latency_ms=latency, cost_usd=cost, mc_gb_s=mc)


def priced(plan: Plan, platform: Platform) -> Plan:
    """``plan`` with its totals from `price_plan`."""
    price = price_plan(plan, platform)
    return replace(
        plan,
        latency_ms=round(price.latency_ms, 3),
        cost_per_1m_usd=significant(price.cost_usd * 1e6),
        mc_gb_s=significant(price.mc_gb_s),
    )


def significant(x: float) -> float:
    """``x`` to 6 significant digits (plans are read by people; a tiny model's cost is tiny)."""
    return float(f"{x:.6g}") if x and math.isfinite(x) else x

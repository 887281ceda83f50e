"""The cost model: what a slice costs and how long it takes on a target platform.

Read in this order: `Link` and `Platform` (frozen facts from `mopar.facts`, which the API
loads once from ``profiles/`` or a caller builds in code; re-exported here), then the three pure
functions the solvers call: `slice_time_ms` (the CPU-share time model),
`Platform.memory_options` (which memory sizes are worth considering for a slice) and
`Platform.cost_usd` (a slice's own bill, which the DP adds up); then `price_plan`, which
prices a whole plan graph in its chain mode under the platform's traffic through `mopar.bill`,
the one owner of billing rules.

A plan's latency is its critical path: the functions on the request path one after another, a
hop before each but the first (slower by the chain mode's own latency); a called function's time
is inside its caller's, which waits for it. Its cost is `mopar.bill.bill_plan`'s: every
invocation weighted by the share of requests that invoke it (`Plan.invocation_probability`),
with the waits the mode bills, cold starts, request fees, the mode's charges and idle replicas.

Time model. A slice's time at one full vCPU is ``t1``; ``par`` of it runs in parallel across
onnxruntime's threads (Amdahl, the share measured per op family by the profiler). With ``c``
vCPUs, ``t(c) = (t1 - par) / min(c, 1) + par / c``: below one vCPU everything slows down
in proportion (Lambda throttles the whole process), above one only the parallel share speeds up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from mopar.bill import PlanBill, bill_plan, cold_request
from mopar.facts import MB, Link, Platform
from mopar.plan import Plan
from mopar.plan.notes import BillIncludes, ChainMode, Note

__all__ = [
    "QUANTIZED_SHARE",
    "cold_latency_ms",
    "lighter_weights",
    "Link",
    "Platform",
    "PlanPrice",
    "price_plan",
    "priced",
    "held_s",
    "significant",
    "slice_time_ms",
]


def held_s(platform: Platform, busy_s, probability: float = 1.0):
    """What one request pays for, s, of a function it invokes with ``probability``, busy
    ``busy_s`` per invocation (numbers or numpy arrays): its share of the busy time, or, where
    replicas are reserved (OpenFaaS), the replica-seconds it holds, idle ones included: at least
    ``min_replicas`` spread over the traffic's requests, and its busy time over the autoscaler's
    target load (`mopar.bill.replicas_for` without its queueing, which a plan's bill prices)."""
    if not platform.reserved:
        return np.multiply(busy_s, probability)
    per = platform.target_load if platform.scale_every_s > 0 else max(platform.max_inflight, 1)
    return np.maximum(
        np.multiply(busy_s, probability) / per, platform.min_replicas / platform.traffic.rate_rps
    )


def slice_time_ms(t1_ms, parallel_ms, vcpus):
    """Time of a slice with ``vcpus``, from its time at one vCPU and the parallel part of it
    (numbers or numpy arrays)."""
    serial = np.maximum(np.subtract(t1_ms, parallel_ms), 0.0)
    return serial / np.minimum(vcpus, 1.0) + np.divide(parallel_ms, vcpus)


@dataclass(frozen=True, kw_only=True)
class PlanPrice:
    """What `price_plan` finds: a request's latency (ms), cost (USD) and MC (GB-s), and the
    bill it comes from (`mopar.bill.PlanBill`: what the cost includes)."""

    latency_ms: float
    cost_usd: float
    mc_gb_s: float
    bill: PlanBill


def price_plan(plan: Plan, platform: Platform, chain: str | None = None) -> PlanPrice:
    """Price ``plan``'s graph on ``platform`` from its functions' memory and predicted times, in
    ``chain`` (None: ``plan.chain``), under ``platform.traffic``: `mopar.bill.bill_plan`. MC
    is the paper's: each function's memory x its own time, weighted by the share of requests
    that invoke it."""
    bill = bill_plan(plan, platform, chain)
    mc = sum(
        plan.invocation_probability(f.name) * f.memory_mb / 1024 * f.time_ms / 1e3
        for f in plan.functions
    )
    return PlanPrice(latency_ms=bill.latency_ms, cost_usd=bill.usd, mc_gb_s=mc, bill=bill)


def cold_latency_ms(plan: Plan, platform: Platform, *, together: bool) -> float:
    """Latency with every function cold, ms: warm + the INITs the request waits for
    (`mopar.bill.cold_request`; ``together``: the entry warms up the rest at its own start, else
    each starts when the request reaches it)."""
    extra = cold_request(plan, platform, prewarm=together).extra_ms
    return price_plan(plan, platform).latency_ms + extra


def priced(plan: Plan, platform: Platform) -> Plan:
    """``plan`` with its totals from `price_plan`, and each function's cost per million of its
    own invocations as the bill has it (waits, INIT share and idle replicas included)."""
    price = price_plan(plan, platform)
    per_call = {f.name: f.usd / f.probability for f in price.bill.functions if f.probability > 0}
    cost = significant(price.cost_usd * 1e6)
    return replace(
        plan,
        notes=tuple(_repriced(n, plan.chain, cost, price) for n in plan.notes),
        functions=tuple(
            replace(f, cost_per_1m_usd=significant(per_call[f.name] * 1e6))
            if f.name in per_call
            else f
            for f in plan.functions
        ),
        latency_ms=round(price.latency_ms, 3),
        cost_per_1m_usd=cost,
        mc_gb_s=significant(price.mc_gb_s),
    )


def _repriced(note: Note, chain: str, cost: float, price: PlanPrice) -> Note:
    """A note that states the plan's bill, at the plan's bill now: its `BillIncludes`, and its
    own chain mode's entry in `ChainMode` (the other modes' best plans stay as priced)."""
    if isinstance(note, BillIncludes):
        return replace(note, cost_per_1m_usd=cost, includes=price.bill.includes())
    if isinstance(note, ChainMode):
        best = tuple(replace(b, cost_per_1m_usd=cost) if b.chain == chain else b for b in note.best)
        return replace(note, best=tuple(sorted(best, key=lambda b: b.cost_per_1m_usd)))
    return note


def significant(x: float) -> float:
    """``x`` to 6 significant digits (plans are read by people; a tiny model's cost is tiny)."""
    return float(f"{x:.6g}") if x and math.isfinite(x) else x


QUANTIZED_SHARE = {"int8": 0.25, "int4": 0.15}
"""What share of its float32 bytes a function's weights keep in each form, for estimates made
before anything is quantised (`lighter_weights`): int8 stores 1 byte per weight; int4 half a
byte on large MatMuls, plus scales, with the rest int8. Compile measures the real bytes."""


def lighter_weights(plan: Plan, platform: Platform, form: str) -> Plan:
    """``plan`` priced (`priced`) with every function's weights at `QUANTIZED_SHARE` of their
    bytes and its memory lowered by what that saves, at the predicted times: an estimate of
    what ``--quantize FORM`` would save, before the budget has been measured. A function whose
    memory was raised for CPU keeps it."""
    share = QUANTIZED_SHARE[form]

    def lighter(f):
        saved = f.param_bytes * (1 - share)
        fitted = f.memory_mb <= platform.round_mb(f.need_mb)
        need = max(f.need_mb - saved / MB, 1.0)
        return replace(
            f,
            need_mb=need,
            memory_mb=platform.round_mb(need) if fitted else f.memory_mb,
            param_bytes=int(f.param_bytes - saved),
        )

    return priced(replace(plan, functions=tuple(lighter(f) for f in plan.functions)), platform)

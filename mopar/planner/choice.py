"""Choosing among priced plans: the cheapest within a latency bound, the cost/latency frontier,
and the rule that mopar's plan is never dearer than a strategy it is compared with.

Read in this order: `cheapest`, `pareto_front`, `never_dearer`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from mopar.plan import Plan, Remark
from mopar.planner.solve import COST_TOLERANCE

__all__ = [
    "ROUNDED_MS",
    "cheapest",
    "fits",
    "ms_or_none",
    "never_dearer",
    "pareto_front",
    "plan_shape",
]


def ms_or_none(bound: float) -> float | None:
    return None if math.isinf(bound) else round(bound, 3)


ROUNDED_MS = 5e-4
"""A plan's latency is rounded to the microsecond (`priced`): within this of a bound is within it."""


def cheapest(plans: Sequence[Plan], bound_ms: float = math.inf) -> Plan | None:
    """The cheapest of ``plans`` within ``bound_ms`` (costs within `COST_TOLERANCE` tie, and
    the faster, then the one with fewer functions, wins); None when none is within it."""
    ok = [p for p in plans if p.latency_ms <= bound_ms * (1 + 1e-9) + ROUNDED_MS]
    if not ok:
        return None
    cheapest = min(p.cost_per_1m_usd for p in ok)
    near = [p for p in ok if p.cost_per_1m_usd <= cheapest * (1 + COST_TOLERANCE)]
    return min(near, key=lambda p: (p.latency_ms, len(p.functions)))


def pareto_front(plans: Sequence[Plan]) -> list[Plan]:
    """The plans no other beats on both cost and latency, fastest first."""
    front: list[Plan] = []
    for p in sorted(plans, key=lambda p: (p.latency_ms, p.cost_per_1m_usd)):
        if not front or p.cost_per_1m_usd < front[-1].cost_per_1m_usd:
            front.append(p)
    return front


def plan_shape(plan: Plan) -> tuple:
    """What tells two plans apart in the notes: their chain mode and their slices' layers."""
    return plan.chain, tuple(f.layers for f in plan.vertical())


def never_dearer(plans: dict[str, Plan], bound_ms: float, *, slices: int | None) -> dict[str, Plan]:
    """``plans`` with mopar's replaced by another strategy's where that one fits, has the
    ``slices`` asked for, and is cheaper within ``bound_ms``: the default is never dearer than
    a row it is compared with."""
    mopar = plans.get("mopar")
    if mopar is None:
        return plans
    rivals = [
        p
        for p in plans.values()
        if p is not mopar and fits(p) and slices in (None, len(p.vertical()))
    ]
    rival = cheapest(rivals, bound_ms)
    if rival is None or rival.cost_per_1m_usd >= mopar.cost_per_1m_usd * (1 - COST_TOLERANCE):
        return plans
    taken = replace(
        rival,
        strategy="mopar",
        frontier=mopar.frontier,
        notes=(
            Remark(
                f"{rival.strategy}'s plan is cheaper within the bound than the frontier's best "
                f"(${rival.cost_per_1m_usd:.4g} against ${mopar.cost_per_1m_usd:.4g} per 1M "
                "requests): taken"
            ),
            *rival.notes,
        ),
    )
    return {**plans, "mopar": taken}


def fits(plan: Plan) -> bool:
    """Whether every function of ``plan`` has the memory mopar's rule says it needs."""
    return all(f.memory_mb >= f.need_mb - 0.5 for f in plan.functions)

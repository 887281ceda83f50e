"""After export: make sure every slice's function holds what the slice measurably uses.

`mopar compile` serves the reference input through the real slice processes and records each
one's peak RSS. `cover_peaks` sizes a function from its peak times (1 + margin): where CPU is
reserved apart from memory (OpenFaaS, Kubernetes) it raises or lowers the plan's prediction to
that size; where CPU follows memory (Lambda) it only raises it, since the plan may have bought
memory for CPU. Each function and the plan are priced again at their new sizes.
"""

from __future__ import annotations

from dataclasses import replace

from mopar.plan import Plan
from mopar.planner.cost import Platform, priced

__all__ = ["cover_peaks"]


def cover_peaks(
    plan: Plan, peaks_mb: dict[str, float], *, margin: float, platform: Platform
) -> Plan:
    """``plan`` with each function at its measured peak RSS (MB) x (1 + ``margin``): raised or
    lowered where CPU does not follow memory, only raised where it does."""
    lowers = platform.mb_per_vcpu <= 0
    functions, raised, lowered = [], [], []
    for s in plan.functions:
        need = platform.round_mb(peaks_mb[s.name] * (1 + margin))
        if need > s.memory_mb or (lowers and need < s.memory_mb):
            (raised if need > s.memory_mb else lowered).append(
                f"{s.name} {s.memory_mb} -> {need} MB"
            )
            cost = platform.cost_usd(need, s.time_ms, s.param_bytes) * 1e6
            s = replace(
                s,
                memory_mb=need,
                vcpus=round(platform.cpu(need), 3),
                cost_per_1m_usd=float(f"{cost:.6g}"),
            )
        functions.append(s)
    if not raised and not lowered:
        return plan
    notes = [
        f"measured peak RSS x {1 + margin:g} {what}: {', '.join(changes)}"
        for what, changes in (
            ("exceeded the prediction, memory raised", raised),
            ("is below the prediction, memory lowered", lowered),
        )
        if changes
    ]
    return priced(replace(plan, functions=tuple(functions), notes=(*plan.notes, *notes)), platform)

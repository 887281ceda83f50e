"""After export: make sure every slice's function holds what the slice measurably uses.

`mopar compile` serves the reference input through the real slice processes and records each
one's peak RSS. `cover_peaks` raises a slice's memory to its peak times (1 + margin) where the
plan's prediction fell short, and never lowers it: the plan may have bought memory for CPU.
"""

from __future__ import annotations

from dataclasses import replace

from mopar.planner.cost import Platform
from mopar.plan import Plan

__all__ = ["cover_peaks"]


def cover_peaks(plan: Plan, peaks_mb: dict[str, float], *, margin: float, platform: Platform) -> Plan:
    """``plan`` with each function at least its measured peak RSS (MB) x (1 + ``margin``)."""
    functions, raised = [], []
    for s in plan.functions:
        need = platform.round_mb(peaks_mb[s.name] * (1 + margin))
        if need > s.memory_mb:
            raised.append(f"{s.name} {s.memory_mb} -> {need} MB")
            s = replace(s, memory_mb=need, vcpus=round(platform.cpu(need), 3))
        functions.append(s)
    if not raised:
        return plan
    note = (f"measured peak RSS x {1 + margin:g} exceeded the prediction, memory raised: "
            + ", ".join(raised))
    return replace(plan, functions=tuple(functions), notes=(*plan.notes, note))

"""After export: make sure every slice's function holds what the slice measurably uses.

`mopar compile` serves the reference input through the real slice processes and records each
one's peak RSS. `cover_peaks` sizes a function from its peak times (1 + margin):

- where CPU is reserved apart from memory (OpenFaaS, Kubernetes) it raises or lowers the
  plan's prediction to that size;
- where CPU follows memory (Lambda) it raises it where the peak needs more, and otherwise
  lowers it to the measured need unless the CPU-share model finds a larger size cheaper, or
  the slower function would break the plan's latency bound (a function whose time the planner
  does not know per vCPU, ``compute`` lacking it, is only raised).

Each function and the plan are priced again at their new sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from mopar.errors import Option, PartitionInfeasibleError
from mopar.plan import Function, Plan, Remark
from mopar.planner.cost import Platform, priced, slice_time_ms

__all__ = ["cover_peaks"]


def cover_peaks(
    plan: Plan,
    peaks_mb: Mapping[str, float],
    *,
    margin: float,
    platform: Platform,
    compute: Mapping[str, tuple[float, float]] | None = None,
) -> Plan:
    """``plan`` with each function at its measured peak RSS (MB) x (1 + ``margin``).

    Args:
        compute: a function's predicted compute at one vCPU and the part of it that runs in
            parallel, ms (``t1``, ``par``: `mopar.planner.cost.slice_time_ms`), where CPU
            follows memory and a smaller size would make it slower.
    """
    follows = platform.mb_per_vcpu > 0
    functions = []
    changes: dict[str, dict[str, str]] = {  # each function's change, by what it was
        k: {} for k in ("raised", "lowered", "cpu", "bound", "cap")
    }
    for f in plan.functions:
        need = platform.round_mb(peaks_mb[f.name] * (1 + margin))
        if need > platform.max_mb:
            if peaks_mb[f.name] > platform.max_mb:
                raise PartitionInfeasibleError(
                    (
                        f"function {f.name} ({_layers(f)}) measured a peak of "
                        f"{peaks_mb[f.name]:.0f} MB, over the largest function allowed "
                        f"({platform.max_mb} MB)",
                    ),
                    "raise ",
                    Option("max_memory_mb"),
                    f" to at least {need}",
                )
            changes["cap"][f.name] = f"{f.name} {peaks_mb[f.name]:.0f} MB"
            need = platform.max_mb  # the peak fits; the margin is what the cap leaves
        if need > f.memory_mb:
            changes["raised"][f.name] = f"{f.name} {f.memory_mb} -> {need} MB"
            f = _at(f, need, f.time_ms, platform)
        elif need < f.memory_mb and not follows:
            changes["lowered"][f.name] = f"{f.name} {f.memory_mb} -> {need} MB"
            f = _at(f, need, f.time_ms, platform)
        elif need < f.memory_mb and compute and f.name in compute:
            size, ms = _cheapest(f, need, compute[f.name], platform)
            if size < f.memory_mb:
                changes["lowered"][f.name] = f"{f.name} {f.memory_mb} -> {size} MB"
            else:
                changes["cpu"][f.name] = f"{f.name} {f.memory_mb} MB (measured need {need} MB)"
            f = _at(f, size, ms, platform)
        functions.append(f)
    resized = replace(plan, functions=tuple(functions))
    if plan.bound_ms is not None and changes["lowered"] and follows:
        resized = _within_bound(plan, resized, platform, changes)
    if not any(changes.values()):
        return plan
    what = {
        "raised": "exceeded the prediction, memory raised",
        "lowered": "is below the prediction, memory lowered",
        "cpu": "is below the prediction, memory kept: the CPU-share model prices the "
        "planned size lower",
        "bound": "is below the prediction, memory kept: lower, the plan would break its "
        "latency bound",
        "cap": "is over the largest function allowed, memory at that cap (a smaller margin "
        "over the peak)",
    }
    notes = [
        Remark(f"measured peak RSS x {1 + margin:g} {what[k]}: {', '.join(v.values())}")
        for k, v in changes.items()
        if v
    ]
    return priced(replace(resized, notes=(*plan.notes, *notes)), platform)


def _layers(f: Function) -> str:
    if not f.layers:
        return f"a {f.kind} function"
    return f"layer {f.layers[0]}" if len(f.layers) == 1 else f"layers {f.layers[0]}..{f.layers[-1]}"


def _at(f: Function, memory_mb: int, time_ms: float, platform: Platform) -> Function:
    """``f`` at ``memory_mb`` and ``time_ms``, at the CPU it gets there (`Platform.cpu_of`)."""
    vcpus = round(platform.cpu_of(memory_mb, f.vcpus), 3)
    cost = platform.cost_usd(memory_mb, time_ms, f.param_bytes, vcpus) * 1e6
    return replace(
        f,
        memory_mb=memory_mb,
        vcpus=vcpus,
        time_ms=round(time_ms, 3),
        cost_per_1m_usd=float(f"{cost:.6g}"),
    )


def _cheapest(
    f: Function, need: int, compute: tuple[float, float], platform: Platform
) -> tuple[int, float]:
    """The cheapest size from ``need`` up to ``f``'s own where CPU follows memory, and the
    time there: ``f``'s time less its compute at its size, plus the compute at the new one (a
    tie keeps the larger, faster size)."""
    t1, par = compute
    waits = max(f.time_ms - float(slice_time_ms(t1, par, platform.cpu(f.memory_mb))), 0.0)
    best = (f.memory_mb, f.time_ms)
    best_usd = platform.cost_usd(f.memory_mb, f.time_ms, f.param_bytes)
    for size in platform.memory_options(need):
        if size >= f.memory_mb:
            break
        ms = waits + float(slice_time_ms(t1, par, platform.cpu(size)))
        usd = platform.cost_usd(size, ms, f.param_bytes)
        if usd < best_usd * (1 - 1e-9):
            best, best_usd = (size, ms), usd
    return best


def _within_bound(
    plan: Plan, resized: Plan, platform: Platform, changes: dict[str, dict[str, str]]
) -> Plan:
    """``resized`` with lowered functions put back to their planned size, the most slowed
    first, until its latency is within ``plan``'s bound again (or none is left)."""
    before = {f.name: f for f in plan.functions}
    lowered = sorted(
        (f for f in resized.functions if f.memory_mb < before[f.name].memory_mb),
        key=lambda f: before[f.name].time_ms - f.time_ms,
    )
    while lowered and priced(resized, platform).latency_ms > plan.bound_ms:
        back = before[lowered.pop(0).name]
        resized = replace(
            resized, functions=tuple(back if g.name == back.name else g for g in resized.functions)
        )
        changes["lowered"].pop(back.name, None)
        changes["bound"][back.name] = f"{back.name} {back.memory_mb} MB"
    return resized

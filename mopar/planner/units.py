"""The units the cut DP solves over: the layer graph's edges as `simplify` takes them, the
groups simplification leaves, and at most `MAX_UNITS` of their boundaries as cut points.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mopar.ir import INPUT, OUTPUT, LayerGraph
from mopar.planner.problem import Problem
from mopar.planner.simplify import simplify

__all__ = ["MAX_UNITS", "candidates", "layer_cuts", "layer_edges", "units_of"]

MAX_UNITS = 120
"""Units the DP solves over at most; larger graphs keep only this many candidate cut points
(see `candidates`). The DP's work grows with the square of the units."""


def layer_edges(lg: LayerGraph) -> list:
    """The layer DAG as `simplify` takes it: (producer, consumer, tensors), -1 and n for the
    model's inputs and outputs."""
    n = len(lg)
    index = {layer.name: k for k, layer in enumerate(lg.layers)}
    return [
        (
            -1 if u == INPUT else index[u],
            n if v == OUTPUT else index[v],
            frozenset((t.name, t.nbytes) for t in tensors),
        )
        for u, v, tensors in lg.graph.edges(data="tensors")
    ]


def units_of(
    problem: Problem, edges: Sequence, *, threshold: float, slices: int | None
) -> tuple[Problem, tuple[str, ...]]:
    """The problem the DP solves: ``problem`` over simplified groups, at most `MAX_UNITS` of
    them; over layers when ``slices`` asks for more slices than there are groups."""
    n = len(problem)
    memory = [w + t for w, t in zip(problem.weight_mb, problem.transient_mb)]
    merged = simplify(n, memory, edges, threshold=threshold)
    if slices and slices > len(merged.groups):
        return problem, (
            f"--slices {slices} exceeds the {len(merged.groups)} groups "
            "simplification leaves: planned over layers",
        )
    starts = [lo for lo, _ in merged.groups[1:]]
    notes = (f"simplification merged {n} layers into {len(merged.groups)} groups",)
    if len(starts) + 1 > MAX_UNITS:
        starts = candidates(problem, starts, MAX_UNITS)
        notes += (
            f"the DP considered {len(starts)} of {len(merged.groups) - 1} cut points "
            "(the cheapest to cut in stretches of equal predicted time, then the cheapest)",
        )
    return problem.restrict(starts), notes


def layer_cuts(units: Problem, unit_cuts: Sequence[int]) -> tuple[int, ...]:
    return tuple(units.spans[c][0] for c in unit_cuts)


def candidates(problem: Problem, starts: Sequence[int], keep: int) -> list[int]:
    """``keep - 1`` of the group boundaries ``starts``: the cheapest to cut (fewest live bytes)
    in each of ``keep`` stretches of equal predicted time, then the cheapest of the rest."""
    total = sum(problem.t1_ms) or 1.0
    elapsed = [0.0, *itertools.accumulate(problem.t1_ms)]
    windows: dict[int, int] = {}
    for s in starts:
        w = min(int(elapsed[s] / total * keep), keep - 1)
        if w not in windows or problem.cut_bytes[s] < problem.cut_bytes[windows[w]]:
            windows[w] = s
    chosen = set(windows.values())
    rest = sorted((s for s in starts if s not in chosen), key=lambda s: problem.cut_bytes[s])
    chosen.update(rest[: max(keep - 1 - len(chosen), 0)])
    return sorted(chosen)[: keep - 1]

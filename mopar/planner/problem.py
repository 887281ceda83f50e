"""The numbers a solver sees: units in order, what each costs, and what crosses each boundary.

A `Problem` is built once per model (`build_problem`) from the layer graph and the profiler's
predictions. Its units are layers, or groups of layers after simplification; a slice is a
contiguous run of units ``[i, j)``. `Problem.slice_need_mb` is the memory rule the planner sizes
functions with:

    need = runtime baseline + weight_copies * sum(weights) + max(transient) + bytes in + bytes out

Weights of every layer stay resident for as long as the function lives, mapped from their file
once (``weight_copies``, 1: ``profiles/runtime.json``). Each layer's transient memory is its
predicted footprint beyond that, and layers run one after another, so only the largest counts;
the memory predictor's footprint holds 2 x a layer's weights, so the transient includes one more
copy of them: what pre-packing holds of the largest layer while it loads. The last unit's
transient is at least what encoding the model's answer as JSON costs (``answer_copies`` x the
answer's bytes): the function that answers does that after its layers have run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mopar.errors import InternalError
from mopar.ir import INPUT, OUTPUT, LayerGraph

__all__ = ["Problem", "build_problem", "cut_bytes", "one_vcpu", "MB"]

MB = float(1 << 20)


@dataclass(frozen=True, kw_only=True)
class Problem:
    """A partition problem over ``n`` units in topological order.

    Attributes:
        names: unit names (a group is named after its first layer).
        spans: the layer range ``[lo, hi)`` each unit covers.
        weight_mb: resident parameter memory of each unit, MB (already x weight copies).
        transient_mb: each unit's largest predicted memory beyond its weights, MB (margin included).
        t1_ms: each unit's predicted time at one vCPU, ms.
        par_ms: the part of ``t1_ms`` that runs in parallel across threads, ms.
        param_bytes: raw parameter bytes of each unit (reported, not costed).
        cut_bytes: ``n + 1`` entries: bytes live across the boundary before unit k (k = 0: the
            model's inputs, k = n: its outputs).
        baseline_mb: memory every function pays before loading its slice, MB.
        threads: the thread count the predicted times were measured at.
    """

    names: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    weight_mb: tuple[float, ...]
    transient_mb: tuple[float, ...]
    t1_ms: tuple[float, ...]
    par_ms: tuple[float, ...]
    param_bytes: tuple[int, ...]
    cut_bytes: tuple[int, ...]
    baseline_mb: float
    threads: float = 1.0

    def __len__(self) -> int:
        return len(self.names)

    def slice_need_mb(self, i: int, j: int) -> float:
        """Memory the slice of units ``[i, j)`` needs, MB.

        Raises:
            InternalError: an empty slice (``i >= j``): no plan makes one.
        """
        if i >= j:
            raise InternalError(
                f"slice_need_mb({i}, {j}) asked for an empty slice of {len(self)} units; report this"
            )
        return (
            self.baseline_mb
            + sum(self.weight_mb[i:j])
            + max(self.transient_mb[i:j])
            + (self.cut_bytes[i] + self.cut_bytes[j]) / MB
        )

    def slice_t1_ms(self, i: int, j: int) -> tuple[float, float]:
        """(time at one vCPU, its parallel part) of units ``[i, j)``, ms."""
        return sum(self.t1_ms[i:j]), sum(self.par_ms[i:j])

    def restrict(self, cuts: Sequence[int]) -> Problem:
        """The problem whose units are the runs between ``cuts`` (sorted unit indices)."""
        bounds = list(zip((0, *cuts), (*cuts, len(self))))
        return Problem(
            names=tuple(self.names[lo] for lo, _ in bounds),
            spans=tuple((self.spans[lo][0], self.spans[hi - 1][1]) for lo, hi in bounds),
            weight_mb=tuple(sum(self.weight_mb[lo:hi]) for lo, hi in bounds),
            transient_mb=tuple(max(self.transient_mb[lo:hi]) for lo, hi in bounds),
            t1_ms=tuple(sum(self.t1_ms[lo:hi]) for lo, hi in bounds),
            par_ms=tuple(sum(self.par_ms[lo:hi]) for lo, hi in bounds),
            param_bytes=tuple(sum(self.param_bytes[lo:hi]) for lo, hi in bounds),
            cut_bytes=(self.cut_bytes[0], *(self.cut_bytes[c] for c in cuts), self.cut_bytes[-1]),
            baseline_mb=self.baseline_mb,
            threads=self.threads,
        )


def cut_bytes(lg: LayerGraph) -> tuple[int, ...]:
    """Bytes of the distinct tensors live across each layer boundary (``len(lg) + 1`` entries).

    A tensor is live across boundary k when a layer before k (or the model input) makes it and a
    layer at or after k (or the model output) reads it: skip connections are paid at every
    boundary they span.
    """
    n = len(lg)
    index = {layer.name: k for k, layer in enumerate(lg.layers)}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    size: dict[str, int] = {}
    for u, v, tensors in lg.graph.edges(data="tensors"):
        src = -1 if u == INPUT else index[u]
        dst = n if v == OUTPUT else index[v]
        for t in tensors:
            size[t.name] = t.nbytes
            first[t.name] = min(first.get(t.name, src), src)
            last[t.name] = max(last.get(t.name, dst), dst)
    delta = np.zeros(n + 2, dtype=np.int64)
    for name, nbytes in size.items():
        # live at boundaries first+1 .. last (boundary k sits before layer k)
        delta[first[name] + 1] += nbytes
        delta[last[name] + 1] -= nbytes
    return tuple(int(v) for v in np.cumsum(delta)[: n + 1])


def one_vcpu(time_ms: float, parallel: float, threads: float) -> tuple[float, float]:
    """A time predicted at ``threads`` threads, back at one vCPU, and the part of it that runs
    in parallel (Amdahl, with the ``parallel`` share), ms."""
    p = min(max(float(parallel), 0.0), 1.0)
    one = float(time_ms) * ((1.0 - p) + p / max(threads, 1.0)) ** -1
    return one, one * p


def build_problem(
    lg: LayerGraph,
    *,
    memory_mb: Sequence[float],
    time_ms: Sequence[float],
    parallel: Sequence[float],
    threads: float,
    weight_copies: float,
    baseline_mb: float,
    answer_copies: float = 1.0,
) -> Problem:
    """The layer-level problem from the profiler's per-layer predictions.

    Args:
        memory_mb: each layer's planned footprint beyond the runtime baseline, MB.
        time_ms: each layer's predicted time at ``threads`` threads, ms.
        parallel: each layer's parallel fraction (Amdahl) in [0, 1].
        threads: the thread count ``time_ms`` was measured at.
        weight_copies: how many times its size a resident weight costs (profiles/runtime.json).
        baseline_mb: the runtime's own memory, MB.
        answer_copies: what encoding the answer costs, in units of its bytes (runtime.json).
    """
    weights = [weight_copies * layer.param_bytes / MB for layer in lg.layers]
    t1, par = [], []
    for t, p in zip(time_ms, parallel):
        one, parallel_ms = one_vcpu(t, p, threads)
        t1.append(one)
        par.append(parallel_ms)
    cuts = cut_bytes(lg)
    transient = [max(float(m) - w, 0.0) for m, w in zip(memory_mb, weights)]
    if transient:
        transient[-1] = max(transient[-1], answer_copies * cuts[-1] / MB)
    return Problem(
        names=tuple(layer.name for layer in lg.layers),
        spans=tuple((k, k + 1) for k in range(len(lg))),
        weight_mb=tuple(weights),
        transient_mb=tuple(transient),
        t1_ms=tuple(t1),
        par_ms=tuple(par),
        param_bytes=tuple(layer.param_bytes for layer in lg.layers),
        cut_bytes=cuts,
        baseline_mb=baseline_mb,
        threads=threads,
    )

"""Exact vertical partitioning: a DP over split points that keeps the cost/latency frontier.

Read in this order: `SliceModel` (what a slice ``[i, j)`` of a `Problem` costs and how long it
takes, for every memory size worth trying: mopar's CPU-aware model and the paper's Eq. 6), then
`pareto_dp` (the solver), then `choose` (pick from the frontier under a latency bound).

A plan's latency is the sum of its slices' billed times (compute, plus reading the cut it
receives) and one hop per extra slice; its cost is the sum of its slices' bills. Both only grow
as slices are appended, so a label (cost, latency) at position j that another label beats on
both can never become part of a better plan: keeping the Pareto set of labels at every position
makes the DP exact. Labels over the latency bound are dropped as soon as they appear. When a
Pareto set grows beyond ``label_cap`` it is thinned evenly along latency and the result is
marked inexact (docs/partition.md says how often).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mopar.errors import Option, PartitionInfeasibleError
from mopar.planner.cost import Platform, held_s, slice_time_ms
from mopar.planner.problem import MB, Problem

__all__ = [
    "SliceModel",
    "Label",
    "Solution",
    "pareto_dp",
    "pareto_dp_waiting",
    "choose",
    "price",
    "COST_TOLERANCE",
]


@dataclass(frozen=True, kw_only=True)
class SliceModel:
    """Prices slices of a problem on a platform.

    Attributes:
        problem: the units.
        platform: the target's facts.
        paper: price as the paper's Eq. 6 does (memory = the largest unit, no runtime baseline,
            time at the measured threads whatever the memory, handoff billed at that memory),
            instead of mopar's model (the `Problem.slice_need_mb` rule, CPU share).
        min_memory: give every slice the smallest size that holds it, never more for CPU (the
            "minimum memory sizing" ablation).
    """

    problem: Problem
    platform: Platform
    paper: bool = False
    min_memory: bool = False

    def __post_init__(self) -> None:
        p = self.problem
        object.__setattr__(self, "_w", np.concatenate([[0.0], np.cumsum(p.weight_mb)]))
        object.__setattr__(self, "_t1", np.concatenate([[0.0], np.cumsum(p.t1_ms)]))
        object.__setattr__(self, "_par", np.concatenate([[0.0], np.cumsum(p.par_ms)]))
        object.__setattr__(
            self, "_pb", np.concatenate([[0.0], np.cumsum(p.param_bytes, dtype=float)])
        )
        # each cut's handoff, received by the slice after it; the answer's, the last slice's
        *cuts, answer = p.cut_bytes
        hand = [self.platform.handoff(b) if k else ("", 0.0) for k, b in enumerate(cuts)]
        hand.append(self.platform.answer(answer))
        object.__setattr__(self, "transports", tuple(h[0] for h in hand))
        object.__setattr__(self, "_hand", np.array([h[1] for h in hand]))

    def options(self, j: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """For every slice ``[i, j)``, ``i < j``: one (memory MB, vCPUs, billed ms, cost USD)
        quadruple of arrays over i per size option; entries that are not an option are NaN."""
        p, plat = self.problem, self.platform
        t1 = self._t1[j] - self._t1[:j]
        par = self._par[j] - self._par[:j]
        hand = self._hand[:j] + (self._hand[j] if j == len(p) else 0.0)
        if self.paper:
            need = _suffix_max(np.asarray(p.weight_mb[:j]) + np.asarray(p.transient_mb[:j]))
            billed = slice_time_ms(t1, par, p.threads) + hand
            cost = need / 1024.0 * billed / 1e3 * plat.usd_per_gb_s + plat.usd_per_request
            mem = _round(need, plat)
            return [_masked(mem, _cpu(mem, plat), billed, cost, mem <= plat.max_mb)]
        cuts = np.asarray(p.cut_bytes, dtype=float)
        need = (
            p.baseline_mb
            + (self._w[j] - self._w[:j])
            + _suffix_max(np.asarray(p.transient_mb[:j]))
            + (cuts[:j] + cuts[j]) / MB
        )
        low = _round(need, plat)
        init = plat.init_share_ms(self._pb[j] - self._pb[:j])
        if plat.cpu_grid:
            sizes = [(low, np.full(j, c), low <= plat.max_mb) for c in plat.cpu_grid]
        else:
            steps = () if self.min_memory else plat.cpu_steps()
            sizes = [(low, _cpu(low, plat), low <= plat.max_mb)]
            for step in steps:
                mem = np.full(j, float(step))
                sizes.append((mem, _cpu(mem, plat), mem > low))
        out = []
        for mem, vcpus, valid in sizes:
            billed = slice_time_ms(t1, par, vcpus) + hand
            per_s = mem / 1024.0 * plat.usd_per_gb_s + vcpus * plat.usd_per_vcpu_s
            held = held_s(plat, (_bill(billed, plat) + init) / 1e3)
            out.append(_masked(mem, vcpus, billed, per_s * held + plat.usd_per_request, valid))
        return out

    def slice(self, i: int, j: int, memory_mb: float, vcpus: float) -> tuple[float, float]:
        """(billed ms, cost USD) of ``[i, j)`` at ``memory_mb`` and ``vcpus``: the scalar twin
        of `options`."""
        p, plat = self.problem, self.platform
        t1, par = p.slice_t1_ms(i, j)
        hand = float(self._hand[i] + (self._hand[j] if j == len(p) else 0.0))
        if self.paper:
            need = max(w + t for w, t in zip(p.weight_mb[i:j], p.transient_mb[i:j]))
            billed = float(slice_time_ms(t1, par, p.threads)) + hand
            return billed, need / 1024.0 * billed / 1e3 * plat.usd_per_gb_s + plat.usd_per_request
        billed = float(slice_time_ms(t1, par, vcpus)) + hand
        busy_s = (plat.billed_ms(billed) + plat.init_share_ms(sum(p.param_bytes[i:j]))) / 1e3
        held = float(held_s(plat, busy_s))
        return billed, plat.usd_per_s(memory_mb, vcpus) * held + plat.usd_per_request

    def sizes(self, i: int, j: int) -> tuple[tuple[int, float], ...]:
        """The (memory MB, vCPUs) sizes tried for ``[i, j)`` (the same as `options`)."""
        p, plat = self.problem, self.platform
        if self.paper:
            need = max(w + t for w, t in zip(p.weight_mb[i:j], p.transient_mb[i:j]))
            low = plat.round_mb(need)
            return ((low, plat.cpu(low)),) if low <= plat.max_mb else ()
        sizes = plat.sizes(p.slice_need_mb(i, j))
        return sizes[:1] if self.min_memory and not plat.cpu_grid else sizes


def _cpu(mem: np.ndarray, plat: Platform) -> np.ndarray:
    """`Platform.cpu` over an array of memory sizes."""
    if plat.mb_per_vcpu > 0:
        return np.minimum(mem / plat.mb_per_vcpu, plat.max_vcpus)
    return np.full(len(mem), float(plat.vcpus))


def _suffix_max(values: np.ndarray) -> np.ndarray:
    """``out[i] = max(values[i:])``."""
    return np.maximum.accumulate(values[::-1])[::-1]


def _round(need: np.ndarray, plat: Platform) -> np.ndarray:
    return np.ceil(np.maximum(need, plat.min_mb) / plat.step_mb - 1e-9) * plat.step_mb


def _bill(ms: np.ndarray, plat: Platform) -> np.ndarray:
    if plat.billing_ms <= 0:
        return ms
    return np.ceil(ms / plat.billing_ms - 1e-9) * plat.billing_ms


def _masked(mem, vcpus, billed, cost, valid):
    nan = np.where(valid, 0.0, np.nan)
    return mem + nan, vcpus + nan, billed + nan, cost + nan


@dataclass(frozen=True, kw_only=True)
class Label:
    """One plan on the cost/latency frontier: its cuts (unit indices) and each slice's size,
    memory and vCPUs."""

    cost_usd: float
    latency_ms: float
    cuts: tuple[int, ...]
    memory_mb: tuple[int, ...]
    vcpus: tuple[float, ...]

    @property
    def sizes(self) -> tuple[tuple[int, float], ...]:
        """Each slice's (memory MB, vCPUs)."""
        return tuple(zip(self.memory_mb, self.vcpus, strict=True))


@dataclass(frozen=True, kw_only=True)
class Solution:
    """The frontier of a DP run: every Pareto-optimal plan, cheapest first."""

    frontier: tuple[Label, ...]
    exact: bool


def pareto_dp(
    model: SliceModel, *, slices: int | None = None, bound_ms: float = math.inf, label_cap: int = 24
) -> Solution:
    """Every plan of ``model.problem`` that no other plan beats on both cost and latency.

    Args:
        model: prices slices.
        slices: exactly this many slices (None: any number).
        bound_ms: drop plans slower than this.
        label_cap: the largest Pareto set kept per position before thinning.
    """
    n = len(model.problem)
    start = _Labels.start()
    exact = True
    # rows[k][j]: Pareto labels of plans covering units [0, j) with k slices; with no slice
    # count there is one row, and it extends itself.
    rows = (
        [[start] + [_Labels.empty()] * n]
        if slices is None
        else [[start] + [_Labels.empty()] * n]
        + [[_Labels.empty()] * (n + 1) for _ in range(slices)]
    )
    for j in range(1, n + 1):
        opts = model.options(j)
        for k in [0] if slices is None else range(1, min(j, slices) + 1):
            source = rows[0] if slices is None else rows[k - 1]
            rows[k][j], thinned = _extend(
                source[:j], opts, model.platform.hop_ms, bound_ms, label_cap
            )
            exact &= not thinned
    last = rows[-1][n]
    frontier = tuple(_backtrack(rows, slices is None, n, q) for q in range(len(last.cost)))
    return Solution(frontier=frontier, exact=exact)


@dataclass(frozen=True)
class _Labels:
    """Labels at one position: parallel arrays, one entry per Pareto-optimal partial plan."""

    cost: np.ndarray
    lat: np.ndarray
    pos: np.ndarray  # where its last slice starts
    idx: np.ndarray  # the label it extends there
    mem: np.ndarray  # its last slice's memory, MB
    cpu: np.ndarray  # its last slice's vCPUs

    @classmethod
    def empty(cls) -> _Labels:
        return cls(
            np.zeros(0), np.zeros(0), np.zeros(0, int), np.zeros(0, int), np.zeros(0), np.zeros(0)
        )

    def take(self, which: np.ndarray) -> _Labels:
        """The labels ``which`` selects (a mask or indices), in its order."""
        return _Labels(
            *(a[which] for a in (self.cost, self.lat, self.pos, self.idx, self.mem, self.cpu))
        )

    @classmethod
    def start(cls) -> _Labels:
        return cls(
            np.zeros(1), np.zeros(1), np.full(1, -1), np.full(1, -1), np.zeros(1), np.zeros(1)
        )


def _extend(
    source: list[_Labels], opts, hop_ms: float, bound_ms: float, cap: int
) -> tuple[_Labels, bool]:
    """Append one slice ``[i, j)`` to every label at every ``i < j``; keep the Pareto set."""
    sizes = [len(lab.cost) for lab in source]
    if not any(sizes):
        return _Labels.empty(), False
    pos = np.repeat(np.arange(len(source)), sizes)
    idx = np.concatenate([np.arange(s) for s in sizes])
    cost0 = np.concatenate([lab.cost for lab in source])
    lat0 = np.concatenate([lab.lat for lab in source]) + np.where(pos > 0, hop_ms, 0.0)
    parts = [
        (cost0 + cost[pos], lat0 + billed[pos], mem[pos], cpu[pos])
        for mem, cpu, billed, cost in opts
    ]
    cost, lat, mem, cpu = (np.concatenate([p[k] for p in parts]) for k in range(4))
    pos, idx = np.tile(pos, len(parts)), np.tile(idx, len(parts))
    return _front(cost, lat, pos, idx, mem, cpu, bound_ms, cap)


def _front(cost, lat, pos, idx, mem, cpu, bound_ms: float, cap: int) -> tuple[_Labels, bool]:
    """The Pareto set of candidate labels (parallel arrays) within ``bound_ms``, thinned to
    ``cap``; whether it was thinned."""
    labels = _Labels(cost, lat, pos, idx, mem, cpu)
    labels = labels.take(~np.isnan(cost) & (lat <= bound_ms * (1 + _EPS)))
    # cheapest, then fastest, then the fewest slices so far
    labels = labels.take(np.lexsort((-labels.pos, labels.lat, labels.cost)))
    lat = labels.lat
    front = np.ones(len(lat), bool)
    front[1:] = lat[1:] < np.minimum.accumulate(lat)[:-1] * (1 - _EPS)  # float ties are ties
    labels = labels.take(front)
    # Latency falls along the front: a label as dear as the next one up to float noise, and
    # slower, is no trade-off.
    cost = labels.cost
    front = np.ones(len(cost), bool)
    front[:-1] = cost[1:] > cost[:-1] * (1 + _EPS)
    labels = labels.take(front)
    thinned = len(labels.cost) > cap
    if thinned:
        pick = np.unique(np.round(np.linspace(0, len(labels.cost) - 1, cap)).astype(int))
        labels = labels.take(pick)
    return labels, thinned


def pareto_dp_waiting(
    model: SliceModel, *, bound_ms: float = math.inf, label_cap: int = 24
) -> Solution:
    """Every plan of ``model.problem`` no other beats on cost and latency, where each slice is
    also billed, at its memory, while it waits for the slices after it (a synchronous chain:
    Lambda's ``invoke``, OpenFaaS's ``http``; `mopar.bill`).

    A slice's wait is the latency of the rest of the chain, so the DP runs backward over
    suffixes: a suffix's label (cost, latency) is all that prepending a slice needs, and its
    cost only grows with the suffix's latency, so keeping the Pareto set per position stays
    exact. Waits are billed unrounded (within a ms per slice of the bill).
    """
    n = len(model.problem)
    plat = model.platform
    hop = plat.hop_ms
    pending: list[list[tuple]] = [[] for _ in range(n)]
    final: list[_Labels] = [_Labels.empty() for _ in range(n)] + [_Labels.start()]
    exact = True
    for i in range(n, 0, -1):
        if i < n and pending[i]:
            parts = [np.concatenate(x) for x in zip(*pending[i])]
            final[i], thinned = _front(*parts, bound_ms, label_cap)
            exact &= not thinned
        lab = final[i]
        if not len(lab.cost):
            continue
        tail = lab.lat + hop if i < n else np.zeros(len(lab.cost))  # what a new slice waits for
        for mem, cpu, billed, cost in model.options(i):
            rate = (mem / 1024.0 * plat.usd_per_gb_s + cpu * plat.usd_per_vcpu_s) / 1e3  # per ms
            c = lab.cost[None, :] + cost[:, None] + rate[:, None] * tail[None, :]
            lat = billed[:, None] + tail[None, :]
            for j in range(i):
                if np.isnan(cost[j]):
                    continue
                k = len(lab.cost)
                pending[j].append(
                    (
                        c[j],
                        lat[j],
                        np.full(k, i),
                        np.arange(k),
                        np.full(k, mem[j]),
                        np.full(k, cpu[j]),
                    )
                )
    parts = [np.concatenate(x) for x in zip(*pending[0])] if pending[0] else None
    if parts is None:
        return Solution(frontier=(), exact=exact)
    final[0], thinned = _front(*parts, bound_ms, label_cap)
    exact &= not thinned
    frontier = []
    for q in range(len(final[0].cost)):
        j, r, cuts, mems, cpus = 0, q, [], [], []
        while j < n:
            row = final[j]
            mems.append(int(row.mem[r]))
            cpus.append(float(row.cpu[r]))
            j, r = int(row.pos[r]), int(row.idx[r])
            if j < n:
                cuts.append(j)
        frontier.append(
            Label(
                cost_usd=float(final[0].cost[q]),
                latency_ms=float(final[0].lat[q]),
                cuts=tuple(cuts),
                memory_mb=tuple(mems),
                vcpus=tuple(cpus),
            )
        )
    return Solution(frontier=tuple(frontier), exact=exact)


def _backtrack(rows, one_row: bool, n: int, q: int) -> Label:
    k = 0 if one_row else len(rows) - 1
    label = rows[k][n]
    cost, lat = float(label.cost[q]), float(label.lat[q])
    j, cuts, mems, cpus = n, [], [], []
    while j > 0:
        row = rows[k][j]
        mems.append(int(row.mem[q]))
        cpus.append(float(row.cpu[q]))
        prev, q = int(row.pos[q]), int(row.idx[q])
        if prev > 0:
            cuts.append(prev)
        j = prev
        if not one_row:
            k -= 1
    return Label(
        cost_usd=cost,
        latency_ms=lat,
        cuts=tuple(reversed(cuts)),
        memory_mb=tuple(reversed(mems)),
        vcpus=tuple(reversed(cpus)),
    )


_EPS = 1e-12
COST_TOLERANCE = 0.01
"""Costs within this relative distance tie, and the faster plan wins: on Lambda a slice's cost is
flat in memory below one vCPU except for rounding (memory to the MB, time to the ms), and nobody
wants a 4x slower function to save 0.2%."""


def _cheapest_then_fastest(items: list, cost, latency):
    cheapest = min(cost(x) for x in items)
    near = [x for x in items if cost(x) <= cheapest * (1 + COST_TOLERANCE)]
    return min(near, key=latency)


def choose(solution: Solution, *, bound_ms: float = math.inf) -> Label | None:
    """The cheapest plan within ``bound_ms`` (ties: see `COST_TOLERANCE`); None when no plan
    meets the bound."""
    ok = [label for label in solution.frontier if label.latency_ms <= bound_ms * (1 + _EPS)]
    if not ok:
        return None
    return _cheapest_then_fastest(ok, lambda x: x.cost_usd, lambda x: (x.latency_ms, len(x.cuts)))


def price(
    model: SliceModel,
    cuts: tuple[int, ...],
    sizes: tuple[tuple[int, float], ...] | None = None,
    *,
    waits: bool = False,
) -> Label:
    """Price a fixed set of cuts at the given (memory MB, vCPUs) sizes, or, without them, with
    each slice at its cheapest size (ties: the fastest); ``waits``: each slice also billed
    while it waits for the slices after it, as `pareto_dp_waiting` prices them.

    Raises:
        PartitionInfeasibleError: a slice fits no memory size of the platform.
    """
    plat = model.platform
    bounds = list(zip((0, *cuts), (*cuts, len(model.problem))))
    cost = lat = 0.0
    chosen: list[tuple[int, float]] = []
    times: list[float] = []
    for k, (i, j) in enumerate(bounds):
        tried = model.sizes(i, j) if sizes is None else (sizes[k],)
        if not tried:
            need = model.problem.slice_need_mb(i, j)
            raise PartitionInfeasibleError(
                (
                    f"slice {model.problem.names[i]}..{model.problem.names[j - 1]} needs "
                    f"{need:.0f} MB, more than the {plat.max_mb} MB a "
                    f"{plat.target} function may have",
                ),
                "allow more slices (drop ",
                Option("slices"),
                " or raise it)",
            )
        cands = [(size, *model.slice(i, j, *size)) for size in tried]
        size, billed, c = _cheapest_then_fastest(cands, lambda x: x[2], lambda x: x[1])
        chosen.append(size)
        cost += c
        lat += billed + (plat.hop_ms if i > 0 else 0.0)
        times.append(billed)
    if waits:  # each slice also billed while the rest of the chain runs (`pareto_dp_waiting`)
        rest = 0.0
        for k in range(len(times) - 1, -1, -1):
            cost += plat.usd_per_s(*chosen[k]) / 1e3 * rest
            rest += times[k] + plat.hop_ms
    return Label(
        cost_usd=cost,
        latency_ms=lat,
        cuts=tuple(cuts),
        memory_mb=tuple(mb for mb, _ in chosen),
        vcpus=tuple(c for _, c in chosen),
    )

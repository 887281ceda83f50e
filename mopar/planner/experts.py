"""Expert functions: how a mixture-of-experts layer is deployed, and what it costs.

Decide (`place_experts`), per MoE layer, before the vertical DP: either

- ``functions``: a dispatch function on the request path (it holds no weights; it routes the
  tokens, calls the expert functions that received any, waits for them and adds their answers)
  and expert functions of ``G`` experts each, every one invoked only when a token reaches one of
  its experts; or
- ``inline``: the experts stay in the slice that holds the layer, as the dense translation
  (every expert on every token, weighted by 0 where not chosen).

Each option is priced per request from the activation trace (`mopar.profile.experts`):

- an expert function of group ``g`` is invoked with probability ``p_g`` (the share of requests
  in which one of its experts got a token) and then runs its ``G`` experts on the
  ``n_g = E[tokens of g] / p_g`` tokens it was sent: ``G * n_g`` expert-token products, each
  ``1 / (E * T)`` of the dense layer's predicted time, but never less than reading its experts'
  weights once at the roofline's memory bandwidth (a few tokens through a large expert are
  bound by its weights, not its arithmetic: measured 1.3-4.1 ms per invocation for 12.6 MB
  experts with 1-4 tokens, docs/moe.md);
- the dispatch function is billed while it waits: its own routing, one hop, the handoff of the
  tokens, and the slowest expert function it calls. It holds no weights, so it is the smallest
  function, which is where the waiting belongs;
- every function pays the runtime baseline in memory, which is what can make small experts
  cheaper grouped, or inline.

The vertical DP then plans the dense layers as usual, with each expert layer placed as
functions costing nothing to the slices around it, and a cut forced on both sides of it
(`mopar.planner.strategies`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mopar.plan import Edge, Function
from mopar.planner.cost import Platform, significant as _sig, slice_time_ms
from mopar.planner.problem import MB, Problem
from mopar.runtime.dispatch import expert_tensors

__all__ = ["Experts", "experts_for", "ExpertPlacement", "place_experts", "as_dispatch",
           "expert_functions", "DISPATCH_MS", "EXPERT_CALL_MS"]

DISPATCH_MS = 0.05
"""Routing tokens and adding the answers, per request, ms (numpy, a few small arrays)."""
EXPERT_CALL_MS = 0.05
"""An expert function's fixed time per invocation beyond its arithmetic (a session run), ms."""


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A mixture-of-experts model's blocks (`mopar.ir.moe.MoeBlock`) and their activation
    trace (`mopar.profile.experts.ExpertTrace`): what the planner places experts with."""

    blocks: tuple
    trace: Any


_LAST: list = []  # the last trace measured: (graph, calibration path, trace)


def experts_for(blocks: Sequence, gm, inputs, calibration: Path | None) -> Experts | None:
    """The blocks with their trace: measured on ``calibration`` token data when given (once
    per graph and file: compile plans again on export failures and measured latency), else
    assumed uniform. None without blocks."""
    from mopar.profile.experts import assumed_trace, request_samples, trace_experts

    if not blocks:
        return None
    if calibration is None:
        return Experts(blocks=tuple(blocks), trace=assumed_trace(blocks))
    if not (_LAST and _LAST[0][0] is gm and _LAST[0][1] == str(calibration)):
        samples, _ = request_samples(Path(calibration), inputs)
        trace = trace_experts(gm, blocks, samples,
                              source=f"{len(samples)} requests of {Path(calibration).name}")
        _LAST[:] = [(gm, str(calibration), trace)]
    return Experts(blocks=tuple(blocks), trace=_LAST[0][2])


@dataclass(frozen=True, kw_only=True)
class ExpertGroup:
    """One expert function: its experts, memory, and predicted time and cost per invocation."""

    experts: tuple[int, ...]
    probability: float
    tokens: float  # expected tokens it is sent when invoked
    memory_mb: int
    need_mb: float
    vcpus: float
    time_ms: float
    param_bytes: int
    cost_usd: float  # per invocation


@dataclass(frozen=True, kw_only=True)
class ExpertPlacement:
    """How one MoE layer is deployed.

    Attributes:
        layer: the experts layer's name; ``index`` its position in the layer graph.
        mode: ``functions`` or ``inline``.
        groups: the expert functions (``functions`` only), in call order.
        dispatch_mb, dispatch_ms: the dispatch function's memory and billed time.
        cost_usd: the expected cost per request of the chosen option; ``inline_usd`` and
            ``functions_usd`` each option's (for the note).
        probability_source: ``measured`` (a calibration trace) or ``assumed``.
        note: what was chosen and why.
    """

    layer: str
    index: int
    mode: str
    tokens: int = 0
    hidden_size: int = 0
    num_experts: int = 0
    groups: tuple[ExpertGroup, ...] = ()
    dispatch_mb: int = 0
    dispatch_ms: float = 0.0
    cost_usd: float = 0.0
    inline_usd: float = 0.0
    functions_usd: float = 0.0
    probability_source: str = "assumed"
    note: str = ""


def place_experts(problem: Problem, blocks: Sequence, index: dict[str, int], trace,
                  platform: Platform, *, mode: str, group: int | None,
                  weight_copies: float, bytes_per_ms: float) -> dict[int, ExpertPlacement]:
    """The placement of every MoE layer, by its layer index (`ExpertPlacement`).

    Args:
        problem: the layer-level problem (the experts layers still dense in it).
        blocks: the model's MoE blocks (`mopar.ir.moe.MoeBlock`).
        index: each layer's position.
        trace: the activation trace (`mopar.profile.experts.ExpertTrace`).
        mode: ``functions`` (the planner may still keep a layer inline or group its experts
            where that is cheaper) or ``inline``.
        group: experts per function, forced (None: the cheapest of 1, 2, 4 ... E).
        bytes_per_ms: the memory bandwidth an expert's weights are read at (the predictors'
            roofline).
    """
    out = {}
    for b in blocks:
        k = index.get(b.name)
        if k is None:
            continue
        inline = _inline_cost(problem, k, platform)
        if mode == "inline":
            out[k] = ExpertPlacement(layer=b.name, index=k, mode="inline", cost_usd=inline,
                                     inline_usd=inline, note=f"experts of {b.name}: inline "
                                     "(--experts inline), as their dense translation")
            continue
        sizes = [group] if group else [g for g in (2 ** i for i in range(12)) if g <= b.num_experts]
        options = [_functions(problem, k, b, trace, platform, g, weight_copies, bytes_per_ms)
                   for g in sizes]
        best = min(options, key=lambda o: o[0])
        cost, groups, dmb, dms = best
        source = "measured" if trace.measured else "assumed"
        g = len(groups[0].experts)
        if group is None and inline < cost:
            out[k] = ExpertPlacement(
                layer=b.name, index=k, mode="inline", cost_usd=inline, inline_usd=inline,
                functions_usd=cost, probability_source=source,
                note=(f"experts of {b.name} kept inline: cheaper (${inline * 1e6:.4g} per 1M "
                      f"requests) than expert functions (${cost * 1e6:.4g} at {g} per function); "
                      "each function pays the runtime baseline"))
            continue
        why = (f"{g} expert{'s' if g > 1 else ''} per function" +
               (" (--expert-group)" if group else ", the cheapest grouping"))
        out[k] = ExpertPlacement(
            layer=b.name, index=k, mode="functions", tokens=b.tokens, hidden_size=b.hidden_size,
            num_experts=b.num_experts, groups=groups, dispatch_mb=dmb,
            dispatch_ms=dms, cost_usd=cost, inline_usd=inline, functions_usd=cost,
            probability_source=source,
            note=(f"experts of {b.name}: {len(groups)} expert function{'s' if len(groups) > 1 else ''}, "
                  f"{why}; expected ${cost * 1e6:.4g} per 1M requests against ${inline * 1e6:.4g} "
                  f"inline; invocation probabilities {source} ({trace.source})"))
    return out


def _inline_cost(problem: Problem, k: int, platform: Platform) -> float:
    """The layer as one function holding every expert and running them all, densely."""
    need = problem.slice_need_mb(k, k + 1)
    mb = platform.round_mb(need)
    t1, par = problem.slice_t1_ms(k, k + 1)
    ms = float(slice_time_ms(t1, par, platform.cpu(mb)))
    return platform.cost_usd(mb, ms, problem.param_bytes[k])


def _functions(problem: Problem, k: int, block, trace, platform: Platform, size: int,
               weight_copies: float, bytes_per_ms: float
               ) -> tuple[float, tuple[ExpertGroup, ...], int, float]:
    """(expected cost per request, the groups, dispatch MB, dispatch ms) with ``size`` experts
    per function."""
    e, t = block.num_experts, block.tokens
    t1, par = problem.slice_t1_ms(k, k + 1)
    frac = par / t1 if t1 else 0.0
    per_product = t1 / (e * t)  # one expert on one token, at one vCPU
    expected = trace.expected_tokens(block.name)
    invoked = np.asarray(trace.invoked[trace.layer(block.name)], dtype=float)
    weight_bytes = problem.param_bytes[k] / e
    transient = problem.transient_mb[k] / e
    row_bytes = block.hidden_size * 4
    groups = []
    for lo in range(0, e, size):
        ids = tuple(range(lo, min(lo + size, e)))
        # invoked when any of its experts is: at least the likeliest one's share
        p = float(min(1.0, 1.0 - np.prod([1.0 - invoked[i] for i in ids])))
        p = max(p, float(invoked[list(ids)].max()))
        n = float(expected[list(ids)].sum()) / p if p > 0 else 0.0
        need = (problem.baseline_mb + weight_copies * weight_bytes * len(ids) / MB
                + transient * len(ids) + 3 * n * row_bytes / MB)
        mb = platform.round_mb(need)
        work = len(ids) * n * per_product
        stream = weight_bytes * len(ids) / bytes_per_ms
        ms = max(float(slice_time_ms(work, work * frac, platform.cpu(mb))), stream) + EXPERT_CALL_MS
        groups.append(ExpertGroup(
            experts=ids, probability=round(p, 4), tokens=round(n, 2), memory_mb=mb,
            need_mb=round(need, 1), vcpus=round(platform.cpu(mb), 3), time_ms=ms,
            param_bytes=int(weight_bytes * len(ids)),
            cost_usd=platform.cost_usd(mb, ms, weight_bytes * len(ids))))
    dispatch_need = problem.baseline_mb + 4 * t * row_bytes / MB
    dmb = platform.round_mb(dispatch_need)
    send = max((platform.handoff(int(g.tokens * row_bytes))[1] for g in groups), default=0.0)
    slowest = max((g.time_ms for g in groups if g.probability > 0), default=0.0)
    dms = DISPATCH_MS + platform.hop_ms + send + slowest
    cost = platform.cost_usd(dmb, dms) + sum(g.probability * g.cost_usd for g in groups)
    if math.isnan(cost):
        cost = math.inf
    return cost, tuple(groups), dmb, dms


def as_dispatch(problem: Problem, indices: Sequence[int]) -> Problem:
    """``problem`` with each layer of ``indices`` as its dispatch function sees it: no weights,
    no memory beyond the baseline, and only the routing's time (its experts are priced apart)."""
    from dataclasses import replace

    if not indices:
        return problem

    def put(values: tuple, value: float) -> tuple:
        return tuple(value if k in indices else v for k, v in enumerate(values))

    return replace(problem, weight_mb=put(problem.weight_mb, 0.0),
                   transient_mb=put(problem.transient_mb, 0.0),
                   t1_ms=put(problem.t1_ms, DISPATCH_MS), par_ms=put(problem.par_ms, 0.0),
                   param_bytes=put(problem.param_bytes, 0))


def expert_functions(name: str, placement: ExpertPlacement, layer, platform: Platform
                     ) -> tuple[list[Function], list[Edge]]:
    """The functions of one expert layer placed as functions -- its expert functions, then the
    dispatch function ``name`` that calls them -- and the edges of their answers, each taken
    with the probability that the function is invoked."""
    functions, edges = [], []
    dense_flops = layer.flops / max(placement.num_experts * placement.tokens, 1)
    for g, group in enumerate(placement.groups):
        fname = f"{name}.e{g}"
        nbytes = int(group.tokens * placement.hidden_size * 4)
        functions.append(Function(
            name=fname, kind="expert", group=name, artifact=f"functions/{fname}/model.onnx",
            memory_mb=group.memory_mb, need_mb=group.need_mb, vcpus=group.vcpus,
            time_ms=_sig(group.time_ms), param_bytes=group.param_bytes,
            flops=int(dense_flops * len(group.experts) * group.tokens),
            cost_per_1m_usd=_sig(group.cost_usd * 1e6), experts=group.experts))
        edges.append(Edge(src=fname, dst=name, tensors=(expert_tensors(fname)[2],), bytes=nbytes,
                          transport=platform.handoff(nbytes)[0], probability=group.probability,
                          probability_source=placement.probability_source))
    functions.append(Function(
        name=name, kind="dispatch", group=name, layers=(layer.name,),
        memory_mb=placement.dispatch_mb, need_mb=float(placement.dispatch_mb),
        vcpus=round(platform.cpu(placement.dispatch_mb), 3), time_ms=_sig(placement.dispatch_ms),
        cost_per_1m_usd=_sig(platform.cost_usd(placement.dispatch_mb, placement.dispatch_ms) * 1e6)))
    return functions, edges

"""Expert functions: how a mixture-of-experts layer is deployed, and what it costs.

Decide (`place_experts`), per MoE layer, before the vertical DP: either

- ``functions``: a dispatch function on the request path (it holds no weights; it routes the
  tokens, calls the expert functions that received any, waits for them and adds their answers)
  and expert functions of ``G`` experts each, every one invoked only when a token reaches one of
  its experts; or
- ``inline``: the experts stay in the slice that holds the layer, in their sparse translation
  (`mopar.ir.moe.SparseExperts`) where it is exact and predicted faster, else the dense one
  (`inline_sparse`). This is also the unsplit baseline (`as_sparse`).

Each option is priced per request from the activation trace (`mopar.profile.experts`):

- an expert function of group ``g`` is invoked with probability ``p_g`` (the share of requests
  in which one of its experts got a token) and then runs its ``G`` experts on the
  ``n_g = E[tokens of g] / p_g`` tokens it was sent: ``G * n_g`` expert-token products, each
  ``1 / (E * T)`` of the dense layer's predicted time, but never less than reading its experts'
  weights once at the roofline's memory bandwidth (a few tokens through a large expert are
  bound by its weights, not its arithmetic: measured 1.3-4.1 ms per invocation for 12.6 MB
  experts with 1-4 tokens, docs/moe.md);
- the dispatch function is billed while it waits: its own routing, one hop, the handoff of the
  tokens, and the slowest expert function it calls;
- every function pays the runtime baseline in memory, which is what can make small experts
  cheaper grouped, or inline.

Three policies from the systems mopar learns from refine the ``functions`` option: hot experts
kept in the dispatch function (Remoe: `place_experts`'s ``hot``), replicas of the most loaded
cold experts under a request rate (MoEless, Remoe's LPT: `replicate`, `lpt`), and, per layer,
tokens in the invocation or through the store (Liu et al.'s ODS: `comm_mode`).

The vertical DP then plans the dense layers as usual, with each expert layer placed as
functions costing nothing to the slices around it, and a cut forced on both sides of it
(`mopar.planner.strategies`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mopar.plan import Edge, Function
from mopar.planner.cost import Platform, held_s, slice_time_ms
from mopar.planner.cost import significant as _sig
from mopar.planner.problem import MB, Problem
from mopar.runtime.dispatch import expert_tensors
from mopar.runtime.transports import inline as inline_transport
from mopar.runtime.transports import store as store_transport
from mopar.runtime.transports import transport_named

__all__ = [
    "ExpertPlacement",
    "place_experts",
    "as_dispatch",
    "as_sparse",
    "inline_sparse",
    "sparse_ms",
    "expert_functions",
    "replicate",
    "lpt",
    "comm_mode",
    "variation",
    "DISPATCH_MS",
    "SPARSE_EXPERT_MS",
    "EXPERT_CALL_MS",
    "CV_BOUND",
    "REPLICA_MEMORY",
]

DISPATCH_MS = 0.05
"""Routing tokens and adding the answers, per request, ms (numpy, a few small arrays)."""
EXPERT_CALL_MS = 0.05
"""An expert function's fixed time per invocation beyond its arithmetic (a session run), ms."""
SPARSE_EXPERT_MS = 0.012
"""Inline sparse experts: selecting one expert's tokens (NonZero, two Gathers) and adding its
answers back (ScatterND), per expert and request, at one thread, ms: about 10 more onnxruntime
nodes per expert. Fitted to ``mixtral_tiny``, whose experts' arithmetic is small, measured
interleaved at one thread (docs/moe.md): the sparse model takes 0.85x the dense one's time at
16 tokens and 1.03x at 1 token; against the dense layer's predicted 0.19 ms at 16 tokens,
that is about 0.012 ms per expert."""
CV_BOUND = 0.2
"""Replicas are added until the load per replica varies by no more than this (std / mean)."""
REPLICA_MEMORY = 2.0
"""Replicas stop when a layer's cold experts, replicas included, hold this many times the
weights of one copy each."""


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
        hot: the experts the dispatch function holds and runs itself.
        expert_bytes: one expert's weights, bytes.
        cv: with replicas, the coefficient of variation of the load per replica (else None).
        comm: how tokens reach the expert functions (`comm_mode`): ``direct`` or ``store``.
        dispatch_mb, dispatch_vcpus, dispatch_ms: the dispatch function's memory, CPU and
            billed time.
        cost_usd: the expected cost per request of the chosen option.
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
    hot: tuple[int, ...] = ()
    expert_bytes: int = 0
    cv: float | None = None
    comm: str = "direct"
    dispatch_mb: int = 0
    dispatch_vcpus: float = 0.0
    dispatch_ms: float = 0.0
    cost_usd: float = 0.0
    probability_source: str = "assumed"
    note: str = ""


def place_experts(
    problem: Problem,
    blocks: Sequence,
    index: dict[str, int],
    trace,
    platform: Platform,
    *,
    mode: str,
    group: int | None,
    weight_copies: float,
    bytes_per_ms: float,
    hot: str | int = "auto",
    rate: float | None = None,
) -> dict[int, ExpertPlacement]:
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
        hot: experts the dispatch function keeps: ``auto`` (the cheapest count), ``none``, or
            a count (the most loaded first).
        rate: requests per second the plan is sized for; given, the cold experts get replicas
            (`replicate`) packed longest-processing-time first (`lpt`).
    """
    out = {}
    for b in blocks:
        k = index.get(b.name)
        if k is None:
            continue
        inline = _inline_cost(as_sparse(problem, [b], index), k, platform)
        form = _form(problem, b, k)
        if mode == "inline":
            out[k] = ExpertPlacement(
                layer=b.name,
                index=k,
                mode="inline",
                cost_usd=inline,
                note=f"experts of {b.name}: inline (--experts inline), as their {form}",
            )
            continue
        layer = _Layer(problem, k, b, trace, platform, weight_copies, bytes_per_ms)
        best = min(
            (layer.price(h, g, rate) for h, g in layer.options(hot, group)),
            key=lambda o: o.cost_usd,
        )
        source = "measured" if trace.measured else "assumed"
        if group is None and hot == "auto" and inline < best.cost_usd:
            out[k] = ExpertPlacement(
                layer=b.name,
                index=k,
                mode="inline",
                cost_usd=inline,
                probability_source=source,
                note=(
                    f"experts of {b.name} kept inline as their {form}: cheaper "
                    f"(${inline * 1e6:.4g} per 1M requests) than expert functions "
                    f"(${best.cost_usd * 1e6:.4g}: {_layout(best)}); each function pays the "
                    f"runtime baseline; invocation probabilities {source} ({trace.source})"
                ),
            )
            continue
        why = ", ".join(
            (
                f"--expert-group {group}" if group else "the cheapest grouping",
                "the cheapest hot count" if hot == "auto" else f"--hot-experts {hot}",
            )
        )
        load = (
            f"; {rate:g} requests/s: replicas balance the load per replica to a coefficient "
            f"of variation of {best.cv:.2f}"
            if best.cv is not None
            else ""
        )
        out[k] = replace(
            best,
            probability_source=source,
            note=(
                f"experts of {b.name}: {_layout(best)} ({why}){load}; expected "
                f"${best.cost_usd * 1e6:.4g} per 1M requests against ${inline * 1e6:.4g} inline "
                f"({form}); "
                f"tokens sent {best.comm}; invocation probabilities {source} ({trace.source})"
            ),
        )
    return out


def _form(problem: Problem, block, k: int) -> str:
    """How the layer runs inline, for the notes (`inline_sparse` decides)."""
    dense = problem.t1_ms[k]
    if not block.sparse:
        return "dense translation: the sparse one was not exact on the example"
    sparse = sparse_ms(block, dense)
    if sparse < dense:
        return "sparse translation"
    return (
        f"dense translation: predicted {dense:.3g} ms at one vCPU against "
        f"{sparse:.3g} ms sparse, where selecting each expert's tokens costs more than "
        "running every expert on every token"
    )


def _layout(p: ExpertPlacement) -> str:
    """``3 expert functions of up to 2 experts, experts 0,5 hot in the dispatch``."""
    n = len(p.groups)
    size = max((len(g.experts) for g in p.groups), default=0)
    parts = (
        [
            f"{n} expert function{'s' if n != 1 else ''} of up to {size} expert"
            f"{'s' if size != 1 else ''}"
        ]
        if n
        else []
    )
    if p.hot:
        parts.append(
            f"expert{'s' if len(p.hot) > 1 else ''} "
            f"{','.join(map(str, sorted(p.hot)))} hot in the dispatch function"
        )
    return ", ".join(parts)


def _inline_cost(problem: Problem, k: int, platform: Platform) -> float:
    """The layer as one function holding every expert (``problem``: `as_sparse`'s)."""
    t1, par = problem.slice_t1_ms(k, k + 1)
    need, weights = problem.slice_need_mb(k, k + 1), problem.param_bytes[k]
    return _cheapest(platform, need, lambda cpu: float(slice_time_ms(t1, par, cpu)), weights)[0]


def _cheapest(
    platform: Platform, need: float, time_ms, param_bytes: float
) -> tuple[float, int, float, float]:
    """(cost, memory, vCPUs, time) of a function needing ``need`` MB at its cheapest size
    by the CPU-share cost model: a larger size (Lambda) or CPU share (OpenFaaS) may finish
    sooner for less; ``time_ms(vcpus)`` is its time with ``vcpus``."""
    low = platform.round_mb(need)
    sizes = platform.sizes(need) or ((low, platform.cpu(low)),)
    return min(
        (platform.cost_usd(mb, ms, param_bytes, cpu), mb, cpu, ms)
        for mb, cpu in sizes
        for ms in (time_ms(cpu),)
    )


class _Layer:
    """One MoE layer's figures, and the price of a placement of its experts."""

    def __init__(
        self,
        problem: Problem,
        k: int,
        block,
        trace,
        platform: Platform,
        weight_copies: float,
        bytes_per_ms: float,
    ) -> None:
        self.k, self.block, self.platform = k, block, platform
        self.weight_copies, self.bytes_per_ms = weight_copies, bytes_per_ms
        self.baseline_mb = problem.baseline_mb
        e, t = block.num_experts, block.tokens
        t1, par = problem.slice_t1_ms(k, k + 1)
        self.frac = par / t1 if t1 else 0.0
        self.per_product = t1 / (e * t)  # one expert on one token, at one vCPU
        self.expected = np.asarray(trace.expected_tokens(block.name), dtype=float)
        self.invoked = np.asarray(trace.invoked[trace.layer(block.name)], dtype=float)
        self.weight_bytes = problem.param_bytes[k] / e
        self.transient = problem.transient_mb[k] / e
        self.row_bytes = block.hidden_size * 4
        # the most loaded first (expected tokens, then invocations, then index)
        self.order = sorted(range(e), key=lambda i: (-self.expected[i], -self.invoked[i], i))

    def options(self, hot: str | int, group: int | None) -> list[tuple[int, int]]:
        """(hot count, experts per function) pairs to price."""
        e = self.block.num_experts
        counts = range(e + 1) if hot == "auto" else [0] if hot == "none" else [min(int(hot), e)]
        out = []
        for h in counts:
            cold = e - h
            sizes = [group] if group else [g for g in (2**i for i in range(12)) if g <= cold]
            out.extend((h, min(g, max(cold, 1))) for g in (sizes or [1]))
        return out

    def price(self, h: int, size: int, rate: float | None) -> ExpertPlacement:
        """The placement with the ``h`` most loaded experts hot and the others in functions of
        up to ``size`` experts (replicated and packed by load when ``rate`` is given)."""
        b, plat = self.block, self.platform
        hot = tuple(sorted(self.order[:h]))
        cold = sorted(self.order[h:])
        cv = None
        if not cold:
            bins: list[list[tuple[int, int]]] = []
        elif rate:
            replicas = replicate(self.expected[cold], max_copies=REPLICA_MEMORY)
            load = {e: self.expected[e] for e in cold}
            bins = lpt({e: (load[e], r) for e, r in zip(cold, replicas)}, size)
            cv = variation([load[e] / r for e, r in zip(cold, replicas) if load[e] > 0])
        else:
            bins = [[(e, 1) for e in cold[lo : lo + size]] for lo in range(0, len(cold), size)]
        groups = tuple(self._group(members) for members in bins)
        comm = comm_mode(plat, b.tokens * (b.hidden_size + size) * 4)
        # the dispatch: routing, the hot experts while the called functions work, the combine
        hot_need = self.weight_copies * self.weight_bytes * h / MB + self.transient * h
        need = self.baseline_mb + 4 * b.tokens * self.row_bytes / MB + hot_need
        remote = 0.0
        if groups:
            send = max(_send_ms(plat, comm, int(g.tokens * self.row_bytes)) for g in groups)
            slowest = max((g.time_ms for g in groups if g.probability > 0), default=0.0)
            remote = plat.hop_ms + send + slowest
        hot_work = float(self.expected[list(hot)].sum()) * self.per_product
        hot_stream = float(self.invoked[list(hot)].sum()) * self.weight_bytes / self.bytes_per_ms

        def waits(cpu: float) -> float:  # routing, then the hot experts while the others work
            ran = (
                (
                    max(float(slice_time_ms(hot_work, hot_work * self.frac, cpu)), hot_stream)
                    + EXPERT_CALL_MS
                )
                if hot
                else 0.0
            )
            return DISPATCH_MS + max(remote, ran)

        dispatch, dmb, dcpu, dms = _cheapest(plat, need, waits, self.weight_bytes * h)
        cost = dispatch + sum(g.probability * g.cost_usd for g in groups)
        if plat.reserved:  # each function holds its replicas, idle ones included
            held = [(dmb, dcpu, dms, 1.0)] + [
                (g.memory_mb, g.vcpus, g.time_ms, g.probability) for g in groups
            ]
            cost = sum(
                plat.usd_per_s(mb, cpu) * float(held_s(plat, ms / 1e3, p))
                + p * plat.usd_per_request
                for mb, cpu, ms, p in held
            )
        if math.isnan(cost):
            cost = math.inf
        return ExpertPlacement(
            layer=b.name,
            index=self.k,
            mode="functions",
            tokens=b.tokens,
            hidden_size=b.hidden_size,
            num_experts=b.num_experts,
            groups=groups,
            hot=hot,
            expert_bytes=int(self.weight_bytes),
            cv=cv,
            comm=comm,
            dispatch_mb=dmb,
            dispatch_vcpus=dcpu,
            dispatch_ms=dms,
            cost_usd=cost,
        )

    def _group(self, members: Sequence[tuple[int, int]]) -> ExpertGroup:
        """One expert function holding ``members``: (expert, its replica count)."""
        ids = tuple(e for e, _ in members)
        # a replica gets a token when its expert got at least as many as its turn needs
        each = [
            self.invoked[e] * min(1.0, self.expected[e] / max(self.invoked[e], 1e-12) / r)
            for e, r in members
        ]
        p = float(min(1.0, 1.0 - np.prod([1.0 - q for q in each])))
        p = max(p, max(each))
        tokens = sum(self.expected[e] / r for e, r in members)
        n = float(tokens / p) if p > 0 else 0.0
        g = len(ids)
        need = (
            self.baseline_mb
            + self.weight_copies * self.weight_bytes * g / MB
            + self.transient * g
            + 3 * n * self.row_bytes / MB
        )
        work = g * n * self.per_product
        stream = self.weight_bytes * g / self.bytes_per_ms
        cost, mb, cpu, ms = _cheapest(
            self.platform,
            need,
            lambda cpu: (
                max(float(slice_time_ms(work, work * self.frac, cpu)), stream) + EXPERT_CALL_MS
            ),
            self.weight_bytes * g,
        )
        return ExpertGroup(
            experts=ids,
            probability=round(p, 4),
            tokens=round(n, 2),
            memory_mb=mb,
            need_mb=round(need, 1),
            vcpus=round(cpu, 3),
            time_ms=ms,
            param_bytes=int(self.weight_bytes * g),
            cost_usd=cost,
        )


def variation(loads: Sequence[float]) -> float:
    """The coefficient of variation (population std / mean) of ``loads``; 0 for none."""
    x = np.asarray(loads, dtype=float)
    return float(x.std() / x.mean()) if x.size and x.mean() > 0 else 0.0


def replicate(
    loads: Sequence[float], *, max_copies: float = REPLICA_MEMORY, bound: float = CV_BOUND
) -> list[int]:
    """Replicas per expert: starting from one each, the expert with the highest load per
    replica gets one more, until the load per replica of the loaded experts varies by at most
    ``bound`` (`variation`), or the replicas reach ``max_copies`` times the experts (the memory
    cap: each replica holds its expert's weights). Experts without load keep one replica and
    stay out of the variation: nothing runs on them."""
    x = np.asarray(loads, dtype=float)
    r = np.ones(x.size, dtype=int)
    loaded = x > 0
    cap = max(int(math.floor(max_copies * x.size)), x.size)
    while r.sum() < cap and variation(x[loaded] / r[loaded]) > bound:
        r[int(np.argmax(np.where(loaded, x / r, -1.0)))] += 1
    return r.tolist()


def lpt(jobs: dict[int, tuple[float, int]], size: int) -> list[list[tuple[int, int]]]:
    """Pack expert replicas into functions of up to ``size`` experts, longest processing time
    first: the replicas in decreasing load per replica, each into the least loaded function
    with room that holds no replica of the same expert (a new one when none has).

    Args:
        jobs: expert -> (its load, its replica count); a replica carries load / count.

    Returns:
        Per function, its (expert, replica count) members, in expert order.
    """
    replicas = sorted(
        ((load / r, e, r) for e, (load, r) in jobs.items() for _ in range(r)),
        key=lambda j: (-j[0], j[1]),
    )
    n = max(math.ceil(len(replicas) / size), max((r for _, r in jobs.values()), default=0))
    bins: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for load, e, r in replicas:
        room = [i for i, b in enumerate(bins) if len(b) < size and all(x != e for x, _ in b)]
        if not room:
            bins.append([])
            loads.append(0.0)
            room = [len(bins) - 1]
        i = min(room, key=lambda i: (loads[i], i))
        bins[i].append((e, r))
        loads[i] += load
    return [sorted(b) for b in bins if b]


def _send_ms(platform: Platform, comm: str, nbytes: int) -> float:
    """Handing ``nbytes`` of tokens to an expert function in mode ``comm``."""
    if comm == "store":
        return next(x for x in platform.links if transport_named(x.name).stores).transfer_ms(nbytes)
    return platform.handoff(nbytes)[1]


def comm_mode(platform: Platform, nbytes: int) -> str:
    """How a layer's tokens reach its expert functions, for calls of up to ``nbytes``:
    ``direct`` (in the invocation) when the platform's cost model takes a direct link for that
    size -- on a platform with a synchronous payload limit, exactly while it fits -- else
    ``store``."""
    return "store" if transport_named(platform.handoff(nbytes)[0]).stores else "direct"


def sparse_ms(block, dense_ms: float) -> float:
    """The time of ``block``'s experts layer in its sparse translation, from its dense
    translation's ``dense_ms``: ``k / E`` of it plus `SPARSE_EXPERT_MS` per expert, ms."""
    return dense_ms * block.top_k / block.num_experts + block.num_experts * SPARSE_EXPERT_MS


def inline_sparse(problem: Problem, blocks: Sequence, index: Mapping[str, int]) -> tuple[str, ...]:
    """The experts layers that run in their sparse translation wherever a function holds them
    (inline, or the unsplit plan): those whose sparse translation was exact on the example
    (`MoeBlock.sparse`) and is predicted faster than the dense one (`sparse_ms`). With few
    tokens and small experts, selecting each expert's tokens costs more than the dense
    translation's extra arithmetic, and the dense one is kept."""
    return tuple(
        b.name
        for b in blocks
        if b.sparse
        and b.name in index
        and sparse_ms(b, problem.t1_ms[index[b.name]]) < problem.t1_ms[index[b.name]]
    )


def as_sparse(problem: Problem, blocks: Sequence, index: Mapping[str, int]) -> Problem:
    """``problem`` (its experts layers priced as their dense translation, which the profiler
    predicts) with each of `inline_sparse`'s layers as its sparse translation: `sparse_ms`,
    and ``k / E`` of the dense layer's parallel time and transient memory (the experts'
    arithmetic and intermediates, on ``k * T`` expert-token products instead of ``E * T``).
    Weights and what crosses its boundaries stay the same."""
    chosen = set(inline_sparse(problem, blocks, index))
    by_index = {index[b.name]: b for b in blocks if b.name in chosen}
    if not by_index:
        return problem

    def put(values: tuple, value) -> tuple:
        return tuple(value(by_index[k], v) if k in by_index else v for k, v in enumerate(values))

    return replace(
        problem,
        t1_ms=put(problem.t1_ms, sparse_ms),
        par_ms=put(problem.par_ms, lambda b, v: v * b.top_k / b.num_experts),
        transient_mb=put(problem.transient_mb, lambda b, v: v * b.top_k / b.num_experts),
    )


def as_dispatch(problem: Problem, indices: Sequence[int]) -> Problem:
    """``problem`` with each layer of ``indices`` as its dispatch function sees it: no weights,
    no memory beyond the baseline, and only the routing's time (its experts are priced apart)."""
    if not indices:
        return problem

    def put(values: tuple, value: float) -> tuple:
        return tuple(value if k in indices else v for k, v in enumerate(values))

    return replace(
        problem,
        weight_mb=put(problem.weight_mb, 0.0),
        transient_mb=put(problem.transient_mb, 0.0),
        t1_ms=put(problem.t1_ms, DISPATCH_MS),
        par_ms=put(problem.par_ms, 0.0),
        param_bytes=put(problem.param_bytes, 0),
    )


def expert_functions(
    name: str, placement: ExpertPlacement, layer, platform: Platform
) -> tuple[list[Function], list[Edge]]:
    """The functions of one expert layer placed as functions -- its expert functions, then the
    dispatch function ``name`` that calls them -- and the edges of their answers, each taken
    with the probability that the function is invoked. The edges' transport is the layer's
    communication mode: ``redis`` for ``store``, a direct link otherwise."""
    functions, edges = [], []
    dense_flops = layer.flops / max(placement.num_experts * placement.tokens, 1)
    for g, group in enumerate(placement.groups):
        fname = f"{name}.e{g}"
        nbytes = int(group.tokens * placement.hidden_size * 4)
        functions.append(
            Function(
                name=fname,
                kind="expert",
                group=name,
                artifact=f"functions/{fname}/model.onnx",
                memory_mb=group.memory_mb,
                need_mb=group.need_mb,
                vcpus=group.vcpus,
                time_ms=_sig(group.time_ms),
                param_bytes=group.param_bytes,
                flops=int(dense_flops * len(group.experts) * group.tokens),
                cost_per_1m_usd=_sig(group.cost_usd * 1e6),
                experts=group.experts,
            )
        )
        link = platform.handoff(nbytes)[0]
        if placement.comm == "store":
            transport = store_transport().name
        else:
            transport = inline_transport().name if transport_named(link).stores else link
        edges.append(
            Edge(
                src=fname,
                dst=name,
                tensors=(expert_tensors(fname)[2],),
                bytes=nbytes,
                transport=transport,
                probability=group.probability,
                probability_source=placement.probability_source,
            )
        )
    hot_bytes = placement.expert_bytes * len(placement.hot)
    functions.append(
        Function(
            name=name,
            kind="dispatch",
            group=name,
            layers=(layer.name,),
            memory_mb=placement.dispatch_mb,
            need_mb=float(placement.dispatch_mb),
            vcpus=round(placement.dispatch_vcpus, 3),
            time_ms=_sig(placement.dispatch_ms),
            param_bytes=hot_bytes,
            experts=placement.hot,
            cost_per_1m_usd=_sig(
                platform.cost_usd(
                    placement.dispatch_mb,
                    placement.dispatch_ms,
                    hot_bytes,
                    placement.dispatch_vcpus,
                )
                * 1e6
            ),
        )
    )
    return functions, edges

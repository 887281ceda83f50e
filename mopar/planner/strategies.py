"""Strategies: from a layer graph and the profiler's predictions to a priced, frozen Plan.

Read in this order: `plan_model` (one strategy),
`plan_all` (every strategy, for ``--compare``), then one function per strategy. Every strategy
returns cut positions (and for the DP strategies the memory sizes); `_finish` then prices them
with the same cost model, so their figures compare fairly.

- ``unsplit``: the model in one function.
- ``mopar`` (default): simplification, then the exact cost/latency DP (`solve.pareto_dp`) under
  the CPU-share model, over memory sizes and transports, bounded by ``--max-slowdown`` (1.05)
  x the unsplit latency, or by ``--slo-ms``; its notes say what more latency would buy.
- ``mopar-paper``: the published HyPAD: simplification, then the DP minimising Eq. 6 (memory =
  the largest layer, no runtime baseline, fixed CPU) under partitioned latency <= unpartitioned
  latency, then η per slice (η > 1 needs M / λ >= 2 GB-vCPU; see `_eta_note`).
- ``uniform``: equal layer counts; ``params``: balanced parameter bytes (DeepSpeed's
  "parameters"); ``latency``: the min-max stage time split (AlpaServe's inference DP). These take
  ``--slices`` or mopar's slice count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from mopar.config import CompileConfig
from mopar.errors import Option, PartitionInfeasibleError, PlanError
from mopar.facts import Facts
from mopar.ir import INPUT, OUTPUT, LayerGraph
from mopar.plan import STRATEGIES, Function, Plan
from mopar.planner.balanced import balanced_split
from mopar.planner.cost import Platform, priced
from mopar.planner.cost import significant as _sig
from mopar.planner.edges import vertical_edges
from mopar.planner.experts import (
    ExpertPlacement,
    as_dispatch,
    as_sparse,
    expert_functions,
    inline_sparse,
    place_experts,
)
from mopar.planner.problem import Problem, build_problem
from mopar.planner.simplify import simplify
from mopar.planner.solve import Label, SliceModel, choose, pareto_dp, price
from mopar.profile.experts import Experts

__all__ = [
    "STRATEGIES",
    "Prediction",
    "plan_model",
    "plan_all",
    "plan_at_cuts",
    "layer_edges",
    "units_of",
    "MAX_UNITS",
    "hot_experts_value",
]

MAX_UNITS = 120
"""Units the DP solves over at most; larger graphs keep only this many candidate cut points
(see `_candidates`). The DP's work grows with the square of the units."""


class Prediction(Protocol):
    """The profiler's per-layer figures (`mopar.profile.service.LayerPrediction`)."""

    memory_mb: tuple[float, ...]
    time_ms: tuple[float, ...]
    parallel: tuple[float, ...]
    threads: float


def plan_model(
    lg: LayerGraph,
    prediction: Prediction,
    request: CompileConfig,
    *,
    model: str,
    facts: Facts,
    moe: Experts | None = None,
) -> Plan:
    """Plan ``lg`` with ``request.strategy`` for ``facts.platform``."""
    return _Planner(lg, prediction, request, model, facts, moe).plan(request.strategy)


def plan_all(
    lg: LayerGraph,
    prediction: Prediction,
    request: CompileConfig,
    *,
    model: str,
    facts: Facts,
    moe: Experts | None = None,
) -> dict[str, Plan]:
    """Every strategy, side by side; the baselines take mopar's slice count unless ``--slices``."""
    planner = _Planner(lg, prediction, request, model, facts, moe)
    return {name: planner.plan(name) for name in dict.fromkeys((request.strategy, *STRATEGIES))}


def plan_at_cuts(
    lg: LayerGraph,
    prediction: Prediction,
    request: CompileConfig,
    *,
    model: str,
    facts: Facts,
    base: Plan,
    cuts: Sequence[int],
    notes: Sequence[str] = (),
    moe: Experts | None = None,
) -> Plan:
    """``base`` cut at ``cuts`` instead (layer indices where slices start), priced again like
    every strategy with each slice at its cheapest memory size; ``base``'s notes, then ``notes``.
    The pipeline's export stage uses it when it moves a cut (`mopar.planner.recut`)."""
    planner = _Planner(lg, prediction, request, model, facts, moe)
    bound = math.inf if base.bound_ms is None else base.bound_ms
    plan = planner._finish(
        base.strategy, price(planner.layers, tuple(cuts)), notes=(*base.notes, *notes), bound=bound
    )
    return replace(plan, frontier=base.frontier)


class _Planner:
    def __init__(
        self,
        lg: LayerGraph,
        prediction: Prediction,
        request: CompileConfig,
        model: str,
        facts: Facts,
        moe: Experts | None = None,
    ):
        if request.strategy not in STRATEGIES:
            raise PlanError(
                "unknown ",
                Option("strategy", value=request.strategy, quoted=True),
                f"; choose one of {', '.join(STRATEGIES)}",
            )
        if request.strategy == "unsplit" and request.slices not in (None, 1):
            raise PlanError(
                Option("strategy", value="unsplit"),
                " makes one slice, got ",
                Option("slices", value=request.slices),
                "; drop ",
                Option("slices"),
                " or pick another strategy",
            )
        if request.slices is not None and not 1 <= request.slices <= len(lg):
            raise PlanError(
                Option("slices"),
                f" must be between 1 and {len(lg)} (the model has {len(lg)} layers), "
                f"got {request.slices}",
            )
        self.lg, self.request, self.model = lg, request, model
        self.platform: Platform = facts.platform
        self.problem: Problem = build_problem(
            lg,
            memory_mb=prediction.memory_mb,
            time_ms=prediction.time_ms,
            parallel=prediction.parallel,
            threads=prediction.threads,
            weight_copies=facts.weight_copies,
            baseline_mb=self.platform.baseline_mb,
        )
        self.placement: dict[int, ExpertPlacement] = {}
        self.sparse: frozenset[str] = frozenset()  # experts layers that run sparse inline
        if moe is not None and moe.blocks:
            index = {layer.name: k for k, layer in enumerate(lg.layers)}
            self.placement = place_experts(
                self.problem,
                moe.blocks,
                index,
                moe.trace,
                self.platform,
                mode=request.experts,
                group=request.expert_group,
                weight_copies=facts.weight_copies,
                bytes_per_ms=facts.predictors.roofline.bytes_per_ms,
                hot=hot_experts_value(request.hot_experts),
                rate=request.rate,
            )
            self.sparse = frozenset(inline_sparse(self.problem, moe.blocks, index))
            self.problem = as_sparse(self.problem, moe.blocks, index)  # inline experts: sparse
        # the model in one function keeps its experts: the unsplit plan, and the bound's base
        self.dense = SliceModel(
            problem=self.problem, platform=self.platform, min_memory=request.min_memory
        )
        if self.placement:
            self.problem = as_dispatch(
                self.problem, [k for k, p in self.placement.items() if p.mode == "functions"]
            )
        self.layers = SliceModel(
            problem=self.problem, platform=self.platform, min_memory=request.min_memory
        )
        self._check_layers_fit()
        try:
            self._unsplit: Label | None = price(self.dense, ())
        except PartitionInfeasibleError:  # the model fits no single function of this platform
            self._unsplit = None
        self._mopar: Plan | None = None

    # --- strategies ---------------------------------------------------------------------------

    def plan(self, strategy: str) -> Plan:
        if strategy == "unsplit":
            if self._unsplit is None:
                price(self.dense, ())  # raises, saying how much memory it needs
            return self._finish("unsplit", self._unsplit, notes=(), dense=True)
        if strategy == "mopar":
            return self._mopar_plan()
        if strategy == "mopar-paper":
            return self._paper_plan()
        n = self.request.slices or len(self._mopar_plan().functions)
        cuts = {"uniform": self._uniform, "params": self._params, "latency": self._latency}[
            strategy
        ](n)
        return self._finish(strategy, price(self.layers, cuts), notes=())

    def _uniform(self, n: int) -> tuple[int, ...]:
        size = len(self.problem) / n
        return tuple(round(k * size) for k in range(1, n))

    def _params(self, n: int) -> tuple[int, ...]:
        return balanced_split(list(self.problem.param_bytes), n)

    def _latency(self, n: int) -> tuple[int, ...]:
        return balanced_split([round(t * 1000) for t in self.problem.t1_ms], n)

    def _mopar_plan(self) -> Plan:
        """The cheapest plan within the bound, from the whole cost/latency frontier (which
        ``--pareto`` shows). Should the frontier have been thinned, the DP runs again with the
        bound, which prunes early and keeps more of what matters."""
        if self._mopar is None:
            bound, bound_note = self._bound()
            units, notes = self._units()
            model = SliceModel(
                problem=units, platform=self.platform, min_memory=self.request.min_memory
            )
            whole = pareto_dp(model, slices=self.request.slices)
            solution = whole
            if not whole.exact and not math.isinf(bound):
                solution = pareto_dp(model, slices=self.request.slices, bound_ms=bound)
            best = choose(solution, bound_ms=bound)
            if best is None and any(x.mode == "functions" for x in self.placement.values()):
                best = min(whole.frontier, key=lambda f: f.latency_ms)
                notes = (
                    *notes,
                    "no plan of the dense layers meets the latency bound beside the "
                    "expert functions: the fastest is taken",
                )
            if best is None:
                self._infeasible(whole, bound)
            notes = (bound_note, *notes)
            if not solution.exact:
                notes += (
                    "a cost/latency frontier was thinned to 24 plans per position: the plan "
                    "is the best found, not proven optimal",
                )
            more = self._more_latency(whole, best, bound)
            if not best.cuts and self.request.slices is None and not more:
                more = (self._why_unsplit(whole),)
            notes += more
            label = price(self.layers, _layer_cuts(units, best.cuts), best.memory_mb)
            frontier = tuple(
                price(self.layers, _layer_cuts(units, f.cuts), f.memory_mb) for f in whole.frontier
            )
            self._mopar = self._finish("mopar", label, notes=notes, bound=bound, frontier=frontier)
        return self._mopar

    def _paper_plan(self) -> Plan:
        units, unit_notes = self._units()
        model = SliceModel(problem=units, platform=self.platform, paper=True)
        bound = math.inf if self.request.slices else price(model, ()).latency_ms
        solution = pareto_dp(model, slices=self.request.slices, bound_ms=bound)
        best = choose(solution, bound_ms=bound)
        if best is None:
            self._infeasible(solution, bound)
        label = price(self.layers, _layer_cuts(units, best.cuts), best.memory_mb)
        notes = (
            "memory sized as the paper does: the largest layer's prediction, without the "
            "runtime baseline; slices may run out of memory (compare `mopar run`)",
            _eta_note(best.memory_mb, self.platform),
            *unit_notes,
        )
        return self._finish("mopar-paper", label, notes=notes, bound=bound)

    # --- helpers ------------------------------------------------------------------------------

    def _bound(self) -> tuple[float, str]:
        if self.request.slo_ms is not None:
            return self.request.slo_ms, f"latency bound: --slo-ms {self.request.slo_ms:g}"
        if self.request.slices is not None:
            return (
                math.inf,
                f"--slices {self.request.slices}: no latency bound (pass --slo-ms to add one)",
            )
        if self._unsplit is None:
            within = (
                f" of at most {self.platform.max_mb} MB (--max-memory-mb)"
                if self.request.max_memory_mb
                else ""
            )
            return math.inf, (
                f"the model fits no single {self.platform.target} function{within}: "
                "no latency bound (pass --slo-ms to add one)"
            )
        factor = self.request.max_slowdown
        return factor * self._unsplit.latency_ms, (
            f"latency bound: {factor:g} x the unsplit plan's predicted "
            f"{self._unsplit.latency_ms:.1f} ms = {factor * self._unsplit.latency_ms:.1f} ms "
            "(--max-slowdown)"
        )

    def _check_layers_fit(self) -> None:
        """Every layer must fit the largest function on its own; else no plan can exist."""
        p, plat = self.problem, self.platform
        for k in range(len(p)):
            need = p.slice_need_mb(k, k + 1)
            if plat.round_mb(need) > plat.max_mb:
                capped = bool(self.request.max_memory_mb)
                raise PartitionInfeasibleError(
                    f"layer {p.names[k]} alone needs {need:.0f} MB, more than the largest "
                    f"{plat.target} function allowed ({plat.max_mb} MB",
                    *((", ", Option("max_memory_mb")) if capped else ()),
                    "); ",
                    *(
                        ("raise ", Option("max_memory_mb"), f" to at least {math.ceil(need)}")
                        if capped
                        else ("plan for another ", Option("target"))
                    ),
                )

    def _more_latency(self, solution, best: Label, bound: float) -> tuple[str, ...]:
        """What the next few points of latency would buy: the cheapest plan of the frontier
        within 1.1x, 1.25x and 1.5x the unsplit latency, where it saves over ``best``."""
        if self._unsplit is None or self.request.slices is not None:
            return ()
        offers = []
        for factor in (1.1, 1.25, 1.5):
            limit = factor * self._unsplit.latency_ms
            if limit <= bound:
                continue
            other = choose(solution, bound_ms=limit)
            if other is None or other.cost_usd >= best.cost_usd * 0.99:
                continue
            if offers and other.cuts == offers[-1][1].cuts:
                continue
            offers.append((factor, other))
        if not offers:
            return ()
        return (
            "more latency would buy: "
            + "; ".join(
                f"--max-slowdown {f:g}: {len(o.cuts) + 1} slices, {1 - o.cost_usd / best.cost_usd:.0%} "
                f"cheaper at {o.latency_ms:.1f} ms"
                for f, o in offers
            ),
        )

    def _units(self) -> tuple[Problem, tuple[str, ...]]:
        """The units the DP solves over; a simplified group too large for the largest function
        is planned over its layers again, so the DP may cut inside it."""
        units, notes = units_of(
            self.problem,
            layer_edges(self.lg),
            threshold=self.request.simplify_threshold,
            slices=self.request.slices,
        )
        plat = self.platform
        too_big = [
            units.spans[k]
            for k in range(len(units))
            if plat.round_mb(units.slice_need_mb(k, k + 1)) > plat.max_mb
        ]
        if not too_big or len(units) == len(self.problem):
            return units, notes
        starts = {lo for lo, _ in units.spans[1:]} | {
            c for lo, hi in too_big for c in range(lo + 1, hi)
        }
        return self.problem.restrict(sorted(starts)), (
            *notes,
            (
                f"{len(too_big)} simplified group(s) exceed the largest function ({plat.max_mb} MB): "
                "planned over their layers"
            ),
        )

    def _infeasible(self, solution, bound: float) -> None:
        best = min((f.latency_ms for f in solution.frontier), default=math.inf)
        what = f"{self.request.slices} slices" if self.request.slices else "any plan"
        if math.isinf(best):
            raise PartitionInfeasibleError(
                f"no plan with {what} fits functions of at most {self.platform.max_mb} MB; ",
                *(
                    ("allow more slices (drop ", Option("slices"), " or raise it)")
                    if self.request.slices
                    else ("raise ", Option("max_memory_mb"))
                    if self.request.max_memory_mb
                    else ("plan for another ", Option("target"))
                ),
            )
        raise PartitionInfeasibleError(
            f"no plan meets the latency bound of {bound:.1f} ms: the fastest with {what} takes "
            f"{best:.1f} ms ({best - bound:.1f} ms over); raise ",
            Option("slo_ms"),
            f" to at least {math.ceil(best)}",
            *((" or drop ", Option("slices")) if self.request.slices else ()),
        )

    def _why_unsplit(self, solution) -> str:
        relaxed = choose(solution)
        if relaxed is None or not relaxed.cuts or self._unsplit is None:
            return (
                "one slice is the cheapest plan at any latency"
                if solution.exact
                else "one slice is the cheapest plan the (thinned) search found at any latency"
            )
        saving = 1 - relaxed.cost_usd / self._unsplit.cost_usd
        return (
            f"no split meets the latency bound: each cut adds a hop and a handoff. Without "
            f"the bound, {len(relaxed.cuts) + 1} slices cost {saving:.0%} less at "
            f"{relaxed.latency_ms:.1f} ms; pass --slo-ms {math.ceil(relaxed.latency_ms)} to allow it"
        )

    def _finish(
        self,
        strategy: str,
        label: Label,
        *,
        notes: Sequence[str],
        bound: float = math.inf,
        frontier: Sequence[Label] = (),
        dense: bool = False,
    ) -> Plan:
        """The plan of ``label``'s cuts; ``dense``: one function, its experts inside it."""
        layers = self.dense if dense else self.layers
        p, plat = layers.problem, self.platform
        placed = {k: x for k, x in self.placement.items() if x.mode == "functions" and not dense}
        forced = {c for k in placed for c in (k, k + 1) if 0 < c < len(p)}
        if not forced <= set(label.cuts):
            label = price(layers, tuple(sorted(forced | set(label.cuts))))
        bounds = list(zip((0, *label.cuts), (*label.cuts, len(p))))
        functions, transports, extra = [], {}, []
        for k, ((i, j), mb) in enumerate(zip(bounds, label.memory_mb)):
            billed, cost = layers.slice(i, j, mb)
            name = f"s{k}"
            transports[name] = layers.transports[j] if j < len(p) else "response"
            if j == i + 1 and i in placed:
                made, edges = expert_functions(name, placed[i], self.lg.layers[i], plat)
                functions.extend(made)
                extra.extend(edges)
                continue
            functions.append(
                Function(
                    name=name,
                    kind="slice",
                    group=name,
                    layers=tuple(layer.name for layer in self.lg.layers[i:j]),
                    artifact=f"functions/{name}/model.onnx",
                    memory_mb=int(mb),
                    param_bytes=sum(p.param_bytes[i:j]),
                    flops=sum(layer.flops for layer in self.lg.layers[i:j]),
                    time_ms=_sig(billed),
                    need_mb=round(p.slice_need_mb(i, j), 1),
                    vcpus=round(plat.cpu(mb), 3),
                    cost_per_1m_usd=_sig(cost * 1e6),
                    sparse_experts=tuple(
                        la.name for la in self.lg.layers[i:j] if la.name in self.sparse
                    ),
                )
            )
        edges = vertical_edges(
            self.lg, [(f.name, f.layers) for f in functions if f.layers], transports
        ) + tuple(extra)
        notes = (*notes, *(() if dense else (x.note for x in self.placement.values())))
        plan = Plan(
            model=self.model,
            strategy=strategy,
            functions=tuple(functions),
            edges=edges,
            memory_source="predicted: runtime baseline + weights x weight_copies + the largest "
            "layer's transient memory + cut buffers (XGBoost, with margin)",
            target=plat.target,
            bound_ms=None if math.isinf(bound) else round(bound, 3),
            frontier=tuple(
                {
                    "slices": len(f.cuts) + 1,
                    "cost_per_1m_usd": _sig(f.cost_usd * 1e6),
                    "latency_ms": round(f.latency_ms, 3),
                }
                for f in frontier
            ),
            notes=tuple(n for n in notes if n),
        )
        return priced(plan, plat)


def hot_experts_value(value: str | int) -> str | int:
    """``auto``, ``none`` or a count of hot experts, from the option's value."""
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return text
    if text.isdigit():
        return int(text)
    raise PlanError(
        Option("hot_experts"), f" must be auto, none or a count of experts, got {value!r}"
    )


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
        starts = _candidates(problem, starts, MAX_UNITS)
        notes += (
            f"the DP considered {len(starts)} of {len(merged.groups) - 1} cut points "
            "(the cheapest to cut in stretches of equal predicted time, then the cheapest)",
        )
    return problem.restrict(starts), notes


def _layer_cuts(units: Problem, unit_cuts: Sequence[int]) -> tuple[int, ...]:
    return tuple(units.spans[c][0] for c in unit_cuts)


def _candidates(problem: Problem, starts: Sequence[int], keep: int) -> list[int]:
    """``keep - 1`` of the group boundaries ``starts``: the cheapest to cut (fewest live bytes)
    in each of ``keep`` stretches of equal predicted time, then the cheapest of the rest."""
    total = sum(problem.t1_ms) or 1.0
    elapsed = [0.0]
    for t in problem.t1_ms:
        elapsed.append(elapsed[-1] + t)
    windows: dict[int, int] = {}
    for s in starts:
        w = min(int(elapsed[s] / total * keep), keep - 1)
        if w not in windows or problem.cut_bytes[s] < problem.cut_bytes[windows[w]]:
            windows[w] = s
    chosen = set(windows.values())
    rest = sorted((s for s in starts if s not in chosen), key=lambda s: problem.cut_bytes[s])
    chosen.update(rest[: max(keep - 1 - len(chosen), 0)])
    return sorted(chosen)[: keep - 1]


def _eta_note(memory_mb: Sequence[int], platform: Platform) -> str:
    """The paper's η search: η in 1..M/λ, λ the memory per vCPU."""
    lam = platform.mb_per_vcpu or 1769.0
    top = max(int(mb // lam) for mb in memory_mb)
    if top < 2:
        return f"η = 1 for every slice: no slice has M / λ >= 2 (λ = {lam:.0f} MB per vCPU)"
    return (
        f"η up to {top} is allowed by M / λ; pass --parallel {top} to let the planner shard "
        "slices where it predicts a gain"
    )

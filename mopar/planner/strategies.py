"""Strategies: from a layer graph and the profiler's predictions to a priced, frozen Plan.

Read in this order: `Planner` (`Planner.plan`: one strategy; `Planner.compare`: every
strategy, for ``--compare``), then one method per strategy. Every strategy
returns cut positions (and for the DP strategies the memory sizes); `_finish` then prices them
with the same cost model, so their figures compare fairly.

- ``unsplit``: the model in one function.
- ``mopar`` (default): simplification, then, in every chain mode the target offers, the exact
  cost/latency DP (`solve.pareto_dp`) under the CPU-share model, over memory sizes and
  transports; every plan of every frontier, the model whole and the baselines' cuts are then
  priced by `mopar.bill` in their mode under the traffic, and the cheapest within
  ``--max-slowdown`` (1.05) x the unsplit latency, or ``--slo-ms``, is the plan (its chain mode
  in ``Plan.chain``); its notes say which mode and why, what the bill includes, the traffic,
  and what more latency would buy.
- ``mopar-paper``: the published HyPAD's cuts: simplification, then the DP minimising Eq. 6
  (memory = the largest layer, no runtime baseline, fixed CPU) under partitioned latency <=
  unpartitioned latency; each slice then sized by mopar's rule like every row of a comparison
  (or, where one fits no function, as the paper sizes it, marked as not fitting); η per slice
  (η > 1 needs M / λ >= 2 GB-vCPU; see `_eta_note`).
- ``uniform``: equal layer counts; ``params``: balanced parameter bytes (DeepSpeed's
  "parameters"); ``latency``: the min-max stage time split (AlpaServe's inference DP). These take
  ``--slices`` or mopar's slice count, and the cheapest chain mode within mopar's bound.

Every strategy is priced in the chain mode that is cheapest for it within the bound (`Planner.compare`
then holds mopar's plan to be no dearer than any row that fits and meets the bound).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from mopar.bill import caller_waits
from mopar.config import CompileConfig, hot_experts_value
from mopar.errors import Option, PartitionInfeasibleError, PlanError
from mopar.facts import MB, Facts
from mopar.ir import LayerGraph
from mopar.plan import RESPONSE, STRATEGIES, Function, Plan
from mopar.plan.notes import BillIncludes, ChainMode, ModeBest, Note, Remark, Traffic, as_notes
from mopar.planner.balanced import balanced_split
from mopar.planner.choice import (
    ROUNDED_MS,
    cheapest,
    ms_or_none,
    never_dearer,
    pareto_front,
    plan_shape,
)
from mopar.planner.cost import Platform, price_plan, priced
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
from mopar.planner.solve import Label, SliceModel, choose, pareto_dp, pareto_dp_waiting, price
from mopar.planner.units import layer_cuts, layer_edges, units_of
from mopar.profile.experts import Experts
from mopar.runtime.transports import handing_on

__all__ = ["STRATEGIES", "Planner", "Prediction", "plan_at_cuts"]

log = logging.getLogger(__name__)


class Prediction(Protocol):
    """The profiler's per-layer figures (`mopar.profile.service.LayerPrediction`)."""

    memory_mb: tuple[float, ...]
    time_ms: tuple[float, ...]
    parallel: tuple[float, ...]
    threads: float


def plan_at_cuts(
    lg: LayerGraph,
    prediction: Prediction,
    request: CompileConfig,
    *,
    model: str,
    facts: Facts,
    base: Plan,
    cuts: Sequence[int],
    notes: Sequence[Note | str] = (),
    moe: Experts | None = None,
) -> Plan:
    """``base`` cut at ``cuts`` instead (layer indices where slices start), priced again like
    every strategy with each slice at its cheapest memory size; ``base``'s notes, then ``notes``.
    The pipeline's export stage uses it when it moves a cut (`mopar.planner.recut`)."""
    planner = Planner(lg, prediction, request, model, facts, moe)
    bound = math.inf if base.bound_ms is None else base.bound_ms
    chain = base.chain if base.chain in planner.models else planner.chain
    plan = planner._finish(
        base.strategy,
        price(planner.models[chain], tuple(cuts)),
        notes=(*base.notes, *notes),
        bound=bound,
        chain=chain,
    )
    return replace(planner._with_chain_note(plan, [plan]), frontier=base.frontier)


class Planner:
    """Plans ``lg`` for ``facts.platform`` from the profiler's ``prediction``: `plan` with one
    strategy, `compare` with every one."""

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
            answer_copies=facts.answer_copies,
        )
        traffic = self.platform.traffic
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
                rate=None if traffic.source == "default" else traffic.rate_rps,
            )
            self.sparse = frozenset(inline_sparse(self.problem, moe.blocks, index))
            self.problem = as_sparse(self.problem, moe.blocks, index)  # inline experts: sparse
        # the model in one function keeps its experts: the unsplit plan, and the bound's base
        dense_problem = self.problem
        if self.placement:
            self.problem = as_dispatch(
                self.problem, [k for k, p in self.placement.items() if p.mode == "functions"]
            )
        self.modes, self.dense_models, self.models, self.skipped = self._chain_modes(dense_problem)
        self.chain = next(iter(self.models))  # the first mode that plans: the default
        self.dense, self.layers = self.dense_models[self.chain], self.models[self.chain]
        self._check_layers_fit()
        try:
            self._unsplit: Label | None = price(self.dense, ())
        except PartitionInfeasibleError:  # the model fits no single function of this platform
            self._unsplit = None
        # the model whole, in the fastest mode planned: its latency is what the bound multiplies
        self._unsplit_ms = math.inf
        if self._unsplit is not None:
            entry = min(self.platform.chain(c).entry_ms for c in self.models)
            self._unsplit_ms = self._unsplit.latency_ms + entry
        self._mopar: Plan | None = None
        self._whole: Plan | None = None

    def _chain_modes(self, dense: Problem):
        """The chain modes plans are priced in (``request.chain``, or every mode the platform
        offers), each as its `Platform` and the `SliceModel` of the dense and the placed
        problem; and why a mode was left out (no transport fits its cuts or payloads)."""
        base, request = self.platform, self.request
        names = (request.chain,) if request.chain else tuple(c.name for c in base.chains)
        modes, dense_models, models, skipped = {}, {}, {}, []
        for name in names or ("",):
            plat = base.for_chain(name)  # an unknown request.chain raises here
            if plat is None:
                apart = base.chain(name).colocated and not base.colocates and base.colocation
                why = (
                    "needs co-located functions (--colocate)"
                    if apart
                    else ("no measured transport fits it")
                )
                skipped.append(f"{name}: {why}")
                continue
            try:
                dense_models[name] = SliceModel(
                    problem=dense, platform=plat, min_memory=request.min_memory
                )
                models[name] = SliceModel(
                    problem=self.problem, platform=plat, min_memory=request.min_memory
                )
            except PlanError as exc:
                skipped.append(f"{name}: {exc}")
                continue
            modes[name] = plat
        if not models:
            raise PlanError(
                f"no chain mode of {base.target} can carry this model's cuts "
                f"({'; '.join(skipped)}); ",
                Option("chain"),
                " another mode, or run `mopar profile calibrate` with redis-server installed",
            )
        return modes, dense_models, models, tuple(skipped)

    # --- strategies ---------------------------------------------------------------------------

    def compare(self) -> dict[str, Plan]:
        """Every strategy, side by side, the requested one first; the baselines take mopar's
        slice count unless ``--slices``."""
        request = self.request
        plans = {request.strategy: self.plan(request.strategy)}
        left_out = []
        for name in STRATEGIES:
            if name in plans:
                continue
            try:
                plans[name] = self.plan(name)
            except PartitionInfeasibleError as exc:  # a row that cannot be made says why
                left_out.append(f"{name}: {exc}")
        plans = never_dearer(plans, self._bound()[0], slices=request.slices)
        if left_out:
            first = plans[request.strategy]
            note = f"not compared, no plan fits: {'; '.join(left_out)}"
            plans[request.strategy] = replace(first, notes=(*first.notes, Remark(note)))
        return plans

    def plan(self, strategy: str) -> Plan:
        if strategy == "unsplit":
            return self._whole_plan()
        if strategy == "mopar":
            return self._mopar_plan()
        if strategy == "mopar-paper":
            return self._paper_plan()
        bound, _ = self._bound()
        plans = [
            self._finish(strategy, price(self.models[c], self._baseline_cuts(strategy)), chain=c)
            for c in self.models
        ]
        return self._with_chain_note(cheapest(plans, bound) or cheapest(plans), plans)

    def _baseline_cuts(self, strategy: str, n: int | None = None) -> tuple[int, ...]:
        """The cuts of ``uniform``, ``params`` or ``latency`` at ``n`` slices (None:
        ``--slices``, else as many as mopar's plan has), never more slices than units."""
        if n is None:
            n = self.request.slices or len(self._mopar_plan().vertical())
        p = self.problem
        n = max(1, min(n, len(p)))
        if strategy == "uniform":
            size = len(p) / n
            cuts = tuple(round(k * size) for k in range(1, n))
        elif strategy == "params":
            cuts = balanced_split(list(p.param_bytes), n)
        else:
            cuts = balanced_split([round(t * 1000) for t in p.t1_ms], n)
        return tuple(sorted({c for c in cuts if 0 < c < len(p)}))

    def _whole_plans(self) -> list[Plan]:
        """The model in one function, its experts inside it, in every chain mode."""
        if self._unsplit is None:
            price(self.dense, ())  # raises, saying how much memory it needs
        return [
            self._finish("unsplit", price(self.dense_models[c], ()), dense=True, chain=c)
            for c in self.dense_models
        ]

    def _whole_plan(self) -> Plan:
        """The unsplit plan: the model in one function, in the cheapest chain mode within
        ``max_slowdown`` of the fastest (a mode's own latency is all that differs)."""
        if self._whole is None:
            plans = self._whole_plans()
            fastest = min(p.latency_ms for p in plans)
            best = cheapest(plans, self.request.max_slowdown * fastest)
            self._whole = self._with_chain_note(best, plans)
        return self._whole

    def _mopar_plan(self) -> Plan:
        """The cheapest plan within the bound, in the cheapest chain mode, under the traffic.

        Candidates: in every chain mode, the whole cost/latency frontier of the DP (which
        ``--pareto`` shows; should it have been thinned, the DP runs again with the bound, which
        prunes early and keeps more of what matters), the model whole, and the baselines' cuts
        sized by mopar's rule. Each is priced by `mopar.bill` in its mode under the traffic
        (waits, cold starts, idle replicas: what the DP's per-slice sums leave out), and the
        cheapest within the bound is the plan."""
        if self._mopar is None:
            bound, bound_note = self._bound()
            units, notes = self._units()
            candidates, exact = self._frontier_candidates(units, bound)
            best = cheapest(candidates, bound)
            if best is not None and self.request.slices is None:
                n = len(best.vertical())
                candidates += self._baseline_candidates(n, bound)
                best = cheapest(candidates, bound)
            if best is None and self.placed:
                best = min(candidates, key=lambda p: p.latency_ms)
                notes = (
                    *notes,
                    "no plan of the dense layers meets the latency bound beside the "
                    "expert functions: the fastest is taken",
                )
            if best is None:
                self._infeasible(min((p.latency_ms for p in candidates), default=math.inf), bound)
            notes = (bound_note, *notes)
            if not exact:
                notes += (
                    "a cost/latency frontier was thinned to 24 plans per position: the plan "
                    "is the best found, not proven optimal",
                )
            more = self._more_latency(candidates, best, bound)
            if len(best.vertical()) == 1 and self.request.slices is None and not more:
                more = (self._why_unsplit(candidates, exact),)
            frontier = pareto_front([p for p in candidates if p.chain == best.chain])
            best = replace(
                best,
                strategy="mopar",
                notes=as_notes(*notes, *more, *best.notes),
                frontier=tuple(
                    {
                        "slices": len(p.vertical()),
                        "cost_per_1m_usd": p.cost_per_1m_usd,
                        "latency_ms": p.latency_ms,
                    }
                    for p in frontier
                ),
            )
            self._mopar = self._with_chain_note(best, candidates)
        return self._mopar

    def _frontier_candidates(self, units: Problem, bound: float) -> tuple[list[Plan], bool]:
        """Every chain mode's DP frontier as plans (and the model whole, where one slice is
        allowed); whether every DP was exact."""
        candidates: list[Plan] = []
        exact = True
        reach = bound
        if self._unsplit is not None and self.request.slices is None:
            reach = max(bound, 1.5 * self._unsplit_ms)  # what `_more_latency` offers
        for chain, plat in self.modes.items():
            model = SliceModel(problem=units, platform=plat, min_memory=self.request.min_memory)
            whole = pareto_dp(model, slices=self.request.slices)
            labels = list(whole.frontier)
            if not whole.exact and not math.isinf(bound):
                bounded = pareto_dp(model, slices=self.request.slices, bound_ms=bound)
                labels += bounded.frontier
                exact &= bounded.exact
            else:
                exact &= whole.exact
            if caller_waits(chain) and self.request.slices is None:
                # where callers wait, the frontier of own times may miss the cheapest plan
                waiting = pareto_dp_waiting(model, bound_ms=reach)
                labels += waiting.frontier
                exact &= waiting.exact
            seen: set = set()
            for f in labels:
                if (f.cuts, f.sizes) in seen or f.latency_ms > reach * (1 + 1e-9):
                    continue
                seen.add((f.cuts, f.sizes))
                label = price(self.models[chain], layer_cuts(units, f.cuts), f.sizes)
                candidates += self._candidate(label, chain, bound)
            if not seen:  # nothing within reach: keep the fastest, to say how far off it is
                fastest = min(whole.frontier, key=lambda f: f.latency_ms, default=None)
                if fastest is not None:
                    label = price(self.models[chain], layer_cuts(units, fastest.cuts))
                    candidates += self._candidate(label, chain, bound)
        # the model whole competes too, its experts inline, unless expert functions were forced
        forced = self.request.expert_group is not None or self.request.hot_experts != "auto"
        whole = self.request.slices in (None, 1) and self._unsplit is not None
        if whole and not (self.placed and forced):
            candidates += [
                replace(p, strategy="mopar", bound_ms=ms_or_none(bound))
                for p in self._whole_plans()
            ]
        return candidates, exact

    def _baseline_candidates(self, n: int, bound: float) -> list[Plan]:
        """The baselines' cuts at ``n`` slices, sized by mopar's rule, in every chain mode."""
        out = []
        for strategy in ("uniform", "params", "latency"):
            cuts = self._baseline_cuts(strategy, n)
            for chain in self.models:
                try:
                    label = price(self.models[chain], cuts)
                except PartitionInfeasibleError:
                    continue
                out += self._candidate(label, chain, bound)
        return out

    def _candidate(self, label: Label, chain: str, bound: float) -> list[Plan]:
        """The plan of ``label`` in ``chain``, or none where the mode cannot carry one of its
        edges (an expert function's tokens above the mode's payload limit, no store measured)."""
        try:
            return [self._finish("mopar", label, chain=chain, bound=bound)]
        except PartitionInfeasibleError:
            raise
        except PlanError as exc:
            log.info("chain mode %s left out for one plan: %s", chain, exc)
            return []

    def _paper_plan(self) -> Plan:
        """The published HyPAD's cuts; each slice then sized by mopar's rule, as every row of a
        comparison is, or, where a slice fits no function by that rule, as the paper sizes it
        (the largest layer, no runtime baseline), marked as not fitting."""
        units, unit_notes = self._units()
        model = SliceModel(problem=units, platform=self.modes[self.chain], paper=True)
        bound = math.inf if self.request.slices else price(model, ()).latency_ms
        solution = pareto_dp(model, slices=self.request.slices, bound_ms=bound)
        best = choose(solution, bound_ms=bound)
        if best is None:
            self._infeasible(
                min((f.latency_ms for f in solution.frontier), default=math.inf), bound
            )
        cuts = layer_cuts(units, best.cuts)
        notes = (_eta_note(best.memory_mb, self.platform), *unit_notes)
        try:
            plans = [
                self._finish("mopar-paper", price(self.models[c], cuts), chain=c, bound=bound)
                for c in self.models
            ]
            notes = (
                "the paper's cuts, each slice sized by mopar's rule (runtime baseline "
                f"included); the paper's own sizing gives {', '.join(map(str, best.memory_mb))} "
                "MB, which leaves out the runtime",
                *notes,
            )
        except PartitionInfeasibleError:
            label = price(self.layers, cuts, best.sizes)
            plans = [self._finish("mopar-paper", label, chain=self.chain, bound=bound)]
            notes = (
                "does not fit: a slice of the paper's cuts needs more than the largest function "
                "by mopar's rule; sized as the paper does (the largest layer, without the runtime "
                "baseline), it would run out of memory",
                *notes,
            )
        mopar_bound, _ = self._bound()
        plan = cheapest(plans, min(bound, mopar_bound)) or cheapest(plans)
        return self._with_chain_note(replace(plan, notes=as_notes(*notes, *plan.notes)), plans)

    # --- helpers ------------------------------------------------------------------------------

    @property
    def placed(self) -> bool:
        return any(x.mode == "functions" for x in self.placement.values())

    def _with_chain_note(self, plan: Plan, others: Sequence[Plan]) -> Plan:
        """``plan`` with notes on its chain mode (why, against the others' best), its bill and
        the traffic it was priced for."""
        if not self.platform.chains:
            return plan
        price = price_plan(plan, self.platform)
        bound = plan.bound_ms or math.inf
        best: dict[str, Plan] = {}
        for chain in dict.fromkeys(p.chain for p in others):
            mine = [p for p in others if p.chain == chain]
            best[chain] = cheapest(mine, bound) or min(mine, key=lambda p: p.latency_ms)
        notes = (
            ChainMode(
                chain=plan.chain,
                best=tuple(
                    ModeBest(
                        chain=c,
                        cost_per_1m_usd=p.cost_per_1m_usd,
                        within_bound=p.latency_ms <= bound * (1 + 1e-9) + ROUNDED_MS,
                    )
                    for c, p in sorted(best.items(), key=lambda x: x[1].cost_per_1m_usd)
                ),
                skipped=tuple(self.skipped),
                needs=self.platform.colocation if self._colocated(plan) else "",
            ),
            BillIncludes(
                cost_per_1m_usd=plan.cost_per_1m_usd,
                includes=price.bill.includes(),
                rate_rps=self.platform.traffic.rate_rps,
            ),
            Traffic(traffic=price.bill.traffic),
        )
        kept = tuple(n for n in plan.notes if not isinstance(n, (ChainMode, BillIncludes, Traffic)))
        return replace(plan, notes=(*kept, *notes))

    def _colocated(self, plan: Plan) -> bool:
        """Whether ``plan`` needs its functions co-located: its chain mode, or a cut's
        transport, shares a host folder."""
        mode = self.platform.chain(plan.chain).colocated if plan.chain else False
        return mode or any(handing_on(e.transport).colocated for e in plan.edges)

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
        return factor * self._unsplit_ms, (
            f"latency bound: {factor:g} x the unsplit plan's predicted "
            f"{self._unsplit_ms:.1f} ms = {factor * self._unsplit_ms:.1f} ms "
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
                    (
                        f"layer {p.names[k]} alone needs {need:.0f} MB, more than the largest "
                        f"{plat.target} function allowed ({plat.max_mb} MB",
                        *((", ", Option("max_memory_mb")) if capped else ()),
                        ")",
                    ),
                    *(
                        ("raise ", Option("max_memory_mb"), f" to at least {math.ceil(need)}")
                        if capped
                        else ("plan for another ", Option("target"))
                    ),
                )

    def _more_latency(
        self, candidates: Sequence[Plan], best: Plan, bound: float
    ) -> tuple[str, ...]:
        """What the next few points of latency would buy: the cheapest candidate within 1.1x,
        1.25x and 1.5x the unsplit latency, where it saves over ``best``."""
        if self._unsplit is None or self.request.slices is not None:
            return ()
        offers: list[tuple[float, Plan]] = []
        for factor in (1.1, 1.25, 1.5):
            limit = factor * self._unsplit_ms
            if limit <= bound:
                continue
            other = cheapest(candidates, limit)
            if other is None or other.cost_per_1m_usd >= best.cost_per_1m_usd * 0.99:
                continue
            if offers and plan_shape(other) == plan_shape(offers[-1][1]):
                continue
            offers.append((factor, other))
        if not offers:
            return ()
        return (
            "more latency would buy: "
            + "; ".join(
                f"--max-slowdown {f:g}: {len(o.vertical())} slices, "
                f"{1 - o.cost_per_1m_usd / best.cost_per_1m_usd:.0%} "
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

    def _infeasible(self, best: float, bound: float) -> None:
        what = f"{self.request.slices} slices" if self.request.slices else "any plan"
        if math.isinf(best):
            raise PartitionInfeasibleError(
                (f"no plan with {what} fits functions of at most {self.platform.max_mb} MB",),
                *(
                    ("allow more slices (drop ", Option("slices"), " or raise it)")
                    if self.request.slices
                    else ("raise ", Option("max_memory_mb"))
                    if self.request.max_memory_mb
                    else ("plan for another ", Option("target"))
                ),
            )
        raise PartitionInfeasibleError(
            (
                f"no plan meets the latency bound of {bound:.1f} ms: the fastest with {what} "
                f"takes {best:.1f} ms ({best - bound:.1f} ms over)",
            ),
            "raise ",
            Option("slo_ms"),
            f" to at least {math.ceil(best)}",
            *((" or drop ", Option("slices")) if self.request.slices else ()),
        )

    def _why_unsplit(self, candidates: Sequence[Plan], exact: bool) -> str:
        relaxed = cheapest(candidates)
        whole = cheapest([p for p in candidates if len(p.vertical()) == 1])
        if relaxed is None or whole is None or len(relaxed.vertical()) == 1:
            return (
                "one slice is the cheapest plan at any latency"
                if exact
                else "one slice is the cheapest plan the (thinned) search found at any latency"
            )
        saving = 1 - relaxed.cost_per_1m_usd / whole.cost_per_1m_usd
        return (
            f"no split meets the latency bound: each cut adds a hop and a handoff. Without "
            f"the bound, {len(relaxed.vertical())} slices cost {saving:.0%} less at "
            f"{relaxed.latency_ms:.1f} ms; pass --slo-ms {math.ceil(relaxed.latency_ms)} to allow it"
        )

    def _finish(
        self,
        strategy: str,
        label: Label,
        *,
        notes: Sequence[Note | str] = (),
        bound: float = math.inf,
        dense: bool = False,
        chain: str | None = None,
    ) -> Plan:
        """The plan of ``label``'s cuts in chain mode ``chain`` (None: the default), priced by
        the bill; ``dense``: one function, its experts inside it."""
        chain = self.chain if chain is None or chain not in self.models else chain
        layers = (self.dense_models if dense else self.models)[chain]
        p, plat = layers.problem, self.modes[chain]
        placed = {k: x for k, x in self.placement.items() if x.mode == "functions" and not dense}
        forced = {c for k in placed for c in (k, k + 1) if 0 < c < len(p)}
        if not forced <= set(label.cuts):
            label = price(layers, tuple(sorted(forced | set(label.cuts))))
        bounds = list(zip((0, *label.cuts), (*label.cuts, len(p))))
        functions, transports, extra = [], {}, []
        for k, ((i, j), (mb, cpu)) in enumerate(zip(bounds, label.sizes)):
            billed, cost = layers.slice(i, j, mb, cpu)
            name = f"s{k}"
            transports[name] = layers.transports[j]
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
                    vcpus=round(cpu, 3),
                    cost_per_1m_usd=_sig(cost * 1e6),
                    sparse_experts=tuple(
                        la.name for la in self.lg.layers[i:j] if la.name in self.sparse
                    ),
                )
            )
        transports[RESPONSE] = answer = layers.transports[-1]
        edges = vertical_edges(
            self.lg, [(f.name, f.layers) for f in functions if f.layers], transports
        ) + tuple(extra)
        notes = (*notes, *(() if dense else (x.note for x in self.placement.values())))
        if answer != "response":  # over the mode's payload limit
            notes = (
                *notes,
                f"the answer, {p.cut_bytes[-1] / MB:.1f} MB, is over the "
                f"{plat.answer_payload_bytes / MB:.1f} MB chain mode {chain} carries inline: the "
                f"last function puts it in the store ({answer}, priced as a handoff) and answers "
                "with its key, which the caller reads (set RedisUrl), or pass --keep-positions "
                "last to answer with the last position alone",
            )
        plan = Plan(
            model=self.model,
            strategy=strategy,
            functions=tuple(functions),
            edges=edges,
            memory_source="predicted: runtime baseline + weights x weight_copies + the largest "
            "layer's transient memory + cut buffers (XGBoost, with margin)",
            target=plat.target,
            bound_ms=ms_or_none(bound),
            chain=chain,
            notes=as_notes(*(n for n in notes if n)),
        )
        return priced(plan, self.platform)


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

"""Partition: decide where to cut a LayerGraph and how big each slice's function is.

`make_plan` runs one strategy (`strategies.py`) over the profiler's predictions; the cost model
(`cost.py`), the problem (`problem.py`), simplification (`simplify.py`), the DP's units
(`units.py`), the DP (`solve.py`) and the choice among priced plans (`choice.py`) are pure
functions over numbers underneath it. What needs the model's graph is measured before
and handed in as data: the activation trace of its experts (`mopar.profile.experts.Experts`)
and, for `with_parallel`, the sharding figures of a vertical plan's slices
(`mopar.profile.shards.ShardAnalysis`). Importing this package stays light (no torch): the CLI
reads `STRATEGIES` from it to build its options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mopar.config import CompileConfig
from mopar.facts import Facts
from mopar.plan import STRATEGIES, Plan, Remark

if TYPE_CHECKING:
    from mopar.ir import LayerGraph
    from mopar.profile.experts import Experts
    from mopar.profile.service import LayerPrediction
    from mopar.profile.shards import ShardAnalysis

__all__ = ["make_plan", "make_plans", "priced", "with_parallel", "STRATEGIES"]


def make_plan(
    lg: LayerGraph,
    *,
    model: str,
    config: CompileConfig,
    prediction: LayerPrediction,
    facts: Facts,
    moe: Experts | None = None,
) -> Plan:
    """The vertical plan of ``lg`` (a LayerGraph) with ``config.strategy`` for
    ``facts.platform``, from the profiler's per-layer ``prediction``; ``moe``: a
    mixture-of-experts model's blocks and trace. `with_parallel` then chooses η per slice."""
    from mopar.planner.strategies import Planner

    planner = Planner(lg, prediction, config, model, facts, moe)
    return priced(planner.plan(config.strategy), facts)


def with_parallel(
    plan: Plan, shards: ShardAnalysis | None, config: CompileConfig, *, facts: Facts
) -> Plan:
    """``plan`` with η chosen per slice (`mopar.planner.horizontal`) when ``config.parallel``
    allows sub-slices, from ``shards``, the sharding figures of ``plan``'s slices; else
    ``plan`` itself.

    Raises:
        PlanError: sub-slices asked for a plan with expert functions (``shards`` is None
            there: a plan with expert functions is not analysed).
    """
    if config.parallel < 2:
        return plan
    from mopar.errors import InternalError, Option, PlanError

    if plan.dispatches():
        raise PlanError(
            Option("parallel"),
            " with expert functions is not supported yet; drop ",
            Option("parallel"),
            ", or pass ",
            Option("experts", value="inline"),
        )
    if shards is None:
        raise InternalError(
            f"parallel={config.parallel} needs the sharding figures of the plan's slices "
            "(mopar.profile.shards.analyze_shards), got none; report this"
        )
    from mopar.planner.horizontal import plan_parallel

    return plan_parallel(
        plan,
        shards,
        facts.platform,
        max_eta=config.parallel,
        force=config.force_parallel,
        weight_copies=facts.weight_copies,
    )


def make_plans(
    lg: LayerGraph,
    *,
    model: str,
    config: CompileConfig,
    prediction: LayerPrediction,
    facts: Facts,
    moe: Experts | None = None,
) -> dict[str, Plan]:
    """Every strategy's vertical plan, ``config.strategy`` first (for ``mopar plan
    --compare``)."""
    from mopar.planner.strategies import Planner

    made = Planner(lg, prediction, config, model, facts, moe).compare()
    return {name: priced(plan, facts) for name, plan in made.items()}


def priced(plan: Plan, facts: Facts) -> Plan:
    """``plan`` saying which CPU its times were priced for: the target's
    (`mopar.facts.Platform.time_factor`), as a note and ``Plan.priced_for``."""
    from dataclasses import replace

    platform = facts.platform
    trained_on = facts.predictors.trained_on
    source = platform.time_source or "as built in code"
    note = Remark(
        f"priced for {platform.target}'s CPU: predicted times x{platform.time_factor:.3g} "
        f"({source}), against the CPU the predictors were measured on ({trained_on}); "
        "never this machine's load"
    )
    return replace(
        plan,
        priced_for={
            "target": platform.target,
            "time_factor": round(platform.time_factor, 4),
            "source": platform.time_source,
            "trained_on": trained_on,
        },
        notes=(*(n for n in plan.notes if n != note), note),
    )

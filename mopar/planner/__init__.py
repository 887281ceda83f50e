"""Partition: decide where to cut a LayerGraph and how big each slice's function is.

`make_plan` runs one strategy (`strategies.py`) over the profiler's predictions; the cost model
(`cost.py`), the problem (`problem.py`), simplification (`simplify.py`) and the DP (`solve.py`)
are pure functions over numbers underneath it. Importing this package stays light (no torch):
the CLI reads `STRATEGIES` from it to build its options.
"""

from __future__ import annotations

from typing import Any

from mopar.facts import Facts
from mopar.plan import STRATEGIES, Plan

__all__ = ["make_plan", "make_plans", "with_parallel", "STRATEGIES"]


def make_plan(
    lg: Any, *, model: str, config: Any, prediction: Any, facts: Facts, moe: Any = None
) -> Plan:
    """Plan ``lg`` (a LayerGraph) with ``config.strategy`` for ``facts.platform``, from the
    profiler's per-layer ``prediction`` (`mopar.profile.service.LayerPrediction`); ``moe``: a
    mixture-of-experts model's blocks and trace (`mopar.planner.experts.Experts`)."""
    from mopar.planner.strategies import plan_model

    return with_parallel(
        lg,
        plan_model(lg, prediction, config, model=model, facts=facts, moe=moe),
        config,
        facts=facts,
    )


def with_parallel(lg: Any, plan: Plan, config: Any, *, facts: Facts) -> Plan:
    """``plan`` with η chosen per slice (`mopar.planner.horizontal`) when ``config.parallel``
    allows sub-slices; else ``plan`` itself."""
    if config.parallel < 2:
        return plan
    if plan.dispatches():
        from mopar.errors import Option, PlanError

        raise PlanError(
            Option("parallel"),
            " with expert functions is not supported yet; drop ",
            Option("parallel"),
            ", or pass ",
            Option("experts", value="inline"),
        )
    from mopar.ir.subgraph import extract_slices
    from mopar.planner.horizontal import plan_parallel

    return plan_parallel(
        plan,
        extract_slices(lg, plan.vertical()),
        facts.platform,
        max_eta=config.parallel,
        force=config.force_parallel,
        weight_copies=facts.weight_copies,
    )


def make_plans(
    lg: Any, *, model: str, config: Any, prediction: Any, facts: Facts, moe: Any = None
) -> dict[str, Plan]:
    """Every strategy, ``config.strategy`` first (for ``mopar plan --compare``)."""
    from mopar.planner.strategies import plan_all

    plans = plan_all(lg, prediction, config, model=model, facts=facts, moe=moe)
    return {
        name: with_parallel(lg, plan, config, facts=facts) if name == config.strategy else plan
        for name, plan in plans.items()
    }

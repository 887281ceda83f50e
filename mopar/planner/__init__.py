"""Partition: decide where to cut a LayerGraph and how big each slice's function is.

`make_plan` runs one strategy (`strategies.py`) over the profiler's predictions; the cost model
(`cost.py`), the problem (`problem.py`), simplification (`simplify.py`) and the DP (`solve.py`)
are pure functions over numbers underneath it. Importing this package stays light (no torch):
the CLI reads `STRATEGIES` and `TARGETS` from it to build its options.
"""

from __future__ import annotations

from typing import Any

from mopar.planner.cost import TARGETS
from mopar.planner.plan import PLAN_FORMAT_VERSION, STRATEGIES, Plan, SlicePlan

__all__ = ["PLAN_FORMAT_VERSION", "Plan", "SlicePlan", "make_plan", "make_plans", "STRATEGIES", "TARGETS"]


def make_plan(lg: Any, *, model: str, config: Any, prediction: Any) -> Plan:
    """Plan ``lg`` (a LayerGraph) with ``config.strategy`` for ``config.target``, from the
    profiler's per-layer ``prediction`` (`mopar.profile.service.LayerPrediction`)."""
    from mopar.planner.strategies import plan_model

    return with_parallel(lg, plan_model(lg, prediction, config, model=model), config)


def with_parallel(lg: Any, plan: Plan, config: Any) -> Plan:
    """``plan`` with η chosen per slice (`mopar.planner.horizontal`) when ``config.parallel``
    allows sub-slices; else ``plan`` itself."""
    if config.parallel < 2:
        return plan
    from mopar.config import load_profile
    from mopar.planner.cost import load_platform
    from mopar.planner.horizontal import plan_parallel
    from mopar.rewrite import split_by_plan

    platform = load_platform(config.profiles_dir, config.target, arch=config.arch,
                             transport=config.transport)
    copies = float(load_profile(config.profiles_dir, "runtime")["weight_copies"])
    return plan_parallel(plan, split_by_plan(lg, plan), platform, max_eta=config.parallel,
                         force=config.force_parallel, weight_copies=copies)


def make_plans(lg: Any, *, model: str, config: Any, prediction: Any) -> dict[str, Plan]:
    """Every strategy, ``config.strategy`` first (for ``mopar plan --compare``)."""
    from mopar.planner.strategies import plan_all

    plans = plan_all(lg, prediction, config, model=model)
    return {name: with_parallel(lg, plan, config) if name == config.strategy else plan
            for name, plan in plans.items()}

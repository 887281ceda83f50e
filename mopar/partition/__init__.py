"""Partition: decide where to cut a LayerGraph and how big each slice's function is.

`make_plan` runs one strategy (`strategies.py`) over the profiler's predictions; the cost model
(`cost.py`), the problem (`problem.py`), simplification (`simplify.py`) and the DP (`solve.py`)
are pure functions over numbers underneath it. Importing this package stays light (no torch):
the CLI reads `STRATEGIES` and `TARGETS` from it to build its options.
"""

from __future__ import annotations

from typing import Any

from mopar.partition.cost import TARGETS
from mopar.partition.plan import PLAN_FORMAT_VERSION, STRATEGIES, Plan, SlicePlan

__all__ = ["PLAN_FORMAT_VERSION", "Plan", "SlicePlan", "make_plan", "make_plans", "STRATEGIES", "TARGETS"]


def make_plan(lg: Any, *, model: str, config: Any, prediction: Any) -> Plan:
    """Plan ``lg`` (a LayerGraph) with ``config.strategy`` for ``config.target``, from the
    profiler's per-layer ``prediction`` (`mopar.profile.service.LayerPrediction`)."""
    from mopar.partition.strategies import plan_model

    return plan_model(lg, prediction, config, model=model)


def make_plans(lg: Any, *, model: str, config: Any, prediction: Any) -> dict[str, Plan]:
    """Every strategy, ``config.strategy`` first (for ``mopar plan --compare``)."""
    from mopar.partition.strategies import plan_all

    return plan_all(lg, prediction, config, model=model)

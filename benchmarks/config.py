"""Frozen options of `mopar bench`, with the unit of every field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mopar.config import PROFILES_DIR

__all__ = ["BenchConfig"]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to benchmark and how.

    Attributes:
        models: suite model names (`benchmarks.suite.SUITE` keys), in run order.
        variants: what to compile per model: strategy names (`mopar.planner.STRATEGIES`) and
            ablations of mopar (``"mopar+min-memory"``, ...; `benchmarks.suite.ABLATIONS`).
        requests: measured requests per bundle, after one warm-up request each.
        concurrency: requests in flight at once, per bundle.
        quick: run the models' tiny variants on their tiny inputs (`--quick`).
        slo_factor: mopar's latency bound as a multiple of the unsplit plan's predicted latency
            (``--max-slowdown``); 1.05 is mopar's own default.
        baseline_slices: slice count of ``uniform``, ``params`` and ``latency`` (None: mopar's
            count for the same model, target and bound, as the paper compares them).
        target: the platform every strategy plans for (``"openfaas"`` or ``"lambda"``); the
            ``min-memory`` ablation always plans for Lambda, where it matters.
        arch: Lambda architecture (its price).
        tolerance: max relative error (max |diff| / max |model|) of a run's outputs against the
            original model: a gate of the bench's own, beside the allclose check of compile.
        timeout_s: seconds to wait for one slice to answer before the run fails.
        profiles_dir: folder of predictors and platform profiles.
    """

    models: tuple[str, ...]
    variants: tuple[str, ...]
    requests: int = 20
    concurrency: int = 1
    quick: bool = False
    slo_factor: float = 1.05
    baseline_slices: int | None = None
    target: str = "openfaas"
    arch: str = "x86_64"
    tolerance: float = 1e-4
    timeout_s: float = 600.0
    profiles_dir: Path = PROFILES_DIR

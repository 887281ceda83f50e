"""How fast the partition engine solves: synthetic chains and DAGs of 100 to 10,000 layers.

A benchmark, not a test (``python -m benchmarks.partition_speed [--json]``; docs/partition.md quotes
it). Each graph is random but realistic in scale: layers of 0-10 MB of weights and 0.1-50 ms,
cut tensors of 10 KB-20 MB; the DAG adds a skip connection over 1-8 layers at every third
layer (ResNet-like). The timed part is what `mopar plan` runs after prediction: simplification,
candidate cut points, the Pareto DP and the choice within 1.1x the unsplit latency, for OpenFaaS and for Lambda.
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

from mopar.errors import PartitionInfeasibleError
from mopar.facts import Platform
from mopar.planner.problem import Problem
from mopar.planner.solve import SliceModel, choose, pareto_dp, price
from mopar.planner.units import units_of

__all__ = ["synthetic", "time_solve"]


def synthetic(n: int, *, dag: bool, seed: int = 0) -> tuple[Problem, list]:
    """A random problem of ``n`` layers and its layer edges (see the module docstring)."""
    rng = np.random.default_rng(seed)
    weight = rng.choice([0.0, 0.0, 0.1, 1.0, 10.0], n) * rng.random(n)
    sizes = (10e3 * 2000 ** rng.random(n + 1)).astype(int)
    edges = [(k - 1, k, frozenset({(f"t{k}", int(sizes[k]))})) for k in range(n)]
    edges.append((n - 1, n, frozenset({(f"t{n}", int(sizes[n]))})))
    live = np.array(sizes[: n + 1], dtype=np.int64)
    if dag:
        for k in range(0, n - 2, 3):
            end = min(k + int(rng.integers(2, 9)), n - 1)
            edges.append((k, end, frozenset({(f"t{k + 1}", int(sizes[k + 1]))})))
            live[k + 2 : end + 1] += sizes[k + 1]
    t1 = 0.1 + 50 * rng.random(n) ** 3
    problem = Problem(
        names=tuple(f"l{k}" for k in range(n)),
        spans=tuple((k, k + 1) for k in range(n)),
        weight_mb=tuple(2.0 * weight),
        transient_mb=tuple(5 + 50 * rng.random(n)),
        t1_ms=tuple(t1),
        par_ms=tuple(0.8 * t1),
        param_bytes=tuple((weight * 2**20).astype(int)),
        cut_bytes=tuple(int(v) for v in live),
        baseline_mb=45.0,
        threads=2.0,
    )
    return problem, edges


def time_solve(n: int, *, dag: bool, platform: Platform) -> dict:
    """Seconds to plan a synthetic graph of ``n`` layers on ``platform`` (best of 3), and what
    came out."""
    problem, edges = synthetic(n, dag=dag)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        units, _notes = units_of(problem, edges, threshold=0.05, slices=None)
        solution = pareto_dp(SliceModel(problem=units, platform=platform))
        try:
            bound = price(SliceModel(problem=problem, platform=platform), ()).latency_ms * 1.10
        except PartitionInfeasibleError:  # the model fits no single function
            bound = math.inf
        plan = choose(solution, bound_ms=bound)
        best = min(best, time.perf_counter() - start)
    return {
        "layers": n,
        "graph": "dag" if dag else "chain",
        "target": platform.target,
        "seconds": round(best, 4),
        "units": len(units),
        "slices": len(plan.cuts) + 1 if plan else None,
        "frontier": len(solution.frontier),
        "exact": solution.exact,
    }


def main(argv: list[str]) -> None:
    # this entry point is the benchmark's boundary: it loads the shipped platforms once
    from mopar.facts import load_facts

    platforms = [load_facts(target=target).platform for target in ("openfaas", "lambda")]
    rows = [
        time_solve(n, dag=dag, platform=platform)
        for n in (100, 1_000, 10_000)
        for dag in (False, True)
        for platform in platforms
    ]
    if "--json" in argv:
        print(json.dumps(rows, indent=2))
        return
    print(
        "| layers | graph | target | units after simplification | solve (s) | slices | frontier | exact |"
    )
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['layers']:,} | {r['graph']} | {r['target']} | {r['units']} | {r['seconds']:.3f} | "
            f"{r['slices']} | {r['frontier']} | {r['exact']} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])

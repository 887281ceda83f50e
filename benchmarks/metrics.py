"""The benchmark's metrics: pure functions over one run's per-slice measurements.

Read in this order: `SliceMeasure` (what was measured per slice, and what the plan allocated),
then one function per metric, each with its definition (docs/benchmarks.md repeats them), then
`ideal_mc_gb_s` (the floor) and `geomean`.

Allocated memory is the plan's size for the slice (``planned_mb`` in ``plan.json``), not the size
compile raised it to after measuring: a slice whose measured peak RSS exceeds it is an OOM, and
the metrics are computed at the allocated size all the same, so an OOM is counted, never hidden.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mopar.planner.cost import Platform, slice_time_ms

__all__ = [
    "SliceMeasure",
    "mc_gb_s",
    "mem_util",
    "oom_count",
    "openfaas_cost_per_1m_usd",
    "lambda_slice_ms",
    "lambda_cost_per_1m_usd",
    "ideal_mc_gb_s",
    "geomean",
]


@dataclass(frozen=True, kw_only=True)
class SliceMeasure:
    """One slice of a run.

    Attributes:
        name: the slice's name.
        layers: layers in the slice.
        allocated_mb: the plan's memory size for the slice's function, MB.
        deployed_mb: the size compile wrote after raising it to measured peak x 1.25, MB.
        need_mb: the planner's predicted need, MB.
        peak_rss_mb: measured peak RSS of the slice process (VmHWM), MB: the larger of compile's
            10 sizing requests and the bench run.
        p50_ms: median measured time per request (read inputs, run, write outputs), ms.
        predicted_ms: the plan's predicted time of the slice, ms.
        floor_mb: runtime baseline + 1.1 x weights + largest live activations
            (`benchmarks.floor`), MB: what its peak RSS should stay under.
        p95_ms: 95th percentile of the same, ms.
        in_bytes: bytes of the tensors the slice receives.
        parallel: the share of the slice's time that runs in parallel across threads (the
            profiler's per-family fractions, weighted by predicted layer time).
        vcpus: the CPU share its plan requested (0: none, the platform's rule).
    """

    name: str
    layers: int
    allocated_mb: float
    deployed_mb: float
    need_mb: float
    peak_rss_mb: float
    p50_ms: float
    p95_ms: float
    in_bytes: int
    parallel: float
    vcpus: float = 0.0
    predicted_ms: float | None = None
    floor_mb: float | None = None


def mc_gb_s(slices: Sequence[SliceMeasure], *, deployed: bool = False) -> float:
    """MC per request: sum over slices of allocated GB x measured (median) seconds.

    With ``deployed``, at the sizes compile raised the slices to instead.
    """
    return sum(
        (s.deployed_mb if deployed else s.allocated_mb) / 1024 * s.p50_ms / 1e3 for s in slices
    )


def mem_util(slices: Sequence[SliceMeasure]) -> float:
    """Measured peak RSS / allocated memory, weighted by each slice's measured time.

    Above 1 when a slice ran out of its allocation.
    """
    allocated = sum(s.allocated_mb * s.p50_ms for s in slices)
    return sum(s.peak_rss_mb * s.p50_ms for s in slices) / allocated if allocated > 0 else math.nan


def oom_count(slices: Sequence[SliceMeasure]) -> int:
    """Slices whose measured peak RSS exceeds their allocated memory."""
    return sum(1 for s in slices if s.peak_rss_mb > s.allocated_mb)


def openfaas_cost_per_1m_usd(
    slices: Sequence[SliceMeasure], platform: Platform, *, threads: float
) -> float:
    """OpenFaaS (reserved memory and CPU): per slice, its allocated memory and requested CPU x
    its time modelled at that CPU (`slice_ms_at`), plus the platform's request fee per slice
    (none on OpenFaaS), for a million requests."""
    usd = 0.0
    for k, s in enumerate(slices):
        cpu = platform.cpu_of(s.allocated_mb, s.vcpus)
        ms = slice_ms_at(s, platform, cpu, threads=threads, first=k == 0)
        usd += platform.cost_usd(s.allocated_mb, ms, vcpus=cpu)
    return usd * 1e6


def slice_ms_at(
    s: SliceMeasure, platform: Platform, vcpus: float, *, threads: float, first: bool
) -> float:
    """A slice's modelled time with ``vcpus``, ms.

    The measured time ``t`` ran at ``threads`` full cores. Amdahl with the slice's parallel share
    ``p`` gives its time at one vCPU, ``t1 = t / ((1 - p) + p / threads)``, and then
    ``t(c) = t1 (1 - p) / min(c, 1) + t1 p / c`` (`mopar.planner.cost.slice_time_ms`). A slice
    after the first also reads its input over the platform's fastest transport for that many
    bytes (measured here by `mopar profile calibrate`), as the planner assumes.
    """
    p = min(max(s.parallel, 0.0), 1.0)
    t1 = s.p50_ms / ((1.0 - p) + p / max(threads, 1.0))
    compute = float(slice_time_ms(t1, t1 * p, vcpus))
    return compute + (0.0 if first else platform.handoff(s.in_bytes)[1])


def lambda_slice_ms(s: SliceMeasure, platform: Platform, *, threads: float, first: bool) -> float:
    """A slice's modelled time on Lambda at its allocated memory, ms: `slice_ms_at` the CPU
    share of the memory (``c = memory / 1,769 MB``, at most 6)."""
    cpu = platform.cpu(_lambda_mb(s, platform))
    return slice_ms_at(s, platform, cpu, threads=threads, first=first)


def lambda_cost_per_1m_usd(
    slices: Sequence[SliceMeasure], platform: Platform, *, threads: float
) -> float:
    """Lambda: per slice, the allocated memory (rounded up to Lambda's sizes) x the modelled time
    billed per ms, plus the request fee of each slice, for a million requests."""
    return (
        sum(
            platform.cost_usd(
                _lambda_mb(s, platform), lambda_slice_ms(s, platform, threads=threads, first=k == 0)
            )
            for k, s in enumerate(slices)
        )
        * 1e6
    )


def _lambda_mb(s: SliceMeasure, platform: Platform) -> int:
    return platform.round_mb(s.allocated_mb)


def ideal_mc_gb_s(layer_memory_mb: Sequence[float], layer_time_ms: Sequence[float]) -> float:
    """The floor: every layer in its own function of exactly its memory, with no runtime
    baseline, handoff or hop: sum over layers of GB x seconds."""
    return sum(m / 1024 * t / 1e3 for m, t in zip(layer_memory_mb, layer_time_ms, strict=True))


def geomean(values: Sequence[float]) -> float:
    """The geometric mean of positive ``values`` (NaN when there are none)."""
    good = [v for v in values if v > 0 and math.isfinite(v)]
    if not good or len(good) != len(values):
        return math.nan
    return math.exp(sum(math.log(v) for v in good) / len(good))

"""Open-loop load: Poisson arrivals, what a load step measured, and the search for the highest
rate that meets a latency objective.

A closed loop (``--concurrency C``) sends a request when one finishes, so a slow server slows the
client down and the queue it would have built never shows: coordinated omission. An open loop
(``--rate R --duration S``) sends requests when they are due, whatever is in flight, and counts
each one's latency from when it was due. `find_max_rate` searches rates as perf_analyzer does
with a latency threshold: up by doubling until the p95 goes over the objective (or a request
fails), then by bisection between the last rate that met it and the first that did not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["poisson_arrivals", "load_summary", "pct", "find_max_rate", "RateStep"]


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values``, rounded to µs (None: no value)."""
    return round(float(np.percentile(values, q)), 3) if values else None


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> Iterator[float]:
    """Arrival times (s from the start) of a Poisson process of ``rate`` per second, up to
    ``duration_s``."""
    rng = np.random.default_rng(seed)
    t = rng.exponential(1.0 / rate)
    while t < duration_s:
        yield float(t)
        t += rng.exponential(1.0 / rate)


def load_summary(
    records: list[tuple[float, float | None]], config, span_s: float, bucket_s: float = 1.0
) -> dict:
    """What an open-loop step measured: offered and served requests, throughput, and the
    latency over time in ``bucket_s`` windows (by arrival).

    Args:
        records: (arrival s from the start, latency ms or None for a failed request).
        config: the `RunConfig` (rate, duration).
        span_s: from the first arrival to the last answer, s.
    """
    ok = [ms for _, ms in records if ms is not None]
    series = []
    for k in range(max(1, math.ceil(config.duration_s / bucket_s))):
        window = [ms for t, ms in records if k * bucket_s <= t < (k + 1) * bucket_s]
        good = [ms for ms in window if ms is not None]
        series.append(
            {
                "t_s": round(k * bucket_s, 3),
                "requests": len(window),
                "errors": len(window) - len(good),
                "p50_ms": pct(good, 50),
                "p95_ms": pct(good, 95),
            }
        )
    return {
        "rate_rps": config.rate,
        "duration_s": config.duration_s,
        "offered": len(records),
        "completed": len(ok),
        "throughput_rps": round(len(ok) / max(span_s, config.duration_s), 3),
        "series": series,
    }


@dataclass(frozen=True)
class RateStep:
    """One rate the search measured: its p95 and error count, and whether it met the SLO."""

    rate: float
    p95_ms: float | None
    errors: int
    met: bool


def find_max_rate(
    measure: Callable[[float], tuple[float | None, int]],
    *,
    slo_ms: float,
    start: float,
    steps: int = 6,
    max_doublings: int = 10,
) -> tuple[float | None, list[RateStep]]:
    """The highest rate whose p95 latency stays within ``slo_ms`` with no failed request.

    Args:
        measure: runs one open-loop step at a rate; returns its p95 (ms) and failed requests.
        start: the first rate tried, per second.
        steps: bisection steps once a rate that misses is known.
        max_doublings: doublings tried above ``start`` before giving up on finding a miss.

    Returns:
        The best rate that met the SLO (None: not even ``start`` did), and every step.
    """
    tried: list[RateStep] = []

    def ok(rate: float) -> bool:
        p95, errors = measure(rate)
        met = errors == 0 and p95 is not None and p95 <= slo_ms
        tried.append(RateStep(rate=round(rate, 3), p95_ms=p95, errors=errors, met=met))
        return met

    good, bad = None, None
    rate = start
    if not ok(rate):
        good, bad = 0.0, rate
    else:
        good = rate
        for _ in range(max_doublings):
            rate *= 2
            if not ok(rate):
                bad = rate
                break
            good = rate
        if bad is None:
            return good, tried
    for _ in range(steps):
        mid = (good + bad) / 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    best = max((s.rate for s in tried if s.met), default=None)
    return best, tried

"""Open-loop load: Poisson arrivals, what a load step measured, and the search for the highest
rate that meets a latency objective.

A closed loop (``--concurrency C``) sends a request when one finishes, so a slow server slows the
client down and the queue it would have built never shows: coordinated omission. An open loop
(``--rate R --duration S``) sends requests when they are due, whatever is in flight, and counts
each one's latency from when it was due. `find_max_rate` searches rates as perf_analyzer does
with a latency threshold: up by doubling until the p95 goes over the objective (or a request
fails), then by bisection between the last rate that met it and the first that did not.

An open loop is bounded whatever it is asked: a rate over `MAX_RATE_RPS` is refused
(`check_rate`), arrivals are drawn as they fall due (`poisson_arrivals`), arrivals while the
in-flight cap is reached are counted by second (`Drops`), not queued or kept one by one, and
a step ends `GRACE_S` after its last arrival, its requests still in flight then failed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mopar.errors import Option, OptionError

__all__ = [
    "GRACE_S",
    "MAX_RATE_RPS",
    "Drops",
    "RateStep",
    "check_rate",
    "find_max_rate",
    "load_summary",
    "pct",
    "poisson_arrivals",
]

MAX_RATE_RPS = 10_000.0
"""The fastest open loop the local runner generates, requests/s: every arrival, even one
refused at the in-flight cap, costs the loop a turn, and one process sends them all."""
GRACE_S = 30.0
"""Seconds an open-loop step waits for its requests in flight after its last arrival; those
still in flight then are counted as failed."""
_BATCH = 1024
"""Arrivals drawn at once (lazily: one batch in memory)."""


def check_rate(rate: float) -> None:
    """Refuse an open-loop ``rate`` the runner cannot generate.

    Raises:
        OptionError: ``rate`` is over `MAX_RATE_RPS` (or not a positive finite number).
    """
    if not (math.isfinite(rate) and 0 < rate <= MAX_RATE_RPS):
        raise OptionError(
            Option("rate", value=f"{rate:g}"),
            f" is not a rate the local runner can generate: it sends at most "
            f"{MAX_RATE_RPS:g} requests per second; pass a rate above 0 and at most that",
        )


def pct(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile of ``values``, rounded to µs (None: no value)."""
    return round(float(np.percentile(values, q)), 3) if len(values) else None


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> Iterator[float]:
    """Arrival times (s from the start) of a Poisson process of ``rate`` per second, up to
    ``duration_s``, drawn as they are asked for (`_BATCH` at a time)."""
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        times = t + np.cumsum(rng.exponential(1.0 / rate, _BATCH))
        for x in times.tolist():
            if x >= duration_s:
                return
            yield x
        t = float(times[-1])


class Drops:
    """Open-loop arrivals refused because the in-flight cap was reached, counted by whole
    second of arrival (a count per second, however many there are)."""

    def __init__(self) -> None:
        self.by_second: Counter[int] = Counter()

    def add(self, arrival_s: float) -> None:
        self.by_second[int(arrival_s)] += 1

    @property
    def total(self) -> int:
        return sum(self.by_second.values())

    def messages(self, max_in_flight: int) -> list[str]:
        """What a report says of them: one line, or none."""
        if not self.total:
            return []
        return [
            f"throttled: {self.total} arrivals dropped with {max_in_flight} requests in flight "
            "(--max-in-flight)"
        ]

    def between(self, start_s: float, end_s: float) -> int:
        """Those that arrived in [start_s, end_s) (whole seconds)."""
        return sum(n for second, n in self.by_second.items() if start_s <= second < end_s)


def load_summary(
    records: list[tuple[float, float | None]], config, span_s: float, drops: Drops | None = None
) -> dict:
    """What an open-loop step measured: offered, served and dropped requests, throughput, and
    the latency over time in windows of 1 s (by arrival, as `Drops` counts).

    Args:
        records: (arrival s from the start, latency ms or None for a failed request) of the
            requests sent.
        config: the `RunConfig` (rate, duration).
        span_s: from the first arrival to the last answer, s.
        drops: the arrivals refused at the in-flight cap (errors too; never sent).
    """
    drops = drops or Drops()
    ok = [ms for _, ms in records if ms is not None]
    series = []
    for k in range(max(1, math.ceil(config.duration_s))):
        window = [ms for t, ms in records if k <= t < k + 1]
        good = [ms for ms in window if ms is not None]
        dropped = drops.between(k, k + 1)
        series.append(
            {
                "t_s": float(k),
                "requests": len(window) + dropped,
                "errors": len(window) - len(good) + dropped,
                "p50_ms": pct(good, 50),
                "p95_ms": pct(good, 95),
            }
        )
    return {
        "rate_rps": config.rate,
        "duration_s": config.duration_s,
        "offered": len(records) + drops.total,
        "completed": len(ok),
        "dropped": drops.total,
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
    ceiling: float = MAX_RATE_RPS,
) -> tuple[float | None, list[RateStep]]:
    """The highest rate whose p95 latency stays within ``slo_ms`` with no failed request.

    Args:
        measure: runs one open-loop step at a rate; returns its p95 (ms) and failed requests.
        start: the first rate tried, per second.
        steps: bisection steps once a rate that misses is known.
        max_doublings: doublings tried above ``start`` before giving up on finding a miss.
        ceiling: the highest rate tried, per second (the doubling stops there).

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
            if rate >= ceiling:
                break
            rate = min(rate * 2, ceiling)
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

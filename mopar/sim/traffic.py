"""Traffic: when requests arrive, as seconds from the start of the simulated span.

Read in this order: `Traffic` (a shape and its figures, frozen), `SHAPES` (the shapes by name),
`arrivals` (the arrival times of a traffic, deterministic for a seed). A trace file is read by
`mopar.traffic.read_trace`, re-exported here.

- ``poisson``: arrivals at a steady ``rate``; the same arrivals as ``mopar load --rate`` with the
  same seed (`mopar.runner.load.poisson_arrivals`), which the validation relies on;
- ``bursty``: on/off: Poisson arrivals during ``on_s`` of every ``on_s + off_s``, none in
  between, at the rate that keeps ``rate`` as the mean (the Azure Functions trace's
  applications are mostly bursty: Shahrad et al., ATC 2020);
- ``diurnal``: a Poisson process whose rate follows a sine of ``period_s`` around ``rate``,
  ``amplitude`` of it up and down (thinned from the peak rate);
- ``trace``: the timestamps of a file, shifted to start at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mopar.errors import Option, OptionError
from mopar.runner.load import poisson_arrivals
from mopar.traffic import read_trace

__all__ = ["SHAPES", "Traffic", "arrivals", "read_trace"]

SHAPES = ("poisson", "bursty", "diurnal", "trace")
"""The traffic shapes `arrivals` knows."""


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """A traffic shape and its figures.

    Attributes:
        shape: one of `SHAPES`.
        rate: mean arrivals per second (a trace: its own mean).
        duration_s: the simulated span of arrivals, s (a trace: its own span).
        on_s, off_s: ``bursty``: seconds with arrivals, then seconds without, repeated.
        period_s: ``diurnal``: seconds of one cycle of the rate.
        amplitude: ``diurnal``: how far the rate swings around ``rate``, a fraction (0-1).
        times: ``trace``: the arrival times, s from the first.
    """

    shape: str = "poisson"
    rate: float
    duration_s: float
    on_s: float = 30.0
    off_s: float = 270.0
    period_s: float = 86400.0
    amplitude: float = 0.8
    times: tuple[float, ...] = ()

    def describe(self) -> str:
        """One line for people: the shape, its mean rate and span."""
        span = f"{self.rate:g} req/s for {self.duration_s:g} s"
        extra = {
            "poisson": "",
            "bursty": f", on {self.on_s:g} s / off {self.off_s:g} s",
            "diurnal": f", period {self.period_s:g} s, amplitude {self.amplitude:g}",
            "trace": f", {len(self.times)} timestamps",
        }[self.shape]
        return f"{self.shape} {span}{extra}"


def arrivals(traffic: Traffic, seed: int = 0) -> np.ndarray:
    """The arrival times of ``traffic``, s from the start, sorted; the same for the same seed."""
    if traffic.shape == "trace":
        return np.asarray(traffic.times, dtype=float)
    if traffic.shape == "poisson":
        return _poisson(traffic.rate, traffic.duration_s, seed)
    if traffic.shape == "bursty":
        cycle = traffic.on_s + traffic.off_s
        peak = traffic.rate * cycle / traffic.on_s
        t = _poisson(peak, traffic.duration_s, seed)
        return t[np.mod(t, cycle) < traffic.on_s]
    if traffic.shape == "diurnal":
        peak = traffic.rate * (1.0 + traffic.amplitude)
        t = _poisson(peak, traffic.duration_s, seed)
        rng = np.random.default_rng([seed, 1])
        now = 1.0 + traffic.amplitude * np.sin(2 * math.pi * t / traffic.period_s)
        return t[rng.random(len(t)) < now / (1.0 + traffic.amplitude)]
    raise OptionError(
        Option("traffic", value=traffic.shape, quoted=True),
        f" is not a traffic shape; choose one of {', '.join(SHAPES)}",
    )


def _poisson(rate: float, duration_s: float, seed: int) -> np.ndarray:
    return np.fromiter(poisson_arrivals(rate, duration_s, seed), dtype=float)

"""The traffic a plan is priced for (`Traffic`: Poisson at a rate, or a trace's arrival times),
and the one reader of trace files (`read_trace`), which `mopar simulate` uses too.

Read in this order: `Traffic`, `load_traffic`, `read_trace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mopar.errors import Option, OptionError

__all__ = ["DEFAULT_RATE_RPS", "Traffic", "load_traffic", "read_trace"]

DEFAULT_RATE_RPS = 1.0
"""The traffic a plan is priced for when none is given: requests per second, Poisson."""


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """The requests a plan serves: Poisson arrivals at ``rate_rps``, or a trace's arrival times.

    Attributes:
        rate_rps: the mean arrival rate, requests per second.
        arrivals_s: a trace's arrival times, s, sorted (empty: Poisson at ``rate_rps``).
        source: ``"default"``, ``"rate"``, or the trace file's name.
        cold_start_rate: the share of invocations that start cold, 0-1, given instead of the
            share the keep-alive implies (None: derived, `cold_share`).
    """

    rate_rps: float = DEFAULT_RATE_RPS
    arrivals_s: tuple[float, ...] = ()
    source: str = "default"
    cold_start_rate: float | None = None

    def cold_share(self, keep_alive_s: float, probability: float = 1.0) -> float:
        """The share of a function's invocations that find no warm instance, when an idle one
        is kept ``keep_alive_s`` and a request invokes the function with ``probability``.

        Poisson: the chance that no invocation came in the last ``keep_alive_s``,
        ``exp(-p R K)``. A trace: for each arrival, ``(1 - p) ** n`` with ``n`` the arrivals in
        the ``keep_alive_s`` before it, averaged. One instance per function: cold starts of
        instances added for concurrent requests are not counted.
        """
        if self.cold_start_rate is not None:
            return self.cold_start_rate
        if probability <= 0 or math.isinf(keep_alive_s):
            return 0.0
        if not self.arrivals_s:
            return math.exp(-probability * self.rate_rps * keep_alive_s)
        import numpy as np

        t = np.asarray(self.arrivals_s, dtype=float)
        before = np.arange(len(t)) - np.searchsorted(t, t - keep_alive_s, side="right")
        return float(np.mean((1.0 - probability) ** before))

    def describe(self) -> str:
        """The traffic in words, as plan notes state it."""
        if self.arrivals_s:
            span = self.arrivals_s[-1] - self.arrivals_s[0]
            what = (
                f"the trace {self.source}: {len(self.arrivals_s)} arrivals over {span:g} s "
                f"(mean {self.rate_rps:.3g} requests/s)"
            )
        else:
            what = f"{self.rate_rps:g} request{'s' if self.rate_rps != 1 else ''}/s, Poisson"
            if self.source == "default":
                what += " (the default traffic; give a rate or a trace to price yours)"
        if self.cold_start_rate is not None:
            what += f", {self.cold_start_rate:.1%} of invocations cold (given)"
        return what


def load_traffic(*, rate: float | None = None, trace: Path | None = None) -> Traffic:
    """The traffic of ``rate`` (requests per second, Poisson) or of ``trace`` (`read_trace`);
    neither: the default.

    Raises:
        OptionError: both given, a rate not above 0, a trace `read_trace` refuses, or one
            whose arrivals all come at one time.
    """
    if rate is not None and trace is not None:
        raise OptionError(
            "give either ", Option("rate"), " or ", Option("trace"), " (the traffic), not both"
        )
    if trace is None:
        if rate is None:
            return Traffic()
        if not (rate > 0 and math.isfinite(rate)):
            raise OptionError(Option("rate", value=rate), " must be above 0 (requests per second)")
        return Traffic(rate_rps=float(rate), source="rate")
    arrivals = read_trace(Path(trace))
    span = arrivals[-1] - arrivals[0]
    if span <= 0:
        raise OptionError(
            Option("trace", value=str(trace), quoted=True),
            f" holds {len(arrivals)} arrivals all at one time; give arrival times in seconds "
            "spread over some time",
        )
    return Traffic(
        rate_rps=(len(arrivals) - 1) / span, arrivals_s=arrivals, source=Path(trace).name
    )


def read_trace(path: Path) -> tuple[float, ...]:
    """Arrival times from a text file: one number of seconds per line (any origin; a line may
    go on after a comma; blank lines and ``#`` comments skipped), sorted and shifted so that
    the first is 0.

    Raises:
        OptionError: the file cannot be read, holds something that is not a number, or fewer
            than two times.
    """
    fix = "write one arrival time in seconds per line"
    where = Option("trace", value=str(path), quoted=True)
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(where, f" cannot be read ({type(exc).__name__}); {fix}") from None
    times = []
    for k, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            t = float(text.split(",")[0])
        except ValueError:
            t = math.nan
        if not math.isfinite(t):
            raise OptionError(where, f": line {k} is {text[:40]!r}, not a number of seconds; {fix}")
        times.append(t)
    if len(times) < 2:
        raise OptionError(where, f" holds {len(times)} time(s), expected at least 2; {fix}")
    times.sort()
    return tuple(t - times[0] for t in times)

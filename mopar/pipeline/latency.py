"""The latency check's numbers: when it runs, what a comparison measured, and its verdict.

Compile serves a plan beside the unsplit model, their requests interleaved (A B A B ...), so that
a busy machine's drift falls on both alike. Each round is one request of each; its ratio is the
plan's latency over the unsplit model's in that round. The slowdown is the median of those
ratios, and its interval is the distribution-free one for a median (order statistics of the
ratios, `median_interval`): no assumption about how the machine's noise is shaped.

A plan is *over* the bound only when the whole interval is above it, *within* when the whole
interval is at or below it, and *unclear* otherwise; unclear comparisons get more rounds (up to
`MAX_ROUNDS`), and a plan that stays unclear is kept: a re-plan needs a difference larger than
the measurement's own spread. Read in this order: `checks_latency`, `median_interval`,
`Slowdown`, `compare`, then the notes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mopar.bundle.document import LatencyCheck, LatencyComparison
from mopar.config import CompileConfig
from mopar.plan.notes import CheckAhead, Note, Remark, Replanned

if TYPE_CHECKING:
    from mopar.pipeline.values import Measured
    from mopar.plan import Plan

__all__ = [
    "CONFIDENCE",
    "ROUNDS",
    "MAX_ROUNDS",
    "Slowdown",
    "checks_latency",
    "default_objective",
    "median_interval",
    "compare",
    "next_rounds",
    "replan_note",
    "result_note",
    "one_function_note",
    "plan_note",
    "recorded",
]

CONFIDENCE = 0.9
"""Two-sided coverage of the slowdown's interval: each of its ends is a 95 % one-sided bound,
so a plan is re-planned only when it is over the bound with 95 % confidence."""

ROUNDS = 9
"""Interleaved rounds of the first comparison (one warm-up request of each before them)."""

MAX_ROUNDS = 36
"""The most rounds one plan is served for while its comparison is unclear (each further batch
doubles the rounds so far, up to this)."""


def default_objective(config: CompileConfig, plan: Plan) -> bool:
    """Whether ``plan`` was made under the objective the latency check holds: a bound relative
    to the unsplit plan (no --slices, no --slo-ms, and a model that fits one function), of
    mopar's strategy, without codecs (they trade latency by design) and without expert
    functions (their cuts are forced: the layer's experts are placed by cost, not by the
    latency bound), with the check on."""
    return (
        config.check_latency
        and config.strategy == "mopar"
        and config.slices is None
        and config.slo_ms is None
        and config.codec == "none"
        and plan.bound_ms is not None
        and plan.bound_ms < float("inf")
        and not plan.dispatches()
    )


def checks_latency(config: CompileConfig, plan: Plan) -> bool:
    """Whether compile serves ``plan`` beside the unsplit model: under the default objective
    (`default_objective`), for a plan of more than one function (a plan of one is the unsplit
    model itself)."""
    return default_objective(config, plan) and len(plan.functions) > 1


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The distribution-free interval of the median of ``values``: the j-th smallest and the
    j-th largest value, j the largest whose coverage, 1 - 2 P(Binomial(n, 1/2) < j), is at least
    ``confidence`` (j = 1, the extremes, where no j reaches it: fewer than 5 values at 0.9)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

    j = 1
    while j < (n + 1) // 2 and coverage(j + 1) >= confidence:
        j += 1
    return ordered[j - 1], ordered[n - j]


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """A plan served beside the unsplit model in interleaved rounds.

    Attributes:
        functions: the plan's functions.
        rounds: rounds served (one request of each per round).
        p50_ms: the plan's median latency over the rounds, ms.
        unsplit_p50_ms: the unsplit model's, ms.
        ratio: the median of the rounds' latency ratios (plan over unsplit).
        low: the lower end of its `CONFIDENCE` interval.
        high: the upper end.
        bound: the bound it is held to (``--max-slowdown``).
        in_turn: the rounds were served in turn (the plan's functions one at a time, then the
            unsplit model: a large model, `mopar.runner.stepwise`), not interleaved.
    """

    functions: int
    rounds: int
    p50_ms: float
    unsplit_p50_ms: float
    ratio: float
    low: float
    high: float
    bound: float
    in_turn: bool = False

    @property
    def verdict(self) -> str:
        """``within`` (the interval at or below the bound), ``over`` (above it) or
        ``unclear`` (the bound inside the interval)."""
        if self.high <= self.bound:
            return "within"
        if self.low > self.bound:
            return "over"
        return "unclear"

    @property
    def misses(self) -> bool:
        """Whether the plan is not kept: over the bound, or unclear with its median ratio
        above it after every round (a plan measured slower than its bound is planned again,
        never written as if within it)."""
        return self.verdict == "over" or self.ratio > self.bound

    def describe(self) -> str:
        """The figures, as the notes give them."""
        how = "rounds served in turn" if self.in_turn else "interleaved rounds"
        return (
            f"{self.ratio:.3f}x the unsplit model's latency (median of {self.rounds} "
            f"{how}, {CONFIDENCE:.0%} interval {self.low:.3f}x-{self.high:.3f}x; "
            f"{self.p50_ms:.1f} ms against {self.unsplit_p50_ms:.1f} ms)"
        )


def compare(
    split_ms: Sequence[float],
    unsplit_ms: Sequence[float],
    *,
    functions: int,
    bound: float,
    in_turn: bool = False,
) -> Slowdown:
    """The slowdown of a plan of ``functions`` functions from paired latencies, ms: round i
    served ``split_ms[i]`` and ``unsplit_ms[i]`` one after the other (``in_turn``: the i-th
    request of each, the plan's all served before the unsplit model's)."""
    if len(split_ms) != len(unsplit_ms) or not split_ms:
        raise ValueError(f"unpaired rounds: {len(split_ms)} and {len(unsplit_ms)}")
    ratios = [a / max(b, 1e-9) for a, b in zip(split_ms, unsplit_ms, strict=True)]
    low, high = median_interval(ratios)
    return Slowdown(
        functions=functions,
        rounds=len(ratios),
        p50_ms=statistics.median(split_ms),
        unsplit_p50_ms=statistics.median(unsplit_ms),
        ratio=statistics.median(ratios),
        low=low,
        high=high,
        bound=bound,
        in_turn=in_turn,
    )


def next_rounds(slowdown: Slowdown) -> int:
    """How many more rounds to serve: none once the verdict is clear or `MAX_ROUNDS` are
    served; else as many as so far (doubling), up to `MAX_ROUNDS` in all."""
    if slowdown.verdict != "unclear":
        return 0
    return max(min(slowdown.rounds, MAX_ROUNDS - slowdown.rounds), 0)


# --- the notes (records of `mopar.plan.notes`, worded for the CLI, kept in plan.json) ----------


def plan_note(config: CompileConfig) -> CheckAhead:
    """What `mopar plan` says of a plan compile will check: that compile may write another."""
    return CheckAhead(max_slowdown=config.max_slowdown, confidence=CONFIDENCE)


def replan_note(slowdown: Slowdown, scale: float, extra_ms: float) -> Replanned:
    """The note of a round that planned again."""
    return Replanned(
        functions=slowdown.functions,
        served=slowdown.describe(),
        max_slowdown=slowdown.bound,
        scale=scale,
        extra_ms=extra_ms,
    )


def result_note(slowdown: Slowdown) -> Remark:
    """The note of the written plan's own comparison (within, or unclear and kept)."""
    if slowdown.verdict == "within":
        verdict = f"within --max-slowdown {slowdown.bound:g}; kept"
    else:
        verdict = (
            f"not beyond the noise of --max-slowdown {slowdown.bound:g} after "
            f"{slowdown.rounds} rounds; kept"
        )
    return Remark(f"measured before writing: {slowdown.describe()}: {verdict}")


def one_function_note(replanned: bool) -> Remark:
    """The note of a written plan of one function, which is not compared."""
    how = "planned again to one function, " if replanned else ""
    return Remark(
        f"latency check: {how}the unsplit model itself; nothing to compare it with "
        "(no latency ratio)"
    )


def recorded(
    config: CompileConfig,
    measured: Measured,
    compared: Sequence[Slowdown],
    notes: Sequence[Note],
    *,
    replanned: bool | None = None,
    why: str = "",
    skipped: str = "",
) -> Measured:
    """``measured`` with the check's notes and its record for ``plan.json``: the written plan
    is compared where the last comparison is of it (same number of functions, not over)."""

    last = compared[-1] if compared else None
    written = last if last is not None and not last.misses and not why else None
    if skipped:
        decision, closing = skipped, None  # the caller's note says it
    elif written is not None:
        decision = f"kept the plan of {written.functions} functions: " + (
            "its interval is within the bound"
            if written.verdict == "within"
            else "the bound lies inside its interval, so a re-plan would follow noise"
        )
        closing = result_note(written)
    elif why:
        decision = f"{why}; kept the unsplit model (one function)"
        closing = None  # the caller's note says it
    else:
        replanned = bool(compared) if replanned is None else replanned
        decision = (
            "planned again to one function, the unsplit model itself"
            if replanned
            else "not compared: the plan is one function, the unsplit model itself"
        )
        closing = one_function_note(replanned)
    check = LatencyCheck(
        p50_ms=round(written.p50_ms, 3) if written else None,
        unsplit_p50_ms=round(written.unsplit_p50_ms, 3) if written else None,
        slowdown=round(written.ratio, 4) if written else None,
        max_slowdown=config.max_slowdown,
        confidence=CONFIDENCE,
        comparisons=tuple(
            LatencyComparison(
                functions=c.functions,
                rounds=c.rounds,
                p50_ms=round(c.p50_ms, 3),
                unsplit_p50_ms=round(c.unsplit_p50_ms, 3),
                slowdown=round(c.ratio, 4),
                low=round(c.low, 4),
                high=round(c.high, 4),
                verdict=c.verdict,
            )
            for c in compared
        ),
        decision=decision,
    )
    kept = tuple(n for n in measured.plan.notes if not isinstance(n, (CheckAhead, Replanned)))
    ending = (*notes, closing) if closing else tuple(notes)
    plan = replace(measured.plan, notes=(*kept, *ending))
    return replace(measured, plan=plan, check=check)

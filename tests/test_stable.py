"""A stable default: compile's latency check re-plans only on a slowdown beyond the measurement's
own spread, never compares a plan of one function (the unsplit model itself), and `mopar plan`
says when compile may write another plan. The numbers are pure functions
(`mopar.pipeline.latency`); the driver's loop is run here on made-up latencies."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopar.config import CompileConfig
from mopar.pipeline import driver
from mopar.pipeline.latency import (
    CONFIDENCE,
    MAX_ROUNDS,
    ROUNDS,
    compare,
    median_interval,
    next_rounds,
    plan_note,
    recorded,
    replan_note,
    result_note,
)
from mopar.pipeline.values import Measured
from mopar.plan import Function, Plan, Remark
from mopar.plan.notes import CheckAhead, Note, Replanned

# --- the interval, the verdict and the rounds -----------------------------------------------------


def _coverage(n: int, j: int) -> float:
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=1, max_size=40))
def test_the_interval_holds_the_median_at_the_widest_order_statistics_that_cover_it(values):
    low, high = median_interval(values)
    ordered, n = sorted(values), len(values)
    assert low <= ordered[(n - 1) // 2] <= high
    best = max((k for k in range(1, (n + 1) // 2 + 1) if _coverage(n, k) >= CONFIDENCE), default=1)
    assert (low, high) == (ordered[best - 1], ordered[n - best])


def test_drift_that_slows_both_alike_cancels_in_the_paired_rounds():
    unsplit = [10.0, 30.0, 11.0, 50.0, 12.0, 10.5, 40.0, 10.2, 20.0]  # a busy machine
    s = compare([u * 1.02 for u in unsplit], unsplit, functions=3, bound=1.05)
    assert s.ratio == pytest.approx(1.02) and s.high == pytest.approx(1.02)
    assert s.verdict == "within"
    # the ratio of medians would have been fooled by one slow round landing on the plan
    assert next_rounds(s) == 0


def test_a_slowdown_within_the_noise_is_unclear_and_gets_more_rounds_not_a_replan():
    unsplit = [10.0] * ROUNDS
    split = [9.6, 11.2, 10.1, 11.0, 10.4, 9.9, 11.3, 10.6, 10.8]  # 1.06x, spread 0.96-1.13
    s = compare(split, unsplit, functions=4, bound=1.05)
    assert s.ratio > 1.05 and s.verdict == "unclear"
    assert next_rounds(s) == ROUNDS  # doubles the rounds so far
    assert "not beyond the noise of --max-slowdown 1.05" in str(result_note(s))


def test_a_slowdown_beyond_the_noise_is_over():
    s = compare([12.0, 12.5, 11.8] * 3, [10.0] * 9, functions=6, bound=1.05)
    assert s.low > 1.05 and s.verdict == "over" and next_rounds(s) == 0


def test_the_notes_say_how_the_rounds_were_served():
    paired = compare([12.0] * 9, [10.0] * 9, functions=2, bound=1.05)
    assert "median of 9 interleaved rounds" in paired.describe()
    alone = compare([12.0] * 9, [10.0] * 9, functions=2, bound=1.05, in_turn=True)
    assert "median of 9 rounds served in turn" in alone.describe()


def test_rounds_stop_at_the_cap():
    s = compare([10.0, 11.0] * 16, [10.0] * 32, functions=2, bound=1.05)
    assert s.verdict == "unclear" and next_rounds(s) == MAX_ROUNDS - 32


def test_the_check_serves_more_rounds_while_unclear(monkeypatch):
    """`driver._compared` on made-up latencies: 1.04x-1.08x rounds are unclear against 1.05 at
    9 and 18 rounds, so it serves 9, 9 and 18 and keeps the plan."""
    served: list[int] = []

    def serve_units(root, analysis, r, reference, *, requests, in_turn, platform):
        served.append(requests)
        split = [10.4 if i % 2 else 10.8 for i in range(requests)]
        report = lambda ms: SimpleNamespace(  # noqa: E731
            served=tuple(SimpleNamespace(latency_ms=m) for m in ms)
        )
        return report(split), report([10.0] * requests)

    sized = lambda root, analysis, r, report, config, facts: Measured(  # noqa: E731
        plan=None, peaks_mb={}, p50_ms={}, latency_ms=0.0
    )
    monkeypatch.setattr(driver, "serve_units", serve_units)
    monkeypatch.setattr(driver, "sized", sized)
    monkeypatch.setattr(driver, "_weights_out", lambda *_: contextlib.nullcontext())
    monkeypatch.setattr(driver, "in_turn", lambda *_: False)
    r = SimpleNamespace(plan=SimpleNamespace(functions=(1, 2)), slices=(1, 2))
    watch = driver.Stopwatch()
    reference = SimpleNamespace(realised=SimpleNamespace(plan=None))
    facts = SimpleNamespace(platform=None)
    measured, s = driver._compared(None, None, r, reference, CompileConfig(), facts, watch, None)
    assert served == [ROUNDS, ROUNDS, 2 * ROUNDS] and s.rounds == MAX_ROUNDS
    assert s.verdict == "unclear" and measured.latency_ms == s.p50_ms


# --- what the written plan says ---------------------------------------------------------------


def _measured(functions: int, notes: tuple[Note, ...] = ()) -> Measured:
    plan = Plan(
        model="m",
        strategy="mopar",
        functions=tuple(
            Function(name=f"s{i}", group=f"s{i}", memory_mb=128, time_ms=1.0, layers=(f"l{i}",))
            for i in range(functions)
        ),
        notes=notes,
    )
    return Measured(plan=plan, peaks_mb={}, p50_ms={}, latency_ms=5.0)


def test_a_plan_of_one_function_is_not_compared_and_says_so():
    measured = _measured(1, notes=(Remark("latency bound: 1.05 x the unsplit plan's"),))
    got = recorded(CompileConfig(), measured, (), (), replanned=False)
    check = got.check
    assert (check.p50_ms, check.slowdown, check.comparisons) == (None, None, ())
    assert check.decision.startswith("not compared: the plan is one function")
    assert str(got.plan.notes[-1]).startswith("latency check: the unsplit model itself")
    assert not any("x the unsplit model's latency" in str(n) for n in got.plan.notes)


def test_a_plan_planned_again_to_one_function_keeps_the_comparison_that_led_there():
    over = compare([13.0] * 9, [10.0] * 9, functions=6, bound=1.05)
    again = replan_note(over, 1.25, 0.5)
    got = recorded(CompileConfig(), _measured(1, notes=(again,)), (over,), (again,))
    assert got.check.slowdown is None and got.check.comparisons[0].verdict == "over"
    assert got.check.decision == "planned again to one function, the unsplit model itself"
    assert tuple(map(str, got.plan.notes)) == (
        "measured: a plan of 6 functions served at "
        f"{over.describe()}: over --max-slowdown 1.05 beyond the noise; planned again with layer "
        "times x1.25 and 0.50 ms more per cut",
        "latency check: planned again to one function, the unsplit model itself; nothing to "
        "compare it with (no latency ratio)",
    )


def test_the_written_plan_records_its_rounds_ratio_and_interval():
    within = compare([10.1, 10.2, 10.0] * 3, [10.0] * 9, functions=3, bound=1.05)
    note = plan_note(CompileConfig())
    got = recorded(CompileConfig(), _measured(3, notes=(note,)), (within,), ())
    c = got.check.comparisons[-1]
    assert (c.rounds, c.verdict, got.check.slowdown) == (9, "within", c.slowdown)
    assert c.low <= c.slowdown <= c.high and got.check.max_slowdown == 1.05
    assert got.plan.notes == (result_note(within),)  # the plan's "may re-plan" note is answered
    assert "within --max-slowdown 1.05; kept" in str(got.plan.notes[0])


# --- mopar plan says that compile may plan again ----------------------------------------------


def test_a_plan_compile_will_check_says_compile_may_write_another():
    import torch

    import mopar
    from tests.test_pipeline import FREE_CUTS, _layers_of_1mb

    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    split = mopar.partition(_layers_of_1mb(), (x,), platform=FREE_CUTS)
    assert len(split.functions) > 1
    note = split.notes[-1]
    assert isinstance(note, CheckAhead) and note.max_slowdown == 1.05
    assert str(note).startswith("compile measures this plan before writing it")
    assert "slower than --max-slowdown 1.05 beyond the measurement's spread" in str(note)
    fixed = mopar.partition(_layers_of_1mb(), (x,), platform=FREE_CUTS, slices=2)
    assert not any(isinstance(n, CheckAhead) for n in fixed.notes)


def test_the_check_s_notes_are_replaced_by_kind_not_by_their_words():
    """A note that only reads like the check's is kept; the check's own records go."""
    over = compare([13.0] * 9, [10.0] * 9, functions=6, bound=1.05)
    alike = Remark("measured: a plan of 6 functions, said by hand")
    earlier = (plan_note(CompileConfig()), replan_note(over, 1.1, 0.2), alike)
    got = recorded(CompileConfig(), _measured(1, notes=earlier), (over,), ())
    assert alike in got.plan.notes
    assert not any(isinstance(n, (CheckAhead, Replanned)) for n in got.plan.notes)


def test_the_check_s_notes_say_what_they_said_as_sentences():
    """plan.json keeps each note's sentence: the records render the words of before."""
    assert str(plan_note(CompileConfig(max_slowdown=1.1))) == (
        "compile measures this plan before writing it: it serves the plan beside the unsplit "
        "model, requests interleaved, and plans again from the measured times only where the "
        "plan is slower than --max-slowdown 1.1 beyond the measurement's spread (its whole 90% "
        "interval above the bound); the bundle may then hold another plan (--no-check-latency "
        "writes this one)"
    )
    note = plan_note(CompileConfig())
    assert (note.kind, note.max_slowdown, note.confidence) == ("check_ahead", 1.05, CONFIDENCE)

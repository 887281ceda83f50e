"""The DP over split points is exact: on small random problems it equals brute force."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopar.errors import PartitionInfeasibleError
from mopar.planner.cost import Link, Platform, slice_time_ms
from mopar.planner.problem import Problem
from mopar.planner.solve import (
    COST_TOLERANCE,
    SliceModel,
    choose,
    pareto_dp,
    pareto_dp_waiting,
    price,
)

LAMBDA = Platform(
    target="lambda",
    usd_per_gb_s=1.66667e-5,
    usd_per_request=2e-7,
    billing_ms=1,
    min_mb=128,
    max_mb=10240,
    step_mb=1,
    mb_per_vcpu=1769,
    max_vcpus=6,
    vcpus=1,
    links=(
        Link(name="http", latency_ms=1.0, mb_per_s=500.0),
        Link(name="redis", latency_ms=0.5, mb_per_s=300.0),
    ),
    hop_ms=2.0,
    baseline_mb=59.0,
    sync_payload_bytes=6 << 20,
)
OPENFAAS = Platform(
    target="openfaas",
    usd_per_gb_s=3.3e-6,
    usd_per_request=0.0,
    billing_ms=0,
    min_mb=64,
    max_mb=65536,
    step_mb=16,
    mb_per_vcpu=0,
    max_vcpus=0,
    vcpus=2,
    links=(Link(name="shm", latency_ms=0.1, mb_per_s=2000.0),),
    hop_ms=0.3,
    baseline_mb=59.0,
)
KUBERNETES = replace(  # CPU requested and billed apart from memory, chosen per slice
    OPENFAAS,
    usd_per_gb_s=1.1634e-06,
    usd_per_vcpu_s=8.68e-06,
    vcpus=1,
    cpu_grid=(0.1, 0.5, 1.0, 2.0),
)


@st.composite
def problems(draw, max_units: int = 6) -> Problem:
    n = draw(st.integers(1, max_units))
    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False, allow_infinity=False)  # noqa: E731
    t1 = draw(st.lists(floats(0.1, 400.0), min_size=n, max_size=n))
    share = draw(st.lists(floats(0.0, 1.0), min_size=n, max_size=n))
    return Problem(
        names=tuple(f"l{k}" for k in range(n)),
        spans=tuple((k, k + 1) for k in range(n)),
        weight_mb=tuple(draw(st.lists(floats(0.0, 3000.0), min_size=n, max_size=n))),
        transient_mb=tuple(draw(st.lists(floats(0.0, 500.0), min_size=n, max_size=n))),
        t1_ms=tuple(t1),
        par_ms=tuple(t * p for t, p in zip(t1, share)),
        param_bytes=(0,) * n,
        cut_bytes=tuple(draw(st.lists(st.integers(0, 50 << 20), min_size=n + 1, max_size=n + 1))),
        baseline_mb=59.0,
        threads=2.0,
    )


def brute_force(
    model: SliceModel, slices: int | None, bound_ms: float
) -> list[tuple[float, float]]:
    """Every (cost, latency) of every plan: all cut sets x all memory sizes per slice."""
    n = len(model.problem)
    out = []
    for r in range(n):
        for cuts in itertools.combinations(range(1, n), r):
            if slices is not None and r + 1 != slices:
                continue
            bounds = list(zip((0, *cuts), (*cuts, n)))
            choices = [model.sizes(i, j) for i, j in bounds]
            for mems in itertools.product(*choices):
                label = price(model, cuts, mems)
                if label.latency_ms <= bound_ms * (1 + 1e-12):
                    out.append((label.cost_usd, label.latency_ms))
    return out


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto set, float ties as ties: of two points as dear up to float noise, the faster."""
    front: list[tuple[float, float]] = []
    for c, lat in sorted(points):
        if front and lat < front[-1][1] * (1 - 1e-12) and c <= front[-1][0] * (1 + 1e-12):
            front.pop()
        if not front or lat < front[-1][1] * (1 - 1e-12):
            front.append((c, lat))
    return front


def covers(a: tuple[float, float], b: tuple[float, float], tol: float = 1e-9) -> bool:
    """``a`` is at least as good as ``b`` on cost and latency, up to float noise."""
    return a[0] <= b[0] * (1 + tol) + 1e-18 and a[1] <= b[1] * (1 + tol) + 1e-12


def assert_same_frontier(dp, brute):
    """Each frontier covers every point of the other (float ties may pick either twin)."""
    got = [(lab.cost_usd, lab.latency_ms) for lab in dp.frontier]
    want = frontier(brute)
    assert bool(got) == bool(want)
    for p in want:
        assert any(covers(q, p) for q in got), (p, "missed by the DP")
    for p in got:
        assert any(covers(q, p) for q in want), (p, "not a real plan's figures")
    assert abs(len(got) - len(want)) <= max(1, len(want) // 20)


PLATFORMS = st.sampled_from(
    [(LAMBDA, 4), (OPENFAAS, 6), (KUBERNETES, 4)]
)  # Lambda tries ~7 sizes per slice


@settings(max_examples=120, deadline=None)
@given(PLATFORMS, st.sampled_from(["mopar", "paper", "min-memory"]), st.data())
def test_dp_frontier_equals_brute_force(platform_units, pricing, data):
    platform, units = platform_units
    problem = data.draw(problems(units))
    model = SliceModel(
        problem=problem,
        platform=platform,
        paper=pricing == "paper",
        min_memory=pricing == "min-memory",
    )
    dp = pareto_dp(model, label_cap=10**6)
    assert dp.exact
    assert_same_frontier(dp, brute_force(model, None, math.inf))


@settings(max_examples=100, deadline=None)
@given(PLATFORMS, st.data())
def test_dp_with_slice_count_and_bound_equals_brute_force(platform_units, data):
    platform, units = platform_units
    problem = data.draw(problems(units))
    model = SliceModel(problem=problem, platform=platform)
    slices = data.draw(st.integers(1, len(problem)))
    free = brute_force(model, slices, math.inf)
    if not free:
        return
    bound = data.draw(st.floats(min(lat for _, lat in free), max(lat for _, lat in free)))
    dp = pareto_dp(model, slices=slices, bound_ms=bound, label_cap=10**6)
    assert_same_frontier(dp, brute_force(model, slices, bound))
    for label in dp.frontier:  # each frontier plan is what it says it is
        again = price(model, label.cuts, label.sizes)
        assert len(label.cuts) + 1 == slices
        assert math.isclose(again.cost_usd, label.cost_usd, rel_tol=1e-9)
        assert math.isclose(again.latency_ms, label.latency_ms, rel_tol=1e-9)


def test_choose_prefers_the_faster_of_equal_costs():
    # one unit, compute-bound: on Lambda any size below one vCPU costs the same, 1,769 MB is fastest
    problem = Problem(
        names=("a",),
        spans=((0, 1),),
        weight_mb=(100.0,),
        transient_mb=(10.0,),
        t1_ms=(200.0,),
        par_ms=(0.0,),
        param_bytes=(0,),
        cut_bytes=(0, 0),
        baseline_mb=59.0,
        threads=2.0,
    )
    best = choose(pareto_dp(SliceModel(problem=problem, platform=LAMBDA)))
    assert best.memory_mb == (1769,)
    assert best.latency_ms == pytest.approx(200.0, rel=1e-3)


def test_cpu_share_time_model():
    assert slice_time_ms(100.0, 50.0, 0.5) == pytest.approx(200.0)
    assert slice_time_ms(100.0, 50.0, 1.0) == pytest.approx(100.0)
    assert slice_time_ms(100.0, 50.0, 2.0) == pytest.approx(75.0)


def test_a_slice_larger_than_the_platform_is_refused_clearly():
    problem = Problem(
        names=("big",),
        spans=((0, 1),),
        weight_mb=(20000.0,),
        transient_mb=(0.0,),
        t1_ms=(1.0,),
        par_ms=(0.0,),
        param_bytes=(0,),
        cut_bytes=(0, 0),
        baseline_mb=59.0,
    )
    with pytest.raises(PartitionInfeasibleError, match="more than the 10240 MB"):
        price(SliceModel(problem=problem, platform=LAMBDA), ())


@settings(max_examples=80, deadline=None)
@given(PLATFORMS, st.data())
def test_the_dp_of_a_chain_whose_callers_wait_equals_brute_force(platform_units, data):
    """Where each slice is billed while the rest of the chain runs (Lambda's invoke), the
    backward DP over suffixes is exact too."""
    platform, units = platform_units
    model = SliceModel(problem=data.draw(problems(units)), platform=platform)
    n = len(model.problem)
    brute = []
    for r in range(n):
        for cuts in itertools.combinations(range(1, n), r):
            bounds = list(zip((0, *cuts), (*cuts, n)))
            for mems in itertools.product(*(model.sizes(i, j) for i, j in bounds)):
                label = price(model, cuts, mems, waits=True)
                brute.append((label.cost_usd, label.latency_ms))
    dp = pareto_dp_waiting(model, label_cap=10**6)
    assert dp.exact
    assert_same_frontier(dp, brute)


def test_where_cpu_is_its_own_resource_each_slice_gets_the_share_that_pays():
    """Priced per vCPU-second, a fully parallel slice costs about the same at every share (twice
    the CPU, half the time), so the fastest of the near-cheapest wins; a serial slice gains
    nothing above one vCPU, so a larger share only pays more."""
    parallel = Problem(
        names=("l0",),
        spans=((0, 1),),
        weight_mb=(10.0,),
        transient_mb=(1.0,),
        t1_ms=(100.0,),
        par_ms=(100.0,),
        param_bytes=(0,),
        cut_bytes=(0, 0),
        baseline_mb=59.0,
        threads=2.0,
    )
    serial = replace(parallel, par_ms=(0.0,))

    def at(problem, share=None):
        sizes = None if share is None else ((KUBERNETES.round_mb(70.0), share),)
        return price(SliceModel(problem=problem, platform=KUBERNETES), (), sizes)

    for problem in (parallel, serial):
        chosen = at(problem)
        each = [at(problem, c) for c in KUBERNETES.cpu_grid]
        assert chosen.vcpus[0] in KUBERNETES.cpu_grid
        assert chosen.memory_mb == (KUBERNETES.round_mb(70.0),)
        assert chosen.cost_usd <= min(x.cost_usd for x in each) * (1 + COST_TOLERANCE)
    assert at(parallel).vcpus == (2.0,)  # the fastest of shares that cost the same
    assert at(serial, 2.0).latency_ms == at(serial, 1.0).latency_ms
    assert at(serial, 2.0).cost_usd > 1.9 * at(serial, 1.0).cost_usd
    assert at(serial).vcpus[0] <= 1.0


def test_an_answer_over_the_payload_limit_goes_back_through_the_store_and_is_priced():
    """The last slice puts an answer over the payload limit in the store, paying its transfer;
    where no store can carry it, the error names --keep-positions."""
    from mopar.errors import PlanError

    big = Problem(
        names=("a", "b"),
        spans=((0, 1), (1, 2)),
        weight_mb=(10.0, 10.0),
        transient_mb=(1.0, 1.0),
        t1_ms=(5.0, 5.0),
        par_ms=(0.0, 0.0),
        param_bytes=(0, 0),
        cut_bytes=(0, 1000, 8 << 20),
        baseline_mb=59.0,
    )
    lam = replace(LAMBDA, answer_payload_bytes=6 << 20)  # as Lambda's invoke chain has it
    stored = SliceModel(problem=big, platform=lam)
    inline = SliceModel(problem=replace(big, cut_bytes=(0, 1000, 1 << 20)), platform=lam)
    assert (stored.transports[-1], inline.transports[-1]) == ("redis", "response")
    store_ms = LAMBDA.handoff(8 << 20)[1]
    whole, first = (0, 2, 1769, 1.0), (0, 1, 1769, 1.0)
    assert stored.slice(*whole)[0] == pytest.approx(inline.slice(*whole)[0] + store_ms)
    assert stored.slice(*first) == inline.slice(*first)  # not the last: no answer to send
    fastest = min(lb.latency_ms for lb in pareto_dp(stored).frontier)
    assert fastest == pytest.approx(
        min(lb.latency_ms for lb in pareto_dp(inline).frontier) + store_ms
    )
    with pytest.raises(PlanError, match=r"8\.0 MB answer .*--keep-positions last"):
        SliceModel(problem=big, platform=replace(lam, links=LAMBDA.links[:1]))
    assert SliceModel(problem=big, platform=LAMBDA).transports[-1] == "response"  # no limit

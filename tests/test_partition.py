"""Partition: strategies on a real model, the balanced split (against brute force), the Plan, sizing."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle
import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopar.api import facts_for, predict
from mopar.config import PROFILES_DIR, CompileConfig
from mopar.errors import BundleError, Option, PartitionInfeasibleError, PlanError
from mopar.facts import load_platform
from mopar.plan import PLAN_FORMAT_VERSION, REQUEST, RESPONSE, STRATEGIES, Function, Plan, Remark
from mopar.planner import make_plan
from mopar.planner.balanced import balanced_split
from mopar.planner.sizing import cover_peaks

# --- balanced_split -------------------------------------------------------------------------------


def _group_sums(weights, cuts):
    bounds = list(zip((0, *cuts), (*cuts, len(weights))))
    return [sum(weights[lo:hi]) for lo, hi in bounds]


def _brute_force_max(weights, n):
    """The smallest possible heaviest group over every way to cut into n non-empty groups."""
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), n - 1):
        worst = max(_group_sums(weights, cuts))
        best = worst if best is None else min(best, worst)
    return best


@st.composite
def weights_and_n(draw):
    weights = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=9))
    n = draw(st.integers(1, len(weights)))
    return weights, n


@settings(max_examples=300, deadline=None)
@given(weights_and_n())
def test_balanced_split_returns_n_minus_1_increasing_cuts_with_the_optimal_max(case):
    weights, n = case
    cuts = balanced_split(weights, n)
    assert len(cuts) == n - 1
    assert list(cuts) == sorted(set(cuts))
    assert all(0 < c < len(weights) for c in cuts)
    assert max(_group_sums(weights, cuts)) == _brute_force_max(weights, n)


def test_balanced_split_on_a_known_case():
    # [5, 5 | 1, 1, 1, 1, 5 | 5] or similar: the best heaviest group is 10.
    weights = [5, 5, 1, 1, 1, 1, 5, 5]
    cuts = balanced_split(weights, 3)
    assert max(_group_sums(weights, cuts)) == 10


def test_balanced_split_with_all_zero_weights_still_makes_n_groups():
    assert balanced_split([0, 0, 0, 0], 4) == (1, 2, 3)
    assert len(balanced_split([0] * 6, 3)) == 2


@pytest.mark.parametrize("n", [0, 4, -1])
def test_balanced_split_refuses_impossible_group_counts(n):
    with pytest.raises(ValueError, match=r"\[1, 3\]"):
        balanced_split([1, 2, 3], n)


# --- make_plan ------------------------------------------------------------------------------------

SLICED = [s for s in STRATEGIES if s != "unsplit"]


@pytest.fixture(scope="module")
def skipnet_prediction(skipnet_analysis):
    return predict(skipnet_analysis.layers, CompileConfig())


def _make(analysis, prediction, **config):
    config = CompileConfig(**config)
    return make_plan(
        analysis.layers,
        model="skipnet",
        config=config,
        prediction=prediction,
        facts=facts_for(config),
    )


@pytest.mark.parametrize("strategy", SLICED)
def test_every_strategy_makes_exactly_the_requested_slices_covering_every_layer_in_order(
    skipnet_analysis, skipnet_prediction, strategy
):
    lg = skipnet_analysis.layers
    order = [la.name for la in lg.layers]
    for n in range(1, len(lg) + 1):
        plan = _make(skipnet_analysis, skipnet_prediction, slices=n, strategy=strategy)
        assert [s.name for s in plan.functions] == [f"s{i}" for i in range(n)]
        assert [name for s in plan.functions for name in s.layers] == order
        assert plan.strategy == strategy and plan.num_layers == len(lg)
        assert plan.cost_per_1m_usd == pytest.approx(
            sum(s.cost_per_1m_usd for s in plan.functions), rel=1e-4
        )
        assert all(s.memory_mb >= s.need_mb or strategy == "mopar-paper" for s in plan.functions)


@pytest.mark.parametrize("target", ["openfaas", "lambda"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_plans_without_a_slice_count(
    skipnet_analysis, skipnet_prediction, strategy, target
):
    plan = _make(skipnet_analysis, skipnet_prediction, strategy=strategy, target=target)
    assert plan.target == target and plan.latency_ms > 0 and plan.cost_per_1m_usd > 0
    assert plan.handoff(plan.functions[-1].name) == "response"
    if target == "lambda":
        assert all(e.transport in ("http", "redis", "request", "response") for e in plan.edges)


def test_mopar_is_never_costlier_than_a_baseline_within_the_same_bound(
    skipnet_analysis, skipnet_prediction
):
    for n in (2, 3):
        mine = _make(skipnet_analysis, skipnet_prediction, slices=n)
        for other in ("uniform", "params", "latency"):
            theirs = _make(skipnet_analysis, skipnet_prediction, slices=n, strategy=other)
            assert mine.cost_per_1m_usd <= theirs.cost_per_1m_usd * (1 + 1e-3)


@pytest.mark.parametrize("slowdown", [1.0, 1.05, 1.5])
def test_default_bound_is_max_slowdown_times_the_unsplit_latency(
    skipnet_analysis, skipnet_prediction, slowdown
):
    options = {} if slowdown == 1.05 else {"max_slowdown": slowdown}
    plan = _make(skipnet_analysis, skipnet_prediction, **options)
    unsplit = _make(skipnet_analysis, skipnet_prediction, strategy="unsplit")
    assert plan.bound_ms == pytest.approx(slowdown * unsplit.latency_ms, rel=1e-2)
    assert f"latency bound: {slowdown:g} x the unsplit plan's" in str(plan.notes[0])
    assert plan.latency_ms <= plan.bound_ms * (1 + 1e-9)
    # the frontier is priced from unrounded times, the plan from its functions' rounded ones
    cheapest = min(f["cost_per_1m_usd"] for f in plan.frontier)
    assert plan.frontier and cheapest <= plan.cost_per_1m_usd * (1 + 1e-5)


def test_an_impossible_slo_says_by_how_much_and_what_to_relax(skipnet_analysis, skipnet_prediction):
    with pytest.raises(
        PartitionInfeasibleError,
        match=r"no plan meets the latency bound of 0\.0 ms: "
        r"the fastest with any plan takes .* raise --slo-ms to at least \d+",
    ):
        _make(skipnet_analysis, skipnet_prediction, slo_ms=1e-3)
    with pytest.raises(PartitionInfeasibleError, match="or drop --slices"):
        _make(skipnet_analysis, skipnet_prediction, slo_ms=1e-3, slices=2)


def test_slices_count_bytes_flops_and_params(skipnet_analysis, skipnet_prediction):
    lg = skipnet_analysis.layers
    plan = _make(skipnet_analysis, skipnet_prediction, slices=len(lg), strategy="uniform")
    layers = {la.name: la for la in lg.layers}
    for s in plan.functions:
        assert s.param_bytes == sum(layers[n].param_bytes for n in s.layers)
        assert s.flops == sum(layers[n].flops for n in s.layers)
        assert s.memory_mb >= 64
    name = {s.layers[0]: s.name for s in plan.functions}

    def edges(src: str, dst: str) -> list[int]:
        return [e.bytes for e in plan.edges if e.src == src and e.dst == dst]

    # mid2 receives mid1's tanh and, over a skip edge, act's relu: two 2048-byte tensors.
    assert edges(name["mid1"], name["mid2"]) == [2048] and edges(name["act"], name["mid2"]) == [
        2048
    ]
    assert sum(e.bytes for e in plan.edges_in(name["mid2"])) == 2 * 2048
    # act's relu goes to both later slices that read it, an edge to each.
    assert [e.dst for e in plan.edges_out(name["act"])] == [name["mid1"], name["mid2"]]
    assert edges(REQUEST, name["stem"]) == [768]  # the model input
    assert edges(name["head"], RESPONSE) == [1024]  # the model output


@pytest.mark.parametrize("slices", [6, 999])
def test_out_of_range_slices_is_a_plan_error_naming_the_layer_count(
    skipnet_analysis, skipnet_prediction, slices
):
    with pytest.raises(PlanError) as info:
        _make(skipnet_analysis, skipnet_prediction, slices=slices)
    assert (
        str(info.value)
        == f"--slices must be between 1 and 5 (the model has 5 layers), got {slices}"
    )


def test_unknown_strategy_is_a_plan_error_listing_the_known_ones(
    skipnet_analysis, skipnet_prediction
):
    with pytest.raises(
        PlanError, match="unknown --strategy 'magic'; choose one of mopar, mopar-paper"
    ):
        _make(skipnet_analysis, skipnet_prediction, slices=2, strategy="magic")


def test_unsplit_refuses_more_than_one_slice(skipnet_analysis, skipnet_prediction):
    with pytest.raises(PlanError, match="--strategy unsplit makes one slice"):
        _make(skipnet_analysis, skipnet_prediction, slices=2, strategy="unsplit")


# --- Plan -----------------------------------------------------------------------------------------


def _plan() -> Plan:
    from tests.conftest import chain_plan

    return chain_plan(
        [
            Function(name="s0", layers=("a", "b"), memory_mb=128, param_bytes=10, flops=20),
            Function(name="s1", layers=("c",), memory_mb=192, param_bytes=1, flops=2),
        ],
        model="toy",
        strategy="balanced",
        notes=(Remark("a note"),),
    )


def test_plan_round_trips_through_dict_and_json():
    plan = _plan()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert plan.to_dict()["format_version"] == PLAN_FORMAT_VERSION


def test_plan_from_a_real_model_round_trips(skipnet_analysis, skipnet_prediction):
    plan = _make(skipnet_analysis, skipnet_prediction, slices=3)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_plan_and_its_slices_are_frozen():
    plan = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.model = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.functions[0].memory_mb = 1  # type: ignore[misc]


def test_plan_of_another_format_version_is_refused():
    data = _plan().to_dict() | {"format_version": PLAN_FORMAT_VERSION + 1}
    with pytest.raises(BundleError, match="recompile"):
        Plan.from_dict(data)


# --- sizing ---------------------------------------------------------------------------------------


def test_cover_peaks_sizes_openfaas_functions_to_their_measured_peaks_both_ways():
    plan = _plan()
    platform = load_platform(PROFILES_DIR, "openfaas")
    sized = cover_peaks(plan, {"s0": 60.0, "s1": 300.0}, margin=0.15, platform=platform)
    # s0: 60 x 1.15 = 69 MB -> 80 (16 MB steps from 64) < 128; s1: 345 -> 352 > 192.
    assert [s.memory_mb for s in sized.functions] == [80, 352]
    assert [s.layers for s in sized.functions] == [s.layers for s in plan.functions]
    assert any("memory raised: s1 192 -> 352 MB" in n for n in map(str, sized.notes))
    assert any("memory lowered: s0 128 -> 80 MB" in n for n in map(str, sized.notes))
    assert plan.functions[1].memory_mb == 192  # the input Plan is untouched
    exact = {"s0": 128 / 1.15, "s1": 192 / 1.15}
    assert cover_peaks(plan, exact, margin=0.15, platform=platform) == plan


def test_cover_peaks_lowers_lambda_functions_only_by_their_cpu_share():
    plan = _plan()
    platform = load_platform(PROFILES_DIR, "lambda")
    # without its compute per vCPU a function is only raised
    assert cover_peaks(plan, {"s0": 1.0, "s1": 1.0}, margin=0.15, platform=platform) == plan
    sized = cover_peaks(plan, {"s0": 1.0, "s1": 300.0}, margin=0.15, platform=platform)
    assert [s.memory_mb for s in sized.functions] == [128, 345]
    # s0 at 1,769 MB (one vCPU), measured at 300 MB: 345 MB is 5x slower but its wait (2 ms)
    # is billed at 345 MB, not 1,769 MB, so it is cheaper; without a bound it is lowered
    big = replace(plan, functions=(replace(plan.functions[0], memory_mb=1769, time_ms=12.0),))
    big = replace(big, functions=(*big.functions, plan.functions[1]))
    compute = {"s0": (10.0, 0.0)}
    lowered = cover_peaks(
        big, {"s0": 300.0, "s1": 1.0}, margin=0.15, platform=platform, compute=compute
    )
    s0 = lowered.functions[0]
    assert s0.memory_mb == 345 and s0.time_ms == pytest.approx(2.0 + 10.0 * 1769 / 345, 1e-3)
    assert any("memory lowered: s0 1769 -> 345 MB" in n for n in map(str, lowered.notes))
    # a bound the slower function would break keeps the planned size, and says so
    bounded = replace(big, bound_ms=20.0)
    kept = cover_peaks(
        bounded, {"s0": 300.0, "s1": 1.0}, margin=0.15, platform=platform, compute=compute
    )
    assert kept.functions[0].memory_mb == 1769
    assert any("break its latency bound: s0 1769 MB" in n for n in map(str, kept.notes))
    # all-parallel compute above one vCPU: the larger size is cheaper per the CPU-share model
    wide = replace(big, functions=(replace(big.functions[0], memory_mb=3538, time_ms=5.0),))
    wide = replace(wide, functions=(*wide.functions, plan.functions[1]))
    cpu = cover_peaks(
        wide,
        {"s0": 1500.0, "s1": 1.0},
        margin=0.15,
        platform=platform,
        compute={"s0": (10.0, 10.0)},
    )
    assert cpu.functions[0].memory_mb == 3538
    assert any(
        "the CPU-share model prices the planned size lower" in n for n in map(str, cpu.notes)
    )


def test_cover_peaks_holds_a_cap_and_refuses_a_peak_over_it():
    plan = _plan()
    capped = dataclasses.replace(load_platform(PROFILES_DIR, "openfaas"), max_mb=400)
    # s1's peak (380 MB) is under the cap; with the margin it would not be: the cap holds
    sized = cover_peaks(plan, {"s0": 60.0, "s1": 380.0}, margin=0.25, platform=capped)
    assert sized.functions[1].memory_mb == 400
    assert any(
        "at that cap (a smaller margin over the peak): s1 380 MB" in n
        for n in map(str, sized.notes)
    )
    with pytest.raises(PartitionInfeasibleError, match=r"s1 \(layer c\) measured a peak of 404 MB"):
        cover_peaks(plan, {"s0": 60.0, "s1": 404.0}, margin=0.25, platform=capped)


# --- the workload: a memory cap, the cold-start share ---------------------------------------------


@pytest.fixture(scope="module")
def wide_mlp():
    """Four 16 MB Linear layers: each fits a 160 MB function on its own, the model does not
    (baseline 54 MB + 2 x 64 MB of weights)."""
    import torch

    import mopar

    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).eval()
    analysis = mopar.analyze(model, (torch.randn(1, 2048),))
    return analysis, predict(analysis.layers, CompileConfig())


@pytest.mark.parametrize("target", ["openfaas", "lambda"])
def test_max_memory_mb_caps_every_function_splitting_as_needed(wide_mlp, target):
    analysis, prediction = wide_mlp
    unsplit = _make(analysis, prediction, strategy="unsplit", target=target)
    assert unsplit.functions[0].memory_mb > 128
    plan = _make(analysis, prediction, target=target, max_memory_mb=128)
    assert len(plan.functions) > 1
    assert all(f.memory_mb <= 128 for f in plan.functions)
    assert any("--max-memory-mb" in n for n in map(str, plan.notes))


def test_a_layer_larger_than_the_cap_is_named_with_the_fix(wide_mlp):
    analysis, prediction = wide_mlp
    with pytest.raises(
        PartitionInfeasibleError,
        match=r"layer \S+ alone needs \d+ MB, more than the largest openfaas function "
        r"allowed \(80 MB, --max-memory-mb\); raise --max-memory-mb to at least",
    ):
        _make(analysis, prediction, max_memory_mb=80)


def test_cold_starts_are_priced_only_where_init_is_billed(wide_mlp):
    analysis, prediction = wide_mlp
    cost = {
        (target, rate): _make(
            analysis, prediction, strategy="unsplit", target=target, cold_start_rate=rate
        ).cost_per_1m_usd
        for target in ("openfaas", "lambda")
        for rate in (0.0, 0.01, 0.5)
    }
    assert cost["openfaas", 0.0] == cost["openfaas", 0.01] == cost["openfaas", 0.5]
    assert cost["lambda", 0.0] < cost["lambda", 0.01] < cost["lambda", 0.5]
    # one invocation at a fixed size: the rate's share of an INIT, billed like the run
    lam = load_platform(PROFILES_DIR, "lambda")
    init_s = lam.init_ms(64 << 20) / 1e3
    assert init_s > lam.init_base_ms / 1e3 > 0
    for rate in (0.01, 0.5):
        extra = dataclasses.replace(lam, cold_start_rate=rate).cost_usd(
            1024, 10.0, 64 << 20
        ) - lam.cost_usd(1024, 10.0, 64 << 20)
        assert extra == pytest.approx(rate * init_s * lam.usd_per_gb_s, rel=1e-9)


def test_the_notes_say_what_more_latency_would_buy(skipnet_analysis, skipnet_prediction):
    plan = _make(skipnet_analysis, skipnet_prediction, max_slowdown=1.0)
    offers = [n for n in map(str, plan.notes) if n.startswith("more latency would buy")]
    for note in offers:
        assert re.search(r"--max-slowdown [\d.]+: \d+ slices, \d+% cheaper at [\d.]+ ms", note)
    looser = _make(skipnet_analysis, skipnet_prediction, max_slowdown=1.5)
    assert looser.cost_per_1m_usd <= plan.cost_per_1m_usd


# --- chain modes and traffic (docs/billing.md) ----------------------------------------------------


@pytest.mark.parametrize("target", ["openfaas", "lambda"])
def test_the_plan_records_its_chain_mode_and_its_notes_say_which_why_and_the_traffic(
    skipnet_analysis, skipnet_prediction, target
):
    plan = _make(skipnet_analysis, skipnet_prediction, target=target)
    offered = [c.name for c in load_platform(PROFILES_DIR, target).chains]
    assert plan.chain in offered
    notes = "\n".join(map(str, plan.notes))
    assert f"chain mode {plan.chain}: the cheapest within the bound" in notes
    assert re.search(
        r"the bill, \$[\d.e-]+ per 1M requests \(\$[\d.,e+-]+ a month at 1 request/s\), includes the functions. own",
        notes,
    )
    assert "traffic: 1 request/s, Poisson (the default traffic" in notes


def test_a_chain_mode_asked_for_is_the_one_priced_and_an_unknown_one_is_refused(
    skipnet_analysis, skipnet_prediction
):
    event = _make(skipnet_analysis, skipnet_prediction, target="lambda", chain="event")
    assert event.chain == "event"
    assert all(f.cost_per_1m_usd > 0 for f in event.functions)
    with pytest.raises(PlanError, match=r"--chain 'http' is not a chain mode of lambda"):
        _make(skipnet_analysis, skipnet_prediction, target="lambda", chain="http")


@pytest.mark.parametrize("target", ["openfaas", "lambda"])
def test_the_default_plan_is_never_dearer_than_a_compared_row_that_runs_within_the_bound(
    skipnet_analysis, skipnet_prediction, target
):
    from mopar.planner import make_plans

    config = CompileConfig(target=target)
    plans = make_plans(
        skipnet_analysis.layers,
        model="skipnet",
        config=config,
        prediction=skipnet_prediction,
        facts=facts_for(config),
    )
    mopar = plans["mopar"]
    for name, p in plans.items():
        runs = all(f.memory_mb >= f.need_mb - 0.5 for f in p.functions)
        if runs and p.latency_ms <= mopar.bound_ms + 5e-4:
            assert mopar.cost_per_1m_usd <= p.cost_per_1m_usd * 1.01, name
        assert p.chain, name  # every row is priced in a chain mode


def test_idle_replicas_make_a_rare_request_dear_on_openfaas_and_the_plan_never_dearer_than_whole(
    skipnet_analysis, skipnet_prediction
):
    rare = _make(skipnet_analysis, skipnet_prediction, rate=0.001)
    busy = _make(skipnet_analysis, skipnet_prediction, rate=1000.0)
    assert rare.cost_per_1m_usd > 100 * busy.cost_per_1m_usd
    for rate in (0.001, 1000.0):
        plan = _make(skipnet_analysis, skipnet_prediction, rate=rate)
        whole = _make(skipnet_analysis, skipnet_prediction, rate=rate, strategy="unsplit")
        assert plan.cost_per_1m_usd <= whole.cost_per_1m_usd * 1.01
        assert any(f"traffic: {rate:g} requests/s, Poisson" in n for n in map(str, plan.notes))


def test_a_trace_prices_the_plan_and_a_bad_one_is_one_line(
    skipnet_analysis, skipnet_prediction, tmp_path
):
    from mopar.errors import OptionError

    trace = tmp_path / "arrivals.txt"
    trace.write_text("\n".join(str(t * 0.5) for t in range(41)))
    plan = _make(skipnet_analysis, skipnet_prediction, target="lambda", trace=trace)
    assert any("the trace arrivals.txt: 41 arrivals over 20 s" in n for n in map(str, plan.notes))
    trace.write_text("0\n1\nlater\n")
    with pytest.raises(OptionError, match="line 3 is 'later'"):
        _make(skipnet_analysis, skipnet_prediction, target="lambda", trace=trace)


def test_baseline_cuts_never_make_an_empty_slice_however_many_functions_mopar_has(
    skipnet_analysis, skipnet_prediction
):
    # `mopar plan --compare` on a Mixtral-style model with expert functions crashed: the
    # baselines took mopar's function count (expert functions included) as their slice count,
    # more than the model's units, and made empty slices (slice_need_mb(i, i)).
    from mopar.errors import InternalError
    from mopar.planner.strategies import Planner

    config = CompileConfig(target="lambda")
    planner = Planner(
        skipnet_analysis.layers, skipnet_prediction, config, "skipnet", facts_for(config)
    )
    n = len(planner.problem)
    for strategy in ("uniform", "params", "latency"):
        cuts = planner._baseline_cuts(strategy, 10 * n)
        assert list(cuts) == sorted(set(cuts)) and all(0 < c < n for c in cuts)
    with pytest.raises(InternalError, match=r"empty slice"):
        planner.problem.slice_need_mb(2, 2)


@pytest.mark.slow  # 60 s here: the tiny Mixtral's trace; the test above covers the cause
def test_compare_plans_a_mixtral_style_model_with_expert_functions():
    from mopar import api, pipeline
    from mopar.frontend.inputs import parse_input_spec

    tokens = ("input_ids=1x16:int64:0..256", "attention_mask=1x16:int64:1..2")
    analysis = api.analyze("examples.moe:mixtral_tiny", [parse_input_spec(s) for s in tokens])
    config = CompileConfig(expert_group=1, hot_experts="none")
    facts = facts_for(config)
    plans = pipeline.plans(analysis, config, facts, pipeline.profile(analysis, config, facts))
    assert set(plans) == set(STRATEGIES)
    for p in plans.values():
        assert all(f.layers or f.experts for f in p.functions)


def test_compare_marks_a_paper_row_too_small_to_run_and_leaves_out_a_row_that_fits_nothing(
    wide_mlp,
):
    from mopar.planner import make_plans

    analysis, prediction = wide_mlp
    config = CompileConfig(max_memory_mb=128)
    plans = make_plans(
        analysis.layers, model="w", config=config, prediction=prediction, facts=facts_for(config)
    )
    paper = plans["mopar-paper"]
    assert any(f.memory_mb < f.need_mb for f in paper.functions)  # the paper's own sizing
    assert str(paper.notes[0]).startswith("does not fit: a slice of the paper's cuts needs more")
    assert paper.cost_per_1m_usd > 0  # priced, although it would not run
    assert plans["mopar"].strategy == "mopar"
    assert "unsplit" not in plans
    assert any(
        n.startswith("not compared, no plan fits: unsplit: ")
        for n in map(str, plans["mopar"].notes)
    )


def test_a_cap_under_the_margined_prediction_is_planned_without_the_margin():
    """A cap under a layer's prediction with its margin, but over it without: planned, said in
    a note (compile's measured peaks decide); under both, refused naming the smaller need."""
    import torch

    import mopar

    torch.manual_seed(0)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 3, 3, padding=1)
    ).eval()
    x = torch.randn(1, 3, 384, 384)
    plan = mopar.partition(conv, (x,), target="lambda", max_memory_mb=300)
    assert all(f.memory_mb <= 300 for f in plan.functions)
    (note,) = [n for n in map(str, plan.notes) if n.startswith("planned at the memory predictions")]
    need = int(re.search(r"with it, layer \S+ alone needs (\d+) MB", note).group(1))
    assert need > 300
    with pytest.raises(
        PartitionInfeasibleError, match=r"raise max_memory_mb= to at least (\d+)"
    ) as e:
        mopar.partition(conv, (x,), target="lambda", max_memory_mb=200)
    least = int(re.search(r"at least (\d+)", str(e.value)).group(1))
    assert 200 < least <= 300  # the need without the margin, which planning accepts


# --- notes are records ---------------------------------------------------------------------------


def test_pricing_a_plan_again_replaces_its_chain_notes_by_kind_not_by_their_words(
    skipnet_analysis, skipnet_prediction
):
    """A plan priced again at other cuts (`plan_at_cuts`) has one chain-mode, bill and traffic
    note, its own; a note that merely reads like one is kept."""
    from mopar.plan.notes import BillIncludes, ChainMode, Traffic
    from mopar.planner.recut import plan_cuts
    from mopar.planner.strategies import plan_at_cuts

    config = CompileConfig(target="lambda", slices=3)
    base = _make(skipnet_analysis, skipnet_prediction, target="lambda", slices=3)
    alike = Remark("chain mode and traffic: words a note may start with")
    again = plan_at_cuts(
        skipnet_analysis.layers,
        skipnet_prediction,
        config,
        model="skipnet",
        facts=facts_for(config),
        base=replace(base, notes=(*base.notes, alike)),
        cuts=plan_cuts(base)[1:],
    )
    assert len(again.vertical()) == 2
    for kind in (ChainMode, BillIncludes, Traffic):
        assert sum(isinstance(n, kind) for n in base.notes) == 1, kind
        assert sum(isinstance(n, kind) for n in again.notes) == 1, kind
    assert alike in again.notes
    (mode,) = [n for n in again.notes if isinstance(n, ChainMode)]
    assert mode.chain == again.chain and mode.best[0].chain == again.chain
    assert str(mode).startswith(f"chain mode {again.chain}: the cheapest within the bound")
    (bill,) = [n for n in again.notes if isinstance(n, BillIncludes)]
    assert bill.cost_per_1m_usd == again.cost_per_1m_usd
    assert str(bill).startswith(f"the bill, ${again.cost_per_1m_usd:.4g} per 1M requests")


def test_a_plan_keeps_its_notes_sentences_in_json_and_reads_them_back_as_remarks(
    skipnet_analysis, skipnet_prediction
):
    from mopar.plan.notes import ChainMode

    plan = _make(skipnet_analysis, skipnet_prediction, target="lambda")
    assert any(isinstance(n, ChainMode) for n in plan.notes)
    data = json.loads(plan.to_json())
    assert data["notes"] == [str(n) for n in plan.notes]
    back = Plan.from_dict(data)
    assert all(type(n) is Remark for n in back.notes) and back.notes == plan.notes
    assert back.to_json() == plan.to_json()


def test_an_infeasible_plan_says_its_reason_apart_from_its_fix():
    err = PartitionInfeasibleError(
        ("layer c alone needs 900 MB (512 MB, ", Option("max_memory_mb"), ")"),
        "raise ",
        Option("max_memory_mb"),
        " to at least 900",
    )
    assert str(err) == (
        "layer c alone needs 900 MB (512 MB, --max-memory-mb); raise --max-memory-mb to at least 900"
    )
    assert err.why() == "layer c alone needs 900 MB (512 MB, --max-memory-mb)"
    assert err.why("python") == "layer c alone needs 900 MB (512 MB, max_memory_mb=)"
    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.why()) == (str(err), err.why())


def test_an_infeasible_plan_of_one_part_and_no_fix_is_that_part():
    err = PartitionInfeasibleError("no plan fits")
    assert (str(err), err.why(), err.fix) == ("no plan fits", "no plan fits", ())

"""Partition: the balanced solver (against brute force), the Plan, and slice sizing."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mopar.config import CompileConfig
from mopar.errors import BundleError, PlanError
from mopar.partition import PLAN_FORMAT_VERSION, Plan, SlicePlan, make_plan
from mopar.partition.balanced import balanced_split
from mopar.partition.sizing import estimate_memory_mb, size_from_peaks

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


def test_plan_has_exactly_the_requested_slices_covering_every_layer_in_order(skipnet_analysis):
    lg = skipnet_analysis.layers
    order = [la.name for la in lg.layers]
    for n in range(1, len(lg) + 1):
        plan = make_plan(lg, model="skipnet", config=CompileConfig(slices=n))
        assert [s.name for s in plan.slices] == [f"s{i}" for i in range(n)]
        assert [name for s in plan.slices for name in s.layers] == order
        assert all(s.layers for s in plan.slices)
        assert plan.num_layers == len(lg)


def test_plan_slices_count_bytes_flops_and_params(skipnet_analysis):
    lg = skipnet_analysis.layers
    plan = make_plan(lg, model="skipnet", config=CompileConfig(slices=len(lg)))
    layers = {la.name: la for la in lg.layers}
    for s in plan.slices:
        assert s.param_bytes == sum(layers[n].param_bytes for n in s.layers)
        assert s.flops == sum(layers[n].flops for n in s.layers)
        assert s.memory_mb >= 128
    by_layer = {s.layers[0]: s for s in plan.slices}
    # mid2 receives mid1's tanh and, across the cut, act's relu: two 2048-byte tensors.
    assert by_layer["mid2"].in_bytes == 2 * 2048
    # act hands its relu on once, although two later slices read it.
    assert by_layer["act"].out_bytes == 2048
    assert by_layer["stem"].in_bytes == 768  # the model input
    assert by_layer["head"].out_bytes == 1024  # the model output


@pytest.mark.parametrize("slices", [0, 6, 999])
def test_out_of_range_slices_is_a_plan_error_naming_the_layer_count(skipnet_analysis, slices):
    with pytest.raises(PlanError) as info:
        make_plan(skipnet_analysis.layers, model="m", config=CompileConfig(slices=slices))
    assert str(info.value) == (
        f"--slices must be between 1 and 5 (the model has 5 layers), got {slices}"
    )


def test_unknown_strategy_is_a_plan_error_listing_the_known_ones(skipnet_analysis):
    with pytest.raises(PlanError, match="unknown --strategy 'magic'; choose one of balanced"):
        make_plan(skipnet_analysis.layers, model="m",
                  config=CompileConfig(slices=2, strategy="magic"))


# --- Plan -----------------------------------------------------------------------------------------


def _plan() -> Plan:
    return Plan(
        model="toy",
        strategy="balanced",
        slices=(
            SlicePlan(name="s0", layers=("a", "b"), memory_mb=128, param_bytes=10, flops=20,
                      in_bytes=30, out_bytes=40),
            SlicePlan(name="s1", layers=("c",), memory_mb=192, param_bytes=1, flops=2,
                      in_bytes=40, out_bytes=4),
        ),
        memory_source="test",
        notes=("a note",),
    )


def test_plan_round_trips_through_dict_and_json():
    plan = _plan()
    assert Plan.from_dict(plan.to_dict()) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert plan.to_dict()["format_version"] == PLAN_FORMAT_VERSION


def test_plan_from_a_real_model_round_trips(skipnet_analysis):
    plan = make_plan(skipnet_analysis.layers, model="skipnet", config=CompileConfig(slices=3))
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_plan_and_its_slices_are_frozen():
    plan = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.model = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.slices[0].memory_mb = 1  # type: ignore[misc]


def test_plan_of_another_format_version_is_refused():
    data = _plan().to_dict() | {"format_version": PLAN_FORMAT_VERSION + 1}
    with pytest.raises(BundleError, match="recompile"):
        Plan.from_dict(data)


# --- sizing ---------------------------------------------------------------------------------------

RUNTIME = {"runtime_baseline_mb": 59, "weight_copies": 3.0, "activation_copies": 5.0,
           "measured_margin": 0.15, "memory_grid_mb": 64, "min_memory_mb": 128,
           "max_memory_mb": 10240}
MB = 1 << 20


def test_estimate_is_baseline_plus_copies_rounded_up_to_the_grid():
    # 59 MB + 3 x 100 MB + 5 x (1 MB + 2 MB) = 374 MB -> 384 MB on a 64 MB grid.
    got = estimate_memory_mb(param_bytes=100 * MB, io_bytes=1 * MB, peak_activation_bytes=2 * MB,
                             runtime=RUNTIME)
    assert got == 384


def test_estimate_is_clamped_to_the_platform_limits():
    assert estimate_memory_mb(param_bytes=0, io_bytes=0, peak_activation_bytes=0,
                              runtime=RUNTIME) == 128
    assert estimate_memory_mb(param_bytes=100_000 * MB, io_bytes=0, peak_activation_bytes=0,
                              runtime=RUNTIME) == 10240


def test_size_from_peaks_adds_the_margin_and_rounds_to_the_grid():
    plan = _plan()
    sized = size_from_peaks(plan, {"s0": 100.0, "s1": 300.0}, RUNTIME)
    # 100 x 1.15 = 115 -> 128; 300 x 1.15 = 345 -> 384.
    assert [s.memory_mb for s in sized.slices] == [128, 384]
    assert [s.layers for s in sized.slices] == [s.layers for s in plan.slices]
    assert sized.memory_source.startswith("measured")
    assert plan.slices[1].memory_mb == 192  # the input Plan is untouched

"""`mopar bench`: the quick suite runs end to end through the real runtime, writes the issue's
schema, and every metric follows its definition from the per-slice measurements it stores.
No test asserts a timing."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.metrics import (
    SliceMeasure,
    geomean,
    ideal_mc_gb_s,
    lambda_cost_per_1m_usd,
    lambda_slice_ms,
    mc_gb_s,
    mem_util,
    oom_count,
    openfaas_cost_per_1m_usd,
)
from mopar.config import PROFILES_DIR
from mopar.facts import load_platform
from tests.conftest import mopar, nonblank_lines

RUN_KEYS = {
    "model",
    "family",
    "workload",
    "strategy",
    "slices",
    "mc_gb_s",
    "cost_per_1m_openfaas_usd",
    "cost_per_1m_lambda_usd",
    "p50_ms",
    "p95_ms",
    "mem_util",
    "oom",
    "max_rel_err",
    "ideal_mc_gb_s",
}
CHARTS = ("mc.png", "cost.png", "p95.png")


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[Path, dict]:
    """``mopar bench --quick`` run once, as a real subprocess."""
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = mopar("bench", "--quick", "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def _platforms():
    return {t: load_platform(PROFILES_DIR, t) for t in ("openfaas", "lambda")}


def _slices(row: dict) -> list[SliceMeasure]:
    fields = SliceMeasure.__dataclass_fields__
    return [
        SliceMeasure(**{k: v for k, v in s.items() if k in fields}) for s in row["slice_details"]
    ]


# --- the quick suite, end to end ------------------------------------------------------------------


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_writes_results_json_markdown_and_charts(quick):
    out, doc = quick
    assert (out / "results.md").read_text().startswith("# mopar bench results")
    for name in CHARTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_results_follow_the_issue_schema(quick):
    _, doc = quick
    assert isinstance(doc["machine"], dict) and doc["machine"]["cores"] >= 1
    assert {(r["model"], r["strategy"]) for r in doc["runs"]} == {
        (m, s)
        for m in ("resnet50", "gcn")
        for s in ("torch-unsplit", "unsplit", "mopar", "uniform", "mopar+http")
    }
    for r in doc["runs"]:
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["slices"] == len(r["slice_details"]) >= 1
        for key in RUN_KEYS - {"model", "family", "workload", "strategy", "slices", "oom"}:
            value = r[key]
            assert isinstance(value, float) and math.isfinite(value) and value >= 0, (key, value)
    assert doc["config"]["quick"] is True and doc["config"]["slo_factor"] == 1.05
    assert not doc["failures"]


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_measures_eager_pytorch_as_the_reference_users_would_deploy(quick):
    _, doc = quick
    for model in ("resnet50", "gcn"):
        torch_run = next(
            r for r in doc["runs"] if (r["model"], r["strategy"]) == (model, "torch-unsplit")
        )
        onnx_run = next(r for r in doc["runs"] if (r["model"], r["strategy"]) == (model, "unsplit"))
        assert torch_run["slices"] == 1 and torch_run["predicted_latency_ms"] is None
        # one process holding torch: its peak is above onnxruntime's for the same model
        assert (
            torch_run["slice_details"][0]["peak_rss_mb"]
            > onnx_run["slice_details"][0]["peak_rss_mb"]
        )
    names = {g["goal"] for g in doc["goals"]}
    assert "MC lower than eager PyTorch unsplit (geomean, torch / mopar)" in names


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_outputs_match_the_original_model_on_every_request(quick):
    _, doc = quick
    for r in doc["runs"]:
        assert r["errors"] == 0 and r["requests"] == doc["config"]["requests"]
        assert r["max_rel_err"] <= doc["config"]["tolerance"], (r["model"], r["strategy"])


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_oom_is_a_count_of_slices_over_their_allocation_never_hidden(quick):
    _, doc = quick
    for r in doc["runs"]:
        assert isinstance(r["oom"], int) and not isinstance(r["oom"], bool)
        over = [s for s in r["slice_details"] if s["peak_rss_mb"] > s["allocated_mb"]]
        assert r["oom"] == len(over)
        assert all(s["oom"] == (s["peak_rss_mb"] > s["allocated_mb"]) for s in r["slice_details"])


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_metrics_follow_their_definitions_from_the_stored_slice_figures(quick):
    _, doc = quick
    plat = _platforms()
    threads = doc["machine"]["threads"]
    for r in doc["runs"]:
        s = r["slice_details"]
        mc = sum(x["allocated_mb"] / 1024 * x["p50_ms"] / 1000 for x in s)
        util = sum(x["peak_rss_mb"] * x["p50_ms"] for x in s) / sum(
            x["allocated_mb"] * x["p50_ms"] for x in s
        )
        lam = sum(plat["lambda"].cost_usd(x["lambda_mb"], x["lambda_ms"]) for x in s) * 1e6
        assert r["mc_gb_s"] == pytest.approx(mc, rel=1e-5)
        assert r["mem_util"] == pytest.approx(util, rel=1e-5)
        assert r["cost_per_1m_openfaas_usd"] == pytest.approx(
            openfaas_cost_per_1m_usd(_slices(r), plat["openfaas"], threads=threads), rel=1e-5
        )
        assert r["cost_per_1m_lambda_usd"] == pytest.approx(lam, rel=1e-4)
        assert r["cost_per_1m_lambda_usd"] == pytest.approx(
            lambda_cost_per_1m_usd(_slices(r), plat["lambda"], threads=threads), rel=1e-5
        )
        # allocated is the plan's size, not the one compile raised to the measured peak
        assert all(x["allocated_mb"] <= x["deployed_mb"] for x in s)
        assert 0 < r["ideal_mc_gb_s"] <= r["mc_gb_s"]


@pytest.mark.slow  # a whole `mopar bench --quick` (50 s); its parts are tested below
def test_quick_markdown_has_the_table_the_family_ratios_and_what_was_not_run(quick):
    out, doc = quick
    text = (out / "results.md").read_text()
    assert "| model | family | request | strategy | slices | MC |" in text
    assert "## Geomean ratios vs unsplit, per family" in text
    assert "## Goals (mopar)" in text
    for r in doc["runs"]:
        assert f"| {r['model']} |" in text
    # mopar keeps tiny models whole: its plan is unsplit's, built and measured once, and said so
    assert "mopar = unsplit" in text
    assert doc["family_ratios"]["all"]["unsplit"]["mc"] == 1.0


def test_bench_refuses_an_unknown_model_in_one_line():
    proc = mopar("bench", "--models", "resnet5", "--out", "/nonexistent/never-written", timeout=60)
    assert proc.returncode == 1
    lines = nonblank_lines(proc.stderr)
    assert len(lines) == 1
    assert "unknown bench model 'resnet5'" in lines[0] and "resnet50" in lines[0]


# --- metrics on hand-made figures -----------------------------------------------------------------


def _slice(
    name="s0", allocated=256.0, peak=200.0, ms=10.0, parallel=0.0, in_bytes=0
) -> SliceMeasure:
    return SliceMeasure(
        name=name,
        layers=1,
        allocated_mb=allocated,
        deployed_mb=max(allocated, peak * 1.25),
        need_mb=allocated,
        peak_rss_mb=peak,
        p50_ms=ms,
        p95_ms=ms,
        in_bytes=in_bytes,
        parallel=parallel,
    )


def test_mc_is_allocated_gb_times_measured_seconds_summed_over_slices():
    s = [_slice(allocated=1024, ms=500), _slice(allocated=512, ms=100)]
    assert mc_gb_s(s) == pytest.approx(1.0 * 0.5 + 0.5 * 0.1)


def test_an_oom_is_counted_and_priced_at_the_allocated_size():
    s = [_slice(allocated=128, peak=300, ms=100), _slice(allocated=512, peak=100, ms=100)]
    assert oom_count(s) == 1
    assert mc_gb_s(s) == pytest.approx((128 + 512) / 1024 * 0.1)
    assert mc_gb_s(s, deployed=True) > mc_gb_s(s)
    assert mem_util(s) == pytest.approx((300 + 100) / (128 + 512))


def test_memory_utilisation_is_weighted_by_time():
    s = [_slice(allocated=100, peak=100, ms=900), _slice(allocated=100, peak=10, ms=100)]
    assert mem_util(s) == pytest.approx((100 * 900 + 10 * 100) / (100 * 1000))


def test_openfaas_cost_is_reserved_memory_and_cpu_times_time():
    plat = load_platform(PROFILES_DIR, "openfaas")
    s = [_slice(allocated=2048, ms=1000)]  # serial: 1 s at one vCPU, the share of a request of 0
    one = 2 * plat.usd_per_gb_s + plat.vcpus * plat.usd_per_vcpu_s
    assert openfaas_cost_per_1m_usd(s, plat, threads=1) == pytest.approx(one * 1e6)
    half = [replace(s[0], vcpus=0.5)]  # half a vCPU: twice as long, at half the CPU price
    assert openfaas_cost_per_1m_usd(half, plat, threads=1) == pytest.approx(
        (4 * plat.usd_per_gb_s + plat.usd_per_vcpu_s) * 1e6
    )


def test_lambda_time_scales_the_measured_time_by_the_cpu_share_of_the_allocation():
    lam = load_platform(PROFILES_DIR, "lambda")
    serial = _slice(allocated=lam.mb_per_vcpu / 4, ms=10.0, parallel=0.0)
    assert lambda_slice_ms(serial, lam, threads=2, first=True) == pytest.approx(40.0, rel=1e-2)
    parallel = _slice(allocated=lam.mb_per_vcpu, ms=10.0, parallel=1.0)  # 2 cores -> 1 vCPU
    assert lambda_slice_ms(parallel, lam, threads=2, first=True) == pytest.approx(20.0)
    later = _slice(allocated=lam.mb_per_vcpu, ms=10.0, parallel=1.0, in_bytes=1 << 20)
    assert lambda_slice_ms(later, lam, threads=2, first=False) == pytest.approx(
        20.0 + lam.handoff(1 << 20)[1]
    )


def test_lambda_cost_pays_a_request_fee_per_slice():
    lam = load_platform(PROFILES_DIR, "lambda")
    one = lambda_cost_per_1m_usd([_slice(allocated=1769, ms=1.0, parallel=1.0)], lam, threads=1)
    assert one == pytest.approx((1769 / 1024 * 1e-3 * lam.usd_per_gb_s + lam.usd_per_request) * 1e6)
    # the second slice also pays its handoff (>= 1 billed ms more) and its own request fee
    two = lambda_cost_per_1m_usd([_slice(allocated=1769, ms=1.0, parallel=1.0)] * 2, lam, threads=1)
    assert two >= 2 * one


def test_ideal_and_geomean():
    assert ideal_mc_gb_s([1024, 2048], [1000, 500]) == pytest.approx(1.0 + 1.0)
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(geomean([])) and math.isnan(geomean([1.0, math.nan]))


def test_ablations_that_do_not_exist_yet_are_skipped_with_a_reason():
    from benchmarks.suite import resolve_variants

    names = ("mopar", "mopar+min-memory", "mopar+http", "mopar+no-codec", "mopar+horizontal")
    variants, skipped = resolve_variants(names, target="openfaas")
    assert [v.label for v in variants] == [
        "mopar",
        "mopar+min-memory",
        "mopar@lambda",
        "mopar+http",
        "mopar+horizontal",
    ]
    assert {s["label"] for s in skipped} == {"mopar+no-codec"}
    assert all(s["reason"] for s in skipped)
    ablation = variants[1]
    assert ablation.min_memory and ablation.target == "lambda" and ablation.strategy == "mopar"
    http = variants[3]
    assert http.transport == "http" and http.strategy == "mopar" and http.target is None
    assert variants[0].parallel == 1 and variants[4].parallel == 2


def test_suite_has_twelve_models_in_four_families_with_requests_from_kb_to_tens_of_mb():
    import numpy as np

    from benchmarks.suite import SUITE
    from examples import EXAMPLES
    from mopar.frontend import parse_input_spec

    assert len(SUITE) == 12 and set(SUITE) <= set(EXAMPLES)
    counts = {
        f: sum(m.family == f for m in SUITE.values()) for f in ("cnn", "rnn", "gcn", "transformer")
    }
    assert counts == {"cnn": 4, "rnn": 2, "gcn": 2, "transformer": 4}
    sizes = [
        sum(
            int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
            for s in map(parse_input_spec, m.inputs)
        )
        for m in SUITE.values()
    ]
    assert min(s for s, m in zip(sizes, SUITE.values()) if m.family != "transformer") < 200 * 1024
    assert max(sizes) > 50 * 2**20


def _record(label: str, slices: list[SliceMeasure]):
    from benchmarks.runner import RunRecord

    return RunRecord(
        label=label,
        strategy=label,
        ablation=None,
        target="openfaas",
        slices=tuple(slices),
        p50_ms=sum(s.p50_ms for s in slices),
        p95_ms=sum(s.p95_ms for s in slices),
        requests=5,
        errors=0,
        max_rel_err=1e-7,
        predicted_latency_ms=1.0,
        predicted_mc_gb_s=1.0,
        slo_ms=None,
        bound_ms=None,
        shares_bundle_with=None,
        notes=(),
    )


def test_an_oom_run_is_shown_in_every_output(tmp_path):
    from benchmarks.config import BenchConfig
    from benchmarks.report import write_results
    from benchmarks.runner import BenchResults, ModelResult, machine_info

    model = ModelResult(
        name="m",
        family="cnn",
        workload="w",
        request_bytes=1000,
        layers=2,
        layer_memory_mb=(50.0, 100.0),
        layer_time_ms=(5.0, 5.0),
        ideal_time="test",
        runs=(
            _record("unsplit", [_slice(allocated=512, peak=300, ms=10)]),
            _record(
                "mopar",
                [
                    _slice("s0", allocated=128, peak=200, ms=5),
                    _slice("s1", allocated=256, peak=100, ms=5),
                ],
            ),
        ),
        skipped=({"label": "uniform", "reason": "no plan"},),
    )
    results = BenchResults(
        config=BenchConfig(models=("m",), variants=("unsplit", "mopar")),
        machine=machine_info(),
        models=(model,),
        skipped=({"label": "mopar+http", "reason": "not yet"},),
        failures=(),
        wall_s=1.0,
    )
    doc, paths = write_results(results, tmp_path)
    mopar_row = next(r for r in doc["runs"] if r["strategy"] == "mopar")
    assert mopar_row["oom"] == 1 and mopar_row["slice_details"][0]["oom"] is True
    assert mopar_row["mc_gb_s"] == pytest.approx((128 + 256) / 1024 * 0.005)
    assert doc["family_ratios"]["cnn"]["mopar"]["oom"] == 1
    goal = next(g for g in doc["goals"] if g["goal"].startswith("zero OOMs"))
    assert goal == {"goal": goal["goal"], "value": 1, "met": False}
    text = (tmp_path / "results.md").read_text()
    assert "| m | cnn | 1000 B | mopar | 2 |" in text and "| 1 | 1.0e-07 |" in text
    assert "`mopar+http`: skipped, not yet." in text
    assert "m `uniform`: could not be planned: no plan" in text
    assert {p.name for p in paths} == {"results.json", "results.md", *CHARTS}


def test_a_functions_floor_counts_weights_and_the_largest_live_activations(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from benchmarks.floor import function_floor

    # x (1 KB) -> Relu -> a (1 KB) -> MatMul w (64 KB of weights) -> b (1 KB) -> Add x -> y
    w = numpy_helper.from_array(np.ones((128, 128), np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["a"]),
            helper.make_node("MatMul", ["a", "w"], ["b"]),
            helper.make_node("Add", ["b", "x"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 128])],
        [w],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), str(path))
    floor = function_floor(path, baseline_mb=40.0)
    kb = 1024 / 2**20
    assert floor.weights_mb == pytest.approx(64 * kb)
    # at the MatMul, x (kept for the Add), a and b are live; at the Add, x, b and y
    assert floor.live_mb == pytest.approx(3 * kb)
    assert floor.unknown == 0
    assert floor.floor_mb == pytest.approx(40.0 + 1.1 * 64 * kb + 3 * kb)

"""The partition engine end to end: every strategy on every example family plans a valid,
runnable split; ``mopar plan`` reports, compares, draws and refuses clearly."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from examples import EXAMPLES
from mopar import api
from mopar.cli import cli
from mopar.config import CompileConfig
from mopar.emit.onnx_export import run_slices_torch
from mopar.planner import STRATEGIES
from mopar.rewrite import output_values, split_by_plan
from tests.conftest import nonblank_lines

FAMILIES = {}
for _ex in EXAMPLES.values():  # the first example of each family
    FAMILIES.setdefault(_ex.family, _ex)


@pytest.fixture(scope="module")
def family_analysis(request):
    ex = FAMILIES[request.param]
    analysis = api.analyze(ex.tiny_factory, list(ex.tiny_inputs))
    return analysis, api.predict(analysis.layers, CompileConfig())


# Every family on OpenFaaS and the transformer on Lambda by default: the split each plan makes
# runs the same whatever target priced it; the other families on Lambda run with the slow ones.
LAMBDA_DEFAULT = "transformer"


@pytest.mark.parametrize(
    "family_analysis, target",
    [
        pytest.param(
            family,
            target,
            id=f"{family}-{target}",
            marks=[pytest.mark.slow] if target == "lambda" and family != LAMBDA_DEFAULT else [],
        )
        for family in sorted(FAMILIES)
        for target in ("openfaas", "lambda")
    ],
    indirect=["family_analysis"],
)
def test_every_strategy_plans_a_runnable_split_of_every_family(family_analysis, target):
    analysis, prediction = family_analysis
    lg, cm = analysis.layers, analysis.captured
    want = [torch.from_numpy(cm.reference[name]) for name in cm.output_names]
    for strategy in STRATEGIES:
        for slices in (None,) if strategy == "unsplit" else (None, 3):
            config = CompileConfig(strategy=strategy, slices=slices, target=target)
            plan = api.plan_from(analysis, config, prediction)
            assert [name for s in plan.functions for name in s.layers] == [
                la.name for la in lg.layers
            ]
            if slices:
                assert len(plan.functions) == slices
            assert all(s.memory_mb > 0 and s.time_ms > 0 for s in plan.functions)
            parts = split_by_plan(lg, plan)
            values = run_slices_torch(parts, cm.inputs)
            got = [values[v] for v in output_values(lg)]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# --- the command ---------------------------------------------------------------------------------

MLP = ["tests.models:mlp", "--input", "x=1x16:float32"]
FUNCTION_KEYS = {"name", "kind", "layers", "memory_mb", "time_ms", "artifact"}
EDGE_KEYS = {"src", "dst", "tensors", "bytes", "transport", "probability", "probability_source"}
PLAN_KEYS = {
    "strategy",
    "target",
    "functions",
    "edges",
    "cost_per_1m_usd",
    "latency_ms",
    "mc_gb_s",
    "format_version",
}


def _plan(*args: str):
    result = CliRunner().invoke(cli, ["plan", *MLP, *args])
    return result


def test_plan_json_has_the_documented_keys():
    result = _plan("--json", "--slices", "2", "--target", "lambda")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert PLAN_KEYS <= set(doc)
    assert doc["target"] == "lambda" and len(doc["functions"]) == 2 and doc["format_version"] == 3
    for f in doc["functions"]:
        assert FUNCTION_KEYS <= set(f)
    for e in doc["edges"]:
        assert EDGE_KEYS <= set(e)
    s0, s1 = (f["name"] for f in doc["functions"])
    kinds = {(e["src"], e["dst"]): e["transport"] for e in doc["edges"]}
    assert kinds[("<request>", s0)] == "request" and kinds[(s1, "<response>")] == "response"
    assert kinds[(s0, s1)] in ("http", "redis")  # Lambda has no shared memory


def test_compare_json_has_every_strategy_with_its_figures():
    result = _plan("--json", "--compare", "--slices", "2")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc["compare"]) == set(STRATEGIES)
    for figures in doc["compare"].values():
        assert set(figures) == {
            "slices",
            "functions",
            "chain",
            "cost_per_1m_usd",
            "latency_ms",
            "mc_gb_s",
            "fits",
            "within_bound",
        }
    assert doc["compare"]["unsplit"]["slices"] == 1
    assert all(doc["compare"][s]["slices"] == 2 for s in STRATEGIES if s != "unsplit")


def test_compare_and_pareto_print_tables_and_the_plot_is_a_png(tmp_path):
    png = tmp_path / "plan.png"
    result = _plan("--compare", "--pareto", "--plot", str(png))
    assert result.exit_code == 0, result.stderr
    for text in (
        "plan for mlp (mopar on openfaas",
        "strategies (predicted: same sizing rule, same bill, same traffic)",
        "cost/latency frontier",
        "mopar-paper",
        f"wrote {png}",
    ):
        assert text in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_impossible_slo_is_one_line_and_exit_1():
    result = _plan("--slo-ms", "0.001")
    assert result.exit_code == 1
    (line,) = nonblank_lines(result.stderr)
    assert (
        line.startswith("error: no plan meets the latency bound of 0.0 ms") and "--slo-ms" in line
    )


def test_an_unknown_strategy_or_target_is_refused_with_the_choices():
    result = _plan("--strategy", "magic")
    assert result.exit_code != 0 and "mopar-paper" in result.stderr
    result = _plan("--target", "azure")
    assert result.exit_code != 0 and "lambda" in result.stderr


def test_plan_always_prints_its_bill_against_unsplit_and_the_json_carries_it():
    result = _plan("--target", "lambda", "--rate", "5")
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert re.search(
        r"bill: \$[\d.]+ per 1M requests in chain mode (invoke|stepfunctions|event), "
        r"[\d.]+x the unsplit plan's \$[\d.]+ \(one function, chain mode \w+",
        text,
    )
    assert "bill includes (per 1M requests): compute $" in text
    assert "bill traffic: 5 requests/s, Poisson" in text
    doc = json.loads(_plan("--json", "--target", "lambda").stdout)
    bill = doc["bill"]
    assert bill["chain"] == doc["chain"] and bill["traffic"].startswith("1 request/s, Poisson")
    assert set(bill["unsplit"]) == {"chain", "cost_per_1m_usd", "usd_per_month", "latency_ms"}
    assert bill["cost_per_1m_usd"] == pytest.approx(doc["cost_per_1m_usd"], rel=1e-5)
    parts = bill["includes_per_1m_usd"]
    assert sum(parts.values()) == pytest.approx(bill["cost_per_1m_usd"], rel=1e-9)
    assert parts["fees_usd"] == pytest.approx(0.2 * len(doc["functions"]))


def test_a_bad_trace_or_both_traffics_are_one_line_and_exit_1(tmp_path):
    trace = tmp_path / "t.txt"
    trace.write_text("0.0\n0.1\nnoon\n")
    result = _plan("--trace", str(trace))
    assert result.exit_code == 1
    (line,) = nonblank_lines(result.stderr)
    assert line.startswith("error: --trace ") and "line 3 is 'noon'" in line
    result = _plan("--trace", str(trace), "--rate", "2")
    assert result.exit_code == 1
    (line,) = nonblank_lines(result.stderr)
    assert "give either --rate or --trace" in line

"""``mopar bench --traffic``: plans made for each rate, simulated at every rate, against unsplit."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from benchmarks.traffic import TrafficConfig, cells, run_traffic_bench, traffic_markdown
from mopar.cli import cli


@pytest.fixture(scope="module")
def gcn_rows(tmp_path_factory):
    config = TrafficConfig(
        models=("gcn",), targets=("openfaas",), rates=(0.1, 100.0), requests=300, quick=True
    )
    return run_traffic_bench(config, tmp_path_factory.mktemp("traffic"))


def test_every_plan_is_simulated_at_every_rate_and_each_cell_holds_the_plan_for_its_rate(
    gcn_rows,
):
    plans = {(r.plan, r.planned_rps) for r in gcn_rows}
    assert plans == {
        ("default", None),
        *((p, r) for p in ("unsplit", "rate") for r in (0.1, 100.0)),
    }
    assert len(gcn_rows) == len(plans) * 2  # each at both rates
    found = cells(gcn_rows)
    assert [(c.unsplit.rate_rps, c.rate.planned_rps) for c in found] == [(0.1, 0.1), (100, 100)]
    for c in found:
        assert c.unsplit.functions == 1 and c.ratio("unsplit") == pytest.approx(1.0)
        assert c.default.planned_rps is None
        assert c.rate.sim_usd_per_m and c.unsplit.sim_usd_per_m


def test_at_a_low_rate_openfaas_bills_the_idle_replica_for_each_request(gcn_rows):
    # OpenFaaS CE keeps one replica of each function, busy or idle: at 0.1 req/s each request
    # carries the replica's memory and CPU for the 10 s between requests
    from mopar.config import PROFILES_DIR
    from mopar.facts import load_platform

    platform = load_platform(PROFILES_DIR, "openfaas")
    (unsplit,) = (r for r in gcn_rows if r.plan == "unsplit" and r.rate_rps == r.planned_rps == 0.1)
    expected = platform.usd_per_s(unsplit.memory_mb, unsplit.vcpus) * 10 * 1e6
    assert unsplit.sim_usd_per_m == pytest.approx(expected, rel=0.15)  # Poisson: 300 +- 17


def test_the_table_has_one_line_per_cell(gcn_rows):
    lines = traffic_markdown(gcn_rows).splitlines()
    assert len(lines) == 2 + 2 and lines[2].startswith("| gcn | ")


def test_bench_traffic_writes_its_table_json_and_chart(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli,
        ["bench", "--traffic", "1", "--quick", "--models", "lstm_cnn", "--out", str(out), "--json"],
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["traffic"]
    assert {r["target"] for r in rows} == {"lambda", "openfaas"}
    assert {r["plan"] for r in rows} == {"unsplit", "default", "rate"}
    assert (out / "traffic.png").stat().st_size > 0
    assert json.loads((out / "traffic.json").read_text())["traffic"] == rows


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--traffic", "fast"], "rates must be positive numbers"),
        (["--traffic", "0,1"], "rates must be positive numbers"),
        (["--traffic", "1", "--models", "nope"], "no model 'nope' in the traffic benchmark"),
    ],
)
def test_bad_traffic_options_are_refused_in_one_line(args, message, tmp_path):
    result = CliRunner().invoke(cli, ["bench", *args, "--out", str(tmp_path)])
    assert result.exit_code != 0 and message in result.output

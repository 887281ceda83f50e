"""The platform simulator (`mopar.sim`) and the bill of what ``mopar run`` served.

Hand-built functions with fixed service times, on platforms built in code, under arrivals given
as timestamps: every latency, cold start and dollar is computed by hand here and checked
exactly. Then the traffic shapes, the trace file, determinism, the CLI in process, and the bill
of a run from its recorded requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from mopar.bill import Invocation, invocation_usd
from mopar.bundle.document import BundleDocument, read_document
from mopar.cli import cli
from mopar.errors import OptionError
from mopar.facts import ChainFacts, Platform
from mopar.plan import Function
from mopar.runner.load import poisson_arrivals
from mopar.runner.report import RunReport, Served, SliceStats, Span
from mopar.sim import (
    PoolRules,
    SimConfig,
    SimFunction,
    Traffic,
    arrivals,
    bill_run,
    read_trace,
    simulate,
)
from mopar.sim.model import ServiceTimes, cpu_factor, functions_of
from tests.conftest import chain_plan

GB_S = 1e-5  # a round price: USD per GB-s
FEE = 2e-7  # USD per request

LAMBDA = Platform(
    target="lambda",
    usd_per_gb_s=GB_S,
    usd_per_request=FEE,
    billing_ms=1,
    min_mb=128,
    max_mb=10240,
    step_mb=1,
    mb_per_vcpu=1024,  # 1,024 MB = 1 vCPU: the functions below get exactly 1
    max_vcpus=6,
    vcpus=0,
    links=(),
    hop_ms=0.5,
    baseline_mb=50,
    bills_init=True,
    chains=tuple(ChainFacts(name=n) for n in ("invoke", "stepfunctions", "event")),
)
OPENFAAS = replace(
    LAMBDA,
    target="openfaas",
    usd_per_request=0.0,
    billing_ms=0,
    mb_per_vcpu=0,
    vcpus=1,
    reserved=True,
    min_replicas=1,
    chains=tuple(ChainFacts(name=n) for n in ("http", "callback", "shm")),
)
KEEP = PoolRules(keep_alive_s=600.0, min_instances=0, max_instances=10, concurrency=1, source="t")


def fn(name: str, own_ms: float, init_ms: float = 100.0, memory_mb: int = 1024) -> SimFunction:
    """A function that always takes ``own_ms`` at 1 vCPU."""
    return SimFunction(
        name=name,
        memory_mb=memory_mb,
        init_ms=init_ms,
        init_source="test",
        service=ServiceTimes(median_ms=own_ms, vcpus=1.0, source="test"),
    )


TWO = (fn("s0", 10.0, init_ms=100.0), fn("s1", 20.0, init_ms=200.0))


def sim(functions, times, *, platform=LAMBDA, chain="invoke", rules=KEEP, **config):
    cfg = SimConfig(rules=rules, chain=chain, **config)
    return simulate(functions, platform, np.asarray(times, dtype=float), cfg)


def usd(memory_mb: float, ms: float, *, fee: float = FEE) -> float:
    return memory_mb / 1024 * ms / 1e3 * GB_S + fee


# --- one request, by hand -------------------------------------------------------------------------


def test_a_warm_invoke_chain_bills_the_callers_wait_for_the_rest_of_the_path():
    result = sim(TWO, [0.0, 100.0, 200.0])
    # s0 runs 10 ms, hands on (0.5 ms hop), waits for s1's 20 ms: billed ceil(30.5) = 31 ms
    assert result.p50_ms == result.p99_ms == 30.5
    per_request = usd(1024, 31) + usd(1024, 20)
    assert result.usd == pytest.approx(3 * per_request, rel=1e-12)
    assert result.cost_per_1m_usd == pytest.approx(per_request * 1e6, rel=1e-5)
    s0, s1 = result.functions
    assert (s0.invocations, s0.cold_starts, s0.instances, s0.p50_ms) == (3, 0, 1, 10.0)
    assert s0.cost_per_1m_usd == pytest.approx(usd(1024, 31) * 1e6, rel=1e-5)
    assert result.cold_share == 0


def test_an_event_chain_bills_each_function_its_own_time_only():
    result = sim(TWO, [0.0, 100.0], chain="event")
    assert result.p50_ms == 30.5  # the same path, nobody waiting on it
    assert result.usd == pytest.approx(2 * (usd(1024, 10) + usd(1024, 20)), rel=1e-12)


def test_a_cold_chain_pays_each_init_once_and_the_caller_waits_through_the_callees_start():
    result = sim(TWO, [0.0], initial_instances=0)
    # s0 starts (100 ms), runs 10, hands on; s1 starts (200 ms) while s0 waits, runs 20
    assert result.p50_ms == pytest.approx(100 + 10 + 0.5 + 200 + 20)
    s0_billed = math.ceil(10 + 0.5 + 200 + 20) + 100  # own and wait, rounded, plus its INIT
    assert result.usd == pytest.approx(usd(1024, s0_billed) + usd(1024, 20 + 200), rel=1e-12)
    assert [f.cold_starts for f in result.functions] == [1, 1]
    assert result.cold_share == 1.0


def test_an_instance_idle_past_the_keep_alive_is_reaped_and_the_next_request_starts_cold():
    gone = sim(TWO, [0.0, 700.0], rules=replace(KEEP, keep_alive_s=600.0))
    kept = sim(TWO, [0.0, 700.0], rules=replace(KEEP, keep_alive_s=800.0))
    assert [f.cold_starts for f in gone.functions] == [1, 1]
    assert gone.p50_ms == pytest.approx((30.5 + 330.5) / 2) and gone.cold_share == 0.5
    assert [f.cold_starts for f in kept.functions] == [0, 0] and kept.p99_ms == 30.5


def test_one_request_per_lambda_instance_so_overlapping_requests_start_another():
    result = sim((fn("s0", 10.0),), [0.0, 0.001, 0.002])
    (s0,) = result.functions
    assert (s0.cold_starts, s0.instances) == (2, 3)
    # the two later requests each met a 100 ms start
    assert result.p99_ms == pytest.approx(110.0, abs=0.1)


def test_at_the_instance_cap_requests_queue_at_a_running_instance():
    capped = replace(KEEP, max_instances=1)
    result = sim((fn("s0", 10.0),), [0.0, 0.0, 0.0], rules=capped)
    assert result.functions[0].instances == 1 and result.functions[0].cold_starts == 0
    # the second waited for the first, the third for both
    assert result.p50_ms == pytest.approx(20.0)
    assert result.p99_ms == pytest.approx(np.percentile([10, 20, 30], 99))


def test_openfaas_bills_the_replicas_it_reserves_busy_or_idle():
    rules = PoolRules(keep_alive_s=None, min_instances=1, max_instances=5, concurrency=4, source="")
    one = (fn("s0", 10.0, memory_mb=512),)
    result = sim(one, np.arange(0, 100, 10.0), platform=OPENFAAS, chain="http", rules=rules)
    span = 90.0 + 0.010  # the last answer
    assert result.span_s == pytest.approx(span)
    assert result.usd == pytest.approx(0.5 * span * GB_S, rel=1e-9)
    assert result.cost_per_1m_usd == pytest.approx(0.5 * span * GB_S / 10 * 1e6, rel=1e-5)


SCALED = PoolRules(
    keep_alive_s=None,
    min_instances=1,
    max_instances=20,
    concurrency=1,
    source="t",
    scale_every_s=10.0,
    target_load=0.9,
)


def test_an_autoscaled_pool_starts_replicas_only_when_it_looks_and_requests_queue_meanwhile():
    # 3 requests of 1 s at once, one replica: they queue (answered at 1, 2 and 3 s), and the
    # load over the first 10 s, queued ones included (3 + 2 + 1 request-seconds: 0.6 in flight),
    # calls for 1 replica at 0.9 each: none is started
    result = sim((fn("s0", 1000.0),), [0.0] * 3, platform=OPENFAAS, chain="http", rules=SCALED)
    (s0,) = result.functions
    assert (s0.cold_starts, s0.instances) == (0, 1)
    assert result.p99_ms == pytest.approx(np.percentile([1000, 2000, 3000], 99))
    # a fourth makes it 10 request-seconds, 1.0 in flight: a second replica starts at 10 s
    result = sim((fn("s0", 1000.0),), [0.0] * 4, platform=OPENFAAS, chain="http", rules=SCALED)
    assert (result.functions[0].cold_starts, result.functions[0].instances) == (1, 2)


def test_an_autoscaled_pool_scales_out_to_the_mean_load_then_back_in():
    # 2 s of work every 2 s for 50 s: exactly 1 in flight, ceil(1 / 0.9) = 2 replicas from the
    # first look (10 s); then one request every 20 s: the look at 60 s sees no load over 50-60 s
    # and stops the second replica
    times = np.concatenate([np.arange(0, 50, 2.0), np.arange(65, 165, 20.0)])
    result = sim((fn("s0", 2000.0),), times, platform=OPENFAAS, chain="http", rules=SCALED)
    (s0,) = result.functions
    assert (s0.cold_starts, s0.instances) == (1, 2)
    assert result.span_s == pytest.approx(147.0)
    assert s0.instance_s == pytest.approx(147.0 + (60.0 - 10.0))


def test_the_planners_replicas_are_the_simulated_autoscalers():
    from mopar.bill import bill_plan
    from mopar.sim.model import pool_rules
    from mopar.traffic import Traffic as PlannedTraffic

    platform = replace(OPENFAAS, scale_every_s=10.0, target_load=0.9)
    assert pool_rules(platform).scale_every_s == 10.0
    plan = chain_plan((Function(name="s0", memory_mb=512, time_ms=250.0, layers=("a",)),))
    for rate in (0.5, 20.0):  # 0.125 in flight (the minimum, 1 replica), then 5 (6 replicas)
        planned = bill_plan(plan, replace(platform, traffic=PlannedTraffic(rate_rps=rate)), "http")
        times = arrivals(Traffic(rate=rate, duration_s=4000 / rate), seed=1)
        got = simulate(
            (fn("s0", 250.0, memory_mb=512),),
            platform,
            times,
            SimConfig(rules=pool_rules(platform), chain="http", initial_instances=1),
        )
        assert got.usd / got.requests == pytest.approx(planned.usd, rel=0.15)


def test_a_function_on_fewer_vcpus_runs_slower_by_the_cpu_share_model():
    assert cpu_factor(1.0, 0.5, 0.5) == pytest.approx(2.0)  # below 1 vCPU: all of it slows
    assert cpu_factor(1.0, 2.0, 0.5) == pytest.approx(0.75)  # above: the parallel half speeds up
    assert cpu_factor(2.0, 2.0, 0.3) == 1.0
    result = sim((fn("s0", 10.0, memory_mb=512),), [0.0])  # 0.5 vCPU on this platform
    assert result.p50_ms == pytest.approx(20.0)
    with pytest.raises(OptionError, match="parallel-share"):
        cpu_factor(1.0, 1.0, 1.5)


def test_on_one_shared_machine_requests_queue_for_its_cores():
    one = (fn("s0", 10.0),)
    # measured with 1 vCPU; 1 core shared: three overlapping requests run one after the other
    result = sim(one, [0.0, 0.0, 0.0], host_cores=1, measured_vcpus=1.0, initial_instances=3)
    assert result.p50_ms == pytest.approx(20.0)
    assert result.p99_ms == pytest.approx(np.percentile([10, 20, 30], 99))


def test_a_called_function_is_waited_for_inside_its_callers_own_time():
    shard = replace(fn("s0.p0", 5.0), called=True, caller="s0")
    result = sim((fn("s0", 10.0), shard), [0.0], chain="event")
    s0, p0 = result.functions
    assert s0.p50_ms == 15.0 and p0.p50_ms == 5.0 and result.p50_ms == 15.0
    assert result.usd == pytest.approx(usd(1024, 15) + usd(1024, 5), rel=1e-12)


def test_the_same_seed_gives_the_same_figures_and_another_seed_other_times():
    spread = tuple(
        replace(f, service=replace(f.service, sigma=0.5)) for f in TWO
    )  # log-normal times
    times = np.fromiter(poisson_arrivals(5.0, 60.0, 0), dtype=float)
    a, b = sim(spread, times), sim(spread, times)
    c = sim(spread, times, seed=1)
    assert a == b
    assert a.p95_ms != c.p95_ms


def test_a_chain_mode_of_another_platform_is_refused_in_one_line():
    with pytest.raises(OptionError, match="not a chain mode of lambda; choose one of invoke"):
        sim(TWO, [0.0], chain="http")


# --- traffic ---------------------------------------------------------------------------------------


def test_poisson_traffic_is_the_runners_open_loop_for_the_same_seed():
    got = arrivals(Traffic(rate=10.0, duration_s=5.0), seed=3)
    assert got.tolist() == list(poisson_arrivals(10.0, 5.0, 3))


def test_bursty_traffic_arrives_only_in_its_on_windows_at_the_mean_rate():
    t = arrivals(Traffic(shape="bursty", rate=2.0, duration_s=3000.0, on_s=30.0, off_s=270.0))
    assert np.all(np.mod(t, 300.0) < 30.0)
    assert len(t) / 3000.0 == pytest.approx(2.0, rel=0.1)


def test_diurnal_traffic_follows_its_sine():
    t = arrivals(Traffic(shape="diurnal", rate=10.0, duration_s=1000.0, period_s=1000.0))
    rising, falling = np.sum(t < 500), np.sum(t >= 500)
    assert rising > 2 * falling  # amplitude 0.8: 1.8x vs 0.2x the rate at the peaks
    assert len(t) / 1000.0 == pytest.approx(10.0, rel=0.1)


def test_a_trace_file_is_shifted_to_zero_and_sorted(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("# arrivals\n105.5\n100\n\n101.25  # a comment\n")
    assert read_trace(path) == (0.0, 1.25, 5.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1\nsoon\n", "line 2 is 'soon', not a number of seconds"),
        ("1\n", "holds 1 time"),
        ("1\nnan\n", "line 2"),
    ],
)
def test_a_bad_trace_file_is_one_line_naming_the_fix(tmp_path, text, message):
    path = tmp_path / "t.txt"
    path.write_text(text)
    with pytest.raises(OptionError, match=message) as err:
        read_trace(path)
    assert "\n" not in str(err.value) and "one arrival time in seconds per line" in str(err.value)


# --- from a bundle's plan.json ---------------------------------------------------------------------


def _document(**fields) -> BundleDocument:
    plan = chain_plan(
        (
            Function(name="s0", memory_mb=1024, time_ms=7.0, param_bytes=10 << 20),
            Function(name="s1", memory_mb=2048, time_ms=9.0),
        ),
        target="lambda",
    )
    return BundleDocument(plan=plan.to_dict(), **fields)


def test_functions_from_a_plan_take_its_predicted_times_at_the_platforms_cpu():
    platform = replace(LAMBDA, init_base_ms=300.0, init_ms_per_mb=1.2)
    s0, s1 = functions_of(_document(), platform, spread=0.0)
    assert (s0.service.median_ms, s0.service.vcpus, s1.service.vcpus) == (7.0, 1.0, 2.0)
    assert s0.init_ms == pytest.approx(300 + 12.0) and s1.init_ms == 300.0
    assert "predicted" in s0.service.source


def test_functions_take_measured_samples_and_starts_from_a_run_profile():
    profile = {
        "s0": SliceStats(
            name="s0",
            peak_rss_mb=1,
            allocated_mb=1024,
            p50_ms=2.0,
            p95_ms=4.0,
            load_ms=1,
            cold_start_ms=250.0,
            samples_ms=(1.0, 2.0, 3.0),
        ),
        "s1": SliceStats(
            name="s1", peak_rss_mb=1, allocated_mb=2048, p50_ms=2.0, p95_ms=4.0, load_ms=1
        ),
    }
    s0, s1 = functions_of(_document(), LAMBDA, profile=profile, measured_vcpus=2)
    assert s0.service.samples_ms == (1.0, 2.0, 3.0) and s0.init_ms == 250.0
    assert s1.service.median_ms == 2.0
    assert s1.service.sigma == pytest.approx(math.log(2.0) / 1.6448536269514722)
    assert s0.service.vcpus == 2


def test_a_profile_of_another_bundle_is_refused():
    from mopar.errors import BundleError

    other = {
        "x0": SliceStats(name="x0", peak_rss_mb=1, allocated_mb=1, p50_ms=1, p95_ms=1, load_ms=1)
    }
    with pytest.raises(BundleError, match="has no function s0 of this bundle"):
        functions_of(_document(), LAMBDA, profile=other)


# --- the bill of a local run -----------------------------------------------------------------------


def _report(served) -> RunReport:
    slices = tuple(
        SliceStats(
            name=n, peak_rss_mb=1, allocated_mb=1024, p50_ms=1, p95_ms=1, load_ms=1, instance_s=s
        )
        for n, s in (("s0", 10.0), ("s1", 4.0))
    )
    return RunReport(
        slices=slices,
        latency_p50_ms=1,
        latency_p95_ms=1,
        requests=len(served),
        errors=0,
        comparison=None,
        served=tuple(served),
    )


def test_a_runs_bill_on_lambda_bills_each_callers_wait_until_the_answer_and_its_starts():
    trace = Served(  # invoke: s0 waited from its answer (12 ms) to the request's (40 ms)
        arrival_s=0.0,
        latency_ms=40.0,
        invocations=(
            Span(function="s0", own_ms=10.0, wait_ms=28.0, init_ms=300.0),
            Span(function="s1", own_ms=20.0),
        ),
    )
    bill = bill_run(_report([trace, trace]), _document(), LAMBDA, "invoke")
    s0 = invocation_usd(
        LAMBDA,
        "invoke",
        Invocation(function="s0", memory_mb=1024, own_ms=10.0, wait_ms=28.0, init_ms=300.0),
    )
    assert s0 == usd(1024, 38 + 300)
    assert bill.usd == pytest.approx(2 * (s0 + usd(1024, 20)), rel=1e-12)
    assert bill.cost_per_1m_usd == pytest.approx((s0 + usd(1024, 20)) * 1e6, rel=1e-5)
    assert set(bill.functions) == {"s0", "s1"} and bill.requests == 2
    assert "waits" in bill.includes


def test_a_runs_bill_on_openfaas_is_the_instance_seconds_it_reserved():
    trace = Served(arrival_s=0.0, latency_ms=5.0, invocations=(Span(function="s0", own_ms=2),))
    bill = bill_run(_report([trace] * 4), _document(), OPENFAAS, "http")
    assert bill.usd == pytest.approx((10.0 + 4.0) * GB_S, rel=1e-12)  # 1 GB each
    assert "instance-seconds" in bill.includes


# --- the CLI, in process ---------------------------------------------------------------------------


def test_simulate_prints_per_function_and_total_figures_as_json(skipnet_bundle):
    result = CliRunner().invoke(
        cli, ["simulate", str(skipnet_bundle), "--rate", "5", "--duration", "120", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data["latency_ms"]) == {"p50", "p95", "p99"}
    assert data["cost_per_1m_usd"] > 0 and data["requests"] > 400
    assert [f["name"] for f in data["functions"]] == ["s0", "s1", "s2"]
    assert sum(f["cost_per_1m_usd"] for f in data["functions"]) == pytest.approx(
        data["cost_per_1m_usd"], rel=1e-4
    )
    assert data["target"] == read_document(skipnet_bundle).plan["target"]
    assert any("service times" in n for n in data["notes"])


def test_simulate_prints_a_table_within_80_columns(skipnet_bundle, monkeypatch):
    from rich.console import Console

    from mopar.cli import simulate as command

    monkeypatch.setattr(command, "stdout", Console(width=80, force_terminal=False))
    result = CliRunner().invoke(
        cli,
        ["simulate", str(skipnet_bundle), "--target", "lambda", "--rate", "2", "--requests", "500"],
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any(line.lstrip("│ ").startswith("end to end") for line in lines)
    assert any("chain mode invoke" in line for line in lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give one of --rate RPS and --trace FILE"),
        (["--rate", "1", "--trace", "x"], "give one of --rate RPS and --trace FILE"),
        (["--rate", "1e5", "--duration", "10"], "shorten --duration"),
        (["--rate", "1", "--chain", "http", "--target", "lambda"], "not a chain mode of lambda"),
        (["--rate", "1", "--target", "gcp"], "unknown --target 'gcp'"),
        (["--trace", "/nonexistent/t.txt"], "cannot be read"),
        (["--rate", "1", "--profile", "/nonexistent/r.json"], "cannot be read as JSON"),
        (["--rate", "1", "--keep-alive-s", "5", "--no-keep-alive-limit"], "contradict"),
    ],
)
def test_simulate_refuses_bad_options_in_one_line(skipnet_bundle, args, message):
    result = CliRunner().invoke(cli, ["simulate", str(skipnet_bundle), *args])
    assert result.exit_code == 1
    assert message in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_the_validation_table_has_the_ratios_of_simulated_to_measured():
    from benchmarks.sim_validate import Row, markdown

    row = Row(
        bundle="b",
        target="lambda",
        rate_rps=4.0,
        requests=120,
        run_usd_per_m=2.0,
        sim_usd_per_m=2.2,
        run_p95_ms=100.0,
        sim_p95_ms=90.0,
        run_cold_starts=3,
        sim_cold_starts=2,
    )
    assert row.ratio("usd_per_m") == pytest.approx(1.1) and row.ratio("p95_ms") == 0.9
    assert markdown([row]).splitlines()[-1] == (
        "| b | lambda | 4 | 120 | 2 | 1.10 | - | 100.0 | 0.90 | - | 3 / 2 / 0 | 0 |"
    )


def test_simulate_serves_exactly_the_requests_of_a_trace_file(skipnet_bundle, tmp_path):
    trace = tmp_path / "arrivals.txt"
    trace.write_text("\n".join(str(1000 + 0.5 * k) for k in range(40)))
    args = ["simulate", str(skipnet_bundle), "--trace", str(trace), "--target", "lambda"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["requests"] == 40 and data["chain"] == "invoke"
    assert all(f["invocations"] == 40 for f in data["functions"])
    assert json.loads(CliRunner().invoke(cli, [*args, "--json"]).output) == data  # seeded


def test_occupancy_times_each_warm_call_from_the_answer_before_it():
    from benchmarks.sim_validate import occupancy

    served = [
        Served(
            arrival_s=0.0,
            latency_ms=40.0,
            invocations=(Span(function="s0", own_ms=10.0), Span(function="s1", own_ms=20.0)),
            answered_ms=(12.0, 39.0),
        ),
        Served(  # s0 met a start: its call is left out, s1's still counts
            arrival_s=1.0,
            latency_ms=400.0,
            invocations=(
                Span(function="s0", own_ms=10.0, init_ms=300.0),
                Span(function="s1", own_ms=20.0),
            ),
            answered_ms=(350.0, 380.0),
        ),
    ]
    got = occupancy(_report(served))
    assert got["s0"].samples_ms == (12.0,) and got["s1"].samples_ms == (27.0, 30.0)

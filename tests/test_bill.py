"""The bill as the platforms bill it (`mopar.bill`): waits where a chain mode makes callers wait,
a request fee per invocation, orchestration charges, INIT of cold starts, rounding, minimum
memory, ephemeral storage, idle reserved replicas, and the traffic that decides cold starts."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mopar.bill import (
    CHAINS,
    Invocation,
    bill_plan,
    chain_usd,
    cold_request,
    fixed_usd_per_s,
    invocation_usd,
    prewarms,
    replicas_for,
)
from mopar.config import PROFILES_DIR
from mopar.errors import OptionError, PlanError
from mopar.facts import load_platform, target_named
from mopar.plan import Function
from mopar.traffic import Traffic, load_traffic
from tests.conftest import chain_plan

LAMBDA = load_platform(PROFILES_DIR, "lambda")
OPENFAAS = load_platform(PROFILES_DIR, "openfaas")


def _gb_ms(platform, chain, memory_mb, own_ms, wait_ms=0.0) -> float:
    """An invocation's duration charge, in GB-ms (the fee left out)."""
    inv = Invocation(function="f", memory_mb=memory_mb, own_ms=own_ms, wait_ms=wait_ms)
    usd = invocation_usd(platform, chain, inv) - platform.usd_per_request
    return usd / platform.usd_per_gb_s * 1e3 * 1024


def test_the_issue_worked_example_waits_bring_a_3_slice_resnet50_to_0_98x_unsplit():
    # make demo's plan: own times 29.9, 40.7 and 13.2 ms at 128, 176 and 240 MB; unsplit 288 MB
    # x 83.0 ms. In the invoke chain each slice also waits for the rest of the chain.
    own = [(128, 29.9), (176, 40.7), (240, 13.2)]
    rest = [sum(t for _, t in own[k + 1 :]) for k in range(3)]
    unsplit = _gb_ms(LAMBDA, "invoke", 288, 83.0)
    waited = sum(_gb_ms(LAMBDA, "invoke", mb, t, w) for (mb, t), w in zip(own, rest))
    alone = sum(_gb_ms(LAMBDA, "event", mb, t, w) for (mb, t), w in zip(own, rest))
    # 0.978x unrounded, as the issue has it; 0.988x with each invocation rounded up to 1 ms
    assert waited / unsplit == pytest.approx(0.988, abs=0.001)
    # 1 ms rounding: 30, 41 and 14 ms billed. (The issue's 0.65x does not follow from its own
    # figures: without waits they give 0.60x.)
    assert alone / unsplit == pytest.approx(0.603, abs=0.002)
    # and three request fees instead of one
    functions = [
        Function(name=f"s{k}", memory_mb=mb, time_ms=t, layers=(f"l{k}",))
        for k, (mb, t) in enumerate(own)
    ]
    plan = chain_plan(functions, chain="invoke")
    bill = bill_plan(plan, dataclasses.replace(LAMBDA, hop_ms=0.0))
    assert bill.fees_usd == pytest.approx(3 * LAMBDA.usd_per_request)
    assert bill.latency_ms == pytest.approx(83.8)
    assert [f.wait_ms for f in bill.functions] == pytest.approx([53.9, 13.2, 0.0])


def test_an_invocation_is_rounded_up_to_the_ms_and_billed_at_least_the_smallest_memory():
    assert _gb_ms(LAMBDA, "invoke", 100, 10.2) == pytest.approx(128 * 11)
    assert _gb_ms(LAMBDA, "invoke", 1024, 10.0) == pytest.approx(1024 * 10)


def test_init_of_a_cold_start_is_billed_only_where_the_platform_bills_it():
    inv = Invocation(function="f", memory_mb=1024, own_ms=10.0, init_ms=500.0)
    warm = dataclasses.replace(inv, init_ms=0.0)
    assert invocation_usd(LAMBDA, "invoke", inv) - invocation_usd(
        LAMBDA, "invoke", warm
    ) == pytest.approx(0.5 * LAMBDA.usd_per_gb_s)
    assert invocation_usd(OPENFAAS, "http", inv) == invocation_usd(OPENFAAS, "http", warm)


def test_ephemeral_storage_is_billed_above_the_free_512_mb():
    inv = Invocation(function="f", memory_mb=1024, own_ms=1000.0)
    more = dataclasses.replace(inv, ephemeral_mb=512 + 1024)
    assert invocation_usd(LAMBDA, "invoke", dataclasses.replace(inv, ephemeral_mb=512)) == (
        invocation_usd(LAMBDA, "invoke", inv)
    )
    extra = invocation_usd(LAMBDA, "invoke", more) - invocation_usd(LAMBDA, "invoke", inv)
    assert extra == pytest.approx(LAMBDA.ephemeral_usd_per_gb_s) and extra > 0


def test_waits_are_billed_only_in_the_modes_where_a_caller_waits():
    waiting = {name for name, c in CHAINS.items() if c.caller_waits}
    assert waiting == {"invoke", "http"}
    for chain in ("invoke", "stepfunctions", "event"):
        billed = _gb_ms(LAMBDA, chain, 1024, 10.0, wait_ms=90.0)
        assert billed == pytest.approx(1024 * (100 if chain in waiting else 10))


def test_step_functions_express_bills_a_request_and_its_duration_in_64_mb_chunks_per_100_ms():
    usd = chain_usd(LAMBDA, "stepfunctions", latency_ms=130.0)
    sfn = LAMBDA.chain("stepfunctions")
    assert sfn.usd_per_request == pytest.approx(1e-6) and sfn.memory_mb == 64
    assert usd == pytest.approx(1e-6 + 64 / 1024 * 0.2 * sfn.usd_per_gb_s)
    assert chain_usd(LAMBDA, "invoke", latency_ms=130.0) == 0.0


def test_the_event_rendezvous_bills_its_operations_and_its_hourly_minimum():
    store = LAMBDA.chain("event")
    assert store.store and store.store_usd_per_hour > 0
    # an answer of 3 KB, written once and read once
    assert chain_usd(LAMBDA, "event", latency_ms=10, answer_bytes=3000) == pytest.approx(
        6 * store.store_usd_per_kb
    )
    assert fixed_usd_per_s(LAMBDA, "event") == pytest.approx(store.store_usd_per_hour / 3600)
    # an empty answer still costs a KB written and a KB read
    assert chain_usd(LAMBDA, "event", latency_ms=5.0) == pytest.approx(2 * store.store_usd_per_kb)


def _two_slices(chain: str):
    functions = [
        Function(name="s0", memory_mb=512, time_ms=50.0, layers=("a",), param_bytes=8 << 20),
        Function(name="s1", memory_mb=256, time_ms=20.0, layers=("b",), param_bytes=1 << 20),
    ]
    return chain_plan(functions, chain=chain)


def test_the_autoscalers_replicas_keep_the_target_load_with_the_queue_they_leave():
    # 5 in flight: 6 replicas would keep 0.83 each, but leave a queue (Erlang C, M/M/6: 2.94
    # waiting) that the autoscaler counts; 7 leave 0.81 waiting: (5 + 0.81) / 7 < 0.9
    assert replicas_for(OPENFAAS, 5.0) == 7
    assert replicas_for(OPENFAAS, 0.01) == 1  # the minimum
    lam = dataclasses.replace(OPENFAAS, scale_every_s=0.0)  # a replica per request in flight
    assert replicas_for(lam, 5.0) == 5.0


def test_openfaas_bills_idle_replicas_at_a_low_rate_and_the_autoscalers_replicas_when_busy():
    plan = _two_slices("shm")
    rare = bill_plan(plan, dataclasses.replace(OPENFAAS, traffic=Traffic(rate_rps=0.01)))
    busy = bill_plan(plan, dataclasses.replace(OPENFAAS, traffic=Traffic(rate_rps=1000)))
    mc = (512 * 0.05 + 256 * 0.02) / 1024 * OPENFAAS.usd_per_gb_s
    # 50 and 20 requests in flight: the replicas that keep 0.9 in flight on each, queue included
    held = replicas_for(OPENFAAS, 50.0) * 512 + replicas_for(OPENFAAS, 20.0) * 256
    assert busy.usd == pytest.approx(held / 1024 * OPENFAAS.usd_per_gb_s / 1000)
    assert mc / 0.9 < busy.usd < 1.25 * mc
    # one replica of each kept all the time, 100 s of it per request
    reserved = (512 + 256) / 1024 * OPENFAAS.usd_per_gb_s * 100
    assert rare.usd == pytest.approx(reserved) and rare.idle_usd > 0.99 * rare.usd


def test_in_the_http_chain_a_waiting_function_holds_its_replica_and_pays_for_it_under_load():
    busy = dataclasses.replace(OPENFAAS, traffic=Traffic(rate_rps=1000), hop_ms=0.0)
    http = bill_plan(_two_slices("http"), busy)
    shm = bill_plan(_two_slices("shm"), busy)
    assert http.waits_usd > 0 and shm.waits_usd == 0
    # s0 holds a slot for its own 50 ms and s1's 20: 70 requests in flight instead of 50
    more = replicas_for(busy, 70.0) - replicas_for(busy, 50.0)
    assert more >= 20  # at least a replica per request more in flight
    assert http.usd - shm.usd == pytest.approx(more * 512 / 1024 * OPENFAAS.usd_per_gb_s / 1000)


def test_lambda_cold_starts_follow_the_traffic_and_the_keep_alive():
    plan = _two_slices("event")
    busy = bill_plan(plan, dataclasses.replace(LAMBDA, traffic=Traffic(rate_rps=10)))
    rare = bill_plan(plan, dataclasses.replace(LAMBDA, traffic=Traffic(rate_rps=1 / 3600)))
    assert busy.init_usd == pytest.approx(0.0, abs=1e-15)
    assert rare.init_usd > 0
    share = math.exp(-LAMBDA.keep_alive_s / 3600)
    assert [f.cold_share for f in rare.functions] == pytest.approx([share, share])
    given = dataclasses.replace(LAMBDA, traffic=Traffic(rate_rps=10, cold_start_rate=0.5))
    assert [f.cold_share for f in bill_plan(plan, given).functions] == [0.5, 0.5]


def test_a_traces_cold_share_counts_the_arrivals_within_the_keep_alive():
    trace = Traffic(rate_rps=1.0, arrivals_s=(0.0, 1.0, 1000.0))
    assert trace.cold_share(600.0) == pytest.approx(2 / 3)  # the first and the third
    # a function half the requests invoke: the second arrival finds it warm half the time
    assert trace.cold_share(600.0, 0.5) == pytest.approx((1 + 0.5 + 1) / 3)
    assert trace.cold_share(math.inf) == 0.0
    assert Traffic(rate_rps=1 / 600).cold_share(600.0) == pytest.approx(math.exp(-1))


def test_traffic_from_a_rate_or_a_trace_and_the_one_line_errors(tmp_path):
    assert load_traffic().source == "default" and load_traffic(rate=5).rate_rps == 5
    good = tmp_path / "arrivals.txt"
    good.write_text("# seconds\n0\n0.5\n\n2.0\n")
    traffic = load_traffic(trace=good)
    assert traffic.arrivals_s == (0.0, 0.5, 2.0) and traffic.rate_rps == pytest.approx(1.0)
    assert "arrivals.txt" in traffic.describe()
    bad = tmp_path / "bad.txt"
    bad.write_text("0\nsoon\n")
    with pytest.raises(OptionError, match=r"--trace '.*bad.txt': line 2 is 'soon', not a number"):
        load_traffic(trace=bad)
    with pytest.raises(OptionError, match="cannot be read"):
        load_traffic(trace=tmp_path / "missing.txt")
    one = tmp_path / "one.txt"
    one.write_text("3\n")
    with pytest.raises(OptionError, match="holds 1 time"):
        load_traffic(trace=one)
    with pytest.raises(OptionError, match="either --rate or --trace"):
        load_traffic(rate=1.0, trace=good)


def test_each_target_offers_its_chain_modes_from_the_facts():
    assert [c.name for c in LAMBDA.chains] == ["invoke", "stepfunctions", "event"]
    assert [c.name for c in OPENFAAS.chains] == ["http", "callback", "shm"]
    offered = target_named("lambda").chain_modes()  # the target's own modes, priced here
    assert [CHAINS[c.name] for c in LAMBDA.chains] == list(offered)
    # the frame each payload limit carries, base64-encoded in a JSON event (less 1 KB of it)
    assert LAMBDA.chain("event").payload_bytes == ((1 << 20) - 1024) * 3 // 4
    assert LAMBDA.chain("invoke").payload_bytes == ((6 << 20) - 1024) * 3 // 4
    assert OPENFAAS.chain("callback").payload_bytes == 1 << 20  # a raw body
    with pytest.raises(PlanError, match=r"--chain 'http' is not a chain mode of lambda"):
        LAMBDA.chain("http")
    # a co-located mode cuts over shm only, the others never; and only where asked for: a
    # stock OpenFaaS (Community Edition) co-locates nothing
    assert OPENFAAS.for_chain("shm") is None and "shm" not in {x.name for x in OPENFAAS.links}
    colocated = load_platform(PROFILES_DIR, "openfaas", colocate=True)
    shm = colocated.for_chain("shm")
    http = colocated.for_chain("http")
    assert shm is not None and {x.name for x in shm.links} == {"shm"}
    assert http is not None and "shm" not in {x.name for x in http.links}
    assert LAMBDA.for_chain("stepfunctions").hop_ms > LAMBDA.hop_ms


def test_a_cold_chain_bills_callers_the_inits_after_them_and_the_entry_its_warm_ups():
    platform = dataclasses.replace(LAMBDA, hop_ms=0.0)
    mb = [0, 100, 0]  # INIT 200 ms + 2.3 ms/MB: 200, 430 and 200 ms
    functions = [
        Function(
            name=f"s{k}", memory_mb=1024, time_ms=100.0, layers=(f"l{k}",), param_bytes=m << 20
        )
        for k, m in enumerate(mb)
    ]
    plan = chain_plan(functions, chain="invoke")
    init = [platform.init_ms(m << 20) for m in mb]
    assert init == pytest.approx([200.0, 430.0, 200.0])
    warm = bill_plan(plan, dataclasses.replace(platform, traffic=Traffic(cold_start_rate=0.0)))
    cold = bill_plan(plan, dataclasses.replace(platform, traffic=Traffic(cold_start_rate=1.0)))
    # warmed up as s0's INIT began, s1 is still starting when the request reaches it (at 300
    # ms, hops aside): the request waits for a new instance's 430 ms; s2 is ready by then
    hop = LAMBDA.chain("invoke").hop_ms
    assert 300 + hop < 430 + hop and 200 + hop <= 300 + 2 * hop + 100
    assert [f.wait_ms - w.wait_ms for f, w in zip(cold.functions, warm.functions)] == (
        pytest.approx([430.0, 0.0, 0.0])
    )
    # every INIT once, then the entry's one warm-up (a fee and 1 ms), of s2: s1's would still
    # be starting when the request came, so it is not sent
    per_ms = platform.usd_per_s(1024, 0.0) / 1e3
    assert cold_request(plan, platform).warmed == ("s2",) == prewarms(plan, platform)
    warm_ups = LAMBDA.usd_per_request + per_ms
    assert cold.init_usd == pytest.approx(sum(init) * per_ms + warm_ups)
    assert prewarms(plan, OPENFAAS) == ()  # replicas kept: nothing to warm

"""The plan as a graph of functions: walks, pricing, function specs and the format."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mopar.bill import cold_request
from mopar.bundle.document import Io
from mopar.emit.functions import function_specs
from mopar.errors import BundleError
from mopar.plan import (
    KINDS,
    PLAN_FORMAT_VERSION,
    REQUEST,
    RESPONSE,
    Edge,
    Function,
    Plan,
    data_edges,
)
from mopar.planner.cost import Link, Platform, cold_latency_ms, price_plan

PLATFORM = Platform(
    target="test",
    usd_per_gb_s=1e-5,
    usd_per_request=2e-7,
    billing_ms=0,
    min_mb=128,
    max_mb=10240,
    step_mb=1,
    mb_per_vcpu=0,
    max_vcpus=0,
    vcpus=1,
    links=(Link(name="http", latency_ms=1.0, mb_per_s=100.0),),
    hop_ms=2.0,
    baseline_mb=50.0,
)


def _fn(name: str, kind: str = "slice", ms: float = 10.0, mb: int = 1024, **more) -> Function:
    return Function(
        name=name,
        kind=kind,
        group=more.pop("group", name),
        memory_mb=mb,
        time_ms=ms,
        layers=more.pop("layers", (f"{name}.layer",)),
        **more,
    )


def _edge(src: str, dst: str, *tensors: str, p: float = 1.0, source: str = "always") -> Edge:
    transport = "request" if src == REQUEST else "response" if dst == RESPONSE else "http"
    return Edge(
        src=src,
        dst=dst,
        tensors=tensors,
        bytes=100 * len(tensors),
        transport=transport,
        probability=p,
        probability_source=source,
    )


def _sharded() -> Plan:
    """s0, then s1 run two ways (two sub-slices called by their join), then s2; a skip edge."""
    shard = dict(kind="shard", group="s1", parallel=2, layers=())
    return Plan(
        model="m",
        strategy="hand",
        functions=(
            _fn("s0"),
            _fn("s1.p0", ms=4.0, mb=512, **shard),
            _fn("s1.p1", ms=5.0, mb=512, **shard),
            _fn("s1", kind="join", ms=9.0, parallel=2),
            _fn("s2"),
        ),
        edges=(
            _edge(REQUEST, "s0", "x"),
            _edge("s0", "s1.p0", "a"),
            _edge("s0", "s1.p1", "a"),
            _edge("s1.p0", "s1", "b:p0"),
            _edge("s1.p1", "s1", "b:p1"),
            _edge("s1", "s2", "c"),
            _edge("s0", "s2", "a"),
            _edge("s2", RESPONSE, "y"),
        ),
    )


def test_a_chain_is_a_path_with_no_calls_and_prices_as_the_sum_with_hops():
    plan = Plan(
        model="m",
        strategy="hand",
        functions=(_fn("s0"), _fn("s1", ms=20.0)),
        edges=(_edge(REQUEST, "s0", "x"), _edge("s0", "s1", "t"), _edge("s1", RESPONSE, "y")),
    )
    assert [f.name for f in plan.path()] == ["s0", "s1"]
    assert plan.callees("s1") == () and plan.handoff("s0") == "http"
    price = price_plan(plan, PLATFORM)
    assert price.latency_ms == pytest.approx(10 + 20 + 2.0)
    assert price.cost_usd == pytest.approx(
        PLATFORM.cost_usd(1024, 10) + PLATFORM.cost_usd(1024, 20)
    )


def test_called_functions_hang_off_their_caller_and_are_billed_but_not_on_the_path():
    plan = _sharded()
    assert [f.name for f in plan.path()] == ["s0", "s1", "s2"]
    assert [f.name for f in plan.callees("s1")] == ["s1.p0", "s1.p1"]
    assert plan.caller("s1.p1").name == "s1"
    assert [f.name for f in plan.vertical()] == ["s0", "s1", "s2"]
    price = price_plan(plan, PLATFORM)
    # the join's 9 ms include waiting for its sub-slices: they add no latency of their own
    assert price.latency_ms == pytest.approx(10 + 9 + 10 + 2 * 2.0)
    assert price.cost_usd == pytest.approx(
        sum(PLATFORM.cost_usd(f.memory_mb, f.time_ms) for f in plan.functions)
    )


def test_cost_weights_each_function_by_the_share_of_requests_that_reach_it():
    plan = _sharded()
    edges = tuple(
        e
        if e.dst != "s1.p1"
        else Edge(**{**e.__dict__, "probability": 0.25, "probability_source": "assumed"})
        for e in plan.edges
    )
    rare = Plan(**{**plan.__dict__, "edges": edges})
    assert rare.invocation_probability("s1.p1") == 0.25
    saved = price_plan(plan, PLATFORM).cost_usd - price_plan(rare, PLATFORM).cost_usd
    assert saved == pytest.approx(0.75 * PLATFORM.cost_usd(512, 5.0))


def test_data_edges_follow_every_tensor_from_its_maker_to_each_reader():
    edges = data_edges(
        [("s0", ["x"], ["a"]), ("s1", ["a"], ["b"]), ("s2", ["a", "b"], ["y"])],
        model_inputs=["x"],
        model_outputs=["y"],
        nbytes={"x": 1, "a": 2, "b": 4, "y": 8},
        transport={"s0": "shm", "s1": "redis"},
        codecs={"a": "fp16"},
    )
    got = {(e.src, e.dst): (e.tensors, e.bytes, e.transport, dict(e.codecs)) for e in edges}
    assert got == {
        (REQUEST, "s0"): (("x",), 1, "request", {}),
        ("s0", "s1"): (("a",), 2, "shm", {"a": "fp16"}),
        ("s0", "s2"): (("a",), 2, "shm", {"a": "fp16"}),
        ("s1", "s2"): (("b",), 4, "redis", {}),
        ("s2", RESPONSE): (("y",), 8, "response", {}),
    }
    with pytest.raises(BundleError, match="reads 'z', which nothing before it makes"):
        data_edges(
            [("s0", ["z"], ["y"])], model_inputs=["x"], model_outputs=["y"], nbytes={}, transport={}
        )


def test_function_specs_come_from_the_graph_callers_call_and_called_ones_answer():
    plan = _sharded()
    t = lambda name: {"name": name, "shape": [1], "dtype": "float32", "nbytes": 4}  # noqa: E731
    io = {
        "inputs": [t("x")],
        "outputs": [{"name": "out", "value": "y", "shape": [1], "dtype": "float32"}],
        "functions": [
            {"name": "s0", "inputs": [t("x")], "outputs": [t("a")]},
            {"name": "s1.p0", "inputs": [t("a")], "outputs": [t("b:p0")]},
            {"name": "s1.p1", "inputs": [t("a")], "outputs": [t("b:p1")]},
            {"name": "s1", "inputs": [t("b:p0"), t("b:p1")], "outputs": [t("c")]},
            {"name": "s2", "inputs": [t("c"), t("a")], "outputs": [t("y")]},
        ],
    }
    specs = {s.slice: s for s in function_specs(plan, Io.from_dict(io))}
    join = specs["s1"]
    assert [c.slice for c in join.calls] == ["s1.p0", "s1.p1"] and not join.answers
    assert all(c.answers and not c.last and c.transport is None for c in join.calls)
    assert [r.name for r in join.receives] == ["a"]  # for its sub-slices, and carried to s2
    assert list(join.sends) == ["a", "c"]
    assert specs["s2"].last and specs["s2"].returns == {"y": "out"}
    assert [s.index for s in specs.values()] == [0, 1, 1, 1, 2]


def test_plan_round_trips_and_older_formats_and_unknown_kinds_are_refused():
    plan = _sharded()
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    old = {**plan.to_dict(), "format_version": 2}
    with pytest.raises(BundleError) as info:
        Plan.from_dict(old)
    assert str(info.value) == (
        f"plan format version 2 is not supported (expected "
        f"{PLAN_FORMAT_VERSION}); recompile the bundle with this mopar"
    )
    data = plan.to_dict()
    data["functions"][0]["kind"] = "wizard"
    with pytest.raises(BundleError, match="unknown function kind 'wizard'.*recompile"):
        Plan.from_dict(data)


def test_every_kind_is_defined_once_with_a_label():
    assert set(KINDS) == {"slice", "shard", "join", "dispatch", "expert"}
    assert [k.name for k in KINDS.values() if k.called] == ["shard", "expert"]
    assert [k.name for k in KINDS.values() if k.fed_by_caller] == ["expert"]


def test_a_cold_request_waits_only_for_inits_its_warm_ups_did_not_finish():
    cold = replace(PLATFORM, init_base_ms=100.0, init_ms_per_mb=2.0)
    mb = {"s0": 10, "s1.p0": 40, "s1.p1": 30, "s1": 0, "s2": 20}  # INIT 120, 180, 160, 100, 140
    plan = _sharded()
    plan = replace(
        plan, functions=tuple(replace(f, param_bytes=mb[f.name] << 20) for f in plan.functions)
    )
    assert [f.name for f in plan.warmed_with_entry()] == ["s1.p0", "s1.p1", "s1", "s2"]
    warm = price_plan(plan, cold).latency_ms
    # the entry warms up the rest as its INIT (120) begins, each a hop (2 ms) later: s1 is ready
    # when the request reaches it (132), its shards are not (134 < 182 and 162), so each is
    # busy and the request waits for a new instance's INIT, the larger 180; s2 is ready
    got = cold_request(plan, cold)
    assert got.delays_ms == {"s0": 120, "s1": 0, "s1.p0": 180, "s1.p1": 160, "s2": 0}
    assert got.warmed == ("s1", "s2")  # the shards' warm-ups would come too late: not sent
    assert cold_latency_ms(plan, cold, together=True) == pytest.approx(warm + 120 + 180)
    # a slower entry (300 ms) leaves every warm-up time to finish: only its own INIT is waited
    slow = replace(plan, functions=(replace(plan.functions[0], time_ms=300.0), *plan.functions[1:]))
    assert cold_request(slow, cold).extra_ms == 120
    assert cold_request(slow, cold).warmed == ("s1", "s1.p0", "s1.p1", "s2")  # as reached
    # in turn: s0, then s1 and the larger of its two callees, then s2
    in_turn = (100 + 20) + (100 + 0) + (100 + 80) + (100 + 40)
    assert cold_latency_ms(plan, cold, together=False) == pytest.approx(warm + in_turn)
    # where callers wait, each is billed its share of the INITs after it
    assert cold_request(plan, cold).after(plan) == {"s0": 180, "s1": 180, "s2": 0}

"""CPU as a resource of every OpenFaaS function: its facts (profiles/platforms.json's
``usd_per_vcpu_s`` and ``cpu.grid``), checked in one line; a replica billed at its requested
vCPUs and memory, busy or idle; the simulator running and billing each replica at its CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from mopar.bill import Replica, bill_plan, replica_usd
from mopar.config import PROFILES_DIR
from mopar.errors import PlanError
from mopar.facts import load_facts, load_platform
from mopar.plan import Function
from mopar.sim import PoolRules, SimConfig, SimFunction, simulate
from mopar.sim.model import ServiceTimes
from tests.conftest import SKIPNET_INPUT, chain_plan, mopar

OPENFAAS = load_platform(PROFILES_DIR, "openfaas")


def _profiles(tmp_path, **openfaas):
    platforms = json.loads((PROFILES_DIR / "platforms.json").read_text())
    for key, value in openfaas.items():
        if value is None:
            platforms["openfaas"].pop(key)
        else:
            platforms["openfaas"][key] = value
    (tmp_path / "platforms.json").write_text(json.dumps(platforms))
    return tmp_path


def test_the_shipped_node_is_split_into_a_vcpu_and_a_gb_price_that_add_up_to_it():
    assert OPENFAAS.cpu_grid == (0.1, 0.25, 0.5, 1.0, 2.0, 3.0)
    node_per_hour = (4 * OPENFAAS.usd_per_vcpu_s + 16 * OPENFAAS.usd_per_gb_s) * 3600
    assert node_per_hour == pytest.approx(0.192, rel=1e-4)  # an m6i.xlarge on demand
    # OpenCost's default ratio of a vCPU-hour to a GB-hour
    assert OPENFAAS.usd_per_vcpu_s / OPENFAAS.usd_per_gb_s == pytest.approx(
        0.031611 / 0.004237, rel=1e-5
    )


def test_a_replica_is_billed_for_its_cpu_and_memory_for_as_long_as_it_exists():
    r = Replica(function="s0", memory_mb=1024, vcpus=0.5, seconds=3600)
    hour = OPENFAAS.usd_per_gb_s * 3600 + 0.5 * OPENFAAS.usd_per_vcpu_s * 3600
    assert replica_usd(OPENFAAS, r) == pytest.approx(hour)
    assert replica_usd(OPENFAAS, replace(r, vcpus=2.0)) > 3 * replica_usd(OPENFAAS, r)


def test_an_idle_replicas_cpu_is_in_the_plans_bill():
    def plan(vcpus):
        return chain_plan(
            [Function(name="s0", layers=("l0",), memory_mb=256, time_ms=10.0, vcpus=vcpus)],
            target="openfaas",
        )

    small, large = bill_plan(plan(0.1), OPENFAAS), bill_plan(plan(2.0), OPENFAAS)
    rate = OPENFAAS.traffic.rate_rps  # 1 request/s: the one replica is idle 99% of the time
    held = OPENFAAS.usd_per_s(256, 2.0) / rate
    assert large.usd == pytest.approx(held, rel=1e-6)
    assert large.idle_usd > 0.95 * large.usd and small.usd < large.usd / 10


def test_the_simulator_runs_each_replica_at_its_cpu_and_bills_it():
    rules = PoolRules(
        keep_alive_s=600.0, min_instances=1, max_instances=5, concurrency=1, source="t"
    )

    def run(vcpus):
        f = SimFunction(
            name="s0",
            memory_mb=512,
            vcpus=vcpus,
            init_ms=0.0,
            init_source="t",
            service=ServiceTimes(median_ms=40.0, vcpus=1.0, source="t"),
        )
        config = SimConfig(rules=rules, chain="http", parallel_share=0.0)
        return simulate((f,), OPENFAAS, np.arange(100) * 1.0, config)  # one a second

    half, one = run(0.5), run(1.0)
    assert half.p50_ms == pytest.approx(2 * one.p50_ms, rel=1e-6)  # a serial function
    # one replica all along, busy or idle: billed at its CPU and memory over the span
    span_h = 99.08 / 3600
    for result, vcpus in ((half, 0.5), (one, 1.0)):
        usd = OPENFAAS.usd_per_s(512, vcpus) * 3600 * span_h
        assert result.cost_per_1m_usd == pytest.approx(usd / 100 * 1e6, rel=0.01)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"cpu": {"grid": [0.5, 0]}}, "CPU share 0 in platforms.json's cpu.grid"),
        ({"cpu": {"grid": [1, 8], "node_vcpus": 4}}, "at most the node's 4"),
        ({"usd_per_vcpu_s": None}, "its node type has no price for it (usd_per_vcpu_s is None)"),
    ],
)
def test_a_cpu_grid_off_its_node_or_without_a_price_is_refused_naming_the_fix(
    tmp_path, change, says
):
    folder = _profiles(tmp_path, **change)
    with pytest.raises(PlanError, match=r".") as refused:
        load_facts(folder)
    assert says in str(refused.value)
    result = mopar("plan", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--profiles", folder)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and says in lines[0], result.stderr

"""Facts are loaded once, at the boundary: a caller may hand `mopar.partition` and
`mopar.compile` a `Platform` built in code for a provider without a profile, and nothing below
the API and the CLI opens ``profiles/``."""

from __future__ import annotations

import builtins
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import mopar
from mopar import api, pipeline
from mopar.config import PROFILES_DIR, CompileConfig
from mopar.errors import OptionError, PlanError
from mopar.facts import Link, Platform, load_facts
from tests import models

ROOT = Path(__file__).resolve().parent.parent

ACME = Platform(
    target="acme",
    usd_per_gb_s=1e-5,
    usd_per_request=0.0,
    billing_ms=0,
    min_mb=128,
    max_mb=4096,
    step_mb=64,
    mb_per_vcpu=0,
    max_vcpus=0,
    vcpus=1.0,
    links=(Link(name="http", latency_ms=1.0, mb_per_s=100.0),),
    hop_ms=2.0,
    baseline_mb=40.0,
)
"""A provider mopar has no profile for: 64 MB steps from 128 MB, one vCPU, HTTP handoffs."""


@pytest.fixture(scope="module")
def mlp() -> torch.nn.Module:
    return models.mlp()


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(1, 16, generator=torch.Generator().manual_seed(3))


# --- a Platform built in code ---------------------------------------------------------------------


def test_partition_plans_for_a_platform_built_in_code(mlp, x):
    plan = mopar.partition(mlp, (x,), platform=ACME, strategy="uniform", slices=2)
    assert plan.target == "acme"
    assert [f.memory_mb % 64 for f in plan.functions] == [0, 0]
    assert all(f.memory_mb >= 128 and f.vcpus == 1.0 for f in plan.functions)
    assert {plan.handoff(f.name) for f in plan.vertical()[:-1]} == {"http"}


def test_doubling_the_gb_s_price_doubles_the_cost(mlp, x):
    cheap = mopar.partition(mlp, (x,), platform=ACME, strategy="uniform", slices=2)
    dear = mopar.partition(
        mlp, (x,), platform=replace(ACME, usd_per_gb_s=2e-5), strategy="uniform", slices=2
    )
    assert [f.memory_mb for f in dear.functions] == [f.memory_mb for f in cheap.functions]
    assert dear.mc_gb_s == cheap.mc_gb_s
    assert dear.cost_per_1m_usd == pytest.approx(2 * cheap.cost_per_1m_usd, rel=1e-5)
    assert cheap.cost_per_1m_usd == pytest.approx(cheap.mc_gb_s * 1e-5 * 1e6, rel=1e-4)


def test_a_request_fee_is_paid_once_per_function(mlp, x):
    free = mopar.partition(mlp, (x,), platform=ACME, strategy="uniform", slices=2)
    fee = mopar.partition(
        mlp, (x,), platform=replace(ACME, usd_per_request=1e-7), strategy="uniform", slices=2
    )
    assert fee.cost_per_1m_usd == pytest.approx(free.cost_per_1m_usd + 2 * 1e-7 * 1e6, rel=1e-5)


def test_transport_restricts_a_platform_built_in_code(mlp, x):
    with pytest.raises(
        PlanError, match="transport='shm' is not available on acme; choose one of http"
    ):
        mopar.partition(mlp, (x,), platform=ACME, transport="shm")


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"platform": ACME, "target": "lambda"}, "got platform= and target='lambda'"),
        ({"platform": ACME, "arch": "arm64"}, "got platform= and arch='arm64'"),
        ({"platform": "acme"}, "platform='acme' is a str; expected mopar.facts.Platform or None"),
        ({"platform": replace(ACME, links=())}, "links is (), expected a non-empty tuple"),
        ({"platform": replace(ACME, step_mb=0)}, "step_mb is 0, expected at least 1"),
    ],
)
def test_a_bad_platform_is_an_option_error_before_the_model_loads(kwargs, says, x):
    with pytest.raises(OptionError) as info:
        mopar.partition("tests.nosuch:model", (x,), **kwargs)  # would fail to import, later
    assert says in str(info.value)


def test_compile_builds_a_bundle_for_a_platform_built_in_code(mlp, x, tmp_path):
    bundle = mopar.compile(
        mlp, (x,), out=tmp_path / "b", platform=ACME, slices=2, strategy="uniform"
    )
    doc = json.loads((bundle.path / "plan.json").read_text())
    assert doc["plan"]["target"] == "acme"
    assert [f["memory_mb"] % 64 for f in doc["plan"]["functions"]] == [0, 0]


def test_an_unknown_target_is_refused_only_when_read_from_the_profiles():
    with pytest.raises(PlanError, match="unknown --target 'acme'"):
        load_facts(target="acme")
    # the caller's platform, priced for the default traffic: it keeps idle instances (it
    # gives no keep-alive), so none starts cold; a given share replaces that
    assert load_facts(platform=ACME).platform == ACME
    given = load_facts(platform=ACME, cold_start_rate=0.01).platform
    assert given.cold_start_rate == 0.01 and given.traffic.cold_start_rate == 0.01


# --- nothing below the boundary opens profiles/ ---------------------------------------------------

BELOW = (
    "planner",
    "rewrite",
    "emit",
    "compress",
    "ir",
    "plan",
    "runtime",
    "runner",
    "codec",
    "frontend",
    "pipeline",
    "target.py",
    "targets",
)
LOADERS = re.compile(
    r"\b(load_profile|load_platform|load_facts|facts_for|load_predictors|"
    r"load_transports|PROFILES_DIR|profiles_dir)\b"
)
ALLOWED = {
    # a target's facts are by default its platforms.json entry, read by the protocol when
    # mopar.facts asks at the boundary (a target's own facts.py is given the folder)
    ("target.py", "profiles_dir"),
    ("target.py", "load_profile"),
}


def test_no_module_below_the_boundary_names_a_profile_loader():
    found = []
    for part in BELOW:
        root = ROOT / "mopar" / part
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            rel = path.relative_to(ROOT / "mopar").as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for name in LOADERS.findall(line):
                    if (rel, name) not in ALLOWED:
                        found.append(f"mopar/{rel}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def _forbid_profiles(monkeypatch) -> list[str]:
    """Make every loader, and every open() of a file in profiles/, fail; returns what tried."""
    tried: list[str] = []

    def refuse(what):
        def call(*args, **kwargs):
            tried.append(what)
            raise AssertionError(f"{what} called below the boundary")

        return call

    for module, name in (
        ("mopar.config", "load_profile"),
        ("mopar.config", "_read_json"),
        ("mopar.facts", "load_facts"),
        ("mopar.facts", "load_platform"),
        ("mopar.api", "facts_for"),
        ("mopar.profile.store", "load_predictors"),
        ("mopar.profile.calibrate", "load_transports"),
    ):
        monkeypatch.setattr(f"{module}.{name}", refuse(f"{module}.{name}"))
    real_open = io.open
    profiles = str(PROFILES_DIR.resolve())

    def guarded_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and str(Path(file).resolve()).startswith(profiles):
            tried.append(f"open({file})")
            raise AssertionError(f"{file} opened below the boundary")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    return tried


def test_the_stages_run_on_facts_loaded_once(mlp, x, tmp_path, monkeypatch):
    config = CompileConfig(slices=2, parallel=2)
    facts = api.facts_for(config)
    analysis = mopar.analyze(mlp, (x,))
    tried = _forbid_profiles(monkeypatch)
    with pytest.raises(AssertionError):  # the guard bites
        (PROFILES_DIR / "runtime.json").read_text()
    tried.clear()
    profiled = pipeline.profile(analysis, config, facts)
    plans = pipeline.plans(analysis, config, facts, profiled)
    assert plans["mopar"].target == "openfaas"
    bundle = pipeline.run(analysis, tmp_path / "b", config=config, facts=facts, force=False)
    monkeypatch.undo()
    assert tried == []
    assert bundle.max_abs_err is not None and (bundle.path / "stack.yml").is_file()
    assert not (bundle.path / "template.yaml").exists()  # the plan's target's files alone


# --- co-location: asked for, never by default ------------------------------------------------


def _chain_note(plan) -> str:
    return next(str(n) for n in plan.notes if str(n).startswith("chain mode "))


def test_an_openfaas_plan_hands_on_over_http_unless_colocation_is_asked_for(mlp, x):
    stock = mopar.partition(mlp, (x,), slices=2, strategy="uniform")
    assert stock.chain != "shm" and {e.transport for e in stock.edges} <= {
        "request",
        "http",
        "redis",
        "response",
    }
    assert "left out: shm: needs co-located functions (--colocate)" in _chain_note(stock)
    asked = mopar.partition(mlp, (x,), slices=2, strategy="uniform", colocate=True, chain="shm")
    assert asked.chain == "shm" and [e.transport for e in asked.edges][1] == "shm"
    needs = load_facts(colocate=True).platform.colocation
    assert "OpenFaaS Standard or Enterprise" in needs and "hostPath" in needs
    assert _chain_note(asked).endswith(f"are co-located (--colocate), which needs {needs}")
    # the bill follows: the http plan pays its hops' transfer and the waits they bring
    assert stock.latency_ms >= asked.latency_ms


def test_colocation_is_refused_where_the_target_cannot_give_it_naming_the_fix(mlp, x):
    with pytest.raises(PlanError) as lam:
        mopar.partition(mlp, (x,), target="lambda", colocate=True)
    assert "colocate=True asks for co-located functions, which lambda cannot give" in str(lam.value)
    with pytest.raises(PlanError) as shm:
        mopar.partition(mlp, (x,), transport="shm")
    assert "transport='shm' is not available on openfaas" in str(shm.value)
    assert "shm needs co-located functions: add colocate=True" in str(shm.value)
    assert load_facts(transport="shm", colocate=True).platform.links[0].name == "shm"


def test_an_answer_is_limited_only_where_it_comes_back_up_the_chain():
    lam, faas = (load_facts(target=t).platform for t in ("lambda", "openfaas"))
    limit = {c.name: lam.for_chain(c.name) for c in lam.chains}
    for name in ("invoke", "stepfunctions"):  # back through the invokes, or as the last state
        assert limit[name].answer_payload_bytes == limit[name].sync_payload_bytes > 0
    assert limit["event"].answer_payload_bytes == 0  # the last leaves it in the rendezvous
    assert faas.for_chain("callback").answer_payload_bytes == 0  # POSTed to the callback URL
    assert limit["invoke"].answer(5 << 20) == ("redis", limit["invoke"].handoff(5 << 20)[1])
    assert limit["invoke"].answer(4 << 20) == ("response", 0.0)
    # one left in the rendezvous is read from the store all the same: priced as a handoff
    event = limit["event"]
    assert event.answer_waits and not limit["invoke"].answer_waits
    assert event.answer(16 << 20) == ("response", event.handoff(16 << 20)[1])
    assert event.answer(16 << 20)[1] > 0

"""Plans priced for the target's CPU (`mopar.facts.Platform.time_factor`, the target's ``speed``
in platforms.json), never for the compiling machine's load; and the probe that measures a
target's speed (`tools.profiler.speed`, ``mopar profile calibrate --speed``). The probe's
arithmetic is tested on timings the test chose; the one real probe is checked for its file,
not for its figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mopar import api
from mopar.config import PROFILES_DIR, CompileConfig
from mopar.errors import PlanError
from mopar.facts import load_facts
from mopar.planner import priced
from tests.conftest import MOPAR, SKIPNET_INPUT, mopar, mopar_in_process, plan_of
from tools.profiler import speed
from tools.profiler.speed import OpTiming, derive


@pytest.fixture(scope="module")
def predictors():
    from mopar.profile.features import FEATURE_NAMES
    from mopar.profile.store import load_predictors

    return load_predictors(PROFILES_DIR, feature_names=FEATURE_NAMES)


def _op(ratio: float, name: str = "op") -> OpTiming:
    return OpTiming(name=name, family="gemm", predicted_ms=2.0, measured_ms=2.0 * ratio)


def _profiles(tmp_path, **speeds):
    """A profiles folder whose platforms.json gives each named target that ``speed`` entry."""
    platforms = json.loads((PROFILES_DIR / "platforms.json").read_text())
    for target, entry in speeds.items():
        if entry is None:
            platforms[target].pop("speed")
        else:
            platforms[target]["speed"] = entry
    (tmp_path / "platforms.json").write_text(json.dumps(platforms))
    return tmp_path


# --- the probe's arithmetic ---------------------------------------------------------------------


def test_the_factor_is_the_geometric_mean_of_measured_over_predicted():
    assert derive([_op(2.0), _op(0.5)]) == pytest.approx((1.0, 2.0))
    factor, spread = derive([_op(3.0, "a"), _op(3.0, "b"), _op(3.0, "c")])
    assert factor == pytest.approx(3.0) and spread == pytest.approx(1.0)


@pytest.mark.parametrize("timings", [[], [_op(0.0)], [replace(_op(1.0), predicted_ms=math.inf)]])
def test_no_timings_or_a_nonpositive_one_derive_no_factor(timings):
    with pytest.raises(ValueError):
        derive(timings)


def test_the_probe_covers_the_families_slices_spend_their_time_in(predictors):
    ones = dict.fromkeys(speed.probe_samples(), 1.0)
    families = {t.family for t in speed.timings(predictors, ones)}
    assert {"gemm", "conv", "attention", "batched_matmul", "layer_norm", "elementwise"} <= families
    assert "embedding" in families


def test_a_probe_twice_as_slow_as_predicted_writes_a_speed_of_two_with_each_family(predictors):
    ones = dict.fromkeys(speed.probe_samples(), 1.0)
    twice = {t.name: 2 * t.predicted_ms for t in speed.timings(predictors, ones)}
    found = speed.speed_of(predictors, twice)
    entry = found.entry()
    assert entry["time_factor"] == pytest.approx(2.0) and len(found.ops) == len(speed.PROBE)
    assert entry["measured"]["family_factors"] == pytest.approx(dict.fromkeys(found.families, 2.0))
    assert "mopar profile calibrate --speed" in entry["source"]
    assert speed.by_family(
        [replace(_op(4.0, "c"), family="conv"), _op(2.0, "a"), _op(8.0, "b")]
    ) == pytest.approx({"conv": 4.0, "gemm": 4.0})


# --- the target's speed reaches predictions and plans -------------------------------------------


def test_the_shipped_targets_state_their_speed_and_its_source():
    for target in ("openfaas", "lambda"):
        platform = load_facts(PROFILES_DIR, target=target).platform
        assert platform.time_factor == 1.0 and "predictors" in platform.time_source


def test_the_target_speed_multiplies_every_predicted_time_and_no_memory(predictors, tmp_path):
    folder = _profiles(tmp_path, openfaas={"time_factor": 0.25, "source": "given"})
    facts = load_facts(folder)
    x = np.stack(
        [speed.feature_vector(speed.feature_row(s)) for s in speed.probe_samples().values()]
    )
    assert (facts.platform.time_factor, facts.predictors.time_factor) == (0.25, 0.25)
    np.testing.assert_allclose(
        facts.predictors.predict_time_ms(x), predictors.predict_time_ms(x) * 0.25, rtol=1e-6
    )
    np.testing.assert_array_equal(
        facts.predictors.predict_memory_mb(x), predictors.predict_memory_mb(x)
    )


def test_the_plan_says_which_cpu_it_was_priced_for(tmp_path):
    folder = _profiles(tmp_path, openfaas={"time_factor": 0.5, "source": "measured on X"})
    facts = load_facts(folder)
    plan = priced(plan_of([["a"], ["b"]]), facts)
    assert plan.priced_for == {
        "target": "openfaas",
        "time_factor": 0.5,
        "source": "measured on X",
        "trained_on": facts.predictors.trained_on,
    }
    note = str(plan.notes[-1])
    assert note.startswith("priced for openfaas's CPU: predicted times x0.5 (measured on X)")
    assert priced(plan, facts).notes == plan.notes  # said once however often it is priced
    assert type(plan).from_dict(plan.to_dict()).priced_for == plan.priced_for


def test_a_plan_for_a_slower_target_predicts_it_slower(skipnet_analysis, tmp_path):
    latency = {}
    for factor in (1.0, 4.0):
        folder = tmp_path / str(factor)
        folder.mkdir()
        _profiles(folder, openfaas={"time_factor": factor, "source": "given"})
        config = CompileConfig(slices=1, profiles_dir=folder)
        facts = api.facts_for(config)
        prediction = api.predict(skipnet_analysis.layers, config, facts=facts)
        plan = api.plan_from(skipnet_analysis, config, prediction, facts=facts)
        assert plan.priced_for["time_factor"] == factor
        latency[factor] = plan.latency_ms
    assert latency[4.0] > 2 * latency[1.0]


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (None, "target 'openfaas' states no speed in "),
        ({"source": "no factor"}, "target 'openfaas' states no speed in "),
        ({"time_factor": 0}, "speed.time_factor 0 in "),
        ({"time_factor": "fast"}, "target 'openfaas' states no speed in "),
    ],
)
def test_a_target_without_a_positive_speed_is_refused_naming_the_fix(tmp_path, entry, says):
    with pytest.raises(PlanError) as refused:
        load_facts(_profiles(tmp_path, openfaas=entry))
    assert says in str(refused.value) and str(refused.value).count("platforms.json") >= 1
    assert ("mopar profile calibrate --speed openfaas" in str(refused.value)) == (
        "no speed" in says
    )


def test_a_profiles_folder_without_a_speed_fails_plan_in_one_line(tmp_path):
    folder = _profiles(tmp_path, openfaas=None)
    result = mopar("plan", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--profiles", folder)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "states no speed" in lines[0], result.stderr


def test_the_removed_calibrate_option_says_what_replaced_it():
    for flag in ("--calibrate", "--no-calibrate"):
        result = mopar("plan", "tests.models:skipnet", "--input", SKIPNET_INPUT, flag)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "error: --calibrate/--no-calibrate is removed: "
        ), lines
        assert "mopar profile calibrate --speed TARGET --out DIR" in lines[0]


# --- the same plan every time -------------------------------------------------------------------

_BURN = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass\n"


def _plan_json() -> dict:
    result = mopar(
        "plan", "tests.models:skipnet", "--input", SKIPNET_INPUT, "--rate", "100", "--json"
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow  # two cores burnt; test_the_plan_says_which_cpu_it_was_priced_for shows the price
def test_the_same_model_and_options_give_the_same_plan_beside_two_cpu_burning_processes():
    quiet = _plan_json()
    burners = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(2)]
    try:
        busy = _plan_json()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert busy == quiet
    assert quiet["priced_for"]["target"] == "openfaas"


# --- measuring a target's speed -----------------------------------------------------------------


@pytest.mark.slow  # a real probe; test_a_probe_twice_as_slow_as_predicted_... covers its arithmetic
def test_calibrate_speed_writes_the_targets_speed_and_plans_use_it(tmp_path):
    out = tmp_path / "p"
    result = subprocess.run(
        [MOPAR, "profile", "calibrate", "--speed", "lambda", "--out", out, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    said = json.loads(result.stdout)
    written = json.loads((out / "platforms.json").read_text())
    assert written["lambda"]["speed"] == {k: v for k, v in said.items() if k != "target"}
    assert (
        written["openfaas"] == json.loads((PROFILES_DIR / "platforms.json").read_text())["openfaas"]
    )
    factor = said["time_factor"]
    assert factor > 0 and len(said["measured"]["ops"]) == len(speed.PROBE)
    facts = load_facts(out, target="lambda")
    assert facts.platform.time_factor == factor and facts.predictors.time_factor == factor


def test_calibrate_speed_of_an_unknown_target_is_one_line_and_writes_nothing(tmp_path):
    result = mopar("profile", "calibrate", "--speed", "nowhere", "--out", tmp_path / "p")
    assert result.returncode == 1 and not (tmp_path / "p").exists()
    assert result.stderr.strip().splitlines() == [
        "error: --speed 'nowhere' is no target of platforms.json; choose one of lambda, openfaas"
    ]


def test_calibrate_speed_from_a_deployed_function_writes_its_measured_factor(
    skipnet_bundle, tmp_path
):
    """The bundle's entry function, served as a deployment runs it (its function server, one
    intra-op thread), measured by ``--bundle --url``: the factor is the plan's own times each
    function's median own time over its prediction, and plans with the folder use it."""
    import os

    from mopar.runner.processes import ServerProcess

    env = dict(os.environ, PORT="0", MOPAR_HOST="127.0.0.1", MOPAR_INTRA_OP="1")
    env["MOPAR_FUNCTION_DIR"] = str(skipnet_bundle / "functions" / "s0")
    server = ServerProcess([sys.executable, "-m", "mopar.runtime.server"], env, "s0", timeout_s=60)
    try:
        server.wait_ready()
        out = tmp_path / "p"
        result = mopar(
            "profile", "calibrate", "--speed", "openfaas", "--bundle", skipnet_bundle,
            "--url", server.url, "--requests", "5", "--out", out, "--json",
        )  # fmt: skip
    finally:
        server.terminate()
    assert result.returncode == 0, result.stderr
    said = json.loads(result.stdout)
    plan = json.loads((skipnet_bundle / "plan.json").read_text())["plan"]
    predicted = {f["name"]: f["time_ms"] for f in plan["functions"]}
    measured = said["measured"]["measured_ms"]
    assert list(measured) == ["s0"] and measured["s0"] > 0  # only s0 answered: no chain here
    ratio = measured["s0"] / predicted["s0"]
    assert said["time_factor"] == pytest.approx(plan["priced_for"]["time_factor"] * ratio, 1e-3)
    assert server.url in said["source"] and "5 requests" in said["source"]
    written = json.loads((out / "platforms.json").read_text())
    assert written["openfaas"]["speed"] == {k: v for k, v in said.items() if k != "target"}
    assert load_facts(out).platform.time_factor == said["time_factor"]


def test_calibrate_speed_url_without_a_bundle_is_one_line(tmp_path):
    result = mopar_in_process(
        "profile", "calibrate", "--speed", "openfaas", "--url", "http://127.0.0.1:9/",
        "--out", str(tmp_path / "p"),
    )  # fmt: skip
    assert result.returncode == 1 and not (tmp_path / "p").exists()
    assert "--bundle and --url go together" in result.stderr
